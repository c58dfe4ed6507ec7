//! The run's trace: every observable event, in virtual time, folded into one hash.
//!
//! Events are hashed as canonical text (`t=<ms> <who> <what>`) with FNV-1a 64, written here
//! so the hash of a seed never changes with a dependency. Only a bounded tail of lines is
//! kept (globally and per live request), for violation reports.

use std::collections::{BTreeMap, VecDeque};

/// FNV-1a, 64 bits: tiny, fixed, and good enough to tell two traces apart.
#[derive(Clone, Copy, Debug)]
pub struct Fnv64(u64);

impl Default for Fnv64 {
    fn default() -> Self {
        Self::new()
    }
}

impl Fnv64 {
    /// The FNV offset basis.
    pub fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }

    /// Folds bytes in.
    pub fn bytes(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    /// Folds a string in, followed by a separator so that `"ab","c"` and `"a","bc"` differ.
    pub fn str(&mut self, s: &str) {
        self.bytes(s.as_bytes());
        self.bytes(&[0xff]);
    }

    /// The hash so far.
    pub fn finish(&self) -> u64 {
        self.0
    }
}

/// The trace's hash: eight bytes at a time, each word xored in then multiplied and
/// rotated, so a line costs one multiply per word where FNV-1a takes one per byte (the
/// trace hashes about a dozen lines a request). Written here, like [`Fnv64`], so the
/// hash of a seed never changes with a dependency.
#[derive(Clone, Copy, Debug)]
pub struct Fold64(u64);

impl Default for Fold64 {
    fn default() -> Self {
        Self::new()
    }
}

impl Fold64 {
    /// FNV's offset basis, as a start that is not zero.
    pub fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }

    /// Folds one word in.
    #[inline]
    pub fn word(&mut self, w: u64) {
        self.0 = (self.0 ^ w)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .rotate_left(29);
    }

    /// Folds bytes in, then their length, so that `"ab","c"` and `"a","bc"` differ and a
    /// short tail padded with zeros differs from the same bytes with zeros written out.
    pub fn bytes(&mut self, bytes: &[u8]) {
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            let mut b = [0u8; 8];
            b.copy_from_slice(w);
            self.word(u64::from_le_bytes(b));
        }
        let rest = words.remainder();
        if !rest.is_empty() {
            let mut b = [0u8; 8];
            b[..rest.len()].copy_from_slice(rest);
            self.word(u64::from_le_bytes(b));
        }
        self.word(bytes.len() as u64);
    }

    /// Folds a string in (its bytes and length).
    pub fn str(&mut self, s: &str) {
        self.bytes(s.as_bytes());
    }

    /// The hash so far.
    pub fn finish(&self) -> u64 {
        self.0
    }
}

/// "00" to "99": numbers are written two digits at a time.
const PAIRS: &str = "00010203040506070809101112131415161718192021222324252627282930313233343536373839404142434445464748495051525354555657585960616263646566676869707172737475767778798081828384858687888990919293949596979899";

/// The two digits of `n` (below 100), from [`PAIRS`].
fn pair(n: u64) -> &'static str {
    let at = 2 * (n % 100) as usize;
    PAIRS.get(at..at + 2).unwrap_or("??")
}

/// Appends `n` in decimal, as `{n}` would: the trace's hot lines are mostly numbers, and
/// this skips the formatting machinery (the same text, so the same hash).
pub fn push_num(s: &mut String, n: u64) {
    // Base-100 digits, least significant first (a u64 has at most 10).
    let mut low = [0u8; 10];
    let mut k = 0;
    let mut n = n;
    while n >= 100 {
        low[k] = (n % 100) as u8;
        n /= 100;
        k += 1;
    }
    if n < 10 {
        s.push(char::from(b'0' + n as u8));
    } else {
        s.push_str(pair(n));
    }
    for &d in low[..k].iter().rev() {
        s.push_str(pair(u64::from(d)));
    }
}

/// Appends `blocks` as `{blocks:?}` writes them (`[BlockId(3), BlockId(4)]`), without the
/// formatting machinery.
pub fn push_blocks(s: &mut String, blocks: &[handoff_transport::BlockId]) {
    s.push('[');
    for (i, b) in blocks.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        s.push_str("BlockId(");
        push_num(s, u64::from(b.0));
        s.push(')');
    }
    s.push(']');
}

/// Lines kept in the global tail, for reports.
pub const TRACE_TAIL_LINES_MAX: usize = 64;
/// Lines kept per live request, for reports: a request emits about a dozen in its life.
pub const TRACE_REQUEST_LINES_MAX: usize = 32;

/// The hash of every event, and the recent lines.
#[derive(Debug, Default)]
pub struct Trace {
    hash: Fold64,
    lines: u64,
    line: String,
    /// `t=<ms> ` for the time of the last line: most lines share their time with the one
    /// before (a turn of the main loop records many), so it is written once a time.
    stamp: String,
    stamp_ms: u64,
    /// A ring of the last lines; `next` is where the next line goes. Slots are reused (a
    /// slot's buffer and `line`'s trade places), so recording a line allocates nothing
    /// once the ring is full.
    tail: Vec<String>,
    next: usize,
    per_request: BTreeMap<u64, VecDeque<String>>,
    keep_request_lines: bool,
    echo: bool,
}

impl Trace {
    /// A trace; `keep_request_lines` keeps the last lines of each live request (costs memory
    /// and time; the hash is the same either way).
    pub fn new(keep_request_lines: bool) -> Self {
        Self {
            keep_request_lines,
            ..Self::default()
        }
    }

    /// Records one event at virtual time `t_ms`, about request `req` if any. `what` writes
    /// the event's text after the time.
    pub fn record(
        &mut self,
        t_ms: u64,
        req: Option<u64>,
        what: impl FnOnce(&mut String) -> std::fmt::Result,
    ) {
        if self.stamp.is_empty() || self.stamp_ms != t_ms {
            self.stamp.clear();
            self.stamp.push_str("t=");
            push_num(&mut self.stamp, t_ms);
            self.stamp.push(' ');
            self.stamp_ms = t_ms;
        }
        self.line.clear();
        self.line.push_str(&self.stamp);
        let _ = what(&mut self.line);
        self.hash.str(&self.line);
        self.lines += 1;
        if self.echo {
            println!("{}", self.line);
        }
        if let (true, Some(r)) = (self.keep_request_lines, req) {
            let lines = self.per_request.entry(r).or_default();
            if lines.len() == TRACE_REQUEST_LINES_MAX {
                lines.pop_front();
            }
            lines.push_back(self.line.clone());
        }
        if self.tail.len() < TRACE_TAIL_LINES_MAX {
            self.tail.push(self.line.clone());
        } else {
            // The line moves into the ring as it is, and the line it replaces becomes the
            // buffer the next one is written in: no copy.
            std::mem::swap(&mut self.line, &mut self.tail[self.next]);
        }
        self.next = (self.next + 1) % TRACE_TAIL_LINES_MAX;
    }

    /// Prints every line to stdout as it is recorded (for replaying a seed by eye).
    pub fn echo(&mut self, on: bool) {
        self.echo = on;
    }

    /// Forgets a settled request's lines.
    pub fn forget(&mut self, req: u64) {
        self.per_request.remove(&req);
    }

    /// The last lines about `req` (empty if not kept).
    pub fn request_lines(&self, req: u64) -> Vec<String> {
        self.per_request
            .get(&req)
            .map(|l| l.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// The last lines of the whole run.
    pub fn tail(&self) -> Vec<String> {
        if self.tail.len() < TRACE_TAIL_LINES_MAX {
            return self.tail.clone();
        }
        let (newer, older) = self.tail.split_at(self.next);
        older.iter().chain(newer).cloned().collect()
    }

    /// The hash of every line so far.
    pub fn hash(&self) -> u64 {
        self.hash.finish()
    }

    /// Lines recorded so far.
    pub fn lines(&self) -> u64 {
        self.lines
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fmt::Write as _;

    #[test]
    fn fnv_matches_the_reference_vectors() {
        let mut h = Fnv64::new();
        h.bytes(b"a");
        assert_eq!(h.finish(), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(Fnv64::new().finish(), 0xcbf2_9ce4_8422_2325);
    }

    #[test]
    fn fold_tells_splits_padding_and_order_apart() {
        let hash = |parts: &[&[u8]]| {
            let mut h = Fold64::new();
            for p in parts {
                h.bytes(p);
            }
            h.finish()
        };
        let all = [
            hash(&[b"ab", b"c"]),
            hash(&[b"a", b"bc"]),
            hash(&[b"abc"]),
            hash(&[b"abc\0"]),
            hash(&[b"c", b"ab"]),
            hash(&[b"abcdefgh"]),
            hash(&[b"abcdefgh", b""]),
            hash(&[]),
        ];
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                assert_ne!(a, b);
            }
        }
        assert_eq!(hash(&[b"same"]), hash(&[b"same"]));
    }

    #[test]
    fn trace_hash_depends_on_order_and_content() {
        let mut a = Trace::new(true);
        a.record(1, Some(0), |s| s.write_str("x"));
        a.record(2, Some(0), |s| s.write_str("y"));
        let mut b = Trace::new(false);
        b.record(2, Some(0), |s| s.write_str("y"));
        b.record(1, Some(0), |s| s.write_str("x"));
        assert_ne!(a.hash(), b.hash());
        assert_eq!(a.request_lines(0).len(), 2);
        assert!(b.request_lines(0).is_empty());
    }

    #[test]
    fn fast_text_matches_the_formatter() {
        use handoff_transport::BlockId;
        for n in (0u64..1_100).chain([12_345, 100_000, 1_000_001, u64::from(u32::MAX), u64::MAX]) {
            let mut s = String::new();
            push_num(&mut s, n);
            assert_eq!(s, format!("{n}"));
        }
        for blocks in [
            vec![],
            vec![BlockId(0)],
            vec![BlockId(3), BlockId(40), BlockId(u32::MAX)],
        ] {
            let mut s = String::new();
            push_blocks(&mut s, &blocks);
            assert_eq!(s, format!("{blocks:?}"));
        }
    }

    #[test]
    fn tail_keeps_the_last_lines_in_order() {
        let mut t = Trace::new(false);
        for i in 0..(TRACE_TAIL_LINES_MAX + 5) {
            t.record(i as u64, None, |s| write!(s, "{i}"));
        }
        let tail = t.tail();
        assert_eq!(tail.len(), TRACE_TAIL_LINES_MAX);
        assert_eq!(tail[0], "t=5 5");
        assert_eq!(
            tail[TRACE_TAIL_LINES_MAX - 1],
            format!("t={0} {0}", TRACE_TAIL_LINES_MAX + 4)
        );
    }
}
