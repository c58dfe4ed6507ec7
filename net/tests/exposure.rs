//! Secure by default on a network: off loopback, a bootstrap server or a worker needs a
//! shared secret or an explicit `insecure`; a worker listening on every interface
//! advertises the interface that reaches the bootstrap server, never 127.0.0.1.
//!
//! Real sockets, real servers and workers (TCP data plane).

use std::time::Duration;

use handoff_bootstrap::exposure::route_to;
use handoff_bootstrap::{serve, BootstrapError, Key, ServerConfig};
use handoff_net::{start_engine_runtime, DataTransport, EngineOptions, NetError, WorkerMemory};
use handoff_transport::{EngineId, RankInfo, Role};

fn key() -> Key {
    Key::new(b"exposure-test-secret-0123456789").unwrap_or_else(|e| panic!("{e}"))
}

fn rank(engine: &str) -> RankInfo {
    RankInfo {
        engine_id: EngineId::new(engine),
        dp_rank: 0,
        dp_size: 1,
        tp_rank: 0,
        tp_size: 1,
        pp_rank: 0,
        pp_size: 1,
    }
}

fn pool() -> WorkerMemory {
    WorkerMemory::Pool {
        blocks: 4,
        block_bytes: 1024,
    }
}

fn options(engine: &str, bootstrap: &str) -> EngineOptions {
    EngineOptions {
        transport: DataTransport::Tcp,
        register_timeout: Duration::from_secs(10),
        ..EngineOptions::new(Role::Prefill, rank(engine), bootstrap)
    }
}

/// A local address that is not loopback (the interface of the default route), if any.
fn lan_ip() -> Option<std::net::IpAddr> {
    route_to("tcp://192.0.2.1:9").filter(|ip| !ip.is_loopback())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bootstrap_server_off_loopback_needs_a_secret_or_insecure() {
    let err = serve(ServerConfig::new("tcp://0.0.0.0:0"))
        .await
        .err()
        .unwrap_or_else(|| panic!("0.0.0.0 without a secret must be refused"));
    assert!(
        matches!(&err, BootstrapError::Exposed(e) if e.address == "tcp://0.0.0.0:0"),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(
        text.contains("HANDOFF_SECRET_FILE") && text.contains("--insecure"),
        "{text}"
    );
    let keyed = serve(ServerConfig::new("tcp://0.0.0.0:0").with_key(key()))
        .await
        .unwrap_or_else(|e| panic!("with a secret: {e}"));
    keyed.stop().await;
    let open = serve(ServerConfig::new("tcp://0.0.0.0:0").with_insecure(true))
        .await
        .unwrap_or_else(|e| panic!("with insecure: {e}"));
    open.stop().await;
    let local = serve(ServerConfig::new("tcp://127.0.0.1:0"))
        .await
        .unwrap_or_else(|e| panic!("loopback needs nothing: {e}"));
    local.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_listening_or_dialing_off_loopback_needs_a_secret_or_insecure() {
    let cases = [
        ("control listen", {
            let mut o = options("x1", "tcp://127.0.0.1:1");
            o.control_listen = "tcp://0.0.0.0:0".into();
            o
        }),
        ("data listen", {
            let mut o = options("x2", "tcp://127.0.0.1:1");
            o.data_listen = "0.0.0.0:0".into();
            o
        }),
        ("bootstrap server", options("x3", "tcp://10.1.2.3:7400")),
        ("advertised host", {
            let mut o = options("x4", "tcp://127.0.0.1:1");
            o.advertise_host = Some("10.1.2.3".into());
            o
        }),
    ];
    for (what, opts) in cases {
        match start_engine_runtime(opts, pool()).await {
            Err(NetError::Exposed(e)) => assert_eq!(e.what, what),
            Err(other) => panic!("{what}: expected Exposed, got {other}"),
            Ok(_) => panic!("{what}: started without a secret"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_on_every_interface_advertises_the_one_that_reaches_the_bootstrap_server() {
    // Loopback bootstrap server: everything is on this host, so loopback is right.
    let server = serve(ServerConfig::new("tcp://127.0.0.1:0"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut opts = options("every-if-lo", &server.address());
    opts.control_listen = "tcp://0.0.0.0:0".into();
    opts.data_listen = "0.0.0.0:0".into();
    opts.insecure = true;
    let engine = start_engine_runtime(opts, pool())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        engine.control_address.starts_with("tcp://127.0.0.1:"),
        "{}",
        engine.control_address
    );
    assert!(
        engine.data_address.starts_with("127.0.0.1:"),
        "{}",
        engine.data_address
    );
    engine.runtime.shutdown().await;
    server.stop().await;

    // A bootstrap server reached through a real interface: that interface is advertised.
    let Some(ip) = lan_ip() else {
        let why = "its LAN half needs an interface besides loopback, with a route";
        handoff_testkit::skip_this(handoff_testkit::Need::Lan, why);
        return;
    };
    let server = serve(ServerConfig::new("tcp://0.0.0.0:0").with_key(key()))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let port = server.local_addr().port();
    let mut opts = options("every-if-lan", &format!("tcp://{ip}:{port}"));
    opts.control_listen = "tcp://0.0.0.0:0".into();
    opts.data_listen = "0.0.0.0:0".into();
    opts.key = Some(key());
    let engine = start_engine_runtime(opts, pool())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        engine.control_address.starts_with(&format!("tcp://{ip}:")),
        "{} (expected {ip})",
        engine.control_address
    );
    assert!(
        engine.data_address.starts_with(&format!("{ip}:")),
        "{} (expected {ip})",
        engine.data_address
    );
    engine.runtime.shutdown().await;
    server.stop().await;
}
