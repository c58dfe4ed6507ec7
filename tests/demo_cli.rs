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
