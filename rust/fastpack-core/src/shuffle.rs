//! A seeded permutation that is the same on every platform and thread count.

use rayon::prelude::*;

use crate::error::Result;
use crate::memory::{self, Slots};

/// SplitMix64: tiny, fast, and fully specified, so a seed means the same order everywhere.
pub(crate) struct SplitMix64(u64);

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// The SplitMix64 output function: a bijective mix of all 64 bits.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN);
        mix(self.0)
    }

    /// Uniform in `0..n` (multiply-shift; the bias is below 2^-32 for any n < 2^32).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}

/// Fisher–Yates over `items`, in place.
fn shuffle_in_place(items: &mut [u32], rng: &mut SplitMix64) {
    for i in (1..items.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        items.swap(i, j);
    }
}

/// Items per bucket (about) and per counting chunk of the parallel shuffle; fixed, so the
/// result does not depend on the thread count.
/// (Under Miri, a few: its small inputs then take the parallel path.)
const BUCKET_ITEMS: usize = if cfg!(miri) { 4 } else { 1 << 15 };

/// A uniformly random permutation of `0..n`, as `perm[i]` = the new position of item `i`
/// (the inverse of a uniform permutation is uniform, so either reading holds).
///
/// Small `n`: Fisher–Yates. Large `n`: Sanders' parallel shuffle — each item goes to a
/// random bucket (a counter-based hash of the seed and the item, so any thread can draw
/// it), the buckets are laid out one after another, and each is Fisher–Yates shuffled
/// with its own stream. Swaps then stay inside a cache-sized bucket instead of jumping
/// across the whole array.
pub(crate) fn permutation(n: usize, seed: u64) -> Result<Vec<u32>> {
    if n <= 2 * BUCKET_ITEMS {
        let mut perm: Vec<u32> = (0..n as u32).collect();
        shuffle_in_place(&mut perm, &mut SplitMix64::new(seed));
        return Ok(perm);
    }
    let buckets = n.div_ceil(BUCKET_ITEMS);
    let bucket_of = |i: usize| {
        let draw = mix(seed.wrapping_add((i as u64).wrapping_add(1).wrapping_mul(GOLDEN)));
        ((draw as u128 * buckets as u128) >> 64) as usize
    };
    let chunks: Vec<std::ops::Range<usize>> =
        (0..n).step_by(BUCKET_ITEMS).map(|s| s..(s + BUCKET_ITEMS).min(n)).collect();
    let counts: Vec<Result<Vec<u32>>> = chunks
        .par_iter()
        .map(|range| {
            let mut c = memory::try_zeroed::<u32>(buckets, "the shuffle")?;
            for i in range.clone() {
                c[bucket_of(i)] += 1;
            }
            Ok(c)
        })
        .collect();
    let counts: Vec<Vec<u32>> = counts.into_iter().collect::<Result<_>>()?;
    // Bucket b holds, chunk by chunk, the items that drew b: cursors[chunk][b] is where
    // the chunk's next such item goes.
    let mut bucket_start = vec![0usize; buckets + 1];
    for c in &counts {
        for (b, &k) in c.iter().enumerate() {
            bucket_start[b + 1] += k as usize;
        }
    }
    for b in 0..buckets {
        bucket_start[b + 1] += bucket_start[b];
    }
    let mut running = bucket_start.clone();
    let cursors: Vec<Vec<usize>> = counts
        .iter()
        .map(|c| {
            let here = running[..buckets].to_vec();
            for (r, &k) in running.iter_mut().zip(c) {
                *r += k as usize;
            }
            here
        })
        .collect();
    drop(counts);

    let mut perm = memory::try_zeroed::<u32>(n, "the shuffle")?;
    let out = Slots::new(&mut perm);
    // The cursors of all chunks and buckets cover disjoint positions of `perm`, which the
    // buckets tile: every position is written once.
    chunks.par_iter().zip(cursors).for_each(|(range, mut cursor)| {
        for i in range.clone() {
            let b = bucket_of(i);
            out.set(cursor[b], i as u32);
            cursor[b] += 1;
        }
    });
    let mut parts = Vec::with_capacity(buckets);
    let mut rest = perm.as_mut_slice();
    for b in 0..buckets {
        let (part, tail) = rest.split_at_mut(bucket_start[b + 1] - bucket_start[b]);
        parts.push((b, part));
        rest = tail;
    }
    parts.into_par_iter().for_each(|(b, part)| {
        let stream = seed ^ mix((b as u64).wrapping_add(1).wrapping_mul(0xD1B5_4A32_D192_ED03));
        shuffle_in_place(part, &mut SplitMix64::new(stream));
    });
    Ok(perm)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutations_are_permutations_and_seeded() {
        let sizes: &[usize] = if cfg!(miri) {
            &[0, 1, 2, 9, 100]
        } else {
            &[0, 1, 2, 1000, 2 * BUCKET_ITEMS + 1, 300_000]
        };
        for &n in sizes {
            let p = permutation(n, 42).unwrap();
            let mut seen = vec![false; n];
            for &q in &p {
                assert!(!seen[q as usize], "{n}: position {q} twice");
                seen[q as usize] = true;
            }
            assert_eq!(p, permutation(n, 42).unwrap());
            if n > 1000 {
                assert_ne!(p, permutation(n, 43).unwrap());
                // Not the identity, nor close to it: few fixed points (about 1 expected).
                let fixed = p.iter().enumerate().filter(|&(i, &q)| i == q as usize).count();
                assert!(fixed < 20, "{n}: {fixed} fixed points");
            }
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "a statistical test over 500,000 items")]
    fn large_permutations_spread_items_evenly() {
        // Where items of the first tenth land: about a tenth in each tenth of the output.
        let n = 500_000;
        let p = permutation(n, 7).unwrap();
        let mut tenths = [0usize; 10];
        for &q in &p[..n / 10] {
            tenths[q as usize * 10 / n] += 1;
        }
        for (t, &k) in tenths.iter().enumerate() {
            assert!((4_500..5_500).contains(&k), "tenth {t}: {k} of 5,000 expected");
        }
    }
}
