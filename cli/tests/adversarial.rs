//! A hostile peer against real processes (the `handoff` binary on loopback), speaking the
//! real wire formats: ZMTP, the bootstrap protocol, the control protocol. Each case asserts
//! that honest requests complete within their deadlines during the attack, that no process
//! crashes, that `status` answers within [`STATUS_WITHIN`], and that the attacked process's
//! resident memory grows by less than [`RSS_GROWTH_BYTES_MAX`].

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use handoff::bootstrap::{BootstrapClient, ClientConfig, Key, StatusReply};
use handoff_transport::wire::{self, Message, WorkerRecord};
use handoff_transport::{RankInfo, RequestId, Role};
use serde_json::Value;

mod common;

const T: Duration = Duration::from_secs(30);

/// How fast `status` must answer during an attack.
const STATUS_WITHIN: Duration = Duration::from_secs(1);

/// How much an attacked process's resident memory may grow during an attack.
const RSS_GROWTH_BYTES_MAX: u64 = 64 << 20;

const SECRET: &str = "adversarial-suite-secret-0123456789";

/// One attack at a time: each loads the machine, and deadlines are asserted.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

struct Proc {
    name: String,
    child: Child,
    lines: mpsc::Receiver<String>,
    stderr: Arc<Mutex<String>>,
}

impl Proc {
    fn spawn(name: &str, args: &[&str], secret: bool) -> Proc {
        let mut cmd = Command::new(common::handoff_bin());
        cmd.args(args)
            .env("RUST_LOG", "warn")
            .env_remove("HANDOFF_SECRET_FILE")
            .env_remove("HANDOFF_SECRET")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if secret {
            cmd.env("HANDOFF_SECRET", SECRET);
        }
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawn handoff: {e}"));
        let (tx, lines) = mpsc::channel();
        let out = child.stdout.take().unwrap_or_else(|| panic!("stdout"));
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut err = child.stderr.take().unwrap_or_else(|| panic!("stderr"));
        let sink = stderr.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = err.read(&mut buf) {
                if n == 0 {
                    return;
                }
                let mut s = sink.lock().unwrap_or_else(|e| e.into_inner());
                if s.len() < 1 << 20 {
                    s.push_str(&String::from_utf8_lossy(&buf[..n]));
                }
            }
        });
        Proc {
            name: name.to_string(),
            child,
            lines,
            stderr,
        }
    }

    fn expect(&self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + T;
        while let Ok(line) = self
            .lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            if let Ok(v) = serde_json::from_str::<Value>(&line) {
                if pred(&v) {
                    return v;
                }
            }
        }
        panic!(
            "{}: no {what} within {T:?}; stderr:\n{}",
            self.name,
            self.stderr.lock().unwrap_or_else(|e| e.into_inner())
        );
    }

    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    fn rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    }

    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

fn bootstrap(secret: bool) -> (Proc, String) {
    let p = Proc::spawn(
        "bootstrap",
        &[
            "bootstrap",
            "--listen",
            "tcp://127.0.0.1:0",
            "--expire-after",
            "3",
        ],
        secret,
    );
    let line = p
        .lines
        .recv_timeout(T)
        .unwrap_or_else(|_| panic!("bootstrap server announces its address"));
    let addr = line.rsplit(' ').next().unwrap_or_default().to_string();
    assert!(addr.starts_with("tcp://"), "{line}");
    (p, addr)
}

fn worker(name: &str, role: &str, engine: &str, boot: &str, extra: &[&str], secret: bool) -> Proc {
    let mut args = common::worker_args(role, engine, boot);
    args.extend([
        "--transport",
        "tcp",
        "--heartbeat-ms",
        "500",
        "--heartbeats-missed",
        "6",
    ]);
    args.extend_from_slice(extra);
    let p = Proc::spawn(name, &args, secret);
    p.expect("ready", |v| v["event"] == "ready");
    p
}

/// Decode's eight requests from prefill `P`: every one `Done` and verified.
fn honest_requests_complete(boot: &str, secret: bool, prefix: &str) {
    let d = worker(
        "decode",
        "decode",
        &format!("D-{prefix}"),
        boot,
        &[
            "--requests",
            "8",
            "--prefill",
            "P",
            "--request-prefix",
            prefix,
            "--bootstrap-timeout-s",
            "20",
        ],
        secret,
    );
    let summary = d.expect("summary", |v| v["event"] == "summary");
    assert_eq!(
        summary["done"],
        8,
        "{summary}; decode's stderr:\n{}",
        d.stderr.lock().unwrap_or_else(|e| e.into_inner())
    );
    assert_eq!(summary["corrupted"], 0, "{summary}");
}

fn key() -> Option<Key> {
    Some(Key::new(SECRET.as_bytes()).unwrap_or_else(|e| panic!("{e}")))
}

fn tokio() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("{e}"))
}

/// `status`, timed: it must answer within [`STATUS_WITHIN`].
fn status(rt: &tokio::runtime::Runtime, boot: &str, key: Option<Key>) -> StatusReply {
    let client = BootstrapClient::new(boot, key, ClientConfig::default());
    let started = Instant::now();
    let reply = rt
        .block_on(client.status(Instant::now() + T))
        .unwrap_or_else(|e| panic!("status: {e}"));
    assert!(
        started.elapsed() < STATUS_WITHIN,
        "status took {:?}",
        started.elapsed()
    );
    reply
}

fn incarnations(reply: &StatusReply, engine: &str) -> Vec<u64> {
    reply
        .engines
        .iter()
        .filter(|e| e.engine_id.as_str() == engine)
        .flat_map(|e| e.workers.iter().map(|w| w.incarnation))
        .collect()
}

/// ZMTP's greeting and a DEALER's READY, as a raw client sends them.
fn zmtp_hello() -> Vec<u8> {
    let mut out = vec![0u8; 64];
    out[0] = 0xff;
    out[9] = 0x7f;
    out[10] = 3;
    out[12..16].copy_from_slice(b"NULL");
    let mut body = vec![5u8];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&6u32.to_be_bytes());
    body.extend_from_slice(b"DEALER");
    out.extend_from_slice(&[0x04, body.len() as u8]);
    out.extend_from_slice(&body);
    out
}

/// One ZMTP message of one frame.
fn zmtp_frame(body: &[u8]) -> Vec<u8> {
    let mut out = vec![0x02];
    out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    out.extend_from_slice(body);
    out
}

fn hostport(addr: &str) -> &str {
    addr.trim_start_matches("tcp://")
}

/// A relay that records what its one client sends upstream (the bootstrap session of a
/// worker, for replaying it later).
fn recording_relay(upstream: &str) -> (String, Arc<Mutex<Vec<u8>>>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
    let addr = format!(
        "tcp://{}",
        listener.local_addr().unwrap_or_else(|e| panic!("{e}"))
    );
    let log = Arc::new(Mutex::new(Vec::new()));
    let record = log.clone();
    let upstream = hostport(upstream).to_string();
    std::thread::spawn(move || {
        let Ok((mut client, _)) = listener.accept() else {
            return;
        };
        let Ok(mut server) = TcpStream::connect(&upstream) else {
            return;
        };
        let (Ok(mut client_w), Ok(mut server_r)) = (client.try_clone(), server.try_clone()) else {
            return;
        };
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut server_r, &mut client_w);
        });
        let mut buf = vec![0u8; 1 << 16];
        while let Ok(n) = client.read(&mut buf) {
            if n == 0 {
                break;
            }
            record
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend_from_slice(&buf[..n]);
            if server.write_all(&buf[..n]).is_err() {
                break;
            }
        }
    });
    (addr, log)
}

fn forged_record(engine: &str, incarnation: u64) -> WorkerRecord {
    WorkerRecord {
        rank: RankInfo::single(engine),
        role: Role::Prefill,
        incarnation,
        control_address: "tcp://127.0.0.1:9".into(),
        data_address: "127.0.0.1:9".into(),
        data_descriptor: Vec::new(),
    }
}

#[test]
fn with_a_secret_forged_and_replayed_registrations_and_strangers_get_nowhere() {
    let _one = serial();
    let rt = tokio();
    let (mut boot, addr) = bootstrap(true);
    // Prefill registers through a relay that records its whole bootstrap session.
    let (relay, capture) = recording_relay(&addr);
    let prefill = ["--serve", "--requests", "8", "--request-prefix", "sec"];
    let mut p = worker("prefill", "prefill", "P", &relay, &prefill, true);
    let before = status(&rt, &addr, key());
    let live = incarnations(&before, "P");
    assert_eq!(live.len(), 1, "{before:?}");
    let rss0 = boot.rss();

    // A stranger without the secret registers as P with a higher incarnation: refused.
    let stranger = BootstrapClient::new(&addr, None, ClientConfig::default());
    let forged =
        rt.block_on(stranger.register(forged_record("P", u64::MAX - 1), Instant::now() + T));
    assert!(forged.is_err(), "a forged registration was accepted");
    // The prefill's captured session (handshake, sealed Register and heartbeats) replayed
    // on new connections, again and again: every one refused.
    let captured = capture.lock().unwrap_or_else(|e| e.into_inner()).clone();
    assert!(captured.len() > 100, "nothing captured");
    for _ in 0..20 {
        if let Ok(mut s) = TcpStream::connect(hostport(&addr)) {
            let _ = s.write_all(&captured);
        }
    }
    // Oversized frames before the handshake: 16 MiB announced, cut off before anything
    // beyond the handshake's size is read.
    let mut hugs = Vec::new();
    for _ in 0..50 {
        if let Ok(mut s) = TcpStream::connect(hostport(&addr)) {
            let mut bytes = zmtp_hello();
            bytes.push(0x02);
            bytes.extend_from_slice(&(16u64 << 20).to_be_bytes());
            bytes.extend_from_slice(&[0u8; 60_000]);
            let _ = s.write_all(&bytes);
            hugs.push(s);
        }
    }
    // A stranger naming live request ids to prefill's control port: refused before any.
    let control = before.engines[0].workers[0].control_address.clone();
    if let Ok(mut s) = TcpStream::connect(hostport(&control)) {
        let mut bytes = zmtp_hello();
        for i in 0..8 {
            let abort = wire::encode(
                &Message::Abort(wire::messages::Abort {
                    request_id: RequestId::new(format!("sec-{i}")),
                    reason: handoff_transport::FailureReason::AbortedByEngine,
                }),
                None,
            );
            if let Ok(frame) = abort {
                bytes.extend_from_slice(&zmtp_frame(&frame));
            }
        }
        let _ = s.write_all(&bytes);
    }

    honest_requests_complete(&addr, true, "sec");
    let after = status(&rt, &addr, key());
    assert_eq!(
        incarnations(&after, "P"),
        live,
        "the registry changed: {after:?}"
    );
    assert!(boot.alive() && p.alive(), "a process died");
    let growth = boot.rss().saturating_sub(rss0);
    assert!(
        growth < RSS_GROWTH_BYTES_MAX,
        "bootstrap grew {growth} bytes"
    );

    // The prefill dies; its captured session replayed cannot keep its record alive.
    p.kill9();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Ok(mut s) = TcpStream::connect(hostport(&addr)) {
            let _ = s.write_all(&captured);
        }
        if incarnations(&status(&rt, &addr, key()), "P").is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "a dead prefill's record was kept alive by replayed frames"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    assert!(boot.alive());
}

#[test]
fn idle_and_trickling_floods_and_unread_replies_do_not_lock_out_honest_peers() {
    let _one = serial();
    let rt = tokio();
    let (mut boot, addr) = bootstrap(false);
    let prefill = ["--serve", "--requests", "8", "--request-prefix", "flood"];
    let mut p = worker("prefill", "prefill", "P", &addr, &prefill, false);
    let control = status(&rt, &addr, None).engines[0].workers[0]
        .control_address
        .clone();
    let (rss_boot, rss_p) = (boot.rss(), p.rss());
    // 600 idle connections (past the ZMTP handshake) to each of the bootstrap server and
    // prefill's control port, half of them trickling a frame header.
    let mut flood = Vec::new();
    for i in 0..600 {
        for target in [&addr, &control] {
            if let Ok(mut s) = TcpStream::connect(hostport(target)) {
                let mut bytes = zmtp_hello();
                if i % 2 == 0 {
                    bytes.extend_from_slice(&[0x02, 0, 0, 0, 0, 0, 1]);
                }
                let _ = s.write_all(&bytes);
                flood.push(s);
            }
        }
    }
    // A client that asks for status thousands of times and never reads an answer.
    let mut unread = TcpStream::connect(hostport(&addr)).unwrap_or_else(|e| panic!("{e}"));
    let request = wire::encode(&Message::StatusRequest(wire::StatusRequest), None)
        .unwrap_or_else(|e| panic!("{e}"));
    let mut bytes = zmtp_hello();
    for _ in 0..20_000 {
        bytes.extend_from_slice(&zmtp_frame(&request));
    }
    let _ = unread.set_write_timeout(Some(Duration::from_secs(5)));
    let _ = unread.write_all(&bytes);
    // A message flood on one connection to prefill's control port: ghost request ids.
    let mut ghosts = Vec::new();
    ghosts.extend_from_slice(&zmtp_hello());
    for i in 0..20_000 {
        let msg = Message::Abort(wire::messages::Abort {
            request_id: RequestId::new(format!("ghost-{i}")),
            reason: handoff_transport::FailureReason::AbortedByEngine,
        });
        if let Ok(frame) = wire::encode(&msg, None) {
            ghosts.extend_from_slice(&zmtp_frame(&frame));
        }
    }
    if let Ok(mut s) = TcpStream::connect(hostport(&control)) {
        let _ = s.set_write_timeout(Some(Duration::from_secs(5)));
        let _ = s.write_all(&ghosts);
        flood.push(s);
    }

    let _ = status(&rt, &addr, None);
    honest_requests_complete(&addr, false, "flood");
    let _ = status(&rt, &addr, None);
    assert!(boot.alive() && p.alive(), "a process died");
    for (who, before, now) in [
        ("bootstrap", rss_boot, boot.rss()),
        ("prefill", rss_p, p.rss()),
    ] {
        let growth = now.saturating_sub(before);
        assert!(growth < RSS_GROWTH_BYTES_MAX, "{who} grew {growth} bytes");
    }
}
