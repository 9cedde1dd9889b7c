//! `pack_segments`: many independent inputs (a mixture's steps) packed in one call.
//!
//! Segment `k` is `lengths[offsets[k]..offsets[k + 1]]`, packed exactly as [`pack_two_level`]
//! packs it alone (shuffled by `seeds[k]` when given). Segments are packed in parallel,
//! each whole on one thread, and joined in segment order: the plan does not depend on the
//! thread count (nor does a failure: the first failed segment's error). One call instead of one per segment saves the per-call overhead (the
//! binding's arrays and dicts, the Python loop and the join), which dominated a mixture
//! of thousands of small steps.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::pack_two_level;
use crate::error::{Error, Result};
use crate::length::Length;
use crate::memory;
use crate::plan::{PackOptions, Plan, Stats};
use crate::two_level::{Bucket, Levels, TwoLevelPlan};

/// The segments' plans laid end to end, and where each segment's packs begin.
#[derive(Debug, Clone, PartialEq)]
pub struct SegmentsPlan {
    /// The joined plan: `sample_ids` index the whole `lengths` (a segment's own ids plus
    /// its offset); `buckets` sum the segments' (the same caps in every segment).
    pub plan: TwoLevelPlan,
    /// Segment `k` holds packs `pack_starts[k]..pack_starts[k + 1]` (`segments + 1`).
    pub pack_starts: Vec<i64>,
}

fn check(n: usize, offsets: &[usize], seeds: Option<&[u64]>, levels: &Levels) -> Result<()> {
    if offsets.first() != Some(&0) || offsets.last() != Some(&n) {
        return Err(Error::invalid(
            "offsets",
            format!(
                "expected the segments' bounds from 0 to the {n} lengths, got {} bounds",
                offsets.len()
            ),
        ));
    }
    if offsets.windows(2).any(|w| w[0] > w[1]) {
        return Err(Error::invalid("offsets", "expected non-decreasing bounds"));
    }
    if let Some(seeds) = seeds {
        if seeds.len() + 1 != offsets.len() {
            return Err(Error::invalid(
                "seeds",
                format!("got {} seeds for {} segments", seeds.len(), offsets.len() - 1),
            ));
        }
    }
    if levels.group_tokens.is_some() {
        return Err(Error::invalid("group_tokens", "segments are packed without groups"));
    }
    Ok(())
}

/// Packs each segment of `lengths` on its own (see the module docs).
///
/// ```
/// use fastpack_core::{pack_segments, Levels, PackOptions};
/// let lengths = [5u32, 3, 4, 4, 2];
/// let opts = PackOptions::new(8);
/// let out = pack_segments(&lengths, &[0, 2, 5], None, &opts, &Levels::default()).unwrap();
/// assert_eq!(out.pack_starts, vec![0, 1, 3]);
/// // Step 0: 5 + 3 in one pack; step 1 (ids 2..5): 4 + 4, then 2 on its own.
/// assert_eq!(out.plan.plan.pack_offsets, vec![0, 2, 4, 5]);
/// assert_eq!(out.plan.plan.sample_ids, vec![0, 1, 2, 3, 4]);
/// ```
pub fn pack_segments<L: Length>(
    lengths: &[L],
    offsets: &[usize],
    seeds: Option<&[u64]>,
    opts: &PackOptions,
    levels: &Levels,
) -> Result<SegmentsPlan> {
    check(lengths.len(), offsets, seeds, levels)?;
    opts.validate()?;
    levels.validate(opts)?;
    let segments = offsets.len() - 1;
    let one = |k: usize| {
        let mut own = opts.clone();
        if let Some(seeds) = seeds {
            own.shuffle_seed = Some(seeds[k]);
        }
        pack_two_level(&lengths[offsets[k]..offsets[k + 1]], &own, levels)
    };
    let workers = rayon::current_num_threads().min(segments);
    let parts: Vec<TwoLevelPlan> = if workers <= 1 {
        (0..segments).map(one).collect::<Result<_>>()?
    } else {
        // One plain thread per worker, each packing whole segments (the next one not
        // taken) on a pool of its own thread only: nested inside the caller's pool, every
        // segment's own parallel phases (joins, pipelined writers) would contend with the
        // other segments and cost more than they save on a small step.
        let next = AtomicUsize::new(0);
        let done: Vec<Vec<(usize, Result<TwoLevelPlan>)>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..workers)
                .map(|_| {
                    scope.spawn(|| {
                        let mut mine = Vec::new();
                        loop {
                            let k = next.fetch_add(1, Ordering::Relaxed);
                            if k >= segments {
                                break mine;
                            }
                            let plan = crate::pool::install(Some(1), || one(k)).and_then(|r| r);
                            let failed = plan.is_err();
                            mine.push((k, plan));
                            if failed {
                                next.store(segments, Ordering::Relaxed);
                            }
                        }
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
                .collect()
        });
        let mut all: Vec<(usize, Result<TwoLevelPlan>)> = done.into_iter().flatten().collect();
        all.sort_unstable_by_key(|(k, _)| *k);
        // The first failed segment's error (every segment before it was packed).
        let mut parts = Vec::with_capacity(segments);
        for (_, plan) in all {
            parts.push(plan?);
        }
        parts
    };
    join(parts, offsets, opts, levels)
}

fn join(
    parts: Vec<TwoLevelPlan>,
    offsets: &[usize],
    opts: &PackOptions,
    levels: &Levels,
) -> Result<SegmentsPlan> {
    let segments: usize = parts.iter().map(|p| p.plan.num_segments()).sum();
    let packs: usize = parts.iter().map(|p| p.plan.num_packs()).sum();
    let mut sample_ids = memory::try_with_capacity::<i64>(segments, "sample_ids")?;
    let mut starts = memory::try_with_capacity::<i64>(segments, "starts")?;
    let mut seqlens = memory::try_with_capacity::<i32>(segments, "seqlens")?;
    let mut pack_offsets = memory::try_with_capacity::<i64>(packs + 1, "pack_offsets")?;
    let mut pack_caps = match levels.long_max_len {
        Some(_) => Some(memory::try_with_capacity::<i32>(packs, "pack_caps")?),
        None => None,
    };
    let mut pack_starts = Vec::with_capacity(parts.len() + 1);
    pack_offsets.push(0);
    pack_starts.push(0);
    let mut stats = Stats::default();
    let mut buckets: Vec<Bucket> = Vec::new();
    for (k, part) in parts.into_iter().enumerate() {
        let p = &part.plan;
        let base = offsets[k] as i64;
        let seg_base = sample_ids.len() as i64;
        sample_ids.extend(p.sample_ids.iter().map(|&id| id + base));
        starts.extend_from_slice(&p.starts);
        seqlens.extend_from_slice(&p.seqlens);
        pack_offsets.extend(p.pack_offsets[1..].iter().map(|&o| o + seg_base));
        pack_starts.push((pack_offsets.len() - 1) as i64);
        if let (Some(all), Some(own)) = (pack_caps.as_mut(), part.pack_caps.as_ref()) {
            all.extend_from_slice(own);
        }
        stats.num_sequences += p.stats.num_sequences; // segments are separate inputs
        stats.add_outcomes(&p.stats);
        if buckets.is_empty() {
            buckets = part
                .buckets
                .iter()
                .map(|b| Bucket { num_sequences: 0, num_packs: 0, total_tokens: 0, ..*b })
                .collect();
        }
        for (all, own) in buckets.iter_mut().zip(&part.buckets) {
            all.num_sequences += own.num_sequences;
            all.num_packs += own.num_packs;
            all.total_tokens += own.total_tokens;
        }
    }
    let plan = Plan::from_arrays(sample_ids, starts, seqlens, pack_offsets, opts, stats);
    let plan = TwoLevelPlan { plan, pack_caps, buckets, groups: None, limits: Vec::new() };
    Ok(SegmentsPlan { plan, pack_starts })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Overlong, Strategy};
    use proptest::prelude::*;

    /// Each segment packed alone, joined by hand: what `pack_segments` must equal.
    fn one_by_one(
        lengths: &[u32],
        offsets: &[usize],
        seeds: Option<&[u64]>,
        opts: &PackOptions,
        levels: &Levels,
    ) -> Vec<TwoLevelPlan> {
        (0..offsets.len() - 1)
            .map(|k| {
                let mut own = opts.clone();
                if let Some(seeds) = seeds {
                    own.shuffle_seed = Some(seeds[k]);
                }
                pack_two_level(&lengths[offsets[k]..offsets[k + 1]], &own, levels).unwrap()
            })
            .collect()
    }

    fn strategy_of(i: u8) -> Strategy {
        [
            Strategy::BestFitDecreasing,
            Strategy::FirstFitDecreasing,
            Strategy::NextFit,
            Strategy::Wrapped,
            Strategy::OnePerPack,
        ][i as usize % 5]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(crate::proptest_cases(64)))]

        #[test]
        fn segments_at_once_equal_each_alone(
            lengths in proptest::collection::vec(0u32..40, 0..300),
            cuts in proptest::collection::vec(0usize..300, 0..12),
            strategy in 0u8..5,
            shuffle in any::<bool>(),
            long in any::<bool>(),
        ) {
            let n = lengths.len();
            let mut offsets: Vec<usize> = cuts.iter().map(|&c| c % (n + 1)).collect();
            offsets.push(0);
            offsets.push(n);
            offsets.sort_unstable();
            let strategy = strategy_of(strategy);
            let mut opts = PackOptions::new(16);
            opts.strategy = strategy;
            opts.overlong = if strategy == Strategy::Wrapped { Overlong::Error } else { Overlong::Split };
            let levels = Levels {
                long_max_len: (long && strategy != Strategy::Wrapped).then_some(32),
                group_tokens: None,
            };
            let seeds: Vec<u64> = (0..offsets.len() as u64 - 1).map(|k| k * 7919 + 3).collect();
            let seeds = shuffle.then_some(seeds.as_slice());
            let alone = one_by_one(&lengths, &offsets, seeds, &opts, &levels);
            let mut results = Vec::new();
            for threads in [1, 4] {
                let out = crate::pool::install(Some(threads), || {
                    pack_segments(&lengths, &offsets, seeds, &opts, &levels)
                })
                .unwrap()
                .unwrap();
                results.push(out);
            }
            prop_assert_eq!(&results[0], &results[1]);
            let out = &results[0];
            let mut packs = 0;
            let mut segs = 0;
            for (k, part) in alone.iter().enumerate() {
                let p = &part.plan;
                let (a, b) = (out.pack_starts[k] as usize, out.pack_starts[k + 1] as usize);
                prop_assert_eq!(b - a, p.num_packs());
                prop_assert_eq!(a, packs);
                let (s0, s1) = (out.plan.plan.pack_offsets[a] as usize, out.plan.plan.pack_offsets[b] as usize);
                prop_assert_eq!(s0, segs);
                let ids: Vec<i64> = p.sample_ids.iter().map(|&i| i + offsets[k] as i64).collect();
                prop_assert_eq!(&out.plan.plan.sample_ids[s0..s1], &ids[..]);
                prop_assert_eq!(&out.plan.plan.starts[s0..s1], &p.starts[..]);
                prop_assert_eq!(&out.plan.plan.seqlens[s0..s1], &p.seqlens[..]);
                let local: Vec<i64> = out.plan.plan.pack_offsets[a..=b].iter().map(|&o| o - s0 as i64).collect();
                prop_assert_eq!(&local[..], &p.pack_offsets[..]);
                if let Some(caps) = &out.plan.pack_caps {
                    prop_assert_eq!(&caps[a..b], &part.pack_caps.as_ref().unwrap()[..]);
                }
                packs = b;
                segs = s1;
            }
            prop_assert_eq!(packs, out.plan.plan.num_packs());
            let total: u64 = alone.iter().map(|p| p.plan.stats.total_tokens).sum();
            prop_assert_eq!(out.plan.plan.stats.total_tokens, total);
        }
    }

    #[test]
    fn bad_offsets_and_seeds_are_refused() {
        let opts = PackOptions::new(8);
        let levels = Levels::default();
        let l = [1u32, 2, 3];
        assert!(pack_segments(&l, &[0, 2], None, &opts, &levels).is_err());
        assert!(pack_segments(&l, &[0, 2, 1, 3], None, &opts, &levels).is_err());
        assert!(pack_segments(&l, &[0, 3], Some(&[1, 2]), &opts, &levels).is_err());
        assert!(pack_segments(&l, &[0, 3], Some(&[1]), &opts, &levels).is_ok());
    }
}
