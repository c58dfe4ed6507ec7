//! Optional frame authentication with a shared secret: an HMAC-SHA256 trailer.
//!
//! When a deployment configures a [`Key`], every frame we send carries a 32-byte
//! HMAC-SHA256 over its header and payload (the header's [`Flags::AUTH`] bit says so), and
//! every frame we receive must carry a trailer that verifies under the same key:
//! [`WireError::AuthMissing`] without one, [`WireError::AuthMismatch`] with a wrong one. The
//! comparison is constant-time. The header is covered too, so a trailer cannot be stripped
//! (that changes the flags) nor moved onto another message type.
//!
//! Without a key, frames are sent bare and a trailer on a received frame is not checked: the
//! side that has a key refuses the other's bare frames, so a half-configured pair fails loudly
//! on that side.
//!
//! This authenticates peers against injected or altered frames; it does not encrypt, and
//! replay protection rests on the protocol (incarnations, per-request state), not on the MAC.
//!
//! [`Flags::AUTH`]: crate::wire::frame::Flags::AUTH

use crate::wire::frame::Frame;
use crate::wire::WireError;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::fmt;

/// Length of the HMAC-SHA256 trailer, in bytes.
pub const TAG_BYTES: usize = 32;

/// Shortest shared secret accepted, in bytes: 128 bits, so a secret cannot be guessed.
pub const KEY_BYTES_MIN: usize = 16;

/// A shared secret, ready to sign and verify frames. Cheap to clone.
///
/// Built once at startup from configuration, then passed as `Some(&key)` to
/// [`crate::wire::encode`] and [`crate::wire::decode`].
#[derive(Clone)]
pub struct Key {
    /// HMAC state with the key already absorbed; cloned per frame.
    mac: Hmac<Sha256>,
    /// The Noise pre-shared key derived from the secret ([`crate::noise`]):
    /// HMAC-SHA256(secret, [`PSK_LABEL`]), so the secret itself is never a Noise key.
    psk: [u8; 32],
}

/// Label of the derivation of the Noise pre-shared key from the secret.
pub const PSK_LABEL: &[u8] = b"handoff noise psk v1";

impl Key {
    /// A key from a shared secret of at least [`KEY_BYTES_MIN`] bytes.
    pub fn new(secret: &[u8]) -> Result<Key, WireError> {
        if secret.len() < KEY_BYTES_MIN {
            return Err(WireError::KeyTooShort {
                len: secret.len(),
                min: KEY_BYTES_MIN,
            });
        }
        // HMAC takes keys of any length; the error arm is unreachable but kept as a value.
        let mac =
            <Hmac<Sha256> as Mac>::new_from_slice(secret).map_err(|_| WireError::KeyTooShort {
                len: secret.len(),
                min: KEY_BYTES_MIN,
            })?;
        let mut derive = mac.clone();
        derive.update(PSK_LABEL);
        let psk: [u8; 32] = derive.finalize().into_bytes().into();
        Ok(Key { mac, psk })
    }

    /// The Noise pre-shared key derived from the secret.
    pub fn psk(&self) -> &[u8; 32] {
        &self.psk
    }

    /// The HMAC-SHA256 tag of `bytes`.
    pub fn sign(&self, bytes: &[u8]) -> [u8; TAG_BYTES] {
        let mut mac = self.mac.clone();
        mac.update(bytes);
        mac.finalize().into_bytes().into()
    }

    /// Checks `tag` against `bytes` in constant time.
    pub fn verify(&self, bytes: &[u8], tag: &[u8; TAG_BYTES]) -> Result<(), WireError> {
        let mut mac = self.mac.clone();
        mac.update(bytes);
        mac.verify_slice(tag).map_err(|_| WireError::AuthMismatch)
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Key(<redacted>)")
    }
}

/// Checks a parsed frame's trailer against the configured key, if there is one.
pub fn verify(key: Option<&Key>, frame: &Frame<'_>) -> Result<(), WireError> {
    match (key, frame.trailer) {
        (None, _) => Ok(()),
        (Some(_), None) => Err(WireError::AuthMissing),
        (Some(key), Some(tag)) => key.verify(frame.signed, tag),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_keys_are_refused() {
        assert_eq!(
            Key::new(b"short").map(|_| ()),
            Err(WireError::KeyTooShort { len: 5, min: 16 })
        );
    }

    #[test]
    fn sign_then_verify_and_any_change_fails() {
        let key = Key::new(b"0123456789abcdef").unwrap_or_else(|e| panic!("{e}"));
        let tag = key.sign(b"frame bytes");
        assert_eq!(key.verify(b"frame bytes", &tag), Ok(()));
        assert_eq!(
            key.verify(b"frame bytez", &tag),
            Err(WireError::AuthMismatch)
        );
        let other = Key::new(b"0123456789abcdeF").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            other.verify(b"frame bytes", &tag),
            Err(WireError::AuthMismatch)
        );
        assert_eq!(format!("{key:?}"), "Key(<redacted>)");
    }

    #[test]
    fn matches_rfc_4231_test_case_2() {
        // RFC 4231 case 2 uses a 4-byte key; test the HMAC itself below the length policy.
        let mut mac =
            <Hmac<Sha256> as Mac>::new_from_slice(b"Jefe").unwrap_or_else(|e| panic!("{e}"));
        mac.update(b"what do ya want for nothing?");
        let tag: [u8; TAG_BYTES] = mac.finalize().into_bytes().into();
        let expected = "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843";
        let hex: String = tag.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, expected);
    }
}
