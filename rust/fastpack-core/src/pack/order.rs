//! Phase 4 — layout: the final pack order as the plan's `pack_offsets` and each pack's
//! first slot, so the writers fill the final layout directly (no second copy of the plan).

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::memory::{self, Slots};

/// `pack_offsets` (int64 [P+1]) and each pack's first slot, for packs of `counts`
/// segments (numbered as placed, buckets one after another) laid out in `order`: `order[q]`
/// is the pack at position `q` (`None`: as placed). Slots fit u32: a plan holds at most
/// MAX_ITEMS segments.
///
/// Invariant handed on: pack `p`'s slots are `first[p] .. first[p] + counts[p]`, and these
/// ranges tile `0..segments` in the order given.
pub(crate) fn lay_out(counts: &[u32], order: Option<&[u32]>) -> Result<(Vec<i64>, Vec<u32>)> {
    let packs = counts.len();
    let mut offsets = memory::try_with_capacity::<i64>(packs + 1, "pack_offsets")?;
    offsets.push(0);
    let Some(order) = order else {
        let mut first = memory::try_with_capacity::<u32>(packs, "pack slots")?;
        let mut acc = 0i64;
        for &c in counts {
            first.push(acc as u32);
            acc += c as i64;
            offsets.push(acc);
        }
        return Ok((offsets, first));
    };
    check_permutation(order, packs)?;
    // Random gathers and scatters over millions of packs: parallel.
    let mut sizes = memory::try_with_capacity::<u32>(packs, "pack slots")?;
    order.par_iter().map(|&p| counts[p as usize]).collect_into_vec(&mut sizes);
    let mut acc = 0i64;
    for size in sizes {
        acc += size as i64;
        offsets.push(acc);
    }
    let mut first = memory::try_zeroed::<u32>(packs, "pack slots")?;
    let slots = Slots::new(&mut first);
    order.par_iter().zip(&offsets[..packs]).for_each(|(&p, &at)| slots.set(p as usize, at as u32));
    Ok((offsets, first))
}

/// Every pack once: a pack listed twice would share its slots with another.
fn check_permutation(order: &[u32], packs: usize) -> Result<()> {
    let mut seen = memory::try_zeroed::<u64>(packs.div_ceil(64), "pack order check")?;
    let ok = order.len() == packs
        && order.iter().all(|&p| {
            let (word, bit) = (p as usize >> 6, 1u64 << (p & 63));
            let fresh = (p as usize) < packs && seen[word] & bit == 0;
            if fresh {
                seen[word] |= bit;
            }
            fresh
        });
    if !ok {
        return Err(Error::invalid(
            "fastpack",
            "internal error: the pack order is not a permutation",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_follow_the_order() {
        let counts = [2u32, 1, 3];
        assert_eq!(lay_out(&counts, None).unwrap(), (vec![0, 2, 3, 6], vec![0, 2, 3]));
        let (offsets, first) = lay_out(&counts, Some(&[2, 0, 1])).unwrap();
        assert_eq!(offsets, vec![0, 3, 5, 6]);
        assert_eq!(first, vec![3, 5, 0]);
        assert!(lay_out(&counts, Some(&[2, 0, 0])).is_err());
        assert!(lay_out(&counts, Some(&[2, 0])).is_err());
        assert!(lay_out(&counts, Some(&[2, 0, 3])).is_err());
    }
}
