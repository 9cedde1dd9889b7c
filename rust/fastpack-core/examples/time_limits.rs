//! Times packing 10^6 multimodal items with tokens only and with two more budgets (the
//! minimum of 15 calls each): `cargo run --release --example time_limits`; `ONLY=1` times the
//! budgets alone, for a profiler.
use fastpack_core::{pack_limited, pack_two_level, Levels, Limit, PackOptions};
fn main() {
    let n = 1_000_000usize;
    let mut x: u64 = 12345;
    let mut rnd = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let (mut l, mut p, mut im) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..n {
        l.push((20 + rnd() % 2980) as u32);
        let pp = if rnd() % 10 < 8 { (rnd() % 4000) as i64 } else { 0 };
        p.push(pp);
        im.push(if pp > 0 { 1 + (rnd() % 3) as i64 } else { 0 });
    }
    let opts = PackOptions::new(4096);
    let limits = [
        Limit { name: "patches", values: &p, cap: 16384 },
        Limit { name: "images", values: &im, cap: 8 },
    ];
    let (mut one, mut two) = (f64::MAX, f64::MAX);
    for _ in 0..15 {
        let t = std::time::Instant::now();
        let a = if std::env::var("ONLY").is_ok() {
            pack_two_level(&l[..10], &opts, &Levels::default()).unwrap()
        } else {
            pack_two_level(&l, &opts, &Levels::default()).unwrap()
        };
        one = one.min(t.elapsed().as_secs_f64());
        let t = std::time::Instant::now();
        let b = pack_limited(&l, &opts, &Levels::default(), &limits).unwrap();
        two = two.min(t.elapsed().as_secs_f64());
        let _ = (a, b);
    }
    println!("min one budget {:.1} ms, three budgets {:.1} ms", one * 1e3, two * 1e3);
}
