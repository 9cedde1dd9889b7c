//! Level 2: each bucket's packs bin-packed by their fills into groups of at most
//! `group_tokens`, and the pack order that makes every group contiguous.

use crate::error::Result;
use crate::memory;
use crate::shuffle::permutation;
use crate::two_level::Groups;

use super::placement::CapacityIndex;

/// Level-2 groups of one bucket: its packs (indices inside the bucket) grouped
/// contiguously, packs per group and tokens per group.
pub(crate) struct BucketGroups {
    members: Vec<u32>,
    sizes: Vec<u32>,
    fills: Vec<i64>,
}

/// Best-fit decreasing of pack fills (each in `1..=item_max`) into groups of `budget`.
///
/// The capacity index covers rooms `0..=item_max`; a room above `item_max` is keyed as
/// `item_max`, since any item fits it. This is still exact best fit: a group is opened only
/// when no room `>= item_max` exists, so at most one group ever has such a room.
pub(crate) fn group_best_fit(fills: &[u32], item_max: usize, budget: u64) -> Result<BucketGroups> {
    let packs = fills.len();
    let mut hist = memory::try_zeroed::<usize>(item_max + 1, "group histogram")?;
    for &f in fills {
        hist[f as usize] += 1;
    }
    // first[len]: sorted position of the first pack of fill `len`, longest first.
    let mut first = memory::try_zeroed::<usize>(item_max + 2, "group histogram")?;
    for len in (0..item_max).rev() {
        first[len] = first[len + 1] + hist[len + 1];
    }
    let mut cursor = first.clone();
    let mut order = memory::try_zeroed::<u32>(packs, "groups")?;
    for (pack, &f) in fills.iter().enumerate() {
        order[cursor[f as usize]] = pack as u32;
        cursor[f as usize] += 1;
    }
    drop(cursor);

    let mut index = CapacityIndex::new(item_max, 0)?;
    let mut rooms: Vec<u64> = Vec::new();
    let mut group_of = memory::try_zeroed::<u32>(packs, "groups")?;
    for len in (1..=item_max).rev() {
        let (mut pos, mut left) = (first[len], hist[len]);
        while left > 0 {
            let group = match index.find_at_least(len) {
                Some(key) => index.pop(key),
                None => {
                    index.open()?;
                    memory::try_push(&mut rooms, budget, "groups")?;
                    (rooms.len() - 1) as u32
                }
            };
            let room = rooms[group as usize];
            let k = left.min((room / len as u64) as usize);
            group_of[pos..pos + k].fill(group);
            pos += k;
            left -= k;
            let rest = room - (k * len) as u64;
            rooms[group as usize] = rest;
            if rest > 0 {
                index.push(rest.min(item_max as u64) as usize, group);
            }
        }
    }

    let mut sizes = memory::try_zeroed::<u32>(rooms.len(), "groups")?;
    for &g in &group_of {
        sizes[g as usize] += 1;
    }
    let mut next = memory::try_with_capacity::<usize>(rooms.len(), "groups")?;
    let mut acc = 0usize;
    for &s in &sizes {
        next.push(acc);
        acc += s as usize;
    }
    let mut members = memory::try_zeroed::<u32>(packs, "groups")?;
    for (&pack, &g) in order.iter().zip(&group_of) {
        members[next[g as usize]] = pack;
        next[g as usize] += 1;
    }
    let fills = rooms.iter().map(|&r| (budget - r) as i64).collect();
    Ok(BucketGroups { members, sizes, fills })
}

/// The pack order (`order[q]` = the pack at position `q`, packs numbered across buckets
/// from each bucket's `first` pack) and the groups' CSR: buckets in order, the groups
/// shuffled if asked (packs stay in their group).
pub(crate) fn lay_out_groups(
    parts: &[(usize, BucketGroups)],
    budget: u64,
    seed: Option<u64>,
) -> Result<(Vec<u32>, Groups)> {
    let groups: usize = parts.iter().map(|(_, part)| part.sizes.len()).sum();
    let packs: usize = parts.iter().map(|(_, p)| p.members.len()).sum();
    // (bucket, group in the bucket, offset of the group in the bucket's `members`).
    let mut all: Vec<(usize, usize, usize)> = memory::try_with_capacity(groups, "groups")?;
    for (b, (_, part)) in parts.iter().enumerate() {
        let mut at = 0usize;
        for (g, &size) in part.sizes.iter().enumerate() {
            all.push((b, g, at));
            at += size as usize;
        }
    }
    let shuffled = match seed {
        Some(seed) => Some(permutation(groups, seed)?),
        None => None,
    };
    let mut order = memory::try_with_capacity(packs, "the pack order")?;
    let mut group_offsets = memory::try_with_capacity(groups + 1, "group_offsets")?;
    let mut group_fills = memory::try_with_capacity(groups, "group_fills")?;
    group_offsets.push(0i64);
    for q in 0..groups {
        let (b, g, at) = all[shuffled.as_ref().map_or(q, |s| s[q] as usize)];
        let (first, part) = &parts[b];
        let size = part.sizes[g] as usize;
        order.extend(part.members[at..at + size].iter().map(|&m| (first + m as usize) as u32));
        group_offsets.push(order.len() as i64);
        group_fills.push(part.fills[g]);
    }
    Ok((order, Groups { group_offsets, group_fills, group_tokens: budget }))
}
