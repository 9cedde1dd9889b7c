//! Times packing the multimodal mix of benches/bench_vlm.py (dumped to /tmp/mix_*.bin as
//! int64) with tokens only and with its other budgets (`K1=1`: patches only).
use fastpack_core::{pack_limited, pack_two_level, Levels, Limit, Overlong, PackOptions};

fn read(p: &str) -> Vec<i64> {
    let b = std::fs::read(p).expect("run benches/bench_vlm.py's mix dump first");
    b.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect()
}

fn main() {
    let l = read("/tmp/mix_lengths.bin");
    let p = read("/tmp/mix_patches.bin");
    let im = read("/tmp/mix_images.bin");
    let mut opts = PackOptions::new(8192);
    opts.overlong = Overlong::Drop;
    let all = [
        Limit {
            name: "patches",
            values: &p,
            cap: std::env::var("PCAP").ok().and_then(|v| v.parse().ok()).unwrap_or(32768),
        },
        Limit { name: "images", values: &im, cap: 16 },
    ];
    let limits = if std::env::var("K1").is_ok() { &all[..1] } else { &all[..] };
    let (mut one, mut many) = (f64::MAX, f64::MAX);
    let reps = std::env::var("REPS").ok().and_then(|v| v.parse().ok()).unwrap_or(15);
    for _ in 0..reps {
        let t = std::time::Instant::now();
        let a = pack_two_level(
            &l[..if std::env::var("ONLY").is_ok() { 10 } else { l.len() }],
            &opts,
            &Levels::default(),
        )
        .unwrap();
        one = one.min(t.elapsed().as_secs_f64());
        let t = std::time::Instant::now();
        let b = pack_limited(&l, &opts, &Levels::default(), limits).unwrap();
        many = many.min(t.elapsed().as_secs_f64());
        assert!(b.plan.num_packs() >= a.plan.num_packs());
    }
    println!("min tokens only {:.2} ms, with budgets {:.2} ms", one * 1e3, many * 1e3);
}
