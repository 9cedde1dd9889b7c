//! Property tests: every invariant of every strategy and over-long policy.

use std::sync::atomic::{AtomicUsize, Ordering};

use fastpack_core::{
    layout, pack, pack_two_level, pool, Error, Length, Levels, Overlong, PackOptions, Plan,
    Strategy,
};
use proptest::prelude::*;
use proptest::strategy::Strategy as PropStrategy;

/// `PROPTEST_CASES` when set (CI runs fewer in a debug build; a long run sets many).
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

const STRATEGIES: [Strategy; 5] = [
    Strategy::BestFitDecreasing,
    Strategy::FirstFitDecreasing,
    Strategy::NextFit,
    Strategy::Wrapped,
    Strategy::OnePerPack,
];
const POLICIES: [Overlong; 4] =
    [Overlong::Error, Overlong::Truncate, Overlong::Split, Overlong::Drop];

/// Tokens of the extended sequence (`len + reserve`) each sequence should contribute.
fn expected_kept(len: u64, opts: &PackOptions) -> Option<u64> {
    if len == 0 {
        return Some(0);
    }
    let e = len + opts.reserve;
    if e <= opts.max_len || opts.strategy == Strategy::Wrapped {
        return Some(e);
    }
    match opts.overlong {
        Overlong::Error => None,
        Overlong::Truncate => Some(opts.max_len),
        Overlong::Split => Some(e),
        Overlong::Drop => Some(0),
    }
}

fn check_plan(lengths: &[u32], opts: &PackOptions, plan: &Plan) {
    let s = plan.num_segments();
    assert_eq!(plan.pack_offsets[0], 0);
    assert_eq!(*plan.pack_offsets.last().unwrap() as usize, s);
    assert_eq!(plan.sample_ids.len(), s);
    assert_eq!(plan.starts.len(), s);
    for w in plan.pack_offsets.windows(2) {
        assert!(w[0] < w[1], "every pack holds at least one segment");
        let tokens: i64 =
            plan.seqlens[w[0] as usize..w[1] as usize].iter().map(|&n| n as i64).sum();
        assert!(tokens as u64 <= opts.max_len, "pack over max_len");
    }
    // Each sequence's segments tile exactly its kept extended tokens.
    let mut pieces: Vec<Vec<(i64, i64)>> = vec![Vec::new(); lengths.len()];
    for k in 0..s {
        assert!(plan.seqlens[k] > 0);
        pieces[plan.sample_ids[k] as usize].push((plan.starts[k], plan.seqlens[k] as i64));
    }
    let (mut dropped, mut truncated) = (0u64, 0u64);
    for (i, &len) in lengths.iter().enumerate() {
        let kept = expected_kept(len as u64, opts).expect("over-long sequences raise");
        let mut p = std::mem::take(&mut pieces[i]);
        p.sort_unstable();
        let mut at = 0i64;
        for (start, n) in p {
            assert_eq!(start, at, "segments of sequence {i} tile it");
            at += n;
        }
        assert_eq!(at as u64, kept, "sequence {i} keeps what its policy says");
        if len > 0 && kept == 0 {
            dropped += len as u64;
        }
        if len > 0 && kept > 0 && kept < len as u64 + opts.reserve {
            truncated += len as u64 + opts.reserve - kept;
        }
    }
    assert_eq!(plan.stats.dropped_tokens, dropped);
    assert_eq!(plan.stats.truncated_tokens, truncated);
    let total: u64 = plan.seqlens.iter().map(|&n| n as u64).sum();
    assert_eq!(plan.stats.total_tokens, total);
    assert!(plan.num_packs() as u64 >= plan.lower_bound());
}

/// A plain O(n * packs) best/first fit over the same decreasing order: the pack count is
/// determined by the order alone, whatever the tie-breaking among equal rooms.
fn reference_fit_packs(lengths: &[u32], max_len: u64, best: bool) -> usize {
    let mut items: Vec<u64> = lengths.iter().map(|&l| l as u64).filter(|&l| l > 0).collect();
    items.sort_unstable_by(|a, b| b.cmp(a));
    let mut rooms: Vec<u64> = Vec::new();
    for len in items {
        let choice = if best {
            rooms
                .iter()
                .enumerate()
                .filter(|(_, &r)| r >= len)
                .min_by_key(|(_, &r)| r)
                .map(|(i, _)| i)
        } else {
            rooms.iter().position(|&r| r >= len)
        };
        match choice {
            Some(i) => rooms[i] -= len,
            None => rooms.push(max_len - len),
        }
    }
    rooms.len()
}

fn opts(max_len: u64, strategy: Strategy, overlong: Overlong, reserve: u64) -> PackOptions {
    let mut o = PackOptions::new(max_len);
    o.strategy = strategy;
    o.overlong = overlong;
    o.reserve = reserve;
    o
}

fn lengths_strategy() -> impl PropStrategy<Value = (Vec<u32>, u64)> {
    (1u64..300).prop_flat_map(|max_len| {
        (prop::collection::vec(0u32..(max_len as u32 * 3 + 2), 0..400), Just(max_len))
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(200), ..ProptestConfig::default() })]

    #[test]
    fn every_strategy_and_policy_keeps_its_invariants(
        (lengths, max_len) in lengths_strategy(),
        reserve_frac in 0u64..3,
    ) {
        let reserve = (max_len - 1).min(reserve_frac);
        for strategy in STRATEGIES {
            for overlong in POLICIES {
                let o = opts(max_len, strategy, overlong, reserve);
                match pack(&lengths, &o) {
                    Ok(plan) => check_plan(&lengths, &o, &plan),
                    Err(Error::Overlong { count, first_index, .. }) => {
                        prop_assert_eq!(overlong, Overlong::Error);
                        let over: Vec<usize> = lengths.iter().enumerate()
                            .filter(|(_, &l)| l > 0 && l as u64 + reserve > max_len)
                            .map(|(i, _)| i).collect();
                        prop_assert_eq!(count as usize, over.len());
                        prop_assert_eq!(first_index as usize, over[0]);
                    }
                    Err(e) => prop_assert!(false, "unexpected error {e}"),
                }
            }
        }
    }

    #[test]
    fn fit_strategies_match_a_reference_packing(
        lengths in prop::collection::vec(0u32..=64, 0..300),
    ) {
        for (strategy, best) in [(Strategy::BestFitDecreasing, true), (Strategy::FirstFitDecreasing, false)] {
            let plan = pack(&lengths, &opts(64, strategy, Overlong::Error, 0)).unwrap();
            prop_assert_eq!(plan.num_packs(), reference_fit_packs(&lengths, 64, best));
        }
    }

    #[test]
    fn the_plan_is_the_same_on_any_thread_count_and_shard_size(
        (lengths, max_len) in lengths_strategy(),
        shard_items in 1usize..50,
        seed in any::<u64>(),
    ) {
        for strategy in STRATEGIES {
            let mut o = opts(max_len, strategy, Overlong::Split, 0);
            o.shuffle_seed = Some(seed);
            o.shard_items = shard_items;
            let one = pool::install(Some(1), || pack(&lengths, &o)).unwrap().unwrap();
            let four = pool::install(Some(4), || pack(&lengths, &o)).unwrap().unwrap();
            prop_assert_eq!(&one, &four);
            check_plan(&lengths, &o, &one);
        }
    }

    #[test]
    fn shuffling_permutes_whole_packs(
        (lengths, max_len) in lengths_strategy(),
        seed in any::<u64>(),
    ) {
        let o = opts(max_len, Strategy::BestFitDecreasing, Overlong::Drop, 0);
        let plain = pack(&lengths, &o).unwrap();
        let mut so = o.clone();
        so.shuffle_seed = Some(seed);
        let shuffled = pack(&lengths, &so).unwrap();
        let packs = |p: &Plan| {
            let mut v: Vec<Vec<(i64, i64, i32)>> = p.pack_offsets.windows(2).map(|w| {
                (w[0] as usize..w[1] as usize).map(|k| (p.sample_ids[k], p.starts[k], p.seqlens[k])).collect()
            }).collect();
            v.sort();
            v
        };
        prop_assert_eq!(packs(&plain), packs(&shuffled));
        prop_assert_eq!(&shuffled, &pack(&lengths, &so).unwrap());
    }

    #[test]
    fn order_preserving_strategies_keep_input_order(
        (lengths, max_len) in lengths_strategy(),
    ) {
        for strategy in [Strategy::NextFit, Strategy::Wrapped, Strategy::OnePerPack] {
            let plan = pack(&lengths, &opts(max_len, strategy, Overlong::Split, 0)).unwrap();
            let keys: Vec<(i64, i64)> = plan.sample_ids.iter().zip(&plan.starts).map(|(&a, &b)| (a, b)).collect();
            prop_assert!(keys.windows(2).all(|w| w[0] < w[1]));
            if strategy == Strategy::Wrapped && plan.num_packs() > 1 {
                let fills = plan.pack_fills();
                prop_assert!(fills[..fills.len() - 1].iter().all(|&f| f as u64 == max_len));
            }
            if strategy == Strategy::OnePerPack {
                // One segment per pack: each sequence, or each piece of a split one.
                prop_assert_eq!(plan.num_packs(), plan.num_segments());
                let pieces: usize = lengths.iter().map(|&l| (l as u64).div_ceil(max_len) as usize).sum();
                prop_assert_eq!(plan.num_packs(), pieces);
            }
        }
    }

    #[test]
    fn cu_seqlens_and_positions_follow_seqlens(
        (lengths, max_len) in lengths_strategy(),
        pick in prop::collection::vec(any::<prop::sample::Index>(), 0..10),
    ) {
        let plan = pack(&lengths, &opts(max_len, Strategy::BestFitDecreasing, Overlong::Split, 1.min(max_len - 1))).unwrap();
        if plan.num_packs() == 0 {
            return Ok(());
        }
        let packs: Vec<i64> = pick.iter().map(|i| i.index(plan.num_packs()) as i64).collect();
        let cu = layout::cu_seqlens(&plan.seqlens, &plan.pack_offsets, &packs).unwrap();
        let positions = layout::position_ids(&plan.seqlens, &plan.pack_offsets, &packs).unwrap();
        let mut expected_cu = vec![0i32];
        let mut expected_pos = Vec::new();
        for &p in &packs {
            for k in plan.pack_offsets[p as usize]..plan.pack_offsets[p as usize + 1] {
                let n = plan.seqlens[k as usize];
                expected_cu.push(expected_cu.last().unwrap() + n);
                expected_pos.extend(0..n as i64);
            }
        }
        prop_assert_eq!(cu, expected_cu);
        prop_assert_eq!(positions, expected_pos);
    }
}

#[test]
fn bad_options_are_rejected_with_the_argument_named() {
    let err = pack(&[1u32], &PackOptions::new(0)).unwrap_err();
    assert!(err.to_string().starts_with("max_len:"), "{err}");
    let mut o = PackOptions::new(8);
    o.reserve = 8;
    assert!(pack(&[1u32], &o).unwrap_err().to_string().starts_with("reserve:"));
    let err = pack(&[3i64, -2], &PackOptions::new(8)).unwrap_err();
    assert!(err.to_string().contains("negative length -2 at index 1"), "{err}");
    let err = pack(&[3u32, 9, 10], &PackOptions::new(8)).unwrap_err();
    assert!(err.to_string().contains("2 sequence(s) longer than 8"), "{err}");
    let err = layout::cu_seqlens(&[1], &[0, 1], &[1]).unwrap_err();
    assert!(err.to_string().starts_with("packs:"), "{err}");
}

#[test]
fn split_of_a_huge_length_is_an_error_not_a_hang() {
    let mut o = PackOptions::new(1);
    o.overlong = Overlong::Split;
    let err = pack(&[i64::MAX], &o).unwrap_err();
    assert!(matches!(err, Error::Overflow { .. }), "{err}");
}

#[test]
fn empty_input_gives_an_empty_plan() {
    for strategy in STRATEGIES {
        let plan = pack::<u32>(&[], &opts(16, strategy, Overlong::Error, 0)).unwrap();
        assert_eq!(plan.num_packs(), 0);
        assert_eq!(plan.pack_offsets, vec![0]);
        let plan = pack(&[0u32, 0], &opts(16, strategy, Overlong::Error, 0)).unwrap();
        assert_eq!(plan.num_packs(), 0);
        assert_eq!(plan.stats.empty_sequences, 2);
    }
}

/// Inputs large enough to be cut into many chunks (the per-chunk cursors, the split
/// remainders' side table and the parallel writers all cross chunk boundaries), with
/// over-long sequences, reserve, shuffle and shards: every invariant, on 1 and 3 threads.
#[test]
fn large_inputs_keep_every_invariant_across_chunks() {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let max_len = 512u64;
    // Mostly short, some near max_len, 5% over-long (up to 6x), 1% empty.
    // (Under Miri, whose chunks are tiny, a few hundred lengths cross as many boundaries.)
    let n = if cfg!(miri) { 700 } else { 400_000 };
    let lengths: Vec<u32> = (0..n)
        .map(|_| match next() % 100 {
            0 => 0,
            1..=5 => (max_len + next() % (5 * max_len)) as u32,
            6..=20 => (max_len / 2 + next() % (max_len / 2)) as u32,
            _ => (1 + next() % 200) as u32,
        })
        .collect();
    for strategy in STRATEGIES {
        for (overlong, reserve, shuffle, shard_items) in [
            (Overlong::Split, 0, None, usize::MAX),
            (Overlong::Split, 1, Some(7), usize::MAX),
            (Overlong::Split, 0, None, 100_000),
            (Overlong::Truncate, 2, Some(3), usize::MAX),
            (Overlong::Drop, 0, None, usize::MAX),
        ] {
            let mut o = opts(max_len, strategy, overlong, reserve);
            o.shuffle_seed = shuffle;
            o.shard_items = shard_items;
            let one = pool::install(Some(1), || pack(&lengths, &o)).unwrap().unwrap();
            let three = pool::install(Some(3), || pack(&lengths, &o)).unwrap().unwrap();
            assert_eq!(one, three, "{strategy:?} {overlong:?} reserve {reserve}");
            check_plan(&lengths, &o, &one);
        }
    }
}

/// The largest cap: lengths of 2^24 tokens survive every internal encoding.
#[test]
#[cfg_attr(miri, ignore = "walks 2^24 capacities: hours under Miri")]
fn the_largest_cap_keeps_full_lengths() {
    let cap = fastpack_core::MAX_LEN_LIMIT;
    let lengths = [cap, 1, cap - 1, 2 * cap + 5, 0, cap];
    for strategy in [Strategy::BestFitDecreasing, Strategy::FirstFitDecreasing] {
        let o = opts(cap, strategy, Overlong::Split, 0);
        let plan = pack(&lengths, &o).unwrap();
        check_plan(&lengths.map(|l| l as u32), &o, &plan);
        assert_eq!(plan.stats.total_tokens, lengths.iter().sum::<u64>());
        assert_eq!(plan.seqlens.iter().filter(|&&l| l as u64 == cap).count(), 4);
    }
}

/// A length that another thread rewrites while fastpack reads it: from the `after`-th read
/// on (all threads together), every value reads as `changed(value)`.
macro_rules! flaky {
    ($name:ident, $changed:expr) => {
        #[derive(Clone, Copy)]
        struct $name(u32);
        impl $name {
            fn reads() -> &'static (AtomicUsize, AtomicUsize) {
                static READS: (AtomicUsize, AtomicUsize) =
                    (AtomicUsize::new(0), AtomicUsize::new(0));
                &READS
            }
            fn arm(after: usize) {
                Self::reads().0.store(0, Ordering::SeqCst);
                Self::reads().1.store(after, Ordering::SeqCst);
            }
        }
        impl Length for $name {
            fn to_u64(self) -> Option<u64> {
                let (reads, after) = Self::reads();
                let n = reads.fetch_add(1, Ordering::SeqCst);
                let change: fn(u32) -> u32 = $changed;
                Some(if n >= after.load(Ordering::SeqCst) { change(self.0) } else { self.0 } as u64)
            }
            fn to_i128(self) -> i128 {
                self.0 as i128
            }
        }
    };
}

/// An array rewritten between fastpack's passes is an error for every strategy and
/// bucket layout — or, where every pass after the first saw the same new values and the
/// counts agree (a permutation of the lengths under an order-preserving strategy), exactly
/// the plan of the new array: never a wrong plan or a write out of place. Lengths grow
/// (more packs and segments), shrink, or trade places.
#[test]
fn an_input_changed_between_passes_is_an_error() {
    flaky!(Grows, |l| l * 2 + 1);
    flaky!(Shrinks, |l| l / 3);
    flaky!(Swaps, |l| 41 - l);
    let n = if cfg!(miri) { 400 } else { 200_000u32 };
    let base: Vec<u32> = (0..n).map(|i| i % 40 + 1).collect();
    for strategy in STRATEGIES {
        for (overlong, long) in [(Overlong::Split, None), (Overlong::Drop, Some(200))] {
            if long.is_some() && strategy == Strategy::Wrapped {
                continue;
            }
            let mut o = opts(64, strategy, overlong, 0);
            o.shuffle_seed = Some(1);
            let levels = Levels { long_max_len: long, group_tokens: Some(4096) };
            for threads in [1, 3] {
                macro_rules! check {
                    ($t:ident) => {
                        let lengths: Vec<$t> = base.iter().map(|&l| $t(l)).collect();
                        // The change lands after the first pass over the input.
                        $t::arm(lengths.len());
                        let got =
                            pool::install(Some(threads), || pack_two_level(&lengths, &o, &levels))
                                .unwrap();
                        match got {
                            Err(Error::InvalidArgument { arg: "lengths", message }) => {
                                assert!(message.contains("changed while"), "{message}")
                            }
                            Ok(plan) => {
                                $t::arm(0);
                                let now: Vec<u32> =
                                    lengths.iter().map(|l| l.to_u64().unwrap() as u32).collect();
                                let expected = pack_two_level(&now, &o, &levels).unwrap();
                                // (Not assert_eq: a plan prints as millions of numbers.)
                                assert!(plan == expected, "{} {strategy:?}", stringify!($t));
                            }
                            Err(other) => panic!("{} {strategy:?}: {other}", stringify!($t)),
                        }
                    };
                }
                check!(Grows);
                check!(Shrinks);
                check!(Swaps);
            }
        }
    }
}

/// Counted before anything is allocated: a plan that cannot be held is an error, not an
/// abort (`wrapped` over 10^15 tokens would be 2.4 * 10^11 packs).
#[test]
fn plans_too_large_to_hold_are_refused_before_allocating() {
    let wrapped = opts(4096, Strategy::Wrapped, Overlong::Error, 0);
    let err = pack(&[1_000_000_000_000_000u64], &wrapped).unwrap_err();
    assert!(matches!(err, Error::Overflow { arg: "lengths", .. }), "{err}");
    assert!(err.to_string().contains("packs"), "{err}");
    let split = opts(4096, Strategy::BestFitDecreasing, Overlong::Split, 0);
    let err = pack(&[1_000_000_000_000_000u64], &split).unwrap_err();
    assert!(matches!(err, Error::Overflow { arg: "lengths", .. }), "{err}");
    let next_fit = opts(1, Strategy::NextFit, Overlong::Split, 0);
    assert!(matches!(pack(&[u64::MAX], &next_fit).unwrap_err(), Error::Overflow { .. }));
}
