//! `handoff bootstrap` (serve) and `handoff bootstrap status`: argument structs and the
//! functions the binary calls with them.
//!
//! Exit codes: 0 on success (for `serve`: stopped by SIGINT or SIGTERM), 1 on any failure,
//! reported as one line on stderr that names the address involved.
//!
//! `status --json` prints the shape `handoff_bootstrap::status` documents.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use handoff_bootstrap::status::{render_table, status_json};
use handoff_bootstrap::{
    serve, BootstrapClient, BootstrapError, ClientConfig, Key, ServerConfig, CONNECT_DEFAULT,
    LISTEN_DEFAULT,
};
use tracing::info;

/// Arguments of `handoff bootstrap`.
#[derive(clap::Args, Clone, Debug)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, value_name = "tcp://HOST:PORT", default_value = LISTEN_DEFAULT)]
    pub listen: String,
    /// File holding the shared secret (at least 16 bytes; one trailing newline is ignored).
    /// With it, unauthenticated clients are refused. Without it, `HANDOFF_SECRET_FILE`,
    /// then `HANDOFF_SECRET`, are read from the environment.
    #[arg(long, value_name = "PATH")]
    pub secret_file: Option<PathBuf>,
    /// Serve unauthenticated clients on a non-loopback address (a trusted network only).
    /// Without it, listening off loopback needs a secret.
    #[arg(long)]
    pub insecure: bool,
    /// Seconds a registered worker may stay silent before its record is removed (default:
    /// three client heartbeat intervals, `EXPIRE_AFTER_DEFAULT`).
    #[arg(long, value_name = "SECS", value_parser = parse_secs,
          default_value = "6")]
    pub expire_after: Duration,
    /// Serve Prometheus metrics (registrations and lookups by outcome) at
    /// `http://HOST:PORT/metrics` (port 0 picks one; the address is printed).
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics_listen: Option<String>,
}

/// Arguments of `handoff bootstrap status`.
#[derive(clap::Args, Clone, Debug)]
pub struct StatusArgs {
    /// Address of the bootstrap server, or of the etcd cluster the workers register in
    /// (`etcd://HOST:PORT[,HOST:PORT...][/CLUSTER]`, cluster `default` when none).
    #[arg(long, value_name = "tcp://HOST:PORT", default_value = CONNECT_DEFAULT)]
    pub connect: String,
    /// The etcd cluster to show, for an `etcd://` address that names none.
    #[arg(long, value_name = "NAME")]
    pub cluster: Option<String>,
    /// Print JSON (shape in the `cli` module docs) instead of a table.
    #[arg(long)]
    pub json: bool,
    /// File holding the shared secret, if the server requires one (else
    /// `HANDOFF_SECRET_FILE`, then `HANDOFF_SECRET`, from the environment).
    #[arg(long, value_name = "PATH")]
    pub secret_file: Option<PathBuf>,
    /// Seconds to wait for the server, connecting and retrying included
    /// (`STATUS_TIMEOUT_DEFAULT`).
    #[arg(long, value_name = "SECS", value_parser = parse_secs,
          default_value = "5")]
    pub timeout: Duration,
}

/// Parses a positive number of seconds (fractions allowed: `0.5`).
fn parse_secs(text: &str) -> Result<Duration, String> {
    let secs: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a number of seconds"))?;
    match Duration::try_from_secs_f64(secs) {
        Ok(d) if !d.is_zero() => Ok(d),
        _ => Err(format!("{text:?}: expected a positive number of seconds")),
    }
}

fn load_optional_key(path: Option<&Path>) -> Result<Option<Key>, BootstrapError> {
    handoff_bootstrap::exposure::resolve_key(path)
}

/// Runs `handoff bootstrap` until SIGINT or SIGTERM, then stops cleanly.
pub async fn run_serve(args: ServeArgs) -> ExitCode {
    let key = match load_optional_key(args.secret_file.as_deref()) {
        Ok(key) => key,
        Err(e) => return fail("serve", &e),
    };
    let mut cfg = ServerConfig::new(args.listen)
        .with_expire_after(args.expire_after)
        .with_insecure(args.insecure);
    cfg.key = key;
    let mut server = match serve(cfg).await {
        Ok(server) => server,
        Err(e) => return fail("serve", &e),
    };
    println!("bootstrap server listening on {}", server.address());
    let _metrics = match &args.metrics_listen {
        None => None,
        Some(listen) => {
            match handoff_transport::exposition::serve_metrics(listen, server.metrics().clone())
                .await
            {
                Ok(m) => {
                    println!("metrics at http://{}/metrics", m.local_addr());
                    Some(m)
                }
                Err(e) => {
                    server.stop().await;
                    eprintln!("handoff bootstrap serve: --metrics-listen {listen}: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
    };
    tokio::select! {
        signal = shutdown_signal() => {
            info!(%signal, "stopping the bootstrap server");
            server.stop().await;
            ExitCode::SUCCESS
        }
        () = server.stopped() => {
            eprintln!("handoff bootstrap: the server stopped unexpectedly (see the log)");
            ExitCode::FAILURE
        }
    }
}

/// Waits for SIGINT or SIGTERM and names it. If a handler cannot be installed, waits for
/// the other one only (and forever if neither can be: the process is then stopped by kill).
async fn shutdown_signal() -> &'static str {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let terminate = async {
            match signal(SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot watch SIGTERM");
                    std::future::pending::<()>().await;
                }
            }
        };
        tokio::select! {
            () = ctrl_c() => "SIGINT",
            () = terminate => "SIGTERM",
        }
    }
    #[cfg(not(unix))]
    {
        ctrl_c().await;
        "ctrl-c"
    }
}

async fn ctrl_c() {
    if let Err(e) = tokio::signal::ctrl_c().await {
        tracing::warn!(error = %e, "cannot watch SIGINT");
        std::future::pending::<()>().await;
    }
}

/// Runs `handoff bootstrap status`: prints the registry as a table (or JSON), or one error
/// line naming the address, within `--timeout`.
pub async fn run_status(args: StatusArgs) -> ExitCode {
    let key = match load_optional_key(args.secret_file.as_deref()) {
        Ok(key) => key,
        Err(e) => return fail("status", &e),
    };
    let deadline = Instant::now() + args.timeout;
    let cfg = ClientConfig {
        attempt_timeout: args.timeout,
        ..ClientConfig::default()
    };
    let connect =
        match handoff_bootstrap::etcd::with_cluster(&args.connect, args.cluster.as_deref()) {
            Ok(connect) => connect,
            Err(e) => return fail("status", &e),
        };
    let answer = if connect.starts_with(handoff_bootstrap::etcd::SCHEME) {
        match handoff_bootstrap::EtcdDirectory::new(&connect, key) {
            Ok(etcd) => etcd.status(deadline).await,
            Err(e) => Err(e),
        }
    } else {
        BootstrapClient::new(&connect, key, cfg)
            .status(deadline)
            .await
    };
    match answer {
        Ok(reply) => {
            if args.json {
                println!("{}", status_json(&connect, &reply));
            } else {
                print!("{}", render_table(&reply));
            }
            ExitCode::SUCCESS
        }
        Err(e) => fail("status", &e),
    }
}

fn fail(command: &str, e: &BootstrapError) -> ExitCode {
    eprintln!("handoff bootstrap {command}: {e}");
    ExitCode::FAILURE
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use handoff_bootstrap::{EXPIRE_AFTER_DEFAULT, STATUS_TIMEOUT_DEFAULT};

    #[derive(clap::Parser)]
    struct Serve {
        #[command(flatten)]
        args: ServeArgs,
    }

    #[derive(clap::Parser)]
    struct Status {
        #[command(flatten)]
        args: StatusArgs,
    }

    #[test]
    fn defaults_in_the_arguments_match_the_named_constants() {
        let serve = Serve::try_parse_from(["serve"]).map_err(|e| e.to_string());
        let serve = serve.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(serve.args.expire_after, EXPIRE_AFTER_DEFAULT);
        assert_eq!(serve.args.listen, LISTEN_DEFAULT);
        let status = Status::try_parse_from(["status"]).map_err(|e| e.to_string());
        let status = status.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(status.args.timeout, STATUS_TIMEOUT_DEFAULT);
        assert_eq!(status.args.connect, CONNECT_DEFAULT);
    }

    #[test]
    fn seconds_must_be_positive_numbers() {
        assert_eq!(parse_secs("0.25"), Ok(Duration::from_millis(250)));
        assert!(parse_secs("0").is_err());
        assert!(parse_secs("-1").is_err());
        assert!(parse_secs("NaN").is_err());
        assert!(parse_secs("1e30").is_err());
        assert!(parse_secs("soon").is_err());
    }
}
