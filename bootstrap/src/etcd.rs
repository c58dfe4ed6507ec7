//! Discovery on etcd: the same registry a `handoff bootstrap` server keeps, held in the etcd
//! cluster an operator already runs, so no single bootstrap process stands between a
//! cluster and its transfers.
//!
//! Selected by the bootstrap address `etcd://HOST:PORT[,HOST:PORT...][/CLUSTER]` (cluster
//! `default` when none is given). Spoken over etcd's v3 JSON gateway (`POST /v3/...` on the
//! client port), plain HTTP: off loopback that needs the caller's explicit `insecure`.
//!
//! Keys, per cluster: `handoff/CLUSTER/w/ENGINE-HEX/DP.TP.PP`, each holding one worker's
//! record as a wire frame (`Register`, HMAC-tagged under the cluster's shared key when one is
//! set, so a writer without the key cannot plant a worker), attached to a lease the worker
//! keeps alive: a dead worker's record expires with its lease. Each renewal reads the key
//! back: a newer process of the rank that rewrote it under its own lease supersedes this
//! one ([`EtcdDirectory::superseded`]), and the lease is renewed no more.
//!
//! The rules are the bootstrap server's own ([`Registry`]): a registration reads its
//! engine's records, replays them into a fresh registry, applies itself there (the same
//! record again is fine, a higher incarnation replaces, a contradiction is
//! [`BootstrapError::Conflict`]) and writes in a transaction that holds only if no key of the
//! engine changed since that read (retried, bounded). A lookup reads the engine's records
//! the same way and answers as the registry does (ready once dp × tp × pp ranks are in).
//! Every call has a deadline; an unreachable etcd is [`BootstrapError::Unavailable`] naming
//! the endpoints, for exactly the calls that needed it.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

use handoff_transport::auth::Key;
use handoff_transport::wire::{self, Message, QueryAnswer, StatusReply, WorkerRecord};
use handoff_transport::zmtp::ConnId;
use handoff_transport::{EngineId, RankInfo};

use crate::client::{Lost, LostRanks, Superseded, SupersededBoard};
use crate::registry::{Origin, RegisterOutcome, Registry};
use crate::{BootstrapError, CACHED_ENGINES_MAX};

/// The scheme that selects etcd as the directory.
pub const SCHEME: &str = "etcd://";

/// The cluster name when the address names none.
pub const CLUSTER_DEFAULT: &str = "default";

/// Longest cluster name: it is part of every key.
pub const CLUSTER_BYTES_MAX: usize = 64;

/// Endpoints one address may list.
pub const ENDPOINTS_MAX: usize = 16;

/// A worker's lease: its record outlives the worker by at most this long. Renewed every
/// third of it, so two renewals may fail (an etcd leader change) before it lapses.
pub const LEASE_TTL: Duration = Duration::from_secs(10);

/// How long a worker lost at an incarnation is refused to new lookups unless its process
/// answers a handshake first: twice a lease, so that a dead worker's record is gone by then
/// (its lease lapsed), and one still there was kept alive by its process since the loss.
const LOST_KEPT: Duration = Duration::from_secs(2 * LEASE_TTL.as_secs());

/// One HTTP exchange with one etcd member, at most.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// Largest etcd answer read: a whole engine's records, or a cluster's for `status`.
pub const ANSWER_BYTES_MAX: usize = 64 << 20;

/// Times a registration retries its transaction when another writer changed the engine
/// between its read and its write.
const CAS_ATTEMPTS_MAX: usize = 16;

/// Pause between rounds over every endpoint while none answers.
const ROUND_BACKOFF: Duration = Duration::from_millis(100);

/// A cached lookup is read again after this long even when the watch saw no change: the
/// bound on how stale an answer can be if the watch is silently cut.
pub const CACHE_AGE_MAX: Duration = Duration::from_secs(30);

/// A watch stream silent this long is opened again (etcd answers progress requests within
/// it; a cut stream would otherwise look idle forever).
const WATCH_IDLE_MAX: Duration = Duration::from_secs(20);

/// Largest piece of a watch stream read (one chunk, or one JSON line).
const WATCH_PIECE_BYTES_MAX: usize = 16 << 20;

/// Pauses between attempts to open the watch: from the first to the last, doubling.
const WATCH_BACKOFF: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(2));

/// Engines whose last change the watch remembers (by revision), at most.
const CHANGED_ENGINES_MAX: usize = 4096;

/// How long a dial's lookup ([`EtcdDirectory::query_including_lost`]) waits for a member
/// before it takes the last answer read for the engine, when there is one: a request
/// already paired reaches its peers while etcd is away (the handshake says whether the
/// process there is the one it knows).
pub const KNOWN_FALLBACK_AFTER: Duration = Duration::from_secs(1);

/// A parsed `etcd://` address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdAddress {
    /// `HOST:PORT` of each member, in the order given.
    pub endpoints: Vec<String>,
    /// The key prefix's cluster name.
    pub cluster: String,
}

impl EtcdAddress {
    /// Parses `etcd://HOST:PORT[,HOST:PORT...][/CLUSTER]`.
    ///
    /// # Errors
    /// [`BootstrapError::Invalid`] naming what is wrong.
    pub fn parse(address: &str) -> Result<EtcdAddress, BootstrapError> {
        let bad = |detail: String| BootstrapError::Invalid {
            detail: format!("bootstrap address {address:?}: {detail}"),
        };
        let rest = address
            .strip_prefix(SCHEME)
            .ok_or_else(|| bad(format!("not an {SCHEME} address")))?;
        let (hosts, cluster) = match rest.split_once('/') {
            Some((hosts, cluster)) => (hosts, cluster),
            None => (rest, CLUSTER_DEFAULT),
        };
        if cluster.is_empty()
            || cluster.len() > CLUSTER_BYTES_MAX
            || !cluster
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        {
            return Err(bad(format!(
                "cluster {cluster:?}: 1 to {CLUSTER_BYTES_MAX} of A-Z a-z 0-9 . _ -"
            )));
        }
        let endpoints: Vec<String> = hosts.split(',').map(str::to_string).collect();
        if endpoints.len() > ENDPOINTS_MAX {
            return Err(bad(format!(
                "{} endpoints, at most {ENDPOINTS_MAX}",
                endpoints.len()
            )));
        }
        for e in &endpoints {
            let (host, port) = e
                .rsplit_once(':')
                .ok_or_else(|| bad(format!("endpoint {e:?} is not HOST:PORT")))?;
            if host.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0) {
                return Err(bad(format!("endpoint {e:?} is not HOST:PORT")));
            }
        }
        Ok(EtcdAddress {
            endpoints,
            cluster: cluster.to_string(),
        })
    }

    /// The key prefix of every worker of the cluster.
    fn workers_prefix(&self) -> String {
        format!("handoff/{}/w/", self.cluster)
    }

    /// The key prefix of one engine's workers.
    fn engine_prefix(&self, engine: &EngineId) -> String {
        format!(
            "{}{}/",
            self.workers_prefix(),
            hex(engine.as_str().as_bytes())
        )
    }

    /// One worker's key.
    fn key(&self, rank: &RankInfo) -> String {
        format!(
            "{}{}.{}.{}",
            self.engine_prefix(&rank.engine_id),
            rank.dp_rank,
            rank.tp_rank,
            rank.pp_rank
        )
    }
}

/// `address` with its etcd cluster named `cluster` (`--cluster`): an `etcd://` address
/// without a cluster of its own takes it; one naming the same cluster is unchanged.
///
/// # Errors
/// [`BootstrapError::Invalid`] for another cluster in the address, a cluster name that is
/// not allowed, or an address that is not `etcd://`.
pub fn with_cluster(address: &str, cluster: Option<&str>) -> Result<String, BootstrapError> {
    let Some(cluster) = cluster else {
        return Ok(address.to_string());
    };
    let Some(rest) = address.strip_prefix(SCHEME) else {
        return Err(BootstrapError::Invalid {
            detail: format!("--cluster {cluster}: names an etcd cluster, and {address} is not an {SCHEME} address"),
        });
    };
    let named = match rest.split_once('/') {
        Some((_, own)) if own != cluster => {
            return Err(BootstrapError::Invalid {
                detail: format!("--cluster {cluster}: the address {address} names cluster {own}"),
            })
        }
        Some(_) => address.to_string(),
        None => format!("{address}/{cluster}"),
    };
    EtcdAddress::parse(&named)?;
    Ok(named)
}

impl std::fmt::Display for EtcdAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{SCHEME}{}/{}", self.endpoints.join(","), self.cluster)
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The end of the key range that holds every key starting with `prefix` (etcd's
/// `range_end`): the prefix with its last byte incremented (prefixes here end in `/`).
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    end
}

// ------------------------------------------------------------------------- base64

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding, as etcd's JSON gateway takes keys and values.
pub fn b64(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | u32::from(b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(B64[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn unb64(text: &str) -> Option<Vec<u8>> {
    let bytes = text.as_bytes();
    if bytes.len() % 4 != 0 {
        return None;
    }
    let mut out = Vec::with_capacity(bytes.len() / 4 * 3);
    for chunk in bytes.chunks(4) {
        let pad = chunk.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 {
            return None;
        }
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            let v = if i >= 4 - pad {
                0
            } else {
                B64.iter().position(|&a| a == c)? as u32
            };
            n |= v << (18 - 6 * i);
        }
        for i in 0..3 - pad {
            out.push((n >> (16 - 8 * i)) as u8);
        }
    }
    Some(out)
}

// --------------------------------------------------------------------------- HTTP

/// The bytes of a JSON `POST` of `body` to `path` on `endpoint`; `close` asks the server to
/// close the connection after its answer (a watch keeps it open).
fn post_request(endpoint: &str, path: &str, body: &str, close: bool) -> String {
    let connection = if close { "Connection: close\r\n" } else { "" };
    format!(
        "POST {path} HTTP/1.1\r\nHost: {endpoint}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{connection}\r\n{body}",
        body.len()
    )
}

/// One `POST` of `body` to `path` on `endpoint`, the whole answer read (bounded), within
/// `limit`. Plain HTTP/1.1, one exchange per connection.
async fn post(endpoint: &str, path: &str, body: &Value, limit: Duration) -> Result<Value, String> {
    let exchange = async {
        let mut stream = TcpStream::connect(endpoint)
            .await
            .map_err(|e| format!("{endpoint}: {e}"))?;
        stream
            .write_all(post_request(endpoint, path, &body.to_string(), true).as_bytes())
            .await
            .map_err(|e| format!("{endpoint}: {e}"))?;
        let mut answer = Vec::new();
        (&mut stream)
            .take(ANSWER_BYTES_MAX as u64 + 1)
            .read_to_end(&mut answer)
            .await
            .map_err(|e| format!("{endpoint}: {e}"))?;
        if answer.len() > ANSWER_BYTES_MAX {
            return Err(format!("{endpoint}: answer over {ANSWER_BYTES_MAX} bytes"));
        }
        parse_response(&answer).map_err(|e| format!("{endpoint}{path}: {e}"))
    };
    tokio::time::timeout(limit, exchange)
        .await
        .unwrap_or_else(|_| Err(format!("{endpoint}: no answer within {limit:?}")))
}

/// The JSON body of a whole HTTP response (status 200), plain or chunked.
fn parse_response(bytes: &[u8]) -> Result<Value, String> {
    let split = bytes
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("no end of headers")?;
    let head = std::str::from_utf8(&bytes[..split]).map_err(|_| "headers not UTF-8")?;
    let mut body = &bytes[split + 4..];
    let mut lines = head.split("\r\n");
    let status = lines.next().unwrap_or_default();
    let code = status.split(' ').nth(1).unwrap_or_default();
    let chunked = lines.any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    let mut unchunked = Vec::new();
    if chunked {
        loop {
            let end = body
                .windows(2)
                .position(|w| w == b"\r\n")
                .ok_or("chunk size cut short")?;
            let size = std::str::from_utf8(&body[..end])
                .ok()
                .and_then(|s| usize::from_str_radix(s.split(';').next()?.trim(), 16).ok())
                .ok_or("bad chunk size")?;
            let start = end + 2;
            if size == 0 {
                break;
            }
            let chunk = body
                .get(start..start.checked_add(size).ok_or("bad chunk size")?)
                .ok_or("chunk cut short")?;
            unchunked.extend_from_slice(chunk);
            body = body.get(start + size + 2..).ok_or("chunk cut short")?;
        }
        body = &unchunked;
    }
    let value: Value =
        serde_json::from_slice(body).map_err(|e| format!("{status}: not JSON ({e})"))?;
    if code != "200" {
        let why = value
            .get("message")
            .or_else(|| value.get("error"))
            .and_then(Value::as_str)
            .unwrap_or("no message");
        return Err(format!("{status}: {why}"));
    }
    Ok(value)
}

/// An etcd int64, which the gateway writes as a string (or leaves out when zero).
fn int(value: Option<&Value>) -> i64 {
    match value {
        Some(Value::String(s)) => s.parse().unwrap_or(0),
        Some(Value::Number(n)) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

/// The engine (hex) part of a worker key under `prefix`.
fn engine_of<'k>(key: &'k str, prefix: &str) -> Option<&'k str> {
    key.strip_prefix(prefix)?.split('/').next()
}

/// Reads a watch's HTTP answer: the head, then its JSON lines out of the chunked body,
/// every read bounded in time ([`WATCH_IDLE_MAX`]) and size ([`WATCH_PIECE_BYTES_MAX`]).
struct WatchReader {
    stream: TcpStream,
    /// Bytes read and not yet taken.
    buf: Vec<u8>,
    /// Body bytes (chunk contents) not yet split into lines.
    body: Vec<u8>,
}

impl WatchReader {
    fn new(stream: TcpStream) -> Self {
        WatchReader {
            stream,
            buf: Vec::new(),
            body: Vec::new(),
        }
    }

    /// Reads more bytes into `buf`.
    async fn fill(&mut self) -> Result<(), String> {
        if self.buf.len() > WATCH_PIECE_BYTES_MAX {
            return Err(format!("a watch piece over {WATCH_PIECE_BYTES_MAX} bytes"));
        }
        let mut more = [0u8; 16 << 10];
        let n = tokio::time::timeout(WATCH_IDLE_MAX, self.stream.read(&mut more))
            .await
            .map_err(|_| format!("silent for {WATCH_IDLE_MAX:?}"))?
            .map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("closed".into());
        }
        self.buf.extend_from_slice(&more[..n]);
        Ok(())
    }

    /// Bytes up to `sep` in `buf` (taken, the separator dropped), reading as needed.
    async fn until(&mut self, sep: &[u8]) -> Result<Vec<u8>, String> {
        loop {
            if let Some(at) = self.buf.windows(sep.len()).position(|w| w == sep) {
                let piece = self.buf[..at].to_vec();
                self.buf.drain(..at + sep.len());
                return Ok(piece);
            }
            self.fill().await?;
        }
    }

    /// The status line and headers; the body must be chunked.
    async fn head(&mut self) -> Result<String, String> {
        let head = String::from_utf8(self.until(b"\r\n\r\n").await?)
            .map_err(|_| "headers not UTF-8".to_string())?;
        let chunked = head.lines().any(|l| {
            let l = l.to_ascii_lowercase();
            l.starts_with("transfer-encoding:") && l.contains("chunked")
        });
        if head.starts_with("HTTP/1.1 200") && !chunked {
            return Err("a watch answer that is not chunked".into());
        }
        Ok(head.lines().next().unwrap_or_default().to_string())
    }

    /// The next non-empty line of the body.
    async fn line(&mut self) -> Result<Vec<u8>, String> {
        loop {
            if let Some(at) = self.body.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.body.drain(..=at).collect();
                if line.iter().any(|b| !b.is_ascii_whitespace()) {
                    return Ok(line);
                }
                continue;
            }
            if self.body.len() > WATCH_PIECE_BYTES_MAX {
                return Err(format!("a watch line over {WATCH_PIECE_BYTES_MAX} bytes"));
            }
            let size = self.until(b"\r\n").await?;
            let size = std::str::from_utf8(&size)
                .ok()
                .and_then(|s| usize::from_str_radix(s.split(';').next()?.trim(), 16).ok())
                .filter(|&n| n <= WATCH_PIECE_BYTES_MAX)
                .ok_or("bad chunk size")?;
            if size == 0 {
                return Err("the watch stream ended".into());
            }
            while self.buf.len() < size + 2 {
                self.fill().await?;
            }
            self.body.extend_from_slice(&self.buf[..size]);
            self.buf.drain(..size + 2);
        }
    }
}

// ------------------------------------------------------------------------ client

/// The etcd members of one address, tried in turn.
struct Members {
    address: EtcdAddress,
    /// The member to try first (the last that answered).
    next: AtomicUsize,
}

impl Members {
    /// `POST path` to the members, from the last that answered, round after round, until
    /// one answers or `deadline` passes: then [`BootstrapError::Unavailable`] naming every
    /// endpoint and the last error.
    async fn call(
        &self,
        path: &str,
        body: &Value,
        deadline: Instant,
    ) -> Result<Value, BootstrapError> {
        let n = self.address.endpoints.len();
        let mut last = String::from("no attempt made before the deadline");
        loop {
            let first = self.next.load(Ordering::Relaxed);
            for k in 0..n {
                let i = (first + k) % n;
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(self.unavailable(last));
                }
                match post(
                    &self.address.endpoints[i],
                    path,
                    body,
                    left.min(CALL_TIMEOUT),
                )
                .await
                {
                    Ok(v) => {
                        self.next.store(i, Ordering::Relaxed);
                        return Ok(v);
                    }
                    Err(e) => last = e,
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(self.unavailable(last));
            }
            tokio::time::sleep(left.min(ROUND_BACKOFF)).await;
        }
    }

    fn unavailable(&self, last_error: String) -> BootstrapError {
        BootstrapError::Unavailable {
            address: self.address.to_string(),
            last_error,
        }
    }

    /// The value of every key under `prefix` and the store's revision at the read.
    async fn range(
        &self,
        prefix: &str,
        deadline: Instant,
    ) -> Result<(Vec<Vec<u8>>, i64), BootstrapError> {
        let body = json!({
            "key": b64(prefix.as_bytes()),
            "range_end": b64(&prefix_end(prefix)),
        });
        let answer = self.call("/v3/kv/range", &body, deadline).await?;
        let revision = int(answer.pointer("/header/revision"));
        let kvs = answer
            .get("kvs")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let mut out = Vec::with_capacity(kvs.len());
        for kv in kvs {
            let value = kv
                .get("value")
                .and_then(Value::as_str)
                .map_or(Some(Vec::new()), unb64)
                .ok_or_else(|| BootstrapError::BadReply {
                    address: self.address.to_string(),
                    detail: format!("a value under {prefix} that is not base64"),
                })?;
            out.push(value);
        }
        Ok((out, revision))
    }

    /// A lease of `ttl`: its id.
    async fn grant(&self, ttl: Duration, deadline: Instant) -> Result<i64, BootstrapError> {
        let answer = self
            .call(
                "/v3/lease/grant",
                &json!({ "TTL": ttl.as_secs() }),
                deadline,
            )
            .await?;
        match int(answer.get("ID")) {
            0 => Err(self.unavailable(format!("lease grant answered without an id: {answer}"))),
            id => Ok(id),
        }
    }

    /// Renews lease `id`: its remaining TTL in seconds, 0 when etcd no longer has it.
    async fn keep_alive(&self, id: i64, deadline: Instant) -> Result<i64, BootstrapError> {
        let answer = self
            .call(
                "/v3/lease/keepalive",
                &json!({ "ID": id.to_string() }),
                deadline,
            )
            .await?;
        Ok(int(answer.pointer("/result/TTL")))
    }

    /// Puts `value` at `key` under `lease` if no key under `guard` was written after
    /// `revision`: whether it was put.
    async fn put_if_unchanged(
        &self,
        guard: &str,
        revision: i64,
        key: &str,
        value: &[u8],
        lease: i64,
        deadline: Instant,
    ) -> Result<bool, BootstrapError> {
        let body = json!({
            "compare": [{
                "key": b64(guard.as_bytes()),
                "range_end": b64(&prefix_end(guard)),
                "target": "MOD",
                "result": "LESS",
                "mod_revision": (revision + 1).to_string(),
            }],
            "success": [{ "request_put": {
                "key": b64(key.as_bytes()),
                "value": b64(value),
                "lease": lease.to_string(),
            }}],
        });
        let answer = self.call("/v3/kv/txn", &body, deadline).await?;
        Ok(answer.get("succeeded").and_then(Value::as_bool) == Some(true))
    }
}

/// The worker directory on etcd: registration with a kept-alive lease, lookups cached
/// until a peer of the engine is lost. Cheap to clone.
#[derive(Clone)]
pub struct EtcdDirectory {
    inner: Arc<Inner>,
}

struct Inner {
    members: Members,
    key: Option<Key>,
    /// Ready answers by engine, with when they were read.
    cache: Mutex<BTreeMap<EngineId, (Vec<WorkerRecord>, Instant)>>,
    /// The last ready answer read for each engine, whatever the watch said: not trusted to
    /// be current, only what a dial falls back to while no member answers.
    known: Mutex<BTreeMap<EngineId, Vec<WorkerRecord>>>,
    lost: LostRanks,
    keeper: Mutex<Option<JoinHandle<()>>>,
    watch: Mutex<Watch>,
    /// Registrations whose key a newer process of their rank holds now.
    superseded: SupersededBoard,
}

/// What the watch on the cluster's records has established.
#[derive(Default)]
struct Watch {
    task: Option<JoinHandle<()>>,
    /// The stream is open and etcd confirmed it: answers may be cached.
    live: bool,
    /// The revision the open stream watches from: an answer read before it may predate a
    /// change no stream reported (one made while the watch was down), so it is not cached.
    since: i64,
    /// The revision of the last change seen, by engine key (hex): an answer read at an
    /// older revision is not cached.
    changed: BTreeMap<String, i64>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(keeper) = lock(&self.keeper).take() {
            keeper.abort();
        }
        if let Some(task) = lock(&self.watch).task.take() {
            task.abort();
        }
    }
}

/// Keeps `value` for `engine`, forgetting the first engine held when the map is full
/// ([`CACHED_ENGINES_MAX`]).
fn keep_bounded<V>(map: &mut BTreeMap<EngineId, V>, engine: &EngineId, value: V) {
    if map.len() >= CACHED_ENGINES_MAX && !map.contains_key(engine) {
        map.pop_first();
    }
    map.insert(engine.clone(), value);
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The origin records replayed from etcd are given in a scratch registry: none (no
/// connection keeps them alive; their leases do).
fn no_origin() -> Origin {
    Origin {
        conn: ConnId(0),
        peer: SocketAddr::from(([0, 0, 0, 0], 0)),
    }
}

impl EtcdDirectory {
    /// A directory on the etcd cluster at `address` (`etcd://...`); records are tagged and
    /// checked with `key` when given. Connects on first use.
    ///
    /// # Errors
    /// [`BootstrapError::Invalid`] for an address that does not parse.
    pub fn new(address: &str, key: Option<Key>) -> Result<EtcdDirectory, BootstrapError> {
        Ok(EtcdDirectory {
            inner: Arc::new(Inner {
                members: Members {
                    address: EtcdAddress::parse(address)?,
                    next: AtomicUsize::new(0),
                },
                key,
                cache: Mutex::new(BTreeMap::new()),
                known: Mutex::new(BTreeMap::new()),
                lost: LostRanks::new(LOST_KEPT),
                keeper: Mutex::new(None),
                watch: Mutex::new(Watch::default()),
                superseded: SupersededBoard::new(),
            }),
        })
    }

    /// The address, as `etcd://ENDPOINTS/CLUSTER`.
    pub fn address(&self) -> String {
        self.inner.members.address.to_string()
    }

    /// The records stored under `prefix`, decoded and checked; a value that does not
    /// decode (or whose tag does not check) is skipped and logged, never trusted.
    async fn records(
        &self,
        prefix: &str,
        deadline: Instant,
    ) -> Result<(Vec<WorkerRecord>, i64), BootstrapError> {
        let (values, revision) = self.inner.members.range(prefix, deadline).await?;
        let mut records = Vec::with_capacity(values.len());
        for value in values {
            match wire::decode(&value, self.inner.key.as_ref()) {
                Ok(Message::Register(record)) => records.push(record),
                Ok(other) => tracing::warn!(prefix, kind = ?std::mem::discriminant(&other),
                    "etcd holds a value that is not a worker record; ignored"),
                Err(e) => tracing::warn!(prefix, error = %e,
                    "etcd holds a record that does not decode (or is not tagged with this cluster's key); ignored"),
            }
        }
        Ok((records, revision))
    }

    /// The records replayed into a registry of their own, as the bootstrap server would
    /// hold them (records that contradict earlier ones are left out, with a log line).
    fn replay(records: Vec<WorkerRecord>) -> Registry {
        let mut registry = Registry::new();
        let now = Instant::now();
        for record in records {
            match registry.register(record, no_origin(), now) {
                RegisterOutcome::Conflict(kept) => tracing::warn!(kept = %kept.rank,
                    "etcd holds two contradicting records of one rank; the first is used"),
                RegisterOutcome::Refused(why) => {
                    tracing::warn!(%why, "etcd holds a record the registry refuses; ignored")
                }
                _ => {}
            }
        }
        registry
    }

    /// Resolves once etcd holds `rank` for a newer process than our `incarnation` (that
    /// process's record), as the keep-alive finds it: on every renewal it reads the rank's
    /// key back (a newer process's registration rewrites it under its own lease while ours
    /// lives on), and a registration again after a lapsed lease may meet the newer record.
    /// Pending for as long as that does not happen.
    pub fn superseded(
        &self,
        rank: &RankInfo,
        incarnation: u64,
    ) -> impl std::future::Future<Output = WorkerRecord> + Send + 'static {
        self.inner.superseded.wait(rank, incarnation)
    }

    /// The record etcd holds for `ours`'s rank, if it holds one a newer process wrote.
    async fn newer_holder(&self, ours: &WorkerRecord, deadline: Instant) -> Option<WorkerRecord> {
        let prefix = self
            .inner
            .members
            .address
            .engine_prefix(&ours.rank.engine_id);
        let (records, _) = self.records(&prefix, deadline).await.ok()?;
        records.into_iter().find(|r| Superseded::succeeds(ours, r))
    }

    /// Registers `record` under a new lease and keeps the lease alive in the background
    /// (re-registering if etcd loses it), until the directory is dropped or a newer process
    /// of the rank holds its key ([`superseded`](Self::superseded)).
    ///
    /// # Errors
    /// [`BootstrapError::Conflict`] when the cluster holds a contradicting record (never
    /// retried), [`BootstrapError::Refused`] for a bound, [`BootstrapError::Unavailable`]
    /// when no member answered before `deadline`.
    pub async fn register(
        &self,
        record: WorkerRecord,
        deadline: Instant,
    ) -> Result<(), BootstrapError> {
        let lease = self.put_record(&record, deadline).await?;
        let me = Arc::downgrade(&self.inner);
        let keeper = tokio::spawn(async move {
            let mut lease = lease;
            loop {
                tokio::time::sleep(LEASE_TTL / 3).await;
                let Some(inner) = me.upgrade() else { return };
                let dir = EtcdDirectory { inner };
                let deadline = Instant::now() + LEASE_TTL / 3;
                match dir.inner.members.keep_alive(lease, deadline).await {
                    Ok(ttl) if ttl > 0 => {
                        if let Some(holder) = dir.newer_holder(&record, deadline).await {
                            return dir.lost_to(&record, &holder);
                        }
                    }
                    Ok(_) => {
                        tracing::warn!(rank = %record.rank, "etcd lost this worker's lease; registering again");
                        match dir.put_record(&record, Instant::now() + LEASE_TTL).await {
                            Ok(id) => lease = id,
                            Err(BootstrapError::Conflict { existing, .. })
                                if Superseded::succeeds(&record, &existing) =>
                            {
                                return dir.lost_to(&record, &existing);
                            }
                            Err(e) => {
                                tracing::warn!(rank = %record.rank, error = %e, "registering again on etcd failed; retrying")
                            }
                        }
                    }
                    Err(e) => {
                        tracing::warn!(rank = %record.rank, error = %e, "renewing the etcd lease failed; retrying")
                    }
                }
            }
        });
        if let Some(old) = lock(&self.inner.keeper).replace(keeper) {
            old.abort();
        }
        Ok(())
    }

    /// The keep-alive of `ours` ends: `holder`, a newer process of the rank, holds its key
    /// (told to [`superseded`](Self::superseded)).
    fn lost_to(&self, ours: &WorkerRecord, holder: &WorkerRecord) {
        self.inner.superseded.tell(ours, holder);
        tracing::error!(
            rank = %ours.rank,
            incarnation = ours.incarnation,
            holder_incarnation = holder.incarnation,
            holder_control = %holder.control_address,
            "registration lost: etcd holds this rank for a newer process; its lease is no longer renewed"
        );
    }

    /// Grants a lease and writes `record` under it by the registry's rules: the lease id.
    async fn put_record(
        &self,
        record: &WorkerRecord,
        deadline: Instant,
    ) -> Result<i64, BootstrapError> {
        let members = &self.inner.members;
        let address = &members.address;
        let lease = members.grant(LEASE_TTL, deadline).await?;
        let value = wire::encode(&Message::Register(record.clone()), self.inner.key.as_ref())
            .map_err(|e| BootstrapError::Invalid {
                detail: format!("the worker record does not encode: {e}"),
            })?;
        let prefix = address.engine_prefix(&record.rank.engine_id);
        for _ in 0..CAS_ATTEMPTS_MAX {
            let (records, revision) = self.records(&prefix, deadline).await?;
            let mut registry = Self::replay(records);
            match registry.register(record.clone(), no_origin(), Instant::now()) {
                RegisterOutcome::Conflict(existing) => {
                    return Err(BootstrapError::Conflict {
                        address: address.to_string(),
                        existing,
                    })
                }
                RegisterOutcome::Refused(detail) => {
                    return Err(BootstrapError::Refused {
                        address: address.to_string(),
                        detail,
                    })
                }
                _ => {}
            }
            let key = address.key(&record.rank);
            if members
                .put_if_unchanged(&prefix, revision, &key, &value, lease, deadline)
                .await?
            {
                tracing::info!(rank = %record.rank, incarnation = record.incarnation,
                    etcd = %address, "registered on etcd");
                return Ok(lease);
            }
        }
        Err(BootstrapError::Unavailable {
            address: address.to_string(),
            last_error: format!(
                "the engine's records kept changing under {CAS_ATTEMPTS_MAX} registration attempts"
            ),
        })
    }

    /// Every worker of `engine` once all its ranks have registered, from the cache if
    /// present; `NotReady` or `UnknownEngine` (not retried here: the caller's request asks
    /// again until its own deadline), `Lost` for a record of a worker this directory lost.
    ///
    /// # Errors
    /// As said, and [`BootstrapError::Unavailable`].
    pub async fn query(
        &self,
        engine: &EngineId,
        deadline: Instant,
    ) -> Result<Vec<WorkerRecord>, BootstrapError> {
        self.query_with(engine, deadline, Lost::Refused).await
    }

    /// [`query`](Self::query), with workers this directory lost included: for dialing a
    /// peer already known, not for pairing a new request (as
    /// [`BootstrapClient::query_including_lost`](crate::BootstrapClient::query_including_lost)).
    /// Not cached. When no member answers within [`KNOWN_FALLBACK_AFTER`], the last answer
    /// read for `engine` (by either kind of query), if there is one: etcd going away does
    /// not cut a request already paired off its peers.
    ///
    /// # Errors
    /// As [`query`](Self::query)'s, less `Lost`.
    pub async fn query_including_lost(
        &self,
        engine: &EngineId,
        deadline: Instant,
    ) -> Result<Vec<WorkerRecord>, BootstrapError> {
        self.query_with(engine, deadline, Lost::Included).await
    }

    async fn query_with(
        &self,
        engine: &EngineId,
        deadline: Instant,
        lost: Lost,
    ) -> Result<Vec<WorkerRecord>, BootstrapError> {
        self.start_watch();
        let fresh = lock(&self.inner.watch).live;
        if let Some((workers, read)) = lock(&self.inner.cache).get(engine).cloned() {
            if fresh && read.elapsed() < CACHE_AGE_MAX {
                return Ok(workers);
            }
        }
        let address = self.inner.members.address.to_string();
        let prefix = self.inner.members.address.engine_prefix(engine);
        // A dial to a peer already known takes the last answer read if no member answers
        // soon; pairing a new request never does (it fails by name instead).
        let known = match lost {
            Lost::Included => lock(&self.inner.known).get(engine).cloned(),
            Lost::Refused => None,
        };
        let read_by = match known {
            Some(_) => deadline.min(Instant::now() + KNOWN_FALLBACK_AFTER),
            None => deadline,
        };
        let (records, revision) = match (self.records(&prefix, read_by).await, known) {
            (Ok(read), _) => read,
            (Err(BootstrapError::Unavailable { last_error, .. }), Some(workers)) => {
                tracing::info!(etcd = %address, engine = %engine, error = %last_error,
                    "no etcd member answers; dialing with the last answer read");
                return Ok(workers);
            }
            (Err(e), _) => return Err(e),
        };
        let answer = Self::replay(records).query(engine);
        if let QueryAnswer::Ready { workers } = &answer {
            keep_bounded(&mut lock(&self.inner.known), engine, workers.clone());
        }
        match answer {
            QueryAnswer::Ready { workers } if lost == Lost::Included => Ok(workers),
            QueryAnswer::Ready { workers } => {
                self.inner.lost.check(&address, &workers, Instant::now())?;
                // Cached only while the watch can tell a later change, and only if it saw
                // none of this engine's since the read.
                let watch = lock(&self.inner.watch);
                let hex = hex(engine.as_str().as_bytes());
                if watch.live
                    && revision >= watch.since
                    && watch.changed.get(&hex).is_none_or(|&r| r <= revision)
                {
                    let answer = (workers.clone(), Instant::now());
                    keep_bounded(&mut lock(&self.inner.cache), engine, answer);
                }
                Ok(workers)
            }
            QueryAnswer::NotReady {
                registered,
                expected,
            } => Err(BootstrapError::NotReady {
                address,
                engine: engine.clone(),
                registered,
                expected,
            }),
            QueryAnswer::UnknownEngine => Err(BootstrapError::UnknownEngine {
                address,
                engine: engine.clone(),
            }),
        }
    }

    /// Starts the watch on the cluster's records, once: while it is open, a change to an
    /// engine's records drops that engine's cached answer.
    fn start_watch(&self) {
        let mut watch = lock(&self.inner.watch);
        if watch.task.is_some() {
            return;
        }
        let me = Arc::downgrade(&self.inner);
        watch.task = Some(tokio::spawn(async move {
            let mut pause = WATCH_BACKOFF.0;
            loop {
                let Some(inner) = me.upgrade() else { return };
                let dir = EtcdDirectory { inner };
                let opened = dir.watch_once().await;
                dir.watch_lost();
                match opened {
                    // It was open: a cut, not a refusal; open it again at once.
                    Ok(()) => pause = WATCH_BACKOFF.0,
                    Err(e) => {
                        tracing::debug!(etcd = %dir.inner.members.address, error = %e,
                            "etcd watch failed; answers are read anew until it is back");
                        pause = (pause * 2).min(WATCH_BACKOFF.1);
                    }
                }
                drop(dir);
                tokio::time::sleep(pause).await;
            }
        }));
    }

    /// The watch is down: nothing cached can be trusted to be current.
    fn watch_lost(&self) {
        lock(&self.inner.watch).live = false;
        lock(&self.inner.cache).clear();
    }

    /// One watch stream, on the first member that takes it, until it is cut or silent for
    /// [`WATCH_IDLE_MAX`]: `Ok` once it had been open, `Err` if it never opened.
    async fn watch_once(&self) -> Result<(), String> {
        let members = &self.inner.members;
        let prefix = members.address.workers_prefix();
        let body = json!({ "create_request": {
            "key": b64(prefix.as_bytes()),
            "range_end": b64(&prefix_end(&prefix)),
            "progress_notify": true,
        }})
        .to_string();
        let n = members.address.endpoints.len();
        let first = members.next.load(Ordering::Relaxed);
        let mut last = String::new();
        for k in 0..n {
            let endpoint = &members.address.endpoints[(first + k) % n];
            match self.watch_on(endpoint, &body, &prefix).await {
                Ok(()) => return Ok(()),
                Err((opened, e)) if opened => {
                    tracing::debug!(%endpoint, error = %e, "etcd watch cut");
                    return Ok(());
                }
                Err((_, e)) => last = e,
            }
        }
        Err(last)
    }

    /// The watch on one member: `Err((opened, why))` when it ends.
    async fn watch_on(
        &self,
        endpoint: &str,
        body: &str,
        prefix: &str,
    ) -> Result<(), (bool, String)> {
        let closed = |opened: bool| move |e: String| (opened, format!("{endpoint}: {e}"));
        let mut stream = tokio::time::timeout(CALL_TIMEOUT, TcpStream::connect(endpoint))
            .await
            .map_err(|_| "no connection".to_string())
            .and_then(|c| c.map_err(|e| e.to_string()))
            .map_err(closed(false))?;
        stream
            .write_all(post_request(endpoint, "/v3/watch", body, false).as_bytes())
            .await
            .map_err(|e| closed(false)(e.to_string()))?;
        let mut reader = WatchReader::new(stream);
        let head = reader.head().await.map_err(closed(false))?;
        if !head.starts_with("HTTP/1.1 200") {
            return Err(closed(false)(format!("watch refused: {head}")));
        }
        let mut opened = false;
        loop {
            let line = reader.line().await.map_err(closed(opened))?;
            let message: Value = serde_json::from_slice(&line)
                .map_err(|e| closed(opened)(format!("a watch message that is not JSON: {e}")))?;
            let Some(result) = message.get("result") else {
                return Err(closed(opened)(format!("watch error: {message}")));
            };
            if result.get("created").and_then(Value::as_bool) == Some(true) {
                // Changes before this point were not seen: start from a clean cache, and
                // cache nothing read before it.
                lock(&self.inner.cache).clear();
                let mut watch = lock(&self.inner.watch);
                watch.live = true;
                watch.since = int(result.pointer("/header/revision"));
                opened = true;
            }
            if result.get("canceled").and_then(Value::as_bool) == Some(true) {
                return Err(closed(opened)(format!("watch canceled: {result}")));
            }
            let revision = int(result.pointer("/header/revision"));
            let events = result.get("events").and_then(Value::as_array);
            for event in events.map(Vec::as_slice).unwrap_or_default() {
                let key = event
                    .pointer("/kv/key")
                    .and_then(Value::as_str)
                    .and_then(unb64)
                    .and_then(|k| String::from_utf8(k).ok());
                let Some(engine) = key.as_deref().and_then(|k| engine_of(k, prefix)) else {
                    continue;
                };
                self.changed(engine, revision);
            }
        }
    }

    /// The watch saw engine `hex` change at `revision`: its cached answer goes.
    fn changed(&self, engine_hex: &str, revision: i64) {
        let mut watch = lock(&self.inner.watch);
        if watch.changed.len() >= CHANGED_ENGINES_MAX && !watch.changed.contains_key(engine_hex) {
            watch.changed.pop_first();
        }
        watch.changed.insert(engine_hex.to_string(), revision);
        drop(watch);
        lock(&self.inner.cache).retain(|e, _| hex(e.as_str().as_bytes()) != engine_hex);
    }

    /// Whether a lookup of `engine` would be answered from the cache now.
    pub fn is_cached(&self, engine: &EngineId) -> bool {
        let live = lock(&self.inner.watch).live;
        live && lock(&self.inner.cache)
            .get(engine)
            .is_some_and(|(_, read)| read.elapsed() < CACHE_AGE_MAX)
    }

    /// Forgets the cached answer for `engine`.
    pub fn invalidate(&self, engine: &EngineId) {
        lock(&self.inner.cache).remove(engine);
    }

    /// Remembers that `rank` was lost at `incarnation` (until it registers anew, a lookup
    /// that finds that record fails by name) and forgets its engine's cached answer.
    pub fn mark_lost(&self, rank: &RankInfo, incarnation: u64) {
        self.inner.lost.insert(rank, incarnation, Instant::now());
        self.invalidate(&rank.engine_id);
    }

    /// The process of `rank` at `incarnation`, lost before, answered a handshake: lookups
    /// hand it out again. True when it was marked lost.
    pub fn mark_found(&self, rank: &RankInfo, incarnation: u64) -> bool {
        self.inner.lost.found(rank, incarnation, Instant::now())
    }

    /// Every engine of the cluster and its workers, as `handoff bootstrap status` shows a
    /// server's.
    ///
    /// # Errors
    /// [`BootstrapError::Unavailable`].
    pub async fn status(&self, deadline: Instant) -> Result<StatusReply, BootstrapError> {
        let prefix = self.inner.members.address.workers_prefix();
        let (records, _) = self.records(&prefix, deadline).await?;
        Ok(Self::replay(records).status())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_or_are_refused_by_name() {
        let a = EtcdAddress::parse("etcd://127.0.0.1:2379").unwrap();
        assert_eq!(a.endpoints, ["127.0.0.1:2379"]);
        assert_eq!(a.cluster, CLUSTER_DEFAULT);
        let a = EtcdAddress::parse("etcd://a:1,b:2,c:3/prod-1").unwrap();
        assert_eq!(a.endpoints, ["a:1", "b:2", "c:3"]);
        assert_eq!(a.cluster, "prod-1");
        assert_eq!(a.to_string(), "etcd://a:1,b:2,c:3/prod-1");
        for bad in [
            "tcp://127.0.0.1:2379",
            "etcd://",
            "etcd://host",
            "etcd://host:0",
            "etcd://host:99999",
            "etcd://:1",
            "etcd://a:1/",
            "etcd://a:1/x/y",
            "etcd://a:1/a b",
        ] {
            assert!(
                matches!(EtcdAddress::parse(bad), Err(BootstrapError::Invalid { .. })),
                "{bad}"
            );
        }
        let many = format!("etcd://{}", vec!["h:1"; ENDPOINTS_MAX + 1].join(","));
        assert!(EtcdAddress::parse(&many).is_err());
    }

    #[test]
    fn a_cluster_flag_names_the_cluster_or_is_refused() {
        assert_eq!(with_cluster("etcd://h:1", None).unwrap(), "etcd://h:1");
        assert_eq!(
            with_cluster("etcd://h:1", Some("c")).unwrap(),
            "etcd://h:1/c"
        );
        assert_eq!(
            with_cluster("etcd://h:1/c", Some("c")).unwrap(),
            "etcd://h:1/c"
        );
        for (address, cluster) in [
            ("etcd://h:1/c", "d"),
            ("tcp://h:1", "c"),
            ("etcd://h:1", "a b"),
        ] {
            assert!(
                matches!(
                    with_cluster(address, Some(cluster)),
                    Err(BootstrapError::Invalid { .. })
                ),
                "{address} {cluster}"
            );
        }
    }

    #[test]
    fn keys_separate_clusters_and_engines() {
        let a = EtcdAddress::parse("etcd://h:1/c").unwrap();
        let r = RankInfo::single("eng/1");
        let key = a.key(&r);
        assert!(key.starts_with(&a.engine_prefix(&r.engine_id)));
        assert!(key.starts_with(&a.workers_prefix()));
        // An engine whose id is another's prefix does not fall in its range.
        let other = a.engine_prefix(&EngineId::new("eng/10"));
        assert!(!other.starts_with(&a.engine_prefix(&r.engine_id)));
        assert_eq!(prefix_end("handoff/c/w/"), b"handoff/c/w0".to_vec());
    }

    #[test]
    fn base64_round_trips_and_refuses_garbage() {
        for n in 0..70usize {
            let bytes: Vec<u8> = (0..n).map(|i| (i * 37 + n) as u8).collect();
            assert_eq!(
                unb64(&b64(&bytes)).as_deref(),
                Some(bytes.as_slice()),
                "{n}"
            );
        }
        assert_eq!(b64(b"foo"), "Zm9v");
        assert_eq!(b64(b"fo"), "Zm8=");
        for bad in ["Zm9", "Zm9v!", "Z===", "Zm9v====", "****"] {
            assert_eq!(unb64(bad), None, "{bad}");
        }
    }

    #[test]
    fn responses_plain_chunked_and_bad_are_told_apart() {
        let plain = b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n{\"a\":\"1\"}";
        assert_eq!(int(parse_response(plain).unwrap().get("a")), 1);
        let chunked =
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{\"a\"\r\n5\r\n:\"7\"}\r\n0\r\n\r\n";
        assert_eq!(int(parse_response(chunked).unwrap().get("a")), 7);
        let refused = b"HTTP/1.1 400 Bad Request\r\n\r\n{\"error\":\"bad\",\"message\":\"nope\"}";
        assert!(parse_response(refused).unwrap_err().contains("nope"));
        for bad in [
            &b"HTTP/1.1 200 OK\r\n"[..],
            b"HTTP/1.1 200 OK\r\n\r\nnot json",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffff\r\nab",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\nab",
        ] {
            assert!(parse_response(bad).is_err(), "{bad:?}");
        }
    }
}
