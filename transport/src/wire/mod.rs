//! The wire protocol: versioned, bounded, optionally authenticated frames that carry the
//! control [`Message`]s between workers and the bootstrap server.
//!
//! Sending: [`encode`] (or [`encode_into`], to reuse a buffer) validates a message, encodes
//! its payload through [`crate::codec`], writes the frame header and, with a key, the HMAC
//! trailer. Receiving: [`decode`] takes a buffer holding exactly one frame (a ZeroMQ message);
//! [`decode_prefix`] reads the first frame off a byte stream and answers
//! [`WireError::Incomplete`] until it has all arrived. Both run, in order:
//! [`frame::check`] (header only: magic, version, type, flags, size limit, before any
//! allocation), [`frame::parse`], [`crate::auth::verify`], then [`crate::codec`]'s bounded
//! decode and [`Message::validate`]. Everything here is pure and synchronous.
//!
//! Errors are [`WireError`] values; the caller names the peer with [`WithPeer::with_peer`].
//!
//! # Layout
//! - [`frame`]: header layout, [`frame::check`] and [`frame::parse`].
//! - [`messages`]: [`Message`], its type codes, every payload, [`check_hello`].
//! - [`limits`]: every bound, with the reason for its value.
//! - [`error`]: [`WireError`], [`PeerError`].
//! - [`fuzz`]: the decode path the fuzz target and the corpus replay test share.

pub mod error;
pub mod frame;
pub mod fuzz;
pub mod limits;
pub mod messages;

pub use error::{PeerError, WireError, WithPeer};
pub use frame::{FrameLen, FRAME_BYTES_MAX, HEADER_BYTES};
pub use limits::{
    AUX_BYTES_MAX, BLOCKS_PER_MESSAGE_MAX, FRAME_PAYLOAD_BYTES_MAX, LAYOUT_REMOTE_KEY_BYTES_MAX,
};
pub use messages::{
    bounded_reason, bounded_text, check_hello, check_hello_ack, Abort, AbortAck, Done,
    EngineStatus, Heartbeat, Hello, HelloAck, LayoutDescriptor, Message, MessageType,
    ProtocolError, Query, QueryAnswer, QueryReply, Queued, RangeDescriptor, ReadDone, Ready,
    RegionDescriptor, RegisterConflict, RegisterOk, Rejected, StatusReply, StatusRequest,
    TransferInfo, TransportKind, Unregister, Unregistered, WorkerRecord, WorkerSummary,
};

use crate::auth::{self, Key};
use crate::codec;
use frame::{Flags, Header};

/// Detail of the refusal a peer with a shared secret sends, in the clear, to a peer that
/// failed its Noise handshake (no secret, or another one).
pub const UNAUTHENTICATED_DETAIL: &str = "not authenticated: this peer requires the shared \
     secret (HANDOFF_SECRET_FILE, HANDOFF_SECRET or --secret-file) and its handshake";

/// The frame of that refusal: a `ProtocolError`, unsigned, the same for every peer.
pub fn unauthenticated_refusal() -> Option<Vec<u8>> {
    encode(
        &Message::ProtocolError(ProtocolError::new(UNAUTHENTICATED_DETAIL)),
        None,
    )
    .ok()
}

/// Encodes `msg` as one frame, signed when `key` is given.
///
/// Refuses a message that breaks a wire limit ([`Message::validate`]) or whose payload
/// exceeds [`FRAME_PAYLOAD_BYTES_MAX`]: we never send what a peer would refuse.
pub fn encode(msg: &Message, key: Option<&Key>) -> Result<Vec<u8>, WireError> {
    let mut out = Vec::new();
    encode_into(msg, key, &mut out)?;
    Ok(out)
}

/// Appends `msg` as one frame to `out` and returns the frame's length; on error `out` is
/// left as it was. Reusing `out` across messages avoids an allocation per frame.
pub fn encode_into(
    msg: &Message,
    key: Option<&Key>,
    out: &mut Vec<u8>,
) -> Result<FrameLen, WireError> {
    msg.validate()?;
    let start = out.len();
    let result = write_frame(msg, key, out, start);
    if result.is_err() {
        out.truncate(start);
    }
    result
}

fn write_frame(
    msg: &Message,
    key: Option<&Key>,
    out: &mut Vec<u8>,
    start: usize,
) -> Result<FrameLen, WireError> {
    out.extend_from_slice(&[0; HEADER_BYTES]);
    codec::encode_payload(msg, out)?;
    let payload_len = out.len() - start - HEADER_BYTES;
    let oversized = WireError::Oversized {
        announced: payload_len as u64,
        max: FRAME_PAYLOAD_BYTES_MAX,
    };
    if payload_len > FRAME_PAYLOAD_BYTES_MAX {
        return Err(oversized);
    }
    let payload_len = u32::try_from(payload_len).map_err(|_| oversized)?;
    let flags = if key.is_some() {
        Flags::AUTH
    } else {
        Flags::NONE
    };
    let header = Header::new(msg.message_type(), flags, payload_len).encode();
    out[start..start + HEADER_BYTES].copy_from_slice(&header);
    if let Some(key) = key {
        let tag = key.sign(&out[start..]);
        out.extend_from_slice(&tag);
    }
    Ok(out.len() - start)
}

/// Decodes a buffer that holds exactly one frame (a message-oriented transport's message).
///
/// A buffer that stops short of the frame is [`WireError::Truncated`] (there is no more to
/// wait for); bytes after the frame are [`WireError::TrailingBytes`].
pub fn decode(buf: &[u8], key: Option<&Key>) -> Result<Message, WireError> {
    let len = match frame::check(buf) {
        Ok(len) => len,
        Err(WireError::Incomplete { need }) => {
            return Err(WireError::Truncated {
                have: buf.len(),
                need,
            })
        }
        Err(e) => return Err(e),
    };
    if buf.len() > len {
        return Err(WireError::TrailingBytes {
            extra: buf.len() - len,
        });
    }
    decode_frame(buf, key)
}

/// Decodes the frame at the start of a stream buffer and returns it with its length, so the
/// caller can drop that many bytes. [`WireError::Incomplete`] means read more and call again;
/// any other error is final for the connection.
pub fn decode_prefix(buf: &[u8], key: Option<&Key>) -> Result<(Message, FrameLen), WireError> {
    let len = frame::check(buf)?;
    let frame_bytes = buf.get(..len).ok_or(WireError::Incomplete { need: len })?;
    let msg = decode_frame(frame_bytes, key)?;
    Ok((msg, len))
}

/// Parse, authenticate, then decode one whole frame: nothing unauthenticated is decoded.
fn decode_frame(buf: &[u8], key: Option<&Key>) -> Result<Message, WireError> {
    let frame = frame::parse(buf)?;
    auth::verify(key, &frame)?;
    codec::decode_payload(frame.header.msg_type, frame.payload)
}
