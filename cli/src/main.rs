//! The `handoff` command: see `handoff --help`.

use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use handoff_cli::demo::{self, DemoOptions};
use handoff_transport::TransferMode;

/// handoff moves KV cache from prefill workers to decode workers, and never hangs, leaks
/// blocks or crashes doing it.
#[derive(Parser, Debug)]
#[command(name = "handoff", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// How logs (stderr) are written: `text` for people, `json` (one object per line, with
    /// the request's span: id, role, rank, peer) for log shippers. `RUST_LOG` picks what
    /// (`RUST_LOG=handoff=debug` follows every request through the actors, the network and
    /// the data plane).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the bootstrap server, where workers register and find each other (loopback by
    /// default; off loopback it needs a secret: `HANDOFF_SECRET_FILE=PATH handoff
    /// bootstrap --listen tcp://0.0.0.0:7400`), or ask one what is registered
    /// (`handoff bootstrap status --connect tcp://HOST:7400 [--json]`).
    #[command(args_conflicts_with_subcommands = true)]
    Bootstrap {
        #[command(subcommand)]
        query: Option<BootstrapCommand>,
        #[command(flatten)]
        serve: handoff_cli::bootstrap::ServeArgs,
    },
    /// Measure the data plane: two processes on loopback, write and read at 16 KiB-4 MiB
    /// blocks, verified by checksum, with memcpy and ucx_perftest measured as references.
    Bench(handoff_cli::bench::BenchArgs),
    /// Run a deterministic simulated cluster with injected faults and check its invariants
    /// (`handoff sim --seed 42`; `--seeds 0..1000 --faults swarm` for a sweep).
    Sim(handoff_sim::cli::SimArgs),
    /// Run one prefill or decode worker on the network: register with the bootstrap server,
    /// hand over `--requests` requests, print one JSON line per event.
    Worker(handoff_cli::worker::WorkerArgs),
    /// Run a prefill and a decode runtime in this process, hand over requests, and print
    /// each request's lifecycle (Bootstrapping → WaitingForInput → Transferring → Done).
    Demo {
        /// How many requests to hand over.
        #[arg(long, default_value_t = 4)]
        requests: u32,
        /// KV blocks per request (each 32 KiB).
        #[arg(long, default_value_t = 4)]
        blocks: u32,
        /// push: prefill writes into decode's blocks; pull: decode reads prefill's blocks.
        #[arg(long, value_enum, default_value_t = Mode::Push)]
        mode: Mode,
    },
}

#[derive(Subcommand, Debug)]
enum BootstrapCommand {
    /// Print what a running bootstrap server has registered, as a table or JSON.
    Status(handoff_cli::bootstrap::StatusArgs),
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Mode {
    Push,
    Pull,
}

/// UCX's own log (libucs) goes to stdout unless `UCX_LOG_FILE` says otherwise, and stdout is
/// where `handoff worker` prints its JSON events: send it to stderr, with every other log,
/// unless the user chose a destination. libucs reads the variable when it is loaded (at run
/// time, by the UCX data plane), so setting it here, before any thread starts (setting the
/// environment while other threads may read it is unsound), is early enough. An empty value
/// is UCX's default (stdout), so it counts as unset.
fn ucx_logs_to_stderr() {
    const VAR: &str = "UCX_LOG_FILE";
    if std::env::var_os(VAR).is_none_or(|v| v.is_empty()) {
        std::env::set_var(VAR, "stderr");
    }
}

fn main() -> ExitCode {
    // First, while this is the only thread.
    ucx_logs_to_stderr();
    let cli = Cli::parse();
    // RUST_LOG overrides. The bootstrap server logs registrations at info; the simulator's
    // report is its output (injected faults would flood warnings); the rest warn.
    let default_level = match &cli.command {
        Command::Bootstrap { query: None, .. } => "info",
        Command::Sim(_) => "off",
        _ => "warn",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| default_level.into());
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .init(),
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("handoff: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match cli.command {
        Command::Bootstrap {
            query: Some(BootstrapCommand::Status(args)),
            ..
        } => rt.block_on(handoff_cli::bootstrap::run_status(args)),
        Command::Sim(args) => handoff_sim::cli::run(args),
        Command::Bench(args) => rt.block_on(handoff_cli::bench::run(args)),
        Command::Worker(args) => rt.block_on(handoff_cli::worker::run(args)),
        Command::Bootstrap { query: None, serve } => {
            rt.block_on(handoff_cli::bootstrap::run_serve(serve))
        }
        Command::Demo {
            requests,
            blocks,
            mode,
        } => {
            let mode = match mode {
                Mode::Push => TransferMode::Push,
                Mode::Pull => TransferMode::Pull,
            };
            if blocks == 0 || blocks > 64 {
                eprintln!("handoff demo: --blocks must be between 1 and 64");
                return ExitCode::from(2);
            }
            let opts = DemoOptions {
                requests,
                blocks_per_request: blocks,
                mode,
            };
            match rt.block_on(demo::run(&opts)) {
                Ok(report) => {
                    println!(
                        "\n{} of {requests} requests done, {} failed, {} corrupted",
                        report.done,
                        report.failed.len(),
                        report.corrupted
                    );
                    for (id, why) in &report.failed {
                        println!("  {id}: {why}");
                    }
                    if report.done == requests && report.corrupted == 0 {
                        ExitCode::SUCCESS
                    } else {
                        ExitCode::FAILURE
                    }
                }
                Err(e) => {
                    eprintln!("handoff demo: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}
