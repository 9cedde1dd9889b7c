//! Targets per segment: how many labels other than `-100` [`materialize`] gives each
//! segment of a plan, counted without building any row. A sampler needs them to hand every
//! micro-batch the normaliser of its whole optimizer step (all ranks, all accumulation
//! micro-steps) before any batch exists.
//!
//! The rules are materialize's: a segment writes `n` data tokens (its piece of the sequence,
//! after truncation) and then `seqlen - n` separators; a data token is a target when its
//! label (the token itself without labels) is not `-100` and its loss mask is not 0; a
//! separator is a target with `train_separators`; the first position of a segment never is.
//! A proptest below checks the counts against materialize's own, pack by pack.
//!
//! ```
//! use fastpack_core::column::Ints;
//! use fastpack_core::materialize::PlanRef;
//! use fastpack_core::targets::{Ragged, Sources};
//! use fastpack_core::targets::segment_targets;
//! use fastpack_core::{pack, PackOptions};
//! let plan = pack(&[3u32, 2], &PackOptions::new(8)).unwrap();
//! let tokens = Ragged { values: Ints::I32(&[10, 11, 12, 20, 21]), offsets: Ints::I64(&[0, 3, 5]) };
//! let sources = Sources { tokens, labels: None, loss_mask: None };
//! let counts = segment_targets(&PlanRef::from(&plan), &sources, None, false).unwrap();
//! assert_eq!(counts.iter().sum::<u32>(), 3); // labels [-100, 11, 12] and [-100, 21]
//! ```
//!
//! [`materialize`]: crate::materialize::materialize

use rayon::prelude::*;

use crate::column::Ints;
use crate::error::{Error, Result};
use crate::materialize::{PlanRef, IGNORE_INDEX};

/// Contiguous ragged data read in place: row `i` is `values[offsets[i]..offsets[i + 1]]`.
#[derive(Debug, Clone, Copy)]
pub struct Ragged<'a, V> {
    pub values: V,
    pub offsets: Ints<'a>,
}

/// The data whose targets are counted: token ids, optional labels and 0/1 loss mask.
#[derive(Debug, Clone, Copy)]
pub struct Sources<'a> {
    pub tokens: Ragged<'a, Ints<'a>>,
    pub labels: Option<Ragged<'a, Ints<'a>>>,
    pub loss_mask: Option<Ragged<'a, &'a [u8]>>,
}
use crate::plan::{Overlong, Strategy};

/// Segments per parallel task.
const TASK_SEGMENTS: usize = 1 << 12;

#[inline]
fn at(ints: &Ints<'_>, i: usize) -> i64 {
    match ints {
        Ints::I32(v) => v[i] as i64,
        Ints::I64(v) => v[i],
    }
}

/// The checked value range of row `i`.
fn row<V>(data: &Ragged<'_, V>, len: usize, arg: &'static str, i: usize) -> Result<(usize, usize)> {
    let rows = data.offsets.len().saturating_sub(1);
    if i >= rows {
        return Err(Error::invalid(arg, format!("row {i} out of range; the data has {rows} rows")));
    }
    let (lo, hi) = (at(&data.offsets, i), at(&data.offsets, i + 1));
    if lo < 0 || hi < lo || hi as u64 > len as u64 {
        return Err(Error::invalid(
            arg,
            format!("offsets[{i}..={}] = {lo}, {hi} do not fit its {len} values", i + 1),
        ));
    }
    Ok((lo as usize, hi as usize))
}

/// Target tokens of every segment of `plan` (in segment order), as
/// [`materialize`](crate::materialize::materialize) would label them with these options.
/// Run it inside [`crate::pool::install`] to choose the thread count.
pub fn segment_targets(
    plan: &PlanRef<'_>,
    sources: &Sources<'_>,
    separator_id: Option<i64>,
    train_separators: bool,
) -> Result<Vec<u32>> {
    let segments = plan.seqlens.len();
    if plan.sample_ids.len() != segments || plan.starts.len() != segments {
        return Err(Error::invalid(
            "plan",
            format!(
                "sample_ids, starts and seqlens differ in length ({}, {}, {segments})",
                plan.sample_ids.len(),
                plan.starts.len()
            ),
        ));
    }
    if plan.reserve > 0 && separator_id.is_none() {
        return Err(Error::invalid(
            "separator_id",
            format!(
                "the plan reserves {} slot(s) after every sequence; pass the separator token id",
                plan.reserve
            ),
        ));
    }
    let separator = u64::from(train_separators && separator_id.is_some_and(|s| s != IGNORE_INDEX));
    let count = |s: usize| segment(plan, sources, separator, s);
    let mut out = vec![0u32; segments];
    out.par_chunks_mut(TASK_SEGMENTS).enumerate().try_for_each(|(task, chunk)| {
        let base = task * TASK_SEGMENTS;
        for (k, slot) in chunk.iter_mut().enumerate() {
            *slot = count(base + k)?;
        }
        Ok(())
    })?;
    Ok(out)
}

fn segment(plan: &PlanRef<'_>, sources: &Sources<'_>, separator: u64, s: usize) -> Result<u32> {
    let sample = plan.sample_ids[s];
    if sample < 0 {
        return Err(Error::invalid("plan", format!("segment {s} refers to sequence {sample}")));
    }
    let i = sample as usize;
    let (tok_lo, tok_hi) = row(&sources.tokens, sources.tokens.values.len(), "tokens", i)?;
    let len = (tok_hi - tok_lo) as u64;
    let (start, seqlen) = (plan.starts[s], plan.seqlens[s]);
    let extended = len + plan.reserve;
    if start < 0 || seqlen <= 0 || start as u64 + seqlen as u64 > extended {
        return Err(Error::invalid(
            "plan",
            format!(
                "segment {s} (sequence {i}, start {start}, {seqlen} tokens) runs past the end \
                 of its sequence: it has {len} tokens + {} reserved; was the plan made from \
                 these lengths?",
                plan.reserve
            ),
        ));
    }
    let (start, seqlen) = (start as u64, seqlen as u64);
    let whole = start == 0 && seqlen == extended;
    let kept =
        if plan.overlong == Overlong::Truncate && plan.strategy != Strategy::Wrapped && !whole {
            seqlen.saturating_sub(plan.reserve)
        } else {
            len
        };
    let n = kept.saturating_sub(start).min(seqlen) as usize;
    let source_start = start.min(len) as usize;

    let (labels, label_lo) = match &sources.labels {
        Some(l) => {
            let (lo, hi) = row(l, l.values.len(), "labels", i)?;
            if (hi - lo) as u64 != len {
                return Err(Error::invalid(
                    "labels",
                    format!("row {i} has {} values for {len} tokens", hi - lo),
                ));
            }
            (&l.values, lo)
        }
        None => (&sources.tokens.values, tok_lo),
    };
    let mask = match &sources.loss_mask {
        Some(m) => {
            let (lo, hi) = row(m, m.values.len(), "loss_mask", i)?;
            if (hi - lo) as u64 != len {
                return Err(Error::invalid(
                    "loss_mask",
                    format!("row {i} has {} values for {len} tokens", hi - lo),
                ));
            }
            Some(&m.values[lo + source_start..lo + source_start + n])
        }
        None => None,
    };
    let lo = label_lo + source_start;
    let valid = |label: i64, keep: Option<u8>| label != IGNORE_INDEX && keep != Some(0);
    // Branch-free sums of 0/1 so the loops vectorise.
    let data: u64 = match (labels, mask) {
        (Ints::I32(v), None) => v[lo..lo + n].iter().map(|&x| u64::from(x != -100)).sum(),
        (Ints::I64(v), None) => v[lo..lo + n].iter().map(|&x| u64::from(x != IGNORE_INDEX)).sum(),
        (Ints::I32(v), Some(m)) => {
            v[lo..lo + n].iter().zip(m).map(|(&x, &k)| u64::from((x != -100) & (k != 0))).sum()
        }
        (Ints::I64(v), Some(m)) => v[lo..lo + n]
            .iter()
            .zip(m)
            .map(|(&x, &k)| u64::from((x != IGNORE_INDEX) & (k != 0)))
            .sum(),
    };
    // The first position is never a target: a data token, or a separator when n == 0.
    let first =
        if n > 0 { u64::from(valid(at(labels, lo), mask.map(|m| m[0]))) } else { separator };
    let separators = (seqlen - n as u64) * separator;
    Ok((data + separators - first) as u32)
}

#[cfg(test)]
mod tests {
    use super::{segment_targets, Ints, Overlong, PlanRef, Ragged, Sources, IGNORE_INDEX};
    use crate::column::{Column, ListChunk, Values};
    use crate::materialize::{self, materialize, MaterializeOptions};
    use crate::plan::Strategy as Planner;
    use crate::{pack, PackOptions};
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        #[test]
        fn counts_equal_materialize_pack_by_pack(
            lengths in prop::collection::vec(0u32..40, 1..40),
            max_len in 4u64..32,
            policy in 0usize..4,
            separator in prop::option::of(0i64..3),
            train_separators in any::<bool>(),
            seed in any::<u64>(),
        ) {
            let mut opts = PackOptions::new(max_len);
            let (strategy, overlong) = [
                (Planner::BestFitDecreasing, Overlong::Split),
                (Planner::BestFitDecreasing, Overlong::Truncate),
                (Planner::NextFit, Overlong::Drop),
                (Planner::Wrapped, Overlong::Error),
            ][policy];
            opts.strategy = strategy;
            opts.overlong = overlong;
            opts.reserve = u64::from(separator.is_some());
            let plan = pack(&lengths, &opts).unwrap();
            // Token ids in 0..5 with every fifth label -100 and a mask that drops some.
            let mut state = seed | 1;
            let mut next = || { state ^= state << 13; state ^= state >> 7; state ^= state << 17; state };
            let total: usize = lengths.iter().map(|&n| n as usize).sum();
            let ids: Vec<i32> = (0..total).map(|_| (next() % 5) as i32).collect();
            let labels: Vec<i64> = ids.iter().map(|&x| if next() % 5 == 0 { IGNORE_INDEX } else { x as i64 }).collect();
            let mask: Vec<u8> = (0..total).map(|_| u8::from(next() % 3 != 0)).collect();
            let mut offsets = vec![0i64];
            for &n in &lengths { offsets.push(offsets.last().unwrap() + n as i64); }
            let ragged = |v| Ragged { values: v, offsets: Ints::I64(&offsets) };
            for (with_labels, with_mask) in [(false, false), (true, false), (false, true), (true, true)] {
                let sources = Sources {
                    tokens: ragged(Ints::I32(&ids)),
                    labels: with_labels.then(|| ragged(Ints::I64(&labels))),
                    loss_mask: with_mask.then(|| Ragged { values: &mask[..], offsets: Ints::I64(&offsets) }),
                };
                let plan_ref = PlanRef::from(&plan);
                let counts = segment_targets(&plan_ref, &sources, separator, train_separators).unwrap();
                let mopts = MaterializeOptions { separator_id: separator, train_separators, ..Default::default() };
                fn column<'a>(name: &str, offsets: &'a [i64], values: Values<'a>) -> Column<'a> {
                    Column::new(name, vec![ListChunk { offsets: Ints::I64(offsets), values }], None).unwrap()
                }
                let token_column = column("input_ids", &offsets, Values::of(&ids));
                let label_column = with_labels.then(|| column("labels", &offsets, Values::of(&labels)));
                let mask_column = with_mask.then(|| column("loss_mask", &offsets, Values::of(&mask)));
                let columns = materialize::Sources {
                    tokens: &token_column,
                    labels: label_column.as_ref(),
                    loss_mask: mask_column.as_ref(),
                };
                for p in 0..plan.num_packs() {
                    let rows = materialize(&plan_ref, &columns, &[p as i64], &mopts).unwrap();
                    let range = plan.pack_offsets[p] as usize..plan.pack_offsets[p + 1] as usize;
                    let ours: u64 = counts[range].iter().map(|&c| c as u64).sum();
                    prop_assert_eq!(ours, rows.num_targets);
                }
            }
        }
    }

    #[test]
    fn errors_are_clear() {
        let plan = pack(&[3u32, 2], &PackOptions::new(8)).unwrap();
        let short = Ragged { values: Ints::I32(&[1, 2, 3]), offsets: Ints::I64(&[0, 3]) };
        let sources = Sources { tokens: short, labels: None, loss_mask: None };
        let err = segment_targets(&PlanRef::from(&plan), &sources, None, false).unwrap_err();
        assert!(err.to_string().contains("tokens: row 1 out of range"), "{err}");
        let mut opts = PackOptions::new(8);
        opts.reserve = 1;
        let plan = pack(&[3u32], &opts).unwrap();
        let tokens = Ragged { values: Ints::I32(&[1, 2, 3]), offsets: Ints::I64(&[0, 3]) };
        let sources = Sources { tokens, labels: None, loss_mask: None };
        let err = segment_targets(&PlanRef::from(&plan), &sources, None, false).unwrap_err();
        assert!(err.to_string().starts_with("separator_id:"), "{err}");
    }
}
