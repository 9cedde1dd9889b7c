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
//! Every metric (bounds, efficiencies) is computed here, once; the Python layer reads them.

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

    /// Tokens over `num_groups * group_tokens`, if grouped; 1.0 for no group.
    pub fn group_efficiency(&self) -> Option<f64> {
        let groups = self.groups.as_ref()?;
        if groups.num_groups() == 0 {
            return Some(1.0);
        }
        let capacity = groups.num_groups() as f64 * groups.group_tokens as f64;
        Some(self.plan.stats.total_tokens as f64 / capacity)
    }

    /// Fewest groups possible, if grouped: per bucket `ceil(total_tokens / group_tokens)`,
    /// summed (groups never mix buckets).
    pub fn group_lower_bound(&self) -> Option<u64> {
        let budget = self.groups.as_ref()?.group_tokens;
        Some(self.buckets.iter().map(|b| b.total_tokens.div_ceil(budget)).sum())
    }
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
        out
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
            Just(Strategy::NextFit)
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
