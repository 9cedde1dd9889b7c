//! fastpack-core: sequence packing for LLM training, with no Python in sight.
//!
//! [`pack`] bin-packs an array of token lengths into packs of at most `max_len` tokens
//! and returns a [`Plan`] in CSR form (see `plan.rs`). [`layout`] turns packs into
//! attention metadata (`cu_seqlens`, `position_ids`). [`pack_two_level`] adds a long
//! bucket with its own cap and level-2 groups of packs under a token budget.
//! [`materialize`] builds training rows of chosen packs, and [`gather`] whole packed
//! columns, from token data read in place as Arrow list [`column`]s.
//!
//! ```
//! use fastpack_core::{pack, PackOptions};
//! let plan = pack(&[3u32, 5, 2, 6], &PackOptions::new(8)).unwrap();
//! assert_eq!(plan.num_packs(), 2);
//! assert_eq!(plan.stats.total_tokens, 16);
//! ```

/// `trace!(start, "phase")` records the time since `start` with the `trace` feature (printed
/// by `trace_print!()`, so printing does not disturb the timing), and compiles to nothing
/// without it.
macro_rules! trace {
    ($start:expr, $phase:expr) => {
        #[cfg(feature = "trace")]
        crate::TRACE
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(($start.elapsed().as_secs_f64() * 1e3, $phase));
    };
}

macro_rules! trace_print {
    () => {
        #[cfg(feature = "trace")]
        for (ms, phase) in
            std::mem::take(&mut *crate::TRACE.lock().unwrap_or_else(|e| e.into_inner()))
        {
            eprintln!("{ms:>8.2} ms  {phase}");
        }
    };
}

#[cfg(feature = "trace")]
static TRACE: std::sync::Mutex<Vec<(f64, &str)>> = std::sync::Mutex::new(Vec::new());

pub mod column;
pub mod context_parallel;
mod error;
pub mod gather;
pub mod layout;
mod length;
pub mod materialize;
mod memory;
mod pack;
mod plan;
pub mod pool;
pub mod schedule;
mod shuffle;
pub mod targets;
pub mod tree;
mod two_level;
pub mod vlm;

pub use error::{Error, Result};

/// Proptest cases: `default`, or `PROPTEST_CASES` when set (CI runs fewer in a debug
/// build; a long run sets many).
#[cfg(test)]
pub(crate) fn proptest_cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}
pub use length::Length;
pub use pack::limits::{Limit, LimitUse, LIMIT_CAP, MAX_LIMITS};
pub use pack::{
    best_fit_oldest, measure_affinity, pack, pack_affinity, pack_limited, pack_segments,
    pack_two_level, Affinity, AffinityPlan, SegmentsPlan,
};
pub use plan::{Overlong, PackOptions, Plan, Stats, Strategy, MAX_ITEMS, MAX_LEN_LIMIT};
pub use two_level::{
    bucket_metrics, metrics, Bucket, Groups, Levels, Metrics, PlanArrays, TwoLevelPlan,
    GROUP_TOKENS_LIMIT,
};
