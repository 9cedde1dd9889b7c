//! Phase 5 — replay: the placement runs again and its runs are written to their slots.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::memory::{Claims, Cursors, Slots};

use super::histogram::Histogram;
use super::placement::Placement;
use super::slot_word;
use super::sort::Sorted;

/// A batch of the replay's runs: each run's slots, claimed, with the first sorted position
/// and the length of its items (positions below MAX_ITEMS, so u32).
type Batch<'t> = Claims<'t, i64, (u32, u32)>;

/// Runs go from the placement to the writers in batches of this many (under Miri a few,
/// so its small inputs are handed off too)...
const RUN_BATCH: usize = if cfg!(miri) { 4 } else { 1 << 13 };
/// ...with at most this many batches waiting, so memory stays bounded when the writers
/// fall behind (the placement then writes its batches itself).
const RUNS_IN_FLIGHT: usize = 4;

/// What the replay of a best/first-fit bucket reads: its histogram and placement, and the
/// sorted order with what the sort handed on.
#[derive(Clone, Copy)]
pub(crate) struct FitBucket<'a> {
    pub hist: &'a Histogram,
    pub placement: &'a Placement<'a>,
    pub order: &'a [i32],
    pub sorted: &'a Sorted,
}

/// Copies runs out of the sorted order into their claimed slots.
struct RunWriter<'a> {
    order: &'a [i32],
    sorted: &'a Sorted,
}

impl RunWriter<'_> {
    /// Fills the runs' slots with their slot words; adds the slots of split remainders
    /// among them to `remainder_slots` (their word holds an index into `split_of` until
    /// resolved).
    fn write(&self, batch: Batch<'_>, remainder_slots: &mut Vec<u32>) {
        let any_remainder = !self.sorted.is_remainder.is_empty();
        batch.fill(|&(pos, len), first, k| {
            let pos = pos as usize;
            if any_remainder {
                for j in 0..k {
                    if self.sorted.remainder_at(pos + j) {
                        remainder_slots.push((first + j) as u32);
                    }
                }
            }
            self.order[pos..pos + k].iter().map(move |&id| slot_word(len as u64, id as u32))
        });
    }
}

/// Writes a best/first-fit bucket through the cursors of its packs (full-piece packs
/// first, then each shard's packs, as placed): the full-piece packs (one segment each, in
/// input order) alongside the replay of the other packs, shard by shard. Returns the slots
/// of split remainders.
///
/// Each run's slots are contiguous and so are its sorted positions: a run is one
/// sequential copy out of `order`. The placement itself is sequential; it claims each
/// run's slots and hands the runs in batches to idle threads, which do the (random-access)
/// writing.
pub(crate) fn write_fit(
    bucket: &FitBucket<'_>,
    cursors: Cursors<'_, i64>,
    shard_packs: &[usize],
    starts: &Slots<'_, i64>,
) -> Result<Vec<u32>> {
    let FitBucket { hist, placement, order, sorted } = *bucket;
    let (full_cursors, mut rest) = cursors.split_at(hist.full_pieces());
    let mut shard_cursors = Vec::with_capacity(shard_packs.len());
    for &size in shard_packs {
        let (part, tail) = rest.split_at(size);
        shard_cursors.push(part);
        rest = tail;
    }
    let (full_written, replayed) = rayon::join(
        || write_full_pieces(hist, &sorted.split_of, full_cursors, starts, placement.max_len()),
        || replay(placement, shard_cursors, &RunWriter { order, sorted }),
    );
    if !full_written {
        return Err(Error::invalid("fastpack", "internal error: a full piece found no slot"));
    }
    replayed
}

/// Pieces of exactly `max_len` of split sequences, one pack each, in input order: chunk
/// `c`'s pieces are full-piece packs `full_before[c]..`. `false` if a pack found no slot.
fn write_full_pieces(
    hist: &Histogram,
    split_of: &[u64],
    cursors: Cursors<'_, i64>,
    starts: &Slots<'_, i64>,
    max_len: u64,
) -> bool {
    let mut per_chunk = Vec::with_capacity(hist.chunks.count);
    let mut rest = cursors;
    for c in 0..hist.chunks.count {
        let (mine, tail) = rest.split_at((hist.full_before[c + 1] - hist.full_before[c]) as usize);
        per_chunk.push(mine);
        rest = tail;
    }
    per_chunk.into_par_iter().enumerate().all(|(c, mut cursors)| {
        let mut pack = 0;
        let range = hist.split_before[c] as usize..hist.split_before[c + 1] as usize;
        for &entry in &split_of[range] {
            let id = (entry & u32::MAX as u64) as u32;
            for piece in 0..entry >> 32 {
                let Some(slot) = cursors.push(pack, slot_word(max_len, id)) else {
                    return false;
                };
                starts.set(slot, (piece * max_len) as i64);
                pack += 1;
            }
        }
        true
    })
}

/// Replays every shard, handing its runs to `writer`. Returns the slots of split
/// remainders.
fn replay<'t>(
    placement: &Placement<'_>,
    shard_cursors: Vec<Cursors<'t, i64>>,
    writer: &RunWriter<'_>,
) -> Result<Vec<u32>> {
    let remainder_slots = Mutex::new(Vec::new());
    let in_flight = AtomicUsize::new(0);
    let pipelined = rayon::current_num_threads() > 1;
    let placed: Vec<Result<()>> = rayon::scope(|scope| {
        let (remainder_slots, in_flight) = (&remainder_slots, &in_flight);
        shard_cursors
            .into_par_iter()
            .enumerate()
            .map(|(shard, mut cursors)| {
                let mut mine = Vec::new();
                let mut batch = cursors.claims(RUN_BATCH);
                let mut lost = false;
                let hand_off = |batch: Batch<'t>, mine: &mut Vec<u32>| {
                    if pipelined && in_flight.load(Ordering::Relaxed) < RUNS_IN_FLIGHT {
                        in_flight.fetch_add(1, Ordering::Relaxed);
                        scope.spawn(move |_| {
                            let mut theirs = Vec::new();
                            writer.write(batch, &mut theirs);
                            if !theirs.is_empty() {
                                lock(remainder_slots).extend(theirs);
                            }
                            in_flight.fetch_sub(1, Ordering::Relaxed);
                        });
                    } else {
                        writer.write(batch, mine);
                    }
                };
                placement.run(shard, &mut |pack, pos, k, len| {
                    if !cursors.claim(pack as usize, k, (pos as u32, len), &mut batch) {
                        lost = true;
                        return;
                    }
                    if batch.len() == RUN_BATCH {
                        let full = std::mem::replace(&mut batch, cursors.claims(RUN_BATCH));
                        hand_off(full, &mut mine);
                    }
                })?;
                writer.write(batch, &mut mine);
                lock(remainder_slots).extend(mine);
                if lost {
                    return Err(Error::invalid("fastpack", "internal error: a run found no slot"));
                }
                Ok(())
            })
            .collect()
    });
    placed.into_iter().collect::<Result<Vec<()>>>()?;
    Ok(remainder_slots.into_inner().unwrap_or_else(|e| e.into_inner()))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
