//! Attention metadata for a set of packs: `cu_seqlens` and `position_ids`, straight from
//! the plan's `seqlens` and `pack_offsets`.

use rayon::prelude::*;

use crate::error::{Error, Result};

/// The chosen packs exist and their segment ranges lie inside `seqlens`: a plan whose
/// offsets are broken gets an error naming `pack_offsets`, never a panic. Only the chosen
/// packs are checked (a step reads a few packs of a big plan); `Plan` checks all of them
/// when it is built from arrays.
fn check_packs(pack_offsets: &[i64], seqlens: &[i32], packs: &[i64]) -> Result<()> {
    let num_packs = pack_offsets.len().saturating_sub(1) as i64;
    if pack_offsets.last().copied().unwrap_or(0) as usize != seqlens.len() {
        return Err(Error::invalid("pack_offsets", "does not end at the number of segments"));
    }
    for &p in packs {
        if p < 0 || p >= num_packs {
            return Err(Error::invalid(
                "packs",
                format!("pack index {p} out of range; the plan has {num_packs} packs"),
            ));
        }
        let (lo, hi) = (pack_offsets[p as usize], pack_offsets[p as usize + 1]);
        if lo < 0 || lo > hi || hi as usize > seqlens.len() {
            return Err(Error::invalid(
                "pack_offsets",
                format!(
                    "entries {p} and {} are {lo} and {hi}: not a range of the {} segments; \
                     expected non-decreasing offsets from 0 to the number of segments",
                    p + 1,
                    seqlens.len()
                ),
            ));
        }
    }
    Ok(())
}

/// Segment ranges of the chosen packs, in order.
fn segment_ranges<'a>(
    pack_offsets: &'a [i64],
    packs: &'a [i64],
) -> impl Iterator<Item = std::ops::Range<usize>> + 'a {
    packs.iter().map(|&p| pack_offsets[p as usize] as usize..pack_offsets[p as usize + 1] as usize)
}

/// `cu_seqlens` (int32, starting at 0) over the segments of `packs` laid end to end, as
/// one varlen row. Fails if the row holds 2^31 tokens or more.
pub fn cu_seqlens(seqlens: &[i32], pack_offsets: &[i64], packs: &[i64]) -> Result<Vec<i32>> {
    check_packs(pack_offsets, seqlens, packs)?;
    let count: usize = segment_ranges(pack_offsets, packs).map(|r| r.len()).sum();
    let mut cu = Vec::with_capacity(count + 1);
    let mut acc = 0i64;
    cu.push(0);
    for range in segment_ranges(pack_offsets, packs) {
        for &n in &seqlens[range] {
            acc += n as i64;
            if acc > i32::MAX as i64 {
                return Err(Error::overflow(
                    "packs",
                    "the chosen packs hold 2^31 tokens or more; cu_seqlens is int32",
                ));
            }
            cu.push(acc as i32);
        }
    }
    Ok(cu)
}

/// Position ids restarting at 0 in every segment, over `packs` laid end to end.
pub fn position_ids(seqlens: &[i32], pack_offsets: &[i64], packs: &[i64]) -> Result<Vec<i64>> {
    let cu = cu_seqlens(seqlens, pack_offsets, packs)?;
    Ok(positions_from_cu(&cu))
}

/// Expands `cu_seqlens` into positions; parallel over segments for big rows.
pub fn positions_from_cu(cu: &[i32]) -> Vec<i64> {
    let total = cu.last().copied().unwrap_or(0) as usize;
    let mut positions = vec![0i64; total];
    if total < (1 << 16) {
        for w in cu.windows(2) {
            for (k, slot) in positions[w[0] as usize..w[1] as usize].iter_mut().enumerate() {
                *slot = k as i64;
            }
        }
        return positions;
    }
    // Split the output at segment boundaries so each task owns whole segments.
    let mut rest: &mut [i64] = &mut positions;
    let mut pieces = Vec::with_capacity(cu.len());
    for w in cu.windows(2) {
        let (head, tail) = rest.split_at_mut((w[1] - w[0]) as usize);
        pieces.push(head);
        rest = tail;
    }
    pieces.par_iter_mut().with_min_len(256).for_each(|seg| {
        for (k, slot) in seg.iter_mut().enumerate() {
            *slot = k as i64;
        }
    });
    positions
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broken_offsets_are_an_error_not_a_panic() {
        let seqlens = [3, 2, 5, 1];
        assert_eq!(cu_seqlens(&seqlens, &[0, 2, 3, 4], &[1, 0]).unwrap(), vec![0, 5, 8, 10]);
        for (offsets, pack) in [([0i64, 3, 1, 4], 1), ([0, 2, 9, 4], 1), ([0, -1, 3, 4], 0)] {
            let err = cu_seqlens(&seqlens, &offsets, &[pack]).unwrap_err();
            assert!(
                err.to_string()
                    .starts_with(&format!("pack_offsets: entries {pack} and {}", pack + 1)),
                "{err}"
            );
        }
    }
}
