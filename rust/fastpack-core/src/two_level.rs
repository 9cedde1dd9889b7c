//! Short/long buckets and two-level packing, as a layer over [`crate::pack`].
//!
//! **Buckets** (seed 002 §4.1): sequences with `len + reserve <= max_len` go into packs of
//! `max_len`; longer ones, with the over-long policy applied against `long_max_len`, into
//! packs of `long_max_len`, so no pack mixes the two. The short bucket is `pack()` on the
//! input itself with `overlong = Drop`: what it drops is exactly the long bucket, so the
//! input is never copied. The long bucket (usually a few percent) is `pack()` on a compact
//! copy of the long lengths, its sample ids mapped back to input indices. The two CSR plans
//! are concatenated: short packs, then long packs.
//!
//! **Groups**: level 2 bin-packs each bucket's packs by their filled tokens into groups of at
//! most `group_tokens` (best-fit decreasing over the same capacity index as level 1), then
//! reorders the packs so each group's packs are contiguous; `group_offsets` is the CSR one
//! level up. Groups never mix buckets: short groups come first, then long groups.
//!
//! **Shuffle**: with groups, the order of groups is shuffled (packs stay inside their group);
//! with buckets alone, the order of all packs, short and long interleaved.

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::fit::{CapacityIndex, NONE};
use crate::length::Length;
use crate::pack::{pack, pack_ordered};
use crate::plan::{Overlong, PackOptions, Plan, Strategy, MAX_ITEMS, MAX_LEN_LIMIT};
use crate::shuffle::permutation;

/// Largest `group_tokens`: a group flattens into one varlen row whose `cu_seqlens` are int32.
pub const GROUP_TOKENS_LIMIT: u64 = i32::MAX as u64;

/// What [`pack_two_level`] adds to [`PackOptions`]. Both `None`: a plain [`pack`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Levels {
    /// Cap of the long bucket; must exceed `max_len`.
    pub long_max_len: Option<u64>,
    /// Token budget of a level-2 group; at least the largest pack cap.
    pub group_tokens: Option<u64>,
}

impl Levels {
    fn validate(&self, opts: &PackOptions) -> Result<()> {
        if let Some(long) = self.long_max_len {
            if long <= opts.max_len || long > MAX_LEN_LIMIT {
                return Err(Error::invalid(
                    "long_max_len",
                    format!(
                        "got {long}; expected an integer in {}..={MAX_LEN_LIMIT}, above max_len ({})",
                        opts.max_len + 1,
                        opts.max_len
                    ),
                ));
            }
            if opts.strategy == Strategy::Wrapped {
                return Err(Error::invalid(
                    "long_max_len",
                    "strategy \"wrapped\" cuts every sequence at max_len, so no sequence is long; \
                     use another strategy or leave long_max_len unset",
                ));
            }
        }
        if let Some(budget) = self.group_tokens {
            let (name, cap) = match self.long_max_len {
                Some(long) => ("long_max_len", long),
                None => ("max_len", opts.max_len),
            };
            if budget < cap || budget > GROUP_TOKENS_LIMIT {
                return Err(Error::invalid(
                    "group_tokens",
                    format!(
                        "got {budget}; expected an integer in {cap}..={GROUP_TOKENS_LIMIT}: at least \
                         {name} ({cap}) so every pack fits a group, at most 2^31 - 1 so a group's \
                         cu_seqlens fit int32"
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// One bucket of a plan: its cap and what went into it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    pub max_len: u64,
    /// Non-empty input sequences routed here (before the bucket's over-long policy).
    pub num_sequences: u64,
    pub num_packs: u64,
    pub total_tokens: u64,
}

impl Bucket {
    /// `ceil(total_tokens / max_len)`.
    pub fn lower_bound(&self) -> u64 {
        self.total_tokens.div_ceil(self.max_len)
    }

    /// `total_tokens / (num_packs * max_len)`; 1.0 for an empty bucket.
    pub fn efficiency(&self) -> f64 {
        if self.num_packs == 0 {
            return 1.0;
        }
        self.total_tokens as f64 / (self.num_packs as f64 * self.max_len as f64)
    }
}

/// Level 2: groups of packs, in CSR form over the (reordered) packs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Groups {
    /// Group `g` holds packs `group_offsets[g] .. group_offsets[g + 1]`.
    pub group_offsets: Vec<i64>,
    /// Tokens in each group.
    pub group_tokens: Vec<i64>,
    /// The budget every group stays within.
    pub cap: u64,
}

impl Groups {
    pub fn num_groups(&self) -> usize {
        self.group_tokens.len()
    }
}

/// A [`Plan`] with buckets and groups. `plan.max_len` is the short cap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TwoLevelPlan {
    pub plan: Plan,
    /// Each pack's cap (its bucket's `max_len`); `None` without a long bucket (all `max_len`).
    pub pack_caps: Option<Vec<i32>>,
    /// The short bucket, then the long one if `long_max_len` was given.
    pub buckets: Vec<Bucket>,
    pub groups: Option<Groups>,
}

impl TwoLevelPlan {
    /// Sum of the buckets' lower bounds: packs never mix buckets.
    pub fn lower_bound(&self) -> u64 {
        self.buckets.iter().map(Bucket::lower_bound).sum()
    }

    /// Tokens over the summed capacity of all packs, each at its own cap.
    pub fn efficiency(&self) -> f64 {
        let capacity: u64 = self.buckets.iter().map(|b| b.num_packs * b.max_len).sum();
        if capacity == 0 {
            return 1.0;
        }
        self.plan.stats.total_tokens as f64 / capacity as f64
    }

    /// Tokens over `num_groups * group_tokens`, if grouped.
    pub fn group_efficiency(&self) -> Option<f64> {
        let groups = self.groups.as_ref()?;
        if groups.num_groups() == 0 {
            return Some(1.0);
        }
        Some(self.plan.stats.total_tokens as f64 / (groups.num_groups() as f64 * groups.cap as f64))
    }
}

/// [`pack`] with an optional long bucket and optional level-2 groups (see the module docs).
///
/// ```
/// use fastpack_core::{pack_two_level, Levels, PackOptions};
/// let levels = Levels { long_max_len: Some(32), group_tokens: Some(32) };
/// let out = pack_two_level(&[3u32, 5, 20, 6, 9], &PackOptions::new(8), &levels).unwrap();
/// assert_eq!(out.pack_caps.as_deref(), Some(&[8, 8, 32][..]));
/// assert_eq!(out.groups.unwrap().group_tokens, vec![14, 29]);
/// ```
pub fn pack_two_level<L: Length>(
    lengths: &[L],
    opts: &PackOptions,
    levels: &Levels,
) -> Result<TwoLevelPlan> {
    opts.validate()?;
    levels.validate(opts)?;
    if levels.long_max_len.is_none() && levels.group_tokens.is_none() {
        let plan = pack(lengths, opts)?;
        let bucket = Bucket {
            max_len: opts.max_len,
            num_sequences: plan.stats.num_sequences - plan.stats.empty_sequences,
            num_packs: plan.num_packs() as u64,
            total_tokens: plan.stats.total_tokens,
        };
        return Ok(TwoLevelPlan { plan, pack_caps: None, buckets: vec![bucket], groups: None });
    }

    if let (None, Some(budget)) = (levels.long_max_len, levels.group_tokens) {
        // One bucket: the groups are chosen from the pack fills inside `pack`, which then
        // writes every segment straight to its grouped position (no reordering pass).
        let mut groups = None;
        let plan = {
            let mut reorder = |fills: &[i64]| {
                let part = group_best_fit(fills, opts.max_len as usize, budget);
                let (order, g) = lay_out_groups(&[(0, part)], budget, opts.shuffle_seed);
                groups = Some(g);
                order
            };
            pack_ordered(lengths, opts, Some(&mut reorder))?
        };
        let bucket = Bucket {
            max_len: opts.max_len,
            num_sequences: plan.stats.num_sequences - plan.stats.empty_sequences,
            num_packs: plan.num_packs() as u64,
            total_tokens: plan.stats.total_tokens,
        };
        return Ok(TwoLevelPlan { plan, pack_caps: None, buckets: vec![bucket], groups });
    }

    // Level 1, unshuffled: the order is set once at the end.
    let mut short_opts = opts.clone();
    short_opts.shuffle_seed = None;
    if levels.long_max_len.is_some() {
        short_opts.overlong = Overlong::Drop;
    }
    let mut plan = pack(lengths, &short_opts)?;
    plan.overlong = opts.overlong;
    let short_packs = plan.num_packs();
    let mut buckets = vec![Bucket {
        max_len: opts.max_len,
        num_sequences: plan.stats.num_sequences - plan.stats.empty_sequences,
        num_packs: short_packs as u64,
        total_tokens: plan.stats.total_tokens,
    }];
    let mut pack_caps = None;
    if let Some(long_max_len) = levels.long_max_len {
        buckets[0].num_sequences -= plan.stats.dropped_sequences;
        let long = add_long_bucket(&mut plan, lengths, opts, long_max_len)?;
        let mut caps = vec![opts.max_len as i32; short_packs];
        caps.resize(plan.num_packs(), long_max_len as i32);
        pack_caps = Some(caps);
        buckets.push(long);
    }

    let total_packs = plan.num_packs();
    let (order, groups) = match levels.group_tokens {
        Some(budget) => {
            let fills = plan.pack_tokens();
            let mut parts = Vec::with_capacity(buckets.len());
            let mut first = 0usize;
            for bucket in &buckets {
                let end = first + bucket.num_packs as usize;
                parts.push((
                    first,
                    group_best_fit(&fills[first..end], bucket.max_len as usize, budget),
                ));
                first = end;
            }
            drop(fills);
            let (order, groups) = lay_out_groups(&parts, budget, opts.shuffle_seed);
            (Some(order), Some(groups))
        }
        None => {
            let order = opts.shuffle_seed.map(|seed| {
                let mut order = vec![0u32; total_packs];
                for (pack, &to) in permutation(total_packs, seed).iter().enumerate() {
                    order[to as usize] = pack as u32;
                }
                order
            });
            (order, None)
        }
    };
    if let Some(order) = order {
        reorder_packs(&mut plan, &order);
        if let Some(caps) = pack_caps.as_mut() {
            *caps = order.iter().map(|&p| caps[p as usize]).collect();
        }
    }
    Ok(TwoLevelPlan { plan, pack_caps, buckets, groups })
}

/// Packs the sequences the short run dropped into packs of `long_max_len` and appends them.
fn add_long_bucket<L: Length>(
    plan: &mut Plan,
    lengths: &[L],
    opts: &PackOptions,
    long_max_len: u64,
) -> Result<Bucket> {
    let is_long =
        |raw: L| raw.to_u64().is_some_and(|len| len.saturating_add(opts.reserve) > opts.max_len);
    const CHUNK: usize = 1 << 20;
    let pieces: Vec<(Vec<u32>, Vec<L>)> = lengths
        .par_chunks(CHUNK)
        .enumerate()
        .map(|(c, chunk)| {
            let mut ids = Vec::new();
            let mut lens = Vec::new();
            for (j, &raw) in chunk.iter().enumerate() {
                if is_long(raw) {
                    ids.push((c * CHUNK + j) as u32);
                    lens.push(raw);
                }
            }
            (ids, lens)
        })
        .collect();
    let count: usize = pieces.iter().map(|(ids, _)| ids.len()).sum();
    let mut ids = Vec::with_capacity(count);
    let mut long_lengths = Vec::with_capacity(count);
    for (i, l) in pieces {
        ids.extend_from_slice(&i);
        long_lengths.extend_from_slice(&l);
    }

    let mut long_opts = opts.clone();
    long_opts.max_len = long_max_len;
    long_opts.shuffle_seed = None;
    let long = pack(&long_lengths, &long_opts).map_err(|err| match err {
        Error::Overlong { count, first_index, first_length, cap, reserve_note } => {
            Error::Overlong {
                count,
                first_index: ids[first_index as usize] as u64,
                first_length,
                cap,
                reserve_note,
            }
        }
        other => other,
    })?;
    drop(long_lengths);

    let segments = plan.num_segments() + long.num_segments();
    let packs = plan.num_packs() + long.num_packs();
    if segments as u64 > MAX_ITEMS || packs as u64 > MAX_ITEMS {
        return Err(Error::overflow("lengths", format!("the plan would hold {segments} segments")));
    }
    let base = plan.num_segments() as i64;
    plan.sample_ids.reserve_exact(long.num_segments());
    plan.sample_ids.extend(long.sample_ids.iter().map(|&s| ids[s as usize] as i64));
    plan.starts.reserve_exact(long.num_segments());
    plan.starts.extend_from_slice(&long.starts);
    plan.seqlens.reserve_exact(long.num_segments());
    plan.seqlens.extend_from_slice(&long.seqlens);
    plan.pack_offsets.reserve_exact(long.num_packs());
    plan.pack_offsets.extend(long.pack_offsets[1..].iter().map(|&o| o + base));

    // The short run counted the long sequences as dropped; the long run says what became of them.
    let s = &mut plan.stats;
    let ls = &long.stats;
    s.dropped_sequences = ls.dropped_sequences;
    s.dropped_tokens = ls.dropped_tokens;
    s.truncated_sequences = ls.truncated_sequences;
    s.truncated_tokens = ls.truncated_tokens;
    s.split_sequences = ls.split_sequences;
    s.total_tokens += ls.total_tokens;
    Ok(Bucket {
        max_len: long_max_len,
        num_sequences: count as u64,
        num_packs: long.num_packs() as u64,
        total_tokens: ls.total_tokens,
    })
}

/// Level-2 groups of one bucket: packs (local indices) grouped contiguously, packs per group
/// and tokens per group.
struct BucketGroups {
    members: Vec<u32>,
    sizes: Vec<u32>,
    tokens: Vec<i64>,
}

/// Best-fit decreasing of pack fills (each in `1..=item_max`) into groups of `budget`.
///
/// The capacity index covers rooms `0..=item_max`; a room above `item_max` is keyed as
/// `item_max`, since any item fits it. This is still exact best fit: a group is opened only
/// when no room `>= item_max` exists, so at most one group ever has such a room.
fn group_best_fit(fills: &[i64], item_max: usize, budget: u64) -> BucketGroups {
    let mut hist = vec![0usize; item_max + 1];
    for &f in fills {
        hist[f as usize] += 1;
    }
    // first[len]: sorted position of the first pack of fill `len`, longest first.
    let mut first = vec![0usize; item_max + 2];
    for len in (0..item_max).rev() {
        first[len] = first[len + 1] + hist[len + 1];
    }
    let mut cursor = first.clone();
    let mut order = vec![0u32; fills.len()];
    for (pack, &f) in fills.iter().enumerate() {
        order[cursor[f as usize]] = pack as u32;
        cursor[f as usize] += 1;
    }
    drop(cursor);

    let mut index = CapacityIndex::new(item_max);
    let mut rooms: Vec<u64> = Vec::new();
    let mut group_of = vec![0u32; fills.len()];
    for len in (1..=item_max).rev() {
        let (mut pos, mut left) = (first[len], hist[len]);
        while left > 0 {
            let group = match index.find_at_least(len) {
                Some(key) => index.pop(key),
                None => {
                    index.next.push(NONE);
                    rooms.push(budget);
                    (rooms.len() - 1) as u32
                }
            };
            let room = rooms[group as usize];
            let k = left.min((room / len as u64) as usize);
            group_of[pos..pos + k].fill(group);
            pos += k;
            left -= k;
            let rest = room - (k * len) as u64;
            rooms[group as usize] = rest;
            if rest > 0 {
                index.push(rest.min(item_max as u64) as usize, group);
            }
        }
    }

    let mut sizes = vec![0u32; rooms.len()];
    for &g in &group_of {
        sizes[g as usize] += 1;
    }
    let mut next = Vec::with_capacity(rooms.len());
    let mut acc = 0usize;
    for &s in &sizes {
        next.push(acc);
        acc += s as usize;
    }
    let mut members = vec![0u32; fills.len()];
    for (&pack, &g) in order.iter().zip(&group_of) {
        members[next[g as usize]] = pack;
        next[g as usize] += 1;
    }
    let tokens = rooms.iter().map(|&r| (budget - r) as i64).collect();
    BucketGroups { members, sizes, tokens }
}

/// The new pack order (new position -> old pack) and the groups' CSR, buckets in order and
/// the groups shuffled if asked.
fn lay_out_groups(
    parts: &[(usize, BucketGroups)],
    budget: u64,
    seed: Option<u64>,
) -> (Vec<u32>, Groups) {
    // (first pack of its bucket, offset of the group in `members`, size, tokens), all buckets.
    let mut all: Vec<(usize, usize, u32, i64)> = Vec::new();
    for (first, part) in parts {
        let mut at = 0usize;
        for (&size, &tokens) in part.sizes.iter().zip(&part.tokens) {
            all.push((*first, at, size, tokens));
            at += size as usize;
        }
    }
    let bucket_of: Vec<usize> = parts
        .iter()
        .enumerate()
        .flat_map(|(b, (_, part))| std::iter::repeat_n(b, part.sizes.len()))
        .collect();
    let mut groups_in_order: Vec<usize> = (0..all.len()).collect();
    if let Some(seed) = seed {
        for (g, &to) in permutation(all.len(), seed).iter().enumerate() {
            groups_in_order[to as usize] = g;
        }
    }
    let packs: usize = parts.iter().map(|(_, p)| p.members.len()).sum();
    let mut order = Vec::with_capacity(packs);
    let mut group_offsets = Vec::with_capacity(all.len() + 1);
    let mut group_tokens = Vec::with_capacity(all.len());
    group_offsets.push(0i64);
    for g in groups_in_order {
        let (first, at, size, tokens) = all[g];
        let members = &parts[bucket_of[g]].1.members[at..at + size as usize];
        order.extend(members.iter().map(|&m| (first + m as usize) as u32));
        group_offsets.push(order.len() as i64);
        group_tokens.push(tokens);
    }
    (order, Groups { group_offsets, group_tokens, cap: budget })
}

/// Rewrites the plan's CSR so pack `i` is old pack `order[i]`, one array at a time (the
/// extra memory is one array, not the plan).
fn reorder_packs(plan: &mut Plan, order: &[u32]) {
    let old = std::mem::take(&mut plan.pack_offsets);
    let mut offsets = Vec::with_capacity(order.len() + 1);
    let mut acc = 0i64;
    offsets.push(0);
    for &p in order {
        acc += old[p as usize + 1] - old[p as usize];
        offsets.push(acc);
    }
    let seqlens = std::mem::take(&mut plan.seqlens);
    plan.seqlens = gather(&seqlens, &old, &offsets, order, |n| n);
    drop(seqlens);
    plan.sample_ids = gather_i64(std::mem::take(&mut plan.sample_ids), &old, &offsets, order);
    plan.starts = gather_i64(std::mem::take(&mut plan.starts), &old, &offsets, order);
    plan.pack_offsets = offsets;
}

/// Gathers an int64 array through a u32 copy when every value fits (sample ids always do),
/// then widens it back into the source buffer: the extra memory is 4 bytes per segment
/// rather than 8, and no second int64 array is allocated.
fn gather_i64(mut src: Vec<i64>, old: &[i64], new: &[i64], order: &[u32]) -> Vec<i64> {
    if !src.par_iter().all(|&v| (0..=u32::MAX as i64).contains(&v)) {
        return gather(&src, old, new, order, |v| v);
    }
    let narrow = gather(&src, old, new, order, |v| v as u32);
    src.par_iter_mut().zip(narrow.par_iter()).for_each(|(slot, &v)| *slot = v as i64);
    src
}

fn gather<S: Copy + Sync, T: Copy + Default + Send>(
    src: &[S],
    old: &[i64],
    new: &[i64],
    order: &[u32],
    convert: impl Fn(S) -> T + Sync,
) -> Vec<T> {
    const PACKS_PER_TASK: usize = 1 << 12;
    let mut out = vec![T::default(); src.len()];
    let mut tasks = Vec::with_capacity(order.len().div_ceil(PACKS_PER_TASK));
    let mut rest: &mut [T] = &mut out;
    for lo in (0..order.len()).step_by(PACKS_PER_TASK) {
        let hi = (lo + PACKS_PER_TASK).min(order.len());
        let (head, tail) = rest.split_at_mut((new[hi] - new[lo]) as usize);
        tasks.push((&order[lo..hi], head));
        rest = tail;
    }
    tasks.into_par_iter().for_each(|(packs, piece)| {
        let mut at = 0;
        for &p in packs {
            let (a, b) = (old[p as usize] as usize, old[p as usize + 1] as usize);
            for (slot, &v) in piece[at..at + b - a].iter_mut().zip(&src[a..b]) {
                *slot = convert(v);
            }
            at += b - a;
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Strategy;
    use proptest::prelude::*;
    use proptest::strategy::Strategy as Strategy2;

    fn check(lengths: &[u32], opts: &PackOptions, levels: &Levels) -> TwoLevelPlan {
        let out = pack_two_level(lengths, opts, levels).unwrap();
        let plan = &out.plan;
        let p = plan.num_packs();
        let caps: Vec<u64> = match &out.pack_caps {
            Some(c) => c.iter().map(|&c| c as u64).collect(),
            None => vec![opts.max_len; p],
        };
        assert_eq!(caps.len(), p);
        let fills = plan.pack_tokens();
        // Each bucket's packs stay within its cap; long and short never share a pack.
        for (pack, (&fill, &cap)) in fills.iter().zip(&caps).enumerate() {
            assert!(fill as u64 <= cap && fill > 0);
            let segments = plan.pack_offsets[pack] as usize..plan.pack_offsets[pack + 1] as usize;
            for s in segments.filter(|_| out.pack_caps.is_some()) {
                let len = lengths[plan.sample_ids[s] as usize] as u64 + opts.reserve;
                assert_eq!(len > opts.max_len, cap != opts.max_len, "bucket mix in pack {pack}");
            }
        }
        // Every token accounted for.
        let input: u64 =
            lengths.iter().map(|&l| l as u64 + if l > 0 { opts.reserve } else { 0 }).sum();
        let s = &plan.stats;
        let reserve_of_dropped = s.dropped_sequences * opts.reserve;
        assert_eq!(
            s.total_tokens + s.dropped_tokens + reserve_of_dropped + s.truncated_tokens,
            input,
            "{s:?}"
        );
        let kept: u64 = plan.seqlens.iter().map(|&n| n as u64).sum();
        assert_eq!(kept, s.total_tokens);
        assert_eq!(out.buckets.iter().map(|b| b.total_tokens).sum::<u64>(), kept);
        assert_eq!(out.buckets.iter().map(|b| b.num_packs).sum::<u64>(), p as u64);
        if let Some(g) = &out.groups {
            assert_eq!(g.group_offsets[0], 0);
            assert_eq!(*g.group_offsets.last().unwrap(), p as i64);
            assert!(g.group_offsets.windows(2).all(|w| w[0] < w[1]));
            for (i, w) in g.group_offsets.windows(2).enumerate() {
                let tokens: i64 = fills[w[0] as usize..w[1] as usize].iter().sum();
                assert_eq!(tokens, g.group_tokens[i]);
                assert!(tokens as u64 <= g.cap);
                let caps = &caps[w[0] as usize..w[1] as usize];
                assert!(caps.iter().all(|&c| c == caps[0]), "group {i} mixes buckets");
            }
        }
        out
    }

    #[test]
    fn buckets_and_groups_small() {
        let lengths = [3u32, 5, 20, 6, 9, 40, 0, 8];
        let mut opts = PackOptions::new(8);
        opts.overlong = Overlong::Split;
        let levels = Levels { long_max_len: Some(32), group_tokens: Some(32) };
        let out = check(&lengths, &opts, &levels);
        assert_eq!(out.buckets[1].num_sequences, 3);
        assert_eq!(out.plan.stats.split_sequences, 1);
        assert_eq!(out.plan.stats.empty_sequences, 1);
    }

    #[test]
    fn overlong_error_names_the_input_index() {
        let mut opts = PackOptions::new(8);
        opts.overlong = Overlong::Error;
        let levels = Levels { long_max_len: Some(16), group_tokens: None };
        let err = pack_two_level(&[1u32, 9, 2, 17, 3], &opts, &levels).unwrap_err();
        assert!(
            matches!(err, Error::Overlong { first_index: 3, first_length: 17, cap: 16, .. }),
            "{err}"
        );
    }

    #[test]
    fn bad_levels_name_the_argument() {
        let opts = PackOptions::new(8);
        for (levels, arg) in [
            (Levels { long_max_len: Some(8), group_tokens: None }, "long_max_len"),
            (Levels { long_max_len: None, group_tokens: Some(7) }, "group_tokens"),
            (Levels { long_max_len: Some(16), group_tokens: Some(15) }, "group_tokens"),
            (Levels { long_max_len: None, group_tokens: Some(1 << 31) }, "group_tokens"),
        ] {
            match pack_two_level(&[1u32], &opts, &levels) {
                Err(Error::InvalidArgument { arg: got, .. }) => assert_eq!(got, arg),
                other => panic!("{levels:?}: {other:?}"),
            }
        }
        let mut wrapped = PackOptions::new(8);
        wrapped.strategy = Strategy::Wrapped;
        let levels = Levels { long_max_len: Some(16), group_tokens: None };
        assert!(pack_two_level(&[1u32], &wrapped, &levels).is_err());
    }

    #[test]
    fn gather_narrows_only_when_values_fit() {
        let (old, new, order) = ([0i64, 2, 3], [0i64, 1, 3], [1u32, 0]);
        assert_eq!(gather_i64(vec![1, 2, 3], &old, &new, &order), vec![3, 1, 2]);
        assert_eq!(gather_i64(vec![1 << 40, 5, 7], &old, &new, &order), vec![7, 1 << 40, 5]);
    }

    #[test]
    fn huge_budget_gives_one_group() {
        let lengths: Vec<u32> = (1..2000).map(|i| (i * 7919) % 4096 + 1).collect();
        let levels = Levels { long_max_len: None, group_tokens: Some(GROUP_TOKENS_LIMIT) };
        let out = check(&lengths, &PackOptions::new(4096), &levels);
        assert_eq!(out.groups.unwrap().num_groups(), 1);
    }

    fn overlong() -> impl Strategy2<Value = Overlong> {
        prop_oneof![Just(Overlong::Truncate), Just(Overlong::Split), Just(Overlong::Drop)]
    }

    fn strategy() -> impl Strategy2<Value = Strategy> {
        prop_oneof![
            Just(Strategy::BestFitDecreasing),
            Just(Strategy::FirstFitDecreasing),
            Just(Strategy::NextFit)
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        #[test]
        fn invariants_hold(
            lengths in proptest::collection::vec(0u32..200, 0..300),
            max_len in 8u64..64,
            long_extra in 1u64..100,
            budget_extra in 0u64..300,
            reserve in 0u64..3,
            overlong in overlong(),
            strategy in strategy(),
            use_long in any::<bool>(),
            use_groups in any::<bool>(),
            seed in proptest::option::of(any::<u64>()),
            shard_items in 1usize..64,
        ) {
            let mut opts = PackOptions::new(max_len);
            opts.overlong = overlong;
            opts.strategy = strategy;
            opts.reserve = reserve;
            opts.shuffle_seed = seed;
            opts.shard_items = shard_items;
            let long = use_long.then_some(max_len + long_extra);
            let cap = long.unwrap_or(max_len);
            let levels = Levels { long_max_len: long, group_tokens: use_groups.then_some(cap + budget_extra) };
            let one = crate::pool::install(Some(1), || check(&lengths, &opts, &levels)).unwrap();
            let two = crate::pool::install(Some(2), || pack_two_level(&lengths, &opts, &levels).unwrap()).unwrap();
            prop_assert_eq!(&one, &two);
            // Grouping and shuffling only reorder level 1: the same packs, as multisets.
            let plain = pack_two_level(&lengths, &PackOptions { shuffle_seed: None, ..opts.clone() },
                &Levels { group_tokens: None, ..levels }).unwrap();
            prop_assert_eq!(plain.plan.num_packs(), one.plan.num_packs());
            prop_assert_eq!(&plain.buckets, &one.buckets);
            let mut a: Vec<i64> = plain.plan.sample_ids.clone();
            let mut b: Vec<i64> = one.plan.sample_ids.clone();
            a.sort_unstable();
            b.sort_unstable();
            prop_assert_eq!(a, b);
        }
    }
}
