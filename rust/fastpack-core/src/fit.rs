//! Best-fit and first-fit decreasing placement over a counting-sorted input.
//!
//! Both walk the length buckets from `max_len` down to 1. Items of one length are
//! interchangeable, so a placement is a *run*: `k` consecutive sorted positions of length
//! `len` into one pack. A pack that takes one item of length `len` stays the best (or
//! first) fit for the next as long as it has room, so a run is `min(left, room / len)`
//! items and the index is touched once per run, not once per item.

/// `emit(pack, first_sorted_position, count, len)`.
pub(crate) trait Emit: FnMut(u32, usize, usize, u32) {}
impl<F: FnMut(u32, usize, usize, u32)> Emit for F {}

pub(crate) const NONE: u32 = u32::MAX;

/// Open packs by remaining capacity: a list of packs per capacity and a 64-ary bitset tree
/// over capacities `0..=max_len`, so "the smallest capacity >= len" costs O(log64 max_len).
pub(crate) struct CapacityIndex {
    levels: Vec<Vec<u64>>,
    head: Vec<u32>,
    pub(crate) next: Vec<u32>,
}

impl CapacityIndex {
    pub(crate) fn new(max_len: usize) -> Self {
        let mut levels = Vec::new();
        let mut bits = max_len + 1;
        loop {
            let words = bits.div_ceil(64);
            levels.push(vec![0u64; words]);
            if words == 1 {
                break;
            }
            bits = words;
        }
        Self { levels, head: vec![NONE; max_len + 1], next: Vec::new() }
    }

    /// [`CapacityIndex::new`] with room for about `packs` packs up front.
    pub(crate) fn with_packs(max_len: usize, packs: usize) -> Self {
        let mut index = Self::new(max_len);
        index.next = crate::memory::with_capacity(packs);
        index
    }

    fn set(&mut self, mut bit: usize) {
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

    fn clear(&mut self, mut bit: usize) {
        for level in &mut self.levels {
            let word = &mut level[bit >> 6];
            *word &= !(1u64 << (bit & 63));
            if *word != 0 {
                return;
            }
            bit >>= 6;
        }
    }

    /// Smallest capacity `>= need` that has an open pack.
    pub(crate) fn find_at_least(&self, need: usize) -> Option<usize> {
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

    pub(crate) fn pop(&mut self, capacity: usize) -> u32 {
        let pack = self.head[capacity];
        self.head[capacity] = self.next[pack as usize];
        if self.head[capacity] == NONE {
            self.clear(capacity);
        }
        pack
    }

    pub(crate) fn push(&mut self, capacity: usize, pack: u32) {
        if self.head[capacity] == NONE {
            self.set(capacity);
        }
        self.next[pack as usize] = self.head[capacity];
        self.head[capacity] = pack;
    }
}

/// Best-fit decreasing over `lens`, the lengths present, longest first. `bucket(len)` gives the sorted positions `(first, count)` of this
/// shard's items of length `len`. Ties between packs of equal room go to the pack that
/// reached that room last, which is deterministic. Returns the number of packs.
pub(crate) fn best_fit(
    max_len: u32,
    lens: &[u32],
    bucket: impl Fn(u32) -> (usize, usize),
    packs_hint: usize,
    mut emit: impl Emit,
) -> u32 {
    let mut index = CapacityIndex::with_packs(max_len as usize, packs_hint);
    let mut packs = 0u32;
    for &len in lens {
        let (mut pos, mut left) = bucket(len);
        while left > 0 {
            let (pack, room) = match index.find_at_least(len as usize) {
                Some(room) => (index.pop(room), room),
                None => {
                    index.next.push(NONE);
                    packs += 1;
                    (packs - 1, max_len as usize)
                }
            };
            let k = left.min(room / len as usize);
            emit(pack, pos, k, len);
            pos += k;
            left -= k;
            let rest = room - k * len as usize;
            if rest > 0 {
                index.push(rest, pack);
            }
        }
    }
    packs
}

/// Max-tree over pack rooms, for "the first pack with room >= len".
struct RoomTree {
    leaves: usize,
    tree: Vec<u32>,
}

impl RoomTree {
    fn new() -> Self {
        Self { leaves: 1024, tree: vec![0; 2048] }
    }

    fn grow(&mut self) {
        let leaves = self.leaves * 2;
        let mut tree = vec![0u32; 2 * leaves];
        tree[leaves..leaves + self.leaves].copy_from_slice(&self.tree[self.leaves..]);
        for i in (1..leaves).rev() {
            tree[i] = tree[2 * i].max(tree[2 * i + 1]);
        }
        self.leaves = leaves;
        self.tree = tree;
    }

    fn set(&mut self, leaf: usize, room: u32) {
        let mut i = leaf + self.leaves;
        self.tree[i] = room;
        while i > 1 {
            i /= 2;
            self.tree[i] = self.tree[2 * i].max(self.tree[2 * i + 1]);
        }
    }

    fn first_at_least(&self, need: u32) -> Option<usize> {
        if self.tree[1] < need {
            return None;
        }
        let mut i = 1;
        while i < self.leaves {
            i = if self.tree[2 * i] >= need { 2 * i } else { 2 * i + 1 };
        }
        Some(i - self.leaves)
    }
}

/// First-fit decreasing: each item goes to the lowest-numbered pack with room.
pub(crate) fn first_fit(
    max_len: u32,
    lens: &[u32],
    bucket: impl Fn(u32) -> (usize, usize),
    mut emit: impl Emit,
) -> u32 {
    let mut rooms = RoomTree::new();
    let mut packs = 0u32;
    for &len in lens {
        let (mut pos, mut left) = bucket(len);
        while left > 0 {
            let (pack, room) = match rooms.first_at_least(len) {
                Some(p) => (p as u32, rooms.tree[p + rooms.leaves]),
                None => {
                    if packs as usize == rooms.leaves {
                        rooms.grow();
                    }
                    packs += 1;
                    (packs - 1, max_len)
                }
            };
            let k = left.min((room / len) as usize);
            emit(pack, pos, k, len);
            pos += k;
            left -= k;
            rooms.set(pack as usize, room - (k as u32) * len);
        }
    }
    packs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_index_finds_smallest_at_least() {
        let mut index = CapacityIndex::new(5000);
        index.next = vec![NONE; 8];
        for (pack, cap) in [(0u32, 7usize), (1, 300), (2, 4097), (3, 64), (4, 5000)] {
            index.push(cap, pack);
        }
        assert_eq!(index.find_at_least(0), Some(7));
        assert_eq!(index.find_at_least(8), Some(64));
        assert_eq!(index.find_at_least(65), Some(300));
        assert_eq!(index.find_at_least(301), Some(4097));
        assert_eq!(index.find_at_least(4098), Some(5000));
        assert_eq!(index.pop(5000), 4);
        assert_eq!(index.find_at_least(4098), None);
        assert_eq!(index.pop(64), 3);
        assert_eq!(index.find_at_least(8), Some(300));
    }

    #[test]
    fn room_tree_grows_and_finds_first() {
        let mut rooms = RoomTree::new();
        for leaf in 0..3000 {
            if leaf == rooms.leaves {
                rooms.grow();
            }
            rooms.set(leaf, (leaf % 100) as u32);
        }
        assert_eq!(rooms.first_at_least(99), Some(99));
        assert_eq!(rooms.first_at_least(50), Some(50));
        assert_eq!(rooms.first_at_least(100), None);
    }
}
