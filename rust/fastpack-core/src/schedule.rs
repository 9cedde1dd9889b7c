//! What a step sampler computes, fast enough for millions of steps and the same on every
//! rank, platform and thread count: the per-step sums it balances by, a seeded
//! permutation, and the steps sorted by cost with seeded tie-breaks (so steps of equal
//! cost keep different company every epoch).
//!
//! ```
//! use fastpack_core::schedule::{by_cost, permutation};
//! let order = by_cost(&[3.0, 1.0, 2.0, 1.0], 7);
//! assert_eq!(order[2..], [2, 0]); // the two 1.0s first, in a seeded order
//! let mut p = permutation(5, 7).unwrap();
//! p.sort();
//! assert_eq!(p, [0, 1, 2, 3, 4]);
//! ```

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::shuffle::{self, SplitMix64};

/// Below this many steps one thread sorts faster than waking the pool.
const PARALLEL_SORT: usize = 1 << 16;

/// A uniformly random permutation of `0..n` from `seed` (`n < 2^32`); fails only when
/// its memory cannot be had.
pub fn permutation(n: usize, seed: u64) -> Result<Vec<u32>> {
    shuffle::permutation(n, seed)
}

/// The indices of `cost` in ascending order of cost; equal costs in an order drawn from
/// `seed`. Costs are finite and non-negative (their bits then order as the values do);
/// a total key, so the result does not depend on the thread count.
pub fn by_cost(cost: &[f64], seed: u64) -> Vec<u32> {
    // (cost bits, random 32 bits << 32 | index): 16 bytes a key, unique, so the unstable
    // sort is deterministic.
    let key = |i: usize| {
        let tiebreak =
            SplitMix64::new(seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)).next_u64();
        (cost[i].max(0.0).to_bits(), (tiebreak & !0xFFFF_FFFF) | i as u64)
    };
    let mut keyed: Vec<(u64, u64)> = if cost.len() >= PARALLEL_SORT {
        (0..cost.len()).into_par_iter().map(key).collect()
    } else {
        (0..cost.len()).map(key).collect()
    };
    if keyed.len() >= PARALLEL_SORT {
        keyed.par_sort_unstable();
    } else {
        keyed.sort_unstable();
    }
    keyed.into_iter().map(|(_, k)| k as u32).collect()
}

/// Per-step sums over the segments of each step (`segment_offsets`, CSR over segments):
/// tokens Σl, Σl², targets, and segments with at least one target. One parallel pass.
pub fn step_sums(
    seqlens: &[i32],
    segment_targets: &[u32],
    segment_offsets: &[i64],
) -> Result<[Vec<i64>; 4]> {
    let segments = seqlens.len();
    if segment_targets.len() != segments {
        return Err(Error::invalid(
            "segment_targets",
            format!("{} counts for {segments} segments", segment_targets.len()),
        ));
    }
    if segment_offsets.first().is_some_and(|&o| o != 0)
        || segment_offsets.last().is_some_and(|&o| o != segments as i64)
        || segment_offsets.windows(2).any(|w| w[1] < w[0])
    {
        return Err(Error::invalid(
            "segment_offsets",
            "must rise from 0 to the number of segments".to_string(),
        ));
    }
    let steps = segment_offsets.len().saturating_sub(1);
    let sums = |s: usize| {
        let range = segment_offsets[s] as usize..segment_offsets[s + 1] as usize;
        let mut out = [0i64; 4];
        for (&l, &t) in seqlens[range.clone()].iter().zip(&segment_targets[range]) {
            let l = l as i64;
            out[0] += l;
            out[1] += l * l;
            out[2] += t as i64;
            out[3] += i64::from(t > 0);
        }
        out
    };
    let per_step: Vec<[i64; 4]> = if segments >= PARALLEL_SORT {
        (0..steps).into_par_iter().map(sums).collect()
    } else {
        (0..steps).map(sums).collect()
    };
    let mut out: [Vec<i64>; 4] = std::array::from_fn(|_| Vec::with_capacity(steps));
    for row in per_step {
        for (column, value) in out.iter_mut().zip(row) {
            column.push(value);
        }
    }
    Ok(out)
}

/// Longest-processing-time first inside every group at once: the units of group `g`
/// (those with `group[i] == g`), in decreasing `cost` (ties by index), each into the
/// lightest of the group's `bins[g]` bins that stays within both caps (ties: the lowest
/// bin). Returns each unit's bin (`-1` where none had room) and whether each group failed:
/// a unit found no room, or a bin stayed empty. Groups run in parallel; each is
/// sequential, so the result does not depend on the thread count.
pub fn lpt_groups(
    group: &[i64],
    cost: &[f64],
    tokens: &[f64],
    bins: &[i64],
    token_cap: f64,
    cost_cap: f64,
) -> Result<(Vec<i64>, Vec<bool>)> {
    let n = group.len();
    if cost.len() != n || tokens.len() != n {
        return Err(Error::invalid(
            "cost",
            format!("{} costs and {} token counts for {n} units", cost.len(), tokens.len()),
        ));
    }
    let count = bins.len();
    if let Some(&g) = group.iter().find(|&&g| g < 0 || g as usize >= count) {
        return Err(Error::invalid("group", format!("{g} is not a group of 0..{count}")));
    }
    if let Some(&b) = bins.iter().find(|&&b| b < 1) {
        return Err(Error::invalid("bins", format!("{b}; every group needs a bin at least")));
    }
    if let Some(&c) = cost.iter().chain(tokens).find(|c| !c.is_finite() || **c < 0.0) {
        return Err(Error::invalid("cost", format!("{c} is not a finite non-negative number")));
    }
    // The units of each group, contiguous (a counting sort: stable by index).
    let mut offsets = vec![0usize; count + 1];
    for &g in group {
        offsets[g as usize + 1] += 1;
    }
    for g in 0..count {
        offsets[g + 1] += offsets[g];
    }
    let mut members = vec![0u32; n];
    let mut next = offsets.clone();
    for (i, &g) in group.iter().enumerate() {
        members[next[g as usize]] = i as u32;
        next[g as usize] += 1;
    }
    let mut placed = vec![-1i64; n];
    let mut chunks: Vec<(&mut [u32], &mut [i64])> = Vec::with_capacity(count);
    let (mut rest_m, mut rest_p) = (&mut members[..], &mut placed[..]);
    for g in 0..count {
        let len = offsets[g + 1] - offsets[g];
        let (m, tail_m) = rest_m.split_at_mut(len);
        let (p, tail_p) = rest_p.split_at_mut(len);
        chunks.push((m, p));
        rest_m = tail_m;
        rest_p = tail_p;
    }
    let place = |(g, (units, out)): (usize, &mut (&mut [u32], &mut [i64]))| -> bool {
        units.sort_unstable_by(|&a, &b| {
            cost[b as usize].total_cmp(&cost[a as usize]).then(a.cmp(&b))
        });
        let width = bins[g] as usize;
        let mut load = vec![0.0f64; width];
        let mut held = vec![0.0f64; width];
        let mut used = vec![false; width];
        let mut failed = false;
        for (slot, &u) in out.iter_mut().zip(units.iter()) {
            let (c, t) = (cost[u as usize], tokens[u as usize]);
            let mut best: Option<usize> = None;
            for b in 0..width {
                if held[b] + t <= token_cap
                    && load[b] + c <= cost_cap
                    && best.is_none_or(|x| load[b] < load[x])
                {
                    best = Some(b);
                }
            }
            match best {
                Some(b) => {
                    load[b] += c;
                    held[b] += t;
                    used[b] = true;
                    *slot = b as i64;
                }
                None => failed = true,
            }
        }
        failed || used.iter().any(|u| !u)
    };
    let failed: Vec<bool> = if n >= PARALLEL_SORT {
        chunks.par_iter_mut().enumerate().map(place).collect()
    } else {
        chunks.iter_mut().enumerate().map(place).collect()
    };
    let mut out = vec![-1i64; n];
    for (&u, &b) in members.iter().zip(&placed) {
        out[u as usize] = b;
    }
    Ok((out, failed))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn sorted_seeded_and_thread_independent(
            cost in prop::collection::vec(0u32..20, 0..300), seed in any::<u64>()
        ) {
            let cost: Vec<f64> = cost.into_iter().map(f64::from).collect();
            let order = by_cost(&cost, seed);
            let mut seen = order.clone();
            seen.sort();
            prop_assert_eq!(seen, (0..cost.len() as u32).collect::<Vec<_>>());
            prop_assert!(order.windows(2).all(|w| cost[w[0] as usize] <= cost[w[1] as usize]));
            let one = pool::install(Some(1), || by_cost(&cost, seed)).unwrap();
            prop_assert_eq!(one, order);
        }
    }

    #[test]
    fn lpt_groups_places_heaviest_first_under_the_caps() {
        // Group 0: 8 units of 7 tokens into 8 bins under a cap of 8 (one each); group 1:
        // costs 5, 4, 3, 3 into 2 bins -> {5, 3} and {4, 3}; group 2 cannot fill 3 bins.
        let group = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2];
        let mut cost = vec![7.0; 8];
        cost.extend([5.0, 4.0, 3.0, 3.0, 1.0]);
        let tokens = cost.clone();
        let (bins, failed) =
            lpt_groups(&group, &cost, &tokens, &[8, 2, 3], 8.0, f64::INFINITY).unwrap();
        assert_eq!(bins[..8], [0, 1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(bins[8..12], [0, 1, 1, 0]);
        assert_eq!(failed, [false, false, true]);
        let (_, failed) = lpt_groups(&[0, 0], &[7.0, 7.0], &[7.0, 7.0], &[1], 8.0, 1e9).unwrap();
        assert_eq!(failed, [true]);
        assert!(lpt_groups(&[1], &[1.0], &[1.0], &[1], 8.0, 8.0).is_err());
    }

    #[test]
    fn step_sums_add_up_and_check_offsets() {
        let [tokens, squared, targets, sequences] =
            step_sums(&[3, 4, 5], &[2, 0, 4], &[0, 2, 3]).unwrap();
        assert_eq!((tokens, squared), (vec![7, 5], vec![25, 25]));
        assert_eq!((targets, sequences), (vec![2, 4], vec![1, 1]));
        let err = step_sums(&[3, 4], &[1, 1], &[0, 3]).unwrap_err();
        assert!(err.to_string().starts_with("segment_offsets:"), "{err}");
    }

    #[test]
    fn large_inputs_agree_across_threads_and_seeds_change_ties() {
        let cost: Vec<f64> = (0..200_000).map(|i| (i % 97) as f64).collect();
        let two = pool::install(Some(2), || by_cost(&cost, 1)).unwrap();
        let one = pool::install(Some(1), || by_cost(&cost, 1)).unwrap();
        assert_eq!(one, two);
        assert_ne!(by_cost(&cost, 2), two);
        assert!(two.windows(2).all(|w| cost[w[0] as usize] <= cost[w[1] as usize]));
    }
}
