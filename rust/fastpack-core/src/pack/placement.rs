//! Phase 3 — placement: best-fit or first-fit decreasing over a counting-sorted bucket.
//!
//! Both walk the lengths present from the longest down. Items of one length are
//! interchangeable, so a placement is a *run*: `k` consecutive sorted positions of length
//! `len` into one pack. A pack that takes one item of length `len` stays the best (or
//! first) fit for the next as long as it has room, so a run is `min(left, room / len)`
//! items and the index is touched once per run, not once per item.
//!
//! The placement reads only the histogram, never the input or the sorted order, so it runs
//! while the counting sort does; it runs twice with the same runs: once to count each
//! pack's segments ([`Placement::count`]), once to write them (the replay).

use rayon::prelude::*;

use crate::error::Result;
use crate::memory;
use crate::plan::Strategy;

use super::counts::PackCounts;
use super::histogram::Histogram;
use super::limits::LimitedRuns;
use super::room_set::RoomSet;

/// `emit(pack, first_sorted_position, count, len)`.
pub(crate) trait Emit: FnMut(u32, usize, usize, u32) {}
impl<F: FnMut(u32, usize, usize, u32)> Emit for F {}

pub(crate) const NONE: u32 = u32::MAX;

/// Open packs by remaining capacity: a list of packs per capacity and the set of
/// capacities that have one, so "the smallest capacity >= len" costs O(log64 max_len).
pub(crate) struct CapacityIndex {
    rooms: RoomSet,
    head: Vec<u32>,
    pub(crate) next: Vec<u32>,
}

impl CapacityIndex {
    /// An empty index over capacities `0..=max_len`, with room for about `packs` packs.
    pub(crate) fn new(max_len: usize, packs: usize) -> Result<Self> {
        let rooms = RoomSet::new(max_len)?;
        let head = memory::try_filled(max_len + 1, NONE, "the capacity index")?;
        let next = memory::try_with_capacity(packs, "the capacity index")?;
        Ok(Self { rooms, head, next })
    }

    /// A new pack (or group), with no capacity listed yet.
    #[inline(always)]
    pub(crate) fn open(&mut self) -> Result<()> {
        memory::try_push(&mut self.next, NONE, "the capacity index")
    }

    /// Smallest capacity `>= need` that has an open pack.
    #[inline(always)]
    pub(crate) fn find_at_least(&self, need: usize) -> Option<usize> {
        self.rooms.first_at_least(need)
    }

    pub(crate) fn pop(&mut self, capacity: usize) -> u32 {
        let pack = self.head[capacity];
        self.head[capacity] = self.next[pack as usize];
        if self.head[capacity] == NONE {
            self.rooms.remove(capacity);
        }
        pack
    }

    pub(crate) fn push(&mut self, capacity: usize, pack: u32) {
        if self.head[capacity] == NONE {
            self.rooms.insert(capacity);
        }
        self.next[pack as usize] = self.head[capacity];
        self.head[capacity] = pack;
    }
}

/// Best-fit decreasing over `lens`, the lengths present, longest first. `bucket(len)` gives
/// the sorted positions `(first, count)` of this shard's items of length `len`. Ties
/// between packs of equal room go to the pack that reached that room last, which is
/// deterministic. Returns the number of packs.
pub(crate) fn best_fit(
    max_len: u32,
    lens: &[u32],
    bucket: impl Fn(u32) -> (usize, usize),
    packs_hint: usize,
    mut emit: impl Emit,
) -> Result<u32> {
    let mut index = CapacityIndex::new(max_len as usize, packs_hint)?;
    let mut packs = 0u32;
    for &len in lens {
        let (mut pos, mut left) = bucket(len);
        while left > 0 {
            let (pack, room) = match index.find_at_least(len as usize) {
                Some(room) => (index.pop(room), room),
                None => {
                    index.open()?;
                    packs += 1;
                    (packs - 1, max_len as usize)
                }
            };
            let k = left.min(room / len as usize);
            emit(pack, pos, k, len);
            pos += k;
            left -= k;
            let rest = room - k * len as usize;
            if rest > 0 {
                index.push(rest, pack);
            }
        }
    }
    Ok(packs)
}

/// Max-tree over pack rooms, for "the first pack with room >= len".
struct RoomTree {
    leaves: usize,
    tree: Vec<u32>,
}

impl RoomTree {
    fn new() -> Self {
        Self { leaves: 1024, tree: vec![0; 2048] }
    }

    fn grow(&mut self) -> Result<()> {
        let leaves = self.leaves * 2;
        let mut tree = memory::try_zeroed::<u32>(2 * leaves, "the first-fit tree")?;
        tree[leaves..leaves + self.leaves].copy_from_slice(&self.tree[self.leaves..]);
        for i in (1..leaves).rev() {
            tree[i] = tree[2 * i].max(tree[2 * i + 1]);
        }
        self.leaves = leaves;
        self.tree = tree;
        Ok(())
    }

    fn set(&mut self, leaf: usize, room: u32) {
        let mut i = leaf + self.leaves;
        self.tree[i] = room;
        while i > 1 {
            i /= 2;
            self.tree[i] = self.tree[2 * i].max(self.tree[2 * i + 1]);
        }
    }

    fn first_at_least(&self, need: u32) -> Option<usize> {
        if self.tree[1] < need {
            return None;
        }
        let mut i = 1;
        while i < self.leaves {
            i = if self.tree[2 * i] >= need { 2 * i } else { 2 * i + 1 };
        }
        Some(i - self.leaves)
    }
}

/// First-fit decreasing: each item goes to the lowest-numbered pack with room.
pub(crate) fn first_fit(
    max_len: u32,
    lens: &[u32],
    bucket: impl Fn(u32) -> (usize, usize),
    mut emit: impl Emit,
) -> Result<u32> {
    let mut rooms = RoomTree::new();
    let mut packs = 0u32;
    for &len in lens {
        let (mut pos, mut left) = bucket(len);
        while left > 0 {
            let (pack, room) = match rooms.first_at_least(len) {
                Some(p) => (p as u32, rooms.tree[p + rooms.leaves]),
                None => {
                    if packs as usize == rooms.leaves {
                        rooms.grow()?;
                    }
                    packs += 1;
                    (packs - 1, max_len)
                }
            };
            let k = left.min((room / len) as usize);
            emit(pack, pos, k, len);
            pos += k;
            left -= k;
            rooms.set(pack as usize, room - (k as u32) * len);
        }
    }
    Ok(packs)
}

/// A new pack's counters (its tokens too when `fills`).
#[inline(always)]
fn open(segs: &mut Vec<u32>, tokens: &mut Vec<u32>, fills: bool) -> Result<()> {
    memory::try_push(segs, 0, "pack counts")?;
    if fills {
        memory::try_push(tokens, 0, "pack fills")?;
    }
    Ok(())
}

/// A bucket's placement: which strategy, over which lengths, cut into which shards.
pub(crate) struct Placement<'h> {
    best: bool,
    max_len: u32,
    hist: &'h Histogram,
    shards: usize,
    /// About how many packs a shard opens: room reserved up front for per-pack state.
    packs_hint: usize,
    /// Under several budgets: the runs placed already (see `limits`), replayed by `run`.
    limited: Option<&'h LimitedRuns>,
}

impl<'h> Placement<'h> {
    /// Shards take an even share of every length's items and are placed on their own;
    /// their number depends on the data (`shard_items`), never on the thread count.
    pub(crate) fn new(
        hist: &'h Histogram,
        strategy: Strategy,
        max_len: u64,
        shard_items: usize,
    ) -> Self {
        let shards = hist.items().div_ceil(shard_items).max(1);
        let fit_tokens = hist.tally.tokens - hist.tally.full_pieces as u128 * max_len as u128;
        let packs_hint = (fit_tokens / max_len as u128) as usize / shards;
        Self {
            best: strategy != Strategy::FirstFitDecreasing,
            max_len: max_len as u32,
            hist,
            shards,
            packs_hint,
            limited: None,
        }
    }

    /// The placement under several budgets: `runs` were placed over the same shards.
    pub(crate) fn with_runs(mut self, runs: Option<&'h LimitedRuns>) -> Self {
        self.limited = runs;
        self
    }

    pub(crate) fn shards(&self) -> usize {
        self.shards
    }

    pub(crate) fn is_best(&self) -> bool {
        self.best
    }

    /// The sorted positions `(first, count)` of shard `shard`'s items of length `len`: an
    /// even share of every length's items.
    #[inline(always)]
    pub(crate) fn range(&self, shard: usize, len: u32) -> (usize, usize) {
        let h = self.hist.counts[len as usize];
        let lo = h * shard / self.shards;
        let hi = h * (shard + 1) / self.shards;
        (self.hist.bucket_start[len as usize] + lo, hi - lo)
    }

    pub(crate) fn max_len(&self) -> u64 {
        self.max_len as u64
    }

    /// Places shard `shard`: `emit(pack, first sorted position, count, len)` for each run,
    /// packs numbered from 0 in the shard. Returns the shard's number of packs.
    pub(crate) fn run(
        &self,
        shard: usize,
        emit: &mut dyn FnMut(u32, usize, usize, u32),
    ) -> Result<u32> {
        if let Some(limited) = self.limited {
            let range = |len: u32| self.range(shard, len);
            return Ok(limited.run(shard, &self.hist.present, range, emit));
        }
        let bucket = move |len: u32| self.range(shard, len);
        if self.best {
            best_fit(self.max_len, &self.hist.present, bucket, self.packs_hint, emit)
        } else {
            first_fit(self.max_len, &self.hist.present, bucket, emit)
        }
    }

    /// Runs every shard (in parallel) and counts each pack's segments, and its tokens when
    /// `fills` is set; `full` full-piece packs (one segment of `max_len`) come first.
    pub(crate) fn count(&self, full: usize, fills: bool) -> Result<PackCounts> {
        let max_len = self.max_len;
        if let Some(limited) = self.limited {
            return limited.counts(full, fills, max_len);
        }
        let placed: Vec<Result<(Vec<u32>, Vec<u32>)>> = (0..self.shards)
            .into_par_iter()
            .map(|shard| {
                // Shard 0's lists start with the full-piece packs: one shard needs no copy.
                let lead = if shard == 0 { full } else { 0 };
                let capacity = lead + self.packs_hint + self.packs_hint / 64 + 16;
                let mut segs = memory::try_with_capacity::<u32>(capacity, "pack counts")?;
                segs.resize(lead, 1);
                let mut tokens = Vec::new();
                if fills {
                    tokens = memory::try_with_capacity(capacity, "pack fills")?;
                    tokens.resize(lead, max_len);
                }
                let mut failed = None;
                self.run(shard, &mut |pack, _pos, k, len| {
                    let g = lead + pack as usize;
                    if g == segs.len() && failed.is_none() {
                        failed = open(&mut segs, &mut tokens, fills).err();
                    }
                    if failed.is_none() {
                        segs[g] += k as u32;
                        if fills {
                            tokens[g] += k as u32 * len;
                        }
                    }
                })?;
                if let Some(e) = failed {
                    return Err(e);
                }
                Ok((segs, tokens))
            })
            .collect();
        let mut placed: Vec<(Vec<u32>, Vec<u32>)> = placed.into_iter().collect::<Result<_>>()?;
        let mut shard_packs: Vec<usize> = placed.iter().map(|(segs, _)| segs.len()).collect();
        shard_packs[0] -= full;
        let (segments, fills) = if placed.len() == 1 {
            placed.pop().expect("one shard")
        } else {
            let packs: usize = placed.iter().map(|(segs, _)| segs.len()).sum();
            let mut segments = memory::try_with_capacity(packs, "pack counts")?;
            let mut all_fills =
                memory::try_with_capacity(if fills { packs } else { 0 }, "pack fills")?;
            for (segs, f) in placed {
                segments.extend_from_slice(&segs);
                all_fills.extend_from_slice(&f);
            }
            (segments, all_fills)
        };
        Ok(PackCounts { packs: segments.len(), segments, fills, shard_packs })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_index_finds_smallest_at_least() {
        let mut index = CapacityIndex::new(5000, 8).unwrap();
        index.next = vec![NONE; 8];
        for (pack, cap) in [(0u32, 7usize), (1, 300), (2, 4097), (3, 64), (4, 5000)] {
            index.push(cap, pack);
        }
        assert_eq!(index.find_at_least(0), Some(7));
        assert_eq!(index.find_at_least(8), Some(64));
        assert_eq!(index.find_at_least(65), Some(300));
        assert_eq!(index.find_at_least(301), Some(4097));
        assert_eq!(index.find_at_least(4098), Some(5000));
        assert_eq!(index.pop(5000), 4);
        assert_eq!(index.find_at_least(4098), None);
        assert_eq!(index.pop(64), 3);
        assert_eq!(index.find_at_least(8), Some(300));
    }

    #[test]
    fn room_tree_grows_and_finds_first() {
        let mut rooms = RoomTree::new();
        for leaf in 0..if cfg!(miri) { 1100 } else { 3000 } {
            if leaf == rooms.leaves {
                rooms.grow().unwrap();
            }
            rooms.set(leaf, (leaf % 100) as u32);
        }
        assert_eq!(rooms.first_at_least(99), Some(99));
        assert_eq!(rooms.first_at_least(50), Some(50));
        assert_eq!(rooms.first_at_least(100), None);
    }
}

/// Best fit of `lens` taken in the given order (the caller sorts them), one item at a
/// time, where a tie between packs of equal room goes to the pack that reached that room
/// **first** (the oldest). This is TRL's rule (`pack_dataset(strategy="bfd")`), which the
/// drop-in `fastpack.trl.pack_dataset` reproduces row for row; `best_fit` keeps its own
/// rule, which lets it place a run of equal lengths with one index operation. Both give
/// the same packs' fills: a tie only decides which of two equal rooms shrinks.
///
/// Returns the pack of each item, packs numbered in the order they open. Every length
/// must be in `1..=max_len`.
pub fn best_fit_oldest(lens: &[u32], max_len: u32) -> Result<Vec<u32>> {
    if max_len == 0 {
        return Err(crate::Error::invalid("max_len", "must be at least 1"));
    }
    let cap = max_len as usize;
    let mut rooms = RoomSet::new(cap)?;
    // Per room, a queue of packs in the order they reached it: head, tail, next.
    let mut head = memory::try_filled(cap + 1, NONE, "the capacity index")?;
    let mut tail = memory::try_filled(cap + 1, NONE, "the capacity index")?;
    let mut next: Vec<u32> = Vec::new();
    let mut out = memory::try_with_capacity(lens.len(), "the placement")?;
    for (i, &len) in lens.iter().enumerate() {
        if len == 0 || len > max_len {
            return Err(crate::Error::invalid(
                "lengths",
                format!("length {len} at index {i} is not in 1..={max_len}"),
            ));
        }
        let len = len as usize;
        let (pack, room) = match rooms.first_at_least(len) {
            Some(room) => {
                let pack = head[room];
                head[room] = next[pack as usize];
                if head[room] == NONE {
                    tail[room] = NONE;
                    rooms.remove(room);
                }
                (pack, room)
            }
            None => {
                memory::try_push(&mut next, NONE, "the capacity index")?;
                ((next.len() - 1) as u32, cap)
            }
        };
        out.push(pack);
        let rest = room - len;
        if rest > 0 {
            next[pack as usize] = NONE;
            if tail[rest] == NONE {
                head[rest] = pack;
                rooms.insert(rest);
            } else {
                next[tail[rest] as usize] = pack;
            }
            tail[rest] = pack;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod oldest_tests {
    use super::best_fit_oldest;

    #[test]
    fn ties_go_to_the_oldest_pack() {
        // Sorted lengths 3, 3, 1 with room 4: both packs have room 1; the first one
        // opened reached it first and takes the 1.
        assert_eq!(best_fit_oldest(&[3, 3, 1], 4).unwrap(), vec![0, 1, 0]);
        // Packs 0 and 1 both have room 2: the 2 goes to pack 0, the 1s then fill pack 1.
        assert_eq!(best_fit_oldest(&[3, 3, 2, 1, 1, 1], 5).unwrap(), vec![0, 1, 0, 1, 1, 2]);
    }

    #[test]
    fn refuses_lengths_outside_the_cap() {
        assert!(best_fit_oldest(&[5], 4).is_err());
        assert!(best_fit_oldest(&[0], 4).is_err());
        assert!(best_fit_oldest(&[1], 0).is_err());
        assert!(best_fit_oldest(&[], 4).unwrap().is_empty());
    }
}
