//! Real etcd members for tests of discovery on etcd: started on loopback ports of their own
//! with data directories of their own, killed on drop.

/// A real etcd member started by a test on loopback ports of its own, its data in a
/// directory of its own; killed (SIGKILL) and its directory removed on drop.
pub struct Etcd {
    /// `127.0.0.1:PORT` of its client port.
    pub client: String,
    child: std::process::Child,
    dir: std::path::PathBuf,
}

/// A loopback port free right now (the kernel's pick, released at once).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

impl Etcd {
    /// One member, or `None` (after saying why, as `handoff_testkit::skip` allows) where
    /// `etcd` is not installed.
    pub fn single(test: &str) -> Option<Etcd> {
        Self::cluster(test, 1).map(|mut members| members.remove(0))
    }

    /// A cluster of `n` members, each serving clients once the cluster has a leader.
    pub fn cluster(test: &str, n: usize) -> Option<Vec<Etcd>> {
        if std::process::Command::new("etcd")
            .arg("--version")
            .output()
            .is_err()
        {
            crate::skip(
                crate::Need::Etcd,
                test,
                "no `etcd` on PATH (Debian etcd-server)",
            );
            return None;
        }
        let ports: Vec<(u16, u16)> = (0..n).map(|_| (free_port(), free_port())).collect();
        let initial: Vec<String> = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}"))
            .collect();
        let token = format!("handoff-test-{}-{}", std::process::id(), free_port());
        let members: Vec<Etcd> = ports
            .iter()
            .enumerate()
            .map(|(i, (client, peer))| {
                let dir = std::env::temp_dir().join(format!("{token}-m{i}"));
                let client_url = format!("http://127.0.0.1:{client}");
                let peer_url = format!("http://127.0.0.1:{peer}");
                let child = std::process::Command::new("etcd")
                    .args(["--name", &format!("m{i}")])
                    .arg("--data-dir")
                    .arg(&dir)
                    .args(["--listen-client-urls", &client_url])
                    .args(["--advertise-client-urls", &client_url])
                    .args(["--listen-peer-urls", &peer_url])
                    .args(["--initial-advertise-peer-urls", &peer_url])
                    .args(["--initial-cluster", &initial.join(",")])
                    .args(["--initial-cluster-token", &token])
                    .args(["--initial-cluster-state", "new"])
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .spawn()
                    .expect("spawn etcd");
                Etcd {
                    client: format!("127.0.0.1:{client}"),
                    child,
                    dir,
                }
            })
            .collect();
        for m in &members {
            m.wait_serving();
        }
        Some(members)
    }

    /// Waits (30 s at most) until the member answers a read through its JSON gateway.
    fn wait_serving(&self) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            if self.post("/v3/kv/range", "{\"key\":\"AA==\"}").is_some() {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "etcd at {} did not serve within 30 s",
                self.client
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    /// One JSON `POST` to this member: the body of a 200 answer, else `None`.
    pub fn post(&self, path: &str, body: &str) -> Option<String> {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&self.client).ok()?;
        s.set_read_timeout(Some(std::time::Duration::from_secs(2)))
            .ok()?;
        write!(
            s,
            "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.client,
            body.len()
        )
        .ok()?;
        let mut answer = String::new();
        s.read_to_string(&mut answer).ok()?;
        let (head, body) = answer.split_once("\r\n\r\n")?;
        head.starts_with("HTTP/1.1 200").then(|| body.to_string())
    }

    /// Whether this member is the cluster's leader now (its own status says so).
    pub fn is_leader(&self) -> bool {
        let Some(status) = self.post("/v3/maintenance/status", "{}") else {
            return false;
        };
        let field = |name: &str| {
            let at = status.find(&format!("\"{name}\":\""))? + name.len() + 4;
            status[at..].split('"').next().map(str::to_string)
        };
        // `member_id` is in the header, `leader` at the top level.
        matches!((field("member_id"), field("leader")), (Some(me), Some(leader)) if me == leader)
    }

    /// SIGKILL, as a crashed member.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill9();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The `etcd://` bootstrap address of `members` in cluster `cluster`.
pub fn address(members: &[&Etcd], cluster: &str) -> String {
    let endpoints: Vec<&str> = members.iter().map(|m| m.client.as_str()).collect();
    format!("etcd://{}/{cluster}", endpoints.join(","))
}
