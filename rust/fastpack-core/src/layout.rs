//! Attention metadata for a set of packs: `cu_seqlens` and `position_ids`, straight from
//! the plan's `seqlens` and `pack_offsets`.

use rayon::prelude::*;

use crate::error::{Error, Result};

fn check_packs(pack_offsets: &[i64], seqlens: &[i32], packs: &[i64]) -> Result<()> {
    let num_packs = pack_offsets.len().saturating_sub(1) as i64;
    if pack_offsets.last().copied().unwrap_or(0) as usize != seqlens.len() {
        return Err(Error::invalid("pack_offsets", "does not end at the number of segments"));
    }
    if let Some(&bad) = packs.iter().find(|&&p| p < 0 || p >= num_packs) {
        return Err(Error::invalid(
            "packs",
            format!("pack index {bad} out of range; the plan has {num_packs} packs"),
        ));
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
