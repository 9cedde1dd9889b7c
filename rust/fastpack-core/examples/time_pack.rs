//! Times `pack` on synthetic lengths:
//! `cargo run --release --example time_pack -- N THREADS [sft|pretrain] [bfd|...]`.
//! A quick profile aid for the core; the benchmarks against peers live in `benches/`.

use std::time::Instant;

use fastpack_core::{pack, pool, Overlong, PackOptions, Strategy};

fn main() {
    let n: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(10_000_000);
    let threads: usize = std::env::args().nth(2).and_then(|a| a.parse().ok()).unwrap_or(1);
    // Log-normal-ish lengths from a fixed LCG: no extra dependency, same input every run.
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut uniform = || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    let pretrain = std::env::args().nth(3).as_deref() == Some("pretrain");
    let log_normal = |mean: f64, uniform: &mut dyn FnMut() -> f64| {
        let z = (-2.0 * uniform().ln()).sqrt() * (2.0 * std::f64::consts::PI * uniform()).cos();
        (mean.ln() - 0.5 + z).exp()
    };
    // As in benches/bench_pack.py: SFT-like log-normal (mean 300) clipped to max_len, or
    // pretraining-like 80% log-normal (mean 600) + 20% Pareto(1.5) tail, split over-long.
    let lengths: Vec<i64> = (0..n)
        .map(|_| {
            if !pretrain {
                return (log_normal(300.0, &mut uniform).round() as i64).clamp(1, 4096);
            }
            let body = log_normal(600.0, &mut uniform);
            let tail = 1850.0 * uniform().powf(-1.0 / 1.5);
            let x = if uniform() < 0.2 { tail } else { body };
            (x.round() as i64).clamp(1, 131_072)
        })
        .collect();
    for (name, strategy, shuffle) in [
        ("bfd", Strategy::BestFitDecreasing, None),
        ("bfd+shuffle", Strategy::BestFitDecreasing, Some(1)),
        ("ffd", Strategy::FirstFitDecreasing, None),
        ("next_fit", Strategy::NextFit, None),
    ] {
        if std::env::args().nth(4).is_some_and(|only| only != name) {
            continue;
        }
        let mut opts = PackOptions::new(4096);
        opts.strategy = strategy;
        opts.shuffle_seed = shuffle;
        if pretrain {
            opts.overlong = Overlong::Split;
        }
        let mut best = f64::INFINITY;
        let mut packs = 0;
        for _ in 0..5 {
            let t = Instant::now();
            let plan = pool::install(Some(threads), || pack(&lengths, &opts)).unwrap().unwrap();
            best = best.min(t.elapsed().as_secs_f64());
            packs = plan.num_packs();
        }
        let mut sorted = lengths.clone();
        let t = Instant::now();
        sorted.sort_unstable();
        let sort = t.elapsed().as_secs_f64();
        println!("{name:12} n={n} threads={threads} best {best:.3}s packs {packs} (sort_unstable {sort:.3}s)");
    }
}
