//! Noise sessions: what every connection runs when a shared secret is configured (the
//! control plane and the bootstrap protocol over ZMTP, the TCP data plane).
//!
//! The construction is the Noise framework's `NNpsk0` pattern over X25519, ChaCha20-Poly1305
//! and BLAKE2s ([`PATTERN`], through the `snow` crate), keyed by a pre-shared key derived
//! from the secret ([`Key::psk`]). Both ends contribute a fresh ephemeral key to every
//! connection, so:
//! - only a holder of the secret completes a handshake (the first message is sealed under
//!   the pre-shared key, the second under it and both ephemerals);
//! - each connection's keys are its own: a frame captured on one connection does not open on
//!   another, and a replayed handshake message gets nowhere (the replayer cannot derive the
//!   keys the responder's fresh ephemeral produced);
//! - each direction numbers its frames (the AEAD nonce is the frame's sequence number, kept
//!   by each end, never sent): a frame replayed, reordered or dropped on a connection fails
//!   to open, refused by name ([`NoiseError::Refused`]), and the connection is closed.
//!
//! The prologue names the plane ([`PROLOGUE_ZMTP`], [`PROLOGUE_DATA`]), so a handshake for
//! one plane is refused by another. Frames are sealed in chunks of at most
//! [`CHUNK_PLAINTEXT_BYTES_MAX`] (Noise's 65535-byte message minus the tag); a reader opens
//! each chunk as it arrives ([`Opener`]), so a forged stream is refused after at most one
//! chunk ([`NOISE_MESSAGE_BYTES_MAX`]) is buffered.

use crate::auth::Key;

/// The Noise pattern and primitives.
pub const PATTERN: &str = "Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s";

/// Prologue of control-plane and bootstrap sessions (ZMTP).
pub const PROLOGUE_ZMTP: &[u8] = b"handoff zmtp v1";

/// Prologue of TCP data-plane sessions.
pub const PROLOGUE_DATA: &[u8] = b"handoff data v1";

/// Largest Noise message (the framework's limit).
pub const NOISE_MESSAGE_BYTES_MAX: usize = 65_535;

/// Bytes of the AEAD tag on every sealed chunk.
pub const TAG_BYTES: usize = 16;

/// Plaintext bytes per sealed chunk.
pub const CHUNK_PLAINTEXT_BYTES_MAX: usize = NOISE_MESSAGE_BYTES_MAX - TAG_BYTES;

/// Largest handshake message: an ephemeral key (32 bytes) and the tag of an empty payload
/// (16), with room to spare. A peer that announces more before it is authenticated is
/// refused before anything is read: this is all a stranger can make us buffer.
pub const HANDSHAKE_MESSAGE_BYTES_MAX: usize = 128;

/// What a Noise session refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoiseError {
    /// The handshake failed: the peer does not hold the same secret, speaks another plane,
    /// or sent something that is not a handshake message.
    #[error("authentication failed in the handshake (not the same secret?): {0}")]
    Handshake(String),
    /// A frame did not open as the next frame of this session in its direction: replayed,
    /// reordered, forged, or from another connection.
    #[error("frame {seq} refused: not the next frame of this session (replayed, reordered, forged or from another connection)")]
    Refused {
        /// The sequence number it was expected to carry.
        seq: u64,
    },
    /// A sealed frame whose length cannot be a whole number of chunks.
    #[error("sealed frame of {0} bytes is malformed")]
    Malformed(usize),
}

fn builder<'k>(key: &'k Key, prologue: &'static [u8]) -> Result<snow::Builder<'k>, NoiseError> {
    let params: snow::params::NoiseParams = PATTERN
        .parse()
        .map_err(|e| NoiseError::Handshake(format!("pattern: {e}")))?;
    snow::Builder::new(params)
        .prologue(prologue)
        .and_then(|b| b.psk(0, key.psk()))
        .map_err(|e| NoiseError::Handshake(e.to_string()))
}

/// The initiator's side of a handshake (the end that connected).
pub struct Initiator(snow::HandshakeState);

/// The responder's side of a handshake (the end that accepted).
pub struct Responder(snow::HandshakeState);

impl Initiator {
    /// A handshake with a fresh ephemeral key.
    pub fn new(key: &Key, prologue: &'static [u8]) -> Result<Initiator, NoiseError> {
        let hs = builder(key, prologue)?
            .build_initiator()
            .map_err(|e| NoiseError::Handshake(e.to_string()))?;
        Ok(Initiator(hs))
    }

    /// The first message (`-> psk, e`), to send.
    pub fn hello(&mut self) -> Result<Vec<u8>, NoiseError> {
        write(&mut self.0)
    }

    /// Reads the responder's answer (`<- e, ee`): the session, or the refusal.
    pub fn finish(mut self, answer: &[u8]) -> Result<Session, NoiseError> {
        read(&mut self.0, answer)?;
        Session::from_handshake(self.0)
    }
}

impl Responder {
    /// A handshake with a fresh ephemeral key.
    pub fn new(key: &Key, prologue: &'static [u8]) -> Result<Responder, NoiseError> {
        let hs = builder(key, prologue)?
            .build_responder()
            .map_err(|e| NoiseError::Handshake(e.to_string()))?;
        Ok(Responder(hs))
    }

    /// Reads the initiator's first message and returns the answer to send with the session.
    pub fn answer(mut self, hello: &[u8]) -> Result<(Vec<u8>, Session), NoiseError> {
        read(&mut self.0, hello)?;
        let answer = write(&mut self.0)?;
        Ok((answer, Session::from_handshake(self.0)?))
    }
}

fn write(hs: &mut snow::HandshakeState) -> Result<Vec<u8>, NoiseError> {
    let mut out = vec![0u8; HANDSHAKE_MESSAGE_BYTES_MAX];
    let n = hs
        .write_message(&[], &mut out)
        .map_err(|e| NoiseError::Handshake(e.to_string()))?;
    out.truncate(n);
    Ok(out)
}

fn read(hs: &mut snow::HandshakeState, msg: &[u8]) -> Result<(), NoiseError> {
    if msg.len() > HANDSHAKE_MESSAGE_BYTES_MAX {
        return Err(NoiseError::Handshake(format!(
            "handshake message of {} bytes (at most {HANDSHAKE_MESSAGE_BYTES_MAX})",
            msg.len()
        )));
    }
    let mut payload = [0u8; HANDSHAKE_MESSAGE_BYTES_MAX];
    hs.read_message(msg, &mut payload)
        .map_err(|e| NoiseError::Handshake(e.to_string()))?;
    Ok(())
}

/// An established session, split into its two directions so that a reader and a writer can
/// run concurrently.
pub struct Session {
    /// Seals what we send.
    pub sealer: Sealer,
    /// Opens what we receive.
    pub opener: Opener,
}

impl Session {
    fn from_handshake(hs: snow::HandshakeState) -> Result<Session, NoiseError> {
        let state = hs
            .into_stateless_transport_mode()
            .map_err(|e| NoiseError::Handshake(e.to_string()))?;
        let state = std::sync::Arc::new(state);
        Ok(Session {
            sealer: Sealer {
                state: state.clone(),
                seq: 0,
            },
            opener: Opener { state, seq: 0 },
        })
    }
}

/// Seals frames in our direction, numbering every chunk.
pub struct Sealer {
    state: std::sync::Arc<snow::StatelessTransportState>,
    seq: u64,
}

/// Bytes a sealed frame of `plain` bytes takes: its chunks' plaintext and one tag each (an
/// empty frame is one empty chunk).
pub fn sealed_len(plain: usize) -> usize {
    let chunks = plain.div_ceil(CHUNK_PLAINTEXT_BYTES_MAX).max(1);
    plain + chunks * TAG_BYTES
}

impl Sealer {
    /// Seals `plain` into one frame: its chunks, each sealed under the next sequence number.
    pub fn seal(&mut self, plain: &[u8]) -> Result<Vec<u8>, NoiseError> {
        let mut out = vec![0u8; sealed_len(plain.len())];
        let mut at = 0;
        // An empty frame is one empty chunk, so it is sealed and numbered like any other.
        let empty: [&[u8]; 1] = [&[]];
        let chunks: Box<dyn Iterator<Item = &[u8]>> = if plain.is_empty() {
            Box::new(empty.into_iter())
        } else {
            Box::new(plain.chunks(CHUNK_PLAINTEXT_BYTES_MAX))
        };
        for chunk in chunks {
            let end = at + chunk.len() + TAG_BYTES;
            let n = self
                .state
                .write_message(self.seq, chunk, &mut out[at..end])
                .map_err(|e| NoiseError::Handshake(format!("sealing: {e}")))?;
            self.seq += 1;
            at += n;
        }
        out.truncate(at);
        Ok(out)
    }
}

/// Opens frames in the peer's direction, each chunk under the sequence number it must carry.
pub struct Opener {
    state: std::sync::Arc<snow::StatelessTransportState>,
    seq: u64,
}

impl Opener {
    /// Opens one sealed chunk (at most [`NOISE_MESSAGE_BYTES_MAX`] bytes), appending its
    /// plaintext to `out`.
    pub fn open_chunk(&mut self, sealed: &[u8], out: &mut Vec<u8>) -> Result<(), NoiseError> {
        if sealed.len() < TAG_BYTES || sealed.len() > NOISE_MESSAGE_BYTES_MAX {
            return Err(NoiseError::Malformed(sealed.len()));
        }
        let at = out.len();
        out.resize(at + sealed.len() - TAG_BYTES, 0);
        let opened = self.state.read_message(self.seq, sealed, &mut out[at..]);
        match opened {
            Ok(n) => {
                out.truncate(at + n);
                self.seq += 1;
                Ok(())
            }
            Err(_) => {
                out.truncate(at);
                Err(NoiseError::Refused { seq: self.seq })
            }
        }
    }

    /// Opens a whole sealed frame (the chunks [`Sealer::seal`] made).
    pub fn open(&mut self, sealed: &[u8]) -> Result<Vec<u8>, NoiseError> {
        if sealed.len() < TAG_BYTES {
            return Err(NoiseError::Malformed(sealed.len()));
        }
        let mut out = Vec::with_capacity(sealed.len());
        for chunk in sealed.chunks(NOISE_MESSAGE_BYTES_MAX) {
            self.open_chunk(chunk, &mut out)?;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &[u8]) -> Key {
        Key::new(s).unwrap_or_else(|e| panic!("{e}"))
    }

    fn pair(
        a: &Key,
        b: &Key,
        pa: &'static [u8],
        pb: &'static [u8],
    ) -> Result<(Session, Session), NoiseError> {
        let mut i = Initiator::new(a, pa)?;
        let r = Responder::new(b, pb)?;
        let hello = i.hello()?;
        let (answer, rs) = r.answer(&hello)?;
        Ok((i.finish(&answer)?, rs))
    }

    #[test]
    fn frames_round_trip_in_both_directions_and_any_size() {
        let k = key(b"0123456789abcdef-secret");
        let (mut i, mut r) =
            pair(&k, &k, PROLOGUE_ZMTP, PROLOGUE_ZMTP).unwrap_or_else(|e| panic!("{e}"));
        for len in [
            0,
            1,
            CHUNK_PLAINTEXT_BYTES_MAX,
            CHUNK_PLAINTEXT_BYTES_MAX + 1,
            300_000,
        ] {
            let plain: Vec<u8> = (0..len).map(|x| x as u8).collect();
            let sealed = i.sealer.seal(&plain).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(sealed.len(), sealed_len(len));
            assert_eq!(r.opener.open(&sealed), Ok(plain.clone()));
            let back = r.sealer.seal(&plain).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(i.opener.open(&back), Ok(plain));
        }
    }

    #[test]
    fn replayed_reordered_and_cross_connection_frames_are_refused_by_name() {
        let k = key(b"0123456789abcdef-secret");
        let (mut i, mut r) =
            pair(&k, &k, PROLOGUE_ZMTP, PROLOGUE_ZMTP).unwrap_or_else(|e| panic!("{e}"));
        let one = i
            .sealer
            .seal(b"heartbeat 1")
            .unwrap_or_else(|e| panic!("{e}"));
        let two = i
            .sealer
            .seal(b"heartbeat 2")
            .unwrap_or_else(|e| panic!("{e}"));
        // Reordered: the second frame first.
        assert_eq!(r.opener.open(&two), Err(NoiseError::Refused { seq: 0 }));
        assert_eq!(r.opener.open(&one), Ok(b"heartbeat 1".to_vec()));
        // Replayed: the first frame again.
        assert_eq!(r.opener.open(&one), Err(NoiseError::Refused { seq: 1 }));
        assert_eq!(r.opener.open(&two), Ok(b"heartbeat 2".to_vec()));
        // Another connection with the same secret: fresh keys, the captured frame is refused.
        let (_, mut r2) =
            pair(&k, &k, PROLOGUE_ZMTP, PROLOGUE_ZMTP).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r2.opener.open(&one), Err(NoiseError::Refused { seq: 0 }));
        // Our own direction's frame reflected back to us.
        assert_eq!(i.opener.open(&one), Err(NoiseError::Refused { seq: 0 }));
    }

    #[test]
    fn another_secret_another_plane_or_a_replayed_hello_get_nowhere() {
        let k = key(b"0123456789abcdef-secret");
        let other = key(b"0123456789abcdef-SECRET");
        assert!(matches!(
            pair(&k, &other, PROLOGUE_ZMTP, PROLOGUE_ZMTP),
            Err(NoiseError::Handshake(_))
        ));
        assert!(matches!(
            pair(&k, &k, PROLOGUE_ZMTP, PROLOGUE_DATA),
            Err(NoiseError::Handshake(_))
        ));
        // A captured first message replayed to a new responder is answered, but the replayer
        // cannot read the answer and its frames (sealed under the original session) fail.
        let mut i = Initiator::new(&k, PROLOGUE_ZMTP).unwrap_or_else(|e| panic!("{e}"));
        let hello = i.hello().unwrap_or_else(|e| panic!("{e}"));
        let (answer, _) = Responder::new(&k, PROLOGUE_ZMTP)
            .and_then(|r| r.answer(&hello))
            .unwrap_or_else(|e| panic!("{e}"));
        let mut original = i.finish(&answer).unwrap_or_else(|e| panic!("{e}"));
        let captured = original
            .sealer
            .seal(b"register")
            .unwrap_or_else(|e| panic!("{e}"));
        let (_, mut replayed) = Responder::new(&k, PROLOGUE_ZMTP)
            .and_then(|r| r.answer(&hello))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            replayed.opener.open(&captured),
            Err(NoiseError::Refused { seq: 0 })
        );
        // An oversized handshake message is refused before it is parsed.
        let r = Responder::new(&k, PROLOGUE_ZMTP).unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(
            r.answer(&[0u8; HANDSHAKE_MESSAGE_BYTES_MAX + 1]),
            Err(NoiseError::Handshake(_))
        ));
    }
}
