//! The simulation's only source of randomness: a seeded splitmix64 generator.
//!
//! Written here rather than taken from a crate so that no default (OS entropy, thread-local
//! state) can slip in, and so that the stream for a seed never changes with a dependency's
//! version. Independent concerns (network, workload, faults) draw from separate streams
//! ([`Rng::fork`]), so adding a draw to one does not shift every other decision.

/// A splitmix64 generator (Steele, Lea, Flood 2014): one `u64` of state, full period 2^64.
#[derive(Clone, Debug)]
pub struct Rng {
    state: u64,
}

/// Parts per million: rates are integers so that every decision is exact and printable.
pub const PPM: u32 = 1_000_000;

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// An independent stream for one concern, named by `stream`.
    pub fn fork(seed: u64, stream: &str) -> Self {
        let mut h = crate::trace::Fnv64::new();
        h.str(stream);
        let mut r = Self::new(seed ^ h.finish());
        r.next_u64();
        r
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A uniform value in `0..n` (0 when `n` is 0), by multiply-shift (no modulo bias to speak of).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// A uniform value in `lo..=hi` (`lo` when `hi < lo`).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + self.below(hi - lo + 1)
    }

    /// True with probability `ppm` / 1 000 000.
    pub fn chance(&mut self, ppm: u32) -> bool {
        ppm > 0 && self.below(u64::from(PPM)) < u64::from(ppm)
    }

    /// One element of a non-empty slice.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        items.get(self.below(items.len() as u64) as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_gives_same_stream_and_forks_differ() {
        let a: Vec<u64> = (0..8)
            .map({
                let mut r = Rng::new(7);
                move |_| r.next_u64()
            })
            .collect();
        let b: Vec<u64> = (0..8)
            .map({
                let mut r = Rng::new(7);
                move |_| r.next_u64()
            })
            .collect();
        assert_eq!(a, b);
        assert_ne!(
            Rng::fork(7, "net").next_u64(),
            Rng::fork(7, "load").next_u64()
        );
    }

    #[test]
    fn draws_stay_in_range() {
        let mut r = Rng::new(1);
        for _ in 0..10_000 {
            assert!(r.range(3, 9) >= 3 && r.range(3, 9) <= 9);
            assert!(r.below(5) < 5);
        }
        assert_eq!(r.below(0), 0);
        assert!(!r.chance(0));
        assert!(r.chance(PPM));
    }
}
