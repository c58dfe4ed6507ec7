//! Heterogeneous tensor parallelism as plain arithmetic (sans-IO): which KV heads each rank
//! of a TP group holds ([`rank_heads`]), which prefill rank a decode rank takes each of its
//! heads from ([`head_sources`]), and where a run of heads lies inside one block of one
//! range on each side ([`pair_heads`]).
//!
//! The rules are the engines' (vLLM, SGLang): with `tp ≤ kv_heads`, rank `r` holds the
//! `kv_heads / tp` heads from `r × kv_heads / tp`; with `tp > kv_heads`, every head is
//! replicated on `tp / kv_heads` consecutive ranks, each holding one. Latent attention (MLA)
//! is one latent "head" replicated on every rank. Either way one size must divide the other.
//!
//! A decode rank reads each of its heads exactly once, from one prefill rank that holds it.
//! Where heads are replicated on prefill, the replica is chosen so that the decode ranks
//! reading one head spread over its replicas (within one read of each other), and a decode
//! rank reading several replicated heads spreads them over the replicas too.
//!
//! Inside a block a range's bytes are `[heads, tokens, head bytes]` ([`HeadOrder::HeadMajor`],
//! vLLM's HND) or `[tokens, heads, head bytes]` ([`HeadOrder::TokenMajor`], NHD). A run of
//! heads is one segment per block in the first, one per token in the second; between two
//! different orders it is one piece per token and head. Nothing here moves a byte: the data
//! planes are given the pieces.

use std::ops::Range;

/// Most KV heads of a model, and most ranks of a TP group, this arithmetic accepts (larger
/// values are a peer's lie or a bug, and would make piece lists unbounded).
pub const TP_HEADS_MAX: u32 = 1 << 12;

/// Most pieces one block pair of one range may take ([`pair_heads`]): a token-major run of
/// heads against a head-major one is one piece per token and head.
pub const HEAD_PIECES_PER_BLOCK_MAX: usize = 1 << 16;

/// Why a TP pairing, or a run of heads, cannot be worked out. Each names what is wrong.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TpError {
    /// A size that must be positive is zero, or one is above [`TP_HEADS_MAX`].
    #[error("{what} is {value} (1 to {TP_HEADS_MAX})")]
    OutOfRange {
        /// Which size.
        what: &'static str,
        /// Its value.
        value: u64,
    },
    /// Neither of two sizes divides the other (heads cannot be split or replicated evenly).
    #[error("{what}: {a} and {b}, neither divides the other")]
    Indivisible {
        /// Which pair of sizes.
        what: &'static str,
        /// The first.
        a: u32,
        /// The second.
        b: u32,
    },
    /// A rank outside its group.
    #[error("rank {rank} of a TP group of {tp}")]
    NoSuchRank {
        /// The rank.
        rank: u32,
        /// The group's size.
        tp: u32,
    },
    /// Heads asked of a range that does not hold them.
    #[error("heads {first}..{end} of a range holding {held}")]
    HeadsOutside {
        /// The first head asked for (local to the range).
        first: u32,
        /// One past the last.
        end: u64,
        /// Heads the range holds.
        held: u32,
    },
    /// The two sides' blocks do not hold heads of the same shape.
    #[error("mismatched heads: {detail}")]
    Mismatch {
        /// What differs.
        detail: String,
    },
    /// A latent cache has no heads to split: only the whole block moves.
    #[error("a latent (MLA) cache moves whole blocks, not {count} of its heads")]
    LatentSplit {
        /// Heads asked for.
        count: u32,
    },
    /// More pieces than [`HEAD_PIECES_PER_BLOCK_MAX`].
    #[error("{count} pieces per block (at most {HEAD_PIECES_PER_BLOCK_MAX})")]
    TooManyPieces {
        /// Pieces the pairing would take.
        count: u64,
    },
}

fn bounded(what: &'static str, value: u32) -> Result<u32, TpError> {
    if value == 0 || value > TP_HEADS_MAX {
        return Err(TpError::OutOfRange {
            what,
            value: u64::from(value),
        });
    }
    Ok(value)
}

/// How many ranks share each head (`tp / kv_heads` when heads are replicated, else 1), and
/// how many heads each rank holds (`kv_heads / tp`, else 1).
fn split(kv_heads: u32, tp: u32) -> Result<(u32, u32), TpError> {
    let (kv_heads, tp) = (bounded("kv_heads", kv_heads)?, bounded("tp", tp)?);
    if tp <= kv_heads {
        if kv_heads % tp != 0 {
            return Err(TpError::Indivisible {
                what: "kv_heads and tp",
                a: kv_heads,
                b: tp,
            });
        }
        Ok((1, kv_heads / tp))
    } else {
        if tp % kv_heads != 0 {
            return Err(TpError::Indivisible {
                what: "kv_heads and tp",
                a: kv_heads,
                b: tp,
            });
        }
        Ok((tp / kv_heads, 1))
    }
}

/// The model's KV heads that rank `rank` of a TP group of `tp` holds, as head ids.
///
/// # Errors
/// [`TpError::OutOfRange`], [`TpError::Indivisible`], [`TpError::NoSuchRank`].
pub fn rank_heads(kv_heads: u32, tp: u32, rank: u32) -> Result<Range<u32>, TpError> {
    let (replicas, per_rank) = split(kv_heads, tp)?;
    if rank >= tp {
        return Err(TpError::NoSuchRank { rank, tp });
    }
    let first = rank / replicas * per_rank;
    Ok(first..first + per_rank)
}

/// Heads one decode rank takes from one prefill rank: model head ids, consecutive.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct HeadSource {
    /// The prefill rank (its tp rank) that holds them.
    pub prefill_rank: u32,
    /// The heads, as model head ids.
    pub heads: Range<u32>,
}

/// Where decode rank `decode_rank` of `decode_tp` takes each of its heads from, among
/// `prefill_tp` prefill ranks: every head it holds exactly once, consecutive heads from
/// one prefill rank merged, in head order.
///
/// Among a head's replicas (prefill `tp > kv_heads`) the one read is the
/// `(decode_rank + head) mod n`th of the `n` that lie in the decode rank's share of prefill
/// ranks (when one size divides the other: [`prefill_share`]), else of all `n`: the
/// decode ranks that read one head spread over its replicas within one read of each other.
/// So where one size divides the other, a decode rank talks only to its share, and each
/// prefill rank to its [`decode_share`] of decode ranks.
///
/// # Errors
/// As [`rank_heads`], for either side.
pub fn head_sources(
    kv_heads: u32,
    prefill_tp: u32,
    decode_tp: u32,
    decode_rank: u32,
) -> Result<Vec<HeadSource>, TpError> {
    let (replicas, per_prefill_rank) = split(kv_heads, prefill_tp)?;
    let mine = rank_heads(kv_heads, decode_tp, decode_rank)?;
    // Where one size divides the other, a decode rank reads only from its share of
    // prefill's ranks ([`prefill_share`]): which ranks it talks to then follows from the
    // two sizes alone.
    let share = prefill_share(prefill_tp, decode_tp, decode_rank).ok();
    let mut out: Vec<HeadSource> = Vec::new();
    for head in mine {
        let holder = head / per_prefill_rank * replicas;
        let (first, count) = match &share {
            Some(share) => {
                let first = holder.max(share.start);
                (
                    first,
                    (holder + replicas)
                        .min(share.end)
                        .saturating_sub(first)
                        .max(1),
                )
            }
            None => (holder, replicas),
        };
        let prefill_rank = first + (decode_rank + head) % count;
        match out.last_mut() {
            Some(last) if last.prefill_rank == prefill_rank && last.heads.end == head => {
                last.heads.end = head + 1;
            }
            _ => out.push(HeadSource {
                prefill_rank,
                heads: head..head + 1,
            }),
        }
    }
    Ok(out)
}

/// How a range orders a block's bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HeadOrder {
    /// `[heads, tokens, head bytes]` (HND): one head's bytes for the whole block together.
    HeadMajor,
    /// `[tokens, heads, head bytes]` (NHD): per token, every head in turn.
    TokenMajor,
    /// A latent cache (MLA): no heads to split, replicated on every rank.
    Latent,
}

/// One range's block as heads: `heads` heads (those the rank holds), `block_tokens` tokens,
/// `head_bytes` bytes per head and token, ordered by `order`. The block is
/// `heads × block_tokens × head_bytes` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HeadGeometry {
    /// How the block's bytes are ordered.
    pub order: HeadOrder,
    /// Heads this range holds (1 for a latent cache).
    pub heads: u32,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Bytes of one head for one token (head size × element size; for a latent cache, the
    /// latent row).
    pub head_bytes: u64,
}

impl HeadGeometry {
    /// Bytes of one block of the range.
    pub fn block_bytes(&self) -> Option<u64> {
        u64::from(self.heads)
            .checked_mul(u64::from(self.block_tokens))?
            .checked_mul(self.head_bytes)
    }

    fn check(&self, first: u32, count: u32) -> Result<(), TpError> {
        bounded("heads", self.heads)?;
        if self.block_tokens == 0 || self.head_bytes == 0 || self.block_bytes().is_none() {
            return Err(TpError::Mismatch {
                detail: format!("a block of {self:?}"),
            });
        }
        let end = u64::from(first) + u64::from(count);
        if count == 0 || end > u64::from(self.heads) {
            return Err(TpError::HeadsOutside {
                first,
                end,
                held: self.heads,
            });
        }
        if self.order == HeadOrder::Latent && count != self.heads {
            return Err(TpError::LatentSplit { count });
        }
        Ok(())
    }

    /// Offset in the block (one part) of head `head` (local: 0 is the range's first) at
    /// token `token`: where an engine's tensor of this order keeps those bytes.
    pub fn offset(&self, head: u32, token: u32) -> u64 {
        let (h, t) = (u64::from(head), u64::from(token));
        match self.order {
            HeadOrder::HeadMajor | HeadOrder::Latent => {
                (h * u64::from(self.block_tokens) + t) * self.head_bytes
            }
            HeadOrder::TokenMajor => (t * u64::from(self.heads) + h) * self.head_bytes,
        }
    }

    /// Whether `count` heads from `first` lie together for a whole block (one segment).
    fn whole_run(&self, first: u32, count: u32) -> bool {
        match self.order {
            HeadOrder::HeadMajor | HeadOrder::Latent => true,
            // Every head of every token, or a single token per block.
            HeadOrder::TokenMajor => (first == 0 && count == self.heads) || self.block_tokens == 1,
        }
    }
}

/// One piece of a block pair: `len` bytes from `src` in the source block to `dst` in the
/// destination block (offsets inside the blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HeadPiece {
    /// Offset in the source block.
    pub src: u64,
    /// Offset in the destination block.
    pub dst: u64,
    /// Bytes.
    pub len: u64,
}

/// The pieces that move `count` heads, from local head `src_first` of a source block shaped
/// `src` to local head `dst_first` of a destination block shaped `dst`: pieces adjacent on
/// both sides merged, in source order.
///
/// Same order on both sides: one piece per block when the run lies together on both sides
/// (head-major, or every head), else one per token. Different orders: one per token and
/// head ([`HEAD_PIECES_PER_BLOCK_MAX`] at most).
///
/// # Errors
/// [`TpError::Mismatch`] (tokens per block, bytes per head, a latent cache against a split
/// one), [`TpError::HeadsOutside`], [`TpError::LatentSplit`], [`TpError::TooManyPieces`].
pub fn pair_heads(
    src: &HeadGeometry,
    src_first: u32,
    dst: &HeadGeometry,
    dst_first: u32,
    count: u32,
) -> Result<Vec<HeadPiece>, TpError> {
    src.check(src_first, count)?;
    dst.check(dst_first, count)?;
    if src.block_tokens != dst.block_tokens || src.head_bytes != dst.head_bytes {
        return Err(TpError::Mismatch {
            detail: format!(
                "{} tokens of {} bytes per head against {} of {}",
                src.block_tokens, src.head_bytes, dst.block_tokens, dst.head_bytes
            ),
        });
    }
    if (src.order == HeadOrder::Latent) != (dst.order == HeadOrder::Latent) {
        return Err(TpError::Mismatch {
            detail: "a latent cache against one of heads".into(),
        });
    }
    let tokens = src.block_tokens;
    let mut pieces: Vec<HeadPiece> = Vec::new();
    let mut push = |p: HeadPiece| match pieces.last_mut() {
        Some(last) if last.src + last.len == p.src && last.dst + last.len == p.dst => {
            last.len += p.len;
        }
        _ => pieces.push(p),
    };
    let run = u64::from(count) * src.head_bytes;
    if src.whole_run(src_first, count) && dst.whole_run(dst_first, count) && src.order == dst.order
    {
        push(HeadPiece {
            src: src.offset(src_first, 0),
            dst: dst.offset(dst_first, 0),
            len: run * u64::from(tokens),
        });
    } else if src.order == dst.order {
        // Token-major on both sides: the run of heads, token by token.
        for t in 0..tokens {
            push(HeadPiece {
                src: src.offset(src_first, t),
                dst: dst.offset(dst_first, t),
                len: run,
            });
        }
    } else {
        let count_pieces = u64::from(tokens) * u64::from(count);
        if count_pieces > HEAD_PIECES_PER_BLOCK_MAX as u64 {
            return Err(TpError::TooManyPieces {
                count: count_pieces,
            });
        }
        // Source order: head-major walks heads then tokens; token-major the reverse.
        let mut one = |h: u32, t: u32| {
            push(HeadPiece {
                src: src.offset(src_first + h, t),
                dst: dst.offset(dst_first + h, t),
                len: src.head_bytes,
            })
        };
        if src.order == HeadOrder::TokenMajor {
            for t in 0..tokens {
                for h in 0..count {
                    one(h, t);
                }
            }
        } else {
            for h in 0..count {
                for t in 0..tokens {
                    one(h, t);
                }
            }
        }
    }
    if pieces.len() > HEAD_PIECES_PER_BLOCK_MAX {
        return Err(TpError::TooManyPieces {
            count: pieces.len() as u64,
        });
    }
    Ok(pieces)
}

/// Most spans one block pair may take ([`tp_spans`]).
pub const TP_SPANS_PER_BLOCK_MAX: usize = 1 << 16;

/// How one side's blocks hold KV heads: the model's KV heads (all ranks together), how each
/// part of a block orders them, and their size. A logical block is a run of parts (layer
/// 0's K, layer 0's V, layer 1's K, ...: the logical order every layout shares, whichever
/// ranges hold them), each `heads held × block_tokens × head_bytes` bytes, ordered by
/// `order`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HeadLayout {
    /// KV heads of the model (1 for a latent cache).
    pub kv_heads: u32,
    /// How each part of a range's block orders its heads.
    pub order: HeadOrder,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Bytes of one head for one token.
    pub head_bytes: u64,
}

/// One side of a TP pairing: its group's size, its rank, how its blocks hold heads, and
/// its logical block's bytes (the layers both sides hold).
#[derive(Clone, Copy, Debug)]
pub struct TpSide {
    /// TP group size.
    pub tp: u32,
    /// This side's TP rank.
    pub rank: u32,
    /// How its blocks hold heads.
    pub heads: HeadLayout,
    /// Bytes of its logical block: a whole number of parts.
    pub block_bytes: u64,
}

/// One span of a logical block pair: `len` bytes at `src` of the source's logical block go
/// to `dst` of the destination's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Span {
    /// Offset in the source's logical block.
    pub src: u64,
    /// Offset in the destination's logical block.
    pub dst: u64,
    /// Bytes.
    pub len: u64,
}

/// The spans of every logical block that prefill rank `src.rank` sends decode rank
/// `dst.rank`: the heads `dst` takes from `src` ([`head_sources`]), in every part, merged
/// where adjacent on both sides; empty when `dst` takes nothing from `src`. Which ranges
/// hold the parts does not matter (spans are logical offsets): per-layer tensors pair with
/// one contiguous allocation.
///
/// # Errors
/// [`TpError::Mismatch`] when the sides disagree on the model's heads, tokens per block,
/// bytes per head or the number of parts (or a block is not a whole number of parts); the
/// errors of [`head_sources`] and [`pair_heads`]; [`TpError::TooManyPieces`] past
/// [`TP_SPANS_PER_BLOCK_MAX`].
pub fn tp_spans(src: &TpSide, dst: &TpSide) -> Result<Vec<Span>, TpError> {
    let mismatch = |detail: String| Err(TpError::Mismatch { detail });
    let (s, d) = (&src.heads, &dst.heads);
    if s.kv_heads != d.kv_heads || s.block_tokens != d.block_tokens || s.head_bytes != d.head_bytes
    {
        return mismatch(format!(
            "{} KV heads, {} tokens of {} bytes per head against {}, {} of {}",
            s.kv_heads, s.block_tokens, s.head_bytes, d.kv_heads, d.block_tokens, d.head_bytes
        ));
    }
    let src_heads = rank_heads(s.kv_heads, src.tp, src.rank)?;
    let dst_heads = rank_heads(d.kv_heads, dst.tp, dst.rank)?;
    let runs: Vec<Range<u32>> = head_sources(s.kv_heads, src.tp, dst.tp, dst.rank)?
        .into_iter()
        .filter(|h| h.prefill_rank == src.rank)
        .map(|h| h.heads)
        .collect();
    let geometry = |l: &HeadLayout, held: u32| HeadGeometry {
        order: l.order,
        heads: held,
        block_tokens: l.block_tokens,
        head_bytes: l.head_bytes,
    };
    let (src_part, dst_part) = (
        geometry(s, src_heads.len() as u32),
        geometry(d, dst_heads.len() as u32),
    );
    let parts_of = |bytes: u64, part: &HeadGeometry, side: &str| match part.block_bytes() {
        Some(p) if p > 0 && bytes > 0 && bytes % p == 0 => Ok((bytes / p, p)),
        _ => Err(TpError::Mismatch {
            detail: format!(
                "{side}: a {bytes}-byte block is not a whole number of parts of {part:?}"
            ),
        }),
    };
    let (parts, src_part_bytes) = parts_of(src.block_bytes, &src_part, "source")?;
    let (dst_parts, dst_part_bytes) = parts_of(dst.block_bytes, &dst_part, "destination")?;
    if parts != dst_parts {
        return mismatch(format!(
            "{parts} parts of heads per source block, {dst_parts} per destination block"
        ));
    }
    // The pieces of every run, in one part; every part repeats them at its offset.
    let mut per_part: Vec<HeadPiece> = Vec::new();
    for run in &runs {
        // A run lies inside both ranks' heads (`head_sources` reads a head only from a rank
        // holding it); checked all the same, since the sizes come from peers.
        let local = |held: &Range<u32>| {
            run.start
                .checked_sub(held.start)
                .ok_or(TpError::HeadsOutside {
                    first: run.start,
                    end: u64::from(run.end),
                    held: held.end - held.start,
                })
        };
        per_part.extend(pair_heads(
            &src_part,
            local(&src_heads)?,
            &dst_part,
            local(&dst_heads)?,
            run.end.saturating_sub(run.start),
        )?);
    }
    let total = (per_part.len() as u64).saturating_mul(parts);
    if total > TP_SPANS_PER_BLOCK_MAX as u64 {
        return Err(TpError::TooManyPieces { count: total });
    }
    let mut spans: Vec<Span> = Vec::with_capacity(total as usize);
    for p in 0..parts {
        for piece in &per_part {
            let span = Span {
                src: p * src_part_bytes + piece.src,
                dst: p * dst_part_bytes + piece.dst,
                len: piece.len,
            };
            match spans.last_mut() {
                Some(last)
                    if last.src + last.len == span.src && last.dst + last.len == span.dst =>
                {
                    last.len += span.len;
                }
                _ => spans.push(span),
            }
        }
    }
    Ok(spans)
}

/// The prefill ranks decode rank `decode_rank` of `decode_tp` reads from ([`head_sources`]
/// never leaves them), when one TP size divides the other: where `decode_tp` divides
/// `prefill_tp`, its `prefill_tp / decode_tp` consecutive ranks from
/// `decode_rank × prefill_tp / decode_tp` (fan-in: it gathers their heads); where
/// `prefill_tp` divides `decode_tp`, the one rank `decode_rank / (decode_tp / prefill_tp)`
/// (fan-out: that rank holds every head the decode rank holds, and serves
/// `decode_tp / prefill_tp` decode ranks, [`decode_share`]). They follow from the two sizes
/// alone, so a decode rank knows whom to ask before it knows the model's heads.
///
/// # Errors
/// [`TpError::OutOfRange`], [`TpError::NoSuchRank`], and [`TpError::Indivisible`] when
/// neither size divides the other.
pub fn prefill_share(
    prefill_tp: u32,
    decode_tp: u32,
    decode_rank: u32,
) -> Result<Range<u32>, TpError> {
    share(prefill_tp, decode_tp, decode_rank, (prefill_tp, decode_tp))
}

/// The decode ranks that read from prefill rank `prefill_rank` of `prefill_tp`: those
/// whose [`prefill_share`] holds it. One rank where `decode_tp` divides `prefill_tp`
/// (`prefill_rank / (prefill_tp / decode_tp)`); where `prefill_tp` divides `decode_tp`,
/// the `decode_tp / prefill_tp` consecutive ranks from
/// `prefill_rank × decode_tp / prefill_tp`, each taking its own heads. A prefill rank knows
/// from the sizes alone how many decode ranks of a request it waits for.
///
/// # Errors
/// [`TpError::OutOfRange`], [`TpError::NoSuchRank`], and [`TpError::Indivisible`] when
/// neither size divides the other.
pub fn decode_share(
    prefill_tp: u32,
    decode_tp: u32,
    prefill_rank: u32,
) -> Result<Range<u32>, TpError> {
    share(decode_tp, prefill_tp, prefill_rank, (prefill_tp, decode_tp))
}

/// The ranks of a TP group of `tp` that pair with rank `rank` of a group of `other_tp`:
/// `tp / other_tp` consecutive ones where `other_tp` divides `tp`, else the one holding
/// `rank`'s share where `tp` divides `other_tp` ([`prefill_share`], [`decode_share`]).
/// `(a, b)`: prefill's and decode's sizes, as an error names them.
fn share(tp: u32, other_tp: u32, rank: u32, (a, b): (u32, u32)) -> Result<Range<u32>, TpError> {
    let (tp, other_tp) = (bounded("tp", tp)?, bounded("tp", other_tp)?);
    if rank >= other_tp {
        return Err(TpError::NoSuchRank { rank, tp: other_tp });
    }
    if tp % other_tp == 0 {
        let n = tp / other_tp;
        Ok(rank * n..(rank + 1) * n)
    } else if other_tp % tp == 0 {
        let first = rank / (other_tp / tp);
        Ok(first..first + 1)
    } else {
        Err(TpError::Indivisible {
            what: "prefill tp and decode tp",
            a,
            b,
        })
    }
}
