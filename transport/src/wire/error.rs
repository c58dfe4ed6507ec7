//! What can go wrong reading or writing a frame, as values.
//!
//! Every way a peer's bytes can be wrong has its own variant, so logs and
//! [`FailureReason::Protocol`] details say exactly what was refused. The functions of the
//! wire layer do not know who sent the bytes: the caller names the peer with
//! [`WireError::with_peer`] (or [`WithPeer::with_peer`] on a `Result`).

use crate::types::{BlockId, FailureReason};
use crate::wire::messages::MessageType;

/// Everything the wire layer refuses, on the way in (a peer's bytes) or on the way out (a
/// message of ours that breaks a limit, which is our bug, reported as a value all the same).
///
/// [`WireError::Incomplete`] is not a failure on a byte stream: it asks the caller to read
/// more. [`crate::wire::decode`], which is handed exactly one frame (a ZeroMQ message), turns
/// it into [`WireError::Truncated`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The buffer holds the start of a frame but not all of it: read more bytes and retry.
    #[error("incomplete frame: need at least {need} bytes")]
    Incomplete {
        /// The smallest buffer length (from the start of the frame) that could hold the frame;
        /// never more than [`crate::wire::FRAME_BYTES_MAX`], so it is safe to reserve.
        need: usize,
    },
    /// The bytes were all there is (a whole message, or the end of a stream) and they stop
    /// before the frame does.
    #[error("truncated frame: {have} bytes, the frame needs {need}")]
    Truncated {
        /// How many bytes arrived.
        have: usize,
        /// How many the header (or, before a whole header, the header itself) asks for.
        need: usize,
    },
    /// The frame does not start with the protocol's magic: not our protocol, or a stream that
    /// lost its framing.
    #[error("bad magic {found:02x?}, expected {expected:02x?}", expected = crate::wire::frame::MAGIC)]
    BadMagic {
        /// The first four bytes that arrived.
        found: [u8; 4],
    },
    /// The peer speaks another version of the protocol.
    #[error("unsupported protocol version {theirs} (this build speaks {ours})")]
    UnsupportedVersion {
        /// The version this build speaks ([`crate::PROTOCOL_VERSION`]).
        ours: u16,
        /// The version the peer announced.
        theirs: u16,
    },
    /// The header names a message type this version does not know.
    #[error("unknown message type {code:#06x}")]
    UnknownMessageType {
        /// The type code from the header.
        code: u16,
    },
    /// The header sets flag bits this version does not define.
    #[error("unknown flag bits {flags:#06x}")]
    UnknownFlags {
        /// The flags field from the header.
        flags: u16,
    },
    /// The header's reserved field is not zero.
    #[error("reserved header field is {value:#06x}, must be 0")]
    ReservedNonZero {
        /// The value found.
        value: u16,
    },
    /// The payload is larger than [`crate::wire::FRAME_PAYLOAD_BYTES_MAX`]; refused from the
    /// header alone, before anything is allocated or waited for.
    #[error("payload of {announced} bytes exceeds the maximum of {max}")]
    Oversized {
        /// The payload length the header announced (or, on encode, that our message needs).
        announced: u64,
        /// The maximum payload length.
        max: usize,
    },
    /// Bytes follow the frame in a buffer that was to hold exactly one frame.
    #[error("{extra} bytes after the end of the frame")]
    TrailingBytes {
        /// How many bytes follow the frame.
        extra: usize,
    },
    /// The message decoded from a prefix of its payload: the payload has bytes left over.
    #[error("{extra} bytes left over after the {msg_type} payload")]
    TrailingPayloadBytes {
        /// The frame's message type.
        msg_type: MessageType,
        /// How many payload bytes were not consumed.
        extra: usize,
    },
    /// A key is configured but the frame carries no authentication trailer.
    #[error("frame is not authenticated but a shared key is configured")]
    AuthMissing,
    /// The frame's authentication trailer does not match: the peer has another key, or the
    /// frame was altered on the way.
    #[error("frame authentication failed (wrong key or altered frame)")]
    AuthMismatch,
    /// A shared key shorter than [`crate::auth::KEY_BYTES_MIN`].
    #[error("shared key of {len} bytes is too short (minimum {min})")]
    KeyTooShort {
        /// The key's length.
        len: usize,
        /// The minimum length.
        min: usize,
    },
    /// The payload is not a valid encoding of the message type in the header.
    #[error("cannot decode {msg_type} payload: {detail}")]
    Decode {
        /// The frame's message type.
        msg_type: MessageType,
        /// What the decoder said.
        detail: String,
    },
    /// Our own message could not be encoded (a bug: every message type is encodable).
    #[error("cannot encode {msg_type}: {detail}")]
    Encode {
        /// The message type.
        msg_type: MessageType,
        /// What the encoder said.
        detail: String,
    },
    /// A list holds more items than its limit allows.
    #[error("{what}: {count} items exceed the maximum of {max}")]
    TooMany {
        /// Which list, as `Message.field`.
        what: &'static str,
        /// How many items it holds.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// A string or byte field is longer than its limit allows.
    #[error("{what}: {len} bytes exceed the maximum of {max}")]
    TooLong {
        /// Which field, as `Message.field`.
        what: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A field holds a value that no correct peer sends (a zero size, an overflowing region, a
    /// block listed twice, ...).
    #[error("{what}: {detail}")]
    Invalid {
        /// Which field, as `Message.field`.
        what: &'static str,
        /// What is wrong with it.
        detail: String,
    },
    /// A block's byte range falls outside the region descriptor it is addressed through.
    #[error(
        "block {block} (bytes {block_bytes} each) falls outside the region of {region_len} bytes"
    )]
    BlockOutsideRegion {
        /// The offending block.
        block: BlockId,
        /// The region's block size in bytes.
        block_bytes: u64,
        /// The region's length in bytes.
        region_len: u64,
    },
    /// A well-formed message that is not the one the protocol expects at this point (e.g. a
    /// connection that does not open with `Hello`).
    #[error("expected {expected}, got {found}")]
    UnexpectedMessage {
        /// What the protocol expects here.
        expected: &'static str,
        /// What arrived.
        found: MessageType,
    },
}

impl WireError {
    /// A short, stable name for why a frame was refused (metrics' `cause` label): `auth`
    /// (missing or wrong HMAC), `oversized`, `truncated`, `version`, `unexpected`, or
    /// `malformed` for the rest.
    pub fn cause(&self) -> &'static str {
        match self {
            WireError::AuthMissing | WireError::AuthMismatch => "auth",
            WireError::Oversized { .. } | WireError::TooMany { .. } | WireError::TooLong { .. } => {
                "oversized"
            }
            WireError::Incomplete { .. } | WireError::Truncated { .. } => "truncated",
            WireError::UnsupportedVersion { .. } => "version",
            WireError::UnexpectedMessage { .. } => "unexpected",
            _ => "malformed",
        }
    }

    /// Names the peer the bytes came from (or were going to), for logs and failure reasons.
    pub fn with_peer(self, peer: impl Into<String>) -> PeerError {
        PeerError {
            peer: peer.into(),
            error: self,
        }
    }

    /// Whether this only asks for more bytes (see [`WireError::Incomplete`]).
    pub fn is_incomplete(&self) -> bool {
        matches!(self, WireError::Incomplete { .. })
    }
}

/// A [`WireError`] with the peer it concerns: what the control channels log and return.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("peer {peer}: {error}")]
pub struct PeerError {
    /// The peer, as its address or `engine/rank`.
    pub peer: String,
    /// What went wrong.
    #[source]
    pub error: WireError,
}

impl PeerError {
    /// The reason to fail the requests that depend on this peer's connection.
    pub fn failure_reason(&self) -> FailureReason {
        FailureReason::Protocol {
            detail: self.to_string(),
        }
    }
}

/// Names the peer on a wire result: `wire::decode(buf, key).with_peer(addr)?`.
pub trait WithPeer<T> {
    /// Wraps the error, if any, in a [`PeerError`] naming `peer`.
    fn with_peer(self, peer: &str) -> Result<T, PeerError>;
}

impl<T> WithPeer<T> for Result<T, WireError> {
    fn with_peer(self, peer: &str) -> Result<T, PeerError> {
        self.map_err(|error| error.with_peer(peer))
    }
}
