//! Property tests of related documents packed together (`pack_affinity`).

use fastpack_core::{pack, pack_affinity, pool, Overlong, PackOptions, Plan, Strategy as Packing};
use proptest::prelude::*;

fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn opts(max_len: u64, overlong: Overlong, reserve: u64, seed: Option<u64>) -> PackOptions {
    let mut o = PackOptions::new(max_len);
    o.overlong = overlong;
    o.reserve = reserve;
    o.shuffle_seed = seed;
    o
}

/// Every token of every kept sequence in exactly one segment (pieces of a split sequence
/// tile it), no pack over `max_len`, and the counts of plain best fit.
fn check_plan(plan: &Plan, lengths: &[u32], o: &PackOptions, bfd: &Plan) {
    assert_eq!(plan.stats, bfd.stats);
    let mut covered = vec![0u64; lengths.len()];
    let mut pieces: Vec<Vec<(i64, i32)>> = vec![Vec::new(); lengths.len()];
    for p in 0..plan.num_packs() {
        let (lo, hi) = (plan.pack_offsets[p] as usize, plan.pack_offsets[p + 1] as usize);
        assert!(hi > lo, "empty pack {p}");
        let fill: i64 = plan.seqlens[lo..hi].iter().map(|&l| l as i64).sum();
        assert!(fill as u64 <= o.max_len, "pack {p} holds {fill} > {}", o.max_len);
        for s in lo..hi {
            let id = plan.sample_ids[s] as usize;
            covered[id] += plan.seqlens[s] as u64;
            pieces[id].push((plan.starts[s], plan.seqlens[s]));
        }
    }
    let mut total = 0u64;
    for (i, &len) in lengths.iter().enumerate() {
        let extended = len as u64 + o.reserve;
        let expect = if len == 0 || (extended > o.max_len && o.overlong == Overlong::Drop) {
            0
        } else if extended > o.max_len && o.overlong == Overlong::Truncate {
            o.max_len
        } else {
            extended
        };
        assert_eq!(covered[i], expect, "sequence {i} of length {len}");
        pieces[i].sort_unstable();
        let mut at = 0i64;
        for &(start, l) in &pieces[i] {
            assert_eq!(start, at, "sequence {i}: pieces do not tile it");
            at += l as i64;
        }
        total += expect;
    }
    assert_eq!(total, plan.stats.total_tokens);
}

fn case() -> impl Strategy<Value = (Vec<u32>, Vec<i64>, u64, u64, Overlong)> {
    (1u64..200, 0usize..400, 1i64..12, 0u64..3, 0usize..4).prop_flat_map(
        |(max_len, n, keys, reserve, policy)| {
            let reserve = reserve.min(max_len - 1);
            let overlong =
                [Overlong::Split, Overlong::Truncate, Overlong::Drop, Overlong::Error][policy];
            // Error refuses any over-long length: keep them under the cap then.
            let top = if overlong == Overlong::Error { max_len - reserve } else { 2 * max_len + 1 };
            (
                prop::collection::vec(0u32..=top as u32, n),
                prop::collection::vec(0i64..keys, n),
                Just(max_len),
                Just(reserve),
                Just(overlong),
            )
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(200), ..ProptestConfig::default() })]

    /// Each token once, no pack over max_len, at most `bfd + bfd / 1000` packs (0.1% of
    /// plain best fit's efficiency: the fallback makes this hold for any input), the same
    /// plan on 1 and 3 threads, and on a repeated call with the same seed.
    #[test]
    fn affinity_keeps_every_guarantee(
        (lengths, keys, max_len, reserve, overlong) in case(),
        slack in prop_oneof![Just(None), (0u32..64).prop_map(Some)],
        seed in prop_oneof![Just(None), any::<u64>().prop_map(Some)],
    ) {
        let o = opts(max_len, overlong, reserve, seed);
        let bfd = pack(&lengths, &o).unwrap();
        let one = pool::install(Some(1), || pack_affinity(&lengths, &keys, &o, slack))
            .unwrap()
            .unwrap();
        let three = pool::install(Some(3), || pack_affinity(&lengths, &keys, &o, slack))
            .unwrap()
            .unwrap();
        prop_assert_eq!(&one.plan, &three.plan);
        prop_assert_eq!(&one.affinity, &three.affinity);
        check_plan(&one.plan, &lengths, &o, &bfd);
        let packs = one.plan.num_packs();
        prop_assert_eq!(one.affinity.bfd_packs as usize, bfd.num_packs());
        prop_assert!(packs <= bfd.num_packs() + bfd.num_packs() / 1000,
            "{} packs, bfd {}", packs, bfd.num_packs());
        // The shares are shares; the fallback (slack 0) has exactly bfd's packs.
        let a = &one.affinity;
        prop_assert!((0.0..=1.0).contains(&a.same_key_share));
        prop_assert!((0.0..=1.0).contains(&a.random_share));
        if a.slack == 0 {
            prop_assert_eq!(packs, bfd.num_packs());
        }
    }
}

/// A deterministic long-tailed sample (log-normal-like: a product of uniforms).
fn long_tail(n: usize, max_len: u32, seed: u64) -> Vec<u32> {
    let mut state = seed;
    let mut next = move || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((state >> 33) as f64 + 0.5) / (1u64 << 31) as f64
    };
    (0..n)
        .map(|_| {
            let g: f64 = (0..4).map(|_| next()).sum::<f64>() - 2.0; // about normal, sd 0.58
            let len = (5.5 + 2.0 * g).exp();
            (len as u32).clamp(1, max_len)
        })
        .collect()
}

/// On realistic lengths (long-tailed, cap 4096) the preferred placement itself (no
/// fallback: `slack > 0`) keeps packs <= bfd packs * 1.001, and packs mostly one key:
/// few keys and many.
#[test]
fn realistic_lengths_keep_efficiency_and_relate_packs() {
    let n = 200_000;
    let lengths = long_tail(n, 4096, 7);
    for (num_keys, min_share) in [(6i64, 0.95), (1000, 0.8)] {
        let keys: Vec<i64> = (0..n as i64).map(|i| (i * 7919 + i / 3) % num_keys).collect();
        let o = opts(4096, Overlong::Error, 0, Some(1));
        let bfd = pack(&lengths, &o).unwrap();
        let out = pack_affinity(&lengths, &keys, &o, None).unwrap();
        let (p, b) = (out.plan.num_packs() as f64, bfd.num_packs() as f64);
        assert!(out.affinity.slack > 0, "the fallback ran ({num_keys} keys)");
        assert!(p <= b * 1.001, "{p} packs vs bfd {b} ({num_keys} keys)");
        let a = out.affinity;
        assert!(a.same_key_share >= min_share, "{num_keys} keys: {a:?}");
        assert!(a.random_share < 0.2, "{num_keys} keys: {a:?}");
    }
}

#[test]
fn affinity_refuses_bad_keys_and_other_strategies() {
    let o = PackOptions::new(8);
    let err = pack_affinity(&[1u32, 2], &[0], &o, None).unwrap_err().to_string();
    assert!(err.contains("affinity") && err.contains("1 keys for 2"), "{err}");
    let err = pack_affinity(&[1u32, 2], &[0, -3], &o, None).unwrap_err().to_string();
    assert!(err.contains("affinity") && err.contains("-3 at index 1"), "{err}");
    let mut ffd = PackOptions::new(8);
    ffd.strategy = Packing::FirstFitDecreasing;
    let err = pack_affinity(&[1u32, 2], &[0, 1], &ffd, None).unwrap_err().to_string();
    assert!(err.contains("affinity") && err.contains("ffd"), "{err}");
    // Over-long under "error": the error of plain packing.
    let err = pack_affinity(&[9u32], &[0], &o, None).unwrap_err().to_string();
    assert_eq!(err, pack(&[9u32], &o).unwrap_err().to_string());
}

#[test]
fn huge_keys_are_ids_too() {
    let o = opts(8, Overlong::Error, 0, None);
    let keys = [i64::MAX, 5, i64::MAX, 5];
    let out = pack_affinity(&[4u32, 4, 4, 4], &keys, &o, None).unwrap();
    assert_eq!(out.plan.num_packs(), 2);
    assert_eq!(out.affinity.same_key_share, 1.0);
    assert_eq!(out.affinity.num_keys, 2);
}
