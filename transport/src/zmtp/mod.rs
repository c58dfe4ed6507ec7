//! ZMTP 3.1, ZeroMQ's wire protocol, with the NULL mechanism: our own bounded
//! implementation of the two socket kinds the control plane uses, ROUTER (servers: the
//! bootstrap server, each worker's control port) and DEALER (clients).
//!
//! Why not the `zeromq` crate: its decoder reserves buffer space for whatever frame length
//! a peer announces before any of it arrives, so nine bytes after the greeting (a long frame
//! announcing 1 TiB) abort the whole process with "memory allocation failed" — measured with
//! zeromq 0.7.0 on this project's machine. A port that faces the network cannot allow that.
//! This module speaks the same protocol (a pyzmq or libzmq DEALER can talk to our ROUTER),
//! but checks every length against a named maximum before allocating, bounds the frames per
//! message, the handshake's duration and size, the connections per listener and every queue,
//! and turns each violation into a logged error that names the peer and closes that one
//! connection.
//!
//! # Layout
//! - `codec`: greeting, READY handshake, frames (check-then-read, bounded).
//! - `socket`: [`Router`] (bind, accept, route by connection) and [`Dealer`] (connect).

mod codec;
mod socket;

pub use codec::{SocketType, ZmtpError};
pub use socket::{ConnId, Dealer, DealerReceiver, DealerSender, Router, RouterEvent, RouterStats};

use std::time::Duration;

/// Largest frame accepted: one handoff wire frame (header, 16 MiB payload, HMAC tag) plus
/// room to spare. Checked on the frame header, before any allocation.
pub const ZMTP_FRAME_BYTES_MAX: usize = 17 << 20;

/// Frames in one message. Control messages are one frame; ROUTER envelopes add one.
pub const FRAMES_PER_MESSAGE_MAX: usize = 4;

/// Bytes of one READY command: a socket type and an identity, with generous room.
pub const COMMAND_BYTES_MAX: usize = 4096;

/// Bytes of a peer identity (ZMTP allows up to 255).
pub const IDENTITY_BYTES_MAX: usize = 255;

/// How long a new connection may take to complete its greeting and READY exchange. A peer
/// that connects and says nothing is dropped after this (it cannot hold a slot forever).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Connections one [`Router`] accepts at once: far more workers than one engine has, few
/// enough that a flood of idle connections cannot exhaust file descriptors (the process
/// raises its open-file soft limit to the hard limit at start; see
/// `handoff_bootstrap::exposure::raise_open_files`). Worst case per connection: its queues
/// below, plus one frame being read (growing with the bytes that arrive).
pub const CONNECTIONS_MAX: usize = 1024;

/// Connections not yet admitted as peers ([`Router::admit`]: a valid hello, a
/// registration), at most: the other `CONNECTIONS_MAX - PENDING_CONNECTIONS_MAX` (768) are
/// reserved for known peers, which a flood of strangers therefore cannot lock out. At the
/// bound the oldest pending connection is evicted (counted, logged), so a newcomer's short
/// exchange (a `status`, a registration) still gets through a flood.
/// Worst case while pending: one partial message each (with a secret: one 64 KiB chunk
/// after a 128-byte handshake message), 256 × 64 KiB = 16 MiB.
pub const PENDING_CONNECTIONS_MAX: usize = 256;

/// Pending connections from one source address (past it, that source's oldest pending
/// connection is evicted). On loopback every peer shares one address, so this bounds a
/// local flood too (honest pending connections are brief).
pub const PENDING_PER_SOURCE_MAX: usize = 64;

/// How long a pending connection may go without sending a whole message: idle and
/// trickling connections are dropped (counted, logged). Known peers have no idle bound
/// (their heartbeats and leases govern them).
pub const PENDING_IDLE_TIMEOUT: Duration = Duration::from_secs(10);

/// Messages of one connection waiting in the router's shared queue: a flood on one
/// connection occupies at most this many places, so other peers' messages (heartbeats
/// first of all) never queue behind more than this per flooding connection.
pub const CONNECTION_INFLIGHT_MAX: usize = 32;

/// Messages queued to send on one connection before `send` reports the peer as too slow.
pub const SEND_QUEUE_MESSAGES_MAX: usize = 1024;

/// Bytes queued to send on one connection: past it the peer does not read its replies and
/// is dropped at once (counted, logged, its queue freed), not buffered. Two of the largest
/// messages fit.
pub const SEND_QUEUE_BYTES_MAX: usize = 2 * ZMTP_FRAME_BYTES_MAX;

/// Bytes queued to send on every connection of one listener together: past it the
/// connection holding the most is dropped the same way, so slow readers cannot add up.
/// Worst case: this plus one message.
pub const SEND_QUEUES_BYTES_MAX: usize = 48 << 20;

/// Messages received and not yet taken by the owner of a socket; readers wait (TCP
/// backpressure) when it is full.
pub const RECV_QUEUE_MESSAGES_MAX: usize = 4096;

const _: () = assert!(ZMTP_FRAME_BYTES_MAX >= crate::wire::FRAME_BYTES_MAX);
const _: () = assert!(PENDING_PER_SOURCE_MAX <= PENDING_CONNECTIONS_MAX);
const _: () = assert!(PENDING_CONNECTIONS_MAX < CONNECTIONS_MAX);
const _: () = assert!(SEND_QUEUE_BYTES_MAX >= 2 * ZMTP_FRAME_BYTES_MAX);
const _: () = assert!(SEND_QUEUES_BYTES_MAX >= SEND_QUEUE_BYTES_MAX);
const _: () = assert!(COMMAND_BYTES_MAX > IDENTITY_BYTES_MAX + 64);
