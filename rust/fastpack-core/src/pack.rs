//! `pack`: validate and classify the lengths, place them with the chosen strategy, and lay
//! the result out as a CSR [`Plan`], shuffled or not, in two passes (count, then write)
//! so every output array is allocated once at its final size.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::fit;
use crate::length::Length;
use crate::memory::{self, prefault_unwritten, prefault_zeroed, zeroed, SyncPtr};
use crate::plan::{Overlong, PackOptions, Plan, Stats, Strategy, MAX_ITEMS};
use crate::shuffle::permutation;

/// What the over-long policy makes of one sequence.
#[derive(Clone, Copy)]
enum Class {
    Empty,
    /// One segment of this many tokens (truncated to the cap when `cut > 0`).
    Whole {
        len: u64,
        cut: u64,
    },
    /// `full` segments of `max_len`, then one of `rest` tokens if `rest > 0`; `len`
    /// tokens in all (reserved slots included).
    Split {
        full: u64,
        rest: u64,
        len: u64,
    },
    Dropped,
    Overlong,
    Negative,
}

#[inline(always)]
fn classify(raw: Option<u64>, opts: &PackOptions) -> Class {
    let Some(len) = raw else { return Class::Negative };
    if len == 0 {
        return Class::Empty;
    }
    // Lengths come from at most i64/u64 and `reserve` < 2^24: saturating keeps absurd
    // inputs over-long instead of wrapping them into short ones.
    let extended = len.saturating_add(opts.reserve);
    if extended <= opts.max_len || opts.strategy == Strategy::Wrapped {
        return Class::Whole { len: extended, cut: 0 };
    }
    match opts.overlong {
        Overlong::Error => Class::Overlong,
        Overlong::Truncate => Class::Whole { len: opts.max_len, cut: extended - opts.max_len },
        Overlong::Drop => Class::Dropped,
        Overlong::Split => Class::Split {
            full: extended / opts.max_len,
            rest: extended % opts.max_len,
            len: extended,
        },
    }
}

/// The extended length of a sequence that fits as it is, the common case: one compare.
#[inline(always)]
fn fits(raw: Option<u64>, opts: &PackOptions) -> Option<u64> {
    match raw {
        Some(len) if len.wrapping_sub(1) < opts.max_len - opts.reserve => Some(len + opts.reserve),
        _ => None,
    }
}

/// Per-chunk tallies, merged in chunk order (integer sums: thread-count independent).
#[derive(Default, Clone)]
struct Tally {
    empty: u64,
    dropped_sequences: u64,
    dropped_tokens: u128,
    truncated_sequences: u64,
    truncated_tokens: u128,
    split_sequences: u64,
    /// Segments of exactly `max_len` from split sequences (each a pack of its own).
    full_pieces: u64,
    /// Segments that go through the sort: whole sequences and split remainders.
    items: u64,
    tokens: u128,
    overlong: u64,
    first_overlong: Option<(u64, u64)>,
    first_negative: Option<(u64, i128)>,
}

impl Tally {
    fn add(&mut self, i: u64, raw: Option<u64>, class: Class, value: impl FnOnce() -> i128) {
        match class {
            Class::Empty => self.empty += 1,
            Class::Whole { len, cut } => {
                self.items += 1;
                self.tokens += len as u128;
                if cut > 0 {
                    self.truncated_sequences += 1;
                    self.truncated_tokens += cut as u128;
                }
            }
            Class::Split { full, rest, len } => {
                self.split_sequences += 1;
                self.full_pieces += full;
                self.items += (rest > 0) as u64;
                self.tokens += len as u128;
            }
            Class::Dropped => {
                self.dropped_sequences += 1;
                self.dropped_tokens += raw.unwrap_or(0) as u128;
            }
            Class::Overlong => {
                self.overlong += 1;
                if self.first_overlong.is_none() {
                    self.first_overlong = Some((i, raw.unwrap_or(0)));
                }
            }
            Class::Negative => {
                if self.first_negative.is_none() {
                    self.first_negative = Some((i, value()));
                }
            }
        }
    }

    fn merge(mut self, other: &Tally) -> Tally {
        self.empty += other.empty;
        self.dropped_sequences += other.dropped_sequences;
        self.dropped_tokens += other.dropped_tokens;
        self.truncated_sequences += other.truncated_sequences;
        self.truncated_tokens += other.truncated_tokens;
        self.split_sequences += other.split_sequences;
        self.full_pieces += other.full_pieces;
        self.items += other.items;
        self.tokens += other.tokens;
        self.overlong += other.overlong;
        self.first_overlong = self.first_overlong.or(other.first_overlong);
        self.first_negative = self.first_negative.or(other.first_negative);
        self
    }
}

/// Classifies and tallies one chunk of the input (its first index is `base`), counting
/// the packed lengths into `hist` when given.
fn tally_chunk<L: Length>(
    chunk: &[L],
    base: u64,
    opts: &PackOptions,
    mut hist: Option<&mut [u32]>,
) -> Tally {
    let mut tally = Tally::default();
    // Fast path: a length that fits as it is (most of them). Tokens fit in u64 here: at
    // most 2^32 items of at most 2^24 tokens per chunk.
    let (mut fast_items, mut fast_tokens) = (0u64, 0u64);
    for (j, &raw) in chunk.iter().enumerate() {
        let value = raw.to_u64();
        if let Some(len) = fits(value, opts) {
            if let Some(h) = hist.as_deref_mut() {
                h[len as usize] += 1;
            }
            fast_items += 1;
            fast_tokens += len;
            continue;
        }
        let class = classify(value, opts);
        if let (Some(h), Class::Whole { len, .. } | Class::Split { rest: len, .. }) =
            (hist.as_deref_mut(), class)
        {
            h[len as usize] += (len > 0) as u32;
        }
        tally.add(base + j as u64, value, class, || raw.to_i128());
    }
    tally.items += fast_items;
    tally.tokens += fast_tokens as u128;
    tally
}

fn check_tally(t: &Tally, n: usize, opts: &PackOptions) -> Result<Stats> {
    if let Some((i, v)) = t.first_negative {
        return Err(Error::invalid(
            "lengths",
            format!("negative length {v} at index {i}; lengths must be non-negative integers"),
        ));
    }
    if let Some((i, len)) = t.first_overlong {
        return Err(Error::Overlong {
            count: t.overlong,
            first_index: i,
            first_length: len,
            cap: opts.max_len,
            reserve_note: if opts.reserve > 0 {
                format!(" with {} reserved separator token(s) each", opts.reserve)
            } else {
                String::new()
            },
        });
    }
    let segments = t.items as u128 + t.full_pieces as u128;
    if segments > MAX_ITEMS as u128 {
        return Err(Error::overflow(
            "lengths",
            format!("the plan would hold {segments} segments; at most {MAX_ITEMS} are supported"),
        ));
    }
    let limit = i64::MAX as u128;
    if t.tokens > limit || t.dropped_tokens > limit || t.truncated_tokens > limit {
        return Err(Error::overflow("lengths", "the total number of tokens exceeds 2^63 - 1"));
    }
    Ok(Stats {
        num_sequences: n as u64,
        empty_sequences: t.empty,
        dropped_sequences: t.dropped_sequences,
        dropped_tokens: t.dropped_tokens as u64,
        truncated_sequences: t.truncated_sequences,
        truncated_tokens: t.truncated_tokens as u64,
        split_sequences: t.split_sequences,
        total_tokens: t.tokens as u64,
    })
}

/// Raw output pointers shared by the writers of disjoint slots.
#[derive(Clone, Copy)]
struct Out {
    sample_ids: *mut i64,
    starts: *mut i64,
}

// SAFETY: every slot is written by exactly one writer (each pack's slots belong to one
// shard or one chunk), and the arrays outlive the parallel section.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

/// Until the final pass, a slot's sample id holds `len << LEN_SHIFT | sample`: a writer
/// then stores one word per segment instead of two, at random slots, and `seqlens` is free
/// to hold the sorted order meanwhile. Samples (and split indices) are below 2^32, lengths
/// at most 2^24.
const LEN_SHIFT: u32 = 39;

impl Out {
    /// The sample and start of a slot whose length is already written.
    #[inline(always)]
    unsafe fn write_sample(self, slot: usize, sample: u64, start: u64) {
        *self.sample_ids.add(slot) = sample as i64;
        if start != 0 {
            *self.starts.add(slot) = start as i64;
        }
    }

    /// One segment, length packed with the sample (see [`LEN_SHIFT`]).
    #[inline(always)]
    unsafe fn write_packed(self, slot: usize, sample: u64, start: u64, len: u64) {
        *self.sample_ids.add(slot) = (len << LEN_SHIFT | sample) as i64;
        // `starts` starts zeroed: skipping zero starts (all of them unless sequences are
        // split) spares a random write per segment.
        if start != 0 {
            *self.starts.add(slot) = start as i64;
        }
    }
}

/// Sets the pack order: `Some(order)` lists the old pack at each new position.
pub(crate) type Reorder<'a> = Option<&'a mut (dyn FnMut(&[i64]) -> Vec<u32> + Send)>;

/// The CSR offsets of packs of the given segment counts, and each pack's first slot (a
/// cursor the writers advance; it reuses `counts`' memory): in the order `reorder` picks
/// from the packs' token fills, else shuffled by the seed, else as placed. The writers
/// then fill the final layout directly: no second copy of the plan. Slots fit in u32: a
/// plan holds at most MAX_ITEMS segments.
fn lay_out(
    mut counts: Vec<u32>,
    fills: &[i64],
    reorder: Reorder<'_>,
    seed: Option<u64>,
) -> (Vec<i64>, Vec<u32>) {
    #[cfg(feature = "trace")]
    let start = std::time::Instant::now();
    // perm[g] = new position of pack g.
    let perm = match reorder {
        Some(f) => {
            let order = f(fills);
            debug_assert_eq!(order.len(), counts.len());
            let mut perm = vec![0u32; counts.len()];
            for (q, &g) in order.iter().enumerate() {
                perm[g as usize] = q as u32;
            }
            Some(perm)
        }
        None => seed.map(|s| permutation(counts.len(), s)),
    };
    trace!(start, "  pack order");
    let mut offsets = memory::with_capacity(counts.len() + 1);
    offsets.push(0i64);
    let mut acc = 0i64;
    match perm {
        None => {
            for c in counts.iter_mut() {
                let size = *c;
                *c = acc as u32;
                acc += size as i64;
                offsets.push(acc);
            }
        }
        Some(perm) => {
            // Random scatter and gather over millions of packs: parallel.
            let mut sizes = memory::with_capacity::<u32>(counts.len());
            let sizes_out = SyncPtr(sizes.as_mut_ptr());
            perm.par_iter().zip(&counts).for_each(|(&q, &c)| {
                // SAFETY: `perm` is a permutation: each position written once.
                unsafe { *sizes_out.get().add(q as usize) = c };
            });
            // SAFETY: every position was written just above.
            unsafe { sizes.set_len(counts.len()) };
            for size in sizes {
                acc += size as i64;
                offsets.push(acc);
            }
            counts.par_iter_mut().zip(&perm).for_each(|(c, &q)| *c = offsets[q as usize] as u32);
        }
    }
    (offsets, counts)
}

fn chunking(n: usize, max_len: u64) -> usize {
    let threads = rayon::current_num_threads();
    // Per-chunk histograms cost (max_len + 1) * 4 bytes each: bound them to 32 MiB.
    let by_memory = ((1usize << 23) / (max_len as usize + 1)).max(1);
    (n >> 16).clamp(1, 4 * threads).min(by_memory)
}

/// Packs `lengths` into packs of at most `opts.max_len` tokens.
pub fn pack<L: Length>(lengths: &[L], opts: &PackOptions) -> Result<Plan> {
    pack_ordered(lengths, opts, None)
}

/// [`pack`] with the pack order chosen by `reorder` from the packs' token fills (two-level
/// grouping lays groups out this way, for free).
pub(crate) fn pack_ordered<L: Length>(
    lengths: &[L],
    opts: &PackOptions,
    reorder: Reorder<'_>,
) -> Result<Plan> {
    opts.validate()?;
    if lengths.len() as u64 > MAX_ITEMS {
        return Err(Error::overflow(
            "lengths",
            format!("got {} sequences; at most {MAX_ITEMS} are supported", lengths.len()),
        ));
    }
    let (stats, sample_ids, starts, seqlens, pack_offsets) = match opts.strategy {
        Strategy::BestFitDecreasing | Strategy::FirstFitDecreasing => {
            pack_fit(lengths, opts, reorder)?
        }
        Strategy::NextFit | Strategy::Wrapped => pack_in_order(lengths, opts, reorder)?,
    };
    let plan = Plan {
        sample_ids,
        starts,
        seqlens,
        pack_offsets,
        max_len: opts.max_len,
        reserve: opts.reserve,
        strategy: opts.strategy,
        overlong: opts.overlong,
        stats,
    };
    Ok(plan)
}

type Arrays = (Stats, Vec<i64>, Vec<i64>, Vec<i32>, Vec<i64>);

/// Best/first fit decreasing. Pass 1 tallies and histograms the lengths (parallel). Then,
/// side by side: the placement runs once to count each pack's segments and the packs are
/// laid out, while the other threads materialize the counting sort and fault in the
/// outputs. The placement runs again (the replay), handing its runs to writers that copy
/// each run out of the sorted order into its pack's slots. A last streaming pass unpacks
/// the lengths; split remainders get their starts.
fn pack_fit<L: Length>(lengths: &[L], opts: &PackOptions, reorder: Reorder<'_>) -> Result<Arrays> {
    let n = lengths.len();
    let max_len = opts.max_len as usize;
    let chunks = chunking(n, opts.max_len);
    let chunk_len = n.div_ceil(chunks).max(1);

    #[cfg(feature = "trace")]
    let start = std::time::Instant::now();
    // Pass 1: classify, tally and histogram each chunk.
    let per_chunk: Vec<(Tally, Vec<u32>)> = lengths
        .par_chunks(chunk_len)
        .enumerate()
        .map(|(c, chunk)| {
            let mut hist = vec![0u32; max_len + 1];
            let tally = tally_chunk(chunk, (c * chunk_len) as u64, opts, Some(&mut hist));
            (tally, hist)
        })
        .collect();
    let tally = per_chunk.iter().fold(Tally::default(), |acc, (t, _)| acc.merge(t));
    let stats = check_tally(&tally, n, opts)?;
    trace!(start, "tally and histogram");

    // Stable counting sort, longest first: bucket `len` starts after all longer buckets.
    let mut hist = vec![0usize; max_len + 1];
    for (_, h) in &per_chunk {
        for (total, &c) in hist.iter_mut().zip(h) {
            *total += c as usize;
        }
    }
    let mut bucket_start = vec![0usize; max_len + 2];
    for len in (1..=max_len).rev() {
        bucket_start[len] = bucket_start[len + 1] + hist[len];
    }
    for len in 1..=max_len {
        bucket_start[len] -= hist[len];
    }
    let mut cursors: Vec<Vec<u32>> = Vec::with_capacity(chunks);
    let mut running: Vec<usize> = bucket_start[..=max_len].to_vec();
    for (_, h) in &per_chunk {
        cursors.push(running.iter().map(|&r| r as u32).collect());
        for (r, &c) in running.iter_mut().zip(h) {
            *r += c as usize;
        }
    }
    // Per chunk: the full pieces and the split sequences of the chunks before it.
    let (full_before, split_before): (Vec<u64>, Vec<u64>) = per_chunk
        .iter()
        .scan((0u64, 0u64), |acc, (t, _)| {
            let before = *acc;
            *acc = (acc.0 + t.full_pieces, acc.1 + t.split_sequences);
            Some(before)
        })
        .unzip();
    drop(per_chunk);

    let items = tally.items as usize;

    // The lengths present, longest first: the placement visits only these.
    let lens: Vec<u32> = (1..=max_len).rev().filter(|&l| hist[l] > 0).map(|l| l as u32).collect();
    // Shards: each takes an even share of every bucket and is packed on its own.
    let shards = items.div_ceil(opts.shard_items).max(1);
    let bucket = |shard: usize| {
        let hist = &hist;
        let bucket_start = &bucket_start;
        move |len: u32| {
            let h = hist[len as usize];
            let lo = h * shard / shards;
            let hi = h * (shard + 1) / shards;
            (bucket_start[len as usize] + lo, hi - lo)
        }
    };
    // About how many packs each shard opens (its tokens over max_len): room reserved up
    // front for per-pack state.
    let fit_tokens = tally.tokens - tally.full_pieces as u128 * opts.max_len as u128;
    let packs_hint = (fit_tokens / opts.max_len as u128) as usize / shards;
    let place = |shard: usize, emit: &mut dyn FnMut(u32, usize, usize, u32)| -> u32 {
        let max_len = opts.max_len as u32;
        match opts.strategy {
            Strategy::FirstFitDecreasing => first_fit_dyn(max_len, &lens, bucket(shard), emit),
            _ => best_fit_dyn(max_len, &lens, bucket(shard), packs_hint, emit),
        }
    };

    // The counting sort itself, run alongside the first placement (which needs only the
    // histogram): `sorted[pos]` is the input index of the item at sorted position `pos`;
    // it lives in `seqlens` until the replay is over (see LEN_SHIFT).
    // Split sequences are listed in `split_of`, in input order, for the full-piece
    // writer; a split remainder needs its start too, so its position is flagged in
    // `is_remainder` and holds its index into `split_of` instead: nothing reads `lengths`
    // at random.
    let m = opts.max_len;
    let any_split = tally.split_sequences > 0;
    let is_remainder: Vec<AtomicU64> = if any_split {
        (0..items.div_ceil(64)).map(|_| AtomicU64::new(0)).collect()
    } else {
        Vec::new()
    };
    // (full pieces << 32 | input index) of each split sequence; both fit in 32 bits since
    // the plan holds at most MAX_ITEMS segments (checked above).
    let mut split_of = memory::with_capacity::<u64>(tally.split_sequences as usize);
    let full = tally.full_pieces as usize;
    let segments = items + full;
    // Every slot's sample and length are written; only the starts rely on being zero.
    let mut sample_ids = memory::with_capacity::<i64>(segments);
    let mut starts = zeroed::<i64>(segments);
    let mut seqlens = memory::with_capacity::<i32>(segments);
    let sorted_out = SyncPtr(seqlens.as_mut_ptr() as *mut u32);
    let laid_out = rayon::join(
        // Place once to count each pack's segments (and tokens), then lay the packs out.
        || -> Result<(Vec<i64>, Vec<u32>, Vec<usize>)> {
            let want_fills = reorder.is_some();
            // Per shard, each pack's segment count and (for `reorder`) token fill. Shard 0's
            // lists start with the full-piece packs: a global placement needs no copy.
            let mut placed: Vec<(Vec<u32>, Vec<u32>)> = (0..shards)
                .into_par_iter()
                .map(|shard| {
                    let lead = if shard == 0 { full } else { 0 };
                    let capacity = lead + packs_hint + packs_hint / 64 + 16;
                    let mut segs: Vec<u32> = memory::with_capacity(capacity);
                    segs.resize(lead, 1);
                    let mut fills: Vec<u32> = Vec::new();
                    if want_fills {
                        fills = memory::with_capacity(capacity);
                        fills.resize(lead, m as u32);
                    }
                    place(shard, &mut |pack, _pos, k, len| {
                        let g = lead + pack as usize;
                        if g == segs.len() {
                            segs.push(0);
                            if want_fills {
                                fills.push(0);
                            }
                        }
                        segs[g] += k as u32;
                        if want_fills {
                            fills[g] += k as u32 * len;
                        }
                    });
                    (segs, fills)
                })
                .collect();
            trace!(start, "placement (counting)");
            let packs_total = placed.iter().map(|(segs, _)| segs.len()).sum::<usize>();
            if packs_total as u64 > MAX_ITEMS {
                let message = format!("the plan would hold {packs_total} packs");
                return Err(Error::overflow("lengths", message));
            }
            let mut shard_packs: Vec<usize> = placed.iter().map(|(segs, _)| segs.len()).collect();
            shard_packs[0] -= full;
            let (counts, fills) = if shards == 1 {
                placed.pop().expect("one shard")
            } else {
                let mut counts = Vec::with_capacity(packs_total);
                let mut fills = Vec::with_capacity(if want_fills { packs_total } else { 0 });
                for (segs, f) in placed {
                    counts.extend_from_slice(&segs);
                    fills.extend_from_slice(&f);
                }
                (counts, fills)
            };
            let fills: Vec<i64> = fills.into_iter().map(i64::from).collect();
            let (offsets, cursor) = lay_out(counts, &fills, reorder, opts.shuffle_seed);
            trace!(start, "lay out");
            Ok((offsets, cursor, shard_packs))
        },
        || {
            let is_remainder = &is_remainder;
            let split_out = SyncPtr(split_of.as_mut_ptr());
            lengths.par_chunks(chunk_len).zip(cursors.par_iter_mut()).enumerate().for_each(
                |(c, (chunk, cursor))| {
                    let base = c * chunk_len;
                    let mut r = split_before[c] as usize;
                    for (j, &raw) in chunk.iter().enumerate() {
                        let value = raw.to_u64();
                        let sample = (base + j) as u32;
                        let (len, entry) = match fits(value, opts) {
                            Some(len) => (len, None),
                            None => match classify(value, opts) {
                                Class::Whole { len, .. } => (len, None),
                                Class::Split { full, rest, .. } => {
                                    // SAFETY: each chunk owns its range of split sequences.
                                    unsafe { *split_out.get().add(r) = full << 32 | sample as u64 };
                                    r += 1;
                                    if rest == 0 {
                                        continue;
                                    }
                                    (rest, Some(r as u32 - 1))
                                }
                                _ => continue,
                            },
                        };
                        let pos = cursor[len as usize] as usize;
                        cursor[len as usize] += 1;
                        // SAFETY: the cursors of all chunks and lengths cover disjoint
                        // position ranges: each position is written once.
                        unsafe { *sorted_out.get().add(pos) = entry.unwrap_or(sample) };
                        if entry.is_some() {
                            is_remainder[pos >> 6].fetch_or(1 << (pos & 63), Ordering::Relaxed);
                        }
                    }
                },
            );
            // The replay writes the outputs at random slots, sequentially: fault them in
            // now, on the threads the placement leaves idle. `starts` stays untouched (all
            // zero, no memory) unless sequences are split.
            trace!(start, "counting sort");
            prefault_unwritten(&mut sample_ids);
            if full > 0 || any_split {
                prefault_zeroed(&mut starts);
            }
            trace!(start, "prefault");
        },
    );
    drop(cursors);
    // SAFETY: the counting sort wrote every sorted position and every split sequence.
    unsafe { split_of.set_len(tally.split_sequences as usize) };
    let (pack_offsets, mut cursor, shard_packs) = laid_out.0?;
    trace!(start, "joined");
    // Full-piece packs come first and hold one segment each; the replay owns the rest.
    let (full_slots, mut fit_cursor) = cursor.split_at_mut(full);
    // Each shard advances the cursors of its own packs.
    let mut shard_cursors = Vec::with_capacity(shards);
    for &size in &shard_packs {
        let (part, rest) = std::mem::take(&mut fit_cursor).split_at_mut(size);
        shard_cursors.push(part);
        fit_cursor = rest;
    }
    let full_slots = &*full_slots;

    let out = Out { sample_ids: sample_ids.as_mut_ptr(), starts: starts.as_mut_ptr() };
    let written = rayon::join(
        // Pieces of exactly max_len, one pack each, in input order.
        || {
            if full == 0 {
                return;
            }
            (0..full_before.len()).into_par_iter().for_each(|c| {
                let mut pack = full_before[c] as usize;
                let end = split_before.get(c + 1).map_or(split_of.len(), |&e| e as usize);
                for &entry in &split_of[split_before[c] as usize..end] {
                    let sample = entry & u32::MAX as u64;
                    for piece in 0..entry >> 32 {
                        // SAFETY: one slot per full-piece pack, written once.
                        unsafe {
                            out.write_packed(full_slots[pack] as usize, sample, piece * m, m)
                        };
                        pack += 1;
                    }
                }
            });
            trace!(start, "full pieces");
        },
        // Replay each shard's placement: a run's slots are contiguous, and so are its
        // sorted positions, so each run is one sequential copy out of `sorted`. The
        // placement itself is sequential; its runs go in batches to idle threads, which
        // do the (random-access) writing.
        || {
            // SAFETY: the counting sort wrote these `items` words; nothing else writes
            // `seqlens` until the final pass.
            let sorted = unsafe { std::slice::from_raw_parts(sorted_out.get(), items) };
            let writer = RunWriter { sorted, is_remainder: &is_remainder, out };
            let remainder_slots = Mutex::new(Vec::new());
            let in_flight = AtomicUsize::new(0);
            let pipelined = rayon::current_num_threads() > 1;
            rayon::scope(|scope| {
                let (writer, remainder_slots, in_flight) = (&writer, &remainder_slots, &in_flight);
                shard_cursors.into_par_iter().enumerate().for_each(|(shard, cursor)| {
                    let mut mine = Vec::new();
                    let mut batch = Vec::with_capacity(RUN_BATCH);
                    let hand_off = |batch: Vec<Run>, mine: &mut Vec<u32>| {
                        if pipelined && in_flight.load(Ordering::Relaxed) < RUNS_IN_FLIGHT {
                            in_flight.fetch_add(1, Ordering::Relaxed);
                            scope.spawn(move |_| {
                                let mut theirs = Vec::new();
                                writer.write(&batch, &mut theirs);
                                if !theirs.is_empty() {
                                    lock(remainder_slots).extend(theirs);
                                }
                                in_flight.fetch_sub(1, Ordering::Relaxed);
                            });
                        } else {
                            writer.write(&batch, mine);
                        }
                    };
                    place(shard, &mut |pack, pos, k, len| {
                        let slot = cursor[pack as usize];
                        cursor[pack as usize] += k as u32;
                        batch.push(Run { slot, pos: pos as u32, k: k as u32, len });
                        if batch.len() == RUN_BATCH {
                            let full = std::mem::replace(&mut batch, Vec::with_capacity(RUN_BATCH));
                            hand_off(full, &mut mine);
                        }
                    });
                    writer.write(&batch, &mut mine);
                    lock(remainder_slots).extend(mine);
                });
            });
            let remainder_slots = remainder_slots.into_inner().unwrap_or_else(|e| e.into_inner());
            trace!(start, "replay");
            remainder_slots
        },
    );
    let remainder_slots = written.1;

    // Unpack: every slot's length goes to `seqlens` (over the sorted order, no longer
    // needed), its sample stays.
    let mask = (1u64 << LEN_SHIFT) - 1;
    // SAFETY: every slot's packed word is written: full pieces by their writer, the rest
    // by the replay.
    unsafe { sample_ids.set_len(segments) };
    let lens = &mut seqlens.spare_capacity_mut()[..segments];
    sample_ids.par_chunks_mut(1 << 16).zip(lens.par_chunks_mut(1 << 16)).for_each(
        |(samples, lens)| {
            for (sample, len) in samples.iter_mut().zip(lens) {
                let word = *sample as u64;
                len.write((word >> LEN_SHIFT) as i32);
                *sample = (word & mask) as i64;
            }
        },
    );
    // SAFETY: the loop above wrote every length.
    unsafe { seqlens.set_len(segments) };
    trace!(start, "unpacked");
    // A remainder's slot holds its index into `split_of` so far. Resolving it here rather
    // than in the replay keeps those random reads off the sequential path (and lets them
    // overlap).
    remainder_slots.par_iter().for_each(|&slot| {
        let slot = slot as usize;
        // SAFETY: each remainder slot is listed once; no other writer is left (`out`
        // points into the same buffers).
        unsafe {
            let entry = split_of[*out.sample_ids.add(slot) as usize];
            out.write_sample(slot, entry & u32::MAX as u64, (entry >> 32) * m);
        }
    });

    trace!(start, "done");
    trace_print!();
    Ok((stats, sample_ids, starts, seqlens, pack_offsets))
}

/// A run of the replay: `k` items of length `len` at sorted positions `pos..` go to
/// slots `slot..` (both below MAX_ITEMS, so u32).
struct Run {
    slot: u32,
    pos: u32,
    k: u32,
    len: u32,
}

/// Runs go from the placement to the writers in batches of this many (128 KiB)...
const RUN_BATCH: usize = 1 << 13;
/// ...with at most this many batches waiting, so memory stays bounded when the writers
/// fall behind (the placement then writes its batches itself).
const RUNS_IN_FLIGHT: usize = 4;

struct RunWriter<'a> {
    sorted: &'a [u32],
    is_remainder: &'a [AtomicU64],
    out: Out,
}

impl RunWriter<'_> {
    /// Writes the runs' segments; adds the slots of split remainders among them to
    /// `remainder_slots` (they hold an index into `split_of` until resolved).
    fn write(&self, runs: &[Run], remainder_slots: &mut Vec<u32>) {
        for run in runs {
            let (slot, pos, k) = (run.slot as usize, run.pos as usize, run.k as usize);
            for j in 0..k {
                // SAFETY: each sorted position belongs to one run of one shard, and each
                // run owns its slots.
                unsafe {
                    self.out.write_packed(slot + j, self.sorted[pos + j] as u64, 0, run.len as u64)
                };
            }
            if self.is_remainder.is_empty() {
                continue;
            }
            for j in 0..k {
                let p = pos + j;
                if self.is_remainder[p >> 6].load(Ordering::Relaxed) >> (p & 63) & 1 != 0 {
                    remainder_slots.push((slot + j) as u32);
                }
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn best_fit_dyn(
    max_len: u32,
    lens: &[u32],
    bucket: impl Fn(u32) -> (usize, usize),
    packs_hint: usize,
    emit: &mut dyn FnMut(u32, usize, usize, u32),
) -> u32 {
    fit::best_fit(max_len, lens, bucket, packs_hint, emit)
}

fn first_fit_dyn(
    max_len: u32,
    lens: &[u32],
    bucket: impl Fn(u32) -> (usize, usize),
    emit: &mut dyn FnMut(u32, usize, usize, u32),
) -> u32 {
    fit::first_fit(max_len, lens, bucket, emit)
}

/// Order-preserving strategies: one sequential walk, run twice (count, then write).
fn pack_in_order<L: Length>(
    lengths: &[L],
    opts: &PackOptions,
    reorder: Reorder<'_>,
) -> Result<Arrays> {
    let n = lengths.len();
    let chunk_len = n.div_ceil(chunking(n, 1)).max(1);
    let tally = lengths
        .par_chunks(chunk_len)
        .enumerate()
        .map(|(c, chunk)| tally_chunk(chunk, (c * chunk_len) as u64, opts, None))
        .reduce(Tally::default, |a, b| a.merge(&b));
    let mut stats = check_tally(&tally, n, opts)?;

    let mut counts: Vec<u32> = Vec::new();
    let mut fills: Vec<i64> = Vec::new();
    let mut segments = 0usize;
    let split = walk(lengths, opts, |pack, _, _, len| {
        if pack as usize == counts.len() {
            counts.push(0);
            fills.push(0);
        }
        counts[pack as usize] += 1;
        fills[pack as usize] += len as i64;
        segments += 1;
    });
    if segments as u64 > MAX_ITEMS {
        return Err(Error::overflow("lengths", format!("the plan would hold {segments} segments")));
    }
    if opts.strategy == Strategy::Wrapped {
        stats.split_sequences = split;
    }
    let (pack_offsets, mut cursor) = lay_out(counts, &fills, reorder, opts.shuffle_seed);
    drop(fills);
    // The walk writes every slot of all three.
    let mut sample_ids = memory::with_capacity::<i64>(segments);
    let mut starts = memory::with_capacity::<i64>(segments);
    let mut seqlens = memory::with_capacity::<i32>(segments);
    {
        let (ids, sts, lens) = (
            &mut sample_ids.spare_capacity_mut()[..segments],
            &mut starts.spare_capacity_mut()[..segments],
            &mut seqlens.spare_capacity_mut()[..segments],
        );
        walk(lengths, opts, |pack, sample, start, len| {
            let slot = cursor[pack as usize] as usize;
            cursor[pack as usize] += 1;
            ids[slot].write(sample as i64);
            sts[slot].write(start as i64);
            lens[slot].write(len as i32);
        });
    }
    // SAFETY: the walk emits every segment once, and the cursors give each its own slot.
    unsafe {
        sample_ids.set_len(segments);
        starts.set_len(segments);
        seqlens.set_len(segments);
    }
    Ok((stats, sample_ids, starts, seqlens, pack_offsets))
}

/// Emits `(pack, sample, start, len)` in input order; returns how many sequences were cut
/// across packs (wrapped only).
fn walk<L: Length>(
    lengths: &[L],
    opts: &PackOptions,
    mut emit: impl FnMut(u32, u64, u64, u64),
) -> u64 {
    let m = opts.max_len;
    let mut packs = 0u32;
    let mut fill = m; // no open pack yet: "full"
    let mut cut = 0u64;
    for (i, &raw) in lengths.iter().enumerate() {
        let i = i as u64;
        match (opts.strategy, classify(raw.to_u64(), opts)) {
            (Strategy::Wrapped, Class::Whole { len, .. }) => {
                let mut start = 0;
                let mut pieces = 0u64;
                while start < len {
                    if fill == m {
                        packs += 1;
                        fill = 0;
                    }
                    let take = (m - fill).min(len - start);
                    emit(packs - 1, i, start, take);
                    fill += take;
                    start += take;
                    pieces += 1;
                }
                cut += (pieces > 1) as u64;
            }
            (_, Class::Whole { len, .. }) => {
                if fill + len > m {
                    packs += 1;
                    fill = 0;
                }
                emit(packs - 1, i, 0, len);
                fill += len;
            }
            (_, Class::Split { full, rest, .. }) => {
                for piece in 0..full {
                    packs += 1;
                    emit(packs - 1, i, piece * m, m);
                    fill = m;
                }
                if rest > 0 {
                    if fill + rest > m {
                        packs += 1;
                        fill = 0;
                    }
                    emit(packs - 1, i, full * m, rest);
                    fill += rest;
                }
            }
            _ => {}
        }
    }
    cut
}
