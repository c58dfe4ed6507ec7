//! Real processes on loopback: a bootstrap server, prefill and decode workers (the
//! `handoff` binary), talking over the ZMTP control plane and the TCP data plane. Each
//! test reads the processes' JSON lines; every wait has a deadline.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

mod common;
use common::gpu_with_cuda_ucx;

const T: Duration = Duration::from_secs(30);

struct Proc {
    name: String,
    child: Child,
    lines: mpsc::Receiver<String>,
    stderr: Arc<Mutex<String>>,
}

impl Proc {
    fn spawn(name: &str, args: &[&str]) -> Proc {
        Self::spawn_env(name, args, &[])
    }

    /// `spawn` with environment variables set (`Some`) or removed (`None`).
    fn spawn_env(name: &str, args: &[&str], env: &[(&str, Option<&str>)]) -> Proc {
        let mut command = Command::new(common::handoff_bin());
        command.args(args);
        for (k, v) in env {
            match v {
                Some(v) => command.env(k, v),
                None => command.env_remove(k),
            };
        }
        Self::spawn_command(name, command)
    }

    /// `handoff` run by `command` (e.g. inside a network namespace), its stdout read line
    /// by line and its stderr kept.
    fn spawn_command(name: &str, mut command: Command) -> Proc {
        if !command.get_envs().any(|(k, _)| k == "RUST_LOG") {
            // HANDOFF_TEST_LOG: the processes' filter when a failure needs more than warnings.
            let filter = std::env::var("HANDOFF_TEST_LOG").unwrap_or_else(|_| "warn".into());
            command.env("RUST_LOG", filter);
        }
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn handoff");
        let (tx, lines) = mpsc::channel();
        let out = child.stdout.take().expect("piped stdout");
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut err = child.stderr.take().expect("piped stderr");
        let sink = stderr.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = err.read(&mut buf) {
                if n == 0 {
                    return;
                }
                // A test that panics while it reads the text poisons the lock: the text
                // is still whole.
                sink.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        Proc {
            name: name.to_string(),
            child,
            lines,
            stderr,
        }
    }

    fn line(&self, deadline: Instant) -> Option<String> {
        self.lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .ok()
    }

    /// Whether the process's stderr holds `text`, waiting up to `within` for it to arrive.
    fn stderr_says(&self, text: &str, within: Duration) -> bool {
        self.stderr_says_times(text, 1, within)
    }

    /// Whether the process's stderr holds `text` at least `times` times, waiting up to
    /// `within` for them.
    fn stderr_says_times(&self, text: &str, times: usize, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        loop {
            if self.stderr.lock().unwrap().matches(text).count() >= times {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The next JSON line matching `pred`, or a panic naming the process and its stderr.
    fn expect(&self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + T;
        while let Some(line) = self.line(deadline) {
            if let Ok(v) = serde_json::from_str::<Value>(&line) {
                if pred(&v) {
                    return v;
                }
            }
        }
        panic!(
            "{}: no {what} within {T:?}; stderr:\n{}",
            self.name,
            self.stderr.lock().unwrap()
        );
    }

    /// Every `end` line until the summary; returns (ends, summary).
    fn ends(&self) -> (Vec<Value>, Value) {
        let mut ends = Vec::new();
        loop {
            let v = self.expect("end or summary", |v| {
                v["event"] == "end" || v["event"] == "summary"
            });
            if v["event"] == "summary" {
                return (ends, v);
            }
            ends.push(v);
        }
    }

    /// Waits until `n` requests said they are in `WaitingForInput` (prefill: decode's
    /// transfer info reached it).
    fn until_waiting_for_input(&self, n: usize) {
        self.until("transfer info for every request", |seen| {
            seen.iter()
                .filter(|v| v["event"] == "state" && v["state"] == "WaitingForInput")
                .count()
                == n
        });
    }

    /// Every stdout line until the process closes it (it exits), JSON or not.
    fn rest(&self) -> Vec<String> {
        let deadline = Instant::now() + T;
        let mut lines = Vec::new();
        loop {
            match self
                .lines
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                Ok(line) => lines.push(line),
                Err(mpsc::RecvTimeoutError::Disconnected) => return lines,
                Err(mpsc::RecvTimeoutError::Timeout) => panic!(
                    "{}: stdout still open after {T:?}; stderr:\n{}",
                    self.name,
                    self.stderr.lock().unwrap()
                ),
            }
        }
    }

    /// Every stdout line (JSON or not) until the JSON lines seen so far satisfy `done`.
    fn until(&self, what: &str, done: impl Fn(&[Value]) -> bool) -> Vec<String> {
        let deadline = Instant::now() + T;
        let (mut lines, mut seen) = (Vec::new(), Vec::new());
        while !done(&seen) {
            let Some(line) = self.line(deadline) else {
                panic!(
                    "{}: no {what} within {T:?}; stderr:\n{}",
                    self.name,
                    self.stderr.lock().unwrap()
                );
            };
            if let Ok(v) = serde_json::from_str::<Value>(&line) {
                seen.push(v);
            }
            lines.push(line);
        }
        lines
    }

    /// SIGTERM: a `--serve` worker stops, prints what is left and its summary, exits.
    fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM {}", self.name);
    }

    fn kill9(&mut self) {
        let _ = self.child.kill(); // SIGKILL
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    /// Kills the process; when the test failed, prints what it said on stderr (a failure's
    /// message names one process, and the cause may lie in another).
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let stderr = self.stderr.lock().unwrap_or_else(|e| e.into_inner());
            println!("--- {}'s stderr:\n{stderr}", self.name);
        }
    }
}

fn bootstrap() -> (Proc, String) {
    let p = Proc::spawn(
        "bootstrap",
        &[
            "bootstrap",
            "--listen",
            "tcp://127.0.0.1:0",
            "--expire-after",
            "3",
        ],
    );
    let line = p
        .line(Instant::now() + T)
        .expect("bootstrap server announces its address");
    let addr = line.rsplit(' ').next().expect("address").to_string();
    assert!(addr.starts_with("tcp://"), "{line}");
    (p, addr)
}

/// A worker; `extra` adds arguments. Fast heartbeats (100 ms × 3) unless `extra` sets them.
fn worker(name: &str, role: &str, engine: &str, boot: &str, extra: &[&str]) -> Proc {
    worker_env(name, role, engine, boot, extra, &[])
}

/// [`worker`] with environment variables set (`Some`) or removed (`None`).
fn worker_env(
    name: &str,
    role: &str,
    engine: &str,
    boot: &str,
    extra: &[&str],
    env: &[(&str, Option<&str>)],
) -> Proc {
    let mut args = common::worker_args(role, engine, boot);
    for [flag, value] in [["--heartbeat-ms", "100"], ["--heartbeats-missed", "3"]] {
        if !extra.contains(&flag) {
            args.extend([flag, value]);
        }
    }
    args.extend_from_slice(extra);
    let p = Proc::spawn_env(name, &args, env);
    p.expect("ready", |v| v["event"] == "ready");
    p
}

fn kinds(ends: &[Value]) -> Vec<String> {
    ends.iter()
        .map(|e| e["kind"].as_str().unwrap_or("?").to_string())
        .collect()
}

fn hands_over_across_processes(mode: &str, transport: &str) {
    hands_over_with(
        mode,
        &["--transport", transport],
        &["--transport", transport],
    );
}

/// Eight requests from prefill (`p_extra`) to decode (`d_extra`), every one verified.
fn hands_over_with(mode: &str, p_extra: &[&str], d_extra: &[&str]) {
    let (_boot, addr) = bootstrap();
    hands_over_through(&addr, mode, p_extra, d_extra);
}

/// [`hands_over_with`] through the directory at `addr` (a bootstrap server or etcd).
fn hands_over_through(addr: &str, mode: &str, p_extra: &[&str], d_extra: &[&str]) {
    let addr = addr.to_string();
    let mut p_args = vec!["--requests", "8", "--serve"];
    p_args.extend_from_slice(p_extra);
    let _p = worker("prefill", "prefill", "P", &addr, &p_args);
    let mut d_args = vec!["--requests", "8", "--prefill", "P", "--mode", mode];
    d_args.extend_from_slice(d_extra);
    let d = worker("decode", "decode", "D", &addr, &d_args);
    let (ends, summary) = d.ends();
    assert_eq!(summary["done"], 8, "{ends:?}");
    assert_eq!(summary["corrupted"], 0);
    assert!(ends.iter().all(|e| e["verified"] == true), "{ends:?}");
}

#[test]
fn requests_are_handed_over_between_processes_in_push_mode() {
    hands_over_across_processes("push", "tcp");
}

#[test]
fn requests_are_handed_over_between_processes_in_pull_mode() {
    hands_over_across_processes("pull", "tcp");
}

/// Whether libucp loads here (`HANDOFF_UCX_LIB`, else the system's); says why not.
fn ucx_available() -> bool {
    match handoff_transport::ucx::sys::api() {
        Ok(_) => true,
        Err(e) => {
            let why = format!("UCX is not available ({e}); install libucx0");
            handoff_testkit::skip_this(handoff_testkit::Need::Ucx, &why);
            false
        }
    }
}

#[test]
fn requests_are_handed_over_between_processes_over_ucx_in_push_mode() {
    if ucx_available() {
        hands_over_across_processes("push", "ucx");
    }
}

#[test]
fn requests_are_handed_over_between_processes_over_ucx_in_pull_mode() {
    if ucx_available() {
        hands_over_across_processes("pull", "ucx");
    }
}

/// Two prefill pipeline ranks, each holding half of every block (its layers), hand over
/// to a decode worker holding whole blocks: each rank writes (push) or decode reads
/// (pull) only that rank's half, and decode checks every byte of the whole blocks.
fn pipeline_halves_meet_in_decode(mode: &str, transport: &str) {
    let (_boot, addr) = bootstrap();
    let mut prefill = Vec::new();
    for pp_rank in ["0", "1"] {
        let args = [
            "--requests",
            "6",
            "--serve",
            "--transport",
            transport,
            "--pp-size",
            "2",
            "--pp-rank",
            pp_rank,
            "--block-bytes",
            "32768",
        ];
        prefill.push(worker(
            &format!("prefill-pp{pp_rank}"),
            "prefill",
            "P",
            &addr,
            &args,
        ));
    }
    let d_args = [
        "--requests",
        "6",
        "--prefill",
        "P",
        "--mode",
        mode,
        "--transport",
        transport,
        "--block-bytes",
        "65536",
    ];
    let d = worker("decode", "decode", "D", &addr, &d_args);
    all_done_and_verified(&d, 6, &format!("{mode} {transport}"));
}

#[test]
fn pipeline_ranks_each_deliver_their_layers_over_tcp() {
    pipeline_halves_meet_in_decode("push", "tcp");
    pipeline_halves_meet_in_decode("pull", "tcp");
}

/// Decode's `n` requests all ended `Done`, none corrupted, every one verified.
fn all_done_and_verified(d: &Proc, n: u64, what: &str) {
    let (ends, summary) = d.ends();
    assert_eq!(summary["done"], n, "{what}: {ends:?}");
    assert_eq!(summary["corrupted"], 0, "{what}: {ends:?}");
    assert!(
        ends.iter().all(|e| e["verified"] == true),
        "{what}: {ends:?}"
    );
}

/// TP rank `r` of `tp` of a worker whose 2 layers hold `heads` KV heads in 8-token blocks
/// of 64 bytes per head and token (this rank's share of them), named `{role}-tp{r}`.
fn head_rank(
    addr: &str,
    role: &str,
    engine: &str,
    heads: u32,
    (tp, r): (u32, u32),
    extra: &[&str],
) -> Proc {
    let (kv, size, rank) = (heads.to_string(), tp.to_string(), r.to_string());
    // 2 layers × K and V × 8 tokens × 64 bytes per head, times the heads a rank holds.
    let bytes = (heads / tp * 2 * 2 * 8 * 64).to_string();
    let mut args = vec![
        "--layers",
        "2",
        "--kv-heads",
        &kv,
        "--block-tokens",
        "8",
        "--tp-size",
        &size,
        "--tp-rank",
        &rank,
        "--block-bytes",
        &bytes,
    ];
    args.extend(extra);
    worker(&format!("{role}-tp{r}"), role, engine, addr, &args)
}

/// Heterogeneous TP across processes, 4 KV heads: prefill at TP `prefill_tp` (head-major),
/// decode at TP `decode_tp` (token-major), each rank holding its share of the heads. Fan-in
/// (2 → 1): decode gathers each block's heads from both prefill ranks; fan-out (1 → 2): the
/// prefill rank serves both decode ranks, each its half. Every decode rank checks every
/// byte against the model's.
fn tp_ranks_meet_in_decode(mode: &str, transport: &str, (prefill_tp, decode_tp): (u32, u32)) {
    let (_boot, addr) = bootstrap();
    let ranks = |role: &str, engine: &str, tp: u32, extra: &[&str]| -> Vec<Proc> {
        let mut args = vec!["--requests", "6", "--transport", transport];
        args.extend(extra);
        (0..tp)
            .map(|r| head_rank(&addr, role, engine, 4, (tp, r), &args))
            .collect()
    };
    let _prefill = ranks(
        "prefill",
        "P",
        prefill_tp,
        &["--serve", "--head-order", "hnd"],
    );
    let decode = ranks(
        "decode",
        "D",
        decode_tp,
        &["--prefill", "P", "--mode", mode, "--head-order", "nhd"],
    );
    for (r, d) in decode.iter().enumerate() {
        let what = format!("{mode} {transport} tp {prefill_tp} -> {decode_tp}, decode rank {r}");
        all_done_and_verified(d, 6, &what);
    }
}

/// Head flags that cannot describe a pool fail at start, by name: heads without layers,
/// heads that do not split the halves into whole bytes, heads a TP size cannot share.
#[test]
fn head_flags_that_describe_no_pool_are_refused_at_start() {
    for (args, says) in [
        (&["--kv-heads", "4"][..], "--kv-heads describes the layers"),
        (
            &["--layers", "2", "--kv-heads", "3", "--block-bytes", "4096"][..],
            "whole bytes",
        ),
        (
            &["--layers", "2", "--kv-heads", "4", "--tp-size", "3"][..],
            "neither divides",
        ),
    ] {
        let out = Command::new(common::handoff_bin())
            .args(["worker", "--role", "prefill", "--engine", "P"])
            .args(args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
}

/// Over UCX, whose writes decode cannot refuse, a worker that would take a peer as lost
/// only after the fence bound (long heartbeats, short request timeouts) refuses to start,
/// by name: at the bound a writer still heard is taken as done, and one stopped before its
/// last post could outlast the fence unseen. Over TCP the same flags are fine.
#[test]
fn a_loss_timeout_past_the_fence_bound_is_refused_over_ucx() {
    if !ucx_available() {
        return;
    }
    let (_boot, addr) = bootstrap();
    let slow = [
        "--heartbeat-ms",
        "10000",
        "--heartbeats-missed",
        "6",
        "--bootstrap-timeout-s",
        "1",
        "--waiting-timeout-s",
        "1",
        "--transfer-timeout-s",
        "1",
        "--pull-ttl-s",
        "1",
        "--requests",
        "0",
    ];
    for (transport, refused) in [("ucx", true), ("tcp", false)] {
        let mut args = common::worker_args("decode", "D", &addr);
        args.extend(["--transport", transport]);
        args.extend(slow);
        let out = Command::new(common::handoff_bin())
            .args(&args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(!out.status.success(), refused, "{transport}: {stderr}");
        assert_eq!(
            stderr.contains("outlast the fence unseen"),
            refused,
            "{transport}: {stderr}"
        );
    }
}

/// TP sizes where neither divides the other, across processes (6 KV heads: prefill at TP 2
/// holds 3 per rank, decode at TP 3 holds 2): every decode rank fails each of its requests
/// by name, before a byte moves; each request ends once, every block it was given is
/// released once, and the worker exits on its own. (A request that fails before the
/// worker hands it its blocks once counted twice, so a worker stopped early and gave
/// another request's blocks back at shutdown without its end.)
#[test]
fn tp_sizes_neither_dividing_the_other_are_refused_by_name_across_processes() {
    let (_boot, addr) = bootstrap();
    let rank = |role: &str, engine: &str, tp: u32, r: u32, extra: &[&str]| {
        head_rank(&addr, role, engine, 6, (tp, r), extra)
    };
    let _prefill: Vec<Proc> = (0..2)
        .map(|r| rank("prefill", "P", 2, r, &["--serve"]))
        .collect();
    let decode: Vec<Proc> = (0..3)
        .map(|r| {
            // A second wave after the first has failed: its lookups are answered at once,
            // so requests fail while the worker is still handing them their blocks.
            let wave = ["--then-prefill", "P", "--then-after-ms", "200"];
            rank(
                "decode",
                "D",
                3,
                r,
                &[&["--prefill", "P", "--requests", "2"][..], &wave].concat(),
            )
        })
        .collect();
    for (r, d) in decode.iter().enumerate() {
        let lines: Vec<Value> = d
            .rest()
            .iter()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        let what = format!("decode rank {r}: {lines:?}");
        let ends = ends_of(&lines);
        assert_eq!(ends.len(), 4, "{what}");
        for e in &ends {
            assert_eq!(e["kind"], "protocol_error", "{what}");
            let reason = e["reason"].as_str().unwrap_or_default();
            assert!(reason.contains("neither divides"), "{what}");
        }
        let summary = lines.iter().find(|v| v["event"] == "summary").expect(&what);
        assert_eq!(summary["by_kind"]["protocol_error"], 4, "{what}");
        assert_eq!(summary["failed"], 4, "{what}");
        let mut given: Vec<u64> = Vec::new();
        let mut released: Vec<u64> = Vec::new();
        for v in &lines {
            let blocks = v["blocks"].as_array().into_iter().flatten();
            let ids = blocks.filter_map(Value::as_u64);
            match v["event"].as_str() {
                Some("opened") => given.extend(ids),
                Some("released") => {
                    // `late`: handed over while the request was failing.
                    assert!(v["why"] == "failed" || v["why"] == "late", "{what}");
                    released.extend(ids)
                }
                _ => {}
            }
        }
        given.sort_unstable();
        released.sort_unstable();
        assert_eq!(given, released, "{what}");
    }
}

#[test]
fn tp2_prefill_ranks_each_deliver_their_heads_over_tcp() {
    tp_ranks_meet_in_decode("push", "tcp", (2, 1));
    tp_ranks_meet_in_decode("pull", "tcp", (2, 1));
}

#[test]
fn tp2_prefill_ranks_each_deliver_their_heads_over_ucx() {
    if ucx_available() {
        tp_ranks_meet_in_decode("push", "ucx", (2, 1));
        tp_ranks_meet_in_decode("pull", "ucx", (2, 1));
    }
}

#[test]
fn tp1_prefill_serves_each_tp2_decode_rank_its_heads_over_tcp() {
    tp_ranks_meet_in_decode("push", "tcp", (1, 2));
    tp_ranks_meet_in_decode("pull", "tcp", (1, 2));
}

#[test]
fn tp1_prefill_serves_each_tp2_decode_rank_its_heads_over_ucx() {
    if ucx_available() {
        tp_ranks_meet_in_decode("push", "ucx", (1, 2));
        tp_ranks_meet_in_decode("pull", "ucx", (1, 2));
    }
}

#[test]
fn pipeline_ranks_each_deliver_their_layers_over_ucx() {
    if ucx_available() {
        pipeline_halves_meet_in_decode("push", "ucx");
        pipeline_halves_meet_in_decode("pull", "ucx");
    }
}

/// Both KV pools in device memory on one GPU: UCX moves the blocks between the two
/// processes (`cuda_ipc`), and decode checks every block's bytes.
#[test]
fn requests_are_handed_over_between_gpu_workers_on_one_gpu() {
    let Some(()) = gpu_with_cuda_ucx() else {
        return;
    };
    // Verified same-host peers: device copies through each other's CUDA IPC handles, by
    // the side that moves the bytes (prefill writes in push mode, decode reads in pull).
    // With same-host copies off: UCX's own cuda_ipc.
    for (mode, mover) in [("push", 0), ("pull", 1)] {
        for lane in [true, false] {
            let procs = gpu_hand_over(mode, lane);
            let line = "device copies with this peer through CUDA IPC";
            // Logged before the first copy, so by now; its pipe may still be in flight.
            let said = (lane && procs[mover].stderr_says(line, Duration::from_secs(10)))
                || procs[mover].stderr.lock().unwrap().contains(line);
            let stderr = procs[mover].stderr.lock().unwrap().clone();
            assert_eq!(said, lane, "{mode}, CUDA IPC lane {lane}: {stderr}");
        }
    }
}

/// Eight verified requests between two GPU workers on device 0, same-host copies on or
/// off; returns prefill and decode, still running.
fn gpu_hand_over(mode: &str, same_host: bool) -> [Proc; 2] {
    let (_boot, addr) = bootstrap();
    let env = [
        ("RUST_LOG", Some("warn,handoff_transport::data::ucx=info")),
        (
            "HANDOFF_SAME_HOST_COPIES",
            Some(if same_host { "1" } else { "0" }),
        ),
    ];
    let gpu = ["--transport", "ucx", "--memory", "cuda"];
    let mut p_args = vec!["--requests", "8", "--serve"];
    p_args.extend_from_slice(&gpu);
    let p = worker_env("prefill", "prefill", "P", &addr, &p_args, &env);
    let mut d_args = vec!["--requests", "8", "--prefill", "P", "--mode", mode];
    d_args.extend_from_slice(&gpu);
    let d = worker_env("decode", "decode", "D", &addr, &d_args, &env);
    let (ends, summary) = d.ends();
    assert_eq!(summary["done"], 8, "{ends:?}");
    assert_eq!(summary["corrupted"], 0);
    assert!(ends.iter().all(|e| e["verified"] == true), "{ends:?}");
    [p, d]
}

/// Prefill's pool on the GPU, decode's in host memory (its UCX thread bound to the GPU).
#[test]
fn requests_are_handed_over_from_a_gpu_worker_to_a_host_worker() {
    let Some(()) = gpu_with_cuda_ucx() else {
        return;
    };
    let gpu = ["--transport", "ucx", "--memory", "cuda"];
    let host = ["--transport", "ucx", "--cuda-device", "0"];
    hands_over_with("push", &gpu, &host);
    hands_over_with("pull", &gpu, &host);
}

/// `--memory cuda` where it cannot work fails at start, saying why, and never hangs.
#[test]
fn a_gpu_worker_that_cannot_have_its_memory_says_why() {
    let out = std::process::Command::new(common::handoff_bin())
        .args([
            "worker", "--role", "prefill", "--engine", "P", "--memory", "cuda",
        ])
        .args(["--transport", "tcp"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("TCP copies through the CPU"), "{stderr}");
    let Err(reason) = handoff_gpu::probe() else {
        return; // with a GPU, the tests above cover a working device pool
    };
    let out = std::process::Command::new(common::handoff_bin())
        .args([
            "worker", "--role", "prefill", "--engine", "P", "--memory", "cuda",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains(&reason.to_string()), "{stderr}");
}

/// kill -9 of prefill mid-request: decode's requests end `Failed(peer lost)` within the
/// heartbeat window (a killed process's sockets reset, so usually at once), not at their
/// own waiting deadline (300 s here).
#[test]
fn killing_prefill_mid_request_fails_decodes_requests_with_peer_lost_promptly() {
    let (_boot, addr) = bootstrap();
    let mut p = worker(
        "prefill",
        "prefill",
        "P",
        &addr,
        &["--requests", "4", "--hold-ms", "600000", "--serve"],
    );
    let d = worker(
        "decode",
        "decode",
        "D",
        &addr,
        &["--requests", "4", "--prefill", "P"],
    );
    p.until_waiting_for_input(4);
    let t0 = Instant::now();
    p.kill9();
    let (ends, summary) = d.ends();
    let took = t0.elapsed();
    assert_eq!(summary["failed"], 4, "{ends:?}");
    assert!(kinds(&ends).iter().all(|k| k == "peer_lost"), "{ends:?}");
    assert!(
        took < Duration::from_secs(3),
        "decode noticed after {took:?}"
    );
    eprintln!("decode's 4 requests failed peer_lost {took:?} after kill -9");
}

/// Prefill frozen (SIGSTOP) past the heartbeat window while its engine still computes,
/// then resumed: decode has failed its requests `peer_lost`; prefill, on waking, hears
/// nothing from decode, takes it as lost and must fail its own requests for it at once,
/// `peer_lost`, with their blocks released, not hold them until its engine hands the
/// blocks over (10 minutes here) and then fail on a refused transfer (issue 11's liveness
/// bug: a request that had only received from a peer never learned of its loss).
fn a_resumed_prefill_fails_its_requests_for_a_lost_decode_at_once(mode: &str) {
    let (_boot, addr) = bootstrap();
    let p = worker(
        "prefill",
        "prefill",
        "P",
        &addr,
        &["--requests", "3", "--hold-ms", "600000"],
    );
    let d = worker(
        "decode",
        "decode",
        "D",
        &addr,
        &[
            "--requests",
            "3",
            "--prefill",
            "P",
            "--mode",
            mode,
            "--serve",
        ],
    );
    p.until_waiting_for_input(3);
    signal(&p, "STOP");
    // Decode stays up (it serves on), so prefill finds it alive but silent towards it.
    let d_lines = d.until("decode's requests ended", |seen| {
        seen.iter().filter(|v| v["event"] == "end").count() == 3
    });
    let d_ends = ends_of(&json_lines("decode", &d_lines));
    assert!(
        kinds(&d_ends).iter().all(|k| k == "peer_lost"),
        "{d_ends:?}"
    );
    let t0 = Instant::now();
    signal(&p, "CONT");
    let (p_ends, summary) = p.ends();
    let took = t0.elapsed();
    assert_eq!(summary["failed"], 3, "{p_ends:?}");
    assert!(
        kinds(&p_ends).iter().all(|k| k == "peer_lost"),
        "{p_ends:?}"
    );
    assert!(
        took < Duration::from_secs(10),
        "prefill failed its requests {took:?} after it resumed"
    );
    eprintln!("{mode}: the resumed prefill failed its 3 requests peer_lost in {took:?}");
}

#[test]
fn a_resumed_prefill_fails_its_requests_for_a_lost_decode_at_once_in_pull_mode() {
    a_resumed_prefill_fails_its_requests_for_a_lost_decode_at_once("pull");
}

#[test]
fn a_resumed_prefill_fails_its_requests_for_a_lost_decode_at_once_in_push_mode() {
    a_resumed_prefill_fails_its_requests_for_a_lost_decode_at_once("push");
}

/// Prefill paused (SIGSTOP) past the loss timeout, then resumed with the same incarnation:
/// decode fails the requests that depended on it, `peer_lost`, and pairs later ones with it
/// again once a dead worker's record would be gone from the server (the client's lost mark,
/// `ClientConfig::lost_kept`, 12 s): before, the mark lasted until a restart, and every new
/// request to the paused engine failed `peer_lost` at once while it ran.
#[test]
fn a_prefill_that_was_only_paused_is_paired_with_new_requests_again() {
    let (_boot, addr) = bootstrap();
    // The second waves open 20 s (prefill) and 25 s (decode) after the first: decode's
    // lookup then comes well after its mark of the loss (a moment after the stop) expired.
    let p = worker_env(
        "prefill",
        "prefill",
        "P",
        &addr,
        &[
            "--requests",
            "3",
            "--hold-ms",
            "600000",
            "--then-hold-ms",
            "0",
            "--then-after-ms",
            "20000",
            "--serve",
        ],
        &[("RUST_LOG", Some("warn,handoff_net::control=info"))],
    );
    let d = worker(
        "decode",
        "decode",
        "D",
        &addr,
        &[
            "--requests",
            "3",
            "--prefill",
            "P",
            "--then-prefill",
            "P",
            "--then-after-ms",
            "25000",
            "--waiting-timeout-s",
            "10",
        ],
    );
    p.until_waiting_for_input(3);
    signal(&p, "STOP");
    let first = d.until("the paused prefill's requests ended", |seen| {
        seen.iter().filter(|v| v["event"] == "end").count() == 3
    });
    let first = ends_of(&json_lines("decode", &first));
    assert!(kinds(&first).iter().all(|k| k == "peer_lost"), "{first:?}");
    signal(&p, "CONT");
    let (ends, summary) = d.ends();
    let second: Vec<&Value> = ends
        .iter()
        .filter(|v| v["request"].as_str().is_some_and(|r| r.contains("then")))
        .collect();
    assert_eq!(second.len(), 3, "{ends:?}");
    assert!(
        second
            .iter()
            .all(|v| v["state"] == "Done" && v["verified"] == true),
        "the resumed prefill was not paired again: {second:?}"
    );
    assert_eq!(summary["done"], 3, "{summary}");
    // Decode's dial was the first word between the two since the pause: the prefill, which
    // had lost decode too, takes that very process back (its own mark of decode expired
    // long before).
    assert!(
        p.stderr_says("answers again", T),
        "the prefill did not take decode back: {}",
        p.stderr.lock().unwrap()
    );
    eprintln!("the resumed prefill served decode's second wave: {second:?}");
}

/// The bootstrap server stops: requests already resolved finish (peers are cached); new
/// requests that need a lookup fail with a named error (the address and the last error).
#[test]
fn stopping_the_bootstrap_server_fails_new_lookups_by_name_and_running_requests_finish() {
    let (mut boot, addr) = bootstrap();
    a_lost_directory_fails_new_lookups_by_name(&addr, || boot.kill9());
}

/// Three requests resolve their prefill through the directory at `addr`; `stop` then takes
/// the directory away while they wait in prefill's hold: they finish, and three more, for
/// an engine not yet resolved, fail `bootstrap_unavailable` naming the address.
fn a_lost_directory_fails_new_lookups_by_name(addr: &str, stop: impl FnOnce()) {
    let _p = worker(
        "prefill",
        "prefill",
        "P",
        addr,
        &["--requests", "3", "--hold-ms", "1500", "--serve"],
    );
    let d = worker(
        "decode",
        "decode",
        "D",
        addr,
        &[
            "--requests",
            "3",
            "--prefill",
            "P",
            "--then-prefill",
            "P2",
            "--then-after-ms",
            "800",
        ],
    );
    // The first three have resolved P (they wait in prefill's hold).
    d.until_waiting_for_input(3);
    stop();
    let (ends, _) = d.ends();
    let (then, first): (Vec<&Value>, Vec<&Value>) = ends
        .iter()
        .partition(|e| e["request"].as_str().unwrap().contains("then"));
    assert!(
        first
            .iter()
            .all(|e| e["kind"] == "done" && e["verified"] == true),
        "{first:?}"
    );
    assert_eq!(then.len(), 3);
    for e in then {
        assert_eq!(e["kind"], "bootstrap_unavailable", "{e}");
        assert!(e["reason"].as_str().unwrap().contains(addr), "{e}");
    }
}

/// A worker restarted with the same rank registers again (a new incarnation replaces the
/// old), and the bootstrap server shows exactly one record for it.
#[test]
fn a_restarted_worker_registers_again_and_replaces_its_record() {
    let (_boot, addr) = bootstrap();
    let mut first = worker("prefill", "prefill", "P", &addr, &["--serve"]);
    first.kill9();
    let second = worker("prefill again", "prefill", "P", &addr, &["--serve"]);
    let status = Command::new(common::handoff_bin())
        .args(["bootstrap", "status", "--connect", &addr, "--json"])
        .output()
        .unwrap();
    assert!(status.status.success());
    let v: Value = serde_json::from_slice(&status.stdout).unwrap();
    let text = v.to_string();
    assert_eq!(text.matches("\"incarnation\"").count(), 1, "{text}");
    drop(second);
}

/// A serving worker whose rank a newer process takes (a supervisor that gave up on it
/// started another) says so, fails its open requests `superseded` (they were waiting on
/// their 300 s bootstrap deadline: no decode ever asked) and exits 1: a process that
/// would refuse every request does not stay up. The newer one serves on, untold.
#[test]
fn a_superseded_serving_worker_fails_its_requests_and_exits() {
    let (_boot, addr) = bootstrap();
    let mut first = worker(
        "prefill",
        "prefill",
        "P",
        &addr,
        &["--serve", "--requests", "2"],
    );
    first.until("both requests opened", |seen| {
        seen.iter().filter(|v| v["event"] == "opened").count() == 2
    });
    let mut args = common::worker_args("prefill", "P", &addr);
    args.extend(["--serve", "--heartbeat-ms", "100"]);
    let newer = Proc::spawn("newer prefill", &args);
    let ready = newer.expect("ready", |v| v["event"] == "ready");
    let incarnation = ready["incarnation"].to_string();
    let said = first.expect("superseded", |v| v["event"] == "superseded");
    assert!(
        said["detail"].as_str().unwrap_or("").contains(&incarnation),
        "{said} does not name the newer process ({incarnation})"
    );
    let (ends, summary) = first.ends();
    assert_eq!(kinds(&ends), ["superseded", "superseded"], "{ends:?}");
    assert_eq!(summary["superseded"], said["detail"], "{summary}");
    first.rest();
    let status = first.child.wait().expect("wait for the superseded worker");
    assert_eq!(status.code(), Some(1), "a superseded worker exits 1");
    assert!(
        !newer.stderr_says("superseded", Duration::ZERO),
        "the newer process was told too: {}",
        newer.stderr.lock().unwrap()
    );
}

/// Decode asks for an engine nobody registered: its requests fail by name at their
/// bootstrap deadline, the bootstrap server answers "not ready", nothing crashes.
#[test]
fn a_query_for_an_unregistered_prefill_fails_by_name_and_nothing_crashes() {
    let (mut boot, addr) = bootstrap();
    let d = worker(
        "decode",
        "decode",
        "D",
        &addr,
        &[
            "--requests",
            "2",
            "--prefill",
            "nobody",
            "--bootstrap-timeout-s",
            "1.5",
        ],
    );
    let (ends, _) = d.ends();
    assert!(
        kinds(&ends)
            .iter()
            .all(|k| k == "bootstrap_timeout" || k == "bootstrap_unavailable"),
        "{ends:?}"
    );
    assert!(
        boot.child.try_wait().unwrap().is_none(),
        "the bootstrap server exited"
    );
    let status = Command::new(common::handoff_bin())
        .args(["bootstrap", "status", "--connect", &addr])
        .output()
        .unwrap();
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
}

/// A decode over its admission threshold: prefill sees `Rejected(Busy)` in milliseconds,
/// not at its bootstrap deadline (300 s here).
#[test]
fn a_saturated_decode_makes_prefill_fail_rejected_busy_in_milliseconds() {
    let (_boot, addr) = bootstrap();
    let _d = worker(
        "decode",
        "decode",
        "D",
        &addr,
        &[
            "--requests",
            "3",
            "--prefill",
            "P",
            "--no-alloc",
            "--admission",
            "0",
            "--serve",
        ],
    );
    let p = worker("prefill", "prefill", "P", &addr, &["--requests", "3"]);
    let (ends, _) = p.ends();
    assert_eq!(kinds(&ends), vec!["rejected_busy"; 3], "{ends:?}");
    for e in &ends {
        let ms = e["ms"].as_f64().unwrap();
        assert!(ms < 2000.0, "prefill waited {ms} ms for the rejection");
    }
    eprintln!(
        "prefill saw Rejected(Busy) after {:?} ms",
        ends.iter()
            .map(|e| e["ms"].as_f64().unwrap().round())
            .collect::<Vec<_>>()
    );
}

/// Malformed traffic to every port the processes open (bootstrap, control, data) costs
/// a connection each; every process stays up and a request still goes through after.
#[test]
fn malformed_traffic_to_every_port_crashes_nothing() {
    let (mut boot, addr) = bootstrap();
    let mut p = worker(
        "prefill",
        "prefill",
        "P",
        &addr,
        &["--requests", "2", "--serve"],
    );
    let status = Command::new(common::handoff_bin())
        .args(["bootstrap", "status", "--connect", &addr, "--json"])
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&status.stdout).unwrap();
    let record = &v["engines"][0]["workers"][0];
    let ports = [
        addr.trim_start_matches("tcp://").to_string(),
        record["control_address"]
            .as_str()
            .unwrap()
            .trim_start_matches("tcp://")
            .to_string(),
        record["data_address"].as_str().unwrap().to_string(),
    ];
    let mut greeting = vec![0u8; 64];
    greeting[0] = 0xff;
    greeting[9] = 0x7f;
    greeting[10] = 3;
    greeting[12..16].copy_from_slice(b"NULL");
    let mut huge = greeting.clone();
    huge.extend([0x04, 27, 5, b'R', b'E', b'A', b'D', b'Y', 11]);
    huge.extend(b"Socket-Type");
    huge.extend(6u32.to_be_bytes());
    huge.extend(b"DEALER");
    huge.extend([0x02]);
    huge.extend((1u64 << 40).to_be_bytes());
    let junk: Vec<Vec<u8>> = vec![
        (0..4096u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 7) as u8).collect(),
        b"GET / HTTP/1.1\r\n\r\n".to_vec(),
        greeting[..30].to_vec(),
        huge,
        b"HDDT\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff".to_vec(),
        vec![0u8; 100_000],
    ];
    for port in &ports {
        for bytes in &junk {
            if let Ok(mut s) = std::net::TcpStream::connect(port) {
                let _ = s.write_all(bytes);
                let _ = s.set_read_timeout(Some(Duration::from_millis(300)));
                let mut sink = [0u8; 1024];
                let _ = s.read(&mut sink);
            }
        }
    }
    assert!(boot.child.try_wait().unwrap().is_none(), "bootstrap died");
    assert!(p.child.try_wait().unwrap().is_none(), "prefill died");
    let d = worker(
        "decode",
        "decode",
        "D",
        &addr,
        &["--requests", "2", "--prefill", "P"],
    );
    let (_, summary) = d.ends();
    assert_eq!(summary["done"], 2);
    p.kill9();
    boot.kill9();
}

/// KV caches as engines hold them, across processes over TCP: prefill holds 4 layers as
/// vLLM's per-layer tensors (K and V halves: 8 ranges), decode the same layers interleaved
/// (4 ranges); decode checks every byte of every block.
#[test]
fn per_layer_prefill_hands_over_to_interleaved_decode_between_processes() {
    for mode in ["push", "pull"] {
        hands_over_with(
            mode,
            &[
                "--transport",
                "tcp",
                "--layers",
                "4",
                "--layout",
                "per-layer",
            ],
            &[
                "--transport",
                "tcp",
                "--layers",
                "4",
                "--layout",
                "interleaved",
            ],
        );
    }
}

/// Two processes whose layouts do not pair (the same block bytes cut into 4 layers on one
/// side, 8 on the other: another model) fail every request by name, naming the peer,
/// before a byte moves; nothing crashes.
#[test]
fn layouts_that_do_not_pair_fail_requests_by_name_between_processes() {
    let (_boot, addr) = bootstrap();
    let p_args = [
        "--requests",
        "2",
        "--serve",
        "--transport",
        "tcp",
        "--layers",
        "4",
    ];
    let _p = worker("prefill", "prefill", "P", &addr, &p_args);
    let d_args = [
        "--requests",
        "2",
        "--prefill",
        "P",
        "--transport",
        "tcp",
        "--layers",
        "8",
    ];
    let d = worker("decode", "decode", "D", &addr, &d_args);
    let (ends, summary) = d.ends();
    assert_eq!(summary["done"], 0, "{ends:?}");
    for end in &ends {
        let reason = end["reason"].as_str().unwrap_or_default();
        assert!(
            reason.contains("per layer differ") && reason.contains('P'),
            "{end}"
        );
    }
}

/// Every stdout line of a worker as JSON; a line that is not JSON fails the test, naming it.
fn json_lines(name: &str, lines: &[String]) -> Vec<Value> {
    lines
        .iter()
        .map(|l| {
            serde_json::from_str(l)
                .unwrap_or_else(|e| panic!("{name}: stdout line is not JSON ({e}): {l:?}"))
        })
        .collect()
}

/// "Released exactly once", checked from outside on a worker's event stream: every block
/// a request was given (its `opened` line) appears in exactly one `released` line of that
/// request, no `released` line names a block the request was not given, and each release
/// says why in a way that matches how the request ended (`done` for `Done`, `failed` with
/// the same kind for `Failed`). Returns the `released` lines.
fn releases_match_ends(name: &str, events: &[Value]) -> Vec<Value> {
    use std::collections::BTreeMap;
    let mut given: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let mut ended: BTreeMap<String, Value> = BTreeMap::new();
    let mut released: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let mut lines = Vec::new();
    let blocks = |v: &Value| -> Vec<u64> {
        v["blocks"]
            .as_array()
            .unwrap_or_else(|| panic!("{name}: no blocks in {v}"))
            .iter()
            .map(|b| b.as_u64().expect("block id"))
            .collect()
    };
    for v in events {
        let id = v["request"].as_str().unwrap_or_default().to_string();
        match v["event"].as_str() {
            Some("opened") => {
                assert!(
                    given.insert(id, blocks(v)).is_none(),
                    "{name}: opened twice: {v}"
                );
            }
            Some("end") => {
                assert!(
                    ended.insert(id, v.clone()).is_none(),
                    "{name}: ended twice: {v}"
                );
            }
            Some("released") => {
                released.entry(id).or_default().extend(blocks(v));
                lines.push(v.clone());
            }
            _ => {}
        }
    }
    assert!(!given.is_empty(), "{name}: no request opened");
    for (id, want) in &given {
        let mut got = released.remove(id).unwrap_or_default();
        got.sort_unstable();
        let mut want = want.clone();
        want.sort_unstable();
        assert_eq!(
            got, want,
            "{name}: {id}: blocks released (each once) vs given"
        );
    }
    assert!(
        released.is_empty(),
        "{name}: released but never opened: {released:?}"
    );
    for r in &lines {
        let id = r["request"].as_str().expect("request");
        let end = ended
            .get(id)
            .unwrap_or_else(|| panic!("{name}: {id} released but never ended: {r}"));
        match end["state"].as_str() {
            Some("Done") => {
                assert_eq!(r["why"], "done", "{name}: {r} after {end}");
                assert!(r["kind"].is_null() && r["fence"].is_null(), "{name}: {r}");
            }
            // Or `shutdown`: the blocks were still fenced when the runtime stopped.
            Some("Failed") if r["why"] == "shutdown" => {}
            Some("Failed") => {
                assert_eq!(r["why"], "failed", "{name}: {r} after {end}");
                assert_eq!(r["kind"], end["kind"], "{name}: {r} after {end}");
            }
            other => panic!("{name}: {id} ended {other:?}"),
        }
    }
    lines
}

/// Eight requests handed over; both workers' streams, read to the end, account for every
/// block: released once, `done`. The prefill worker (`--serve`) is stopped by SIGTERM.
fn releases_are_reported_once_with_why(mode: &str, transport: &str) {
    let (_boot, addr) = bootstrap();
    let common = ["--requests", "8", "--transport", transport];
    let p = worker(
        "prefill",
        "prefill",
        "P",
        &addr,
        &[&common[..], &["--serve"]].concat(),
    );
    let d_args = [&common[..], &["--prefill", "P", "--mode", mode]].concat();
    let d = worker("decode", "decode", "D", &addr, &d_args);
    let d_events = json_lines("decode", &d.rest());
    let summary = d_events.last().expect("decode printed something");
    assert_eq!(summary["event"], "summary", "the summary comes last");
    assert_eq!(summary["done"], 8, "{summary}");
    let d_rel = releases_match_ends("decode", &d_events);
    assert!(d_rel.iter().all(|r| r["why"] == "done"), "{d_rel:?}");
    // Prefill ends all eight once decode has (its `Done`, or decode's `ReadDone`, came
    // first), give or take a control message in flight: stop it only then.
    let mut p_lines = p.until("eight ends", |seen| {
        seen.iter().filter(|v| v["event"] == "end").count() == 8
    });
    p.terminate();
    p_lines.extend(p.rest());
    let p_events = json_lines("prefill", &p_lines);
    assert_eq!(p_events.last().expect("summary")["event"], "summary");
    let p_rel = releases_match_ends("prefill", &p_events);
    assert!(p_rel.iter().all(|r| r["why"] == "done"), "{p_rel:?}");
}

#[test]
fn every_release_is_reported_once_with_why_in_push_mode() {
    releases_are_reported_once_with_why("push", "tcp");
}

#[test]
fn every_release_is_reported_once_with_why_in_pull_mode_over_ucx() {
    if ucx_available() {
        releases_are_reported_once_with_why("pull", "ucx");
    }
}

/// The failure path, from outside: prefill is killed while decode's requests wait for it;
/// decode's requests end `peer_lost` and each block is released once, for `why`.
fn releases_after_a_lost_prefill(transport: &str, mode: &str, why: Value) {
    let (_boot, addr) = bootstrap();
    let mut p = worker(
        "prefill",
        "prefill",
        "P",
        &addr,
        &[
            "--requests",
            "4",
            "--hold-ms",
            "600000",
            "--serve",
            "--transport",
            transport,
        ],
    );
    let d_args = [
        "--requests",
        "4",
        "--prefill",
        "P",
        "--transport",
        transport,
        "--mode",
        mode,
    ];
    let d = worker("decode", "decode", "D", &addr, &d_args);
    p.until_waiting_for_input(4);
    p.kill9();
    let d_events = json_lines("decode", &d.rest());
    let summary = d_events.last().expect("decode printed something");
    assert_eq!(summary["failed"], 4, "{summary}");
    let rel = releases_match_ends("decode", &d_events);
    assert!(kinds(&ends_of(&d_events)).iter().all(|k| k == "peer_lost"));
    for r in &rel {
        let got = serde_json::json!({"why": r["why"], "kind": r["kind"], "fence": r["fence"]});
        assert_eq!(got, why, "{r}");
    }
}

fn ends_of(events: &[Value]) -> Vec<Value> {
    events
        .iter()
        .filter(|v| v["event"] == "end")
        .cloned()
        .collect()
}

/// Over TCP decode's server checks every write against its grant: the blocks go when the
/// request fails.
#[test]
fn releases_after_a_lost_prefill_say_failed_peer_lost() {
    let why = serde_json::json!({"why": "failed", "kind": "peer_lost", "fence": null});
    releases_after_a_lost_prefill("tcp", "push", why);
}

/// Over UCX in pull mode (the default) only decode's own reads write its blocks, and none
/// was in flight: the blocks go when the request fails, as over TCP.
#[test]
fn releases_after_a_lost_prefill_over_ucx_in_pull_mode_go_at_once() {
    if ucx_available() {
        let why = serde_json::json!({"why": "failed", "kind": "peer_lost", "fence": null});
        releases_after_a_lost_prefill("ucx", "pull", why);
    }
}

/// Over UCX (push) a lost prefill rank could still write (it may be frozen, not dead):
/// decode fences the blocks past the failure, here until the worker stops.
#[test]
fn releases_after_a_lost_prefill_over_ucx_wait_behind_the_fence() {
    if ucx_available() {
        let why = serde_json::json!({"why": "shutdown", "kind": null, "fence": null});
        releases_after_a_lost_prefill("ucx", "push", why);
    }
}

/// UCX's own log lines go to stderr, never among the JSON events on stdout (libucs logs to
/// stdout unless `UCX_LOG_FILE` says otherwise; `handoff` sets it to stderr when unset).
/// At `UCX_LOG_LEVEL=info` libucp prints its version and environment when a context is
/// made: a UCX worker's stdout must still be JSON, line by line, and stderr must have them.
#[test]
fn ucx_log_lines_go_to_stderr_not_into_the_event_stream() {
    if !ucx_available() {
        return;
    }
    let (_boot, addr) = bootstrap();
    let env = [("UCX_LOG_LEVEL", Some("info")), ("UCX_LOG_FILE", None)];
    let mut args = common::worker_args("prefill", "P", &addr);
    args.extend([
        "--transport",
        "ucx",
        "--requests",
        "1",
        "--bootstrap-timeout-s",
        "0.5",
    ]);
    let p = Proc::spawn_env("prefill", &args, &env);
    let events = json_lines("prefill", &p.rest());
    assert_eq!(events.first().expect("ready")["event"], "ready");
    assert_eq!(events.first().expect("ready")["transport"], "ucx");
    assert_eq!(events.last().expect("summary")["event"], "summary");
    let deadline = Instant::now() + T;
    while !p.stderr.lock().unwrap().contains("UCX  INFO") {
        assert!(
            Instant::now() < deadline,
            "no UCX log line on stderr at UCX_LOG_LEVEL=info:\n{}",
            p.stderr.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Two UCX workers on one host, host memory registered as an engine's (`--layers`): each
/// verifies the other by the kernel (it holds the other end of their control connection)
/// and moves blocks by same-host copies, push and pull, every block verified; with
/// `HANDOFF_SAME_HOST_COPIES=0` neither copies and UCX moves them, verified just the
/// same. Over a pool UCX allocated (no `--layers`), which a peer's UCX maps through shared
/// memory, neither welcomes copies either: UCX moves the blocks. Either way each still
/// verifies the other's process, to watch it should it be lost as a writer.
#[test]
fn same_host_workers_copy_directly_and_can_be_told_not_to() {
    if !ucx_available() {
        return;
    }
    const SAID: &str = "same-host copies with this peer";
    const WATCHED: &str = "watched should it be lost as a writer";
    let registered: &[&str] = &["--layers", "1"];
    // Per-layer pieces of 256 B, which a same-host read gathers.
    let small: &[&str] = &["--layers", "8", "--block-bytes", "4096"];
    for (copies, mode, shape, direct) in [
        ("1", "pull", registered, true),
        ("1", "push", registered, true),
        ("0", "pull", registered, false),
        ("1", "pull", small, true),
        ("1", "pull", &[][..], false),
    ] {
        let env = [
            (
                "RUST_LOG",
                Some("warn,handoff_net::control=info,handoff_transport::data::ucx=debug"),
            ),
            ("HANDOFF_SAME_HOST_COPIES", Some(copies)),
        ];
        let (_boot, addr) = bootstrap();
        let ucx = [&["--transport", "ucx", "--requests", "8"][..], shape].concat();
        // Prefill hands over 1.5 s after it started, long after decode's connection is
        // checked by the kernel (until then, UCX carries a connection's transfers).
        let p_args = [&ucx[..], &["--serve", "--hold-ms", "1500"]].concat();
        let p = worker_env("prefill", "prefill", "P", &addr, &p_args, &env);
        let d_args = [&ucx[..], &["--prefill", "P", "--mode", mode]].concat();
        let d = worker_env("decode", "decode", "D", &addr, &d_args, &env);
        let (ends, summary) = d.ends();
        assert_eq!(summary["done"], 8, "{copies} {mode}: {ends:?}");
        assert_eq!(summary["corrupted"], 0);
        assert!(ends.iter().all(|e| e["verified"] == true), "{ends:?}");
        for w in [&p, &d] {
            let said = w.stderr.lock().unwrap().contains(SAID);
            assert_eq!(
                said,
                direct,
                "{} ({mode}, copies {copies}, {shape:?}): stderr:\n{}",
                w.name,
                w.stderr.lock().unwrap()
            );
        }
        for w in [&p, &d] {
            let watched = w.stderr.lock().unwrap().contains(WATCHED);
            assert_eq!(watched, !direct, "{} ({mode}, copies {copies})", w.name);
        }
        // The side that moves the bytes did copy them itself: decode reads, prefill writes.
        let mover = if mode == "pull" { &d } else { &p };
        let copied = mover
            .stderr
            .lock()
            .unwrap()
            .matches("same-host copy")
            .count();
        if direct {
            assert!(
                copied >= 8,
                "{} ({mode}): {copied} same-host copies",
                mover.name
            );
        } else {
            assert_eq!(copied, 0, "{} ({mode})", mover.name);
        }
    }
}

/// Sends `signal` (`STOP`, `CONT`) to a worker.
fn signal(p: &Proc, signal: &str) {
    let status = Command::new("kill")
        .args([&format!("-{signal}"), &p.child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{signal} {}", p.name);
}

/// A decode whose second wave (`--then-prefill`) opens as soon as the first gives blocks
/// back, that keeps what arrived and checks it again when it stops, with short deadlines
/// (its one-sided fence, their sum, is 9 s).
const REUSING_DECODE: &[&str] = &[
    "--then-after-ms",
    "0",
    "--keep-done",
    "--serve",
    "--bootstrap-timeout-s",
    "2",
    "--waiting-timeout-s",
    "5",
    "--transfer-timeout-s",
    "2",
    "--pull-ttl-s",
    "2",
];

/// A frozen writer: prefill is stopped (SIGSTOP) and kept stopped while decode fails its
/// requests. It must not land a byte in their blocks once the engine has them again
/// (decode keeps the blocks of the next requests they go to and checks them again when it
/// stops), and its own requests must end failed, by name.
/// - Over TCP (push and pull) and UCX pull, decode gives the blocks back and hands the very
///   same blocks to a second prefill's requests while the first is still stopped; they
///   arrive verified; then it is resumed. TCP: decode's server refuses a lost peer's
///   writes (push) and only decode's own reads write its blocks (pull, either plane).
/// - UCX push: the writer fences itself with its lease, checked before every post, but a
///   stop can fall between that check and the post, and no time bound covers a stop: so
///   decode, past its fence bound, keeps the blocks quarantined while the stopped writer
///   (on this host, its process watched) lives. The second wave waits; prefill is resumed
///   while decode holds them; whatever it still lands goes into the quarantined blocks;
///   it then confirms, decode lets the blocks go, and the second wave arrives in them
///   verified, and still verifies when decode stops.
/// - Pull: prefill is stopped once decode's transfer info reached it, with its hand-over
///   due at once when it resumes.
fn a_frozen_writer_never_lands_in_reused_blocks(transport: &str, mode: &str) {
    frozen_writer(transport, mode, "CONT");
}

/// The frozen writer of [`a_frozen_writer_never_lands_in_reused_blocks`], resumed
/// (`CONT`) or killed (`KILL`) once decode holds its blocks, or (`REPLACE`, UCX push) its
/// rank taken by a new process while it is still stopped, then resumed. The stop must land while every
/// request of the frozen writer is still open; on a busy machine it can come after one
/// already arrived (its transfer took milliseconds), which tests nothing: that attempt is
/// run again, three times at most.
fn frozen_writer(transport: &str, mode: &str, then: &str) {
    frozen_writer_in(transport, mode, then, Memory::Host);
}

/// Where the frozen-writer tests' workers hold their KV pools.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Memory {
    /// Host memory laid out as an engine's 32 layers.
    Host,
    /// One device allocation on GPU 0 (copies through the peer's CUDA IPC handles).
    Cuda,
    /// The pool UCX allocates (`handoff worker` without `--layers`): peers move its blocks
    /// with UCX, not with same-host copies, and are watched all the same.
    Allocated,
}

/// [`frozen_writer`] with the pools in `memory`.
fn frozen_writer_in(transport: &str, mode: &str, then: &str, memory: Memory) {
    const ATTEMPTS: usize = 3;
    for attempt in 1..=ATTEMPTS {
        match frozen_writer_once(transport, mode, then, memory) {
            Ok(()) => return,
            Err(late) if attempt < ATTEMPTS => {
                println!("{transport} {mode}: attempt {attempt}: {late}; again");
            }
            Err(late) => panic!("{transport} {mode}: {ATTEMPTS} attempts: {late}"),
        }
    }
}

/// One attempt of [`frozen_writer`]: `Err` when the stop came after one of the frozen
/// writer's requests had already arrived (the scenario did not happen).
fn frozen_writer_once(
    transport: &str,
    mode: &str,
    then: &str,
    memory: Memory,
) -> Result<(), String> {
    let (_boot, addr) = bootstrap();
    // 4 requests of 256 blocks over 32 layers held as an engine holds them: a transfer is
    // thousands of operations, so a stop lands in the middle of one.
    // Losses after a second's silence, not 300 ms: the stopped writer is lost all the
    // same, and the honest second prefill, starved for 300 ms by four such tests on two
    // cores, is not (seen: decode failed a second-wave request "peer lost: P2").
    let mut common = vec![
        "--blocks-per-request",
        "256",
        "--pool-blocks",
        "1024",
        "--transport",
        transport,
        "--heartbeats-missed",
        "10",
    ];
    match memory {
        Memory::Host => common.extend(["--layers", "32"]),
        // One device range: a request's transfer is a few device copies, over in far less
        // time than a stop takes to land, so the writer is stopped before its hand-over
        // (as in pull mode) and writes, if at all, only once resumed.
        Memory::Cuda => common.extend(["--memory", "cuda"]),
        // One block a put: over before a stop lands, as for device memory.
        Memory::Allocated => {}
    }
    // REPLACE: stopped with every request's transfer info in, before its hand-over, like
    // pull mode. Stopped at the first write, another request may still be bootstrapping:
    // it knows no decode, so the loss of decode fails nothing of it, decode's asks go to
    // the new process, never to it, and it waits out its own deadline (minutes), holding
    // decode's quarantine as long (seen once in CI: no second wave within 30 s of the
    // resume). And waiting for all four to write lets the first finish before the stop.
    let before_hand_over = mode == "pull" || memory != Memory::Host || then == "REPLACE";
    // The hold runs from prefill's open: decode must have sent its transfer info by then.
    // A GPU decode takes longer to start (a CUDA context, UCX's CUDA transports).
    let hold = match (before_hand_over, memory) {
        (false, _) => "0",
        (true, Memory::Host | Memory::Allocated) => "1500",
        (true, Memory::Cuda) => "6000",
    };
    let mut p1_args = vec!["--requests", "4", "--hold-ms", hold];
    p1_args.extend_from_slice(&common);
    let mut p1 = worker("frozen prefill", "prefill", "P1", &addr, &p1_args);
    let mut p2_args = vec!["--requests", "4", "--request-prefix", "req-then", "--serve"];
    p2_args.extend_from_slice(&common);
    let _p2 = worker("second prefill", "prefill", "P2", &addr, &p2_args);
    // A pool of exactly one wave: the second wave gets the blocks the first gave back.
    let mut d_args = vec![
        "--requests",
        "4",
        "--prefill",
        "P1",
        "--then-prefill",
        "P2",
        "--mode",
        mode,
    ];
    d_args.extend_from_slice(REUSING_DECODE);
    d_args.extend_from_slice(&common);
    let d = worker("decode", "decode", "D", &addr, &d_args);
    let state = |v: &Value, s: &str| v["event"] == "state" && v["state"] == s;
    if !before_hand_over {
        p1.until("a write under way", |seen| {
            seen.iter().any(|v| state(v, "Transferring"))
        });
    } else {
        p1.until("transfer info for every request", |seen| {
            seen.iter().filter(|v| state(v, "WaitingForInput")).count() == 4
        });
    }
    signal(&p1, "STOP");
    // Decode ends every request of the frozen writer (it is lost): all must fail.
    let first_wave = |v: &Value| {
        v["event"] == "end" && v["request"].as_str().is_some_and(|r| !r.contains("then"))
    };
    let first_lines = d.until("the frozen writer's requests ended", |seen| {
        seen.iter().filter(|v| first_wave(v)).count() == 4
    });
    let first_seen = json_lines("decode", &first_lines);
    if let Some(arrived) = first_seen
        .iter()
        .find(|v| first_wave(v) && v["state"] == "Done")
    {
        return Err(format!(
            "the stop came after {} arrived",
            arrived["request"]
        ));
    }
    let quarantine = transport == "ucx" && mode == "push";
    // The new process of `REPLACE`, up until the end.
    let mut restarted = None;
    if quarantine {
        // Decode loses P1, fails its requests, and past its fence bound keeps their blocks.
        assert!(
            d.stderr_says_times("quarantined", 4, T),
            "decode quarantined no blocks for the stopped writer: {}",
            d.stderr.lock().unwrap()
        );
        let held = d.stderr.lock().unwrap().clone();
        assert!(
            !held.contains("req-then"),
            "the second wave started: {held}"
        );
        if then == "REPLACE" {
            restarted = Some(replaced_while_stopped(&d, &addr, &common));
            signal(&p1, "CONT");
        } else {
            signal(&p1, then);
        }
    }
    // Decode loses P1, fails its requests, lets their blocks go (over UCX in push mode once
    // the resumed writer confirms), and P2's requests arrive in them, verified.
    let d_lines = d.until("the second wave, verified", |seen| {
        seen.iter()
            .filter(|v| {
                v["event"] == "end" && v["request"].as_str().is_some_and(|r| r.contains("then"))
            })
            .count()
            == 4
    });
    let mut d_seen = first_seen;
    d_seen.extend(json_lines("decode", &d_lines));
    let blocks_of = |second: bool| -> BTreeSet<u64> {
        d_seen
            .iter()
            .filter(|v| {
                v["event"] == "opened"
                    && v["request"].as_str().unwrap_or("").contains("then") == second
            })
            .flat_map(|v| v["blocks"].as_array().cloned().unwrap_or_default())
            .filter_map(|b| b.as_u64())
            .collect()
    };
    assert_eq!(
        blocks_of(false),
        blocks_of(true),
        "the second wave reuses the first's blocks"
    );
    for end in ends_of(&d_seen) {
        if end["request"].as_str().unwrap_or("").contains("then") {
            let stderr = d.stderr.lock().unwrap().clone();
            assert_eq!(end["verified"], true, "{end}; decode's stderr:\n{stderr}");
        } else {
            assert_eq!(end["state"], "Failed", "{end}");
        }
    }
    if quarantine {
        // Released only once the writer confirmed, never on the bound.
        for released in d_seen.iter().filter(|v| {
            v["event"] == "released" && !v["request"].as_str().unwrap_or("").contains("then")
        }) {
            assert_eq!(released["fence"], "confirmed", "{released}");
        }
    } else {
        // Resume the frozen prefill: its write goes on where it stopped (push), or its
        // hand-over, overdue, is tried at once (pull).
        signal(&p1, then);
    }
    if then == "KILL" {
        use std::os::unix::process::ExitStatusExt;
        let status = p1.child.try_wait();
        assert!(
            matches!(&status, Ok(Some(s)) if s.signal() == Some(9)),
            "the frozen prefill was not killed: {status:?}"
        );
        println!("{transport} {mode}: the frozen prefill was killed, and decode let its blocks go");
    } else {
        frozen_writer_ended(&p1, transport, mode);
    }
    d.terminate();
    let rest = json_lines("decode", &d.rest());
    let rechecks: Vec<&Value> = rest.iter().filter(|v| v["event"] == "recheck").collect();
    assert_eq!(rechecks.len(), 4, "{rest:?}");
    assert!(
        rechecks.iter().all(|v| v["verified"] == true),
        "a late write landed in reused blocks: {rechecks:?}"
    );
    let summary = rest.last().expect("summary");
    assert_eq!(summary["recheck_bad"], 0, "{summary}");
    drop(restarted);
    Ok(())
}

/// A new process takes the stopped writer's rank (a restart, say, by a supervisor that
/// gave up on it) while decode holds the stopped one's blocks quarantined. Decode's ask
/// reaches the new process, which answers for a request it never knew with `AbortAck`:
/// that must end nothing (the stopped one may still hold a post), and the second wave
/// must still wait. The new process lives on until the test ends.
fn replaced_while_stopped(d: &Proc, addr: &str, common: &[&str]) -> Proc {
    let mut args = vec!["--requests", "0", "--serve"];
    args.extend_from_slice(common);
    let restarted = worker("restarted prefill", "prefill", "P1", addr, &args);
    // Decode asks its quarantined writers again every few seconds, at the rank's new
    // address once the old one is found gone, and an answer from there is refused by name.
    // One at least: the first ask is what connects decode to the new process, and a
    // request whose ask falls due after decode learnt of the new process asks no more
    // (seen: the four asks fall within 2 ms of the connection, and only some are sent).
    assert!(
        d.stderr_says("ends nothing", T),
        "decode never heard the new process: {}",
        d.stderr.lock().unwrap()
    );
    let held = d.stderr.lock().unwrap().clone();
    assert!(
        !held.contains("req-then"),
        "the new process's answer let the blocks go: {held}"
    );
    restarted
}

/// The frozen prefill, resumed, ends every request failed, by name.
fn frozen_writer_ended(p1: &Proc, transport: &str, mode: &str) {
    let (p1_ends, _) = p1.ends();
    assert_eq!(p1_ends.len(), 4, "{p1_ends:?}");
    for end in &p1_ends {
        assert_eq!(end["state"], "Failed", "a late write went through: {end}");
    }
    println!(
        "{transport} {mode}: the frozen prefill's requests ended {:?}",
        p1_ends
            .iter()
            .map(|e| e["reason"].clone())
            .collect::<Vec<_>>()
    );
}

#[test]
fn a_frozen_writer_never_lands_in_reused_blocks_over_tcp_push() {
    a_frozen_writer_never_lands_in_reused_blocks("tcp", "push");
}

#[test]
fn a_frozen_writer_never_lands_in_reused_blocks_over_tcp_pull() {
    a_frozen_writer_never_lands_in_reused_blocks("tcp", "pull");
}

#[test]
fn a_frozen_writer_never_lands_in_reused_blocks_over_ucx_push() {
    if ucx_available() {
        a_frozen_writer_never_lands_in_reused_blocks("ucx", "push");
    }
}

/// A stopped writer that never resumes: decode's quarantine ends when its process exits.
#[test]
fn a_quarantine_ends_when_the_stopped_writer_is_killed_over_ucx_push() {
    if ucx_available() {
        frozen_writer("ucx", "push", "KILL");
    }
}

/// The frozen writer between two GPU workers (device pools on one GPU, UCX push; same-host
/// copies through the peer's CUDA IPC handles), stopped with transfer info in hand and its
/// hand-over due: decode quarantines, and the resumed writer's device copies never land in
/// the blocks the second wave reuses.
#[test]
fn a_frozen_gpu_writer_never_lands_in_reused_device_blocks_over_ucx_push() {
    if gpu_with_cuda_ucx().is_some() {
        frozen_writer_in("ucx", "push", "CONT", Memory::Cuda);
    }
}

/// The frozen writer over the pool UCX allocates, where same-host peers copy with UCX, not
/// with the kernel: decode still watches the stopped writer's process (its pid is offered
/// to be watched whatever the lane), so the quarantine holds until the writer confirms,
/// never just its bound (which let the blocks go before protocol 7).
#[test]
fn a_frozen_writer_is_watched_without_same_host_copies_over_ucx_push() {
    if ucx_available() {
        frozen_writer_in("ucx", "push", "CONT", Memory::Allocated);
    }
}

/// A stopped writer whose rank a new process takes: the new process's answers do not end
/// the quarantine; the old one's end does, once it is resumed and gives up.
#[test]
fn a_restarted_writers_answer_does_not_end_its_stopped_predecessors_quarantine_over_ucx_push() {
    if ucx_available() {
        frozen_writer("ucx", "push", "REPLACE");
    }
}

#[test]
fn a_frozen_writer_never_lands_in_reused_blocks_over_ucx_pull() {
    if ucx_available() {
        a_frozen_writer_never_lands_in_reused_blocks("ucx", "pull");
    }
}

// ---------------------------------------------------------------- partitions

/// Hosts as network namespaces on one bridge, made by the test and removed when dropped:
/// `10.77.<n>.1` is the bridge (the bootstrap server runs there, in the test's own
/// namespace), and each named host gets the next address on its own veth.
struct Hosts {
    tag: String,
    subnet: String,
    names: Vec<String>,
}

impl Hosts {
    /// The hosts, or `None` after saying why they cannot be made here (needs root, `ip` and
    /// `nft`): the caller then skips, by name.
    fn make(test: &str, names: &[&str]) -> Option<Hosts> {
        use std::sync::atomic::{AtomicU32, Ordering};
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let have = |tool: &str| {
            Command::new(tool)
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc_geteuid() } == 0;
        if !root || !have("nft") || Command::new("ip").arg("-V").output().is_err() {
            let why = "partitions need root, `ip` and `nft` (nftables) to make network namespaces and cut them";
            handoff_testkit::skip(handoff_testkit::Need::Netns, test, why);
            return None;
        }
        // Unique per make in this process (names and subnet), and apart from other test
        // processes by their pid.
        let n = NEXT.fetch_add(1, Ordering::Relaxed) % 250;
        let pid = std::process::id() % 1000;
        let tag = format!("ho{pid}x{n}");
        let subnet = format!("10.{}.{n}", 100 + pid % 100);
        let hosts = Hosts {
            tag: tag.clone(),
            subnet: subnet.clone(),
            names: names.iter().map(|s| s.to_string()).collect(),
        };
        let bridge = format!("{tag}br");
        // Leftovers of a run that was killed before it could clean up.
        drop(Hosts {
            tag: tag.clone(),
            subnet: subnet.clone(),
            names: hosts.names.clone(),
        });
        sh(&["ip", "link", "add", &bridge, "type", "bridge"]);
        sh(&[
            "ip",
            "addr",
            "add",
            &format!("{subnet}.1/24"),
            "dev",
            &bridge,
        ]);
        sh(&["ip", "link", "set", &bridge, "up"]);
        for (i, name) in names.iter().enumerate() {
            let ns = hosts.ns(name);
            let (outer, inner) = (format!("{tag}{name}0"), format!("{tag}{name}1"));
            sh(&["ip", "netns", "add", &ns]);
            sh(&[
                "ip", "link", "add", &outer, "type", "veth", "peer", "name", &inner,
            ]);
            sh(&["ip", "link", "set", &inner, "netns", &ns]);
            sh(&["ip", "link", "set", &outer, "master", &bridge, "up"]);
            let addr = format!("{subnet}.{}/24", i + 2);
            sh(&["ip", "-n", &ns, "addr", "add", &addr, "dev", &inner]);
            sh(&["ip", "-n", &ns, "link", "set", &inner, "up"]);
            sh(&["ip", "-n", &ns, "link", "set", "lo", "up"]);
        }
        Some(hosts)
    }

    fn ns(&self, name: &str) -> String {
        format!("{}-{name}", self.tag)
    }

    fn addr(&self, name: &str) -> String {
        let i = self
            .names
            .iter()
            .position(|n| n == name)
            .expect("a host of the test");
        format!("{}.{}", self.subnet, i + 2)
    }

    /// `handoff` args run inside host `name`'s namespace.
    fn command(&self, name: &str, args: &[&str]) -> Command {
        let mut command = Command::new("ip");
        command
            .args(["netns", "exec", &self.ns(name)])
            .arg(common::handoff_bin())
            .args(args);
        command
    }

    /// Cuts traffic between host `a` and host `b`, on `a`'s side, both directions: every
    /// packet (`ports: None`), or only TCP to or from `ports` (`except: false`), or
    /// everything but TCP to or from `ports` (`except: true`).
    fn cut(&self, a: &str, b: &str, ports: Option<&[u16]>, except: bool) {
        let ns = self.ns(a);
        let peer = self.addr(b);
        let nft = |rule: &str| sh(&["ip", "netns", "exec", &ns, "nft", rule]);
        nft("add table inet cut");
        nft("add chain inet cut in { type filter hook input priority 0; }");
        nft("add chain inet cut out { type filter hook output priority 0; }");
        let (from, to) = (format!("ip saddr {peer}"), format!("ip daddr {peer}"));
        match ports {
            None => {
                nft(&format!("add rule inet cut in {from} drop"));
                nft(&format!("add rule inet cut out {to} drop"));
            }
            Some(ports) => {
                let set = ports
                    .iter()
                    .map(u16::to_string)
                    .collect::<Vec<_>>()
                    .join(", ");
                let verdict = if except { "accept" } else { "drop" };
                for (chain, who) in [("in", &from), ("out", &to)] {
                    for dir in ["sport", "dport"] {
                        nft(&format!(
                            "add rule inet cut {chain} {who} tcp {dir} {{ {set} }} {verdict}"
                        ));
                    }
                    if except {
                        nft(&format!("add rule inet cut {chain} {who} drop"));
                    }
                }
            }
        }
    }

    /// Ends every cut of host `a`.
    fn heal(&self, a: &str) {
        sh(&[
            "ip",
            "netns",
            "exec",
            &self.ns(a),
            "nft",
            "delete table inet cut",
        ]);
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        // Quietly: some of these may not exist (leftovers checked before a run).
        let ip = |args: &[&str]| Command::new("ip").args(args).output();
        for name in &self.names {
            let _ = ip(&["netns", "del", &self.ns(name)]);
            let _ = ip(&["link", "del", &format!("{}{name}0", self.tag)]);
        }
        let _ = ip(&["link", "del", &format!("{}br", self.tag)]);
    }
}

extern "C" {
    #[link_name = "geteuid"]
    fn libc_geteuid() -> u32;
}

/// Runs a setup command; a failure is the test's.
fn sh(args: &[&str]) {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .expect("run");
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The port of a `ready` line's `tcp://HOST:PORT` or `HOST:PORT` address.
fn port_of(address: &Value) -> u16 {
    let text = address.as_str().unwrap_or("");
    text.rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in {address}"))
}

/// Prefill P (host `p`) and decode D (host `d`) are cut apart once D's transfer info has
/// reached P (`cut`: `full`, `control` or `data`), while P's engine still computes. D
/// lets the blocks of what it failed go to a second prefill Q (host `q`), keeps what
/// arrived and checks it again at the end; then the cut heals and P hands over. Every
/// request ends on both sides, by name; where the two sides disagree, no byte of P's may
/// have landed in blocks D gave back (every block D kept still verifies).
fn partitioned(cut: &str, transport: &str, mode: &str) {
    let test = format!("partition {cut} {transport} {mode}");
    let Some(hosts) = Hosts::make(&test, &["p", "q", "d"]) else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("{}-secret", hosts.tag));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let secret = dir.join("secret");
    std::fs::write(&secret, "a secret of the partition test, long enough").expect("secret");
    let secret = secret.to_string_lossy().to_string();
    let env = |mut c: Command| {
        c.env("HANDOFF_SECRET_FILE", &secret);
        // Says when a push runs as pull (below).
        c.env("RUST_LOG", "warn,handoff_actors::request=debug");
        c
    };
    let boot_listen = format!("tcp://{}.1:0", hosts.subnet);
    let mut boot_cmd = Command::new(common::handoff_bin());
    boot_cmd.args(["bootstrap", "--listen", &boot_listen, "--expire-after", "3"]);
    let boot = Proc::spawn_command("bootstrap", env(boot_cmd));
    let line = boot.line(Instant::now() + T).expect("bootstrap address");
    let addr = line.rsplit(' ').next().expect("address").to_string();
    let start = |name: &str, host: &str, engine: &str, role: &str, extra: &[&str]| {
        let ip = hosts.addr(host);
        let (control, data) = (format!("tcp://{ip}:0"), format!("{ip}:0"));
        let mut args = common::worker_args(role, engine, &addr);
        args.extend([
            "--control-listen",
            &control,
            "--data-listen",
            &data,
            "--advertise-host",
            &ip,
            "--heartbeat-ms",
            "100",
            "--heartbeats-missed",
            "3",
            "--transport",
            transport,
            "--blocks-per-request",
            "8",
        ]);
        args.extend_from_slice(extra);
        let p = Proc::spawn_command(name, env(hosts.command(host, &args)));
        let ready = p.expect("ready", |v| v["event"] == "ready");
        (p, ready)
    };
    let (p, p_ready) = start(
        "prefill P",
        "p",
        "P",
        "prefill",
        &["--requests", "4", "--hold-ms", "1500"],
    );
    let (_q, _) = start(
        "prefill Q",
        "q",
        "Q",
        "prefill",
        &["--requests", "4", "--request-prefix", "req-then", "--serve"],
    );
    let (d, d_ready) = start(
        "decode D",
        "d",
        "D",
        "decode",
        &[
            &[
                "--requests",
                "4",
                "--pool-blocks",
                "32",
                "--prefill",
                "P",
                "--then-prefill",
                "Q",
                "--mode",
                mode,
            ],
            REUSING_DECODE,
        ]
        .concat(),
    );
    p.until_waiting_for_input(4);
    let controls = [port_of(&p_ready["control"]), port_of(&d_ready["control"])];
    match cut {
        "full" => hosts.cut("p", "d", None, false),
        "control" => hosts.cut("p", "d", Some(&controls), false),
        _ => hosts.cut("p", "d", Some(&controls), true),
    }
    // D ends the first wave (by name), and what it gave back goes to Q's requests.
    let first = |v: &Value| !v["request"].as_str().unwrap_or("").contains("then");
    let lines = d.until("the first wave's ends", |seen| {
        seen.iter()
            .filter(|v| v["event"] == "end" && first(v))
            .count()
            == 4
    });
    let mut d_seen = json_lines("decode D", &lines);
    let failed = ends_of(&d_seen)
        .iter()
        .filter(|e| e["state"] == "Failed")
        .count();
    let more = d.until("the second wave's ends", |seen| {
        seen.iter()
            .filter(|v| v["event"] == "end" && !first(v))
            .count()
            == failed
    });
    d_seen.extend(json_lines("decode D", &more));
    hosts.heal("p");
    let (p_ends, _) = p.ends();
    assert_eq!(p_ends.len(), 4, "{test}: {p_ends:?}");
    d.terminate();
    d_seen.extend(json_lines("decode D", &d.rest()));
    let d_ends = ends_of(&d_seen);
    for end in &d_ends {
        assert!(
            end["state"] == "Failed" || end["verified"] == true,
            "{test}: {end}"
        );
    }
    let rechecks: Vec<&Value> = d_seen.iter().filter(|v| v["event"] == "recheck").collect();
    assert!(
        rechecks.iter().all(|v| v["verified"] == true),
        "{test}: a byte landed in blocks decode had given back: {rechecks:?}"
    );
    // Decode cannot watch a prefill process in another network namespace (the kernel shows
    // it no socket of ours there): a push over UCX, whose writes decode cannot refuse, runs
    // as pull with it, so a stopped writer has nothing to land.
    let pulled = d
        .stderr
        .lock()
        .unwrap()
        .matches("push runs as pull")
        .count();
    if transport == "ucx" && mode == "push" {
        assert!(pulled >= 4, "{test}: {pulled} pushes ran as pull");
    } else {
        assert_eq!(pulled, 0, "{test}");
    }
    let state_of = |ends: &[Value], id: &str| {
        ends.iter()
            .find(|e| e["request"] == id)
            .map(|e| e["state"].clone())
    };
    let agree = (0..4)
        .filter(|i| {
            let id = format!("req-{i}");
            state_of(&p_ends, &id) == state_of(&d_ends, &id)
        })
        .count();
    println!(
        "{test}: decode {:?}, prefill {:?}; {agree} of 4 agree; {} kept blocks rechecked",
        kinds(
            &d_ends
                .iter()
                .filter(|e| first(e))
                .cloned()
                .collect::<Vec<_>>()
        ),
        kinds(&p_ends),
        rechecks.len()
    );
}

/// The partition of `cut` over each (transport, mode); UCX ones where libucp loads.
fn partitioned_each(cut: &str, cases: &[(&str, &str)]) {
    // One partition at a time: each runs four processes on their own network.
    static ONE: Mutex<()> = Mutex::new(());
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    for (transport, mode) in cases {
        if *transport == "ucx" && !ucx_available() {
            continue;
        }
        partitioned(cut, transport, mode);
    }
}

#[test]
fn a_full_partition_between_prefill_and_decode_ends_every_request_without_a_late_byte() {
    partitioned_each("full", &[("tcp", "push"), ("ucx", "push"), ("ucx", "pull")]);
}

#[test]
fn a_control_plane_cut_between_prefill_and_decode_ends_every_request_without_a_late_byte() {
    partitioned_each(
        "control",
        &[("tcp", "push"), ("ucx", "push"), ("ucx", "pull")],
    );
}

/// Over UCX the namespaces share memory: the data-plane cut leaves UCX running.
#[test]
fn a_data_plane_cut_between_prefill_and_decode_ends_every_request_without_a_late_byte() {
    partitioned_each("data", &[("tcp", "push"), ("tcp", "pull"), ("ucx", "push")]);
}

// ---------------------------------------------------------------- metrics

/// `GET /metrics` from `addr` (`HOST:PORT`): the body, or a panic naming what went wrong.
fn scrape(addr: &str) -> String {
    use std::io::Write as _;
    let mut s = std::net::TcpStream::connect(addr).unwrap_or_else(|e| panic!("{addr}: {e}"));
    s.set_read_timeout(Some(T)).expect("a read timeout");
    write!(s, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\n\r\n").expect("send the request");
    let mut answer = String::new();
    s.read_to_string(&mut answer).expect("read the answer");
    let (head, body) = answer.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("text/plain; version=0.0.4"), "{head}");
    body.to_string()
}

/// The value of the sample `series` (name and labels, as exposed) in `text`.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// `promtool check metrics` on `text`: its complaints, or a skip when there is no promtool.
fn promtool(text: &str) -> Option<String> {
    use std::io::Write as _;
    let child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let Ok(mut child) = child else {
        let why = "no promtool (Debian package prometheus) to check the exposition";
        handoff_testkit::skip_this(handoff_testkit::Need::Promtool, why);
        return None;
    };
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(text.as_bytes())
        .expect("feed promtool");
    let out = child.wait_with_output().expect("promtool ends");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Some(if out.status.success() {
        said
    } else {
        format!("promtool failed: {said}")
    })
}

/// What an operator scrapes: the bootstrap server and both workers serve `/metrics` in the
/// Prometheus text format that `promtool check metrics` accepts without a complaint, and
/// the numbers are the run's: eight requests done on each side, every block given back,
/// none held, eight writes over TCP on prefill, two registrations and decode's lookups.
#[test]
fn workers_and_the_bootstrap_server_serve_metrics_that_promtool_accepts() {
    let boot = Proc::spawn(
        "bootstrap",
        &[
            "bootstrap",
            "--listen",
            "tcp://127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
        ],
    );
    let first = boot.line(Instant::now() + T).expect("the listen line");
    let addr = first.rsplit(' ').next().expect("address").to_string();
    let second = boot.line(Instant::now() + T).expect("the metrics line");
    let boot_metrics = second
        .strip_prefix("metrics at http://")
        .and_then(|s| s.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("{second}"))
        .to_string();
    let start = |name: &str, role: &str, engine: &str, extra: &[&str]| {
        let mut args = common::worker_args(role, engine, &addr);
        args.extend([
            "--requests",
            "8",
            "--transport",
            "tcp",
            "--serve",
            "--metrics-listen",
            "127.0.0.1:0",
        ]);
        args.extend_from_slice(extra);
        let p = Proc::spawn(name, &args);
        let ready = p.expect("ready", |v| v["event"] == "ready");
        let at = ready["metrics"]
            .as_str()
            .expect("the ready line says where")
            .to_string();
        (p, at)
    };
    let (_p, p_metrics) = start("prefill", "prefill", "P", &[]);
    let (d, d_metrics) = start(
        "decode",
        "decode",
        "D",
        &["--prefill", "P", "--mode", "push"],
    );
    // Serving, decode prints its summary only when stopped: its eight ends say it is done.
    let seen = d.until("eight ends", |seen| {
        seen.iter().filter(|v| v["event"] == "end").count() == 8
    });
    assert!(
        seen.iter()
            .filter(|l| l.contains(r#""event":"end""#))
            .all(|l| l.contains(r#""state":"Done""#)),
        "{seen:?}"
    );

    let decode = scrape(&d_metrics);
    let done =
        |role: &str| format!(r#"handoff_requests_total{{role="{role}",outcome="done",reason=""}}"#);
    assert_eq!(sample(&decode, &done("decode")), Some(8.0), "{decode}");
    assert_eq!(
        sample(&decode, r#"handoff_blocks_held{role="decode"}"#),
        Some(0.0),
        "{decode}"
    );
    // Shown from the start, at zero, so that an alert on it needs no absent-series rule.
    assert_eq!(
        sample(&decode, r#"handoff_blocks_quarantined{role="decode"}"#),
        Some(0.0),
        "{decode}"
    );
    assert_eq!(
        sample(
            &decode,
            r#"handoff_blocks_released_total{role="decode",why="done"}"#
        ),
        Some(32.0),
        "{decode}"
    );
    // Prefill's side ends when decode's Done reaches it: wait for the eighth.
    let deadline = Instant::now() + T;
    let prefill = loop {
        let text = scrape(&p_metrics);
        if sample(&text, &done("prefill")) == Some(8.0) || Instant::now() > deadline {
            break text;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(sample(&prefill, &done("prefill")), Some(8.0), "{prefill}");
    let writes = r#"handoff_transfers_total{transport="tcp",op="write",outcome="ok"}"#;
    assert_eq!(sample(&prefill, writes), Some(8.0), "{prefill}");
    let moved = r#"handoff_transfer_blocks_total{transport="tcp",op="write"}"#;
    assert_eq!(sample(&prefill, moved), Some(32.0), "{prefill}");
    let bytes = r#"handoff_transfer_bytes_total{transport="tcp",op="write"}"#;
    assert_eq!(sample(&prefill, bytes), Some(32.0 * 65536.0), "{prefill}");
    let timed = r#"handoff_transfer_seconds_count{transport="tcp",op="write"}"#;
    assert_eq!(sample(&prefill, timed), Some(8.0), "{prefill}");
    assert_eq!(
        sample(&prefill, "handoff_block_bytes"),
        Some(65536.0),
        "{prefill}"
    );

    // Each side has the other as its one live peer (counted at a heartbeat).
    let deadline = Instant::now() + T;
    let live = loop {
        let text = scrape(&d_metrics);
        if sample(&text, "handoff_peers_live") == Some(1.0) || Instant::now() > deadline {
            break text;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(sample(&live, "handoff_peers_live"), Some(1.0), "{live}");

    let bootstrap = scrape(&boot_metrics);
    let added = r#"handoff_bootstrap_registrations_total{outcome="added"}"#;
    assert_eq!(sample(&bootstrap, added), Some(2.0), "{bootstrap}");
    let ready = r#"handoff_bootstrap_lookups_total{outcome="ready"}"#;
    assert!(
        sample(&bootstrap, ready).is_some_and(|n| n >= 1.0),
        "{bootstrap}"
    );

    for (who, text) in [
        ("decode", &decode),
        ("prefill", &prefill),
        ("bootstrap", &bootstrap),
    ] {
        if let Some(said) = promtool(text) {
            assert!(said.trim().is_empty(), "{who}: {said}\n{text}");
        }
    }
}

/// `--log-format json` with `RUST_LOG=handoff=debug`: every log line is one JSON object,
/// and a request's lines (its states, its transfer) carry its span: id, role, rank, peer.
#[test]
fn json_logs_follow_each_request_in_its_span() {
    let (_boot, addr) = bootstrap();
    let env = [("RUST_LOG", Some("handoff=debug"))];
    let common = [
        "--requests",
        "2",
        "--transport",
        "tcp",
        "--log-format",
        "json",
    ];
    let mut p_args = vec!["--serve"];
    p_args.extend_from_slice(&common);
    let _p = worker_env("prefill", "prefill", "P", &addr, &p_args, &env);
    let mut d_args = vec!["--prefill", "P"];
    d_args.extend_from_slice(&common);
    let d = worker_env("decode", "decode", "D", &addr, &d_args, &env);
    let (_, summary) = d.ends();
    assert_eq!(summary["done"], 2);
    // The summary comes after the runtime stopped: every log line is written by then.
    let log = d.stderr.lock().unwrap().clone();
    let lines: Vec<Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    for id in ["req-0", "req-1"] {
        let inside: Vec<&Value> = lines.iter().filter(|v| v["span"]["id"] == id).collect();
        let states = inside
            .iter()
            .filter(|v| v["fields"]["message"] == "state changed")
            .count();
        assert!(states >= 2, "{id}: {states} state lines in its span\n{log}");
        assert!(
            inside
                .iter()
                .any(|v| v["fields"]["message"] == "transfer answered"),
            "{id}: no transfer in its span\n{log}"
        );
        for v in &inside {
            assert_eq!(v["span"]["role"], "decode", "{v}");
            assert_eq!(v["span"]["rank"], "D/dp0tp0pp0", "{v}");
        }
        assert!(
            inside.iter().any(|v| v["span"]["peer"] == "P/dp0tp0pp0"),
            "{id}: its peer is never named\n{log}"
        );
    }
}

// ------------------------------------------------------------------ discovery on etcd

/// `handoff bootstrap status --json` of `addr` (a bootstrap server or an etcd cluster).
fn status_json(addr: &str) -> Value {
    let out = Command::new(common::handoff_bin())
        .args(["bootstrap", "status", "--connect", addr, "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "status of {addr}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The incarnations `addr` holds for engine `engine`.
fn incarnations(addr: &str, engine: &str) -> Vec<u64> {
    let status = status_json(addr);
    let engines = status["engines"].as_array().cloned().unwrap_or_default();
    engines
        .iter()
        .filter(|e| e["engine_id"] == engine)
        .flat_map(|e| e["workers"].as_array().cloned().unwrap_or_default())
        .map(|w| w["incarnation"].as_u64().expect("an incarnation"))
        .collect()
}

#[test]
fn requests_are_handed_over_through_etcd_discovery() {
    let Some(etcd) =
        handoff_testkit::etcd::Etcd::single("requests_are_handed_over_through_etcd_discovery")
    else {
        return;
    };
    let addr = handoff_testkit::etcd::address(&[&etcd], "handover");
    let _p = worker(
        "prefill",
        "prefill",
        "P",
        &addr,
        &["--requests", "8", "--serve"],
    );
    // Decode names the same cluster with --cluster instead of the address's path.
    let members = format!("etcd://{}", etcd.client);
    let d = worker(
        "decode",
        "decode",
        "D",
        &members,
        &["--requests", "8", "--prefill", "P", "--cluster", "handover"],
    );
    let (ends, summary) = d.ends();
    assert_eq!(summary["done"], 8, "{ends:?}");
    assert_eq!(summary["corrupted"], 0);
    assert!(ends.iter().all(|e| e["verified"] == true), "{ends:?}");
    // Both workers are in the cluster's table, once each; another cluster on the same etcd
    // holds none of them.
    assert_eq!(incarnations(&addr, "P").len(), 1);
    assert_eq!(incarnations(&addr, "D").len(), 1);
    let other = handoff_testkit::etcd::address(&[&etcd], "other");
    assert!(incarnations(&other, "P").is_empty());
}

/// The handover tests of the bootstrap server, through etcd: push over TCP, pull over UCX.
#[test]
fn push_and_ucx_handovers_run_through_etcd_as_through_a_bootstrap_server() {
    let Some(etcd) = handoff_testkit::etcd::Etcd::single(
        "push_and_ucx_handovers_run_through_etcd_as_through_a_bootstrap_server",
    ) else {
        return;
    };
    let tcp = handoff_testkit::etcd::address(&[&etcd], "tcp-push");
    hands_over_through(
        &tcp,
        "push",
        &["--transport", "tcp"],
        &["--transport", "tcp"],
    );
    if ucx_available() {
        let ucx = handoff_testkit::etcd::address(&[&etcd], "ucx-pull");
        hands_over_through(
            &ucx,
            "pull",
            &["--transport", "ucx"],
            &["--transport", "ucx"],
        );
    }
}

/// A worker killed and restarted: the new incarnation replaces the old record at once;
/// killed for good, its record expires with its lease (no one removes it).
#[test]
fn a_killed_worker_expires_from_etcd_and_a_restarted_one_replaces_it() {
    let Some(etcd) = handoff_testkit::etcd::Etcd::single(
        "a_killed_worker_expires_from_etcd_and_a_restarted_one_replaces_it",
    ) else {
        return;
    };
    let addr = handoff_testkit::etcd::address(&[&etcd], "restart");
    let mut first = worker("prefill", "prefill", "P", &addr, &["--serve"]);
    let before = incarnations(&addr, "P");
    assert_eq!(before.len(), 1);
    first.kill9();
    let mut second = worker("prefill again", "prefill", "P", &addr, &["--serve"]);
    let after = incarnations(&addr, "P");
    assert_eq!(after.len(), 1, "one record per rank");
    assert!(after[0] > before[0], "{after:?} replaces {before:?}");
    second.kill9();
    let killed = Instant::now();
    let deadline = killed + handoff_bootstrap::etcd::LEASE_TTL + Duration::from_secs(10);
    while !incarnations(&addr, "P").is_empty() {
        assert!(
            Instant::now() < deadline,
            "the killed worker's record did not expire with its lease"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    eprintln!("record expired {:?} after the kill", killed.elapsed());
}

#[test]
fn an_unreachable_etcd_fails_new_lookups_by_name_and_running_requests_finish() {
    let Some(mut etcd) = handoff_testkit::etcd::Etcd::single(
        "an_unreachable_etcd_fails_new_lookups_by_name_and_running_requests_finish",
    ) else {
        return;
    };
    let addr = handoff_testkit::etcd::address(&[&etcd], "unreachable");
    a_lost_directory_fails_new_lookups_by_name(&addr, || etcd.kill9());
}

/// Three members, the leader killed: a new one is elected, and registrations, lookups and
/// the workers' lease renewals go on through the other two; requests still hand over.
#[test]
fn a_three_member_etcd_keeps_serving_with_its_leader_killed() {
    let Some(mut members) = handoff_testkit::etcd::Etcd::cluster(
        "a_three_member_etcd_keeps_serving_with_its_leader_killed",
        3,
    ) else {
        return;
    };
    let addr = handoff_testkit::etcd::address(&members.iter().collect::<Vec<_>>(), "three");
    let _p = worker(
        "prefill",
        "prefill",
        "P",
        &addr,
        &["--requests", "8", "--serve"],
    );
    let leader = members
        .iter()
        .position(|m| m.is_leader())
        .expect("one member leads");
    members[leader].kill9();
    let killed = Instant::now();
    let d = worker(
        "decode",
        "decode",
        "D",
        &addr,
        &["--requests", "8", "--prefill", "P"],
    );
    let (ends, summary) = d.ends();
    assert_eq!(summary["done"], 8, "{ends:?}");
    assert!(ends.iter().all(|e| e["verified"] == true), "{ends:?}");
    // Past a whole lease after the kill, prefill's record is still there: its renewals
    // reached the members left.
    let lease = handoff_bootstrap::etcd::LEASE_TTL + Duration::from_secs(2);
    std::thread::sleep(lease.saturating_sub(killed.elapsed()));
    assert_eq!(incarnations(&addr, "P").len(), 1);
}
