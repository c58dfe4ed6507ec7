//! The crates show the design: an engine that embeds the `handoff` facade builds neither
//! the simulator, nor the command line's clap, nor tokio's test utilities; and the
//! lifecycle crate knows no network.

use std::process::Command;

/// `cargo tree` of `package` (normal dependencies, features included), one line each.
fn tree(package: &str, edges: &str) -> String {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new(cargo)
        .current_dir(root)
        .args([
            "tree",
            "--offline",
            "-p",
            package,
            "-e",
            edges,
            "--prefix",
            "none",
        ])
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "cargo tree -p {package}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_facade_builds_no_simulator_no_clap_and_no_test_utilities() {
    let deps = tree("handoff", "normal,features");
    for crate_name in ["handoff-net", "handoff-bootstrap", "handoff-actors"] {
        assert!(deps.contains(crate_name), "{crate_name} missing:\n{deps}");
    }
    for unwanted in [
        "handoff-sim ",
        "handoff-cli ",
        "clap ",
        "tokio feature \"test-util\"",
    ] {
        assert!(
            !deps.contains(unwanted),
            "the facade pulls in {unwanted}:\n{deps}"
        );
    }
}

#[test]
fn the_lifecycle_crate_knows_no_network_and_no_bootstrap() {
    let deps = tree("handoff-actors", "normal");
    for unwanted in [
        "handoff-net ",
        "handoff-bootstrap ",
        "handoff-sim ",
        "clap ",
    ] {
        assert!(
            !deps.contains(unwanted),
            "handoff-actors depends on {unwanted}:\n{deps}"
        );
    }
}
