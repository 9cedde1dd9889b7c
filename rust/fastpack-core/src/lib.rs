//! fastpack-core: sequence packing for LLM training, with no Python in sight.
//!
//! [`pack`] bin-packs an array of token lengths into packs of at most `max_len` tokens
//! and returns a [`Plan`] in CSR form (see `plan.rs`). [`layout`] turns packs into
//! attention metadata (`cu_seqlens`, `position_ids`). [`pack_two_level`] adds a long
//! bucket with its own cap and level-2 groups of packs under a token budget.
//!
//! ```
//! use fastpack_core::{pack, PackOptions};
//! let plan = pack(&[3u32, 5, 2, 6], &PackOptions::new(8)).unwrap();
//! assert_eq!(plan.num_packs(), 2);
//! assert_eq!(plan.stats.total_tokens, 16);
//! ```

/// `trace!(start, "phase")` prints the time since `start` with the `trace` feature, and
/// compiles to nothing without it.
macro_rules! trace {
    ($start:expr, $phase:expr) => {
        #[cfg(feature = "trace")]
        eprintln!("{:>8.2} ms  {}", $start.elapsed().as_secs_f64() * 1e3, $phase);
    };
}

mod error;
mod fit;
pub mod layout;
mod length;
pub mod materialize;
mod memory;
mod pack;
mod plan;
pub mod pool;
mod shuffle;
mod two_level;

pub use error::{Error, Result};
pub use length::Length;
pub use pack::pack;
pub use plan::{Overlong, PackOptions, Plan, Stats, Strategy, MAX_ITEMS, MAX_LEN_LIMIT};
pub use two_level::{pack_two_level, Bucket, Groups, Levels, TwoLevelPlan, GROUP_TOKENS_LIMIT};
