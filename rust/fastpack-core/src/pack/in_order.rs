//! The order-preserving strategies, `next_fit`, `wrapped` and `one_per_pack`: one sequential
//! walk over the input, run twice — to count each pack's segments (their placement), then
//! to write them (their replay). `one_per_pack` is `next_fit` whose every sequence closes
//! its pack (the padded baseline: one sequence, or piece of one, per pack).

use crate::error::{Error, Result};
use crate::length::Length;
use crate::memory::{self, Cursors, Slots};
use crate::plan::MAX_ITEMS;

use super::classify::{Class, Rules, Tally};
use super::counts::PackCounts;
use super::{slot_word, Input};

/// Emits `(pack, id, start, len)` in input order, until `emit` returns false; returns how
/// many sequences were cut across packs (wrapped only).
fn walk<L: Length>(
    input: Input<'_, L>,
    rules: &Rules,
    mut emit: impl FnMut(u32, u32, u64, u64) -> bool,
) -> u64 {
    let m = rules.max_len;
    let mut packs = 0u32;
    let mut fill = m; // no open pack yet: "full"
    let mut cut = 0u64;
    for (j, &raw) in input.lengths.iter().enumerate() {
        let id = input.id(j);
        match rules.classify(raw.to_u64()) {
            Class::Whole { len, .. } if rules.wrapped => {
                let mut start = 0;
                let mut pieces = 0u64;
                while start < len {
                    if fill == m {
                        packs += 1;
                        fill = 0;
                    }
                    let take = (m - fill).min(len - start);
                    if !emit(packs - 1, id, start, take) {
                        return cut;
                    }
                    fill += take;
                    start += take;
                    pieces += 1;
                }
                cut += (pieces > 1) as u64;
            }
            Class::Whole { len, .. } => {
                if fill + len > m {
                    packs += 1;
                    fill = 0;
                }
                if !emit(packs - 1, id, 0, len) {
                    return cut;
                }
                fill += len;
            }
            Class::Split { full, rest, .. } => {
                for piece in 0..full {
                    packs += 1;
                    if !emit(packs - 1, id, piece * m, m) {
                        return cut;
                    }
                    fill = m;
                }
                if rest > 0 {
                    if fill + rest > m {
                        packs += 1;
                        fill = 0;
                    }
                    if !emit(packs - 1, id, full * m, rest) {
                        return cut;
                    }
                    fill += rest;
                }
            }
            _ => {}
        }
        if rules.one_per_pack {
            fill = m; // closed: the next sequence opens a pack of its own
        }
    }
    cut
}

/// The first walk: each pack's segments and tokens, and the number of sequences cut
/// across packs. `tally` is the bucket's: `wrapped` holds exactly `ceil(tokens / max_len)`
/// packs, refused before any is counted if the plan cannot hold them. A walk that finds
/// other segments or tokens than the tally did (the caller changed the array meanwhile)
/// stops as soon as it can tell, an error.
pub(crate) fn count<L: Length>(
    input: Input<'_, L>,
    rules: &Rules,
    tally: &Tally,
) -> Result<(PackCounts, u64)> {
    let tokens = tally.tokens as u64;
    let (packs_hint, most) = if rules.wrapped {
        let packs = tokens.div_ceil(rules.max_len);
        let segments = tally.items as u128 + packs.saturating_sub(1) as u128;
        if packs > MAX_ITEMS || segments > MAX_ITEMS as u128 {
            return Err(Error::overflow(
                "lengths",
                format!(
                    "strategy \"wrapped\" would cut {tokens} tokens into {packs} packs of {} \
                     tokens; at most {MAX_ITEMS} packs and segments are supported",
                    rules.max_len
                ),
            ));
        }
        (packs as usize, segments as u64)
    } else {
        (0, tally.segments() as u64)
    };
    // Fills are kept whatever the options: the second walk checks them too.
    let mut segments = memory::try_with_capacity::<u32>(packs_hint, "pack counts")?;
    let mut fills = memory::try_with_capacity::<u32>(packs_hint, "pack fills")?;
    let (mut total, mut tokens_seen) = (0u64, 0u64);
    let mut failed = None;
    let cut = walk(input, rules, |pack, _, _, len| {
        total += 1;
        tokens_seen = tokens_seen.saturating_add(len);
        if total > most || tokens_seen > tokens {
            failed = Some(Error::input_changed("lengths"));
            return false;
        }
        if pack as usize == segments.len() {
            let pushed = memory::try_push(&mut segments, 0, "pack counts")
                .and_then(|()| memory::try_push(&mut fills, 0, "pack fills"));
            if let Err(e) = pushed {
                failed = Some(e);
                return false;
            }
        }
        segments[pack as usize] += 1;
        fills[pack as usize] += len as u32;
        true
    });
    if let Some(e) = failed {
        return Err(e);
    }
    if (!rules.wrapped && total != most) || tokens_seen != tokens {
        return Err(Error::input_changed("lengths"));
    }
    let packs = segments.len();
    Ok((PackCounts { packs, segments, fills, shard_packs: vec![packs] }, cut))
}

/// The second walk writes every segment to its pack's next slot, through the packs'
/// cursors. The input is read again: a walk that finds other packs than the first one did
/// (segments or tokens: the caller changed the array between the two walks) is an error,
/// and writes nothing outside its packs' slots.
pub(crate) fn write<L: Length>(
    input: Input<'_, L>,
    rules: &Rules,
    counts: &PackCounts,
    mut cursors: Cursors<'_, i64>,
    starts: &Slots<'_, i64>,
) -> Result<()> {
    let packs = counts.packs;
    let mut tokens_left = memory::try_with_capacity::<u32>(packs, "pack fills")?;
    tokens_left.extend_from_slice(&counts.fills);
    let mut changed = false;
    walk(input, rules, |pack, id, start, len| {
        let pack = pack as usize;
        let slot = match tokens_left.get_mut(pack) {
            Some(t) if *t as u64 >= len => {
                *t -= len as u32;
                cursors.push(pack, slot_word(len, id))
            }
            _ => None,
        };
        match slot {
            Some(slot) => {
                if start != 0 {
                    starts.set(slot, start as i64);
                }
                true
            }
            None => {
                changed = true;
                false
            }
        }
    });
    // (Each pack's slots all written is checked by the tiles.)
    if changed || tokens_left.iter().any(|&n| n != 0) {
        return Err(Error::input_changed("lengths"));
    }
    Ok(())
}
