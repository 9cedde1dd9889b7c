//! Thread pools that survive `fork()`.
//!
//! Rayon's global pool is unusable in a forked child (its worker threads are not copied),
//! and PyTorch dataloader workers are forked. So fastpack never touches the global pool:
//! it keeps its own pools, remembers which process built them, and builds new ones in a
//! child.

use std::sync::{Arc, Mutex};

use rayon::ThreadPool;

use crate::error::{Error, Result};

struct Pools {
    pid: u32,
    pools: Vec<(usize, Arc<ThreadPool>)>,
}

static POOLS: Mutex<Option<Pools>> = Mutex::new(None);

/// Threads used when the caller does not say: `RAYON_NUM_THREADS`, else every core.
pub fn default_threads() -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

fn pool(threads: usize) -> Result<Arc<ThreadPool>> {
    let pid = std::process::id();
    let mut guard = POOLS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if guard.as_ref().is_some_and(|p| p.pid != pid) {
        // Forked: the old pools' threads do not exist here. Dropping them would try to
        // signal those threads, so leak them instead.
        if let Some(old) = guard.take() {
            std::mem::forget(old);
        }
    }
    let pools = guard.get_or_insert_with(|| Pools { pid, pools: Vec::new() });
    if let Some((_, p)) = pools.pools.iter().find(|(n, _)| *n == threads) {
        return Ok(p.clone());
    }
    let built = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("fastpack-{i}"))
        .build()
        .map_err(|e| {
            Error::invalid("threads", format!("could not start {threads} threads: {e}"))
        })?;
    let built = Arc::new(built);
    pools.pools.push((threads, built.clone()));
    Ok(built)
}

thread_local! {
    /// A one-thread pool made of the calling thread itself, so that one-thread work runs
    /// right here: handing a small job to a pool thread and waking it costs more (tens of
    /// microseconds) than packing a batch. `None` when this thread is already a worker of
    /// another pool. Built once per thread and never dropped (rayon cannot release a pool
    /// that adopted its builder; the cost is a few KiB per calling thread). It owns no
    /// other thread, so it also survives `fork()`.
    static HERE: Option<&'static ThreadPool> = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .use_current_thread()
        .build()
        .ok()
        .map(|pool| &*Box::leak(Box::new(pool)));
}

/// Runs `f` on a pool of `threads` workers (`None`: [`default_threads`]); one thread means
/// the calling thread.
pub fn install<R: Send>(threads: Option<usize>, f: impl FnOnce() -> R + Send) -> Result<R> {
    let n = threads.unwrap_or_else(default_threads);
    if n == 0 {
        return Err(Error::invalid("threads", "got 0; expected a positive number or None"));
    }
    if n == 1 {
        if let Some(here) = HERE.with(|here| *here) {
            return Ok(here.install(f));
        }
    }
    Ok(pool(n)?.install(f))
}
