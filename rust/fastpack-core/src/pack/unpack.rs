//! Phase 6 — unpack: slot words become the plan's `sample_ids` and `seqlens`.

use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::memory::{self, Slots};

use super::{LEN_SHIFT, SAMPLE_MASK};

/// Splits every slot's word (see [`super::slot_word`]): the length goes to `seqlens`
/// (over the sorted order, no longer needed), the sample id stays.
pub(crate) fn unpack(sample_ids: &mut [i64], seqlens: &mut Vec<i32>) -> Result<()> {
    memory::fill_from(
        seqlens,
        sample_ids,
        |sample| {
            let word = *sample as u64;
            *sample = (word & SAMPLE_MASK) as i64;
            (word >> LEN_SHIFT) as i32
        },
        "seqlens",
    )
}

/// A split remainder's slot holds its index into `split_of` until here. Resolving it after
/// the replay rather than during it keeps those random reads off the sequential path (and
/// lets them overlap). Each slot is listed once.
pub(crate) fn resolve_remainders(
    remainder_slots: &[u32],
    split_of: &[u64],
    max_len: u64,
    sample_ids: &mut [i64],
    starts: &mut [i64],
) -> Result<()> {
    let (ids, starts) = (Slots::new(sample_ids), Slots::new(starts));
    let lost = AtomicBool::new(false);
    remainder_slots.par_iter().for_each(|&slot| {
        let slot = slot as usize;
        match split_of.get(ids.get(slot) as usize) {
            Some(&entry) => {
                ids.set(slot, (entry & u32::MAX as u64) as i64);
                starts.set(slot, ((entry >> 32) * max_len) as i64);
            }
            None => lost.store(true, Ordering::Relaxed),
        }
    });
    if lost.into_inner() {
        return Err(Error::invalid("fastpack", "internal error: a split remainder was lost"));
    }
    Ok(())
}
