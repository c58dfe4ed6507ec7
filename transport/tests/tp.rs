//! Heterogeneous TP arithmetic (`handoff_transport::tp`), over TP sizes, head counts and
//! head orders: every decode head is read exactly once, from a prefill rank that holds it,
//! replicas share the reads evenly, and the pieces of a run of heads move exactly those
//! heads' bytes, checked byte by byte; and, against a model of the whole KV cache, every
//! decode rank's blocks are rebuilt from the prefill ranks' spans, every byte written once.

use std::collections::BTreeMap;

use handoff_transport::tp::{
    decode_share, head_sources, pair_heads, prefill_share, rank_heads, tp_spans, HeadGeometry,
    HeadLayout, HeadOrder, TpError, TpSide, TP_HEADS_MAX,
};
use proptest::prelude::*;

const HEADS: [u32; 10] = [1, 2, 3, 4, 6, 8, 12, 16, 32, 64];
const TPS: [u32; 12] = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128];

fn valid(kv_heads: u32, tp: u32) -> bool {
    rank_heads(kv_heads, tp, 0).is_ok()
}

proptest! {
    // About half the drawn shapes are rejected (heads that do not divide): the bound on
    // rejects grows with the cases, for a deeper run (`PROPTEST_CASES`).
    #![proptest_config(ProptestConfig {
        max_global_rejects: 4 * handoff_testkit::proptest_cases(512),
        ..ProptestConfig::with_cases(handoff_testkit::proptest_cases(512))
    })]

    /// Ranks split the heads evenly, or each head is replicated on `tp / kv_heads`
    /// consecutive ranks.
    #[test]
    fn ranks_partition_or_replicate_the_heads(h in 0..HEADS.len(), t in 0..TPS.len()) {
        let (kv_heads, tp) = (HEADS[h], TPS[t]);
        prop_assume!(valid(kv_heads, tp));
        let mut holders = vec![0u32; kv_heads as usize];
        for rank in 0..tp {
            let heads = rank_heads(kv_heads, tp, rank).unwrap();
            prop_assert_eq!(heads.len() as u32, (kv_heads / tp).max(1));
            for head in heads {
                holders[head as usize] += 1;
            }
        }
        let replicas = (tp / kv_heads).max(1);
        prop_assert!(holders.iter().all(|&n| n == replicas), "{:?}", holders);
    }

    /// Every head a decode rank holds is read exactly once, from a prefill rank holding
    /// it; runs from one rank are merged; a head's readers spread over its replicas
    /// within one read of each other.
    #[test]
    fn every_decode_head_is_read_once_and_replicas_share_the_reads(
        h in 0..HEADS.len(),
        p in 0..TPS.len(),
        d in 0..TPS.len(),
    ) {
        let (kv_heads, prefill_tp, decode_tp) = (HEADS[h], TPS[p], TPS[d]);
        prop_assume!(valid(kv_heads, prefill_tp) && valid(kv_heads, decode_tp));
        let mut reads: BTreeMap<(u32, u32), u32> = BTreeMap::new();
        for rank in 0..decode_tp {
            let sources = head_sources(kv_heads, prefill_tp, decode_tp, rank).unwrap();
            let read: Vec<u32> = sources.iter().flat_map(|s| s.heads.clone()).collect();
            let held: Vec<u32> = rank_heads(kv_heads, decode_tp, rank).unwrap().collect();
            prop_assert_eq!(&read, &held, "decode rank {}", rank);
            for pair in sources.windows(2) {
                prop_assert!(
                    pair[0].prefill_rank != pair[1].prefill_rank
                        || pair[0].heads.end != pair[1].heads.start,
                    "unmerged {:?}", pair
                );
            }
            if let Ok(share) = prefill_share(prefill_tp, decode_tp, rank) {
                // Only from its own share of prefill ranks, known from the sizes alone.
                for s in &sources {
                    prop_assert!(share.contains(&s.prefill_rank), "{:?} outside {:?}", s, share);
                }
            }
            for s in &sources {
                let there = rank_heads(kv_heads, prefill_tp, s.prefill_rank).unwrap();
                prop_assert!(there.start <= s.heads.start && s.heads.end <= there.end,
                    "prefill rank {} holds {:?}, not {:?}", s.prefill_rank, there, s.heads);
                for head in s.heads.clone() {
                    *reads.entry((head, s.prefill_rank)).or_default() += 1;
                }
            }
        }
        for head in 0..kv_heads {
            let counts: Vec<u32> = (0..prefill_tp)
                .filter(|&p| rank_heads(kv_heads, prefill_tp, p).unwrap().contains(&head))
                .map(|p| reads.get(&(head, p)).copied().unwrap_or(0))
                .collect();
            let (lo, hi) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
            prop_assert!(hi - lo <= 1, "head {}: reads per replica {:?}", head, counts);
        }
    }

    /// Where one TP size divides the other, each side's share is the other's inverse: the
    /// decode ranks a prefill rank waits for ([`decode_share`]) are exactly those whose
    /// share holds it, every decode rank reads from exactly its share, and every prefill
    /// rank serves the same number of decode ranks (the load spread evenly). Otherwise
    /// both refuse by name.
    #[test]
    fn prefill_and_decode_shares_are_each_others_inverse(
        p in 0..TPS.len(),
        d in 0..TPS.len(),
    ) {
        let (prefill_tp, decode_tp) = (TPS[p], TPS[d]);
        let divides = prefill_tp % decode_tp == 0 || decode_tp % prefill_tp == 0;
        if !divides {
            let refused = |r: Result<std::ops::Range<u32>, TpError>| matches!(r, Err(TpError::Indivisible { .. }));
            prop_assert!(refused(prefill_share(prefill_tp, decode_tp, 0)), "prefill_share");
            prop_assert!(refused(decode_share(prefill_tp, decode_tp, 0)), "decode_share");
            return Ok(());
        }
        let per_prefill = (decode_tp / prefill_tp).max(1);
        for r in 0..prefill_tp {
            let readers = decode_share(prefill_tp, decode_tp, r).unwrap();
            prop_assert_eq!(readers.len() as u32, per_prefill);
            let expect: Vec<u32> = (0..decode_tp)
                .filter(|&d| prefill_share(prefill_tp, decode_tp, d).unwrap().contains(&r))
                .collect();
            prop_assert_eq!(readers.collect::<Vec<_>>(), expect);
        }
        prop_assert!(decode_share(prefill_tp, decode_tp, prefill_tp).is_err());
    }

    /// The pieces of a run of heads move exactly those heads' bytes, for every token,
    /// between any two head orders, and touch nothing else of the destination.
    #[test]
    fn pieces_move_exactly_the_run_of_heads(
        src_heads in 1u32..9,
        dst_heads in 1u32..9,
        tokens in 1u32..9,
        head_bytes in 1u64..9,
        src_order in prop::sample::select(vec![HeadOrder::HeadMajor, HeadOrder::TokenMajor]),
        dst_order in prop::sample::select(vec![HeadOrder::HeadMajor, HeadOrder::TokenMajor]),
        picks in (0u32..64, 0u32..64, 0u32..64),
    ) {
        // A run that fits both sides: its length first, then where it starts on each.
        let count = 1 + picks.2 % src_heads.min(dst_heads);
        let src_first = picks.0 % (src_heads - count + 1);
        let dst_first = picks.1 % (dst_heads - count + 1);
        let src = HeadGeometry { order: src_order, heads: src_heads, block_tokens: tokens, head_bytes };
        let dst = HeadGeometry { order: dst_order, heads: dst_heads, block_tokens: tokens, head_bytes };
        let pieces = pair_heads(&src, src_first, &dst, dst_first, count).unwrap();
        // Every byte of the source block tagged with (head, token, byte).
        let at = |g: &HeadGeometry, h: u32, t: u32, b: u64| -> usize {
            let (h, t, n) = (u64::from(h), u64::from(t), u64::from(g.heads));
            (match g.order {
                HeadOrder::TokenMajor => (t * n + h) * g.head_bytes + b,
                _ => (h * u64::from(g.block_tokens) + t) * g.head_bytes + b,
            }) as usize
        };
        let mut block = vec![0u32; src.block_bytes().unwrap() as usize];
        for h in 0..src_heads {
            for t in 0..tokens {
                for b in 0..head_bytes {
                    block[at(&src, h, t, b)] = 1 + (h * 1000 + t) * 100 + b as u32;
                }
            }
        }
        let mut out = vec![0u32; dst.block_bytes().unwrap() as usize];
        for p in &pieces {
            let (s, d, n) = (p.src as usize, p.dst as usize, p.len as usize);
            out[d..d + n].copy_from_slice(&block[s..s + n]);
        }
        let mut expected = vec![0u32; out.len()];
        for h in 0..count {
            for t in 0..tokens {
                for b in 0..head_bytes {
                    expected[at(&dst, dst_first + h, t, b)] = block[at(&src, src_first + h, t, b)];
                }
            }
        }
        prop_assert_eq!(out, expected);
        let moved: u64 = pieces.iter().map(|p| p.len).sum();
        prop_assert_eq!(moved, u64::from(count) * u64::from(tokens) * head_bytes);
        if src_order == HeadOrder::HeadMajor && dst_order == HeadOrder::HeadMajor {
            prop_assert_eq!(pieces.len(), 1);
        }
    }
}

#[test]
fn latent_caches_are_read_whole_from_one_rank_each_spread_over_prefill() {
    // MLA: one latent head, replicated on every rank of both sides.
    for (prefill_tp, decode_tp) in [(1, 4), (4, 1), (2, 8), (8, 2), (4, 4)] {
        let mut per_prefill = vec![0u32; prefill_tp as usize];
        for rank in 0..decode_tp {
            let sources = head_sources(1, prefill_tp, decode_tp, rank).unwrap();
            assert_eq!(sources.len(), 1);
            assert_eq!(sources[0].heads, 0..1);
            per_prefill[sources[0].prefill_rank as usize] += 1;
        }
        let (lo, hi) = (per_prefill.iter().min(), per_prefill.iter().max());
        assert!(
            hi.unwrap() - lo.unwrap() <= 1,
            "{prefill_tp}->{decode_tp}: {per_prefill:?}"
        );
    }
    let latent = HeadGeometry {
        order: HeadOrder::Latent,
        heads: 1,
        block_tokens: 16,
        head_bytes: 576 * 2,
    };
    let pieces = pair_heads(&latent, 0, &latent, 0, 1).unwrap();
    assert_eq!(pieces.len(), 1);
    assert_eq!(pieces[0].len, latent.block_bytes().unwrap());
    let split = HeadGeometry { heads: 2, ..latent };
    assert_eq!(
        pair_heads(&split, 0, &split, 0, 1),
        Err(TpError::LatentSplit { count: 1 })
    );
    let heads = HeadGeometry {
        order: HeadOrder::HeadMajor,
        ..latent
    };
    assert!(matches!(
        pair_heads(&latent, 0, &heads, 0, 1),
        Err(TpError::Mismatch { .. })
    ));
}

#[test]
fn pairings_that_cannot_work_are_refused_by_name() {
    assert_eq!(
        rank_heads(8, 3, 0),
        Err(TpError::Indivisible {
            what: "kv_heads and tp",
            a: 8,
            b: 3
        })
    );
    assert_eq!(
        rank_heads(4, 6, 0),
        Err(TpError::Indivisible {
            what: "kv_heads and tp",
            a: 4,
            b: 6
        })
    );
    assert_eq!(
        rank_heads(8, 4, 4),
        Err(TpError::NoSuchRank { rank: 4, tp: 4 })
    );
    assert!(matches!(
        rank_heads(0, 1, 0),
        Err(TpError::OutOfRange {
            what: "kv_heads",
            ..
        })
    ));
    assert!(matches!(
        head_sources(8, TP_HEADS_MAX + 1, 1, 0),
        Err(TpError::OutOfRange { what: "tp", .. })
    ));
    assert!(matches!(
        head_sources(8, 3, 2, 0),
        Err(TpError::Indivisible { .. })
    ));
    let g = HeadGeometry {
        order: HeadOrder::TokenMajor,
        heads: 4,
        block_tokens: 16,
        head_bytes: 256,
    };
    assert!(matches!(
        pair_heads(&g, 3, &g, 0, 2),
        Err(TpError::HeadsOutside {
            first: 3,
            end: 5,
            held: 4
        })
    ));
    let longer = HeadGeometry {
        block_tokens: 32,
        ..g
    };
    assert!(matches!(
        pair_heads(&g, 0, &longer, 0, 1),
        Err(TpError::Mismatch { .. })
    ));
    // Token-major against head-major: one piece per token and head, bounded.
    let hnd = HeadGeometry {
        order: HeadOrder::HeadMajor,
        ..g
    };
    assert_eq!(pair_heads(&g, 1, &hnd, 0, 2).unwrap().len(), 2 * 16);
    let huge = HeadGeometry {
        heads: 4096,
        block_tokens: 4096,
        head_bytes: 1,
        order: HeadOrder::TokenMajor,
    };
    let huge_hnd = HeadGeometry {
        order: HeadOrder::HeadMajor,
        ..huge
    };
    assert!(matches!(
        pair_heads(&huge, 0, &huge_hnd, 0, 4096),
        Err(TpError::TooManyPieces { .. })
    ));
}

#[test]
fn decode_tp_above_prefill_tp_reads_a_slice_of_one_rank_and_below_gathers_several() {
    // 8 KV heads. Decode tp 4 from prefill tp 2: rank 1 takes heads 2..4 of prefill rank 0.
    let s = head_sources(8, 2, 4, 1).unwrap();
    assert_eq!(s.len(), 1);
    assert_eq!((s[0].prefill_rank, s[0].heads.clone()), (0, 2..4));
    // Decode tp 1 from prefill tp 4: all 8 heads, two from each prefill rank.
    let s = head_sources(8, 4, 1, 0).unwrap();
    let got: Vec<(u32, std::ops::Range<u32>)> =
        s.into_iter().map(|s| (s.prefill_rank, s.heads)).collect();
    assert_eq!(got, vec![(0, 0..2), (1, 2..4), (2, 4..6), (3, 6..8)]);
    // 2 KV heads, prefill tp 8 (each head on 4 ranks), decode tp 4 (each head on 2):
    // head 0's two readers take two different replicas among ranks 0..4.
    let a = head_sources(2, 8, 4, 0).unwrap();
    let b = head_sources(2, 8, 4, 1).unwrap();
    assert_eq!((a[0].heads.clone(), b[0].heads.clone()), (0..1, 0..1));
    assert_ne!(a[0].prefill_rank, b[0].prefill_rank);
    assert!(a[0].prefill_rank < 4 && b[0].prefill_rank < 4);
}

/// A model-wide block: every (range, part, head, token, byte) its own value.
fn truth(range: usize, part: u64, head: u32, token: u32, byte: u64) -> u32 {
    1 + ((((range as u32 * 4 + part as u32) * 64 + head) * 64 + token) * 16 + byte as u32)
}

/// Rank `rank` of `tp`'s logical block under `layout`, built from [`truth`]: range by
/// range, part by part, its heads in `layout.order`.
fn rank_block(layout: &HeadLayout, tp: u32, rank: u32, parts: &[u64]) -> Vec<u32> {
    let heads = rank_heads(layout.kv_heads, tp, rank).unwrap();
    let held = heads.len() as u32;
    let (t_n, hb) = (layout.block_tokens, layout.head_bytes);
    let mut out = Vec::new();
    for (i, &n) in parts.iter().enumerate() {
        for p in 0..n {
            let mut part = vec![0u32; (u64::from(held) * u64::from(t_n) * hb) as usize];
            for h in 0..held {
                for t in 0..t_n {
                    for b in 0..hb {
                        let at = match layout.order {
                            HeadOrder::TokenMajor => {
                                (u64::from(t) * u64::from(held) + u64::from(h)) * hb + b
                            }
                            _ => (u64::from(h) * u64::from(t_n) + u64::from(t)) * hb + b,
                        };
                        part[at as usize] = truth(i, p, heads.start + h, t, b);
                    }
                }
            }
            out.extend(part);
        }
    }
    out
}

/// Bytes per block of each range of a rank holding `held` heads (only their sum, the
/// logical block, matters to the spans: a part may sit in any range).
fn range_bytes(layout: &HeadLayout, held: u32, parts: &[u64]) -> Vec<u64> {
    parts
        .iter()
        .map(|n| n * u64::from(held) * u64::from(layout.block_tokens) * layout.head_bytes)
        .collect()
}

proptest! {
    // About half the drawn shapes are rejected (heads that do not divide): the bound on
    // rejects grows with the cases, for a deeper run (`PROPTEST_CASES`).
    #![proptest_config(ProptestConfig {
        max_global_rejects: 4 * handoff_testkit::proptest_cases(256),
        ..ProptestConfig::with_cases(handoff_testkit::proptest_cases(256))
    })]

    /// Every decode rank's logical block, rebuilt from the spans of every prefill rank,
    /// equals the model's heads it holds, each byte written exactly once: any TP sizes
    /// where one divides the other, either head order on either side, K and V apart or
    /// together.
    #[test]
    fn decode_blocks_are_rebuilt_from_the_prefill_ranks_spans(
        h in 0..6usize,
        p in 0..7usize,
        d in 0..7usize,
        orders in (prop::sample::select(vec![HeadOrder::HeadMajor, HeadOrder::TokenMajor]),
                   prop::sample::select(vec![HeadOrder::HeadMajor, HeadOrder::TokenMajor])),
        tokens in 1u32..5,
        head_bytes in 1u64..4,
        parts in prop::collection::vec(1u64..3, 1..4),
        latent in any::<bool>(),
    ) {
        let kv_heads = if latent { 1 } else { [1, 2, 4, 6, 8, 12][h] };
        let (prefill_tp, decode_tp) = ([1, 2, 3, 4, 6, 8, 16][p], [1, 2, 3, 4, 6, 8, 16][d]);
        prop_assume!(rank_heads(kv_heads, prefill_tp, 0).is_ok() && rank_heads(kv_heads, decode_tp, 0).is_ok());
        let (src_order, dst_order) = if latent { (HeadOrder::Latent, HeadOrder::Latent) } else { orders };
        let layout = |order| HeadLayout { kv_heads, order, block_tokens: tokens, head_bytes };
        let (src_layout, dst_layout) = (layout(src_order), layout(dst_order));
        let held = |tp, r| rank_heads(kv_heads, tp, r).unwrap().len() as u32;
        for dr in 0..decode_tp {
            let expected = rank_block(&dst_layout, decode_tp, dr, &parts);
            let mut out = vec![0u32; expected.len()];
            let mut writes = vec![0u32; expected.len()];
            let dst_ranges = range_bytes(&dst_layout, held(decode_tp, dr), &parts);
            for pr in 0..prefill_tp {
                let block = rank_block(&src_layout, prefill_tp, pr, &parts);
                let src_ranges = range_bytes(&src_layout, held(prefill_tp, pr), &parts);
                let src = TpSide { tp: prefill_tp, rank: pr, heads: src_layout, block_bytes: src_ranges.iter().sum() };
                let dst = TpSide { tp: decode_tp, rank: dr, heads: dst_layout, block_bytes: dst_ranges.iter().sum() };
                for span in tp_spans(&src, &dst).unwrap() {
                    let (s, t, n) = (span.src as usize, span.dst as usize, span.len as usize);
                    out[t..t + n].copy_from_slice(&block[s..s + n]);
                    for w in &mut writes[t..t + n] {
                        *w += 1;
                    }
                }
            }
            prop_assert!(writes.iter().all(|&w| w == 1), "decode rank {}: writes {:?}", dr, writes);
            prop_assert_eq!(&out, &expected, "decode rank {}", dr);
        }
    }
}

#[test]
fn sides_that_disagree_are_refused_before_any_span() {
    let layout = HeadLayout {
        kv_heads: 8,
        order: HeadOrder::HeadMajor,
        block_tokens: 16,
        head_bytes: 256,
    };
    let four = range_bytes(&layout, 4, &[1, 1]);
    fn side(tp: u32, rank: u32, heads: HeadLayout, ranges: &[u64]) -> TpSide {
        TpSide {
            tp,
            rank,
            heads,
            block_bytes: ranges.iter().sum(),
        }
    }
    let ok = tp_spans(&side(2, 0, layout, &four), &side(2, 0, layout, &four)).unwrap();
    assert_eq!(
        ok.len(),
        1,
        "two whole ranges, adjacent on both sides: {ok:?}"
    );
    for (what, heads, ranges) in [
        (
            "other KV heads",
            HeadLayout {
                kv_heads: 16,
                ..layout
            },
            four.clone(),
        ),
        (
            "other tokens",
            HeadLayout {
                block_tokens: 32,
                ..layout
            },
            four.clone(),
        ),
        (
            "other head size",
            HeadLayout {
                head_bytes: 128,
                ..layout
            },
            four.clone(),
        ),
        ("a part more", layout, range_bytes(&layout, 4, &[1, 1, 1])),
        ("two parts more", layout, range_bytes(&layout, 4, &[2, 2])),
        (
            "not a whole number of parts",
            layout,
            vec![four[0] + 1, four[1]],
        ),
    ] {
        let got = tp_spans(&side(2, 0, layout, &four), &side(2, 0, heads, &ranges));
        assert!(
            matches!(got, Err(TpError::Mismatch { .. })),
            "{what}: {got:?}"
        );
    }
    // A prefill rank a decode rank takes nothing from gives no spans.
    let eight = range_bytes(&layout, 2, &[1, 1]);
    let none = tp_spans(&side(2, 1, layout, &four), &side(4, 0, layout, &eight)).unwrap();
    assert!(none.is_empty());
}
