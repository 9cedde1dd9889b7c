//! Phase 1 — histogram: one parallel pass over a bucket's input.

use rayon::prelude::*;

use crate::error::Result;
use crate::length::Length;
use crate::memory;
use crate::plan::Stats;

use super::classify::{tally_chunk, Rules, Tally};
use super::Input;

/// A chunk holds at least 2^CHUNK_SHIFT lengths. Under Miri, a few dozen: its small
/// inputs then cross chunk boundaries as real ones do.
const CHUNK_SHIFT: u32 = if cfg!(miri) { 5 } else { 16 };

/// The input's fixed chunks: every pass over the input uses the same ones, so a chunk's
/// counts from one pass are its cursors in the next.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Chunks {
    pub len: usize,
    pub count: usize,
}

impl Chunks {
    /// Per-chunk histograms cost `(max_len + 1) * 4` bytes each: at most 32 MiB in all.
    /// The plan does not depend on the chunking (each length's sorted range keeps input
    /// order whatever the chunks).
    pub(crate) fn new(n: usize, max_len: u64) -> Self {
        let threads = rayon::current_num_threads();
        let by_memory = ((1usize << 23) / (max_len as usize + 1)).max(1);
        let count = (n >> CHUNK_SHIFT).clamp(1, 4 * threads).min(by_memory);
        let len = n.div_ceil(count).max(1);
        // No chunk at all for no input: every pass over the chunks is then empty.
        Self { len, count: n.div_ceil(len) }
    }
}

/// Tallies a bucket's input without a histogram (the order-preserving strategies), and
/// lists the positions routed to the long bucket, in input order.
pub(crate) fn tally<L: Length>(input: Input<'_, L>, rules: &Rules) -> Result<(Tally, Vec<u32>)> {
    let chunks = Chunks::new(input.lengths.len(), 1);
    let per_chunk: Vec<Result<(Tally, Vec<u32>, ())>> = input
        .lengths
        .par_chunks(chunks.len)
        .enumerate()
        .map(|(c, chunk)| {
            let mut routed = Vec::new();
            let tally = tally_chunk(chunk, c * chunks.len, rules, None, &mut routed)?;
            Ok((tally, routed, ()))
        })
        .collect();
    let (tallies, routed, _) = merge(per_chunk)?;
    Ok((total(&tallies), routed))
}

fn total(tallies: &[Tally]) -> Tally {
    tallies.iter().fold(Tally::default(), |acc, t| acc.merge(t))
}

/// Each chunk's tally, the routed positions of all chunks in order, and each chunk's `T`.
type Merged<T> = (Vec<Tally>, Vec<u32>, Vec<T>);

fn merge<T>(parts: Vec<Result<(Tally, Vec<u32>, T)>>) -> Result<Merged<T>> {
    let parts: Vec<(Tally, Vec<u32>, T)> = parts.into_iter().collect::<Result<_>>()?;
    let routed_total = parts.iter().map(|(_, r, _)| r.len()).sum();
    let mut routed = memory::try_with_capacity(routed_total, "the long bucket")?;
    let mut tallies = Vec::with_capacity(parts.len());
    let mut rest = Vec::with_capacity(parts.len());
    for (t, r, x) in parts {
        routed.extend_from_slice(&r);
        tallies.push(t);
        rest.push(x);
    }
    Ok((tallies, routed, rest))
}

/// The histogram of a best/first-fit bucket: every length classified once, the bucket
/// tallied, and its sortable items (whole sequences and split remainders) counted by
/// length, per chunk.
///
/// Invariant handed on: the sorted order puts length `l`'s items at
/// `bucket_start[l] .. bucket_start[l] + counts[l]`, longest first, and inside that range
/// chunk `c`'s `chunk_counts[c * (max_len + 1) + l]` items after those of the chunks
/// before it, in input order; `split_before[c]` and `full_before[c]` count the split
/// sequences and full pieces of the chunks before `c`.
pub(crate) struct Histogram {
    pub tally: Tally,
    pub stats: Stats,
    pub chunks: Chunks,
    /// Sortable items of each length `0..=max_len`.
    pub counts: Vec<usize>,
    /// First sorted position of each length.
    pub bucket_start: Vec<usize>,
    /// The lengths present, longest first: the placement visits only these.
    pub present: Vec<u32>,
    /// Per chunk, its items of each length `0..=max_len`, chunk after chunk (u32: a plan
    /// holds at most MAX_ITEMS segments).
    pub chunk_counts: Vec<u32>,
    /// Per chunk (and one past the last), split sequences and full pieces before it.
    pub split_before: Vec<u64>,
    pub full_before: Vec<u64>,
    /// Positions routed to the long bucket, in input order.
    pub routed: Vec<u32>,
}

impl Histogram {
    pub(crate) fn build<L: Length>(input: Input<'_, L>, rules: &Rules) -> Result<Self> {
        let max_len = rules.max_len as usize;
        let chunks = Chunks::new(input.lengths.len(), rules.max_len);
        let per_chunk = input.lengths.par_chunks(chunks.len).enumerate().map(|(c, chunk)| {
            let mut hist = memory::try_zeroed::<u32>(max_len + 1, "a length histogram")?;
            let mut routed = Vec::new();
            let tally = tally_chunk(chunk, c * chunks.len, rules, Some(&mut hist), &mut routed)?;
            Ok((tally, routed, hist))
        });
        let (tallies, routed, hists) = merge(per_chunk.collect())?;
        let tally = total(&tallies);
        let stats = tally.check(input, rules)?;

        // Stable counting sort, longest first: length `l` starts after all longer ones.
        let mut counts = memory::try_zeroed::<usize>(max_len + 1, "a length histogram")?;
        for h in &hists {
            for (total, &c) in counts.iter_mut().zip(h) {
                *total += c as usize;
            }
        }
        let mut bucket_start = memory::try_zeroed::<usize>(max_len + 2, "a length histogram")?;
        for len in (1..=max_len).rev() {
            bucket_start[len] = bucket_start[len + 1] + counts[len];
        }
        for len in 1..=max_len {
            bucket_start[len] -= counts[len];
        }
        let lengths_present = (1..=max_len).filter(|&l| counts[l] > 0).count();
        let mut present = memory::try_with_capacity(lengths_present, "the lengths present")?;
        present.extend((1..=max_len).rev().filter(|&l| counts[l] > 0).map(|l| l as u32));
        let mut chunk_counts = memory::try_with_capacity(hists.len() * (max_len + 1), "counts")?;
        for h in &hists {
            chunk_counts.extend_from_slice(h);
        }
        drop(hists);
        let (mut split_before, mut full_before) = (vec![0u64], vec![0u64]);
        for t in &tallies {
            split_before.push(split_before[split_before.len() - 1] + t.split_sequences);
            full_before.push(full_before[full_before.len() - 1] + t.full_pieces);
        }
        Ok(Self {
            tally,
            stats,
            chunks,
            counts,
            bucket_start,
            present,
            chunk_counts,
            split_before,
            full_before,
            routed,
        })
    }

    /// Sortable items: whole sequences and split remainders.
    pub(crate) fn items(&self) -> usize {
        self.tally.items as usize
    }

    /// Segments of exactly `max_len` cut from split sequences.
    pub(crate) fn full_pieces(&self) -> usize {
        self.tally.full_pieces as usize
    }
}
