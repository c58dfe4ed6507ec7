//! The TCP data protocol's frames: a fixed header, bounded metadata, an optional HMAC tag,
//! then the bulk bytes. Check-then-parse: the header is checked (magic, version, op, flags,
//! reserved bits, both lengths against their maxima) before anything else is read or
//! allocated, and metadata parses to exactly its length.
//!
//! ```text
//!  0      4         6    7       8       12          16          20         24
//!  +------+---------+----+-------+-------+-----------+-----------+----------+------+--------+------+
//!  | HDDP | version | op | flags | seq   | meta len  | data len  | reserved | meta | [tag]  | data |
//!  +------+---------+----+-------+-------+-----------+-----------+----------+------+--------+------+
//!          u16       u8   u8      u32     u32         u32         u32 = 0          32 bytes
//! ```
//!
//! All integers little-endian. With a shared key, a connection opens with a Noise handshake
//! (`crate::noise`, prologue `PROLOGUE_DATA`: fresh ephemerals from both ends), and every
//! frame's header and metadata then travel as one Noise message (`u16` length, sealed
//! bytes) under its direction's next sequence number, so a frame cannot be altered,
//! injected, replayed, reordered or moved to another connection; each is refused by name.
//! The bulk bytes follow in the clear, not covered (sealing them would cost more than
//! moving them); TCP's checksum and the runtime's end-to-end checksums guard them. The
//! HMAC tag (`FLAG_AUTH`, [`sign`], [`verify`]) is no longer sent; a tag on a bare frame is
//! read and ignored. The server's `HelloOk` nonce is kept in the format, unused.

use std::fmt;

use crate::auth::{Key, TAG_BYTES};
use crate::types::{EngineId, RankInfo, RequestId};
use crate::wire::limits::{DETAIL_BYTES_MAX, ENGINE_ID_BYTES_MAX, REQUEST_ID_BYTES_MAX};

use super::{META_BYTES_MAX, OP_BYTES_MAX, SEGMENTS_PER_OP_MAX};

/// The first four bytes of every data frame ("handoff data plane").
pub const MAGIC: [u8; 4] = *b"HDDP";

/// The data protocol version this build speaks. Version 2: a read's data is followed by
/// `ReadOk` (or `Error`), since a server sends the bytes straight from its blocks and
/// confirms its grant held only once the last of them left.
pub const VERSION: u16 = 2;

/// Length of the fixed header, in bytes.
pub const HEADER_BYTES: usize = 24;

/// Length of the per-connection nonce, in bytes.
pub const NONCE_BYTES: usize = 16;

/// Flag bit: a 32-byte HMAC tag follows the metadata.
pub const FLAG_AUTH: u8 = 1;

/// Bytes of one segment in a `Write`/`Read` frame's metadata: offset u64, length u32.
const SEGMENT_BYTES: usize = 12;

// The largest legitimate metadata (a full op's segments and the longest request id) fits.
const _: () =
    assert!(2 + REQUEST_ID_BYTES_MAX + 4 + SEGMENTS_PER_OP_MAX * SEGMENT_BYTES <= META_BYTES_MAX);
const _: () = assert!(OP_BYTES_MAX <= u32::MAX as usize);

/// Frame kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// Client → server, first frame: who the client is. Metadata: a rank.
    Hello = 1,
    /// Server → client: accepted. Metadata: nonce, the region's shape, the server's rank.
    HelloOk = 2,
    /// Client → server: write the data into these segments of the region.
    Write = 3,
    /// Server → client: the write with this sequence number is in the region.
    WriteOk = 4,
    /// Client → server: send these segments of the region.
    Read = 5,
    /// Server → client: the bytes of the read with this sequence number; `ReadOk` or
    /// `Error` for the same number follows, and only `ReadOk` makes them good.
    ReadData = 6,
    /// Server → client: the operation with this sequence number (or the connection) was
    /// refused. Metadata: a code and a text.
    Error = 7,
    /// Server → client: the read grant held while the bytes of the `ReadData` just sent
    /// were taken from the blocks.
    ReadOk = 8,
}

impl Op {
    fn from_wire(code: u8) -> Option<Op> {
        Some(match code {
            1 => Op::Hello,
            2 => Op::HelloOk,
            3 => Op::Write,
            4 => Op::WriteOk,
            5 => Op::Read,
            6 => Op::ReadData,
            7 => Op::Error,
            8 => Op::ReadOk,
            _ => return None,
        })
    }

    /// Whether frames of this kind carry bulk bytes.
    fn carries_data(self) -> bool {
        matches!(self, Op::Write | Op::ReadData)
    }
}

/// What a frame header says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// The frame's kind.
    pub op: Op,
    /// Flag bits ([`FLAG_AUTH`]).
    pub flags: u8,
    /// The operation's sequence number on its connection.
    pub seq: u32,
    /// Metadata length in bytes, at most [`META_BYTES_MAX`].
    pub meta_len: u32,
    /// Bulk data length in bytes, at most [`OP_BYTES_MAX`].
    pub data_len: u32,
}

/// A header or metadata that breaks the protocol (the caller names the peer).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FrameError {
    /// Not our magic.
    BadMagic([u8; 4]),
    /// Another protocol version.
    Version(u16),
    /// Unknown op code.
    UnknownOp(u8),
    /// Unknown flag bits or a non-zero reserved field.
    Reserved(String),
    /// A length over its maximum, or data on a kind that carries none.
    Length(String),
    /// Metadata that does not parse to exactly its length.
    Meta(String),
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FrameError::BadMagic(m) => write!(f, "bad magic {m:02x?}, expected {MAGIC:02x?}"),
            FrameError::Version(v) => {
                write!(f, "data protocol version {v}, this build speaks {VERSION}")
            }
            FrameError::UnknownOp(op) => write!(f, "unknown op {op}"),
            FrameError::Reserved(d) | FrameError::Length(d) | FrameError::Meta(d) => f.write_str(d),
        }
    }
}

impl Header {
    /// The header's bytes.
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut out = [0u8; HEADER_BYTES];
        out[0..4].copy_from_slice(&MAGIC);
        out[4..6].copy_from_slice(&VERSION.to_le_bytes());
        out[6] = self.op as u8;
        out[7] = self.flags;
        out[8..12].copy_from_slice(&self.seq.to_le_bytes());
        out[12..16].copy_from_slice(&self.meta_len.to_le_bytes());
        out[16..20].copy_from_slice(&self.data_len.to_le_bytes());
        out
    }

    /// Checks a received header completely before anything after it is read.
    pub fn check(bytes: &[u8; HEADER_BYTES]) -> Result<Header, FrameError> {
        let magic = [bytes[0], bytes[1], bytes[2], bytes[3]];
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        if version != VERSION {
            return Err(FrameError::Version(version));
        }
        let op = Op::from_wire(bytes[6]).ok_or(FrameError::UnknownOp(bytes[6]))?;
        let flags = bytes[7];
        let word =
            |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
        if flags & !FLAG_AUTH != 0 || word(20) != 0 {
            return Err(FrameError::Reserved(format!(
                "unknown flags {flags:#04x} or reserved field {:#x}",
                word(20)
            )));
        }
        let (meta_len, data_len) = (word(12), word(16));
        if meta_len as usize > META_BYTES_MAX {
            return Err(FrameError::Length(format!(
                "metadata of {meta_len} bytes, at most {META_BYTES_MAX}"
            )));
        }
        if data_len as usize > OP_BYTES_MAX {
            return Err(FrameError::Length(format!(
                "data of {data_len} bytes, at most {OP_BYTES_MAX}"
            )));
        }
        if data_len > 0 && !op.carries_data() {
            return Err(FrameError::Length(format!(
                "{op:?} frame with {data_len} data bytes"
            )));
        }
        Ok(Header {
            op,
            flags,
            seq: word(8),
            meta_len,
            data_len,
        })
    }

    /// Whether an HMAC tag follows the metadata.
    pub fn has_tag(&self) -> bool {
        self.flags & FLAG_AUTH != 0
    }
}

/// The HMAC tag of a frame on a connection with `nonce`.
pub fn sign(
    key: &Key,
    nonce: &[u8; NONCE_BYTES],
    header: &[u8; HEADER_BYTES],
    meta: &[u8],
) -> [u8; TAG_BYTES] {
    let mut signed = Vec::with_capacity(NONCE_BYTES + HEADER_BYTES + meta.len());
    signed.extend_from_slice(nonce);
    signed.extend_from_slice(header);
    signed.extend_from_slice(meta);
    key.sign(&signed)
}

/// Checks a frame's tag (constant time).
pub fn verify(
    key: &Key,
    nonce: &[u8; NONCE_BYTES],
    header: &[u8; HEADER_BYTES],
    meta: &[u8],
    tag: &[u8; TAG_BYTES],
) -> bool {
    let mut signed = Vec::with_capacity(NONCE_BYTES + HEADER_BYTES + meta.len());
    signed.extend_from_slice(nonce);
    signed.extend_from_slice(header);
    signed.extend_from_slice(meta);
    key.verify(&signed, tag).is_ok()
}

// ------------------------------------------------------------------ metadata

/// Reads fields off metadata bytes; every read is bounds-checked.
struct Cursor<'a> {
    bytes: &'a [u8],
    what: &'static str,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], FrameError> {
        if self.bytes.len() < n {
            return Err(FrameError::Meta(format!(
                "{} metadata ends early",
                self.what
            )));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }

    fn u16(&mut self) -> Result<u16, FrameError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, FrameError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, FrameError> {
        let mut w = [0u8; 8];
        w.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(w))
    }

    fn text(&mut self, max: usize) -> Result<&'a str, FrameError> {
        let len = self.u16()? as usize;
        if len > max {
            return Err(FrameError::Meta(format!(
                "{} text of {len} bytes, at most {max}",
                self.what
            )));
        }
        std::str::from_utf8(self.take(len)?)
            .map_err(|_| FrameError::Meta(format!("{} text is not UTF-8", self.what)))
    }

    fn finish(self) -> Result<(), FrameError> {
        if self.bytes.is_empty() {
            Ok(())
        } else {
            Err(FrameError::Meta(format!(
                "{} metadata has {} bytes left over",
                self.what,
                self.bytes.len()
            )))
        }
    }
}

fn put_text(out: &mut Vec<u8>, text: &str, max: usize) {
    // Cut at a char boundary so what we send always parses on the other side.
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    out.extend_from_slice(&(end as u16).to_le_bytes());
    out.extend_from_slice(&text.as_bytes()[..end]);
}

fn put_rank(out: &mut Vec<u8>, rank: &RankInfo) {
    put_text(out, rank.engine_id.as_str(), ENGINE_ID_BYTES_MAX);
    for v in [
        rank.dp_rank,
        rank.dp_size,
        rank.tp_rank,
        rank.tp_size,
        rank.pp_rank,
        rank.pp_size,
    ] {
        out.extend_from_slice(&v.to_le_bytes());
    }
}

fn get_rank(c: &mut Cursor<'_>) -> Result<RankInfo, FrameError> {
    let engine_id = EngineId::new(c.text(ENGINE_ID_BYTES_MAX)?);
    Ok(RankInfo {
        engine_id,
        dp_rank: c.u32()?,
        dp_size: c.u32()?,
        tp_rank: c.u32()?,
        tp_size: c.u32()?,
        pp_rank: c.u32()?,
        pp_size: c.u32()?,
    })
}

/// `Hello` metadata: the client's rank.
pub fn encode_hello(me: &RankInfo) -> Vec<u8> {
    let mut out = Vec::new();
    put_rank(&mut out, me);
    out
}

/// Parses `Hello` metadata.
pub fn decode_hello(meta: &[u8]) -> Result<RankInfo, FrameError> {
    let mut c = Cursor {
        bytes: meta,
        what: "Hello",
    };
    let rank = get_rank(&mut c)?;
    c.finish()?;
    Ok(rank)
}

/// What a server says about itself in `HelloOk`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HelloOk {
    /// The connection's nonce, mixed into every later tag.
    pub nonce: [u8; NONCE_BYTES],
    /// Blocks in the served region.
    pub blocks: u32,
    /// Bytes per block of the served region.
    pub block_bytes: u64,
    /// The server's rank.
    pub rank: RankInfo,
}

/// `HelloOk` metadata.
pub fn encode_hello_ok(ok: &HelloOk) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&ok.nonce);
    out.extend_from_slice(&ok.blocks.to_le_bytes());
    out.extend_from_slice(&ok.block_bytes.to_le_bytes());
    put_rank(&mut out, &ok.rank);
    out
}

/// Parses `HelloOk` metadata.
pub fn decode_hello_ok(meta: &[u8]) -> Result<HelloOk, FrameError> {
    let mut c = Cursor {
        bytes: meta,
        what: "HelloOk",
    };
    let mut nonce = [0u8; NONCE_BYTES];
    nonce.copy_from_slice(c.take(NONCE_BYTES)?);
    let blocks = c.u32()?;
    let block_bytes = c.u64()?;
    let rank = get_rank(&mut c)?;
    c.finish()?;
    if block_bytes == 0 || block_bytes > OP_BYTES_MAX as u64 * u64::from(u32::MAX) {
        return Err(FrameError::Meta(format!(
            "HelloOk block size {block_bytes}"
        )));
    }
    Ok(HelloOk {
        nonce,
        blocks,
        block_bytes,
        rank,
    })
}

/// One byte range of the server's region named in a `Write` or `Read` frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Byte offset in the server's region.
    pub offset: u64,
    /// Length in bytes, not zero.
    pub len: u32,
}

/// `Write`/`Read` metadata: the request and the segments of the server's region.
pub fn encode_op(
    request: &RequestId,
    segments: impl ExactSizeIterator<Item = Segment>,
    out: &mut Vec<u8>,
) {
    out.clear();
    put_text(out, request.as_str(), REQUEST_ID_BYTES_MAX);
    out.extend_from_slice(&(segments.len() as u32).to_le_bytes());
    for s in segments {
        out.extend_from_slice(&s.offset.to_le_bytes());
        out.extend_from_slice(&s.len.to_le_bytes());
    }
}

/// Parses `Write`/`Read` metadata into `segments` (cleared first); returns the request id
/// and the segments' total length. Refuses empty or zero-length segments, more than
/// [`SEGMENTS_PER_OP_MAX`], and totals over [`OP_BYTES_MAX`].
pub fn decode_op(meta: &[u8], segments: &mut Vec<Segment>) -> Result<(RequestId, u64), FrameError> {
    let mut c = Cursor {
        bytes: meta,
        what: "Write/Read",
    };
    let request = RequestId::new(c.text(REQUEST_ID_BYTES_MAX)?);
    let count = c.u32()? as usize;
    if count == 0 || count > SEGMENTS_PER_OP_MAX {
        return Err(FrameError::Meta(format!(
            "{count} segments, expected 1..={SEGMENTS_PER_OP_MAX}"
        )));
    }
    segments.clear();
    let mut total = 0u64;
    for _ in 0..count {
        let seg = Segment {
            offset: c.u64()?,
            len: c.u32()?,
        };
        if seg.len == 0 {
            return Err(FrameError::Meta("zero-length segment".into()));
        }
        total += u64::from(seg.len);
        segments.push(seg);
    }
    c.finish()?;
    if total > OP_BYTES_MAX as u64 {
        return Err(FrameError::Meta(format!(
            "segments total {total} bytes, at most {OP_BYTES_MAX}"
        )));
    }
    Ok((request, total))
}

/// `Error` metadata: a refusal code and its text.
pub fn encode_error(code: u16, detail: &str) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&code.to_le_bytes());
    put_text(&mut out, detail, DETAIL_BYTES_MAX);
    out
}

/// Parses `Error` metadata.
pub fn decode_error(meta: &[u8]) -> Result<(u16, String), FrameError> {
    let mut c = Cursor {
        bytes: meta,
        what: "Error",
    };
    let code = c.u16()?;
    let detail = c.text(DETAIL_BYTES_MAX)?.to_string();
    c.finish()?;
    Ok((code, detail))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_every_bad_field_is_refused() {
        let h = Header {
            op: Op::Write,
            flags: FLAG_AUTH,
            seq: 7,
            meta_len: 30,
            data_len: 4096,
        };
        let bytes = h.encode();
        assert_eq!(Header::check(&bytes), Ok(h));
        let mut bad = bytes;
        bad[0] = b'X';
        assert!(matches!(Header::check(&bad), Err(FrameError::BadMagic(_))));
        let mut bad = bytes;
        bad[4] = 9;
        assert_eq!(Header::check(&bad), Err(FrameError::Version(9)));
        let mut bad = bytes;
        bad[6] = 99;
        assert_eq!(Header::check(&bad), Err(FrameError::UnknownOp(99)));
        let mut bad = bytes;
        bad[7] = 0x80;
        assert!(matches!(Header::check(&bad), Err(FrameError::Reserved(_))));
        let mut bad = bytes;
        bad[23] = 1;
        assert!(matches!(Header::check(&bad), Err(FrameError::Reserved(_))));
        let big = Header {
            data_len: OP_BYTES_MAX as u32 + 1,
            ..h
        }
        .encode();
        assert!(matches!(Header::check(&big), Err(FrameError::Length(_))));
        let big = Header {
            meta_len: META_BYTES_MAX as u32 + 1,
            ..h
        }
        .encode();
        assert!(matches!(Header::check(&big), Err(FrameError::Length(_))));
        let data_on_ack = Header {
            op: Op::WriteOk,
            data_len: 1,
            ..h
        }
        .encode();
        assert!(matches!(
            Header::check(&data_on_ack),
            Err(FrameError::Length(_))
        ));
        let data_on_read_ok = Header {
            op: Op::ReadOk,
            data_len: 1,
            ..h
        }
        .encode();
        assert!(matches!(
            Header::check(&data_on_read_ok),
            Err(FrameError::Length(_))
        ));
        let read_ok = Header {
            op: Op::ReadOk,
            flags: 0,
            meta_len: 0,
            data_len: 0,
            ..h
        };
        assert_eq!(Header::check(&read_ok.encode()), Ok(read_ok));
    }

    #[test]
    fn metadata_round_trips_and_refuses_leftovers_and_bad_segments() {
        let rank = RankInfo::single("prefill-0");
        assert_eq!(decode_hello(&encode_hello(&rank)), Ok(rank.clone()));
        let ok = HelloOk {
            nonce: [3; NONCE_BYTES],
            blocks: 9,
            block_bytes: 64,
            rank,
        };
        assert_eq!(decode_hello_ok(&encode_hello_ok(&ok)), Ok(ok));
        let mut meta = Vec::new();
        let segs = [
            Segment {
                offset: 64,
                len: 64,
            },
            Segment { offset: 0, len: 1 },
        ];
        encode_op(&RequestId::new("r1"), segs.iter().copied(), &mut meta);
        let mut out = Vec::new();
        assert_eq!(decode_op(&meta, &mut out), Ok((RequestId::new("r1"), 65)));
        assert_eq!(out, segs);
        meta.push(0);
        assert!(decode_op(&meta, &mut out).is_err(), "leftover byte");
        encode_op(
            &RequestId::new("r1"),
            [Segment { offset: 0, len: 0 }].into_iter(),
            &mut meta,
        );
        assert!(decode_op(&meta, &mut out).is_err(), "zero length");
        encode_op(
            &RequestId::new("r1"),
            std::iter::empty::<Segment>()
                .collect::<Vec<_>>()
                .into_iter(),
            &mut meta,
        );
        assert!(decode_op(&meta, &mut out).is_err(), "no segment");
        let mut meta = Vec::new();
        encode_op(
            &RequestId::new("r1"),
            [Segment {
                offset: 0,
                len: u32::MAX,
            }]
            .into_iter(),
            &mut meta,
        );
        assert!(decode_op(&meta, &mut out).is_err(), "over the op maximum");
        assert_eq!(
            decode_error(&encode_error(2, "nope")),
            Ok((2, "nope".into()))
        );
        assert!(decode_error(&[1]).is_err());
    }
}
