//! Targets per segment: how many labels other than `-100` [`materialize`] gives each
//! segment of a plan, counted without building any row. A sampler needs them to hand every
//! micro-batch the normaliser of its whole optimizer step (all ranks, all accumulation
//! micro-steps) before any batch exists.
//!
//! The data is read as materialize reads it: list [`Column`]s in place (every chunk,
//! through an indices mapping), so a memory-mapped dataset is never copied. What each
//! segment holds is [`PlanRef::segment_source`], the one definition gather and materialize
//! use too (with its truncation and policy checks). The rules are materialize's: a segment
//! writes `n` data tokens and then `seqlen - n` separators; a data token is a target when
//! its label (the token itself without labels) is not `-100` and its loss mask is not 0; a
//! separator is a target with `train_separators`; the first position of a segment never is.
//!
//! Token ids are vocabulary indices, never `-100`, so the token values themselves are not
//! read unless `ignore_tokens` names some: without labels and mask the counts follow from
//! the segments' lengths alone, and a mask alone is read without the tokens. A
//! vision-language batch sets the labels of its image and video placeholders to `-100`
//! after materializing; `ignore_tokens` (the placeholder ids) counts its targets as that
//! batch has them, reading the token values of those datasets only. A proptest below checks the counts against
//! materialize's own, pack by pack, over chunked columns read through a mapping.
//!
//! ```
//! use fastpack_core::column::{Column, Ints, ListChunk, Values};
//! use fastpack_core::materialize::{PlanRef, Sources};
//! use fastpack_core::targets::segment_targets;
//! use fastpack_core::{pack, PackOptions};
//! let plan = pack(&[3u32, 2], &PackOptions::new(8)).unwrap();
//! let chunk = ListChunk { offsets: Ints::I64(&[0, 3, 5]), values: Values::of(&[10i32, 11, 12, 20, 21]) };
//! let tokens = Column::new("input_ids", vec![chunk], None).unwrap();
//! let sources = Sources { tokens: &tokens, labels: None, loss_mask: None };
//! let counts = segment_targets(&PlanRef::from(&plan), &sources, None, false, &[]).unwrap();
//! assert_eq!(counts.iter().sum::<u32>(), 3); // labels [-100, 11, 12] and [-100, 21]
//! // Token 12 a placeholder (its label set to -100): one target fewer.
//! let counts = segment_targets(&PlanRef::from(&plan), &sources, None, false, &[12]).unwrap();
//! assert_eq!(counts.iter().sum::<u32>(), 2);
//! ```
//!
//! [`materialize`]: crate::materialize::materialize

use rayon::prelude::*;

use crate::column::{check_row_len, Column, Values};
use crate::error::{Error, Result};
use crate::materialize::{PlanRef, Sources, IGNORE_INDEX};

/// Segments per parallel task.
const TASK_SEGMENTS: usize = 1 << 12;
/// Values counted per block (a stack buffer of widened labels and mask flags).
const BLOCK: usize = 256;

/// Target tokens of every segment of `plan` (in segment order), as
/// [`materialize`](crate::materialize::materialize) would label them with these options,
/// a data token whose id is in `ignore_tokens` never a target (a placeholder whose label
/// the caller sets to `-100`). Every segment and its rows are checked as gather and
/// materialize check them. Run it inside [`crate::pool::install`] to choose the thread
/// count.
pub fn segment_targets(
    plan: &PlanRef<'_>,
    sources: &Sources<'_>,
    separator_id: Option<i64>,
    train_separators: bool,
    ignore_tokens: &[i64],
) -> Result<Vec<u32>> {
    if plan.parents.is_some() {
        return Err(Error::invalid(
            "plan",
            "is a plan of trees, whose targets belong to samples, not segments; count them with \
             tree::path_targets",
        ));
    }
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
    let tokens = sources.tokens;
    if let Some(labels) = sources.labels {
        labels.require_integers("labels")?;
    }
    for side in [sources.labels, sources.loss_mask].into_iter().flatten() {
        if side.rows() != tokens.rows() {
            return Err(Error::invalid(
                "columns",
                format!(
                    "column '{}' has {} rows, but the tokens '{}' have {}; every column needs \
                     one row per sequence",
                    side.name(),
                    side.rows(),
                    tokens.name(),
                    tokens.rows()
                ),
            ));
        }
    }
    let separator = u64::from(
        train_separators
            && separator_id.is_some_and(|s| s != IGNORE_INDEX && !ignore_tokens.contains(&s)),
    );
    let count = |s: usize| segment(plan, sources, separator, ignore_tokens, s);
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

/// The targets of segment `s`: its rows resolved and checked (offsets only), its piece
/// from [`PlanRef::segment_source`], then the labels and mask of that piece counted.
fn segment<'a>(
    plan: &PlanRef<'_>,
    sources: &Sources<'a>,
    separator: u64,
    ignore: &[i64],
    s: usize,
) -> Result<u32> {
    let tokens = sources.tokens;
    let i = plan.sample(s, tokens.rows())?;
    let row = tokens.row(i)?;
    let len = row.len();
    let ids = (!ignore.is_empty()).then(|| (*tokens.values(row), row.lo));
    let side = |column: Option<&Column<'a>>| -> Result<Option<(Values<'a>, usize)>> {
        column.map(|c| check_row_len(c, tokens, i, len).map(|r| (*c.values(r), r.lo))).transpose()
    };
    let labels = side(sources.labels)?;
    let mask = side(sources.loss_mask)?;
    let (from, n) = plan.segment_source(s, len as u64)?;
    let seqlen = plan.seqlens[s] as u64;
    let at = |side: Option<(Values<'a>, usize)>| side.map(|(v, lo)| (v, lo + from));
    let (data, first) = match at(ids) {
        None => count_data(at(labels), at(mask), n),
        Some(ids) => count_blocks(at(labels), at(mask), Some((ids.0, ids.1, ignore)), n),
    };
    // The first position is never a target: a data token, or a separator when n == 0.
    let first = if n > 0 { u64::from(first) } else { separator };
    Ok((data + (seqlen - n as u64) * separator - first) as u32)
}

/// Targets among `n` data tokens whose labels (default: the token ids, never -100) and
/// mask start at the given values, and whether the first of them is one.
fn count_data<'a>(
    labels: Option<(Values<'a>, usize)>,
    mask: Option<(Values<'a>, usize)>,
    n: usize,
) -> (u64, bool) {
    if n == 0 {
        return (0, false);
    }
    // The common types, read as typed slices in one pass; any other through blocks.
    let label = |v: &Values<'a>, lo: usize| -> Option<Labels<'a>> {
        v.slice::<i32>(lo, n).map(Labels::I32).or_else(|| v.slice::<i64>(lo, n).map(Labels::I64))
    };
    let flags = |v: &Values<'a>, lo: usize| -> Option<Mask<'a>> {
        v.slice::<u8>(lo, n)
            .map(Mask::U8)
            .or_else(|| v.slice::<i8>(lo, n).map(|m| Mask::U8(bytes(m))))
            .or_else(|| v.slice::<i64>(lo, n).map(Mask::I64))
            .or_else(|| v.slice::<i32>(lo, n).map(Mask::I32))
    };
    let fast = match (&labels, &mask) {
        (None, None) => Some((n as u64, true)),
        (Some((l, lo)), None) => label(l, *lo).map(|l| l.count(None)),
        (None, Some((m, lo))) => flags(m, *lo).map(|m| m.count()),
        (Some((l, llo)), Some((m, mlo))) => match (label(l, *llo), flags(m, *mlo)) {
            (Some(l), Some(m)) => Some(l.count(Some(m))),
            _ => None,
        },
    };
    fast.unwrap_or_else(|| count_blocks(labels, mask, None, n))
}

/// An int8 mask read as bytes (only compared with 0).
fn bytes(m: &[i8]) -> &[u8] {
    // SAFETY: i8 and u8 have the same size and alignment, and any bit pattern is valid.
    unsafe { std::slice::from_raw_parts(m.as_ptr() as *const u8, m.len()) }
}

enum Labels<'a> {
    I32(&'a [i32]),
    I64(&'a [i64]),
}

enum Mask<'a> {
    U8(&'a [u8]),
    I32(&'a [i32]),
    I64(&'a [i64]),
}

/// Branch-free sums of 0/1, so the loops vectorise.
fn kept<L: Copy + Into<i64>, M: Copy + Default + PartialEq>(l: &[L], m: &[M]) -> u64 {
    l.iter()
        .zip(m)
        .map(|(&x, &k)| u64::from((x.into() != IGNORE_INDEX) & (k != M::default())))
        .sum()
}

fn unmasked<L: Copy + Into<i64>>(l: &[L]) -> u64 {
    l.iter().map(|&x| u64::from(x.into() != IGNORE_INDEX)).sum()
}

fn ones<M: Copy + Default + PartialEq>(m: &[M]) -> u64 {
    m.iter().map(|&k| u64::from(k != M::default())).sum()
}

impl Mask<'_> {
    fn count(&self) -> (u64, bool) {
        match self {
            Mask::U8(m) => (ones(m), m[0] != 0),
            Mask::I32(m) => (ones(m), m[0] != 0),
            Mask::I64(m) => (ones(m), m[0] != 0),
        }
    }
}

impl Labels<'_> {
    fn count(&self, mask: Option<Mask<'_>>) -> (u64, bool) {
        macro_rules! with {
            ($l:expr) => {{
                let l = $l;
                let first = l[0] as i64 != IGNORE_INDEX;
                match mask {
                    None => (unmasked(l), first),
                    Some(Mask::U8(m)) => (kept(l, m), first && m[0] != 0),
                    Some(Mask::I32(m)) => (kept(l, m), first && m[0] != 0),
                    Some(Mask::I64(m)) => (kept(l, m), first && m[0] != 0),
                }
            }};
        }
        match self {
            Labels::I32(l) => with!(*l),
            Labels::I64(l) => with!(*l),
        }
    }
}

/// [`count_data`] for the other types, and with token ids to ignore (`ids`: the token
/// values, where the data starts, the ids that are never targets): blocks of labels
/// widened to i64 and mask flags.
fn count_blocks(
    labels: Option<(Values<'_>, usize)>,
    mask: Option<(Values<'_>, usize)>,
    ids: Option<(Values<'_>, usize, &[i64])>,
    n: usize,
) -> (u64, bool) {
    if n == 0 {
        return (0, false);
    }
    if labels.is_none() && mask.is_none() && ids.is_none() {
        return (n as u64, true);
    }
    let mut label = [0i64; BLOCK];
    let mut token = [0i64; BLOCK];
    let mut keep = [1u8; BLOCK];
    let (mut total, mut first) = (0u64, false);
    for at in (0..n).step_by(BLOCK) {
        let m = BLOCK.min(n - at);
        keep[..m].fill(1);
        if let Some((v, lo)) = &mask {
            v.for_each_zero(lo + at, m, |k| keep[k] = 0);
        }
        if let Some((v, lo, ignore)) = &ids {
            v.copy_i64(lo + at, &mut token[..m]);
            for (k, t) in keep[..m].iter_mut().zip(&token[..m]) {
                *k &= u8::from(!ignore.contains(t));
            }
        }
        // Branch-free sums of 0/1 so the loops vectorise.
        total += match &labels {
            Some((v, lo)) => {
                v.copy_i64(lo + at, &mut label[..m]);
                label[..m]
                    .iter()
                    .zip(&keep[..m])
                    .map(|(&x, &k)| u64::from((x != IGNORE_INDEX) & (k != 0)))
                    .sum::<u64>()
            }
            None => keep[..m].iter().map(|&k| u64::from(k)).sum::<u64>(),
        };
        if at == 0 {
            first = keep[0] != 0 && (labels.is_none() || label[0] != IGNORE_INDEX);
        }
    }
    (total, first)
}

#[cfg(test)]
mod tests {
    use super::segment_targets;
    use crate::column::{Column, Indices, Ints, ListChunk, Native, Values};
    use crate::materialize::{materialize, MaterializeOptions, PlanRef, Sources, IGNORE_INDEX};
    use crate::plan::{Overlong, Strategy as Planner};
    use crate::{pack, PackOptions};
    use proptest::prelude::*;

    /// Rows laid out as `datasets` keeps them after a shuffle: the physical rows in another
    /// order (row `r` is physical row `order[r]`), cut into `chunks` chunks, each with a
    /// leading value it does not use (sliced offsets), read through the mapping.
    struct Layout {
        order: Vec<usize>,
        /// Per chunk: its offsets (into its own value vector).
        offsets: Vec<Vec<i64>>,
        /// Per chunk: physical rows in it.
        bounds: Vec<(usize, usize)>,
        indices: Vec<i64>,
    }

    impl Layout {
        fn new(lengths: &[u32], chunks: usize, seed: u64) -> Self {
            let rows = lengths.len();
            let mut order: Vec<usize> = (0..rows).collect();
            let mut state = seed | 1;
            for k in (1..rows).rev() {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                order.swap(k, (state % (k as u64 + 1)) as usize);
            }
            // physical[p]: the user row stored at physical row p.
            let mut physical = vec![0usize; rows];
            for (r, &p) in order.iter().enumerate() {
                physical[p] = r;
            }
            let per = rows.div_ceil(chunks.max(1)).max(1);
            let mut offsets = Vec::new();
            let mut bounds = Vec::new();
            for lo in (0..rows).step_by(per) {
                let hi = (lo + per).min(rows);
                let mut o = vec![1i64];
                for &r in &physical[lo..hi] {
                    o.push(o.last().unwrap() + lengths[r] as i64);
                }
                offsets.push(o);
                bounds.push((lo, hi));
            }
            let indices = order.iter().map(|&p| p as i64).collect();
            Self { order, offsets, bounds, indices }
        }

        /// Each chunk's values for per-user-row data `flat` (rows end to end at `starts`).
        fn values<T: Native + Default>(&self, flat: &[T], starts: &[usize]) -> Vec<Vec<T>> {
            let mut physical = vec![0usize; self.order.len()];
            for (r, &p) in self.order.iter().enumerate() {
                physical[p] = r;
            }
            self.bounds
                .iter()
                .map(|&(lo, hi)| {
                    let mut v = vec![T::default()];
                    for &r in &physical[lo..hi] {
                        v.extend_from_slice(&flat[starts[r]..starts[r + 1]]);
                    }
                    v
                })
                .collect()
        }

        fn column<'a, T: Native>(&'a self, name: &str, values: &'a [Vec<T>]) -> Column<'a> {
            let chunks = self
                .offsets
                .iter()
                .zip(values)
                .map(|(o, v)| ListChunk { offsets: Ints::I64(o), values: Values::of(v) })
                .collect();
            Column::new(name, chunks, Some(Indices::new(vec![&self.indices]))).unwrap()
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        #[test]
        fn counts_equal_materialize_pack_by_pack(
            lengths in prop::collection::vec(0u32..40, 1..40),
            max_len in 4u64..32,
            policy in 0usize..4,
            separator in prop::option::of(-100i64..3),
            train_separators in any::<bool>(),
            chunks in 1usize..4,
            dtypes in 0usize..3,
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
            // Token ids in 0..5, labels -100 at every fifth, a mask that drops some.
            let mut state = seed | 1;
            let mut next = || { state ^= state << 13; state ^= state >> 7; state ^= state << 17; state };
            let total: usize = lengths.iter().map(|&n| n as usize).sum();
            let ids: Vec<i32> = (0..total).map(|_| (next() % 5) as i32).collect();
            let labels: Vec<i64> = ids.iter().map(|&x| if next() % 5 == 0 { IGNORE_INDEX } else { x as i64 }).collect();
            let mask: Vec<u8> = (0..total).map(|_| u8::from(next() % 3 != 0)).collect();
            let mut starts = vec![0usize];
            for &n in &lengths { starts.push(starts.last().unwrap() + n as usize); }
            let layout = Layout::new(&lengths, chunks, seed);
            let id_values = layout.values(&ids, &starts);
            let token_column = layout.column("input_ids", &id_values);
            // Label and mask types read as typed slices, and others read through blocks.
            let labels16: Vec<i16> = labels.iter().map(|&x| x as i16).collect();
            let labels32: Vec<i32> = labels.iter().map(|&x| x as i32).collect();
            let mask64: Vec<i64> = mask.iter().map(|&k| k as i64).collect();
            let mask_f32: Vec<f32> = mask.iter().map(|&k| if k == 0 { -0.0 } else { 0.5 }).collect();
            let (l64, l32, l16) = (layout.values(&labels, &starts), layout.values(&labels32, &starts), layout.values(&labels16, &starts));
            let (m8, m64, mf) = (layout.values(&mask, &starts), layout.values(&mask64, &starts), layout.values(&mask_f32, &starts));
            let (label_column, mask_column) = match dtypes {
                0 => (layout.column("labels", &l64), layout.column("loss_mask", &m8)),
                1 => (layout.column("labels", &l32), layout.column("loss_mask", &m64)),
                _ => (layout.column("labels", &l16), layout.column("loss_mask", &mf)),
            };
            let plan_ref = PlanRef::from(&plan);
            for (with_labels, with_mask) in [(false, false), (true, false), (false, true), (true, true)] {
                let sources = Sources {
                    tokens: &token_column,
                    labels: with_labels.then_some(&label_column),
                    loss_mask: with_mask.then_some(&mask_column),
                };
                let counts = segment_targets(&plan_ref, &sources, separator, train_separators, &[]).unwrap();
                // Token ids 1 and 3 as placeholders: their labels -100 once materialized.
                let ignored = segment_targets(&plan_ref, &sources, separator, train_separators, &[1, 3]).unwrap();
                let mopts = MaterializeOptions { separator_id: separator, train_separators, ..Default::default() };
                for p in 0..plan.num_packs() {
                    let rows = materialize(&plan_ref, &sources, &[p as i64], &mopts).unwrap();
                    let range = plan.pack_offsets[p] as usize..plan.pack_offsets[p + 1] as usize;
                    let ours: u64 = counts[range.clone()].iter().map(|&c| c as u64).sum();
                    prop_assert_eq!(ours, rows.num_targets);
                    let kept = rows.labels.iter().zip(&rows.input_ids)
                        .filter(|&(&l, &t)| l != IGNORE_INDEX && t != 1 && t != 3).count() as u64;
                    let ours: u64 = ignored[range].iter().map(|&c| c as u64).sum();
                    prop_assert_eq!(ours, kept);
                }
            }
        }
    }

    /// Rows longer than a block, in the types read through blocks (and the typed ones).
    #[test]
    fn long_rows_cross_blocks() {
        let lengths = [700u32, 300, 257];
        let plan = pack(&lengths, &PackOptions::new(1024)).unwrap();
        let offsets = [0i64, 700, 1000, 1257];
        let ids: Vec<i32> = (0..1257).map(|i| i % 7).collect();
        let labels: Vec<i16> = (0..1257).map(|i| if i % 5 == 0 { -100 } else { 1 }).collect();
        let mask: Vec<f32> = (0..1257).map(|i| if i % 3 == 0 { 0.0 } else { 1.0 }).collect();
        let wide: Vec<i64> = labels.iter().map(|&x| x as i64).collect();
        let bytes: Vec<u8> = mask.iter().map(|&k| k as u8).collect();
        let tokens = column("input_ids", &offsets, Values::of(&ids));
        let plan_ref = PlanRef::from(&plan);
        let all: Vec<i64> = (0..plan.num_packs() as i64).collect();
        for (l, m) in [
            (
                column("labels", &offsets, Values::of(&labels)),
                column("m", &offsets, Values::of(&mask)),
            ),
            (
                column("labels", &offsets, Values::of(&wide)),
                column("m", &offsets, Values::of(&bytes)),
            ),
        ] {
            let sources = Sources { tokens: &tokens, labels: Some(&l), loss_mask: Some(&m) };
            let counts = segment_targets(&plan_ref, &sources, None, false, &[]).unwrap();
            let rows =
                materialize(&plan_ref, &sources, &all, &MaterializeOptions::default()).unwrap();
            assert_eq!(counts.iter().map(|&c| c as u64).sum::<u64>(), rows.num_targets);
        }
    }

    fn column<'a>(name: &str, offsets: &'a [i64], values: Values<'a>) -> Column<'a> {
        Column::new(name, vec![ListChunk { offsets: Ints::I64(offsets), values }], None).unwrap()
    }

    #[test]
    fn errors_are_clear() {
        let plan = pack(&[3u32, 2], &PackOptions::new(8)).unwrap();
        let short = column("input_ids", &[0, 3], Values::of(&[1i32, 2, 3]));
        let sources = Sources { tokens: &short, labels: None, loss_mask: None };
        let err = segment_targets(&PlanRef::from(&plan), &sources, None, false, &[]).unwrap_err();
        assert!(err.to_string().contains("refers to sequence 1"), "{err}");
        let mut opts = PackOptions::new(8);
        opts.reserve = 1;
        let plan = pack(&[3u32], &opts).unwrap();
        let sources = Sources { tokens: &short, labels: None, loss_mask: None };
        let err = segment_targets(&PlanRef::from(&plan), &sources, None, false, &[]).unwrap_err();
        assert!(err.to_string().starts_with("separator_id:"), "{err}");
        // A labels column with more rows than the tokens is refused, as gather refuses it.
        let labels = column("labels", &[0, 3, 4], Values::of(&[1i64, 2, 3, 4]));
        let sources = Sources { tokens: &short, labels: Some(&labels), loss_mask: None };
        let err =
            segment_targets(&PlanRef::from(&plan), &sources, Some(0), false, &[]).unwrap_err();
        assert!(err.to_string().contains("column 'labels' has 2 rows"), "{err}");
    }

    /// Segments that gather refuses (a truncated piece not at the start, a partial segment
    /// under the error policy) used to be counted by the target count's own copy of the
    /// rule; now all three read `PlanRef::segment_source`.
    #[test]
    fn segments_that_gather_refuses_are_refused() {
        let offsets = [0i64, 10];
        let values: Vec<i32> = (0..10).collect();
        let tokens = column("input_ids", &offsets, Values::of(&values));
        let sources = Sources { tokens: &tokens, labels: None, loss_mask: None };
        let columns = [tokens.clone()];
        for (overlong, start, seqlen) in
            [(Overlong::Truncate, 3i64, 4i32), (Overlong::Error, 0, 4), (Overlong::Drop, 2, 4)]
        {
            let plan = PlanRef {
                sample_ids: &[0],
                starts: &[start],
                seqlens: &[seqlen],
                pack_offsets: &[0, 1],
                reserve: 0,
                strategy: Planner::BestFitDecreasing,
                overlong,
                parents: None,
            };
            let gathered =
                crate::gather::gather(&plan, &[0], &columns, &crate::gather::GatherOptions::new(1))
                    .unwrap_err()
                    .to_string();
            let counted =
                segment_targets(&plan, &sources, None, false, &[]).unwrap_err().to_string();
            assert_eq!(counted, gathered);
            let made = materialize(&plan, &sources, &[0], &MaterializeOptions::default())
                .unwrap_err()
                .to_string();
            assert_eq!(made, gathered);
        }
    }
}
