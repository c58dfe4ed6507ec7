//! A network interface that goes away between `ucp_init` (which lists it) and
//! `ucp_worker_create` (which opens it). Its own test binary: the interface it removes
//! would fail the workers other tests of the same binary start meanwhile (cargo runs test
//! binaries one at a time, and the tests of one binary on parallel threads).

mod ucx_common;

use handoff_transport::ucx::{ContextOptions, Worker};
use ucx_common::context_or_skip;

/// An interface that goes away between `ucp_init` (which lists it) and `ucp_worker_create`
/// (which opens it) fails the worker with `UCS_ERR_NO_DEVICE` (seen in CI: a partition
/// test removed its veths while another test's worker started). `Worker::open` lists the
/// interfaces again and opens a worker. Makes a veth pair with an address to remove, so it
/// needs root and `ip`; skips, saying so, without them.
#[test]
fn a_worker_opens_although_an_interface_went_away_after_the_context_listed_it() {
    use std::process::Command;
    let ip = |args: &[&str]| {
        Command::new("ip")
            .args(args)
            .output()
            .is_ok_and(|o| o.status.success())
    };
    // Unique per process, so parallel runs do not meet.
    let name = format!("hxo{}", std::process::id() % 100_000);
    let peer = format!("{name}p");
    let _ = ip(&["link", "del", &name]);
    if !ip(&["link", "add", &name, "type", "veth", "peer", "name", &peer]) {
        let why = "needs root and `ip` to make an interface and remove it";
        handoff_testkit::skip_this(handoff_testkit::Need::Netns, why);
        return;
    }
    let subnet = 200 + std::process::id() % 50;
    assert!(ip(&[
        "addr",
        "add",
        &format!("10.254.{subnet}.1/24"),
        "dev",
        &name
    ]));
    assert!(ip(&["link", "set", &name, "up"]));
    assert!(ip(&["link", "set", &peer, "up"]));
    let options = ContextOptions::default();
    if context_or_skip("interfaces", &options).is_none() {
        let _ = ip(&["link", "del", &name]);
        return;
    }
    let mut attempts = Vec::new();
    let opened = Worker::open_with(&options, |attempt| {
        attempts.push(attempt);
        if attempt == 1 {
            // After the first context listed it (it is up, with an address), before its
            // worker opens it.
            assert!(ip(&["link", "del", &name]));
        }
    });
    let _ = ip(&["link", "del", &name]);
    let (_ctx, worker) = opened.expect("a worker, the interfaces listed again");
    assert!(!worker.address().expect("its address").is_empty());
    // UCX versions that open such a worker anyway (skipping the interface) need no second
    // listing; those that fail it get one.
    assert!(matches!(attempts[..], [1] | [1, 2]), "{attempts:?}");
    eprintln!("interfaces listed {} time(s)", attempts.len());
}
