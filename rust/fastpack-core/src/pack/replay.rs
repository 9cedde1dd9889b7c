//! Phase 5 — replay: the placement runs again and its runs are written to their slots.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::memory::Slots;

use super::histogram::Histogram;
use super::placement::Placement;
use super::slot_word;
use super::sort::Sorted;

/// A run of the replay: `k` items of length `len` at sorted positions `pos..` go to
/// slots `slot..` (both below MAX_ITEMS, so u32).
struct Run {
    slot: u32,
    pos: u32,
    k: u32,
    len: u32,
}

/// Runs go from the placement to the writers in batches of this many (128 KiB; under Miri
/// a few, so its small inputs are handed off too)...
const RUN_BATCH: usize = if cfg!(miri) { 4 } else { 1 << 13 };
/// ...with at most this many batches waiting, so memory stays bounded when the writers
/// fall behind (the placement then writes its batches itself).
const RUNS_IN_FLIGHT: usize = 4;

/// Copies runs out of the sorted order into their slots.
struct RunWriter<'a> {
    order: &'a [i32],
    sorted: &'a Sorted,
    words: &'a Slots<'a, i64>,
}

impl RunWriter<'_> {
    /// Writes the runs' slot words; adds the slots of split remainders among them to
    /// `remainder_slots` (their word holds an index into `split_of` until resolved).
    /// Returns the number of slots written.
    fn write(&self, runs: &[Run], remainder_slots: &mut Vec<u32>) -> usize {
        let mut written = 0;
        for run in runs {
            let (slot, pos, k) = (run.slot as usize, run.pos as usize, run.k as usize);
            let ids = &self.order[pos..pos + k];
            self.words.set_run(slot, ids.iter().map(|&id| slot_word(run.len as u64, id as u32)));
            written += k;
            if self.sorted.is_remainder.is_empty() {
                continue;
            }
            for j in 0..k {
                if self.sorted.remainder_at(pos + j) {
                    remainder_slots.push((slot + j) as u32);
                }
            }
        }
        written
    }
}

/// What the replay of a best/first-fit bucket reads: its histogram and placement, and the
/// sorted order with what the sort handed on.
#[derive(Clone, Copy)]
pub(crate) struct FitBucket<'a> {
    pub hist: &'a Histogram,
    pub placement: &'a Placement<'a>,
    pub order: &'a [i32],
    pub sorted: &'a Sorted,
}

/// Writes a best/first-fit bucket: the full-piece packs (one segment each, in input
/// order) alongside the replay of the other packs, shard by shard. `first` holds each
/// pack's first slot in placement order (full-piece packs, then each shard's packs) and
/// is advanced as the slots fill. Returns the slots of split remainders.
///
/// Each run's slots are contiguous and so are its sorted positions: a run is one
/// sequential copy out of `order`. The placement itself is sequential; its runs go in
/// batches to idle threads, which do the (random-access) writing.
pub(crate) fn write_fit(
    bucket: &FitBucket<'_>,
    first: &mut [u32],
    shard_packs: &[usize],
    words: &Slots<'_, i64>,
    starts: &Slots<'_, i64>,
) -> Result<Vec<u32>> {
    let FitBucket { hist, placement, order, sorted } = *bucket;
    let max_len = placement.max_len();
    let full = hist.full_pieces();
    let (full_slots, mut fit_cursor) = first.split_at_mut(full);
    let mut shard_cursors = Vec::with_capacity(shard_packs.len());
    for &size in shard_packs {
        let (part, rest) = std::mem::take(&mut fit_cursor).split_at_mut(size);
        shard_cursors.push(part);
        fit_cursor = rest;
    }
    let full_slots = &*full_slots;
    let (written_full, replayed) = rayon::join(
        || write_full_pieces(hist, &sorted.split_of, full_slots, words, starts, max_len),
        || {
            let writer = RunWriter { order, sorted, words };
            replay(placement, shard_cursors, &writer)
        },
    );
    let (written, remainder_slots) = replayed?;
    if written_full + written != full + hist.items() {
        return Err(Error::invalid("fastpack", "internal error: the replay missed slots"));
    }
    Ok(remainder_slots)
}

/// Pieces of exactly `max_len` of split sequences, one pack each, in input order: chunk
/// `c`'s pieces are full-piece packs `full_before[c]..`.
fn write_full_pieces(
    hist: &Histogram,
    split_of: &[u64],
    full_slots: &[u32],
    words: &Slots<'_, i64>,
    starts: &Slots<'_, i64>,
    max_len: u64,
) -> usize {
    if full_slots.is_empty() {
        return 0;
    }
    (0..hist.chunks.count)
        .into_par_iter()
        .map(|c| {
            let mut pack = hist.full_before[c] as usize;
            let range = hist.split_before[c] as usize..hist.split_before[c + 1] as usize;
            for &entry in &split_of[range] {
                let id = (entry & u32::MAX as u64) as u32;
                for piece in 0..entry >> 32 {
                    let slot = full_slots[pack] as usize;
                    words.set(slot, slot_word(max_len, id));
                    starts.set(slot, (piece * max_len) as i64);
                    pack += 1;
                }
            }
            pack - hist.full_before[c] as usize
        })
        .sum()
}

/// Replays every shard, handing its runs to `writer`. Returns the slots written and the
/// slots of split remainders.
fn replay(
    placement: &Placement<'_>,
    shard_cursors: Vec<&mut [u32]>,
    writer: &RunWriter<'_>,
) -> Result<(usize, Vec<u32>)> {
    let remainder_slots = Mutex::new(Vec::new());
    let written = AtomicUsize::new(0);
    let in_flight = AtomicUsize::new(0);
    let pipelined = rayon::current_num_threads() > 1;
    let placed: Vec<Result<u32>> = rayon::scope(|scope| {
        let (remainder_slots, written, in_flight) = (&remainder_slots, &written, &in_flight);
        shard_cursors
            .into_par_iter()
            .enumerate()
            .map(|(shard, cursor)| {
                let mut mine = Vec::new();
                let mut mine_written = 0;
                let mut batch = Vec::with_capacity(RUN_BATCH);
                let mut hand_off = |batch: Vec<Run>, mine: &mut Vec<u32>| {
                    if pipelined && in_flight.load(Ordering::Relaxed) < RUNS_IN_FLIGHT {
                        in_flight.fetch_add(1, Ordering::Relaxed);
                        scope.spawn(move |_| {
                            let mut theirs = Vec::new();
                            let n = writer.write(&batch, &mut theirs);
                            written.fetch_add(n, Ordering::Relaxed);
                            if !theirs.is_empty() {
                                lock(remainder_slots).extend(theirs);
                            }
                            in_flight.fetch_sub(1, Ordering::Relaxed);
                        });
                    } else {
                        mine_written += writer.write(&batch, mine);
                    }
                };
                let packs = placement.run(shard, &mut |pack, pos, k, len| {
                    let slot = cursor[pack as usize];
                    cursor[pack as usize] += k as u32;
                    batch.push(Run { slot, pos: pos as u32, k: k as u32, len });
                    if batch.len() == RUN_BATCH {
                        let full = std::mem::replace(&mut batch, Vec::with_capacity(RUN_BATCH));
                        hand_off(full, &mut mine);
                    }
                })?;
                mine_written += writer.write(&batch, &mut mine);
                written.fetch_add(mine_written, Ordering::Relaxed);
                lock(remainder_slots).extend(mine);
                Ok(packs)
            })
            .collect()
    });
    placed.into_iter().collect::<Result<Vec<u32>>>()?;
    let remainder_slots = remainder_slots.into_inner().unwrap_or_else(|e| e.into_inner());
    Ok((written.into_inner(), remainder_slots))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
