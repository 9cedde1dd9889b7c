//! The plan: which segment of which sequence goes into which pack, as flat CSR arrays.

use crate::error::{Error, Result};

/// Largest accepted `max_len`. The fit strategies keep an index over every capacity
/// `0..=max_len`, so the cap bounds their memory (16M tokens is far beyond any context).
pub const MAX_LEN_LIMIT: u64 = 1 << 24;

/// Largest number of input sequences or output segments: indices are held as `u32`
/// internally, which halves the memory traffic of the sort.
pub const MAX_ITEMS: u64 = u32::MAX as u64 - 1;

/// How sequences are assigned to packs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// Best-fit decreasing over the whole input: the fewest packs.
    BestFitDecreasing,
    /// First-fit decreasing.
    FirstFitDecreasing,
    /// Order-preserving greedy: start a new pack when the next sequence does not fit.
    NextFit,
    /// Concatenate everything and cut every `max_len` tokens.
    Wrapped,
    /// Every sequence (or piece of a split one) in a pack of its own, in input order: the
    /// padded baseline, one sequence per row.
    OnePerPack,
}

impl Strategy {
    pub const NAMES: &'static str =
        "\"bfd\", \"ffd\", \"next_fit\", \"wrapped\" or \"one_per_pack\"";

    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "bfd" => Ok(Self::BestFitDecreasing),
            "ffd" => Ok(Self::FirstFitDecreasing),
            "next_fit" => Ok(Self::NextFit),
            "wrapped" => Ok(Self::Wrapped),
            "one_per_pack" => Ok(Self::OnePerPack),
            other => Err(Error::invalid(
                "strategy",
                format!("unknown strategy {other:?}; expected one of {}", Self::NAMES),
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::BestFitDecreasing => "bfd",
            Self::FirstFitDecreasing => "ffd",
            Self::NextFit => "next_fit",
            Self::Wrapped => "wrapped",
            Self::OnePerPack => "one_per_pack",
        }
    }
}

/// What happens to a sequence whose length (plus `reserve`) exceeds the cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overlong {
    Error,
    /// Keep the first `max_len - reserve` tokens.
    Truncate,
    /// Cut into pieces of `max_len`, each packed on its own.
    Split,
    Drop,
}

impl Overlong {
    pub const NAMES: &'static str = "\"error\", \"truncate\", \"split\" or \"drop\"";

    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "error" => Ok(Self::Error),
            "truncate" => Ok(Self::Truncate),
            "split" => Ok(Self::Split),
            "drop" => Ok(Self::Drop),
            other => Err(Error::invalid(
                "overlong",
                format!("unknown policy {other:?}; expected one of {}", Self::NAMES),
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Error => "error",
            Self::Truncate => "truncate",
            Self::Split => "split",
            Self::Drop => "drop",
        }
    }
}

/// Options of [`crate::pack`].
#[derive(Debug, Clone)]
pub struct PackOptions {
    pub max_len: u64,
    pub strategy: Strategy,
    pub overlong: Overlong,
    /// Tokens reserved after every sequence (separators inserted when materializing).
    pub reserve: u64,
    /// Shuffle the pack order with this seed.
    pub shuffle_seed: Option<u64>,
    /// Items per independent shard of the fit strategies (default: one global shard, the
    /// exact BFD/FFD). Fixed by the data, never by the thread count, so the plan is the
    /// same on any number of threads.
    pub shard_items: usize,
}

impl PackOptions {
    pub const DEFAULT_SHARD_ITEMS: usize = usize::MAX;

    pub fn new(max_len: u64) -> Self {
        Self {
            max_len,
            strategy: Strategy::BestFitDecreasing,
            overlong: Overlong::Error,
            reserve: 0,
            shuffle_seed: None,
            shard_items: Self::DEFAULT_SHARD_ITEMS,
        }
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.max_len == 0 || self.max_len > MAX_LEN_LIMIT {
            return Err(Error::invalid(
                "max_len",
                format!("got {}; expected an integer in 1..={MAX_LEN_LIMIT}", self.max_len),
            ));
        }
        if self.reserve >= self.max_len {
            return Err(Error::invalid(
                "reserve",
                format!(
                    "got {}; expected fewer tokens than max_len ({}) so that a sequence fits",
                    self.reserve, self.max_len
                ),
            ));
        }
        if self.shard_items == 0 {
            return Err(Error::invalid("shard_items", "got 0; expected at least 1"));
        }
        Ok(())
    }
}

/// Counts of what the plan did with its input. Nothing is lost silently: every input
/// token is either in a segment or counted here as dropped or truncated.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    pub num_sequences: u64,
    /// Sequences of length 0: they hold no token and get no segment.
    pub empty_sequences: u64,
    pub dropped_sequences: u64,
    pub dropped_tokens: u64,
    pub truncated_sequences: u64,
    pub truncated_tokens: u64,
    /// Sequences cut into several segments (`overlong="split"`, or `"wrapped"`).
    pub split_sequences: u64,
    /// Tokens in all segments, reserved separator slots included: `sum(seqlens)`.
    pub total_tokens: u64,
}

impl Stats {
    /// Adds what `other` did with its sequences (every count but `num_sequences`, which
    /// counts an input: a bucket or a segment of the same input must not add it twice).
    pub fn add_outcomes(&mut self, other: &Stats) {
        self.empty_sequences += other.empty_sequences;
        self.dropped_sequences += other.dropped_sequences;
        self.dropped_tokens += other.dropped_tokens;
        self.truncated_sequences += other.truncated_sequences;
        self.truncated_tokens += other.truncated_tokens;
        self.split_sequences += other.split_sequences;
        self.total_tokens += other.total_tokens;
    }
}

/// A packing plan in CSR form. Segment `s` covers positions
/// `starts[s] .. starts[s] + seqlens[s]` of sequence `sample_ids[s]` extended by `reserve`
/// separator slots; pack `p` holds segments `pack_offsets[p] .. pack_offsets[p + 1]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub sample_ids: Vec<i64>,
    pub starts: Vec<i64>,
    pub seqlens: Vec<i32>,
    pub pack_offsets: Vec<i64>,
    pub max_len: u64,
    pub reserve: u64,
    pub strategy: Strategy,
    pub overlong: Overlong,
    pub stats: Stats,
}

impl Plan {
    /// A plan of these arrays, with `opts`' cap, reserve, strategy and over-the-cap policy.
    pub(crate) fn from_arrays(
        sample_ids: Vec<i64>,
        starts: Vec<i64>,
        seqlens: Vec<i32>,
        pack_offsets: Vec<i64>,
        opts: &PackOptions,
        stats: Stats,
    ) -> Self {
        Plan {
            sample_ids,
            starts,
            seqlens,
            pack_offsets,
            max_len: opts.max_len,
            reserve: opts.reserve,
            strategy: opts.strategy,
            overlong: opts.overlong,
            stats,
        }
    }

    pub fn num_packs(&self) -> usize {
        self.pack_offsets.len() - 1
    }

    pub fn num_segments(&self) -> usize {
        self.seqlens.len()
    }

    /// `ceil(total_tokens / max_len)`: no plan can use fewer packs.
    pub fn lower_bound(&self) -> u64 {
        self.bucket().lower_bound()
    }

    /// Fraction of the packs' capacity holding tokens; 1.0 for no pack.
    pub fn efficiency(&self) -> f64 {
        self.bucket().efficiency()
    }

    /// The plan as one bucket of `max_len`, whose metrics define the plan's.
    fn bucket(&self) -> crate::Bucket {
        crate::Bucket {
            max_len: self.max_len,
            num_sequences: self.stats.num_sequences - self.stats.empty_sequences,
            num_packs: self.num_packs() as u64,
            total_tokens: self.stats.total_tokens,
        }
    }

    /// Tokens in each pack (its fill).
    pub fn pack_fills(&self) -> Vec<i64> {
        self.pack_offsets
            .windows(2)
            .map(|w| self.seqlens[w[0] as usize..w[1] as usize].iter().map(|&n| n as i64).sum())
            .collect()
    }
}
