//! A placement's counts per pack, shared by every placement (best/first fit, in order,
//! under budgets), so none of them imports another for it.

/// Each pack's segments and (when asked) tokens, in placement order: full-piece packs
/// first, then shard by shard.
pub(crate) struct PackCounts {
    /// Packs (the length of `segments` until the layout takes it).
    pub packs: usize,
    pub segments: Vec<u32>,
    /// Empty unless asked for (level-2 groups need it).
    pub fills: Vec<u32>,
    /// Packs of each shard (full-piece packs not included).
    pub shard_packs: Vec<usize>,
}
