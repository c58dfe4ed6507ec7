//! Real etcd members for tests of discovery on etcd: started on loopback ports of their own
//! with data directories of their own, killed on drop.

/// A real etcd member started by a test on loopback ports of its own, its data in a
/// directory of its own; killed (SIGKILL) and its directory removed on drop.
pub struct Etcd {
    /// `127.0.0.1:PORT` of its client port.
    pub client: String,
    child: std::process::Child,
    dir: std::path::PathBuf,
    /// What it prints (its stderr), kept to say why it did not start.
    log: std::path::PathBuf,
}

/// How many times a start is tried on fresh ports when a member exits at once.
const START_ATTEMPTS: usize = 4;

/// How long a started member may take to serve.
const SERVE_WITHIN: std::time::Duration = std::time::Duration::from_secs(30);

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
        // A port picked free may be taken again before etcd binds it (an outgoing
        // connection of another test gets it as its ephemeral port): etcd then exits at
        // once. Such a start is seen as the member's exit and retried on fresh ports.
        let mut failures = Vec::new();
        for _ in 0..START_ATTEMPTS {
            match Self::start(n) {
                Ok(members) => return Some(members),
                Err(why) => failures.push(why),
            }
        }
        panic!(
            "etcd did not start in {START_ATTEMPTS} attempts:\n{}",
            failures.join("\n")
        );
    }

    /// Spawns `n` members on fresh ports and waits until each serves: `Err` (what it
    /// printed) where a member exits first; a panic where none exits and one does not serve
    /// within [`SERVE_WITHIN`].
    fn start(n: usize) -> Result<Vec<Etcd>, String> {
        let ports: Vec<(u16, u16)> = (0..n).map(|_| (free_port(), free_port())).collect();
        let initial: Vec<String> = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}"))
            .collect();
        let token = format!("handoff-test-{}-{}", std::process::id(), free_port());
        let mut members: Vec<Etcd> = ports
            .iter()
            .enumerate()
            .map(|(i, (client, peer))| {
                let dir = std::env::temp_dir().join(format!("{token}-m{i}"));
                let log = std::env::temp_dir().join(format!("{token}-m{i}.log"));
                let client_url = format!("http://127.0.0.1:{client}");
                let peer_url = format!("http://127.0.0.1:{peer}");
                let stderr = std::fs::File::create(&log).expect("create an etcd log file");
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
                    .stderr(stderr)
                    .spawn()
                    .expect("spawn etcd");
                Etcd {
                    client: format!("127.0.0.1:{client}"),
                    child,
                    dir,
                    log,
                }
            })
            .collect();
        // Members of a cluster serve only once it has a leader, so all are watched at once:
        // one that exits fails the start at once instead of its peers waiting it out.
        let deadline = std::time::Instant::now() + SERVE_WITHIN;
        let mut serving = vec![false; members.len()];
        loop {
            for (m, up) in members.iter_mut().zip(serving.iter_mut()) {
                m.exited()?;
                *up = *up || m.post("/v3/kv/range", "{\"key\":\"AA==\"}").is_some();
            }
            if serving.iter().all(|up| *up) {
                return Ok(members);
            }
            if std::time::Instant::now() >= deadline {
                let logs: Vec<String> = members
                    .iter()
                    .map(|m| format!("{}: {}", m.client, m.log_tail()))
                    .collect();
                panic!(
                    "etcd did not serve within {SERVE_WITHIN:?}:\n{}",
                    logs.join("\n")
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    /// Whether the member has exited; `Err` with its status and the end of its log if so.
    fn exited(&mut self) -> Result<(), String> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(format!(
                "etcd at {} exited ({status}): {}",
                self.client,
                self.log_tail()
            )),
            Err(e) => Err(format!("etcd at {}: wait: {e}", self.client)),
        }
    }

    /// The last lines of what the member printed.
    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(5)..].join("\n")
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
        let _ = std::fs::remove_file(&self.log);
    }
}

/// The `etcd://` bootstrap address of `members` in cluster `cluster`.
pub fn address(members: &[&Etcd], cluster: &str) -> String {
    let endpoints: Vec<&str> = members.iter().map(|m| m.client.as_str()).collect();
    format!("etcd://{}/{cluster}", endpoints.join(","))
}
