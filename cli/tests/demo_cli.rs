//! The `handoff` binary as a user runs it: real processes, real output.

use std::process::Command;

fn handoff() -> Command {
    Command::new(env!("CARGO_BIN_EXE_handoff"))
}

#[test]
fn demo_hands_over_every_request_and_prints_each_lifecycle() {
    for mode in ["push", "pull"] {
        let out = handoff()
            .args(["demo", "--requests", "3", "--mode", mode])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{mode}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains("3 of 3 requests done, 0 failed, 0 corrupted"),
            "{stdout}"
        );
        for state in ["Bootstrapping", "WaitingForInput", "Done", "released"] {
            assert!(stdout.contains(state), "{mode}: no {state} in\n{stdout}");
        }
    }
}

#[test]
fn demo_refuses_bad_arguments_with_a_clear_message() {
    let out = handoff().args(["demo", "--blocks", "0"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--blocks must be between 1 and 64"));
    let out = handoff()
        .args(["demo", "--mode", "sideways"])
        .output()
        .unwrap();
    assert!(!out.status.success());
}

#[test]
fn help_explains_the_commands() {
    let out = handoff().arg("--help").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(stdout.contains("demo"), "{stdout}");
}

/// `handoff sim --seeds A..B --plot FILE.svg` draws the sweep: requests per seed by outcome
/// above latency per seed, one point per seed on every line.
#[test]
fn a_sweep_draws_its_outcomes_and_latency_per_seed() {
    let dir = std::env::temp_dir().join(format!("handoff-plot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temp dir");
    let plot = dir.join("sweep.svg");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_handoff"))
        .args([
            "sim", "--seeds", "5..9", "--faults", "swarm", "--quiet", "--plot",
        ])
        .arg(&plot)
        .output()
        .expect("run handoff sim");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let svg = std::fs::read_to_string(&plot).expect("the plot");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(svg.contains("handoff sim, seeds 5..=8"), "{svg}");
    for name in [">done<", ">failed<", ">p50<", ">p99<"] {
        assert!(svg.contains(name), "{name} missing:\n{svg}");
    }
    // Every line has a point per seed: the first line's polyline has four.
    let first = svg.split("<polyline points=\"").nth(1).expect("a line");
    let points = first
        .split('"')
        .next()
        .unwrap_or_default()
        .split(' ')
        .count();
    assert_eq!(points, 4, "{first}");
}
