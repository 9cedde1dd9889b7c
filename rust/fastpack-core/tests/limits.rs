//! Property tests of packing under several budgets (tokens plus patches, images, ...).

use fastpack_core::{
    pack_limited, pack_two_level, pool, Error, Levels, Limit, Overlong, PackOptions, Strategy,
    TwoLevelPlan,
};
use proptest::prelude::*;
use proptest::strategy::Strategy as PropStrategy;

fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Items: (tokens, [need per budget]); budgets' caps.
#[derive(Debug, Clone)]
struct Case {
    lengths: Vec<u32>,
    values: Vec<Vec<i64>>,
    caps: Vec<u64>,
    max_len: u64,
}

impl Case {
    fn limits(&self) -> Vec<Limit<'_>> {
        const NAMES: [&str; 4] = ["patches", "images", "frames", "audio"];
        self.values
            .iter()
            .zip(&self.caps)
            .enumerate()
            .map(|(d, (values, &cap))| Limit { name: NAMES[d], values, cap })
            .collect()
    }
}

fn case() -> impl PropStrategy<Value = Case> {
    (1u64..120, 1usize..=3).prop_flat_map(|(max_len, budgets)| {
        let n = 0usize..250;
        let caps = prop::collection::vec(1u64..40, budgets);
        (n, caps, Just(max_len)).prop_flat_map(move |(n, caps, max_len)| {
            let lengths = prop::collection::vec(0u32..(max_len as u32 + 2), n);
            // Values mostly under their cap, sometimes over it, often 0 (text-only items).
            let values: Vec<_> = caps
                .iter()
                .map(|&cap| {
                    prop::collection::vec(
                        prop_oneof![3 => Just(0i64), 6 => 0i64..=cap as i64, 1 => 0i64..(2 * cap as i64 + 2)],
                        n,
                    )
                })
                .collect();
            (lengths, values, Just(caps), Just(max_len))
                .prop_map(|(lengths, values, caps, max_len)| Case { lengths, values, caps, max_len })
        })
    })
}

fn opts(max_len: u64, strategy: Strategy, overlong: Overlong) -> PackOptions {
    let mut o = PackOptions::new(max_len);
    o.strategy = strategy;
    o.overlong = overlong;
    o
}

/// Every pack within every budget, every kept item in exactly one pack, every dropped one
/// counted, the budgets' uses reported as they are.
fn check(case: &Case, out: &TwoLevelPlan) {
    let plan = &out.plan;
    let over = |i: usize| {
        case.values.iter().zip(&case.caps).any(|(v, &cap)| v[i] as u64 > cap)
            || case.lengths[i] as u64 > case.max_len
    };
    let mut seen = vec![0u32; case.lengths.len()];
    for w in plan.pack_offsets.windows(2) {
        let segs = w[0] as usize..w[1] as usize;
        let tokens: u64 = plan.seqlens[segs.clone()].iter().map(|&n| n as u64).sum();
        assert!(tokens <= case.max_len, "a pack over max_len");
        for (values, &cap) in case.values.iter().zip(&case.caps) {
            let used: u64 =
                plan.sample_ids[segs.clone()].iter().map(|&s| values[s as usize] as u64).sum();
            assert!(used <= cap, "a pack over a budget: {used} > {cap}");
        }
        for k in segs {
            let s = plan.sample_ids[k] as usize;
            assert_eq!(plan.seqlens[k] as u32, case.lengths[s], "an item is never cut");
            seen[s] += 1;
        }
    }
    let (mut dropped, mut dropped_tokens) = (0u64, 0u64);
    for (i, &len) in case.lengths.iter().enumerate() {
        if len == 0 {
            assert_eq!(seen[i], 0);
        } else if over(i) {
            assert_eq!(seen[i], 0, "item {i} is over a budget and dropped");
            dropped += 1;
            dropped_tokens += len as u64;
        } else {
            assert_eq!(seen[i], 1, "item {i} is in exactly one pack");
        }
    }
    assert_eq!(plan.stats.dropped_sequences, dropped);
    assert_eq!(plan.stats.dropped_tokens, dropped_tokens);
    for (d, used) in out.limits.iter().enumerate() {
        let total: u64 = (0..case.lengths.len())
            .filter(|&i| seen[i] == 1)
            .map(|i| case.values[d][i] as u64)
            .sum();
        assert_eq!(used.total, total);
        assert_eq!(used.lower_bound, total.div_ceil(case.caps[d]));
        assert!(plan.num_packs() as u64 >= used.lower_bound);
    }
}

/// Replays the plan item by item in the placement's order (tokens descending, input order
/// within a length) and checks the rule at every item. Items of one length go in runs: an
/// item follows the item before it (same length) into its pack while that pack has room
/// for it in tokens and in every budget (exact needs). An item that starts a run goes to a
/// new pack only when no open pack has room for it in every budget; otherwise best fit
/// puts it in a pack of the least token room among those that have room (ties: any),
/// first fit in the earliest opened one.
fn check_rule(case: &Case, out: &TwoLevelPlan, best: bool) {
    let plan = &out.plan;
    let mut pack_of = vec![usize::MAX; case.lengths.len()];
    for (q, w) in plan.pack_offsets.windows(2).enumerate() {
        for k in w[0] as usize..w[1] as usize {
            pack_of[plan.sample_ids[k] as usize] = q;
        }
    }
    let mut items: Vec<usize> =
        (0..case.lengths.len()).filter(|&i| pack_of[i] != usize::MAX).collect();
    items.sort_by_key(|&i| (std::cmp::Reverse(case.lengths[i]), i));
    // Per plan pack: (opened at, token room, budget rooms), once opened.
    let mut open: Vec<Option<(usize, u64, Vec<u64>)>> = vec![None; plan.num_packs()];
    let mut opened = 0;
    // The item before, in placement order: (its length, its pack).
    let mut before: Option<(u32, usize)> = None;
    for &i in &items {
        let len = case.lengths[i] as u64;
        let fits = |p: &(usize, u64, Vec<u64>)| {
            p.1 >= len && case.values.iter().zip(&p.2).all(|(v, &room)| v[i] as u64 <= room)
        };
        let q = pack_of[i];
        let follows = match before {
            Some((l, p)) if l == case.lengths[i] => open[p].as_ref().filter(|o| fits(o)).map(|_| p),
            _ => None,
        };
        if let Some(p) = follows {
            assert_eq!(q, p, "item {i}: its run's pack had room, yet it went elsewhere");
        } else {
            let feasible: Vec<(usize, u64)> =
                open.iter().flatten().filter(|p| fits(p)).map(|p| (p.0, p.1)).collect();
            match &open[q] {
                None => {
                    assert!(
                        feasible.is_empty(),
                        "item {i} opened a pack while {feasible:?} had room"
                    );
                    open[q] = Some((opened, case.max_len, case.caps.clone()));
                    opened += 1;
                }
                Some(p) => {
                    assert!(fits(p), "item {i} went to a pack without room");
                    if best {
                        let least = feasible.iter().map(|f| f.1).min().unwrap();
                        assert_eq!(p.1, least, "item {i}: not the least token room");
                    } else {
                        let first = feasible.iter().map(|f| f.0).min().unwrap();
                        assert_eq!(p.0, first, "item {i}: not the first pack with room");
                    }
                }
            }
        }
        let p = open[q].as_mut().unwrap();
        p.1 -= len;
        for (room, v) in p.2.iter_mut().zip(&case.values) {
            *room -= v[i] as u64;
        }
        before = Some((case.lengths[i], q));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(300), ..ProptestConfig::default() })]

    #[test]
    fn no_pack_over_any_budget_and_every_item_once(case in case(), seed in any::<u64>()) {
        let levels = Levels { long_max_len: None, group_tokens: Some(case.max_len * 3) };
        for strategy in [Strategy::BestFitDecreasing, Strategy::FirstFitDecreasing] {
            let mut o = opts(case.max_len, strategy, Overlong::Drop);
            o.shuffle_seed = Some(seed);
            let out = pack_limited(&case.lengths, &o, &levels, &case.limits()).unwrap();
            check(&case, &out);
        }
    }

    #[test]
    fn each_item_goes_where_the_rule_puts_it(case in case()) {
        for (strategy, best) in [(Strategy::BestFitDecreasing, true), (Strategy::FirstFitDecreasing, false)] {
            let o = opts(case.max_len, strategy, Overlong::Drop);
            let out = pack_limited(&case.lengths, &o, &Levels::default(), &case.limits()).unwrap();
            check_rule(&case, &out, best);
        }
    }

    #[test]
    fn the_rule_holds_under_tight_budgets(
        lengths in prop::collection::vec(1u32..12, 0..300),
        caps in prop::collection::vec(1u64..5, 1..=2),
        seed in any::<u64>(),
    ) {
        // Small caps and few distinct needs: packs run out of a budget long before their
        // tokens, so the budget index's maxima go stale and mislead searches often.
        let mut x = seed | 1;
        let values: Vec<Vec<i64>> = caps
            .iter()
            .map(|&cap| {
                lengths
                    .iter()
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        (x % (cap + 1)) as i64
                    })
                    .collect()
            })
            .collect();
        let case = Case { lengths, values, caps, max_len: 12 };
        for (strategy, best) in [(Strategy::BestFitDecreasing, true), (Strategy::FirstFitDecreasing, false)] {
            let o = opts(case.max_len, strategy, Overlong::Drop);
            let out = pack_limited(&case.lengths, &o, &Levels::default(), &case.limits()).unwrap();
            check(&case, &out);
            check_rule(&case, &out, best);
        }
    }

    #[test]
    fn budgets_that_never_bind_give_the_one_budget_packing(case in case(), seed in any::<u64>()) {
        // Packs of equal room are interchangeable for every later item, so best fit
        // fills the same packs whichever of them a tie goes to; first fit has no ties.
        let zeros: Vec<Vec<i64>> = case.values.iter().map(|v| vec![0; v.len()]).collect();
        let free = Case { values: zeros, ..case.clone() };
        let fills = |out: &TwoLevelPlan| {
            let mut f = out.plan.pack_fills();
            f.sort_unstable();
            f
        };
        for strategy in [Strategy::BestFitDecreasing, Strategy::FirstFitDecreasing] {
            let mut o = opts(case.max_len, strategy, Overlong::Drop);
            o.shuffle_seed = Some(seed);
            let levels = Levels::default();
            let one = pack_two_level(&case.lengths, &o, &levels).unwrap();
            let limited = pack_limited(&case.lengths, &o, &levels, &free.limits()).unwrap();
            prop_assert_eq!(fills(&one), fills(&limited));
            if strategy == Strategy::FirstFitDecreasing {
                prop_assert_eq!(&one.plan, &limited.plan);
            }
        }
    }

    #[test]
    fn the_plan_is_the_same_on_any_thread_count(
        case in case(),
        shard_items in 1usize..80,
        long in any::<bool>(),
    ) {
        let levels = Levels { long_max_len: long.then_some(case.max_len * 2), group_tokens: None };
        let long_case = Case { max_len: case.max_len * if long { 2 } else { 1 }, ..case.clone() };
        for strategy in [Strategy::BestFitDecreasing, Strategy::FirstFitDecreasing] {
            let mut o = opts(case.max_len, strategy, Overlong::Drop);
            o.shard_items = shard_items;
            let limits = case.limits();
            let one = pool::install(Some(1), || pack_limited(&case.lengths, &o, &levels, &limits))
                .unwrap().unwrap();
            let four = pool::install(Some(4), || pack_limited(&case.lengths, &o, &levels, &limits))
                .unwrap().unwrap();
            prop_assert_eq!(&one, &four);
            check(&long_case, &one);
        }
    }
}

#[test]
fn an_item_over_a_budget_is_refused_naming_it() {
    let images = [0i64, 3, 1];
    let limits = [Limit { name: "images", values: &images, cap: 2 }];
    let o = opts(16, Strategy::BestFitDecreasing, Overlong::Error);
    let e = pack_limited(&[4u32, 4, 4], &o, &Levels::default(), &limits).unwrap_err();
    let text = e.to_string();
    assert!(text.starts_with("limits: 1 sequence(s) over the \"images\" budget"), "{text}");
    assert!(text.contains("first at index 1: 3 images over the cap of 2"), "{text}");
    let split = opts(16, Strategy::BestFitDecreasing, Overlong::Split);
    let e = pack_limited(&[4u32, 4, 4], &split, &Levels::default(), &limits).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { arg: "limits", .. }), "{e}");
    let next_fit = opts(16, Strategy::NextFit, Overlong::Drop);
    assert!(pack_limited(&[4u32, 4, 4], &next_fit, &Levels::default(), &limits).is_err());
}

#[test]
fn a_negative_value_is_refused_even_where_nothing_is_packed() {
    // The values are checked as the sort reads them; an empty item and one dropped for
    // its length are not sorted, yet a negative value there is still the caller's error.
    for lengths in [[0u32, 4, 4], [40, 4, 4]] {
        let images = [-1i64, 1, 1];
        let limits = [Limit { name: "images", values: &images, cap: 2 }];
        let o = opts(16, Strategy::BestFitDecreasing, Overlong::Drop);
        let e = pack_limited(&lengths, &o, &Levels::default(), &limits).unwrap_err();
        assert!(e.to_string().contains("negative value -1 at index 0"), "{e}");
    }
    // An item over a budget and over max_len: refused for the budget (checked first).
    let images = [3i64, 1, 1];
    let limits = [Limit { name: "images", values: &images, cap: 2 }];
    let o = opts(16, Strategy::BestFitDecreasing, Overlong::Error);
    let e = pack_limited(&[40u32, 4, 4], &o, &Levels::default(), &limits).unwrap_err();
    assert!(e.to_string().contains("over the \"images\" budget"), "{e}");
}

#[test]
fn caps_too_wide_to_share_a_word_keep_each_need_in_its_own() {
    // 32 + 23 bits of caps: the needs are held one word per budget, not packed in one.
    let mut x = 7u64;
    let mut next = |m: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % m
    };
    let n = 400;
    let lengths: Vec<u32> = (0..n).map(|_| 1 + next(40) as u32).collect();
    let caps = vec![3_000_000_000u64, 5_000_000];
    let values: Vec<Vec<i64>> =
        caps.iter().map(|&cap| (0..n).map(|_| next(cap / 3) as i64).collect()).collect();
    let case = Case { lengths, values, caps, max_len: 64 };
    for (strategy, best) in
        [(Strategy::BestFitDecreasing, true), (Strategy::FirstFitDecreasing, false)]
    {
        let o = opts(case.max_len, strategy, Overlong::Drop);
        let out = pack_limited(&case.lengths, &o, &Levels::default(), &case.limits()).unwrap();
        check(&case, &out);
        check_rule(&case, &out, best);
        assert!(out.limits[0].max_used > 2_000_000_000, "the wide budget binds");
    }
}
