//! Phase 2 — counting sort: the input's second and last pass.

use std::sync::atomic::{AtomicU64, Ordering};

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::length::Length;
use crate::memory::{self, Cursors, Slots, Tiles, Tiling};

use super::classify::{Class, Rules};
use super::histogram::Histogram;
use super::limits::Needs;
use super::Input;

/// What the sort hands to the replay besides the order itself.
pub(crate) struct Sorted {
    /// `full << 32 | id` of each split sequence, in input order: its full pieces and its
    /// input index (both below 2^32: a plan holds at most MAX_ITEMS segments).
    pub split_of: Vec<u64>,
    /// Bit `pos` is set when sorted position `pos` holds a split remainder, whose entry in
    /// the order is then its index into `split_of` (it needs its start, which only
    /// `split_of` knows: nothing reads the input at random).
    pub is_remainder: Vec<AtomicU64>,
}

impl Sorted {
    pub(crate) fn remainder_at(&self, pos: usize) -> bool {
        !self.is_remainder.is_empty()
            && self.is_remainder[pos >> 6].load(Ordering::Relaxed) >> (pos & 63) & 1 != 0
    }
}

/// The sorted order's ranges: one per chunk and length (`c * (max_len + 1) + l`, so a
/// chunk's ranges are contiguous), laid out longest length first and, within a length, in
/// chunk order — a stable counting sort.
pub(crate) fn tiling(hist: &Histogram, max_len: usize) -> Result<Tiling> {
    let width = max_len + 1;
    let chunks = hist.chunks.count;
    let mut order = memory::try_with_capacity::<u32>(chunks * width, "the sorted order")?;
    for len in (0..width).rev() {
        order.extend((0..chunks).map(|c| (c * width + len) as u32));
    }
    let mut sizes = memory::try_with_capacity::<u32>(chunks * width, "the sorted order")?;
    sizes.extend_from_slice(&hist.chunk_counts);
    Tiling::new(sizes, Some(order), "the sorted order")
}

/// Writes the sorted order into `order` (`order[pos]` = the input index of the item at
/// sorted position `pos`, as `u32` bits): longest first, each length in input order; with
/// budgets besides tokens, each item's needs at its sorted position too (`needs`), so the
/// placement reads them in order instead of at random.
///
/// Each chunk writes its own ranges through their cursors. A chunk that finds other counts
/// than the histogram did (the caller changed the array between the two passes) finds a
/// range full, or leaves one short: either way the order is never read, and the input's
/// change is an error.
pub(crate) fn sort<L: Length>(
    input: Input<'_, L>,
    rules: &Rules,
    hist: &Histogram,
    mut order: Tiles<'_, i32>,
    needs: Option<&Needs<'_>>,
) -> Result<Sorted> {
    let items = hist.items();
    let splits = hist.tally.split_sequences as usize;
    let mut split_of = memory::try_zeroed::<u64>(splits, "the split sequences")?;
    let is_remainder = if splits > 0 {
        let mut bits = memory::try_with_capacity(items.div_ceil(64), "the split remainders")?;
        bits.extend((0..items.div_ceil(64)).map(|_| AtomicU64::new(0)));
        bits
    } else {
        Vec::new()
    };
    let width = rules.max_len as usize + 1;
    let chunks = hist.chunks;
    let mut per_chunk = Vec::with_capacity(chunks.count);
    let mut rest = order.cursors();
    for _ in 0..chunks.count {
        let (mine, tail) = rest.split_at(width);
        per_chunk.push(mine);
        rest = tail;
    }
    {
        let split_out = Slots::new(&mut split_of);
        let sort = Chunk { rules, hist, split_out: &split_out, is_remainder: &is_remainder };
        let checks: Vec<bool> = input
            .lengths
            .par_chunks(chunks.len)
            .zip(per_chunk)
            .enumerate()
            .map(|(c, (lengths, cursors))| {
                let base = c * chunks.len;
                // One loop per kind of id, so the common one (the input itself) is a count;
                // the needs are written by their own loops (none: nothing more to do).
                let none = |_: usize, _: u32| true;
                let pass = |_: u32| {};
                match (input.ids, needs) {
                    (None, None) => {
                        sort.run(c, lengths, cursors, |j| (base + j) as u32, none, pass)
                    }
                    (Some(ids), None) => {
                        sort.run(c, lengths, cursors, |j| ids[base + j], none, pass)
                    }
                    (None, Some(n)) => {
                        let (write, skip) = (|pos, id| n.write(pos, id), |id| n.skipped(id));
                        sort.run(c, lengths, cursors, |j| (base + j) as u32, write, skip)
                    }
                    (Some(ids), Some(n)) => {
                        let (write, skip) = (|pos, id| n.write(pos, id), |id| n.skipped(id));
                        sort.run(c, lengths, cursors, |j| ids[base + j], write, skip)
                    }
                }
            })
            .collect();
        if !checks.into_iter().all(|ok| ok) {
            return Err(Error::input_changed("lengths"));
        }
    }
    // Every chunk's every range full: exactly the histogram's counts were written.
    if order.finish().is_none() {
        return Err(Error::input_changed("lengths"));
    }
    Ok(Sorted { split_of, is_remainder })
}

/// One chunk's share of the sort.
struct Chunk<'a> {
    rules: &'a Rules,
    hist: &'a Histogram,
    split_out: &'a Slots<'a, u64>,
    is_remainder: &'a [AtomicU64],
}

impl Chunk<'_> {
    /// Sorts chunk `c` (its lengths, the cursors of its ranges, the id of its `j`-th
    /// length), calling `also(pos, id)` for every whole item placed (`false`: a slot out
    /// of bounds) and `skipped(id)` for every item it does not sort; `false` if it finds
    /// other counts than the histogram did.
    #[inline(always)]
    fn run<L: Length>(
        &self,
        c: usize,
        lengths: &[L],
        mut cursors: Cursors<'_, i32>,
        id: impl Fn(usize) -> u32,
        also: impl Fn(usize, u32) -> bool,
        skipped: impl Fn(u32),
    ) -> bool {
        let (rules, hist) = (self.rules, self.hist);
        let mut r = hist.split_before[c] as usize;
        let mut full = 0u64;
        for (j, &raw) in lengths.iter().enumerate() {
            let value = raw.to_u64();
            let (len, entry, remainder) = match rules.fits(value) {
                Some(len) => (len, id(j), false),
                None => match rules.classify(value) {
                    Class::Whole { len, .. } => (len, id(j), false),
                    Class::Split { full: f, rest, .. } => {
                        if !self.split_out.try_set(r, f << 32 | id(j) as u64) {
                            return false;
                        }
                        full += f;
                        r += 1;
                        if rest == 0 {
                            continue;
                        }
                        (rest, r as u32 - 1, true)
                    }
                    _ => {
                        skipped(id(j));
                        continue;
                    }
                },
            };
            let Some(pos) = cursors.push(len as usize, entry as i32) else {
                return false;
            };
            if remainder {
                match self.is_remainder.get(pos >> 6) {
                    Some(bits) => _ = bits.fetch_or(1 << (pos & 63), Ordering::Relaxed),
                    None => return false,
                }
            } else if !also(pos, entry) {
                return false;
            }
        }
        let split_end = hist.split_before[c + 1] as usize;
        let full_count = hist.full_before[c + 1] - hist.full_before[c];
        r == split_end && full == full_count
    }
}
