//! A fast 64-bit checksum and a deterministic fill pattern, both pure CPU code.
//!
//! The checksum runs on host bytes only; device buffers are copied back first (see the
//! crate doc for why). Both are streaming: feeding the bytes in any split gives the same
//! result as feeding them at once, which is what lets a device buffer be checksummed
//! through a bounded staging buffer and a request's segments be hashed one by one.

/// Multipliers of the xxHash family: odd, with well-spread bits.
const PRIME_1: u64 = 0x9E37_79B1_85EB_CA87;
const PRIME_2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const PRIME_3: u64 = 0x1656_67B1_9E37_79F9;
const PRIME_4: u64 = 0x85EB_CA77_C2B2_AE63;
const PRIME_5: u64 = 0x27D4_EB2F_1656_67C5;

/// Bytes consumed per step: four independent 8-byte lanes, so that the multiplies of
/// one step overlap in the CPU's pipeline instead of waiting on each other.
const STRIPE_BYTES: usize = 32;
const WORD_BYTES: usize = 8;
const LANES: usize = STRIPE_BYTES / WORD_BYTES;
const _: () = assert!(LANES * WORD_BYTES == STRIPE_BYTES);

/// The golden-ratio increment of splitmix64, which the fill pattern is built on.
const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// A streaming 64-bit checksum in the style of xxHash64 (written here; not bit-compatible
/// with it): four multiply-rotate lanes over 32-byte stripes, merged and avalanched at
/// the end. Not cryptographic: it detects corruption (a wrong block, a torn write, a
/// flipped bit), not tampering.
///
/// Use [`checksum64`] for one slice; use this when the bytes arrive in pieces:
/// `new`, then `update` any number of times, then `finish`.
#[derive(Debug, Clone)]
pub struct Checksum64 {
    lanes: [u64; LANES],
    pending: [u8; STRIPE_BYTES],
    pending_len: usize,
    total_len: u64,
}

impl Default for Checksum64 {
    fn default() -> Self {
        Self::new()
    }
}

impl Checksum64 {
    /// A checksum of nothing yet.
    pub fn new() -> Self {
        Self {
            lanes: [
                PRIME_1.wrapping_add(PRIME_2),
                PRIME_2,
                0,
                0u64.wrapping_sub(PRIME_1),
            ],
            pending: [0; STRIPE_BYTES],
            pending_len: 0,
            total_len: 0,
        }
    }

    /// Feeds more bytes.
    pub fn update(&mut self, mut bytes: &[u8]) {
        self.total_len = self.total_len.wrapping_add(bytes.len() as u64);
        if self.pending_len > 0 {
            let take = (STRIPE_BYTES - self.pending_len).min(bytes.len());
            self.pending[self.pending_len..self.pending_len + take].copy_from_slice(&bytes[..take]);
            self.pending_len += take;
            bytes = &bytes[take..];
            if self.pending_len < STRIPE_BYTES {
                return;
            }
            let stripe = self.pending;
            self.stripe(&stripe);
            self.pending_len = 0;
        }
        let mut stripes = bytes.chunks_exact(STRIPE_BYTES);
        for stripe in &mut stripes {
            self.stripe(stripe);
        }
        let rest = stripes.remainder();
        self.pending[..rest.len()].copy_from_slice(rest);
        self.pending_len = rest.len();
    }

    fn stripe(&mut self, stripe: &[u8]) {
        for (lane, word) in self.lanes.iter_mut().zip(stripe.chunks(WORD_BYTES)) {
            *lane = round(*lane, le_word(word));
        }
    }

    /// The checksum of every byte fed so far.
    pub fn finish(&self) -> u64 {
        let mut hash = if self.total_len >= STRIPE_BYTES as u64 {
            self.merged_lanes()
        } else {
            PRIME_5
        };
        hash = hash.wrapping_add(self.total_len);
        // The last partial word is zero-padded; `total_len`, mixed in above, tells
        // "ab" from "ab\0" apart.
        for word in self.pending[..self.pending_len].chunks(WORD_BYTES) {
            hash ^= round(0, le_word(word));
            hash = hash
                .rotate_left(27)
                .wrapping_mul(PRIME_1)
                .wrapping_add(PRIME_4);
        }
        avalanche(hash)
    }

    fn merged_lanes(&self) -> u64 {
        let [a, b, c, d] = self.lanes;
        let mut hash = a
            .rotate_left(1)
            .wrapping_add(b.rotate_left(7))
            .wrapping_add(c.rotate_left(12))
            .wrapping_add(d.rotate_left(18));
        for lane in self.lanes {
            hash ^= round(0, lane);
            hash = hash.wrapping_mul(PRIME_1).wrapping_add(PRIME_4);
        }
        hash
    }
}

/// The checksum of one slice: `Checksum64` fed once.
pub fn checksum64(bytes: &[u8]) -> u64 {
    let mut checksum = Checksum64::new();
    checksum.update(bytes);
    checksum.finish()
}

fn round(acc: u64, word: u64) -> u64 {
    acc.wrapping_add(word.wrapping_mul(PRIME_2))
        .rotate_left(31)
        .wrapping_mul(PRIME_1)
}

fn avalanche(mut hash: u64) -> u64 {
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(PRIME_2);
    hash ^= hash >> 29;
    hash = hash.wrapping_mul(PRIME_3);
    hash ^ (hash >> 32)
}

/// Up to 8 bytes as a little-endian word, zero-padded.
fn le_word(bytes: &[u8]) -> u64 {
    let mut word = [0u8; WORD_BYTES];
    let n = bytes.len().min(WORD_BYTES);
    word[..n].copy_from_slice(&bytes[..n]);
    u64::from_le_bytes(word)
}

/// The pattern's 8-byte word number `index` for `seed`: element `index` of the
/// splitmix64 sequence that starts at `seed`.
pub fn pattern_word(seed: u64, index: u64) -> u64 {
    let mut z = seed.wrapping_add(index.wrapping_add(1).wrapping_mul(GOLDEN_GAMMA));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fills `dst` with the deterministic pattern of `seed`, as if `dst` started `offset`
/// bytes into one long patterned buffer.
///
/// The byte at absolute position `p` is byte `p % 8` (little-endian) of
/// `pattern_word(seed, p / 8)`, so filling a buffer in pieces gives the same bytes as
/// filling it at once, on the host or staged to a device.
pub fn fill_pattern(dst: &mut [u8], seed: u64, offset: u64) {
    let head = ((WORD_BYTES as u64 - offset % WORD_BYTES as u64) % WORD_BYTES as u64) as usize;
    let (head_bytes, body) = dst.split_at_mut(head.min(dst.len()));
    fill_unaligned(head_bytes, seed, offset);
    let body_offset = offset.wrapping_add(head_bytes.len() as u64);
    let mut words = body.chunks_exact_mut(WORD_BYTES);
    let mut index = body_offset / WORD_BYTES as u64;
    for word in &mut words {
        word.copy_from_slice(&pattern_word(seed, index).to_le_bytes());
        index = index.wrapping_add(1);
    }
    fill_unaligned(
        words.into_remainder(),
        seed,
        index.wrapping_mul(WORD_BYTES as u64),
    );
}

/// The slow path for fewer than 8 bytes at either end of a fill.
fn fill_unaligned(dst: &mut [u8], seed: u64, offset: u64) {
    for (i, byte) in dst.iter_mut().enumerate() {
        let position = offset.wrapping_add(i as u64);
        let word = pattern_word(seed, position / WORD_BYTES as u64).to_le_bytes();
        *byte = word[(position % WORD_BYTES as u64) as usize];
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn patterned(len: usize, seed: u64) -> Vec<u8> {
        let mut bytes = vec![0u8; len];
        fill_pattern(&mut bytes, seed, 0);
        bytes
    }

    #[test]
    fn checksum_values_are_pinned() {
        // Pinned so that a change to the function (which would make checksums from
        // two builds incomparable) is a deliberate one.
        assert_eq!(checksum64(b""), PINNED_EMPTY);
        assert_eq!(checksum64(b"handoff"), PINNED_HANDOFF);
        assert_eq!(checksum64(&patterned(4096, 7)), PINNED_PATTERN_4096_SEED_7);
    }

    /// Equal to XXH64 of no bytes with seed 0: for input shorter than a word the two
    /// functions agree, which checks that the constants were copied right.
    const PINNED_EMPTY: u64 = 0xef46_db37_51d8_e999;
    const PINNED_HANDOFF: u64 = 0xceb3_1681_cc35_f7b6;
    const PINNED_PATTERN_4096_SEED_7: u64 = 0x8d16_c251_ff65_568d;

    #[test]
    fn checksum_tells_length_and_zero_padding_apart() {
        assert_ne!(checksum64(b"ab"), checksum64(b"ab\0"));
        assert_ne!(checksum64(&[0u8; 32]), checksum64(&[0u8; 64]));
        assert_ne!(checksum64(&[]), checksum64(&[0u8]));
    }

    #[test]
    fn checksum_sees_two_top_bit_flips_that_plain_fnv_would_miss() {
        // Word-wise FNV-1a carries a flip of bit 63 unchanged to the end, so two of them
        // cancel; the rotations here move high bits down.
        let original = patterned(256, 1);
        let mut flipped = original.clone();
        flipped[7] ^= 0x80;
        flipped[15] ^= 0x80;
        assert_ne!(checksum64(&original), checksum64(&flipped));
    }

    #[test]
    fn checksum_sees_swapped_blocks() {
        let original = patterned(2 * 4096, 3);
        let mut swapped = original[4096..].to_vec();
        swapped.extend_from_slice(&original[..4096]);
        assert_ne!(checksum64(&original), checksum64(&swapped));
    }

    #[test]
    fn pattern_depends_on_seed_and_position() {
        assert_ne!(patterned(64, 1), patterned(64, 2));
        let bytes = patterned(64, 1);
        assert_ne!(bytes[..32], bytes[32..]);
        assert_eq!(bytes[..8], pattern_word(1, 0).to_le_bytes());
    }

    proptest! {
        #[test]
        fn checksum_is_the_same_whatever_the_split(
            bytes in proptest::collection::vec(any::<u8>(), 0..600),
            cuts in proptest::collection::vec(0usize..600, 0..8),
        ) {
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(bytes.len())).collect();
            cuts.sort_unstable();
            let mut checksum = Checksum64::new();
            let mut start = 0;
            for cut in cuts.into_iter().chain([bytes.len()]) {
                checksum.update(&bytes[start..cut]);
                start = cut;
            }
            prop_assert_eq!(checksum.finish(), checksum64(&bytes));
        }

        #[test]
        fn checksum_sees_any_single_bit_flip(len in 1usize..600, seed: u64, bit: usize) {
            let original = patterned(len, seed);
            let mut flipped = original.clone();
            let bit = bit % (len * 8);
            flipped[bit / 8] ^= 1 << (bit % 8);
            prop_assert_ne!(checksum64(&original), checksum64(&flipped));
        }

        #[test]
        fn pattern_is_the_same_whatever_the_split(len in 0usize..300, cut in 0usize..300, seed: u64) {
            let whole = patterned(len, seed);
            let cut = cut.min(len);
            let mut pieces = vec![0u8; len];
            let (left, right) = pieces.split_at_mut(cut);
            fill_pattern(left, seed, 0);
            fill_pattern(right, seed, cut as u64);
            prop_assert_eq!(pieces, whole);
        }
    }
}
