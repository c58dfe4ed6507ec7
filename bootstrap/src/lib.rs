//! `handoff-bootstrap`: the bootstrap server, its client, and secure-by-default exposure.
//!
//! Every prefill and decode worker registers a [`WorkerRecord`] (engine, rank, role,
//! incarnation, control and data addresses) with one bootstrap server; decode workers (and
//! routers) ask it for an engine's workers once every rank of that engine has registered.
//! This replaces the bootstrap servers of vLLM's Mooncake connector and SGLang, without
//! their failures (seed 001): registration and query failures are named errors returned to
//! the caller, never only logged; every wait has a deadline; registration is idempotent and
//! a conflicting one is refused by name; ranks may be sparse and need not start at zero; an
//! empty registry answers `UnknownEngine`, never crashes.
//!
//! Over the wire: one ZMTP message carries one [`handoff_transport::wire`] frame, signed
//! when a shared [`Key`] is configured. The server is a ROUTER
//! ([`handoff_transport::zmtp::Router`]), each client one DEALER. Requests and answers:
//! `Register` → `RegisterOk` | `RegisterConflict`; `Query` → `QueryReply`; `StatusRequest`
//! → `StatusReply`; `Unregister` → `Unregistered`; `Heartbeat` → `Heartbeat` (the server's
//! incarnation, the same `seq`); optionally `Hello` → `HelloAck` first. Anything else, or a
//! frame that does not decode (bad magic, other protocol version, truncated, oversized, bad
//! or missing HMAC), is answered with a `ProtocolError` and the connection is closed; the
//! server logs it with the peer's address and goes on serving everyone else.
//!
//! Liveness: a registered client heartbeats every [`HEARTBEAT_INTERVAL_DEFAULT`]; the server
//! removes a record not heard from for [`EXPIRE_AFTER_DEFAULT`] (three intervals, so one
//! lost heartbeat is not a death). A disconnect alone removes nothing: a worker that
//! reconnects keeps its record (its client registers again on every new connection).
//!
//! # Layout
//! - [`registry`]: the registry as plain data (no IO, no clock): every registration rule.
//! - [`server`]: the server actor, [`serve`], the [`BootstrapServer`] handle.
//! - [`client`]: [`BootstrapClient`] (register + keepalive, query + cache, status).
//! - [`exposure`]: secure by default on a network (a secret or `--insecure` off loopback),
//!   the secret from a file or the environment ([`load_key`]), the advertised host.
//! - [`metrics`]: the server's Prometheus metrics ([`BootstrapMetrics`]).
//! - [`status`]: the registry as `handoff bootstrap status` shows it (table, JSON).
//! - `error`: [`BootstrapError`].
//! - this file: the named limits and defaults.

pub mod client;
mod error;
pub mod etcd;
pub mod exposure;
pub mod metrics;
pub mod registry;
pub mod server;
pub mod status;

pub use client::{
    BootstrapClient, ClientConfig, LostRanks, Superseded, LOST_INCARNATIONS_MAX, LOST_KEPT_DEFAULT,
};
pub use error::BootstrapError;
pub use etcd::EtcdDirectory;
pub use exposure::load_key;
pub use handoff_transport::auth::Key;
pub use handoff_transport::wire::{QueryAnswer, StatusReply, WorkerRecord};
pub use metrics::BootstrapMetrics;
pub use server::{serve, BootstrapServer, ServerConfig};

use std::time::Duration;

/// Where `handoff bootstrap` listens unless told otherwise: loopback, so that a server
/// started without a secret is reachable from this host only (a network address needs a
/// secret or `--insecure`, see [`crate::exposure`]). Port 7400 rather than the 8998 that
/// SGLang and vLLM's Mooncake bootstrap servers default to, so both can run on one host
/// while a deployment migrates.
pub const LISTEN_DEFAULT: &str = "tcp://127.0.0.1:7400";

/// Where `handoff bootstrap status` connects unless told otherwise.
pub const CONNECT_DEFAULT: &str = "tcp://127.0.0.1:7400";

/// How often a registered client heartbeats. Two seconds: a dead worker is noticed within
/// seconds, and a thousand workers cost the server 500 tiny messages a second.
pub const HEARTBEAT_INTERVAL_DEFAULT: Duration = Duration::from_secs(2);

/// How long the server keeps a silent worker's record: three heartbeat intervals, so one
/// lost or late heartbeat never expires a live worker, two do not either.
pub const EXPIRE_AFTER_DEFAULT: Duration = Duration::from_secs(6);

/// Longest one client exchange (connect, send, answer) may take before the connection is
/// presumed dead and dropped. The server answers in microseconds; two seconds covers a TCP
/// SYN retransmission (1 s initial RTO) on a lossy network.
pub const ATTEMPT_TIMEOUT_DEFAULT: Duration = Duration::from_secs(2);

/// First pause between client retries: short, since the usual cause (server not up yet,
/// engine not complete yet) clears within a second.
pub const BACKOFF_MIN: Duration = Duration::from_millis(50);

/// Longest pause between client retries: a thousand workers retrying against a restarting
/// server cost it at most 500 connection attempts a second.
pub const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// Most workers the registry holds over all engines. A status reply lists each in about a
/// kilobyte at most (two addresses of up to 512 bytes), so 8192 of them fit in one frame;
/// the largest deployments run a few thousand ranks.
pub const WORKERS_MAX: usize = 8192;

/// Router events handed to the server actor and not yet handled: bounds the actor's mailbox
/// (ractor's is unbounded); past it the pump waits, and TCP backpressure does the rest.
pub const SERVER_EVENTS_INFLIGHT_MAX: usize = 1024;

/// Replies and disconnects the server actor has queued for the router and the pump has not
/// performed yet. Past it a reply is dropped (logged); the client's deadline covers it.
pub const SERVER_OUTBOX_MAX: usize = 4096;

/// Shortest interval between expiry sweeps, whatever `expire_after` is (tests use tens of
/// milliseconds; the sweep runs every `expire_after / 4`).
pub const SWEEP_INTERVAL_MIN: Duration = Duration::from_millis(10);

/// How long [`BootstrapServer::status`], [`BootstrapServer::query`] and
/// [`BootstrapServer::stop`] wait for the actor.
pub const SERVER_CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Calls queued for one client's driver task: callers beyond it wait (under their deadline).
pub const CLIENT_CALLS_QUEUED_MAX: usize = 64;

/// Registrations one client keeps alive. A worker process registers one rank, or a handful
/// when one process drives several GPUs.
pub const CLIENT_REGISTRATIONS_MAX: usize = 64;

/// Engines whose answers one client caches; past it the first in id order is forgotten.
pub const CACHED_ENGINES_MAX: usize = handoff_transport::wire::limits::ENGINES_MAX;

/// Largest secret file accepted, in bytes: secrets are tens of bytes; a bigger file is a
/// wrong path, not a key.
pub const SECRET_FILE_BYTES_MAX: u64 = 4096;

/// Default `--timeout` of `handoff bootstrap status`, in seconds.
pub const STATUS_TIMEOUT_DEFAULT: Duration = Duration::from_secs(5);

const _: () = assert!(
    EXPIRE_AFTER_DEFAULT.as_millis() == 3 * HEARTBEAT_INTERVAL_DEFAULT.as_millis(),
    "expiry is documented as three heartbeat intervals"
);
const _: () = assert!(BACKOFF_MIN.as_millis() < BACKOFF_MAX.as_millis());
const _: () = assert!(BACKOFF_MAX.as_millis() <= EXPIRE_AFTER_DEFAULT.as_millis());
// A status reply listing every worker (at most ~1.1 KB each: rank, incarnation, two
// addresses of ADDRESS_BYTES_MAX) and every engine id fits in one frame.
const _: () = assert!(
    WORKERS_MAX * (2 * handoff_transport::wire::limits::ADDRESS_BYTES_MAX + 64)
        + handoff_transport::wire::limits::ENGINES_MAX
            * (handoff_transport::wire::limits::ENGINE_ID_BYTES_MAX + 64)
        <= handoff_transport::wire::FRAME_PAYLOAD_BYTES_MAX
);
const _: () = assert!(
    handoff_transport::wire::limits::ENGINES_MAX <= WORKERS_MAX,
    "every engine can hold at least one worker"
);
