//! handoff's TCP data transport: a [`DataServer`] that serves one worker's region, and a
//! [`DataClient`] that writes (push) and reads (pull) blocks of it.
//!
//! For machines without UCX, and as the fallback of `--transport auto`. The protocol is
//! our own ([`frame`]): a handshake (`Hello`: the client's rank; `HelloOk`: a
//! connection nonce and the region's shape), then pipelined operations, each naming a
//! request and up to [`SEGMENTS_PER_OP_MAX`] byte ranges of the server's region, carrying
//! at most [`OP_BYTES_MAX`] bytes. The server answers each in order (`WriteOk`;
//! `ReadData` then `ReadOk`; or `Error` with a [`RefusalCode`]).
//!
//! What a server guarantees, whatever a peer sends: every header is checked before its
//! metadata or data is read; nothing is allocated past the checked maxima; a write's bytes
//! go from the socket straight into the blocks (no staging copy), each receive taking
//! what the socket holds, without waiting, while the grant of the blocks it fills is held,
//! so a slow peer holds no grant and no byte lands once the grant ended (the rest of that
//! write is read and dropped, and the write refused); a read's bytes go from host blocks straight into the socket (one copy fewer),
//! with the grant checked before the first byte and again, the same grant, after the last,
//! and only then confirmed (`ReadOk`): a read of blocks whose grant ended meanwhile is
//! refused, never taken for good; every range is checked against the region and
//! then against the runtime's [`Grants`] before one byte moves; a refused operation is
//! answered and logged with the peer named, and the connection goes on; a malformed frame
//! closes that connection only. Every read of a connection has a timeout.
//!
//! # Layout
//! - [`frame`]: header, metadata encodings, HMAC tags.
//! - `server`: [`DataServer`], [`ServerConfig`], [`ServerStats`].
//! - `client`: [`DataClient`].
//!
//! [`RefusalCode`]: crate::data::RefusalCode
//! [`Grants`]: crate::data::Grants

mod client;
pub mod frame;
mod io;
mod server;
mod stripes;

use std::time::Duration;

pub use client::DataClient;
pub use server::{DataServer, ServerConfig, ServerStats};

/// Most bytes one operation carries. 4 MiB makes the per-operation costs (a header, a
/// grant call, an answer: ~10 µs) under 1% at 4 GB/s.
pub const OP_BYTES_MAX: usize = 4 << 20;

/// Block-slice pairs one pipelined plan holds at most (a pair is a piece or a few, of 24
/// bytes each: about 6 MiB). A call moving more slices of more blocks (token-major heads
/// between TP sizes: a slice per token and head) runs as several plans in turn, under its
/// one deadline.
pub const PLAN_PAIRS_MAX: usize = 1 << 18;

/// Most byte ranges one operation names: a full operation of 4 KiB blocks, none adjacent.
pub const SEGMENTS_PER_OP_MAX: usize = 1024;

/// Largest metadata of one frame, in bytes: holds [`SEGMENTS_PER_OP_MAX`] segments of 12
/// bytes and the longest request id (checked in [`frame`]).
pub const META_BYTES_MAX: usize = 16 * 1024;

/// Operations one call keeps sent but unanswered on its connection. Four 4 MiB operations
/// cover the round trip on loopback and on a LAN; more only grows the server's socket queue.
pub const OPS_INFLIGHT_MAX: usize = 4;

/// Connections a [`DataClient`] opens to its server at most: calls beyond this wait (within
/// their deadline) for a connection to come free. Eight lets eight requests move at once,
/// which fills a link; more would only multiply connections and their socket buffers.
pub const CLIENT_CONNECTIONS_MAX: usize = 8;

/// Connections a server accepts at once by default; a further one is answered `Busy` and
/// closed: 128 clients (peer workers) with [`CLIENT_CONNECTIONS_MAX`]/8 connections each.
/// A connection holds no buffer of an operation's size (writes land straight in the
/// blocks, reads go straight from them).
pub const SERVER_CONNECTIONS_MAX: usize = 128;

/// Connections from one address that have not said hello yet, at most, on a server: at
/// the bound the oldest of that address is evicted, so one source's flood pushes out its
/// own connections and no one else's. 64 covers eight peer workers on one host opening
/// their [`CLIENT_CONNECTIONS_MAX`] connections at once; each holds at most a `Hello`
/// frame's header and metadata (under 1 KiB) before it is evicted or says hello.
pub const SERVER_PENDING_PER_SOURCE_MAX: usize = 64;

/// Time a server gives a peer to send the rest of a frame once its header arrived (and the
/// `Hello` once the connection is accepted): bounds what a stalled peer holds.
pub const FRAME_READ_TIMEOUT_DEFAULT: Duration = Duration::from_secs(10);

/// A server closes a connection idle this long. Longer than [`POOL_IDLE_MAX`] so a
/// client's pooled connection is dropped by the client first.
pub const CONNECTION_IDLE_TIMEOUT_DEFAULT: Duration = Duration::from_secs(120);

/// Longest busy poll ([`ServerConfig::busy_poll`], [`DataClient::connect_with`]): a wait for
/// bytes that spins this long at most before the thread sleeps.
pub const BUSY_POLL_MAX: Duration = Duration::from_millis(1);

/// A client's spin, by default, for the answer to an operation of at most
/// [`SPIN_OP_BYTES_MAX`] bytes ([`BusyPoll::default`]). Waking a sleeping thread of another
/// core costs tens of microseconds on a virtual machine (an interrupt to an idle virtual CPU),
/// more than a loopback answer to one block: spinning meets the answer awake, so a one-block
/// transfer pays one wake-up (the server's) instead of two. 100 µs covers that wake-up and a
/// 16 KiB write on this project's 2-vCPU VM, where it halved the one-block p50.
pub const CLIENT_BUSY_POLL_DEFAULT: Duration = Duration::from_micros(100);

/// Largest operation whose answer a client spins for: an answer due within about
/// [`CLIENT_BUSY_POLL_DEFAULT`] (256 KiB at 2.5 GB/s). A larger operation's answer waits
/// for its bytes to cross, so the thread sleeps at once instead of spinning in vain.
pub const SPIN_OP_BYTES_MAX: usize = 256 << 10;

/// How long each side of the TCP data plane waits for bytes spinning before its thread
/// sleeps, at most [`BUSY_POLL_MAX`] each.
///
/// The default spins only where it pays and only while a transfer is in flight: a client
/// for the answer to a small operation ([`CLIENT_BUSY_POLL_DEFAULT`], [`SPIN_OP_BYTES_MAX`]);
/// a server never (it would spin after every frame, and its cores are usually an
/// engine's). An idle runtime never spins, and neither does a client of a server in its
/// own process (two runtimes of one process: the spin would hold a worker the server
/// needs). A spin yields to the runtime between
/// its looks, so the worker's other tasks run meanwhile. [`BusyPoll::both`] also has the server wait
/// for each next frame spinning (lower one-block latency still, for the CPU spun, on
/// workers with cores to spare); [`BusyPoll::OFF`] never spins.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BusyPoll {
    /// A client waiting for the answer to an operation of at most [`SPIN_OP_BYTES_MAX`].
    pub client: Duration,
    /// A server waiting for a connection's next frame.
    pub server: Duration,
}

impl BusyPoll {
    /// Nothing spins: every wait sleeps at once.
    pub const OFF: BusyPoll = BusyPoll {
        client: Duration::ZERO,
        server: Duration::ZERO,
    };

    /// Both sides spin up to `spin` (at most [`BUSY_POLL_MAX`]); zero is [`BusyPoll::OFF`].
    pub fn both(spin: Duration) -> BusyPoll {
        let spin = spin.min(BUSY_POLL_MAX);
        BusyPoll {
            client: spin,
            server: spin,
        }
    }

    /// An operator's setting (`--tcp-busy-poll-us`, `tcp_busy_poll_us`): unset is the
    /// default, a number of microseconds is [`BusyPoll::both`] of it.
    pub fn from_micros(micros: Option<u64>) -> BusyPoll {
        micros.map_or_else(BusyPoll::default, |us| {
            BusyPoll::both(Duration::from_micros(us))
        })
    }
}

impl Default for BusyPoll {
    fn default() -> Self {
        BusyPoll {
            client: CLIENT_BUSY_POLL_DEFAULT,
            server: Duration::ZERO,
        }
    }
}

/// A client drops a pooled connection unused this long rather than reuse it.
pub const POOL_IDLE_MAX: Duration = Duration::from_secs(60);

const _: () = assert!(POOL_IDLE_MAX.as_secs() < CONNECTION_IDLE_TIMEOUT_DEFAULT.as_secs());
const _: () = assert!(BUSY_POLL_MAX.as_micros() <= FRAME_READ_TIMEOUT_DEFAULT.as_micros());
const _: () = assert!(CLIENT_BUSY_POLL_DEFAULT.as_micros() <= BUSY_POLL_MAX.as_micros());
const _: () = assert!(OPS_INFLIGHT_MAX >= 1 && CLIENT_CONNECTIONS_MAX >= 1);
const _: () = assert!(SERVER_PENDING_PER_SOURCE_MAX <= SERVER_CONNECTIONS_MAX);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_spins_only_the_client_and_both_is_clamped() {
        let default = BusyPoll::default();
        assert_eq!(default.client, CLIENT_BUSY_POLL_DEFAULT);
        assert!(default.server.is_zero());
        assert_eq!(BusyPoll::both(Duration::ZERO), BusyPoll::OFF);
        assert_eq!(BusyPoll::from_micros(None), default);
        assert_eq!(BusyPoll::from_micros(Some(0)), BusyPoll::OFF);
        let spin = Duration::from_micros(250);
        assert_eq!(
            BusyPoll::both(spin),
            BusyPoll {
                client: spin,
                server: spin
            }
        );
        assert_eq!(
            BusyPoll::both(Duration::from_secs(1)),
            BusyPoll::both(BUSY_POLL_MAX)
        );
    }
}
