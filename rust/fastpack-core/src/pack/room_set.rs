//! The set of free capacities both the placement and the limits walk: a 64-ary bitset
//! tree over `0..=max` (its own module so neither of them imports the other).

use crate::error::Result;
use crate::memory;

/// A set of capacities `0..=max` as a 64-ary bitset tree: "the smallest member `>= need`"
/// costs O(log64 max).
pub(crate) struct RoomSet {
    levels: Vec<Vec<u64>>,
}

impl RoomSet {
    pub(crate) fn new(max: usize) -> Result<Self> {
        let mut levels = Vec::new();
        let mut bits = max + 1;
        loop {
            let words = bits.div_ceil(64);
            levels.push(memory::try_zeroed::<u64>(words, "the capacity index")?);
            if words == 1 {
                break;
            }
            bits = words;
        }
        Ok(Self { levels })
    }

    #[inline(always)]
    pub(crate) fn insert(&mut self, mut bit: usize) {
        for level in &mut self.levels {
            let word = &mut level[bit >> 6];
            let was_empty = *word == 0;
            *word |= 1u64 << (bit & 63);
            if !was_empty {
                return;
            }
            bit >>= 6;
        }
    }

    #[inline(always)]
    pub(crate) fn remove(&mut self, mut bit: usize) {
        for level in &mut self.levels {
            let word = &mut level[bit >> 6];
            *word &= !(1u64 << (bit & 63));
            if *word != 0 {
                return;
            }
            bit >>= 6;
        }
    }

    /// Smallest member `>= need`.
    #[inline(always)]
    pub(crate) fn first_at_least(&self, need: usize) -> Option<usize> {
        let mut level = 0;
        let mut bit = need;
        let found = loop {
            let words = &self.levels[level];
            let w = bit >> 6;
            if w >= words.len() {
                return None;
            }
            let masked = words[w] & (!0u64 << (bit & 63));
            if masked != 0 {
                break (w << 6) | masked.trailing_zeros() as usize;
            }
            level += 1;
            if level == self.levels.len() {
                return None;
            }
            bit = w + 1;
        };
        let mut bit = found;
        while level > 0 {
            level -= 1;
            bit = (bit << 6) | self.levels[level][bit].trailing_zeros() as usize;
        }
        Some(bit)
    }
}
