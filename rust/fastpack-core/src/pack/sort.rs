//! Phase 2 — counting sort: the input's second and last pass.

use std::sync::atomic::{AtomicU64, Ordering};

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::length::Length;
use crate::memory::{self, Slots};

use super::classify::{Class, Rules};
use super::histogram::Histogram;
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

/// Writes the sorted order into `order` (`order[pos]` = the input index of the item at
/// sorted position `pos`, as `u32` bits): longest first, each length in input order.
///
/// Each chunk writes from its own cursors, which cover disjoint position ranges. A chunk
/// that finds other counts than the histogram did (the caller changed the array between
/// the two passes) ends its ranges elsewhere: that is checked for every chunk and length,
/// and is an error; its stray writes stay inside `order` (bounds-checked).
pub(crate) fn sort<L: Length>(
    input: Input<'_, L>,
    rules: &Rules,
    hist: &Histogram,
    order: &mut [i32],
) -> Result<Sorted> {
    let items = hist.items();
    assert_eq!(order.len(), items, "the order holds every sortable item");
    let splits = hist.tally.split_sequences as usize;
    let mut split_of = memory::try_zeroed::<u64>(splits, "the split sequences")?;
    let is_remainder = if splits > 0 {
        let mut bits = memory::try_with_capacity(items.div_ceil(64), "the split remainders")?;
        bits.extend((0..items.div_ceil(64)).map(|_| AtomicU64::new(0)));
        bits
    } else {
        Vec::new()
    };
    let max_len = rules.max_len as usize;
    let chunks = hist.chunks;
    {
        let order = Slots::new(order);
        let split_out = Slots::new(&mut split_of);
        let is_remainder = &is_remainder;
        let checks: Vec<Result<()>> = input
            .lengths
            .par_chunks(chunks.len)
            .enumerate()
            .map(|(c, chunk)| {
                let mut cursor = memory::try_with_capacity::<u32>(max_len + 1, "sort cursors")?;
                cursor.extend_from_slice(&hist.cursors[c]);
                let base = c * chunks.len;
                let mut r = hist.split_before[c] as usize;
                let mut full = 0u64;
                let mut stray = false;
                for (j, &raw) in chunk.iter().enumerate() {
                    let value = raw.to_u64();
                    let id = input.id(base + j);
                    let (len, entry, remainder) = match rules.fits(value) {
                        Some(len) => (len, id, false),
                        None => match rules.classify(value) {
                            Class::Whole { len, .. } => (len, id, false),
                            Class::Split { full: f, rest, .. } => {
                                stray |= !split_out.try_set(r, f << 32 | id as u64);
                                full += f;
                                r += 1;
                                if rest == 0 {
                                    continue;
                                }
                                (rest, r as u32 - 1, true)
                            }
                            _ => continue,
                        },
                    };
                    let pos = cursor[len as usize] as usize;
                    cursor[len as usize] = cursor[len as usize].saturating_add(1);
                    if !order.try_set(pos, entry as i32) {
                        stray = true;
                    } else if remainder {
                        match is_remainder.get(pos >> 6) {
                            Some(bits) => _ = bits.fetch_or(1 << (pos & 63), Ordering::Relaxed),
                            None => stray = true,
                        }
                    }
                }
                let ends = (1..=max_len).all(|len| {
                    let end = match hist.cursors.get(c + 1) {
                        Some(next) => next[len] as usize,
                        None => hist.bucket_start[len] + hist.counts[len],
                    };
                    cursor[len] as usize == end
                });
                let split_end = hist.split_before[c + 1] as usize;
                let full_count = hist.full_before[c + 1] - hist.full_before[c];
                if stray || !ends || r != split_end || full != full_count {
                    return Err(Error::input_changed("lengths"));
                }
                Ok(())
            })
            .collect();
        checks.into_iter().collect::<Result<()>>()?;
    }
    Ok(Sorted { split_of, is_remainder })
}
