//! What two-level packing returns: buckets and groups, with their metrics (see
//! [`crate::pack_two_level`] for how they are made).
//!
//! **Buckets** (seed 002 §4.1): sequences with `len + reserve <= max_len` go into packs of
//! `max_len`; longer ones, with the over-long policy applied against `long_max_len`, into
//! packs of `long_max_len`, so no pack mixes the two.
//!
//! **Groups**: level 2 bin-packs each bucket's packs by their fills into groups of at most
//! `group_tokens` tokens; the packs are laid out so each group's packs are contiguous, and
//! `group_offsets` is the CSR one level up. Groups never mix buckets.
//!
//! Every metric (bounds, efficiencies, fills) is defined here, once: [`bucket_metrics`]
//! makes them from each bucket's totals; [`TwoLevelPlan`] reports them for the plans the
//! core makes, [`metrics`] computes the same ones from the arrays of a plan assembled
//! elsewhere (a step's sub-plan, shards joined, a stream's window restored), and the
//! report of plan shards that are never in one place (Ray's planners) merges the
//! buckets' totals and calls [`bucket_metrics`]: the Python layer computes none itself.

use crate::error::{Error, Result};
use crate::plan::{PackOptions, Plan, Strategy, MAX_LEN_LIMIT};

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
    pub(crate) fn validate(&self, opts: &PackOptions) -> Result<()> {
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

/// Level 2: groups of packs, in CSR form over the (laid out) packs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Groups {
    /// Group `g` holds packs `group_offsets[g] .. group_offsets[g + 1]`.
    pub group_offsets: Vec<i64>,
    /// Tokens in each group (its fill).
    pub group_fills: Vec<i64>,
    /// The budget every group stays within (the `group_tokens` option).
    pub group_tokens: u64,
}

impl Groups {
    pub fn num_groups(&self) -> usize {
        self.group_fills.len()
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
    /// How the plan uses each budget besides tokens (empty without `limits`).
    pub limits: Vec<crate::LimitUse>,
}

impl TwoLevelPlan {
    /// Sum of the buckets' lower bounds: packs never mix buckets.
    pub fn lower_bound(&self) -> u64 {
        lower_bound(&self.buckets)
    }

    /// Tokens over the summed capacity of all packs, each at its own cap.
    pub fn efficiency(&self) -> f64 {
        efficiency(self.plan.stats.total_tokens, &self.buckets)
    }

    /// Tokens over `num_groups * group_tokens`, if grouped; 1.0 for no group.
    pub fn group_efficiency(&self) -> Option<f64> {
        let groups = self.groups.as_ref()?;
        Some(group_efficiency(
            self.plan.stats.total_tokens,
            groups.num_groups(),
            groups.group_tokens,
        ))
    }

    /// Fewest groups possible, if grouped: per bucket `ceil(total_tokens / group_tokens)`,
    /// summed (groups never mix buckets).
    pub fn group_lower_bound(&self) -> Option<u64> {
        Some(group_lower_bound(&self.buckets, self.groups.as_ref()?.group_tokens))
    }

    /// Every metric of the plan.
    pub fn metrics(&self) -> Metrics {
        let groups = self.groups.as_ref().map(|g| (g.num_groups() as u64, g.group_tokens));
        Metrics {
            group_fills: self.groups.as_ref().map(|g| g.group_fills.clone()),
            ..bucket_metrics(self.buckets.clone(), groups)
        }
    }
}

/// Every metric but the group fills, from each bucket's totals and, if grouped,
/// `(num_groups, group_tokens)`: the one definition the others call. Every token is in a
/// bucket, so `total_tokens` is their sum.
pub fn bucket_metrics(buckets: Vec<Bucket>, groups: Option<(u64, u64)>) -> Metrics {
    let total_tokens = buckets.iter().map(|b| b.total_tokens).sum();
    Metrics {
        total_tokens,
        lower_bound: lower_bound(&buckets),
        efficiency: efficiency(total_tokens, &buckets),
        group_fills: None,
        group_lower_bound: groups.map(|(_, budget)| group_lower_bound(&buckets, budget)),
        group_efficiency: groups
            .map(|(count, budget)| group_efficiency(total_tokens, count as usize, budget)),
        buckets,
    }
}

fn lower_bound(buckets: &[Bucket]) -> u64 {
    buckets.iter().map(Bucket::lower_bound).sum()
}

fn efficiency(total_tokens: u64, buckets: &[Bucket]) -> f64 {
    let capacity: u64 = buckets.iter().map(|b| b.num_packs * b.max_len).sum();
    if capacity == 0 {
        return 1.0;
    }
    total_tokens as f64 / capacity as f64
}

fn group_efficiency(total_tokens: u64, num_groups: usize, group_tokens: u64) -> f64 {
    if num_groups == 0 {
        return 1.0;
    }
    total_tokens as f64 / (num_groups as f64 * group_tokens as f64)
}

fn group_lower_bound(buckets: &[Bucket], group_tokens: u64) -> u64 {
    buckets.iter().map(|b| b.total_tokens.div_ceil(group_tokens)).sum()
}

/// Every metric of a plan (see [`TwoLevelPlan`]'s methods for their definitions).
#[derive(Debug, Clone, PartialEq)]
pub struct Metrics {
    /// `sum(seqlens)`.
    pub total_tokens: u64,
    pub lower_bound: u64,
    pub efficiency: f64,
    /// The short bucket, then the long one if the plan has `long_max_len`.
    pub buckets: Vec<Bucket>,
    /// Tokens in each group, if grouped.
    pub group_fills: Option<Vec<i64>>,
    pub group_lower_bound: Option<u64>,
    pub group_efficiency: Option<f64>,
}

/// The arrays and caps of a plan, whoever assembled it: what [`metrics`] reads.
#[derive(Debug, Clone, Copy)]
pub struct PlanArrays<'a> {
    pub seqlens: &'a [i32],
    pub pack_offsets: &'a [i64],
    pub max_len: u64,
    /// Each pack's cap; `None`: every pack's is `max_len`.
    pub pack_caps: Option<&'a [i32]>,
    pub long_max_len: Option<u64>,
    pub group_offsets: Option<&'a [i64]>,
    pub group_tokens: Option<u64>,
    /// Each bucket's non-empty input sequences (short, then long): a count of the input,
    /// which the arrays cannot give (a dropped sequence has no segment).
    pub bucket_sequences: &'a [u64],
}

/// `offsets` as a CSR over `items`: starts at 0, never decreases, ends at `items`.
/// The error names `arg` and the first bad index.
pub(crate) fn check_offsets(
    arg: &'static str,
    offsets: &[i64],
    items: usize,
    what: &str,
) -> Result<()> {
    let Some(&first) = offsets.first() else {
        return Err(Error::invalid(arg, "is empty; expected at least one entry (0)"));
    };
    if first != 0 {
        return Err(Error::invalid(arg, format!("starts at {first}; expected 0")));
    }
    if let Some(i) = offsets.windows(2).position(|w| w[1] < w[0]) {
        return Err(Error::invalid(
            arg,
            format!(
                "decreases at index {}: {} then {}; expected non-decreasing offsets",
                i + 1,
                offsets[i],
                offsets[i + 1]
            ),
        ));
    }
    let last = offsets[offsets.len() - 1];
    if last != items as i64 {
        return Err(Error::invalid(
            arg,
            format!(
                "ends at {last} (index {}); expected the number of {what}, {items}",
                offsets.len() - 1
            ),
        ));
    }
    Ok(())
}

/// Every metric of the plan `arrays` describe, after checking that they describe one: the
/// same definitions as the plans the core makes report.
pub fn metrics(arrays: &PlanArrays<'_>) -> Result<Metrics> {
    let &PlanArrays { seqlens, pack_offsets, max_len, pack_caps, long_max_len, .. } = arrays;
    if max_len == 0 {
        return Err(Error::invalid("max_len", "got 0; expected at least 1"));
    }
    if let Some(long) = long_max_len.filter(|&long| long <= max_len) {
        return Err(Error::invalid(
            "long_max_len",
            format!("got {long}; expected more than max_len ({max_len})"),
        ));
    }
    if let Some(i) = seqlens.iter().position(|&n| n < 0) {
        return Err(Error::invalid(
            "seqlens",
            format!("negative length {} at index {i}", seqlens[i]),
        ));
    }
    check_offsets("pack_offsets", pack_offsets, seqlens.len(), "segments")?;
    let num_packs = pack_offsets.len() - 1;
    let mut caps = vec![max_len];
    caps.extend(long_max_len);
    let mut bucket_of = vec![0u8; num_packs];
    if let Some(pack_caps) = pack_caps {
        if pack_caps.len() != num_packs {
            return Err(Error::invalid(
                "pack_caps",
                format!("has {} entries for {num_packs} packs", pack_caps.len()),
            ));
        }
        for (p, &cap) in pack_caps.iter().enumerate() {
            match caps.iter().position(|&c| c == cap as u64) {
                Some(b) => bucket_of[p] = b as u8,
                None => {
                    return Err(Error::invalid(
                        "pack_caps",
                        format!(
                            "pack {p} has cap {cap}; expected max_len ({max_len}){}",
                            long_max_len
                                .map_or(String::new(), |l| format!(" or long_max_len ({l})"))
                        ),
                    ))
                }
            }
        }
    }
    if arrays.bucket_sequences.len() != caps.len() {
        return Err(Error::invalid(
            "buckets",
            format!(
                "got the sequence counts of {} bucket(s); the plan has {}",
                arrays.bucket_sequences.len(),
                caps.len()
            ),
        ));
    }
    let mut fills = Vec::with_capacity(num_packs);
    let mut buckets: Vec<Bucket> = caps
        .iter()
        .zip(arrays.bucket_sequences)
        .map(|(&max_len, &num_sequences)| Bucket {
            max_len,
            num_sequences,
            num_packs: 0,
            total_tokens: 0,
        })
        .collect();
    for (p, w) in pack_offsets.windows(2).enumerate() {
        let fill: u64 = seqlens[w[0] as usize..w[1] as usize].iter().map(|&n| n as u64).sum();
        let bucket = &mut buckets[bucket_of[p] as usize];
        bucket.num_packs += 1;
        bucket.total_tokens += fill;
        fills.push(fill as i64);
    }
    let group_fills: Option<Vec<i64>> = match (arrays.group_offsets, arrays.group_tokens) {
        (None, None) => None,
        (_, Some(0)) => return Err(Error::invalid("group_tokens", "got 0; expected at least 1")),
        (Some(offsets), Some(_)) => {
            check_offsets("group_offsets", offsets, num_packs, "packs")?;
            Some(
                offsets
                    .windows(2)
                    .map(|w| fills[w[0] as usize..w[1] as usize].iter().sum())
                    .collect(),
            )
        }
        (Some(_), None) => {
            return Err(Error::invalid("group_tokens", "missing: the plan has group_offsets"))
        }
        (None, Some(_)) => {
            return Err(Error::invalid("group_offsets", "missing: the plan has group_tokens"))
        }
    };
    let groups = arrays.group_tokens.zip(group_fills.as_ref()).map(|(b, f)| (f.len() as u64, b));
    Ok(Metrics { group_fills, ..bucket_metrics(buckets, groups) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Overlong, Strategy};
    use crate::{pack_two_level, proptest_cases};
    use proptest::prelude::*;
    use proptest::strategy::Strategy as Strategy2;

    /// Every invariant of a plan with buckets and groups, checked against the input.
    fn check(lengths: &[u32], opts: &PackOptions, levels: &Levels) -> TwoLevelPlan {
        let out = pack_two_level(lengths, opts, levels).unwrap();
        let plan = &out.plan;
        let p = plan.num_packs();
        let long = levels.long_max_len;
        let caps: Vec<u64> = match &out.pack_caps {
            Some(c) => c.iter().map(|&c| c as u64).collect(),
            None => vec![opts.max_len; p],
        };
        assert_eq!(caps.len(), p);
        assert_eq!(out.pack_caps.is_some(), long.is_some());
        let fills = plan.pack_fills();
        // Each bucket's packs stay within its cap; long and short never share a pack.
        for (pack, (&fill, &cap)) in fills.iter().zip(&caps).enumerate() {
            assert!(fill as u64 <= cap && fill > 0);
            let segments = plan.pack_offsets[pack] as usize..plan.pack_offsets[pack + 1] as usize;
            for s in segments {
                let len = lengths[plan.sample_ids[s] as usize] as u64 + opts.reserve;
                assert_eq!(long.is_some() && len > opts.max_len, cap != opts.max_len);
            }
        }
        // Each sequence's segments tile exactly what its bucket's policy keeps.
        let mut pieces: Vec<Vec<(i64, i64)>> = vec![Vec::new(); lengths.len()];
        for k in 0..plan.num_segments() {
            pieces[plan.sample_ids[k] as usize].push((plan.starts[k], plan.seqlens[k] as i64));
        }
        for (i, &len) in lengths.iter().enumerate() {
            let extended = len as u64 + opts.reserve;
            let cap = match long {
                Some(l) if extended > opts.max_len => l,
                _ => opts.max_len,
            };
            let kept = match (len, opts.overlong) {
                (0, _) => 0,
                _ if extended <= cap => extended,
                (_, Overlong::Truncate) => cap,
                (_, Overlong::Split) => extended,
                _ => 0,
            };
            let mut mine = std::mem::take(&mut pieces[i]);
            mine.sort_unstable();
            let mut at = 0;
            for (start, n) in mine {
                assert_eq!(start, at, "segments of sequence {i} tile it");
                assert!(n as u64 <= cap);
                at += n;
            }
            assert_eq!(at as u64, kept, "sequence {i} (length {len}, cap {cap})");
        }
        // Every token accounted for.
        let input: u64 =
            lengths.iter().map(|&l| l as u64 + if l > 0 { opts.reserve } else { 0 }).sum();
        let s = &plan.stats;
        assert_eq!(s.num_sequences, lengths.len() as u64);
        let reserve_of_dropped = s.dropped_sequences * opts.reserve;
        assert_eq!(
            s.total_tokens + s.dropped_tokens + reserve_of_dropped + s.truncated_tokens,
            input,
            "{s:?}"
        );
        let kept: u64 = plan.seqlens.iter().map(|&n| n as u64).sum();
        assert_eq!(kept, s.total_tokens);
        // Bucket metrics, recomputed from the packs themselves.
        assert_eq!(out.buckets.len(), 1 + long.is_some() as usize);
        for (b, bucket) in out.buckets.iter().enumerate() {
            let cap = if b == 0 { opts.max_len } else { long.unwrap() };
            let mine: Vec<usize> = (0..p).filter(|&q| caps[q] == cap).collect();
            let tokens: i64 = mine.iter().map(|&q| fills[q]).sum();
            assert_eq!(bucket.max_len, cap);
            assert_eq!(bucket.num_packs, mine.len() as u64);
            assert_eq!(bucket.total_tokens, tokens as u64);
            let here = |l: u64| long.is_none() || (l + opts.reserve > opts.max_len) == (b == 1);
            let expected = lengths.iter().filter(|&&l| l > 0 && here(l as u64)).count();
            assert_eq!(bucket.num_sequences, expected as u64);
            assert_eq!(bucket.lower_bound(), (tokens as u64).div_ceil(cap));
        }
        let capacity: u64 = caps.iter().sum();
        let efficiency = if capacity == 0 { 1.0 } else { kept as f64 / capacity as f64 };
        assert!((out.efficiency() - efficiency).abs() < 1e-12);
        assert!(p as u64 >= out.lower_bound());
        match &out.groups {
            None => {
                assert!(levels.group_tokens.is_none());
                assert_eq!(out.group_efficiency(), None);
                assert_eq!(out.group_lower_bound(), None);
            }
            Some(g) => {
                assert_eq!(Some(g.group_tokens), levels.group_tokens);
                assert_eq!(g.group_offsets[0], 0);
                assert_eq!(*g.group_offsets.last().unwrap(), p as i64);
                assert!(g.group_offsets.windows(2).all(|w| w[0] < w[1]));
                for (i, w) in g.group_offsets.windows(2).enumerate() {
                    let tokens: i64 = fills[w[0] as usize..w[1] as usize].iter().sum();
                    assert_eq!(tokens, g.group_fills[i]);
                    assert!(tokens as u64 <= g.group_tokens);
                    let caps = &caps[w[0] as usize..w[1] as usize];
                    assert!(caps.iter().all(|&c| c == caps[0]), "group {i} mixes buckets");
                }
                let bound: u64 =
                    out.buckets.iter().map(|b| b.total_tokens.div_ceil(g.group_tokens)).sum();
                assert_eq!(out.group_lower_bound(), Some(bound));
                assert!(g.num_groups() as u64 >= bound);
                let capacity = g.num_groups() as f64 * g.group_tokens as f64;
                let expected = if g.num_groups() == 0 { 1.0 } else { kept as f64 / capacity };
                assert!((out.group_efficiency().unwrap() - expected).abs() < 1e-12);
            }
        }
        // The metrics computed from the arrays alone (as for a plan assembled in Python)
        // are the plan's own.
        let sequences: Vec<u64> = out.buckets.iter().map(|b| b.num_sequences).collect();
        let arrays = PlanArrays {
            seqlens: &plan.seqlens,
            pack_offsets: &plan.pack_offsets,
            max_len: opts.max_len,
            pack_caps: out.pack_caps.as_deref(),
            long_max_len: levels.long_max_len,
            group_offsets: out.groups.as_ref().map(|g| &g.group_offsets[..]),
            group_tokens: out.groups.as_ref().map(|g| g.group_tokens),
            bucket_sequences: &sequences,
        };
        assert_eq!(metrics(&arrays).unwrap(), out.metrics());
        out
    }

    #[test]
    fn metrics_refuse_arrays_that_are_no_plan() {
        let (seqlens, offsets) = ([3, 2, 5, 1], [0i64, 2, 3, 4]);
        let arrays = PlanArrays {
            seqlens: &seqlens,
            pack_offsets: &offsets,
            max_len: 8,
            pack_caps: None,
            long_max_len: None,
            group_offsets: None,
            group_tokens: None,
            bucket_sequences: &[4],
        };
        let m = metrics(&arrays).unwrap();
        assert_eq!((m.total_tokens, m.lower_bound, m.buckets[0].num_packs), (11, 2, 3));
        let message = |a: &PlanArrays<'_>| metrics(a).unwrap_err().to_string();
        let bad = [0i64, 3, 2, 4];
        assert_eq!(
            message(&PlanArrays { pack_offsets: &bad, ..arrays }),
            "pack_offsets: decreases at index 2: 3 then 2; expected non-decreasing offsets"
        );
        let short = [0i64, 2, 3];
        assert!(message(&PlanArrays { pack_offsets: &short, ..arrays })
            .starts_with("pack_offsets: ends at 3"));
        let caps = [8, 16, 8];
        assert!(message(&PlanArrays { pack_caps: Some(&caps), ..arrays })
            .starts_with("pack_caps: pack 1 has cap 16"));
        let groups = [0i64, 2];
        let grouped = PlanArrays { group_offsets: Some(&groups), group_tokens: Some(16), ..arrays };
        assert!(message(&grouped).starts_with("group_offsets: ends at 2"));
        assert!(message(&PlanArrays { bucket_sequences: &[], ..arrays }).starts_with("buckets:"));
    }

    /// The packs as a multiset of sorted segment lists.
    fn packs(plan: &Plan) -> Vec<Vec<(i64, i64, i32)>> {
        let mut v: Vec<Vec<(i64, i64, i32)>> = plan
            .pack_offsets
            .windows(2)
            .map(|w| {
                let mut pack: Vec<_> = (w[0] as usize..w[1] as usize)
                    .map(|k| (plan.sample_ids[k], plan.starts[k], plan.seqlens[k]))
                    .collect();
                pack.sort_unstable();
                pack
            })
            .collect();
        v.sort();
        v
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
        let err = pack_two_level(&[1i64, 9, 2, -17, 3], &opts, &levels).unwrap_err();
        assert!(err.to_string().contains("negative length -17 at index 3"), "{err}");
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
    fn huge_budget_gives_one_group() {
        let lengths: Vec<u32> = (1..2000).map(|i| (i * 7919) % 4096 + 1).collect();
        let levels = Levels { long_max_len: None, group_tokens: Some(GROUP_TOKENS_LIMIT) };
        let out = check(&lengths, &PackOptions::new(4096), &levels);
        assert_eq!(out.groups.unwrap().num_groups(), 1);
    }

    #[test]
    fn groups_are_contiguous_and_balanced_at_scale() {
        // Many packs, both buckets, every strategy: crosses chunk and shard boundaries.
        let lengths: Vec<u32> =
            (0..300_000u64).map(|i| ((i * 2654435761) % 700 + 1) as u32).collect();
        for strategy in [Strategy::BestFitDecreasing, Strategy::NextFit] {
            let mut opts = PackOptions::new(512);
            opts.strategy = strategy;
            opts.overlong = Overlong::Split;
            opts.shuffle_seed = Some(3);
            let levels = Levels { long_max_len: Some(1024), group_tokens: Some(8192) };
            let one = crate::pool::install(Some(1), || check(&lengths, &opts, &levels)).unwrap();
            let three =
                crate::pool::install(Some(3), || pack_two_level(&lengths, &opts, &levels)).unwrap();
            assert_eq!(one, three.unwrap());
        }
    }

    fn overlong() -> impl Strategy2<Value = Overlong> {
        prop_oneof![Just(Overlong::Truncate), Just(Overlong::Split), Just(Overlong::Drop)]
    }

    fn strategy() -> impl Strategy2<Value = Strategy> {
        prop_oneof![
            Just(Strategy::BestFitDecreasing),
            Just(Strategy::FirstFitDecreasing),
            Just(Strategy::NextFit),
            Just(Strategy::OnePerPack)
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(proptest_cases(300)))]
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
            // Grouping and shuffling only lay level 1 out differently: the same packs.
            let plain = pack_two_level(&lengths, &PackOptions { shuffle_seed: None, ..opts.clone() },
                &Levels { group_tokens: None, ..levels }).unwrap();
            prop_assert_eq!(&plain.buckets, &one.buckets);
            prop_assert_eq!(packs(&plain.plan), packs(&one.plan));
        }
    }
}
