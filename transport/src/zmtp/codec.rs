//! The ZMTP 3.1 greeting, the NULL-mechanism READY handshake, and frames.
//!
//! Reads are check-then-read: a frame's length is read and checked against the maximum
//! before its body is allocated, and the body is then read exactly (growing with the bytes
//! that arrive). With a shared secret, each message travels sealed as one frame
//! ([`write_sealed`], [`read_sealed`]: `crate::noise`), opened chunk by chunk as it arrives.

use std::fmt;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::{COMMAND_BYTES_MAX, FRAMES_PER_MESSAGE_MAX, IDENTITY_BYTES_MAX, ZMTP_FRAME_BYTES_MAX};
use crate::noise;

const GREETING_BYTES: usize = 64;
const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;
const FLAGS_RESERVED: u8 = !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND);

/// Errors of the ZMTP layer. Each closes the one connection it happened on.
#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    /// The connection failed or closed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// The peer's greeting is not a ZMTP greeting.
    #[error("bad greeting: {0}")]
    BadGreeting(&'static str),
    /// The peer speaks a ZMTP version before 3.0.
    #[error("unsupported ZMTP version {major}.{minor} (3.x required)")]
    UnsupportedVersion {
        /// Major version the peer announced.
        major: u8,
        /// Minor version the peer announced.
        minor: u8,
    },
    /// The peer asked for a security mechanism other than NULL.
    #[error("unsupported security mechanism {0:?} (NULL required)")]
    UnsupportedMechanism(String),
    /// A frame announced more bytes than allowed; nothing was allocated for it.
    #[error("frame of {announced} bytes announced, at most {max} allowed")]
    FrameTooLarge {
        /// Length the peer announced.
        announced: u64,
        /// The limit.
        max: usize,
    },
    /// A message with more frames than allowed.
    #[error("message with more than {max} frames")]
    TooManyFrames {
        /// The limit.
        max: usize,
    },
    /// Reserved flag bits were set.
    #[error("frame flags {0:#04x} use reserved bits")]
    ReservedFlags(u8),
    /// A malformed or unexpected command.
    #[error("bad command: {0}")]
    BadCommand(String),
    /// The peer's socket type cannot talk to ours.
    #[error("peer socket type {theirs} cannot talk to {ours}")]
    SocketTypeMismatch {
        /// Ours.
        ours: SocketType,
        /// Theirs, as announced.
        theirs: String,
    },
    /// A connection not admitted as a peer sent no whole message in time.
    #[error("no whole message within {0:?} from a connection that is not a known peer")]
    Idle(std::time::Duration),
    /// The handshake did not finish in time.
    #[error("handshake did not finish within {0:?}")]
    HandshakeTimeout(std::time::Duration),
    /// The connection is closed (or was never open).
    #[error("connection closed")]
    Closed,
    /// The peer does not read fast enough: its send queue is full.
    #[error("send queue full: peer too slow")]
    QueueFull,
    /// The listener holds its maximum of connections.
    #[error("too many connections")]
    TooManyConnections,
    /// An address that is not `tcp://host:port` or `host:port`.
    #[error("bad address {0:?}: expected tcp://host:port")]
    BadAddress(String),
    /// With a shared secret: the Noise handshake failed, or a frame did not open as the next
    /// of this session (replayed, reordered, forged, from another connection).
    #[error("authentication: {0}")]
    Noise(#[from] crate::noise::NoiseError),
}

/// The ZeroMQ socket types this module implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SocketType {
    /// Accepts many peers; routes by peer.
    Router,
    /// Connects to one peer.
    Dealer,
}

impl SocketType {
    fn name(self) -> &'static str {
        match self {
            SocketType::Router => "ROUTER",
            SocketType::Dealer => "DEALER",
        }
    }

    /// ROUTER and DEALER talk to each other and to their own kind (ZMTP's valid pairs).
    fn accepts(self, theirs: &[u8]) -> bool {
        matches!(theirs, b"ROUTER" | b"DEALER")
    }
}

impl fmt::Display for SocketType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

fn greeting() -> [u8; GREETING_BYTES] {
    let mut g = [0u8; GREETING_BYTES];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3; // version 3.1
    g[11] = 1;
    g[12..16].copy_from_slice(b"NULL");
    g
}

fn check_greeting(g: &[u8; GREETING_BYTES]) -> Result<(), ZmtpError> {
    if g[0] != 0xff || g[9] != 0x7f {
        return Err(ZmtpError::BadGreeting("no ZMTP signature"));
    }
    if g[10] < 3 {
        return Err(ZmtpError::UnsupportedVersion {
            major: g[10],
            minor: g[11],
        });
    }
    let mechanism = &g[12..32];
    let end = mechanism
        .iter()
        .position(|b| *b == 0)
        .unwrap_or(mechanism.len());
    if &mechanism[..end] != b"NULL" || mechanism[end..].iter().any(|b| *b != 0) {
        let name = String::from_utf8_lossy(&mechanism[..end]).into_owned();
        return Err(ZmtpError::UnsupportedMechanism(name));
    }
    Ok(())
}

/// What the peer said about itself in its READY command.
#[derive(Debug, Default)]
pub(crate) struct PeerReady {
    pub(crate) identity: Vec<u8>,
}

fn ready_body(ours: SocketType, identity: &[u8]) -> Vec<u8> {
    let mut body = vec![5u8];
    body.extend_from_slice(b"READY");
    let mut prop = |name: &[u8], value: &[u8]| {
        body.push(name.len() as u8);
        body.extend_from_slice(name);
        body.extend_from_slice(&(value.len() as u32).to_be_bytes());
        body.extend_from_slice(value);
    };
    prop(b"Socket-Type", ours.name().as_bytes());
    if !identity.is_empty() {
        prop(b"Identity", identity);
    }
    body
}

fn parse_ready(ours: SocketType, body: &[u8]) -> Result<PeerReady, ZmtpError> {
    let bad = |what: &str| ZmtpError::BadCommand(what.to_string());
    let (&name_len, rest) = body.split_first().ok_or_else(|| bad("empty command"))?;
    let name = rest
        .get(..name_len as usize)
        .ok_or_else(|| bad("truncated command name"))?;
    if name != b"READY" {
        return Err(ZmtpError::BadCommand(format!(
            "expected READY, got {:?}",
            String::from_utf8_lossy(name)
        )));
    }
    let mut rest = &rest[name_len as usize..];
    let mut ready = PeerReady::default();
    let mut socket_type = None;
    while let Some((&len, tail)) = rest.split_first() {
        let key = tail
            .get(..len as usize)
            .ok_or_else(|| bad("truncated property name"))?;
        let tail = &tail[len as usize..];
        let vlen = tail
            .get(..4)
            .ok_or_else(|| bad("truncated property length"))?;
        let vlen = u32::from_be_bytes([vlen[0], vlen[1], vlen[2], vlen[3]]) as usize;
        let value = tail
            .get(4..4 + vlen)
            .ok_or_else(|| bad("truncated property value"))?;
        match key.to_ascii_lowercase().as_slice() {
            b"socket-type" => socket_type = Some(value.to_vec()),
            b"identity" if value.len() <= IDENTITY_BYTES_MAX => ready.identity = value.to_vec(),
            b"identity" => return Err(bad("identity longer than 255 bytes")),
            _ => {} // other metadata is allowed and ignored
        }
        rest = &tail[4 + vlen..];
    }
    let theirs = socket_type.ok_or_else(|| bad("READY without Socket-Type"))?;
    if !ours.accepts(&theirs) {
        let theirs = String::from_utf8_lossy(&theirs).into_owned();
        return Err(ZmtpError::SocketTypeMismatch { ours, theirs });
    }
    Ok(ready)
}

/// Performs the greeting and READY exchange (the caller bounds it with a timeout).
pub(crate) async fn handshake<S>(
    io: &mut S,
    ours: SocketType,
    identity: &[u8],
) -> Result<PeerReady, ZmtpError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    io.write_all(&greeting()).await?;
    io.flush().await?;
    let mut theirs = [0u8; GREETING_BYTES];
    io.read_exact(&mut theirs).await?;
    check_greeting(&theirs)?;
    write_frame(io, &ready_body(ours, identity), FLAG_COMMAND).await?;
    io.flush().await?;
    let (flags, body) = read_frame(io, COMMAND_BYTES_MAX).await?;
    if flags & FLAG_COMMAND == 0 {
        return Err(ZmtpError::BadCommand("a message before READY".into()));
    }
    parse_ready(ours, &body)
}

async fn write_frame<S: AsyncWrite + Unpin>(
    io: &mut S,
    body: &[u8],
    flags: u8,
) -> Result<(), ZmtpError> {
    if body.len() > 255 {
        io.write_all(&[flags | FLAG_LONG]).await?;
        io.write_all(&(body.len() as u64).to_be_bytes()).await?;
    } else {
        io.write_all(&[flags, body.len() as u8]).await?;
    }
    io.write_all(body).await?;
    Ok(())
}

/// Reads a frame's flags and length, checked against `max`.
async fn read_frame_head<S: AsyncRead + Unpin>(
    io: &mut S,
    max: usize,
) -> Result<(u8, usize), ZmtpError> {
    let flags = io.read_u8().await?;
    if flags & FLAGS_RESERVED != 0 {
        return Err(ZmtpError::ReservedFlags(flags));
    }
    let announced = if flags & FLAG_LONG != 0 {
        io.read_u64().await?
    } else {
        u64::from(io.read_u8().await?)
    };
    if announced > max as u64 {
        return Err(ZmtpError::FrameTooLarge { announced, max });
    }
    Ok((flags, announced as usize))
}

/// Reads one frame: flags and length first, checked, then the body, which grows with the
/// bytes that actually arrive (a peer announcing a large frame and sending little makes us
/// hold what it sent, not what it announced).
async fn read_frame<S: AsyncRead + Unpin>(
    io: &mut S,
    max: usize,
) -> Result<(u8, Vec<u8>), ZmtpError> {
    let (flags, len) = read_frame_head(io, max).await?;
    let mut body = Vec::with_capacity(len.min(READ_GROWTH_BYTES));
    let got = (&mut *io).take(len as u64).read_to_end(&mut body).await?;
    if got < len {
        return Err(ZmtpError::Io(std::io::ErrorKind::UnexpectedEof.into()));
    }
    Ok((flags, body))
}

/// First allocation for a frame body; it grows as bytes arrive.
const READ_GROWTH_BYTES: usize = 64 << 10;

/// Writes one Noise handshake message as a frame.
pub(crate) async fn write_handshake<S: AsyncWrite + Unpin>(
    io: &mut S,
    msg: &[u8],
) -> Result<(), ZmtpError> {
    write_frame(io, msg, 0).await?;
    io.flush().await?;
    Ok(())
}

/// Reads one Noise handshake message: at most [`noise::HANDSHAKE_MESSAGE_BYTES_MAX`] bytes,
/// checked before anything is read (all a stranger can make us buffer).
pub(crate) async fn read_handshake<S: AsyncRead + Unpin>(io: &mut S) -> Result<Vec<u8>, ZmtpError> {
    let (flags, body) = read_frame(io, noise::HANDSHAKE_MESSAGE_BYTES_MAX)
        .await
        .map_err(|e| match e {
            ZmtpError::Io(_) => e,
            // Not a handshake message: a peer without the secret (or its refusal of ours).
            other => ZmtpError::Noise(noise::NoiseError::Handshake(other.to_string())),
        })?;
    if flags & (FLAG_COMMAND | FLAG_MORE) != 0 {
        return Err(ZmtpError::Noise(noise::NoiseError::Handshake(
            "expected a handshake message".into(),
        )));
    }
    Ok(body)
}

/// Writes one message sealed as one frame: its frames packed (count, then each length and
/// bytes), sealed by `sealer`.
pub(crate) async fn write_sealed<S: AsyncWrite + Unpin>(
    io: &mut S,
    sealer: &mut noise::Sealer,
    frames: &[Vec<u8>],
) -> Result<(), ZmtpError> {
    let mut plain = Vec::with_capacity(1 + frames.iter().map(|f| 4 + f.len()).sum::<usize>());
    plain.push(frames.len() as u8);
    for f in frames {
        plain.extend_from_slice(&(f.len() as u32).to_le_bytes());
        plain.extend_from_slice(f);
    }
    let sealed = sealer.seal(&plain)?;
    write_frame(io, &sealed, 0).await?;
    io.flush().await?;
    Ok(())
}

/// Reads one sealed message, opening each chunk as it arrives: a forged or replayed frame is
/// refused after at most one chunk. Commands (PING) pass as they are.
pub(crate) async fn read_sealed<S: AsyncRead + Unpin>(
    io: &mut S,
    opener: &mut noise::Opener,
) -> Result<Incoming, ZmtpError> {
    let max = noise::sealed_len(ZMTP_FRAME_BYTES_MAX);
    let (flags, len) = read_frame_head(io, max).await?;
    if flags & FLAG_COMMAND != 0 {
        if len > COMMAND_BYTES_MAX {
            return Err(ZmtpError::FrameTooLarge {
                announced: len as u64,
                max: COMMAND_BYTES_MAX,
            });
        }
        let mut body = vec![0u8; len];
        io.read_exact(&mut body).await?;
        return Ok(Incoming::Command(body));
    }
    if flags & FLAG_MORE != 0 {
        return Err(ZmtpError::BadCommand(
            "a sealed message is one frame".into(),
        ));
    }
    let mut plain = Vec::with_capacity(len.min(READ_GROWTH_BYTES));
    let mut chunk = vec![0u8; len.min(noise::NOISE_MESSAGE_BYTES_MAX)];
    let mut left = len;
    while left > 0 {
        let n = left.min(noise::NOISE_MESSAGE_BYTES_MAX);
        io.read_exact(&mut chunk[..n]).await?;
        opener.open_chunk(&chunk[..n], &mut plain)?;
        left -= n;
    }
    if len == 0 {
        return Err(noise::NoiseError::Malformed(0).into());
    }
    unpack(&plain).map(Incoming::Message)
}

/// The frames of a packed message (see [`write_sealed`]), every length checked.
fn unpack(plain: &[u8]) -> Result<Vec<Vec<u8>>, ZmtpError> {
    let bad = || ZmtpError::BadCommand("malformed sealed message".into());
    let (&count, mut rest) = plain.split_first().ok_or_else(bad)?;
    if count as usize > FRAMES_PER_MESSAGE_MAX {
        return Err(ZmtpError::TooManyFrames {
            max: FRAMES_PER_MESSAGE_MAX,
        });
    }
    let mut frames = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let (len, tail) = rest.split_first_chunk::<4>().ok_or_else(bad)?;
        let len = u32::from_le_bytes(*len) as usize;
        if len > tail.len() {
            return Err(bad());
        }
        let (frame, tail) = tail.split_at(len);
        frames.push(frame.to_vec());
        rest = tail;
    }
    if !rest.is_empty() || frames.is_empty() {
        return Err(bad());
    }
    Ok(frames)
}

/// Writes one message (its frames, MORE set on all but the last).
pub(crate) async fn write_message<S: AsyncWrite + Unpin>(
    io: &mut S,
    frames: &[Vec<u8>],
) -> Result<(), ZmtpError> {
    for (i, frame) in frames.iter().enumerate() {
        let more = if i + 1 < frames.len() { FLAG_MORE } else { 0 };
        write_frame(io, frame, more).await?;
    }
    io.flush().await?;
    Ok(())
}

/// Reads one message. Commands between messages: PING is answered by the caller (it gets
/// `Ok(None)` with `ping` set), others are ignored.
pub(crate) async fn read_message<S: AsyncRead + Unpin>(io: &mut S) -> Result<Incoming, ZmtpError> {
    let mut frames = Vec::new();
    loop {
        let (flags, body) = read_frame(io, ZMTP_FRAME_BYTES_MAX).await?;
        if flags & FLAG_COMMAND != 0 {
            if !frames.is_empty() {
                return Err(ZmtpError::BadCommand("command inside a message".into()));
            }
            return Ok(Incoming::Command(body));
        }
        if frames.len() == FRAMES_PER_MESSAGE_MAX {
            return Err(ZmtpError::TooManyFrames {
                max: FRAMES_PER_MESSAGE_MAX,
            });
        }
        frames.push(body);
        if flags & FLAG_MORE == 0 {
            return Ok(Incoming::Message(frames));
        }
    }
}

/// What [`read_message`] read.
pub(crate) enum Incoming {
    /// A whole message.
    Message(Vec<Vec<u8>>),
    /// A command frame's body (PING, ERROR, ...).
    Command(Vec<u8>),
}

/// The PONG for a PING command body, if `body` is a PING (ZMTP 3.1 heartbeats).
pub(crate) fn pong_for(body: &[u8]) -> Option<Vec<u8>> {
    let rest = body.strip_prefix(b"\x04PING")?;
    let context = rest.get(2..).unwrap_or(&[]);
    let mut pong = b"\x04PONG".to_vec();
    pong.extend_from_slice(&context[..context.len().min(16)]);
    Some(pong)
}

pub(crate) async fn write_command<S: AsyncWrite + Unpin>(
    io: &mut S,
    body: &[u8],
) -> Result<(), ZmtpError> {
    write_frame(io, body, FLAG_COMMAND).await?;
    io.flush().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_round_trips_and_refuses_truncation() {
        let body = ready_body(SocketType::Dealer, b"worker-7");
        let ready = parse_ready(SocketType::Router, &body).unwrap();
        assert_eq!(ready.identity, b"worker-7");
        // Cut exactly after a whole property, the body is a valid (shorter) READY: the
        // identity is optional. Cut anywhere else, it must be refused.
        let socket_type_end = 6 + 1 + 11 + 4 + 6;
        for cut in 0..body.len() {
            let parsed = parse_ready(SocketType::Router, &body[..cut]);
            assert_eq!(parsed.is_ok(), cut == socket_type_end, "cut at {cut}");
        }
    }

    #[test]
    fn greeting_checks_signature_version_and_mechanism() {
        assert!(check_greeting(&greeting()).is_ok());
        let mut g = greeting();
        g[10] = 2;
        assert!(matches!(
            check_greeting(&g),
            Err(ZmtpError::UnsupportedVersion { major: 2, .. })
        ));
        let mut g = greeting();
        g[12..17].copy_from_slice(b"PLAIN");
        assert!(matches!(
            check_greeting(&g),
            Err(ZmtpError::UnsupportedMechanism(_))
        ));
        let mut g = greeting();
        g[0] = b'G';
        assert!(matches!(check_greeting(&g), Err(ZmtpError::BadGreeting(_))));
    }

    #[tokio::test]
    async fn a_huge_announced_frame_is_refused_before_allocating() {
        let mut input: &[u8] = &[FLAG_LONG, 0, 0, 1, 0, 0, 0, 0, 0]; // 1 TiB
        let err = read_message(&mut input).await.err().unwrap();
        assert!(matches!(err, ZmtpError::FrameTooLarge { announced, .. } if announced == 1 << 40));
    }
}
