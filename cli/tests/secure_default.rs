//! Secure by default, through the real binary: off loopback, `handoff bootstrap` and
//! `handoff worker` refuse to start without a secret (saying how to set one), start with
//! one from the environment (`HANDOFF_SECRET`, `HANDOFF_SECRET_FILE`), or with `--insecure`.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const START: Duration = Duration::from_secs(20);

fn handoff(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(common::handoff_bin());
    cmd.args(args)
        .env_remove("HANDOFF_SECRET")
        .env_remove("HANDOFF_SECRET_FILE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// Runs to completion (it must exit by itself) and returns (success, stderr).
fn refused(args: &[&str]) -> (bool, String) {
    let out = handoff(args, &[])
        .output()
        .unwrap_or_else(|e| panic!("spawn: {e}"));
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Spawns and waits for a stdout line containing `needle`, within [`START`].
fn started(args: &[&str], env: &[(&str, &str)], needle: &str) -> Child {
    let mut child = handoff(args, env)
        .spawn()
        .unwrap_or_else(|e| panic!("spawn: {e}"));
    let stdout = child.stdout.take().unwrap_or_else(|| panic!("stdout"));
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let deadline = std::time::Instant::now() + START;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line.contains(needle) => return child,
            Ok(_) => {}
            Err(_) => {
                let _ = child.kill();
                let out = child.wait_with_output().ok();
                let err = out.map(|o| String::from_utf8_lossy(&o.stderr).into_owned());
                panic!("{args:?}: no {needle:?} within {START:?}; stderr: {err:?}");
            }
        }
    }
}

fn stop(mut child: Child) {
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn the_bootstrap_server_off_loopback_refuses_without_a_secret_and_says_how() {
    let (ok, err) = refused(&["bootstrap", "--listen", "tcp://0.0.0.0:0"]);
    assert!(!ok, "started without a secret");
    for needle in [
        "0.0.0.0",
        "HANDOFF_SECRET_FILE",
        "HANDOFF_SECRET=",
        "--insecure",
    ] {
        assert!(err.contains(needle), "{needle:?} missing from: {err}");
    }
    let listening = "bootstrap server listening on";
    let secret = [("HANDOFF_SECRET", "a-secret-of-at-least-16-bytes")];
    stop(started(
        &["bootstrap", "--listen", "tcp://0.0.0.0:0"],
        &secret,
        listening,
    ));
    let dir = std::env::temp_dir().join(format!("handoff-secure-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    let file = dir.join("secret");
    std::fs::write(&file, "another-secret-0123456789\n").unwrap_or_else(|e| panic!("{e}"));
    let file_env = [("HANDOFF_SECRET_FILE", file.to_str().unwrap_or_default())];
    stop(started(
        &["bootstrap", "--listen", "tcp://0.0.0.0:0"],
        &file_env,
        listening,
    ));
    stop(started(
        &["bootstrap", "--listen", "tcp://0.0.0.0:0", "--insecure"],
        &[],
        listening,
    ));
    let short = [("HANDOFF_SECRET", "short")];
    let out = handoff(&["bootstrap", "--listen", "tcp://0.0.0.0:0"], &short)
        .output()
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(!out.status.success(), "a 5-byte secret was accepted");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_worker_off_loopback_refuses_without_a_secret_before_it_dials() {
    for (flag, value, what) in [
        ("--control-listen", "tcp://0.0.0.0:0", "control listen"),
        ("--data-listen", "0.0.0.0:0", "data listen"),
        ("--bootstrap", "tcp://192.0.2.77:7400", "bootstrap server"),
        // Any one etcd member off loopback is enough.
        (
            "--bootstrap",
            "etcd://127.0.0.1:2379,192.0.2.78:2379/c",
            "etcd member",
        ),
    ] {
        let (ok, err) = refused(&[
            "worker",
            "--role",
            "prefill",
            "--engine",
            "p",
            "--transport",
            "tcp",
            flag,
            value,
        ]);
        assert!(!ok, "{flag}: started without a secret");
        assert!(
            err.contains(what) && err.contains("HANDOFF_SECRET_FILE"),
            "{flag}: {err}"
        );
    }
}
