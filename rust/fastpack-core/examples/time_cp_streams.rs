//! Times `context_parallel::streams_layout` over a plan of SFT-like lengths:
//! `cargo run --release --example time_cp_streams -- N THREADS [REPS [MODE CP]]`.
//! A quick profile aid for the core (callgrind counts it repeatably on shared cores); the
//! benchmark against the floor of copying its outputs is `benches/bench_context_parallel.py`.

use std::time::Instant;

use fastpack_core::context_parallel::{streams_layout, CpMode, CpSpec};
use fastpack_core::{pack, pool, PackOptions};

fn main() {
    let arg = |i: usize| std::env::args().nth(i).and_then(|a| a.parse::<usize>().ok());
    let n = arg(1).unwrap_or(10_000_000);
    let threads = arg(2).unwrap_or(2);
    let reps = arg(3).unwrap_or(9);
    // SFT-like log-normal lengths (mean 300, clipped to 4096) from a fixed LCG.
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut uniform = || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    let lengths: Vec<i64> = (0..n)
        .map(|_| {
            let z = (-2.0 * uniform().ln()).sqrt() * (2.0 * std::f64::consts::PI * uniform()).cos();
            ((300f64.ln() - 0.5 + z).exp().round() as i64).clamp(1, 4096)
        })
        .collect();
    let mut opts = PackOptions::new(4096);
    opts.shuffle_seed = Some(0);
    let plan = pool::install(Some(threads), || pack(&lengths, &opts)).unwrap().unwrap();
    for (cp, mode) in
        [(2, CpMode::Zigzag), (2, CpMode::Contiguous), (8, CpMode::Zigzag), (8, CpMode::Contiguous)]
    {
        let only = std::env::args().nth(4);
        if only.is_some_and(|m| m != mode.name() || arg(5).is_some_and(|c| c as u64 != cp)) {
            continue;
        }
        let spec = CpSpec::new(cp, mode, 1).unwrap();
        let mut times = Vec::new();
        let mut bytes = 0;
        for _ in 0..reps {
            let t = Instant::now();
            let out = pool::install(Some(threads), || {
                streams_layout(&plan.seqlens, &plan.pack_offsets, spec, true)
            })
            .unwrap()
            .unwrap();
            times.push(t.elapsed().as_secs_f64());
            bytes = out.padded_tokens.len() * 8 + out.work.len() * 8;
        }
        times.sort_by(f64::total_cmp);
        println!(
            "cp={cp} {:10} segments={} packs={} bytes={:.1}MiB median {:.1} ms best {:.1} ms",
            mode.name(),
            plan.seqlens.len(),
            plan.num_packs(),
            bytes as f64 / (1 << 20) as f64,
            times[times.len() / 2] * 1e3,
            times[0] * 1e3
        );
    }
}
