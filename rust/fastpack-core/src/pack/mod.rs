//! `pack`: the packing pipeline, buckets → packs → groups, written once into a CSR plan.
//!
//! **Buckets.** The input is the short bucket; with `long_max_len`, the sequences over
//! `max_len` are routed (during the short bucket's first pass) to a long bucket: a compact
//! copy of their lengths with their input indices, packed with its own cap.
//!
//! **Packs** (level 1), per bucket, in phases — each a module whose docs state what it
//! guarantees and what it hands on:
//!
//! 1. [`histogram`]: one parallel pass over the input classifies every length (the
//!    over-long policy), tallies the bucket, and counts its sortable items by length.
//! 2. [`sort`]: the input's second and last pass, a stable counting sort, longest first.
//! 3. [`placement`]: best or first fit over the sorted lengths, run to count each pack's
//!    segments while the sort runs (it needs only the histogram).
//! 4. [`order`] (layout): the pack order — as placed, shuffled, or by groups — becomes
//!    `pack_offsets` and each pack's first slot.
//! 5. [`replay`]: the placement runs again and writes each of its runs to its slots.
//! 6. [`unpack`]: slot words become `sample_ids` and `seqlens`; split remainders get their
//!    starts.
//!
//! The order-preserving strategies ([`in_order`]: `next_fit`, `wrapped`, `one_per_pack`)
//! tally (phase 1), walk the input once to count (3) and once more to write (5).
//!
//! **Affinity** ([`affinity`]): best fit preferring packs of one key, over the same
//! classification (phase 1) and plain best fit's pack count as its efficiency bound.
//!
//! **Groups** (level 2, [`groups`]): each bucket's packs are bin-packed by their fills into
//! groups of at most `group_tokens`, and the layout puts each group's packs together.
//!
//! Every output array is allocated once at its final size (counted first, then written)
//! and fallibly: a plan that cannot be held is an error, never an abort. Parallel writes
//! go through [`crate::memory::Tiles`] (fresh buffers, each position written once, read
//! only once all are) and [`crate::memory::Slots`]; this module has no `unsafe`.

pub(crate) mod affinity;
mod classify;
mod counts;
mod groups;
mod histogram;
mod in_order;
pub(crate) mod limits;
mod order;
mod placement;
mod replay;
mod room_set;
mod segments;
mod sort;
mod unpack;

use crate::error::{Error, Result};
use crate::length::Length;
use crate::memory::{self, Slots, Tiling};
use crate::plan::{PackOptions, Plan, Stats, Strategy, MAX_ITEMS};
use crate::shuffle::permutation;
use crate::two_level::{Bucket, Groups, Levels, TwoLevelPlan};

pub use affinity::{measure as measure_affinity, pack_affinity, Affinity, AffinityPlan};
use classify::Rules;
use counts::PackCounts;
use histogram::Histogram;
use limits::{Limit, LimitedRuns, NeedWords, Needs};
pub use placement::best_fit_oldest;
use placement::Placement;
pub use segments::{pack_segments, SegmentsPlan};
use sort::Sorted;

/// Until the unpack, a slot of `sample_ids` holds its segment's length and sample as one
/// word, `len << LEN_SHIFT | id`: a writer stores one word per segment instead of two, at
/// random slots, and `seqlens` is free to hold the sorted order meanwhile. Ids are below
/// 2^32, lengths at most 2^24: the word stays below 2^63.
const LEN_SHIFT: u32 = 39;
const SAMPLE_MASK: u64 = (1 << LEN_SHIFT) - 1;

#[inline(always)]
fn slot_word(len: u64, id: u32) -> i64 {
    (len << LEN_SHIFT | id as u64) as i64
}

/// The sequences one bucket packs: `lengths[j]` is input sequence `id(j)`.
#[derive(Clone, Copy)]
pub(crate) struct Input<'a, L> {
    pub lengths: &'a [L],
    /// Input index of each length; `None`: the lengths are the input itself.
    pub ids: Option<&'a [u32]>,
}

impl<L> Input<'_, L> {
    /// Input index of position `j` (below 2^32: at most MAX_ITEMS sequences).
    #[inline(always)]
    pub(crate) fn id(&self, j: usize) -> u32 {
        match self.ids {
            None => j as u32,
            Some(ids) => ids[j],
        }
    }
}

/// Packs `lengths` into packs of at most `opts.max_len` tokens.
pub fn pack<L: Length>(lengths: &[L], opts: &PackOptions) -> Result<Plan> {
    Ok(pack_two_level(lengths, opts, &Levels::default())?.plan)
}

/// One bucket's level 1, counted (phases 1 and, for the order-preserving strategies, 3).
struct Level1<'a, L> {
    input: Input<'a, L>,
    rules: Rules,
    strategy: Strategy,
    shard_items: usize,
    stats: Stats,
    segments: usize,
    /// Best/first fit: the histogram. Order-preserving: `None`.
    hist: Option<Histogram>,
    routed: Vec<u32>,
}

impl<'a, L: Length> Level1<'a, L> {
    /// Phase 1; the order-preserving strategies also count their packs here (they have no
    /// sort to overlap with), returned with the bucket.
    fn count(
        input: Input<'a, L>,
        rules: Rules,
        opts: &PackOptions,
    ) -> Result<(Self, Option<PackCounts>)> {
        let strategy = opts.strategy;
        let mut bucket = Self {
            input,
            rules,
            strategy,
            shard_items: opts.shard_items,
            stats: Stats::default(),
            segments: 0,
            hist: None,
            routed: Vec::new(),
        };
        match strategy {
            Strategy::BestFitDecreasing | Strategy::FirstFitDecreasing => {
                let mut hist = Histogram::build(input, &rules)?;
                bucket.stats = hist.stats.clone();
                bucket.segments = hist.items() + hist.full_pieces();
                bucket.routed = std::mem::take(&mut hist.routed);
                bucket.hist = Some(hist);
                Ok((bucket, None))
            }
            Strategy::NextFit | Strategy::Wrapped | Strategy::OnePerPack => {
                let (tally, routed) = histogram::tally(input, &rules)?;
                bucket.stats = tally.check(input, &rules)?;
                bucket.routed = routed;
                let (counts, cut) = in_order::count(input, &rules, &tally)?;
                if rules.wrapped {
                    bucket.stats.split_sequences = cut;
                }
                bucket.segments = counts.segments.iter().map(|&c| c as usize).sum();
                Ok((bucket, Some(counts)))
            }
        }
    }

    /// The fit placement; under several budgets, the one that replays `runs`.
    fn placement<'s>(&'s self, runs: Option<&'s LimitedRuns>) -> Option<Placement<'s>> {
        let hist = self.hist.as_ref()?;
        let placement = Placement::new(hist, self.strategy, self.rules.max_len, self.shard_items);
        Some(placement.with_runs(runs))
    }

    /// Sortable items: the length of the scratch the sort needs.
    fn items(&self) -> usize {
        self.hist.as_ref().map_or(0, Histogram::items)
    }

    fn any_split(&self) -> bool {
        self.stats.split_sequences > 0
    }

    fn bucket(&self, packs: usize) -> Bucket {
        Bucket {
            max_len: self.rules.max_len,
            num_sequences: self.stats.num_sequences - self.stats.empty_sequences,
            num_packs: packs as u64,
            total_tokens: self.stats.total_tokens,
        }
    }
}

/// What the layout hands to the writers.
struct Laid {
    /// Per bucket, its packs' counts in placement order (the segment counts themselves
    /// moved into the tiling for the fit strategies; their number stays).
    counts: Vec<PackCounts>,
    /// Each pack's slots (packs numbered as placed, buckets one after another); its
    /// offsets are the plan's `pack_offsets`.
    tiling: Option<Tiling>,
    /// Each pack's cap in the final order (with a long bucket).
    pack_caps: Option<Vec<i32>>,
    groups: Option<Groups>,
}

/// [`pack`] with an optional long bucket and optional level-2 groups; one pipeline for
/// every combination (see the module docs).
///
/// ```
/// use fastpack_core::{pack_two_level, Levels, PackOptions};
/// let levels = Levels { long_max_len: Some(32), group_tokens: Some(32) };
/// let out = pack_two_level(&[3u32, 5, 20, 6, 9], &PackOptions::new(8), &levels).unwrap();
/// assert_eq!(out.pack_caps.as_deref(), Some(&[8, 8, 32][..]));
/// assert_eq!(out.groups.unwrap().group_fills, vec![14, 29]);
/// ```
pub fn pack_two_level<L: Length>(
    lengths: &[L],
    opts: &PackOptions,
    levels: &Levels,
) -> Result<TwoLevelPlan> {
    pack_limited(lengths, opts, levels, &[])
}

/// [`pack_two_level`] under budgets besides tokens: every pack also holds at most
/// `limit.cap` of each `limit`'s values (see the `limits` module).
///
/// ```
/// use fastpack_core::{pack_limited, Levels, Limit, PackOptions};
/// let images = [1i64, 1, 0, 1];
/// let limits = [Limit { name: "images", values: &images, cap: 1 }];
/// let out = pack_limited(&[2u32, 2, 2, 2], &PackOptions::new(8), &Levels::default(), &limits)
///     .unwrap();
/// assert_eq!(out.plan.num_packs(), 3); // 8 tokens fit one pack, 3 images need 3
/// assert_eq!(out.limits[0].lower_bound, 3);
/// ```
pub fn pack_limited<L: Length>(
    lengths: &[L],
    opts: &PackOptions,
    levels: &Levels,
    limits: &[Limit<'_>],
) -> Result<TwoLevelPlan> {
    opts.validate()?;
    levels.validate(opts)?;
    if !limits.is_empty() {
        limits::validate(limits, opts, lengths.len())?;
    }
    if lengths.len() as u64 > MAX_ITEMS {
        return Err(Error::overflow(
            "lengths",
            format!("got {} sequences; at most {MAX_ITEMS} are supported", lengths.len()),
        ));
    }
    if limits.is_empty() {
        return Ok(pack_checked(lengths, opts, levels, limits, false)?.expect("no budgets"));
    }
    // Optimistic first: the sort checks the budgets' values as it reads them, so they are
    // read once. Any value out of range (or an error before the sort: a budget's error
    // comes first) sends the call to the screening path, which reports them as it always
    // did.
    if let Ok(Some(plan)) = pack_checked(lengths, opts, levels, limits, false) {
        return Ok(plan);
    }
    Ok(pack_checked(lengths, opts, levels, limits, true)?.expect("screened"))
}

/// [`pack_limited`] after its checks; with budgets, either screening their values first
/// (`screen`) or leaving them to the sort, then `None` if one was out of range.
fn pack_checked<L: Length>(
    lengths: &[L],
    opts: &PackOptions,
    levels: &Levels,
    limits: &[Limit<'_>],
    screen: bool,
) -> Result<Option<TwoLevelPlan>> {
    #[cfg(feature = "trace")]
    let start = std::time::Instant::now();

    // Items over a budget besides tokens: refused, or dropped (counted) before packing.
    let screened = if screen { Some(limits::screen(lengths, limits, opts)?) } else { None };
    trace!(start, "screen");
    let input = match screened.as_ref().and_then(|s| s.kept.as_ref()) {
        Some((kept, ids)) => Input { lengths: kept.as_slice(), ids: Some(ids.as_slice()) },
        None => Input { lengths, ids: None },
    };
    // Buckets, and the count of every segment they will write.
    let short_rules = Rules::new(opts, levels.long_max_len.is_some());
    let (mut short, short_counts) = Level1::count(input, short_rules, opts)?;
    // The long bucket: the routed positions, in input order, and a compact copy of their
    // lengths (the input is not read again).
    let mut routed = std::mem::take(&mut short.routed);
    let mut long_lengths = memory::try_with_capacity::<L>(routed.len(), "the long bucket")?;
    long_lengths.extend(routed.iter().map(|&j| input.lengths[j as usize]));
    if let Some(ids) = input.ids {
        for j in routed.iter_mut() {
            *j = ids[*j as usize];
        }
    }
    let mut buckets = vec![short];
    let mut in_order_counts = vec![short_counts];
    if let Some(long_max_len) = levels.long_max_len {
        let long_opts = PackOptions { max_len: long_max_len, ..opts.clone() };
        let long_input = Input { lengths: &long_lengths, ids: Some(&routed) };
        let long_rules = Rules::new(&long_opts, false);
        let (long, long_counts) = Level1::count(long_input, long_rules, &long_opts)?;
        buckets.push(long);
        in_order_counts.push(long_counts);
    }
    trace!(start, "histogram");
    let segments: usize = buckets.iter().map(|b| b.segments).sum();
    if segments as u64 > MAX_ITEMS {
        return Err(Error::overflow(
            "lengths",
            format!("the plan would hold {segments} segments; at most {MAX_ITEMS} are supported"),
        ));
    }
    // `sample_ids` and `seqlens` are written whole, through tiles (no zeroing first);
    // `starts` only where sequences are split: its untouched pages cost nothing.
    let mut sample_ids = memory::try_with_capacity::<i64>(segments, "sample_ids")?;
    let mut starts = memory::try_zeroed::<i64>(segments, "starts")?;
    let mut seqlens = memory::try_with_capacity::<i32>(segments, "seqlens")?;
    // The first bucket's sorted order lives in `seqlens` until the unpack; the others
    // (the long bucket, a few percent) have their own.
    let mut scratch: Vec<Vec<i32>> = Vec::with_capacity(buckets.len());
    for b in &buckets[1..] {
        scratch.push(memory::try_with_capacity::<i32>(b.items(), "the sorted order")?);
    }

    // The counting sort (and the outputs' page faults), alongside the placement and the
    // layout; under several budgets the placement reads the sorted order, so it follows.
    // Under several budgets, each fit bucket's needs at its sorted positions (the sort
    // writes them).
    let k = limits.len();
    let words = NeedWords::new(limits).words;
    let mut needs: Vec<Vec<u32>> = Vec::with_capacity(buckets.len());
    for b in &buckets {
        let n = if k > 0 && b.hist.is_some() { b.items() * words } else { 0 };
        needs.push(memory::try_zeroed::<u32>(n, "the items' needs")?);
    }
    // Also whether a value the sort read was out of range (unscreened values only).
    let mut sort_all = || -> Result<(Vec<Option<Sorted>>, bool)> {
        let orders = std::iter::once(&mut seqlens).chain(scratch.iter_mut());
        let mut sorted = Vec::with_capacity(buckets.len());
        let mut out_of_range = false;
        for ((bucket, order), need) in buckets.iter().zip(orders).zip(needs.iter_mut()) {
            sorted.push(match &bucket.hist {
                Some(hist) => {
                    let max_len = bucket.rules.max_len as usize;
                    let tiles = sort::tiling(hist, max_len)?.over(order, "the sorted order")?;
                    let writer = (k > 0).then(|| Needs::new(need, limits));
                    let s = sort::sort(bucket.input, &bucket.rules, hist, tiles, writer.as_ref())?;
                    out_of_range |= writer.is_some_and(|w| w.out_of_range());
                    Some(s)
                }
                None => None,
            });
        }
        trace!(start, "  counting sort");
        if out_of_range && screened.is_none() {
            return Ok((sorted, true));
        }
        // The replay writes the outputs at random slots, sequentially: fault them in
        // now, on the threads the placement leaves idle.
        memory::prefault_spare(&mut sample_ids);
        if buckets.iter().any(Level1::any_split) {
            memory::prefault_zeroed(&mut starts);
        }
        trace!(start, "  prefault");
        Ok((sorted, false))
    };
    let mut runs: Vec<Option<LimitedRuns>> = buckets.iter().map(|_| None).collect();
    let (laid, sorted) = if limits.is_empty() {
        rayon::join(
            || {
                let laid = lay_out(&buckets, &runs, in_order_counts, opts, levels);
                trace!(start, "  placement (counting) and layout");
                laid
            },
            || sort_all().map(|(sorted, _)| sorted),
        )
    } else {
        let (sorted, out_of_range) = sort_all()?;
        if out_of_range {
            // Values unscreened: screen them, and pack again.
            return Ok(None);
        }
        for (b, bucket) in buckets.iter().enumerate() {
            let Some(placement) = bucket.placement(None) else { continue };
            let hist = bucket.hist.as_ref().expect("a fit bucket");
            let budgeted = limits::Budgeted {
                hist,
                needs: &needs[b],
                limits,
                best: placement.is_best(),
                max_len: bucket.rules.max_len as u32,
                shards: placement.shards(),
            };
            runs[b] = Some(limits::place(&budgeted, |shard, len| placement.range(shard, len))?);
        }
        drop(needs);
        trace!(start, "  placement under the budgets");
        (lay_out(&buckets, &runs, in_order_counts, opts, levels), Ok(sorted))
    };
    let mut laid = laid?;
    let sorted = sorted?;
    trace!(start, "joined");

    // Replay: every bucket writes its packs' slots, each through its packs' cursors.
    let mut remainders = Vec::with_capacity(buckets.len());
    let pack_offsets;
    {
        let tiling = laid.tiling.take().expect("laid out");
        let mut tiles = tiling.over(&mut sample_ids, "sample_ids")?;
        let start_slots = Slots::new(&mut starts);
        let mut rest = tiles.cursors();
        for (b, bucket) in buckets.iter().enumerate() {
            let counts = &laid.counts[b];
            let (cursors, tail) = rest.split_at(counts.packs);
            rest = tail;
            let slots = match (&bucket.hist, &sorted[b]) {
                (Some(hist), Some(sorted)) => {
                    let order: &[i32] = if b == 0 { &seqlens } else { &scratch[b - 1] };
                    let placement = bucket.placement(runs[b].as_ref()).expect("a fit bucket");
                    let fit = replay::FitBucket { hist, placement: &placement, order, sorted };
                    replay::write_fit(&fit, cursors, &counts.shard_packs, &start_slots)?
                }
                _ => {
                    in_order::write(bucket.input, &bucket.rules, counts, cursors, &start_slots)?;
                    Vec::new()
                }
            };
            remainders.push(slots);
        }
        trace!(start, "replay (writes)");
        pack_offsets = tiles.finish().ok_or_else(|| {
            Error::invalid("fastpack", "internal error: a segment was not written")
        })?;
    }
    drop(scratch);
    trace!(start, "replay (every slot written: checked)");

    // Unpack.
    unpack::unpack(&mut sample_ids, &mut seqlens)?;
    trace!(start, "unpack");
    for ((bucket, slots), sorted) in buckets.iter().zip(&remainders).zip(&sorted) {
        if let Some(sorted) = sorted {
            let m = bucket.rules.max_len;
            unpack::resolve_remainders(slots, &sorted.split_of, m, &mut sample_ids, &mut starts)?;
        }
    }
    trace!(start, "remainders");
    trace_print!();

    // The plan and its metrics.
    let mut stats = Stats { num_sequences: lengths.len() as u64, ..Stats::default() };
    if let Some(s) = &screened {
        stats.dropped_sequences += s.dropped_sequences;
        stats.dropped_tokens += s.dropped_tokens as u64;
    }
    for b in &buckets {
        stats.add_outcomes(&b.stats);
    }
    let bucket_metrics = buckets.iter().zip(&laid.counts).map(|(b, c)| b.bucket(c.packs)).collect();
    let placed: Vec<&LimitedRuns> = runs.iter().flatten().collect();
    let limit_uses = limits::uses(limits, &placed);
    let plan = Plan::from_arrays(sample_ids, starts, seqlens, pack_offsets, opts, stats);
    Ok(Some(TwoLevelPlan {
        plan,
        pack_caps: laid.pack_caps.take(),
        buckets: bucket_metrics,
        groups: laid.groups.take(),
        limits: limit_uses,
    }))
}

/// Phases 3 and 4 for every bucket: count the packs, choose their order (groups, shuffle,
/// or as placed) and lay them out.
fn lay_out<L: Length>(
    buckets: &[Level1<'_, L>],
    runs: &[Option<LimitedRuns>],
    in_order_counts: Vec<Option<PackCounts>>,
    opts: &PackOptions,
    levels: &Levels,
) -> Result<Laid> {
    let fills = levels.group_tokens.is_some();
    #[cfg(feature = "trace")]
    let start = std::time::Instant::now();
    let mut counts = Vec::with_capacity(buckets.len());
    for ((bucket, counted), runs) in buckets.iter().zip(in_order_counts).zip(runs) {
        counts.push(match counted {
            Some(c) => c,
            None => {
                let placement = bucket.placement(runs.as_ref()).expect("a fit bucket");
                placement.count(bucket.hist.as_ref().map_or(0, Histogram::full_pieces), fills)?
            }
        });
    }
    trace!(start, "    (placement)");
    let packs: usize = counts.iter().map(|c| c.packs).sum();
    if packs as u64 > MAX_ITEMS {
        return Err(Error::overflow("lengths", format!("the plan would hold {packs} packs")));
    }
    // First pack (as placed) of each bucket.
    let firsts: Vec<usize> = counts
        .iter()
        .scan(0, |at, c| {
            let first = *at;
            *at += c.packs;
            Some(first)
        })
        .collect();

    let (order, groups) = match levels.group_tokens {
        Some(budget) => {
            let mut parts = Vec::with_capacity(buckets.len());
            for ((bucket, c), &first) in buckets.iter().zip(&counts).zip(&firsts) {
                let item_max = bucket.rules.max_len as usize;
                parts.push((first, groups::group_best_fit(&c.fills, item_max, budget)?));
            }
            let (order, groups) = groups::lay_out_groups(&parts, budget, opts.shuffle_seed)?;
            (Some(order), Some(groups))
        }
        // Shuffled, the packs of all buckets are interleaved.
        None => match opts.shuffle_seed {
            Some(seed) => (Some(permutation(packs, seed)?), None),
            None => (None, None),
        },
    };
    // The tiling takes the segment counts (one bucket's without a copy).
    let all = if counts.len() == 1 {
        std::mem::take(&mut counts[0].segments)
    } else {
        let mut all = memory::try_with_capacity::<u32>(packs, "pack counts")?;
        for c in &mut counts {
            all.extend_from_slice(&std::mem::take(&mut c.segments));
        }
        all
    };
    trace!(start, "    (order)");
    let pack_caps = pack_caps(buckets, &firsts, order.as_deref(), packs)?;
    let tiling = order::lay_out(all, order)?;
    trace!(start, "    (tiling)");
    Ok(Laid { counts, tiling: Some(tiling), pack_caps, groups })
}

/// Each pack's cap in the final order, with a long bucket.
fn pack_caps<L>(
    buckets: &[Level1<'_, L>],
    firsts: &[usize],
    order: Option<&[u32]>,
    packs: usize,
) -> Result<Option<Vec<i32>>> {
    if buckets.len() == 1 {
        return Ok(None);
    }
    let cap_of = |p: usize| {
        let b = firsts.partition_point(|&f| f <= p) - 1;
        buckets[b].rules.max_len as i32
    };
    let mut caps = memory::try_with_capacity::<i32>(packs, "pack_caps")?;
    match order {
        Some(order) => caps.extend(order.iter().map(|&p| cap_of(p as usize))),
        None => caps.extend((0..packs).map(cap_of)),
    }
    Ok(Some(caps))
}
