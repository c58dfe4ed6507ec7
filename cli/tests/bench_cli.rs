//! `handoff bench` as a user runs it: two real processes per point, every point's
//! destination checked by checksum, results read back from `--json`.
//!
//! The host run needs no GPU (UCX rows where libucp loads). The `--memory cuda` runs
//! need a GPU and a UCX built with CUDA (`HANDOFF_UCX_LIB`, the `libucx-cu12` wheel's
//! `libucp.so`): they are the two-process same-GPU transfers (`cuda_ipc`) and GPU↔host.
//! Without a GPU, `--memory cuda` must fail with a message naming what is missing.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

mod common;
use common::gpu_with_cuda_ucx;

fn handoff() -> Command {
    Command::new(common::handoff_bin())
}

/// Small regions and few bytes per point: this checks behaviour, not speed.
const SMALL: [&str; 8] = [
    "--region-mib",
    "8",
    "--total-mib",
    "8",
    "--latency-iters",
    "20",
    "--seed",
    "7",
];

fn run(args: &[&str], json: &Path) -> (Output, Option<Value>) {
    let out = handoff()
        .arg("bench")
        .args(SMALL)
        .args(["--no-perftest", "--json"])
        .arg(json)
        .args(args)
        .output()
        .unwrap();
    let report = std::fs::read_to_string(json)
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok());
    (out, report)
}

fn text(out: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Every point of `report` was verified, and `want` (transport, op) rows exist at every
/// block size.
fn check_points(report: &Value, want: &[(&str, &str)], log: &str) {
    let points = report["points"].as_array().expect("points");
    // At least `--repeat` (5 by default) timed passes per point, each one's time kept, the
    // point's rate between its slowest and its fastest pass's.
    let passes = report["passes"].as_u64().expect("passes");
    assert!(passes >= 5, "{passes} passes\n{log}");
    for p in points {
        assert_eq!(p["verified"], Value::Bool(true), "{p}\n{log}");
        let each = p["pass_secs"].as_array().expect("pass_secs");
        assert_eq!(each.len() as u64, passes, "{p}");
        let (lo, mid, hi) = (
            p["gbps_min"].as_f64().expect("gbps_min"),
            p["gbps"].as_f64().expect("gbps"),
            p["gbps_max"].as_f64().expect("gbps_max"),
        );
        // Rounded to 4 places in the JSON.
        assert!(lo <= mid + 1e-3 && mid <= hi + 1e-3, "{p}");
    }
    for (transport, op) in want {
        let rows = points
            .iter()
            .filter(|p| p["transport"] == *transport && p["op"] == *op)
            .count();
        assert_eq!(rows, 4, "{transport} {op}: {rows} rows\n{log}");
    }
}

#[test]
fn host_bench_verifies_every_point_against_the_memcpy_reference() {
    let dir = tempdir();
    let json = dir.join("host.json");
    let plot = dir.join("host.svg");
    let plot_arg = plot.to_str().expect("a UTF-8 path");
    let (out, report) = run(&["--transport", "inproc,tcp", "--plot", plot_arg], &json);
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    // The picture: one line per transport and operation, the reference dashed.
    let svg = std::fs::read_to_string(&plot).expect("the plot");
    assert!(
        svg.starts_with("<svg ") && svg.trim_end().ends_with("</svg>"),
        "{svg}"
    );
    for line in [
        "memcpy copy",
        "tcp_stream stream",
        "inproc write",
        "inproc read",
        "tcp write",
        "tcp read",
    ] {
        assert!(
            svg.contains(&format!(">{line}</text>")),
            "{line} missing:\n{svg}"
        );
    }
    assert_eq!(svg.matches("<polyline").count(), 6, "{svg}");
    assert_eq!(
        svg.matches("stroke-dasharray").count(),
        4,
        "the references' lines and legends (memcpy, raw TCP)"
    );
    let report = report.expect("a JSON report");
    assert_eq!(report["reference"], "memcpy", "{log}");
    check_points(
        &report,
        &[
            ("memcpy", "copy"),
            ("tcp_stream", "stream"),
            ("inproc", "write"),
            ("inproc", "read"),
            ("tcp", "write"),
            ("tcp", "read"),
        ],
        &log,
    );
    // The reference's own ratio is 1, and every row has one.
    for p in report["points"].as_array().unwrap() {
        assert!(p["vs_reference"].as_f64().is_some(), "{p}");
    }
    assert!(log.contains("vs memcpy"), "{log}");
    // The lifecycle over TCP, and its floors: the woken round trip is also pinged once
    // before each request, and the lifecycle's ratio is to that one.
    let latency = report["latency"].as_array().expect("latency rows");
    let row = |transport: &str, op: &str| {
        latency
            .iter()
            .find(|l| l["transport"] == transport && l["op"] == op)
            .unwrap_or_else(|| panic!("no {transport} {op} row\n{log}"))
    };
    for op in ["rtt", "rtt-woken", "rtt-woken-between"] {
        let l = row("loopback", op);
        assert_eq!(l["samples"], 20, "{l}");
        assert!(l["p50_us"].as_f64().is_some_and(|us| us > 0.0), "{l}");
    }
    let lifecycle = &report["lifecycle"];
    assert_eq!(lifecycle["samples"], 20, "{lifecycle}");
    let between = row("loopback", "rtt-woken-between")["p50_us"]
        .as_f64()
        .expect("a p50");
    let p50 = lifecycle["p50_us"].as_f64().expect("a p50");
    let note = lifecycle["note"].as_str().expect("a note");
    let said: f64 = note
        .split_once("x the round trip that wakes its peer measured between")
        .and_then(|(head, _)| head.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no ratio to the floor between the requests in: {note}"));
    // The note rounds to 0.01, the JSON's p50s to 0.0001 µs.
    let want = p50 / between;
    assert!(
        (said - want).abs() <= 0.01 + want * 1e-3,
        "{note}: want {want:.3}"
    );
    // Each request over the round trip just before it: a median inside its middle half.
    let paired: Vec<f64> = note
        .split_once("timed just before it: median ")
        .map(|(_, tail)| {
            tail.split(|c: char| !(c.is_ascii_digit() || c == '.'))
                .filter_map(|n| n.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    assert!(
        matches!(paired[..], [m, lo, hi, ..] if m > 0.0 && lo <= m && m <= hi),
        "no paired ratio in: {note}"
    );
}

#[test]
fn layered_bench_repeats_every_ucx_point_over_per_layer_ranges_with_its_ratio() {
    let dir = tempdir();
    let json = dir.join("layers.json");
    let (out, report) = run(
        &[
            "--transport",
            "ucx",
            "--layers",
            "2",
            "--block-kib",
            "16,256",
            "--lease-cost",
        ],
        &json,
    );
    let log = text(&out);
    if !out.status.success() && log.contains("UCX library not found") {
        let why = format!("libucp not usable here:\n{log}");
        handoff_testkit::skip_this(handoff_testkit::Need::Ucx, &why);
        return;
    }
    assert!(out.status.success(), "{log}");
    let report = report.expect("a JSON report");
    let points = report["points"].as_array().expect("points");
    for p in points {
        assert_eq!(p["verified"], Value::Bool(true), "{p}\n{log}");
    }
    for (transport, op) in [("memcpy", "copy"), ("ucx", "write"), ("ucx", "read")] {
        for block in [16 << 10, 256 << 10] {
            let rows: Vec<&Value> = points
                .iter()
                .filter(|p| p["transport"] == transport && p["op"] == op)
                .filter(|p| p["block_bytes"] == block)
                .collect();
            let ranges: Vec<u64> = rows.iter().filter_map(|p| p["ranges"].as_u64()).collect();
            assert_eq!(ranges, [1, 4], "{transport} {op} {block}\n{log}");
            // The layered row: 4 segments per block, and its ratio to the one-range row.
            assert_eq!(rows[1]["segment_bytes"], block / 4, "{log}");
            assert!(rows[1]["vs_one_range"].as_f64().is_some(), "{}", rows[1]);
            assert!(rows[0]["vs_one_range"].is_null(), "{}", rows[0]);
            // --lease-cost: each one-range write names its ratio to the same writes
            // without the lease, measured in turns (the reference row is not listed).
            if (transport, op) == ("ucx", "write") {
                let note = rows[0]["note"].as_str().unwrap_or("");
                assert!(note.starts_with("leased/unleased "), "{}", rows[0]);
            }
        }
    }
    assert!(log.contains("vs 1-range"), "{log}");
    // The lifecycle between registered memory (the engine's path, a same-host copy), and
    // the same requests over memory UCX allocated, each with its paired ratio.
    let note = report["lifecycle"]["note"].as_str().unwrap_or("");
    assert!(note.contains("registered by address"), "{note}");
    let pool = report["latency"]
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r["transport"] == "lifecycle+pool"))
        .unwrap_or_else(|| panic!("no lifecycle+pool row\n{log}"));
    assert_eq!(pool["op"], "ucx", "{pool}");
    assert!(pool["p50_us"].as_f64().is_some_and(|p| p > 0.0), "{pool}");
    let note = pool["note"].as_str().unwrap_or("");
    assert!(
        note.contains("UCX allocated") && note.contains("median"),
        "{note}"
    );
}

#[test]
fn layered_bench_refuses_what_it_cannot_lay_out() {
    for args in [
        &["--layers", "0"][..],
        &["--layers", "3", "--block-kib", "16"][..],
        &["--layers", "2", "--memory", "cuda"][..],
        &["--repeat", "0"][..],
        &["--repeat", "1001"][..],
    ] {
        let out = handoff()
            .arg("bench")
            .args(SMALL)
            .args(["--no-perftest", "--transport", "ucx"])
            .args(args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", text(&out));
    }
}

#[test]
fn cuda_memory_refuses_transports_that_copy_through_the_cpu() {
    let out = handoff()
        .args(["bench", "--memory", "cuda", "--transport", "tcp"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("UCX only"), "{}", text(&out));
}

#[test]
fn cuda_bench_without_a_gpu_names_what_is_missing() {
    let reason = match handoff_gpu::probe() {
        Ok(_) => {
            eprintln!("a GPU is present: the GPU runs below cover --memory cuda");
            return;
        }
        Err(e) => e,
    };
    let out = handoff()
        .args(["bench", "--memory", "cuda", "--no-perftest"])
        .output()
        .unwrap();
    let log = text(&out);
    assert_eq!(out.status.code(), Some(2), "{log}");
    assert!(log.contains("--memory cuda needs a GPU"), "{log}");
    assert!(log.contains(&reason.to_string()), "{log}");
}

#[test]
fn cuda_bench_moves_device_memory_between_two_processes_on_one_gpu() {
    let Some(()) = gpu_with_cuda_ucx() else {
        return;
    };
    let dir = tempdir();
    let json = dir.join("cuda.json");
    let (out, report) = run(&["--memory", "cuda"], &json);
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    let report = report.expect("a JSON report");
    assert_eq!(report["reference"], "cuda_memcpy", "{log}");
    check_points(
        &report,
        &[("cuda_memcpy", "dtod"), ("ucx", "write"), ("ucx", "read")],
        &log,
    );
    eprintln!("{log}");
}

#[test]
fn cuda_bench_moves_blocks_between_a_gpu_and_host_memory() {
    let Some(()) = gpu_with_cuda_ucx() else {
        return;
    };
    let dir = tempdir();
    let json = dir.join("cuda-host.json");
    let (out, report) = run(&["--memory", "cuda", "--peer-memory", "host"], &json);
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    check_points(
        &report.expect("a JSON report"),
        &[("ucx", "write"), ("ucx", "read")],
        &log,
    );
}

/// A fresh directory under the system's temp dir (no tempfile crate needed), removed
/// with everything in it when the test is done with it.
fn tempdir() -> TempDir {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("handoff-bench-cli-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    TempDir(dir)
}

struct TempDir(std::path::PathBuf);

impl std::ops::Deref for TempDir {
    type Target = std::path::Path;

    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
