//! Frame layout, and the check-then-parse reading of it.
//!
//! A frame is a fixed 16-byte header, the payload, and an optional 32-byte HMAC-SHA256
//! trailer over header and payload (see [`crate::auth`]). All integers are little-endian.
//!
//! ```text
//!  0      4         6         8       10         12             16
//!  +------+---------+---------+-------+----------+--------------+---------+-------------+
//!  | HDOF | version | msg type| flags | reserved | payload len  | payload | [HMAC: 32B] |
//!  +------+---------+---------+-------+----------+--------------+---------+-------------+
//!          u16       u16       u16     u16 = 0    u32
//! ```
//!
//! Reading is two steps, as in mini-redis: [`check`] looks at the header only, refuses
//! anything wrong in it (magic, version, type, flags, reserved bits, and a payload length over
//! [`FRAME_PAYLOAD_BYTES_MAX`]) and answers [`WireError::Incomplete`] until the whole frame is
//! in the buffer; [`parse`] then splits the frame without copying. Nothing is allocated
//! before the header has been accepted and the whole frame has arrived.

use crate::auth::TAG_BYTES;
use crate::wire::limits::FRAME_PAYLOAD_BYTES_MAX;
use crate::wire::messages::MessageType;
use crate::wire::WireError;
use crate::PROTOCOL_VERSION;

/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"HDOF";

/// Length of the fixed frame header, in bytes.
pub const HEADER_BYTES: usize = 16;

/// Largest whole frame (header, largest payload, trailer), in bytes: the size to give a
/// message transport's own limit (e.g. ZeroMQ's `ZMQ_MAXMSGSIZE`).
pub const FRAME_BYTES_MAX: usize = HEADER_BYTES + FRAME_PAYLOAD_BYTES_MAX + TAG_BYTES;

/// The length of a whole frame, in bytes (header, payload and trailer), as [`check`] found it.
pub type FrameLen = usize;

/// The header's flag bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Flags(u16);

impl Flags {
    /// No flags.
    pub const NONE: Flags = Flags(0);
    /// Bit 0: a 32-byte HMAC-SHA256 trailer follows the payload.
    pub const AUTH: Flags = Flags(1);
    /// Every bit this version defines.
    const KNOWN: u16 = Flags::AUTH.0;

    /// Flags from their wire value, refusing bits this version does not define.
    pub fn from_bits(bits: u16) -> Result<Flags, WireError> {
        if bits & !Flags::KNOWN != 0 {
            return Err(WireError::UnknownFlags { flags: bits });
        }
        Ok(Flags(bits))
    }

    /// The wire value.
    pub fn bits(self) -> u16 {
        self.0
    }

    /// Whether an HMAC trailer follows the payload.
    pub fn has_auth(self) -> bool {
        self.0 & Flags::AUTH.0 != 0
    }
}

/// A frame header that [`check`] accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Protocol version; always [`PROTOCOL_VERSION`] once accepted.
    pub version: u16,
    /// What the payload holds.
    pub msg_type: MessageType,
    /// Flag bits.
    pub flags: Flags,
    /// Payload length in bytes, at most [`FRAME_PAYLOAD_BYTES_MAX`].
    pub payload_len: u32,
}

impl Header {
    /// A header for a payload of our own.
    pub(crate) fn new(msg_type: MessageType, flags: Flags, payload_len: u32) -> Header {
        Header {
            version: PROTOCOL_VERSION,
            msg_type,
            flags,
            payload_len,
        }
    }

    /// Reads and validates the fixed header. Fields are checked in wire order, so a stream
    /// that is not ours fails on the magic before anything else is looked at.
    pub fn decode(bytes: &[u8; HEADER_BYTES]) -> Result<Header, WireError> {
        let [m0, m1, m2, m3, v0, v1, t0, t1, f0, f1, r0, r1, l0, l1, l2, l3] = *bytes;
        let found = [m0, m1, m2, m3];
        if found != MAGIC {
            return Err(WireError::BadMagic { found });
        }
        let version = u16::from_le_bytes([v0, v1]);
        if version != PROTOCOL_VERSION {
            return Err(WireError::UnsupportedVersion {
                ours: PROTOCOL_VERSION,
                theirs: version,
            });
        }
        let code = u16::from_le_bytes([t0, t1]);
        let msg_type =
            MessageType::from_code(code).ok_or(WireError::UnknownMessageType { code })?;
        let flags = Flags::from_bits(u16::from_le_bytes([f0, f1]))?;
        let reserved = u16::from_le_bytes([r0, r1]);
        if reserved != 0 {
            return Err(WireError::ReservedNonZero { value: reserved });
        }
        let payload_len = u32::from_le_bytes([l0, l1, l2, l3]);
        if payload_len as usize > FRAME_PAYLOAD_BYTES_MAX {
            return Err(WireError::Oversized {
                announced: u64::from(payload_len),
                max: FRAME_PAYLOAD_BYTES_MAX,
            });
        }
        Ok(Header {
            version,
            msg_type,
            flags,
            payload_len,
        })
    }

    /// The header's wire bytes.
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut out = [0u8; HEADER_BYTES];
        out[0..4].copy_from_slice(&MAGIC);
        out[4..6].copy_from_slice(&self.version.to_le_bytes());
        out[6..8].copy_from_slice(&self.msg_type.code().to_le_bytes());
        out[8..10].copy_from_slice(&self.flags.bits().to_le_bytes());
        // 10..12: reserved, zero.
        out[12..16].copy_from_slice(&self.payload_len.to_le_bytes());
        out
    }

    /// Length of the whole frame this header announces: header, payload and trailer.
    pub fn frame_len(&self) -> FrameLen {
        let trailer = if self.flags.has_auth() { TAG_BYTES } else { 0 };
        HEADER_BYTES + self.payload_len as usize + trailer
    }
}

/// One whole frame, split but not decoded; borrows the buffer it was parsed from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Frame<'a> {
    /// The accepted header.
    pub header: Header,
    /// The payload bytes, still encoded.
    pub payload: &'a [u8],
    /// Header and payload: the bytes the HMAC trailer covers.
    pub signed: &'a [u8],
    /// The HMAC trailer, when the header's [`Flags::AUTH`] bit is set.
    pub trailer: Option<&'a [u8; TAG_BYTES]>,
}

impl Frame<'_> {
    /// Length of the whole frame in bytes.
    pub fn frame_len(&self) -> FrameLen {
        self.header.frame_len()
    }
}

/// Checks that `buf` starts with a whole, acceptable frame, and returns that frame's length.
///
/// Looks only at the header: [`WireError::Incomplete`] while fewer than [`HEADER_BYTES`] or
/// fewer than the announced frame length have arrived; any other error is final (close the
/// connection). Allocates nothing, and refuses an oversized announcement before the payload
/// is waited for. Bytes after the frame (the next frame, on a stream) are not looked at.
pub fn check(buf: &[u8]) -> Result<FrameLen, WireError> {
    let header = header_of(buf)?;
    let need = header.frame_len();
    if buf.len() < need {
        return Err(WireError::Incomplete { need });
    }
    Ok(need)
}

/// Splits the frame at the start of `buf` into header, payload and trailer, without copying.
///
/// Runs [`check`] first, so it may be called on its own; bytes after the frame are ignored
/// (use [`crate::wire::decode`] to refuse them).
pub fn parse(buf: &[u8]) -> Result<Frame<'_>, WireError> {
    let header = header_of(buf)?;
    let need = header.frame_len();
    let frame = buf.get(..need).ok_or(WireError::Incomplete { need })?;
    let signed_len = HEADER_BYTES + header.payload_len as usize;
    let (signed, trailer) = frame.split_at(signed_len);
    let payload = &signed[HEADER_BYTES..];
    let trailer = if header.flags.has_auth() {
        // `need` counted the trailer in, so this cannot fail; map it anyway rather than panic.
        Some(<&[u8; TAG_BYTES]>::try_from(trailer).map_err(|_| WireError::Incomplete { need })?)
    } else {
        None
    };
    Ok(Frame {
        header,
        payload,
        signed,
        trailer,
    })
}

/// The accepted header at the start of `buf`, or `Incomplete` before 16 bytes have arrived.
fn header_of(buf: &[u8]) -> Result<Header, WireError> {
    let bytes = buf
        .first_chunk::<HEADER_BYTES>()
        .ok_or(WireError::Incomplete { need: HEADER_BYTES })?;
    Header::decode(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header_bytes(len: u32) -> [u8; HEADER_BYTES] {
        Header::new(MessageType::Heartbeat, Flags::NONE, len).encode()
    }

    #[test]
    fn check_asks_for_the_header_then_the_payload() {
        let header = header_bytes(10);
        assert_eq!(
            check(&header[..5]),
            Err(WireError::Incomplete { need: HEADER_BYTES })
        );
        assert_eq!(check(&header), Err(WireError::Incomplete { need: 26 }));
        let mut whole = header.to_vec();
        whole.extend_from_slice(&[0; 10]);
        assert_eq!(check(&whole), Ok(26));
        whole.extend_from_slice(b"next frame");
        assert_eq!(check(&whole), Ok(26));
    }

    #[test]
    fn header_round_trips() {
        let header = Header::new(MessageType::TransferInfo, Flags::AUTH, 1234);
        assert_eq!(Header::decode(&header.encode()), Ok(header));
        assert_eq!(header.frame_len(), HEADER_BYTES + 1234 + TAG_BYTES);
    }

    #[test]
    fn four_gib_announcement_is_refused_from_the_header() {
        let mut header = header_bytes(0);
        header[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            check(&header),
            Err(WireError::Oversized {
                announced: u64::from(u32::MAX),
                max: FRAME_PAYLOAD_BYTES_MAX
            })
        );
    }

    #[test]
    fn largest_payload_is_accepted_one_more_byte_is_not() {
        let max = u32::try_from(FRAME_PAYLOAD_BYTES_MAX).unwrap_or(u32::MAX);
        assert_eq!(
            check(&header_bytes(max)),
            Err(WireError::Incomplete {
                need: HEADER_BYTES + FRAME_PAYLOAD_BYTES_MAX
            })
        );
        assert!(matches!(
            check(&header_bytes(max + 1)),
            Err(WireError::Oversized { .. })
        ));
    }

    #[test]
    fn unknown_flags_and_reserved_bits_are_refused() {
        let mut header = header_bytes(0);
        header[8] = 0b10;
        assert_eq!(check(&header), Err(WireError::UnknownFlags { flags: 2 }));
        let mut header = header_bytes(0);
        header[11] = 1;
        assert_eq!(
            check(&header),
            Err(WireError::ReservedNonZero { value: 0x100 })
        );
    }

    #[test]
    fn parse_splits_payload_and_trailer() {
        let mut buf = Header::new(MessageType::Heartbeat, Flags::AUTH, 3)
            .encode()
            .to_vec();
        buf.extend_from_slice(&[1, 2, 3]);
        buf.extend_from_slice(&[9; TAG_BYTES]);
        let frame = parse(&buf).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(frame.payload, &[1, 2, 3]);
        assert_eq!(frame.signed.len(), HEADER_BYTES + 3);
        assert_eq!(frame.trailer, Some(&[9; TAG_BYTES]));
        assert_eq!(frame.frame_len(), buf.len());
        assert_eq!(
            parse(&buf[..buf.len() - 1]),
            Err(WireError::Incomplete { need: buf.len() })
        );
    }
}
