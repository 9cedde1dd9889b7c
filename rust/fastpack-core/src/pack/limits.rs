//! Several budgets per pack: tokens (`max_len`) and up to [`MAX_LIMITS`] others (image
//! patches, images, frames, ...), each with its own per-item values and per-pack cap.
//!
//! The fit strategies keep their order — items sorted by tokens, longest first, each
//! length in input order — and place the items of one length in **runs**, as the
//! one-budget placement does:
//!
//! - an item *starts a run* in the pack the strategy's rule picks among the packs with
//!   room for it in tokens and in every other budget (its exact needs): best fit the one
//!   with the least token room, first fit the lowest-numbered one; a new pack when none
//!   has room;
//! - the next item of the same length *follows it* into that pack while the pack has
//!   room for it in tokens and in every budget; the first one that does not fit starts a
//!   new run.
//!
//! Every room goes down by the exact needs placed, so no pack is ever over a cap. An item
//! that starts a run is placed exactly as the per-item rule places it; one that follows
//! may skip a pack of less token room (one the run's first item had no room for in a
//! budget, but it has). That relaxation is what makes a run one index operation instead
//! of one per item: needs are nearly unique per item (patches), so the per-item rule made
//! about 9 searches per 10 items, runs make about 4 (bench_vlm's mix at 10^6 items), for
//! packs within 0.05% of the per-item rule's (`benches/results/vlm_budgets.md`). With no
//! budget binding, runs are exactly the one-budget placement's.
//!
//! An item is never cut (an image is never split); one over any budget follows
//! `overlong` (`"error"` or `"drop"`, counted).
//!
//! The placement reads every item's needs — written at its sorted position by the
//! counting sort (one packed word per item when the caps' bits fit in 32), read here in
//! order — and runs once, after the sort, recording its runs; the layout and the replay
//! read those.
//!
//! **Best fit**: the rooms that have a pack (the one-budget placement's bitset tree) give
//! the least token room `>= len`, whose list usually holds a pack with room in every
//! budget. When it does not, a max-tree over token rooms `0..=max_len` whose leaves hold,
//! per budget, `1 +` the largest room of their packs (0: none) is searched rightwards,
//! descending only where every budget's maximum admits the item. The maxima are upper
//! bounds (raised when a pack is put in a list, left as they are when one is taken out,
//! recomputed from the list when they misled a search), so a leaf misleads when one
//! pack has the most room in one budget and another in the next, or when the pack that
//! held a maximum left: then no pack of it takes the item, the leaf is made exact and the
//! search moves on. Keeping them exact on every take cost a scan of the list and a walk
//! up the tree per item — most of the placement's time.
//! **First fit**: a max-tree over the packs themselves (token room and every budget's).
//!
//! The placement is deterministic and depends on the data only (shards as for one
//! budget), never on the thread count.

use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::length::Length;
use crate::memory::{self, Slots};
use crate::plan::{Overlong, PackOptions, Strategy};

use super::counts::PackCounts;
use super::histogram::Histogram;
use super::room_set::RoomSet;

/// Budgets besides tokens a plan can have.
pub const MAX_LIMITS: usize = 4;
/// Largest per-pack cap of a budget (values and rooms are held as `u32`, maxima as `1 +`).
pub const LIMIT_CAP: u64 = u32::MAX as u64 - 1;

/// One budget besides tokens: item `i` needs `values[i]`, a pack holds at most `cap`.
#[derive(Debug, Clone, Copy)]
pub struct Limit<'a> {
    pub name: &'a str,
    pub values: &'a [i64],
    pub cap: u64,
}

/// How a plan uses one budget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitUse {
    pub name: String,
    pub cap: u64,
    /// Sum over the packed items.
    pub total: u64,
    /// `ceil(total / cap)`: no plan can use fewer packs.
    pub lower_bound: u64,
    /// The fullest pack's use (at most `cap`).
    pub max_used: u64,
}

fn arg_name(limit: &Limit<'_>) -> String {
    format!("limits[{:?}]", limit.name)
}

/// Checks the limits against the options and the input, before anything is read.
pub(crate) fn validate(limits: &[Limit<'_>], opts: &PackOptions, items: usize) -> Result<()> {
    if limits.len() > MAX_LIMITS {
        return Err(Error::invalid(
            "limits",
            format!("got {} budgets; at most {MAX_LIMITS} besides tokens", limits.len()),
        ));
    }
    for (i, l) in limits.iter().enumerate() {
        if l.name.is_empty() || limits[..i].iter().any(|o| o.name == l.name) {
            return Err(Error::invalid(
                "limits",
                format!("budget names must be non-empty and distinct, got {:?}", l.name),
            ));
        }
        if !(1..=LIMIT_CAP).contains(&l.cap) {
            return Err(Error::invalid(
                "limits",
                format!("{}: cap {} out of range; expected 1..={LIMIT_CAP}", arg_name(l), l.cap),
            ));
        }
        if l.values.len() != items {
            return Err(Error::invalid(
                "limits",
                format!(
                    "{}: {} values for {items} sequences; expected one per sequence",
                    arg_name(l),
                    l.values.len()
                ),
            ));
        }
    }
    if !matches!(opts.strategy, Strategy::BestFitDecreasing | Strategy::FirstFitDecreasing) {
        return Err(Error::invalid(
            "limits",
            format!(
                "strategy {:?} keeps input order or cuts sequences; budgets besides tokens \
                 take \"bfd\" or \"ffd\"",
                opts.strategy.name()
            ),
        ));
    }
    if matches!(opts.overlong, Overlong::Truncate | Overlong::Split) {
        return Err(Error::invalid(
            "limits",
            format!(
                "overlong={:?} would cut an item, and the media it holds with it; with budgets \
                 besides tokens use \"error\" or \"drop\"",
                opts.overlong.name()
            ),
        ));
    }
    Ok(())
}

/// The items over a budget, dropped (counted) or refused.
pub(crate) struct Screened<L> {
    /// The kept items' lengths and input indices; `None`: every item is kept.
    pub kept: Option<(Vec<L>, Vec<u32>)>,
    pub dropped_sequences: u64,
    pub dropped_tokens: u128,
}

/// One parallel pass over every budget's values: a negative value is an error; an item
/// over a budget is an error under `overlong="error"`, dropped and counted under
/// `"drop"`.
pub(crate) fn screen<L: Length>(
    lengths: &[L],
    limits: &[Limit<'_>],
    opts: &PackOptions,
) -> Result<Screened<L>> {
    const CHUNK: usize = 1 << 16;
    // Per chunk: (first negative, first over, over count).
    type Found = (Option<(usize, usize)>, Option<(usize, usize)>, u64);
    let found: Vec<Found> = (0..lengths.len().div_ceil(CHUNK))
        .into_par_iter()
        .map(|c| {
            let (lo, hi) = (c * CHUNK, ((c + 1) * CHUNK).min(lengths.len()));
            // The common case first, in one vectorized pass per budget: no value negative
            // (huge as u64) or over its cap.
            let within = |l: &Limit<'_>| {
                l.values[lo..hi].iter().fold(0u64, |m, &v| m.max(v as u64)) <= l.cap
            };
            if limits.iter().all(within) {
                return (None, None, 0);
            }
            let (mut negative, mut over, mut count) = (None, None, 0u64);
            for (i, len) in lengths.iter().enumerate().take(hi).skip(lo) {
                let mut is_over = false;
                for (d, l) in limits.iter().enumerate() {
                    let v = l.values[i];
                    if v < 0 {
                        negative = negative.or(Some((i, d)));
                    } else if v as u64 > l.cap && !is_over && len.to_u64() != Some(0) {
                        is_over = true;
                        over = over.or(Some((i, d)));
                    }
                }
                count += is_over as u64;
            }
            (negative, over, count)
        })
        .collect();
    if let Some((i, d)) = found.iter().find_map(|f| f.0) {
        let l = &limits[d];
        return Err(Error::invalid(
            "limits",
            format!(
                "{}: negative value {} at index {i}; values must be non-negative integers",
                arg_name(l),
                l.values[i]
            ),
        ));
    }
    let count: u64 = found.iter().map(|f| f.2).sum();
    let Some((first, d)) = found.iter().find_map(|f| f.1) else {
        return Ok(Screened { kept: None, dropped_sequences: 0, dropped_tokens: 0 });
    };
    let l = &limits[d];
    if opts.overlong == Overlong::Error {
        return Err(Error::invalid(
            "limits",
            format!(
                "{count} sequence(s) over the {:?} budget or another (first at index {first}: \
                 {} {} over the cap of {}); pass overlong=\"drop\" (counted) or raise the cap",
                l.name, l.values[first], l.name, l.cap
            ),
        ));
    }
    // An empty sequence holds nothing to drop: it stays empty (counted as such).
    let over = |i: usize| {
        lengths[i].to_u64() != Some(0) && limits.iter().any(|l| l.values[i] as u64 > l.cap)
    };
    let kept_count = lengths.len() - count as usize;
    let mut kept_lengths = memory::try_with_capacity::<L>(kept_count, "the kept sequences")?;
    let mut kept_ids = memory::try_with_capacity::<u32>(kept_count, "the kept sequences")?;
    let mut dropped_tokens = 0u128;
    for (i, &len) in lengths.iter().enumerate() {
        if over(i) {
            // A negative length is kept, so the packing reports it as it always does.
            match len.to_u64() {
                Some(n) => dropped_tokens += n as u128,
                None => {
                    kept_lengths.push(len);
                    kept_ids.push(i as u32);
                }
            }
        } else {
            kept_lengths.push(len);
            kept_ids.push(i as u32);
        }
    }
    let dropped_sequences = (lengths.len() - kept_lengths.len()) as u64;
    Ok(Screened { kept: Some((kept_lengths, kept_ids)), dropped_sequences, dropped_tokens })
}

/// How an item's needs are held at its sorted position: one `u32` word when the caps'
/// bits fit in 32 (each need in its own bits: the sort writes a quarter to a half of the
/// bytes it would write otherwise), else one word per budget.
#[derive(Clone, Copy, Debug)]
pub(crate) struct NeedWords {
    /// Words per item: 1 (packed) or the number of budgets.
    pub words: usize,
    /// Packed: each budget's first bit and its mask (its bits: those of its cap).
    shift: [u32; MAX_LIMITS],
    mask: [u32; MAX_LIMITS],
}

impl NeedWords {
    pub(crate) fn new(limits: &[Limit<'_>]) -> Self {
        let (mut shift, mut mask) = ([0u32; MAX_LIMITS], [0u32; MAX_LIMITS]);
        let mut bits = 0u32;
        for (d, l) in limits.iter().enumerate() {
            let width = 64 - l.cap.leading_zeros();
            shift[d] = bits;
            mask[d] = ((1u64 << width.min(32)) - 1) as u32;
            bits += width;
        }
        Self { words: if bits <= 32 { 1 } else { limits.len() }, shift, mask }
    }

    fn packed(&self) -> bool {
        self.words == 1
    }

    /// Writes item `id`'s needs at position `pos`: `(in bounds, every value within its
    /// cap)`. A value out of range is written cut to 32 bits (the caller then discards
    /// the needs and screens the values).
    #[inline(always)]
    fn write(
        &self,
        slots: &Slots<'_, u32>,
        limits: &[Limit<'_>],
        pos: usize,
        id: u32,
    ) -> (bool, bool) {
        let id = id as usize;
        let mut within = true;
        if self.packed() {
            let mut word = 0u32;
            for (l, &s) in limits.iter().zip(&self.shift) {
                let v = l.values[id];
                within &= v as u64 <= l.cap;
                word |= (v as u32) << s;
            }
            return (slots.try_set(pos, word), within);
        }
        let k = limits.len();
        let mut written = true;
        for (d, l) in limits.iter().enumerate() {
            let v = l.values[id];
            within &= v as u64 <= l.cap;
            written &= slots.try_set(pos * k + d, v as u32);
        }
        (written, within)
    }

    /// The needs at position `pos` of `needs`.
    #[inline(always)]
    fn read<const K: usize>(&self, needs: &[u32], pos: usize) -> [u32; K] {
        let mut n = [0u32; K];
        if self.packed() {
            let word = needs[pos];
            for (d, v) in n.iter_mut().enumerate() {
                *v = (word >> self.shift[d]) & self.mask[d];
            }
        } else {
            n.copy_from_slice(&needs[pos * K..pos * K + K]);
        }
        n
    }
}

/// Writes each item's needs at its sorted position during the counting sort. Unless the
/// values were screened first, it checks them as it reads them: a value negative or over
/// its cap (of an item it sorts; negative, of one it does not) is noted, and the caller
/// screens and packs again (the values are read once when none is).
pub(crate) struct Needs<'a> {
    slots: Slots<'a, u32>,
    limits: &'a [Limit<'a>],
    words: NeedWords,
    out_of_range: AtomicBool,
}

impl<'a> Needs<'a> {
    pub(crate) fn new(buffer: &'a mut [u32], limits: &'a [Limit<'a>]) -> Self {
        let words = NeedWords::new(limits);
        Self { slots: Slots::new(buffer), limits, words, out_of_range: AtomicBool::new(false) }
    }

    /// `false` if `pos` is out of the buffer (the caller changed the input meanwhile).
    #[inline(always)]
    pub(crate) fn write(&self, pos: usize, id: u32) -> bool {
        let (written, within) = self.words.write(&self.slots, self.limits, pos, id);
        if !within {
            self.out_of_range.store(true, Ordering::Relaxed);
        }
        written
    }

    /// An item the sort does not place (empty, dropped for its length, or routed to
    /// another bucket): only a negative value is wrong there.
    pub(crate) fn skipped(&self, id: u32) {
        if self.limits.iter().any(|l| l.values[id as usize] < 0) {
            self.out_of_range.store(true, Ordering::Relaxed);
        }
    }

    /// Whether a value the sort read was negative or over its cap.
    pub(crate) fn out_of_range(&self) -> bool {
        self.out_of_range.load(Ordering::Relaxed)
    }
}

/// A bucket's placement under several budgets: per shard, its runs in sorted-position
/// order (`(pack, items)`: the next `items` positions of the current length go to `pack`,
/// packs numbered from 0 in the shard) and its packs' segments and tokens; each budget's
/// use.
pub(crate) struct LimitedRuns {
    pub shards: Vec<ShardRuns>,
    /// Per budget: (sum, fullest pack) over every pack of the bucket.
    pub used: Vec<(u64, u64)>,
}

/// One shard's runs, and each of its packs' segments and tokens.
pub(crate) struct ShardRuns {
    runs: Vec<(u32, u32)>,
    segments: Vec<u32>,
    fills: Vec<u32>,
}

impl LimitedRuns {
    /// Each pack's segments and (when asked) tokens, shard after shard, after `full`
    /// full-piece packs: what [`Placement::count`] counts by replaying the runs, counted
    /// as they were placed.
    pub(crate) fn counts(&self, full: usize, fills: bool, max_len: u32) -> Result<PackCounts> {
        let packs = full + self.shards.iter().map(|s| s.segments.len()).sum::<usize>();
        let mut segments = memory::try_with_capacity::<u32>(packs, "pack counts")?;
        let mut all_fills =
            memory::try_with_capacity::<u32>(if fills { packs } else { 0 }, "pack fills")?;
        segments.resize(full, 1);
        if fills {
            all_fills.resize(full, max_len);
        }
        for s in &self.shards {
            segments.extend_from_slice(&s.segments);
            if fills {
                all_fills.extend_from_slice(&s.fills);
            }
        }
        let shard_packs = self.shards.iter().map(|s| s.segments.len()).collect();
        Ok(PackCounts { packs, segments, fills: all_fills, shard_packs })
    }

    /// Replays shard `shard`: `emit(pack, first sorted position, count, len)` for each run
    /// of consecutive positions in one pack, in placement order.
    pub(crate) fn run(
        &self,
        shard: usize,
        lens: &[u32],
        range: impl Fn(u32) -> (usize, usize),
        emit: &mut dyn FnMut(u32, usize, usize, u32),
    ) -> u32 {
        let mut runs = self.shards[shard].runs.iter();
        for &len in lens {
            let (mut pos, count) = range(len);
            let end = pos + count;
            while pos < end {
                let Some(&(pack, k)) = runs.next() else { break };
                emit(pack, pos, k as usize, len);
                pos += k as usize;
            }
        }
        self.shards[shard].segments.len() as u32
    }
}

/// A best/first-fit bucket to place under `limits`: `needs` holds each sorted position's
/// needs (as `NeedWords::new(limits)` lays them out); `shards` as the one-budget
/// placement cuts them.
pub(crate) struct Budgeted<'a> {
    pub hist: &'a Histogram,
    pub needs: &'a [u32],
    pub limits: &'a [Limit<'a>],
    pub best: bool,
    pub max_len: u32,
    pub shards: usize,
}

/// Places `bucket`; `range(shard, len)` gives the sorted positions `(first, count)` of
/// length `len` in a shard.
pub(crate) fn place(
    bucket: &Budgeted<'_>,
    range: impl Fn(usize, u32) -> (usize, usize) + Sync,
) -> Result<LimitedRuns> {
    match bucket.limits.len() {
        1 => place_k::<1, 2>(bucket, &range),
        2 => place_k::<2, 3>(bucket, &range),
        3 => place_k::<3, 4>(bucket, &range),
        4 => place_k::<4, 5>(bucket, &range),
        n => Err(Error::invalid("limits", format!("got {n} budgets; expected 1..={MAX_LIMITS}"))),
    }
}

/// `K` budgets; first fit's tree has `L = K + 1` lanes (tokens first).
fn place_k<const K: usize, const L: usize>(
    bucket: &Budgeted<'_>,
    range: &(impl Fn(usize, u32) -> (usize, usize) + Sync),
) -> Result<LimitedRuns> {
    let Budgeted { hist, needs, limits, best, max_len, shards } = *bucket;
    let mut caps = [0u32; K];
    for d in 0..K {
        caps[d] = limits[d].cap as u32;
    }
    let words = NeedWords::new(limits);
    let need = |pos: usize| words.read::<K>(needs, pos);
    let placed: Vec<Result<Placed<K>>> = (0..shards)
        .into_par_iter()
        .map(|shard| {
            let positions = |len: u32| range(shard, len);
            if best {
                let fit = BestFit::<K>::new(max_len, caps)?;
                place_shard(fit, hist, &positions, &need)
            } else {
                let fit = FirstFit::<K, L>::new(max_len, caps);
                place_shard(fit, hist, &positions, &need)
            }
        })
        .collect();
    let mut runs = Vec::with_capacity(shards);
    let mut used = vec![(0u64, 0u64); K];
    for r in placed {
        let (shard_runs, f) = r?;
        runs.push(shard_runs);
        for d in 0..K {
            used[d].0 += f[d].0;
            used[d].1 = used[d].1.max(f[d].1);
        }
    }
    Ok(LimitedRuns { shards: runs, used })
}

/// A shard's runs and, per budget, (sum, fullest pack).
type Placed<const K: usize> = (ShardRuns, [(u64, u64); K]);

/// One shard under the rule `fit`, in runs (see the module docs): the first item of a run
/// goes where the rule puts it, the next items of its length follow it into that pack
/// while they fit in every budget.
fn place_shard<const K: usize, F: Fit<K>>(
    mut fit: F,
    hist: &Histogram,
    positions: &impl Fn(u32) -> (usize, usize),
    need: &impl Fn(usize) -> [u32; K],
) -> Result<Placed<K>> {
    let mut out = ShardRuns { runs: Vec::new(), segments: Vec::new(), fills: Vec::new() };
    for &len in &hist.present {
        let (first, count) = positions(len);
        let (mut pos, end) = (first, first + count);
        while pos < end {
            let mut n = need(pos);
            let (pack, mut room, mut left) = match fit.take(len, &n) {
                Some(taken) => taken,
                None => {
                    memory::try_push(&mut out.segments, 0, "pack counts")?;
                    memory::try_push(&mut out.fills, 0, "pack fills")?;
                    fit.open()?
                }
            };
            let start = pos;
            loop {
                room -= len;
                sub(&mut left, &n);
                pos += 1;
                if pos == end || room < len {
                    break;
                }
                n = need(pos);
                if !covers(&left, &n) {
                    break;
                }
            }
            let k = (pos - start) as u32;
            memory::try_push(&mut out.runs, (pack, k), "the placement")?;
            out.segments[pack as usize] += k;
            out.fills[pack as usize] += k * len;
            fit.put(pack, room, left)?;
        }
    }
    Ok((out, fit.used()))
}

#[inline(always)]
fn covers<const K: usize>(have: &[u32; K], need: &[u32; K]) -> bool {
    (0..K).all(|d| have[d] >= need[d])
}

#[inline(always)]
fn sub<const K: usize>(have: &mut [u32; K], need: &[u32; K]) {
    for d in 0..K {
        have[d] -= need[d];
    }
}

/// Adds a pack's use of every budget (its cap less its room) to (sum, fullest pack).
fn add_used<const K: usize>(acc: &mut [(u64, u64); K], caps: &[u32; K], left: &[u32; K]) {
    for ((sum, most), (cap, room)) in acc.iter_mut().zip(caps.iter().zip(left)) {
        let used = (cap - room) as u64;
        *sum += used;
        *most = (*most).max(used);
    }
}

#[inline(always)]
fn lane_max<const K: usize>(a: [u32; K], b: [u32; K]) -> [u32; K] {
    let mut m = a;
    for d in 0..K {
        m[d] = m[d].max(b[d]);
    }
    m
}

/// A placement rule over open packs.
trait Fit<const K: usize> {
    /// Takes the pack the rule picks for an item of `len` tokens and needs `need`, out of
    /// the index: `(pack, token room, other rooms)`.
    fn take(&mut self, len: u32, need: &[u32; K]) -> Option<(u32, u32, [u32; K])>;
    /// A new, empty pack (taken).
    fn open(&mut self) -> Result<(u32, u32, [u32; K])>;
    /// Puts a taken pack back with its rooms.
    fn put(&mut self, pack: u32, room: u32, left: [u32; K]) -> Result<()>;
    /// Per budget: (sum, fullest pack) over the packs.
    fn used(&self) -> [(u64, u64); K];
}

/// An open pack of best fit, listed under its token room: its rooms in every budget.
#[derive(Clone, Copy)]
struct Entry<const K: usize> {
    pack: u32,
    left: [u32; K],
}

/// Children of a node of best fit's max-tree: one cache line of lanes for two budgets.
const FAN: usize = 16;

/// Best fit on tokens (see the module docs): the rooms that have a pack (a bitset tree,
/// the usual answer in a few word operations), each room's packs with their budgets'
/// rooms side by side (a short scan of contiguous memory) and, for the items their least
/// room cannot take, a 16-ary max-tree of every budget's rooms.
struct BestFit<const K: usize> {
    max_len: u32,
    caps: [u32; K],
    present: RoomSet,
    /// `levels[0][room]`, per budget, `1 +` the largest room of a pack of that token room
    /// (0: none); `levels[k + 1][i]` the lane maxima of `levels[k][16i..16i + 16]`.
    levels: Vec<Vec<[u32; K]>>,
    /// The open packs of each token room (their order is free: ties of token room go to
    /// the first that fits).
    lists: Vec<Vec<Entry<K>>>,
    packs: u32,
    /// Per budget: sum and fullest pack, of the packs that closed (no token room left).
    closed: [(u64, u64); K],
}

impl<const K: usize> BestFit<K> {
    fn new(max_len: u32, caps: [u32; K]) -> Result<Self> {
        let mut levels = Vec::new();
        let mut width = max_len as usize + 1;
        loop {
            let mut level = memory::try_with_capacity::<[u32; K]>(width, "the budget index")?;
            level.resize(width, [0; K]);
            levels.push(level);
            if width == 1 {
                break;
            }
            width = width.div_ceil(FAN);
        }
        let mut lists = memory::try_with_capacity(max_len as usize + 1, "the budget index")?;
        lists.resize_with(max_len as usize + 1, Vec::new);
        Ok(Self {
            max_len,
            caps,
            present: RoomSet::new(max_len as usize)?,
            levels,
            lists,
            packs: 0,
            closed: [(0, 0); K],
        })
    }

    #[inline(always)]
    fn admits(lanes: &[u32; K], need: &[u32; K]) -> bool {
        (0..K).all(|d| lanes[d] > need[d])
    }

    /// The leftmost room under node `i` of level `k` (which admits `need`) that admits it.
    fn descend(&self, k: usize, i: usize, need: &[u32; K]) -> Option<usize> {
        if k == 0 {
            return Some(i);
        }
        let below = &self.levels[k - 1];
        let end = (FAN * (i + 1)).min(below.len());
        for (c, lanes) in below.iter().enumerate().take(end).skip(FAN * i) {
            if Self::admits(lanes, need) {
                if let Some(room) = self.descend(k - 1, c, need) {
                    return Some(room);
                }
            }
        }
        None
    }

    /// The first room at or after `from` whose maxima admit `need`.
    fn first_leaf(&self, from: usize, need: &[u32; K]) -> Option<usize> {
        let (mut k, mut i) = (0, from);
        loop {
            let level = &self.levels[k];
            let end = ((i / FAN + 1) * FAN).min(level.len());
            for (j, lanes) in level.iter().enumerate().take(end).skip(i) {
                if Self::admits(lanes, need) {
                    if let Some(room) = self.descend(k, j, need) {
                        return Some(room);
                    }
                }
            }
            k += 1;
            i = i / FAN + 1;
            if k == self.levels.len() || i >= self.levels[k].len() {
                return None;
            }
        }
    }

    /// Takes a pack of room `room` that covers `need`, if one does. The room's maxima are
    /// left as they were when a pack is taken (an upper bound still: the search only
    /// prunes with them), and made exact when they misled a search (no pack of the room
    /// covers `need`), so a room misleads once per change, not once per item; the pack
    /// chosen is the same as with exact maxima.
    #[inline(always)]
    fn take_from(&mut self, room: usize, need: &[u32; K]) -> Option<Entry<K>> {
        let list = &mut self.lists[room];
        let Some(at) = list.iter().position(|e| covers(&e.left, need)) else {
            let lanes = list.iter().fold([0u32; K], |m, e| lane_max(m, e.left.map(|r| r + 1)));
            self.lower(room, lanes);
            return None;
        };
        let entry = list.swap_remove(at);
        if list.is_empty() {
            self.present.remove(room);
        }
        Some(entry)
    }

    /// Room `room`'s maxima lowered to `lanes`, and its ancestors' recomputed.
    fn lower(&mut self, room: usize, lanes: [u32; K]) {
        if self.levels[0][room] == lanes {
            return;
        }
        self.levels[0][room] = lanes;
        let mut i = room;
        for k in 1..self.levels.len() {
            i /= FAN;
            let below = &self.levels[k - 1];
            let end = (FAN * (i + 1)).min(below.len());
            let m = below[FAN * i..end].iter().fold([0u32; K], |m, l| lane_max(m, *l));
            if m == self.levels[k][i] {
                break;
            }
            self.levels[k][i] = m;
        }
    }

    /// Room `room`'s maxima raised to hold `lanes`, and its ancestors'.
    fn raise(&mut self, room: usize, lanes: [u32; K]) {
        let mut i = room;
        for level in &mut self.levels {
            let m = lane_max(level[i], lanes);
            if m == level[i] {
                break;
            }
            level[i] = m;
            i /= FAN;
        }
    }
}

impl<const K: usize> Fit<K> for BestFit<K> {
    fn take(&mut self, len: u32, need: &[u32; K]) -> Option<(u32, u32, [u32; K])> {
        // From the least room that has a pack (usually one of its packs takes the item),
        // the rooms whose budgets' maxima admit it.
        let mut from = self.present.first_at_least(len as usize)?;
        while from <= self.max_len as usize {
            let room = self.first_leaf(from, need)?;
            if let Some(e) = self.take_from(room, need) {
                return Some((e.pack, room as u32, e.left));
            }
            from = room + 1;
        }
        None
    }

    fn open(&mut self) -> Result<(u32, u32, [u32; K])> {
        self.packs += 1;
        Ok((self.packs - 1, self.max_len, self.caps))
    }

    fn put(&mut self, pack: u32, room: u32, left: [u32; K]) -> Result<()> {
        if room == 0 {
            add_used(&mut self.closed, &self.caps, &left);
            return Ok(());
        }
        let r = room as usize;
        let list = &mut self.lists[r];
        if list.len() == list.capacity() {
            // Doubling from 4: most rooms hold a few packs, so their lists stay small.
            memory::try_reserve(list, list.len().max(4), "the budget index")?;
        }
        list.push(Entry { pack, left });
        if list.len() == 1 {
            self.present.insert(r);
        }
        self.raise(r, left.map(|x| x + 1));
        Ok(())
    }

    fn used(&self) -> [(u64, u64); K] {
        let mut out = self.closed;
        for entry in self.lists.iter().flatten() {
            add_used(&mut out, &self.caps, &entry.left);
        }
        out
    }
}

/// First fit: a max-tree over the packs, lane 0 their token room, lanes `1..L` the other
/// budgets' rooms.
struct FirstFit<const K: usize, const L: usize> {
    max_len: u32,
    caps: [u32; K],
    size: usize,
    tree: Vec<[u32; L]>,
    packs: u32,
}

impl<const K: usize, const L: usize> FirstFit<K, L> {
    fn new(max_len: u32, caps: [u32; K]) -> Self {
        Self { max_len, caps, size: 1024, tree: vec![[0; L]; 2048], packs: 0 }
    }

    fn lanes(len: u32, need: &[u32; K]) -> [u32; L] {
        let mut n = [0u32; L];
        n[0] = len;
        n[1..].copy_from_slice(need);
        n
    }

    #[inline(always)]
    fn admits(&self, node: usize, need: &[u32; L]) -> bool {
        (0..L).all(|d| self.tree[node][d] >= need[d])
    }

    fn descend(&self, node: usize, need: &[u32; L]) -> Option<usize> {
        if node >= self.size {
            return Some(node - self.size);
        }
        for child in [2 * node, 2 * node + 1] {
            if self.admits(child, need) {
                if let Some(leaf) = self.descend(child, need) {
                    return Some(leaf);
                }
            }
        }
        None
    }

    fn set(&mut self, leaf: usize, lanes: [u32; L]) {
        let mut node = leaf + self.size;
        self.tree[node] = lanes;
        while node > 1 {
            node >>= 1;
            self.tree[node] = lane_max(self.tree[2 * node], self.tree[2 * node + 1]);
        }
    }

    fn grow(&mut self) -> Result<()> {
        let size = self.size * 2;
        let mut tree = memory::try_with_capacity::<[u32; L]>(2 * size, "the budget index")?;
        tree.resize(2 * size, [0; L]);
        tree[size..size + self.size].copy_from_slice(&self.tree[self.size..]);
        for i in (1..size).rev() {
            tree[i] = lane_max(tree[2 * i], tree[2 * i + 1]);
        }
        self.size = size;
        self.tree = tree;
        Ok(())
    }
}

impl<const K: usize, const L: usize> Fit<K> for FirstFit<K, L> {
    fn take(&mut self, len: u32, need: &[u32; K]) -> Option<(u32, u32, [u32; K])> {
        let want = Self::lanes(len, need);
        if !self.admits(1, &want) {
            return None;
        }
        let leaf = self.descend(1, &want)?;
        let lanes = self.tree[leaf + self.size];
        let mut left = [0u32; K];
        left.copy_from_slice(&lanes[1..]);
        Some((leaf as u32, lanes[0], left))
    }

    fn open(&mut self) -> Result<(u32, u32, [u32; K])> {
        if self.packs as usize == self.size {
            self.grow()?;
        }
        self.packs += 1;
        Ok((self.packs - 1, self.max_len, self.caps))
    }

    fn put(&mut self, pack: u32, room: u32, left: [u32; K]) -> Result<()> {
        let mut lanes = [0u32; L];
        lanes[0] = room;
        lanes[1..].copy_from_slice(&left);
        self.set(pack as usize, lanes);
        Ok(())
    }

    fn used(&self) -> [(u64, u64); K] {
        let mut out = [(0u64, 0u64); K];
        let leaves = &self.tree[self.size..self.size + self.packs as usize];
        for lanes in leaves {
            let mut left = [0u32; K];
            left.copy_from_slice(&lanes[1..]);
            add_used(&mut out, &self.caps, &left);
        }
        out
    }
}

/// How the plan uses each budget, from every bucket's use.
pub(crate) fn uses(limits: &[Limit<'_>], buckets: &[&LimitedRuns]) -> Vec<LimitUse> {
    limits
        .iter()
        .enumerate()
        .map(|(d, l)| {
            let total: u64 = buckets.iter().map(|b| b.used[d].0).sum();
            let max_used = buckets.iter().map(|b| b.used[d].1).max().unwrap_or(0);
            LimitUse {
                name: l.name.to_string(),
                cap: l.cap,
                total,
                lower_bound: total.div_ceil(l.cap),
                max_used,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_fit_skips_packs_without_room_in_a_budget() {
        let mut fit = BestFit::<1>::new(10, [2]).unwrap();
        // Pack 0: room 3 tokens, no room for images; pack 1: room 5, one image left.
        let (p0, _, _) = fit.open().unwrap();
        fit.put(p0, 3, [0]).unwrap();
        let (p1, _, _) = fit.open().unwrap();
        fit.put(p1, 5, [1]).unwrap();
        // A 2-token item with an image: pack 0 fits on tokens but not on images.
        assert_eq!(fit.take(2, &[1]).map(|t| t.0), Some(p1));
        // A 2-token text item: pack 0 (the least room).
        assert_eq!(fit.take(2, &[0]).map(|t| t.0), Some(p0));
        assert!(fit.take(2, &[0]).is_none());
    }

    #[test]
    fn stale_maxima_mislead_once_and_never_hide_a_pack() {
        let mut fit = BestFit::<1>::new(10, [5]).unwrap();
        let (p0, _, _) = fit.open().unwrap();
        fit.put(p0, 3, [4]).unwrap();
        let (p1, _, _) = fit.open().unwrap();
        fit.put(p1, 3, [1]).unwrap();
        // Taking p0 leaves room 3's maximum at p0's 4 images: an upper bound now.
        assert_eq!(fit.take(2, &[4]).map(|t| t.0), Some(p0));
        assert_eq!(fit.levels[0][3], [5]);
        // Room 3 misleads (p1 has 1 image left): made exact, and no pack takes 2 images.
        assert!(fit.take(2, &[2]).is_none());
        assert_eq!(fit.levels[0][3], [2]);
        let (p2, _, _) = fit.open().unwrap();
        fit.put(p2, 7, [3]).unwrap();
        assert_eq!(fit.take(2, &[2]).map(|t| t.0), Some(p2));
        // A text item still takes the least room: p1.
        assert_eq!(fit.take(2, &[0]).map(|t| t.0), Some(p1));
    }

    #[test]
    fn first_fit_takes_the_lowest_pack_with_room_in_every_budget() {
        let mut fit = FirstFit::<1, 2>::new(10, [2]);
        for (room, left) in [(6, 0), (2, 2), (8, 1)] {
            let (p, _, _) = fit.open().unwrap();
            fit.put(p, room, [left]).unwrap();
        }
        assert_eq!(fit.take(3, &[1]).map(|t| t.0), Some(2));
        assert_eq!(fit.take(3, &[0]).map(|t| t.0), Some(0));
    }
}
