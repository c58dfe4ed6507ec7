//! Helpers shared by the UCX tests and the `ucx_bench` example: a seeded pattern, a seeded
//! permutation, a checksum, and "skip when libucp is missing".
#![allow(dead_code)]

use handoff_transport::ucx::{Context, ContextOptions, UcxError};

/// splitmix64: a tiny seeded generator, good enough for test patterns.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A random permutation of `0..n` (Fisher-Yates).
    pub fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut p: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            p.swap(i, j);
        }
        p
    }
}

/// `len` bytes of a pattern drawn from `seed`.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = Rng::new(seed);
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        out.extend_from_slice(&rng.next_u64().to_le_bytes());
    }
    out.truncate(len);
    out
}

/// FNV-1a over 8-byte words (position-sensitive, fast enough for tens of MiB in debug).
pub fn checksum(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut chunks = data.chunks_exact(8);
    for c in &mut chunks {
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        h = (h ^ u64::from_le_bytes(w)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    for &b in chunks.remainder() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn unhex(text: &str) -> Option<Vec<u8>> {
    if text.len() % 2 != 0 {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// A context, or `None` (with the reason printed) when libucp cannot be loaded here.
pub fn context_or_skip(test: &str, options: &ContextOptions) -> Option<Context> {
    match Context::with_options(options) {
        Ok(ctx) => Some(ctx),
        Err(
            e @ (UcxError::LibraryNotFound { .. }
            | UcxError::SymbolMissing { .. }
            | UcxError::VersionTooOld { .. }
            | UcxError::VersionUnsupported { .. }),
        ) => {
            let why = format!("libucp not usable here: {e}");
            handoff_testkit::skip(handoff_testkit::Need::Ucx, test, &why);
            None
        }
        Err(e) => panic!("{test}: UCX context failed: {e}"),
    }
}
