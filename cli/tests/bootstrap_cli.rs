//! `handoff bootstrap` and `handoff bootstrap status` as the binary runs them: a status
//! against nothing, and serve's refusals of bad input.

use std::time::{Duration, Instant};

use handoff_cli::bootstrap::{run_serve, run_status, ServeArgs, StatusArgs};

/// Scheduling slack allowed past a deadline.
const SLACK: Duration = Duration::from_millis(300);

/// A port nothing listens on (bound, then released).
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_against_an_unreachable_server_exits_non_zero_within_its_timeout() {
    // A bootstrap server, and an etcd cluster of two members (with --cluster).
    for (connect, cluster) in [
        (format!("tcp://127.0.0.1:{}", free_port()), None),
        (
            format!("etcd://127.0.0.1:{},127.0.0.1:{}", free_port(), free_port()),
            Some("c".to_string()),
        ),
    ] {
        let args = StatusArgs {
            connect,
            cluster,
            json: false,
            secret_file: None,
            timeout: Duration::from_millis(400),
        };
        let started = Instant::now();
        let code = run_status(args).await;
        assert_eq!(code, std::process::ExitCode::FAILURE);
        assert!(started.elapsed() < Duration::from_millis(400) + SLACK);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_fails_fast_with_a_named_error_on_bad_input() {
    let args = |listen: &str, secret: Option<std::path::PathBuf>| ServeArgs {
        listen: listen.into(),
        secret_file: secret,
        insecure: false,
        expire_after: Duration::from_secs(6),
        metrics_listen: None,
    };
    let code = run_serve(args("not an address", None)).await;
    assert_eq!(code, std::process::ExitCode::FAILURE);
    // A metrics endpoint that cannot bind stops the server it came with.
    let mut bad_metrics = args("tcp://127.0.0.1:0", None);
    bad_metrics.metrics_listen = Some("not an address".into());
    let code = run_serve(bad_metrics).await;
    assert_eq!(code, std::process::ExitCode::FAILURE);
    let missing = std::path::PathBuf::from("/nonexistent/handoff-secret");
    let code = run_serve(args("tcp://127.0.0.1:0", Some(missing))).await;
    assert_eq!(code, std::process::ExitCode::FAILURE);
}
