//! Phase 4 — layout: the final pack order as the plan's `pack_offsets` and each pack's
//! first slot, so the writers fill the final layout directly (no second copy of the plan).

use crate::error::Result;
use crate::memory::Tiling;

/// The slots' tiling (its offsets are `pack_offsets`, int64 [P+1]), for packs of `counts` segments
/// (numbered as placed, buckets one after another) laid out in `order`: `order[q]` is the
/// pack at position `q` (`None`: as placed). An order that is not a permutation of the
/// packs is an error.
///
/// Invariant handed on: pack `p`'s slots form one range of the tiling, its
/// `counts[p]` positions starting at `pack_offsets[q]` where `order[q] = p`; the ranges
/// tile `0..segments`, and the writers fill each through its cursor.
pub(crate) fn lay_out(counts: Vec<u32>, order: Option<Vec<u32>>) -> Result<Tiling> {
    Tiling::new(counts, order, "pack slots")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_follow_the_order() {
        let counts = vec![2u32, 1, 3];
        assert_eq!(lay_out(counts.clone(), None).unwrap().offsets(), &[0, 2, 3, 6]);
        let tiling = lay_out(counts.clone(), Some(vec![2, 0, 1])).unwrap();
        assert_eq!(tiling.offsets(), &[0, 3, 5, 6]);
        // Pack 0's slots are 3 and 4: its first push lands at 3.
        let mut v: Vec<i64> = Vec::new();
        let mut tiles = tiling.over(&mut v, "t").unwrap();
        assert_eq!(tiles.cursors().push(0, 1), Some(3));
        assert!(lay_out(counts.clone(), Some(vec![2, 0, 0])).is_err());
        assert!(lay_out(counts.clone(), Some(vec![2, 0])).is_err());
        assert!(lay_out(counts, Some(vec![2, 0, 3])).is_err());
    }
}
