//! `handoff bootstrap` and `handoff bootstrap status` as the binary runs them: the
//! status table and JSON, a status against nothing, and serve's refusals of bad input.

use std::time::{Duration, Instant};

use handoff_bootstrap::{
    serve, BootstrapClient, BootstrapServer, ClientConfig, ServerConfig, WorkerRecord,
};
use handoff_cli::bootstrap::{
    render_table, run_serve, run_status, status_json, ServeArgs, StatusArgs,
};
use handoff_transport::{EngineId, RankInfo, Role};

const T: Duration = Duration::from_secs(5);
/// Scheduling slack allowed past a deadline.
const SLACK: Duration = Duration::from_millis(300);

fn fast() -> ClientConfig {
    ClientConfig {
        heartbeat_interval: Duration::from_millis(100),
        attempt_timeout: Duration::from_millis(500),
        backoff_min: Duration::from_millis(20),
        backoff_max: Duration::from_millis(200),
    }
}

fn record(engine: &str, dp: (u32, u32), tp: (u32, u32), incarnation: u64) -> WorkerRecord {
    let rank = RankInfo {
        engine_id: EngineId::new(engine),
        dp_rank: dp.0,
        dp_size: dp.1,
        tp_rank: tp.0,
        tp_size: tp.1,
        pp_rank: 0,
        pp_size: 1,
    };
    WorkerRecord {
        rank,
        role: Role::Prefill,
        incarnation,
        control_address: format!("tcp://10.0.{}.{}:5000", dp.0, tp.0),
        data_address: format!("10.0.{}.{}:6000", dp.0, tp.0),
        data_descriptor: vec![dp.0 as u8, tp.0 as u8],
    }
}

async fn server() -> BootstrapServer {
    serve(ServerConfig::new("tcp://127.0.0.1:0"))
        .await
        .unwrap_or_else(|e| panic!("server starts: {e}"))
}

fn soon() -> Instant {
    Instant::now() + T
}

fn client(server: &BootstrapServer) -> BootstrapClient {
    BootstrapClient::new(&server.address(), None, fast())
}

/// A port nothing listens on (bound, then released).
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_renders_as_an_aligned_table_and_stable_json() {
    let server = server().await;
    let c = client(&server);
    c.register(record("p", (0, 1), (0, 2), 12), soon())
        .await
        .expect("register");
    client(&server)
        .register(record("zz-decode", (3, 1), (0, 1), 5), soon())
        .await
        .expect("register");
    let status = c.status(soon()).await.expect("status");
    let table = render_table(&status);
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 3, "{table}");
    assert!(lines[0].starts_with("ENGINE"), "{table}");
    assert!(lines[1].contains("1 of 2 registered"), "{table}");
    assert!(
        lines[2].contains("complete") && lines[2].contains("3/0/0"),
        "{table}"
    );
    let col = |line: &str, word: &str| line.find(word);
    assert_eq!(col(lines[0], "INCARNATION"), col(lines[1], "12"), "{table}");
    let json = status_json(&server.address(), &status);
    assert_eq!(json["server"], server.address());
    assert_eq!(json["engines"][0]["engine_id"], "p");
    assert_eq!(json["engines"][0]["complete"], false);
    assert_eq!(json["engines"][0]["registered"], 1);
    assert_eq!(json["engines"][0]["expected"], 2);
    assert_eq!(json["engines"][1]["workers"][0]["dp_rank"], 3);
    assert_eq!(json["engines"][1]["workers"][0]["incarnation"], 5);
    assert_eq!(
        json["engines"][1]["workers"][0]["control_address"],
        "tcp://10.0.3.0:5000"
    );
    assert_eq!(
        render_table(&handoff_bootstrap::StatusReply { engines: vec![] }),
        "no workers registered\n"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_against_an_unreachable_server_exits_non_zero_within_its_timeout() {
    let args = StatusArgs {
        connect: format!("tcp://127.0.0.1:{}", free_port()),
        json: false,
        secret_file: None,
        timeout: Duration::from_millis(400),
    };
    let started = Instant::now();
    let code = run_status(args).await;
    assert_eq!(code, std::process::ExitCode::FAILURE);
    assert!(started.elapsed() < Duration::from_millis(400) + SLACK);
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
