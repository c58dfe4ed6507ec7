//! The user docs match the binary: every `handoff` command that README.md, ARCHITECTURE.md
//! and python/README.md show (in code blocks or inline code) exists, and every `--flag`
//! written with it is one its `--help` lists.

mod common;

use std::collections::BTreeMap;
use std::process::Command;

/// The subcommands, longest first (so `bootstrap status` wins over `bootstrap`).
const COMMANDS: [&str; 6] = [
    "bootstrap status",
    "bootstrap",
    "worker",
    "bench",
    "sim",
    "demo",
];

/// Every `handoff <command> ...` the docs write, with the flags written after it (up to the
/// end of the inline code span, or of the code block's command with its `\` continuations).
fn documented() -> Vec<(String, String, Vec<String>)> {
    let mut out = Vec::new();
    for doc in ["README.md", "ARCHITECTURE.md", "python/README.md"] {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let path = root.join(doc);
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{doc}: {e}"));
        // Code blocks' continued lines are one command.
        let text = text.replace("\\\n", " ");
        for (n, line) in text.lines().enumerate() {
            let mut rest = line;
            while let Some(at) = rest.find("handoff ") {
                let after = &rest[at + "handoff ".len()..];
                rest = after;
                let Some(cmd) = COMMANDS.iter().find(|c| after.starts_with(**c)) else {
                    continue;
                };
                // A word boundary after the command (`handoff workers` is prose).
                let tail = &after[cmd.len()..];
                if tail
                    .chars()
                    .next()
                    .is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '-')
                {
                    continue;
                }
                let span = tail.split('`').next().unwrap_or_default();
                let span = span.split(" # ").next().unwrap_or_default();
                let flags = span
                    .split_whitespace()
                    .filter(|w| w.starts_with("--"))
                    .map(|w| {
                        w.split(['=', ',', ')', '`', '[', ']', ';'])
                            .next()
                            .unwrap_or_default()
                            .to_string()
                    })
                    .filter(|f| f.len() > 2)
                    .collect();
                out.push((format!("{doc}:{}", n + 1), cmd.to_string(), flags));
            }
        }
    }
    out
}

#[test]
fn every_documented_command_and_flag_is_in_its_help() {
    let docs = documented();
    assert!(
        docs.len() >= 15,
        "the docs name handoff's commands far more often than {}: {docs:?}",
        docs.len()
    );
    let mut helps: BTreeMap<String, String> = BTreeMap::new();
    let mut missing = Vec::new();
    for (at, cmd, flags) in &docs {
        let help = helps.entry(cmd.clone()).or_insert_with(|| {
            let out = Command::new(common::handoff_bin())
                .args(cmd.split(' '))
                .arg("--help")
                .output()
                .expect("run handoff");
            assert!(out.status.success(), "{at}: `handoff {cmd} --help` failed");
            String::from_utf8_lossy(&out.stdout).into_owned()
        });
        for flag in flags {
            let listed = help.match_indices(flag.as_str()).any(|(i, _)| {
                !help[i + flag.len()..].starts_with(|c: char| c.is_alphanumeric() || c == '-')
            });
            if !listed && flag != "--help" {
                missing.push(format!("{at}: handoff {cmd} {flag}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "documented but not in --help:\n{}",
        missing.join("\n")
    );
}
