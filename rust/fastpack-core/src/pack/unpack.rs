//! Phase 6 — unpack: slot words become the plan's `sample_ids` and `seqlens`.

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::memory::Slots;

use super::{LEN_SHIFT, SAMPLE_MASK};

/// Splits every slot's word (see [`super::slot_word`]): the length goes to `seqlens`
/// (over the sorted order, no longer needed), the sample id stays.
pub(crate) fn unpack(sample_ids: &mut [i64], seqlens: &mut [i32]) {
    const CHUNK: usize = 1 << 16;
    sample_ids.par_chunks_mut(CHUNK).zip(seqlens.par_chunks_mut(CHUNK)).for_each(
        |(samples, lens)| {
            for (sample, len) in samples.iter_mut().zip(lens) {
                let word = *sample as u64;
                *len = (word >> LEN_SHIFT) as i32;
                *sample = (word & SAMPLE_MASK) as i64;
            }
        },
    );
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
    let bad = remainder_slots.par_iter().any(|&slot| {
        let slot = slot as usize;
        let Some(&entry) = split_of.get(ids.get(slot) as usize) else { return true };
        ids.set(slot, (entry & u32::MAX as u64) as i64);
        starts.set(slot, ((entry >> 32) * max_len) as i64);
        false
    });
    if bad {
        return Err(Error::invalid("fastpack", "internal error: a split remainder was lost"));
    }
    Ok(())
}
