//! Times `gather` of every pack of a bfd plan over SFT-like rows (two int32 columns in
//! 1,000-row chunks), against one copy of the token bytes:
//! `cargo run --release --example time_gather -- ROWS THREADS`.
//! A profile aid for the core; the benchmark against TRL lives in `benches/bench_hf.py`.

use std::time::Instant;

use fastpack_core::column::{Column, Ints, ListChunk, Values};
use fastpack_core::gather::{gather, pack_tokens, GatherOptions, PlanRef};
use fastpack_core::{pack, pool, PackOptions};

const CHUNK_ROWS: usize = 1000;

/// CPU seconds of this process (all threads): steadier than wall time on a busy machine.
fn cpu() -> f64 {
    // SAFETY: getrusage fills the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 * 1e-6;
    t(u.ru_utime) + t(u.ru_stime)
}
const BATCH_TOKENS: i64 = 1 << 22;

fn main() {
    let n: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(1_000_000);
    let threads: usize = std::env::args().nth(2).and_then(|a| a.parse().ok()).unwrap_or(1);
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut uniform = || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    let lengths: Vec<i64> = (0..n)
        .map(|_| {
            let z = (-2.0 * uniform().ln()).sqrt() * (2.0 * std::f64::consts::PI * uniform()).cos();
            (((300f64).ln() - 0.5 + z).exp().round() as i64).clamp(1, 4096)
        })
        .collect();
    let mut offsets = vec![0i32];
    for &l in &lengths {
        offsets.push(offsets.last().unwrap() + l as i32);
    }
    let total = *offsets.last().unwrap() as usize;
    let offsets: &'static [i32] = Box::leak(offsets.into_boxed_slice());
    let tokens: Vec<i32> = (0..total as i32).collect();
    let labels: Vec<i32> = tokens.iter().map(|t| -t).collect();
    let column = |name: &str, values: &'static [i32]| {
        let chunks = (0..n)
            .step_by(CHUNK_ROWS)
            .map(|a| ListChunk {
                offsets: Ints::I32(&offsets[a..(a + CHUNK_ROWS).min(n) + 1]),
                values: Values::of(values),
            })
            .collect();
        Column::new(name, chunks, None).unwrap()
    };
    let tokens: &'static [i32] = Box::leak(tokens.into_boxed_slice());
    let labels: &'static [i32] = Box::leak(labels.into_boxed_slice());
    let columns = [column("input_ids", tokens), column("labels", labels)];
    let plan = pack(&lengths, &PackOptions::new(4096)).unwrap();
    let plan = PlanRef::from(&plan);
    let opts = GatherOptions::new(2);
    for _ in 0..3 {
        let (t, c) = (Instant::now(), cpu());
        let copies: Vec<Vec<i32>> = [tokens, labels].iter().map(|v| v.to_vec()).collect();
        let (copy, copy_cpu) = (t.elapsed().as_secs_f64(), cpu() - c);
        drop(copies);
        let (t, c) = (Instant::now(), cpu());
        let all: Vec<i64> = (0..plan.num_packs() as i64).collect();
        let sizes = pack_tokens(&plan, &all).unwrap();
        let mut outs = Vec::new();
        pool::install(Some(threads), || {
            let mut lo = 0;
            while lo < all.len() {
                let mut hi = lo;
                let mut acc = 0;
                while hi < all.len() && acc < BATCH_TOKENS {
                    acc += sizes[hi];
                    hi += 1;
                }
                outs.push(gather(&plan, &all[lo..hi], &columns, &opts).unwrap());
                lo = hi;
            }
        })
        .unwrap();
        let (took, took_cpu) = (t.elapsed().as_secs_f64(), cpu() - c);
        println!(
            "{n} rows, {total} tokens: copy {copy:.3} s (cpu {copy_cpu:.3}), gather {took:.3} s \
             (cpu {took_cpu:.3}; {:.2}x the copy's), {} batches",
            took_cpu / copy_cpu,
            outs.len()
        );
    }
}
