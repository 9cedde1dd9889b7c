//! What the options make of one length, and the tallies of a bucket's input.

use crate::error::{Error, Result};
use crate::length::Length;
use crate::memory;
use crate::plan::{Overlong, PackOptions, Stats, Strategy, MAX_ITEMS};

use super::Input;

/// What one sequence becomes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Class {
    Empty,
    /// One segment of `len` tokens (truncated to the cap when `cut > 0`).
    Whole {
        len: u64,
        cut: u64,
    },
    /// `full` segments of `max_len`, then one of `rest` tokens if `rest > 0`; `len`
    /// tokens in all (reserved slots included).
    Split {
        full: u64,
        rest: u64,
        len: u64,
    },
    Dropped,
    Overlong,
    Negative,
    /// Longer than this bucket's cap, packed by the long bucket.
    Routed,
}

/// The rules of one bucket: its cap, reserve, strategy and over-long policy, and whether
/// sequences over the cap go to a long bucket instead.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rules {
    pub max_len: u64,
    pub reserve: u64,
    pub wrapped: bool,
    /// Every sequence closes its pack (`one_per_pack`).
    pub one_per_pack: bool,
    pub overlong: Overlong,
    pub route_long: bool,
}

impl Rules {
    pub(crate) fn new(opts: &PackOptions, route_long: bool) -> Self {
        Self {
            max_len: opts.max_len,
            reserve: opts.reserve,
            wrapped: opts.strategy == Strategy::Wrapped,
            one_per_pack: opts.strategy == Strategy::OnePerPack,
            overlong: opts.overlong,
            route_long,
        }
    }

    /// The extended length of a sequence that fits as it is, the common case: one compare.
    #[inline(always)]
    pub(crate) fn fits(&self, raw: Option<u64>) -> Option<u64> {
        match raw {
            Some(len) if len.wrapping_sub(1) < self.max_len - self.reserve => {
                Some(len + self.reserve)
            }
            _ => None,
        }
    }

    #[inline(always)]
    pub(crate) fn classify(&self, raw: Option<u64>) -> Class {
        let Some(len) = raw else { return Class::Negative };
        if len == 0 {
            return Class::Empty;
        }
        // Lengths come from at most i64/u64 and `reserve` < 2^24: saturating keeps absurd
        // inputs over-long instead of wrapping them into short ones.
        let extended = len.saturating_add(self.reserve);
        if extended <= self.max_len || self.wrapped {
            return Class::Whole { len: extended, cut: 0 };
        }
        if self.route_long {
            return Class::Routed;
        }
        match self.overlong {
            Overlong::Error => Class::Overlong,
            Overlong::Truncate => Class::Whole { len: self.max_len, cut: extended - self.max_len },
            Overlong::Drop => Class::Dropped,
            Overlong::Split => Class::Split {
                full: extended / self.max_len,
                rest: extended % self.max_len,
                len: extended,
            },
        }
    }
}

/// Per-chunk tallies, merged in chunk order (integer sums: thread-count independent).
#[derive(Default, Clone, Debug)]
pub(crate) struct Tally {
    pub empty: u64,
    pub dropped_sequences: u64,
    pub dropped_tokens: u128,
    pub truncated_sequences: u64,
    pub truncated_tokens: u128,
    pub split_sequences: u64,
    /// Segments of exactly `max_len` from split sequences (each a pack of its own).
    pub full_pieces: u64,
    /// Segments that go through the sort: whole sequences and split remainders.
    pub items: u64,
    pub tokens: u128,
    pub routed: u64,
    pub overlong: u64,
    /// (position in the bucket's input, length) of the first over-long / negative one.
    pub first_overlong: Option<(usize, u64)>,
    pub first_negative: Option<(usize, i128)>,
}

impl Tally {
    fn add(&mut self, j: usize, raw: Option<u64>, class: Class, value: impl FnOnce() -> i128) {
        match class {
            Class::Empty => self.empty += 1,
            Class::Whole { len, cut } => {
                self.items += 1;
                self.tokens += len as u128;
                if cut > 0 {
                    self.truncated_sequences += 1;
                    self.truncated_tokens += cut as u128;
                }
            }
            Class::Split { full, rest, len } => {
                self.split_sequences += 1;
                self.full_pieces += full;
                self.items += (rest > 0) as u64;
                self.tokens += len as u128;
            }
            Class::Dropped => {
                self.dropped_sequences += 1;
                self.dropped_tokens += raw.unwrap_or(0) as u128;
            }
            Class::Routed => self.routed += 1,
            Class::Overlong => {
                self.overlong += 1;
                if self.first_overlong.is_none() {
                    self.first_overlong = Some((j, raw.unwrap_or(0)));
                }
            }
            Class::Negative => {
                if self.first_negative.is_none() {
                    self.first_negative = Some((j, value()));
                }
            }
        }
    }

    pub(crate) fn merge(mut self, other: &Tally) -> Tally {
        self.empty += other.empty;
        self.dropped_sequences += other.dropped_sequences;
        self.dropped_tokens += other.dropped_tokens;
        self.truncated_sequences += other.truncated_sequences;
        self.truncated_tokens += other.truncated_tokens;
        self.split_sequences += other.split_sequences;
        self.full_pieces += other.full_pieces;
        self.items += other.items;
        self.tokens += other.tokens;
        self.routed += other.routed;
        self.overlong += other.overlong;
        self.first_overlong = self.first_overlong.or(other.first_overlong);
        self.first_negative = self.first_negative.or(other.first_negative);
        self
    }

    /// Segments the bucket will write.
    pub(crate) fn segments(&self) -> u128 {
        self.items as u128 + self.full_pieces as u128
    }

    /// The bucket's [`Stats`], or the error its input deserves: a negative length, an
    /// over-long one under `overlong="error"`, or more than the plan can hold.
    pub(crate) fn check<L: Length>(&self, input: Input<'_, L>, rules: &Rules) -> Result<Stats> {
        if let Some((j, v)) = self.first_negative {
            return Err(Error::invalid(
                "lengths",
                format!(
                    "negative length {v} at index {}; lengths must be non-negative integers",
                    input.id(j)
                ),
            ));
        }
        if let Some((j, len)) = self.first_overlong {
            return Err(Error::Overlong {
                count: self.overlong,
                first_index: input.id(j) as u64,
                first_length: len,
                cap: rules.max_len,
                reserve_note: if rules.reserve > 0 {
                    format!(" with {} reserved separator token(s) each", rules.reserve)
                } else {
                    String::new()
                },
            });
        }
        let segments = self.segments();
        if segments > MAX_ITEMS as u128 {
            return Err(Error::overflow(
                "lengths",
                format!(
                    "the plan would hold {segments} segments; at most {MAX_ITEMS} are supported"
                ),
            ));
        }
        let limit = i64::MAX as u128;
        if self.tokens > limit || self.dropped_tokens > limit || self.truncated_tokens > limit {
            return Err(Error::overflow("lengths", "the total number of tokens exceeds 2^63 - 1"));
        }
        Ok(Stats {
            num_sequences: input.lengths.len() as u64 - self.routed,
            empty_sequences: self.empty,
            dropped_sequences: self.dropped_sequences,
            dropped_tokens: self.dropped_tokens as u64,
            truncated_sequences: self.truncated_sequences,
            truncated_tokens: self.truncated_tokens as u64,
            split_sequences: self.split_sequences,
            total_tokens: self.tokens as u64,
        })
    }
}

/// Classifies and tallies one chunk of a bucket's input (its first position is `base`):
/// counts the sortable lengths into `hist` when given, and lists the positions of the
/// sequences routed to the long bucket in `routed`.
pub(crate) fn tally_chunk<L: Length>(
    chunk: &[L],
    base: usize,
    rules: &Rules,
    mut hist: Option<&mut [u32]>,
    routed: &mut Vec<u32>,
) -> Result<Tally> {
    let mut tally = Tally::default();
    // Fast path: a length that fits as it is (most of them). Tokens fit in u64 here: at
    // most 2^32 items of at most 2^24 tokens per chunk.
    let (mut fast_items, mut fast_tokens) = (0u64, 0u64);
    for (j, &raw) in chunk.iter().enumerate() {
        let value = raw.to_u64();
        if let Some(len) = rules.fits(value) {
            if let Some(h) = hist.as_deref_mut() {
                h[len as usize] += 1;
            }
            fast_items += 1;
            fast_tokens += len;
            continue;
        }
        let class = rules.classify(value);
        match class {
            Class::Whole { len, .. } | Class::Split { rest: len, .. } => {
                if let Some(h) = hist.as_deref_mut() {
                    h[len as usize] += (len > 0) as u32;
                }
            }
            // The plan holds at most MAX_ITEMS (< 2^32) sequences: positions fit u32.
            Class::Routed => memory::try_push(routed, (base + j) as u32, "the long bucket")?,
            _ => {}
        }
        tally.add(base + j, value, class, || raw.to_i128());
    }
    tally.items += fast_items;
    tally.tokens += fast_tokens as u128;
    Ok(tally)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(max_len: u64, reserve: u64, overlong: Overlong, route_long: bool) -> Rules {
        Rules { max_len, reserve, wrapped: false, one_per_pack: false, overlong, route_long }
    }

    #[test]
    fn the_fast_path_agrees_with_classify() {
        for reserve in 0..3 {
            for overlong in [Overlong::Error, Overlong::Truncate, Overlong::Split, Overlong::Drop] {
                let r = rules(8, reserve, overlong, false);
                for raw in
                    [None, Some(0), Some(1), Some(5), Some(6), Some(8), Some(9), Some(u64::MAX)]
                {
                    if let Some(len) = r.fits(raw) {
                        assert_eq!(r.classify(raw), Class::Whole { len, cut: 0 }, "{raw:?}");
                    } else {
                        assert!(!matches!(r.classify(raw), Class::Whole { cut: 0, .. }), "{raw:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn classes() {
        let r = rules(8, 1, Overlong::Split, false);
        assert_eq!(r.classify(Some(20)), Class::Split { full: 2, rest: 5, len: 21 });
        assert_eq!(
            r.classify(Some(u64::MAX)).clone(),
            Class::Split { full: u64::MAX / 8, rest: u64::MAX % 8, len: u64::MAX }
        );
        let r = rules(8, 1, Overlong::Truncate, false);
        assert_eq!(r.classify(Some(20)), Class::Whole { len: 8, cut: 13 });
        assert_eq!(rules(8, 0, Overlong::Error, true).classify(Some(9)), Class::Routed);
        assert_eq!(rules(8, 0, Overlong::Error, false).classify(Some(9)), Class::Overlong);
    }
}
