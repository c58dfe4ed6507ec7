//! The ZMTP layer over real TCP on loopback: round trips, hostile peers that must cost the
//! listener one connection and nothing else, and interop with libzmq (through pyzmq) when
//! it is installed.

use std::io::{Read, Write};
use std::time::Duration;

use handoff_transport::zmtp::{Dealer, Router, RouterEvent};

const T: Duration = Duration::from_secs(5);

async fn next_message(router: &mut Router) -> (handoff_transport::zmtp::ConnId, Vec<Vec<u8>>) {
    loop {
        match tokio::time::timeout(T, router.recv())
            .await
            .expect("router event in time")
        {
            Some(RouterEvent::Message { conn, frames, .. }) => return (conn, frames),
            Some(_) => continue,
            None => panic!("router closed"),
        }
    }
}

async fn echo_once(router: &mut Router) {
    let addr = format!("tcp://{}", router.local_addr());
    let mut dealer = Dealer::connect(&addr, b"probe", T)
        .await
        .expect("valid client connects");
    dealer.send(vec![b"ping".to_vec(), vec![7; 300]]).unwrap();
    let (conn, frames) = next_message(router).await;
    assert_eq!(frames, vec![b"ping".to_vec(), vec![7; 300]]);
    router.send(conn, vec![b"pong".to_vec()]).unwrap();
    let reply = tokio::time::timeout(T, dealer.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(reply, vec![b"pong".to_vec()]);
}

#[tokio::test]
async fn dealer_and_router_exchange_multipart_messages() {
    let mut router = Router::bind("tcp://127.0.0.1:0").await.unwrap();
    echo_once(&mut router).await;
    echo_once(&mut router).await;
}

fn greeting() -> Vec<u8> {
    let mut g = vec![0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    g
}

fn ready_dealer() -> Vec<u8> {
    let mut body = vec![5u8];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&6u32.to_be_bytes());
    body.extend_from_slice(b"DEALER");
    let mut f = vec![0x04, body.len() as u8];
    f.extend(body);
    f
}

/// Sends `bytes` on a raw TCP connection, then waits for the server to close it (or 2 s).
fn hostile(addr: std::net::SocketAddr, bytes: &[u8]) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let _ = s.write_all(bytes);
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut sink = [0u8; 256];
    while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_peers_cost_one_connection_and_the_router_keeps_serving() {
    let mut router = Router::bind("tcp://127.0.0.1:0").await.unwrap();
    let addr = router.local_addr();
    let mut after_handshake = greeting();
    after_handshake.extend(ready_dealer());
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "random bytes",
            (0..500u32)
                .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
                .collect(),
        ),
        (
            "http request",
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
        ),
        ("truncated greeting", greeting()[..20].to_vec()),
        ("zmtp 2.0 greeting", {
            let mut g = greeting();
            g[10] = 2;
            g
        }),
        ("CURVE mechanism", {
            let mut g = greeting();
            g[12..17].copy_from_slice(b"CURVE");
            g
        }),
        ("1 TiB frame (aborts zeromq 0.7)", {
            let mut b = after_handshake.clone();
            b.push(0x02);
            b.extend((1u64 << 40).to_be_bytes());
            b
        }),
        ("4 GiB frame", {
            let mut b = after_handshake.clone();
            b.push(0x02);
            b.extend((4u64 << 30).to_be_bytes());
            b
        }),
        ("reserved flag bits", {
            let mut b = after_handshake.clone();
            b.extend([0x80, 1, 0]);
            b
        }),
        ("too many frames", {
            let mut b = after_handshake.clone();
            for _ in 0..10 {
                b.extend([0x01, 1, 0]);
            }
            b
        }),
        ("message before READY", {
            let mut b = greeting();
            b.extend([0x00, 1, 0]);
            b
        }),
        ("PUB socket type", {
            let mut b = greeting();
            let mut r = ready_dealer();
            let n = r.len();
            r[n - 6..].copy_from_slice(b"PUBXXX");
            b.extend(r);
            b
        }),
    ];
    for (name, bytes) in cases {
        let join = tokio::task::spawn_blocking(move || hostile(addr, &bytes));
        tokio::time::timeout(Duration::from_secs(10), join)
            .await
            .unwrap_or_else(|_| panic!("{name}: hung"))
            .unwrap();
        echo_once(&mut router).await;
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let rss_kb: u64 = status
        .lines()
        .find(|l| l.starts_with("VmHWM"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!(
        rss_kb < 512 * 1024,
        "peak RSS {rss_kb} kB: a hostile length was allocated"
    );
}

/// Real libzmq (through pyzmq) as a DEALER against our ROUTER. Skips, saying why, without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libzmq_dealer_talks_to_our_router() {
    let probe = std::process::Command::new("python3")
        .args(["-c", "import zmq"])
        .output();
    if !probe.is_ok_and(|o| o.status.success()) {
        let why = "pyzmq is not installed (pip install pyzmq): no libzmq to talk to";
        handoff_testkit::skip_this(handoff_testkit::Need::Pyzmq, why);
        return;
    }
    let mut router = Router::bind("tcp://127.0.0.1:0").await.unwrap();
    let script = format!(
        "import zmq\nc=zmq.Context()\ns=c.socket(zmq.DEALER)\ns.setsockopt(zmq.RCVTIMEO,5000)\ns.connect('tcp://{}')\ns.send_multipart([b'hello',b'x'*1000])\nprint(s.recv_multipart()[0].decode())",
        router.local_addr()
    );
    let child = tokio::process::Command::new("python3")
        .args(["-c", &script])
        .output();
    let serve = async {
        let (conn, frames) = next_message(&mut router).await;
        assert_eq!(frames[0], b"hello");
        assert_eq!(frames[1].len(), 1000);
        router.send(conn, vec![b"from-rust".to_vec()]).unwrap();
    };
    let (out, ()) = tokio::join!(child, serve);
    let out = out.unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "from-rust");
}
