"""fastpack at corpus scale: 10^7 and 10^8 lengths, max_len 4096.

Reports, per distribution (SFT-like and pretraining-like, as in bench_pack.py) and size:

- the time of ``fastpack.pack`` (default threads) against ``numpy.sort`` on the same array,
- the peak memory of the pack beyond the input array, in bytes per sequence (VmHWM growth
  after ``echo 5 > /proc/self/clear_refs``, in a fresh subprocess, output included),
- the extra packs of sharded BFD (independent shards of ``shard_items`` = 2^22) against the
  default, one global BFD, and whether the plan on 1 thread is identical to the plan on
  the default number of threads (a BLAKE2 digest of the CSR arrays),
- at 10^7, two-level packing (``group_tokens``) against the alternatives at the same token
  budget B: batching a fixed number (B / max_len) of shuffled level-1 packs, and
  single-level packing straight into packs of B tokens; and short/long buckets for the
  pretraining-like data.

    python benches/bench_scale.py                      # 10^7 and 10^8, ~5-10 min on 2 cores
    python benches/bench_scale.py --sizes 1e6 --out /tmp/scale.md   # quick check

Every subprocess generates its input deterministically in chunks (int32), so the input is
the only thing alive when the peak counter is reset. Results go to benches/results/scale.md
(and scale.json).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

MAX_LEN = 4096
SHARD_ITEMS = 1 << 22
CHUNK = 1 << 22
HERE = Path(__file__).resolve().parent


# --------------------------------------------------------------------------- inputs
def gen_lengths(dist: str, n: int, seed: int = 0) -> np.ndarray:
    """The distributions of bench_pack.py, generated chunk by chunk into int32."""
    out = np.empty(n, dtype=np.int32)
    for i, lo in enumerate(range(0, n, CHUNK)):
        m = min(CHUNK, n - lo)
        rng = np.random.default_rng([seed, i])
        if dist == "sft":
            # log-normal, sigma 1, mean 300 before clipping to [1, 4096]
            x = rng.lognormal(math.log(300) - 0.5, 1.0, m)
            out[lo : lo + m] = np.clip(np.rint(x), 1, MAX_LEN)
        elif dist == "pretrain":
            # 80% log-normal body (mean 600) + 20% Pareto(1.5, x_m=1850) tail, clipped to
            # [1, 131072]: mean ~1,500 tokens, ~6.5% of documents longer than 4096.
            body = rng.lognormal(math.log(600) - 0.5, 1.0, m)
            tail = 1850.0 * (rng.pareto(1.5, m) + 1.0)
            x = np.where(rng.random(m) < 0.2, tail, body)
            out[lo : lo + m] = np.clip(np.rint(x), 1, 131072)
        else:
            raise ValueError(dist)
    return out


def overlong_of(dist: str) -> str:
    return "split" if dist == "pretrain" else "error"


# --------------------------------------------------------------------------- memory
def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM:", "VmRSS:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak() -> int:
    """Reset VmHWM to the current RSS (Linux >= 4.0) and return that RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status()["VmRSS"]


def digest(plan) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in ("sample_ids", "starts", "seqlens", "pack_offsets"):
        h.update(np.ascontiguousarray(getattr(plan, name)).data)
    return h.hexdigest()


def spread(x: np.ndarray, cap: int | None = None) -> dict[str, float]:
    out = {"min": int(x.min()), "p1": float(np.percentile(x, 1)), "median": float(np.median(x)),
           "max": int(x.max())}
    if cap:
        out["full"] = float((x >= 0.99 * cap).mean())
    return out


# --------------------------------------------------------------------------- worker
def worker(task: str, dist: str, n: int, reps: int) -> dict:
    import fastpack
    from fastpack import _core

    lengths = gen_lengths(dist, n)
    overlong = overlong_of(dist)
    out: dict = {"task": task, "dist": dist, "n": n, "tokens": int(lengths.sum(dtype=np.int64))}

    def timed(fn):
        base = reset_peak()
        t0 = time.perf_counter()
        result = fn()
        times = [time.perf_counter() - t0]
        out["peak_bytes_per_seq"] = (_status()["VmHWM"] - base) / n
        for _ in range(reps - 1):
            del result
            t0 = time.perf_counter()
            result = fn()
            times.append(time.perf_counter() - t0)
        out["time_s"] = float(np.median(times))
        out["times_s"] = times
        return result

    if task == "numpy.sort":
        timed(lambda: np.sort(lengths))
    elif task in ("pack", "pack-1thread"):
        threads = 1 if task == "pack-1thread" else None
        plan = timed(lambda: fastpack.pack(lengths, MAX_LEN, overlong=overlong, threads=threads,
                                           shuffle=False))
        out.update(packs=plan.num_packs, lower_bound=plan.lower_bound,
                   efficiency=plan.efficiency, digest=digest(plan), threads=threads or
                   fastpack._core.default_threads())
    elif task == "pack-groups":
        plan = timed(lambda: fastpack.pack(lengths, MAX_LEN, overlong=overlong,
                                           group_tokens=65536, shuffle=True, seed=0))
        out.update(packs=plan.num_packs, groups=plan.num_groups)
    elif task == "pack-sharded":
        fields = timed(lambda: _core.pack(lengths, MAX_LEN, "bfd", overlong, 0, None, None,
                                          SHARD_ITEMS))
        out["packs"] = len(fields["pack_offsets"]) - 1
    elif task.startswith("groups-"):
        budget = int(task.split("-")[1])
        out["budget"] = budget
        plan = timed(lambda: fastpack.pack(lengths, MAX_LEN, overlong=overlong,
                                           group_tokens=budget, shuffle=True, seed=0))
        assert plan.group_fills is not None
        out["two_level"] = {
            "packs": plan.num_packs, "pack_efficiency": plan.efficiency,
            "groups": plan.num_groups, "group_lower_bound": plan.group_lower_bound,
            "group_efficiency": plan.group_efficiency, "tokens": spread(plan.group_fills, budget),
        }
        # Baseline 1: the same level-1 packs, shuffled, batched B / max_len at a time.
        level1 = fastpack.pack(lengths, MAX_LEN, overlong=overlong, shuffle=True, seed=0)
        k = budget // MAX_LEN
        fills = level1.pack_fills
        batches = np.add.reduceat(fills, np.arange(0, len(fills), k))
        out["fixed_batches"] = {
            "batches": len(batches), "packs_per_batch": k,
            "efficiency": level1.total_tokens / (len(batches) * budget),
            "tokens": spread(batches, budget),
        }
        del level1, fills, batches
        # Where groups matter: order-preserving level 1 (next_fit) leaves uneven packs.
        nf = fastpack.pack(lengths, MAX_LEN, overlong=overlong, strategy="next_fit",
                           group_tokens=budget, shuffle=True, seed=0)
        assert nf.group_fills is not None
        nf_fills = fastpack.pack(lengths, MAX_LEN, overlong=overlong, strategy="next_fit",
                                 shuffle=True, seed=0).pack_fills
        nf_batches = np.add.reduceat(nf_fills, np.arange(0, len(nf_fills), k))
        out["next_fit"] = {
            "pack_efficiency": nf.efficiency, "groups": nf.num_groups,
            "group_lower_bound": nf.group_lower_bound, "group_efficiency": nf.group_efficiency,
            "tokens": spread(nf.group_fills, budget), "batches": len(nf_batches),
            "batch_efficiency": nf.total_tokens / (len(nf_batches) * budget),
            "batch_tokens": spread(nf_batches, budget),
        }
        del nf, nf_fills, nf_batches
        # Baseline 2: single-level packing straight into rows of B tokens.
        single = fastpack.pack(lengths, budget, overlong=overlong, shuffle=False)
        out["single_level"] = {
            "packs": single.num_packs, "lower_bound": single.lower_bound,
            "efficiency": single.efficiency, "tokens": spread(single.pack_fills, budget),
            "longest_row_sequences": int(np.diff(single.pack_offsets).max()),
        }
    elif task == "buckets":
        long_max_len, budget = 32768, 65536
        plan = timed(lambda: fastpack.pack(lengths, MAX_LEN, overlong=overlong, shuffle=False,
                                           long_max_len=long_max_len, group_tokens=budget))
        assert plan.group_fills is not None
        caps = plan.pack_caps[plan.group_offsets[:-1]]
        out["long_max_len"], out["budget"] = long_max_len, budget
        out["buckets"] = [
            {"name": b.name, "max_len": b.max_len, "sequences": b.num_sequences,
             "packs": b.num_packs, "efficiency": b.efficiency, "lower_bound": b.lower_bound}
            for b in plan.buckets
        ]
        out["groups"] = {
            name: {"groups": int((caps == cap).sum()), "tokens": spread(plan.group_fills[
                caps == cap], budget)}
            for name, cap in (("short", MAX_LEN), ("long", long_max_len)) if (caps == cap).any()
        }
        out["group_efficiency"] = plan.group_efficiency
        out["split_sequences"] = plan.split_sequences
    else:
        raise ValueError(task)
    return out


# --------------------------------------------------------------------------- driver
def run(task: str, dist: str, n: int, reps: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", json.dumps([task, dist, n, reps])]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{task} {dist} {n}: {proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"  {task:14s} {dist:9s} n={n:.0e}: {result.get('time_s', 0):7.2f} s "
          f"(subprocess {time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return result


def fmt_n(n: int) -> str:
    e = int(round(math.log10(n)))
    return f"10^{e}" if 10**e == n else f"{n:,}"


def render(results: list[dict], env: dict) -> str:
    by = {(r["task"], r["dist"], r["n"]): r for r in results}
    sizes = sorted({r["n"] for r in results})
    dists = [d for d in ("sft", "pretrain") if any(r["dist"] == d for r in results)]
    lines = [
        "# fastpack at scale",
        "",
        f"`python benches/bench_scale.py` on {env['cpus']} CPU cores ({env['machine']}), "
        f"{env['date']}, fastpack {env['fastpack']}, numpy {env['numpy']}. max_len = 4096; "
        "lengths int32, generated as in `bench_pack.py` (SFT-like: log-normal mean ~300 "
        "clipped to [1, 4096]; pretraining-like: log-normal + Pareto tail, mean ~1,500, "
        "~6.5% over 4096, `overlong=\"split\"`). Each cell is a fresh subprocess; times "
        "are the median of the repeats at 10^7 and one call at 10^8 (wall clock; 5-minute "
        f"load average at the end {env['loadavg']:.1f}: the machine was shared).",
        "",
        "## Time and memory",
        "",
        "peak = VmHWM growth during the first `pack` call beyond the input array (output "
        "included), bytes per input sequence. Sharding: packs of a sharded BFD (independent "
        "shards of 2^22 items, `shard_items`) against the default, one global BFD. "
        "Threads: digest of the plan on 1 thread against the default. With groups: "
        "`pack(..., group_tokens=65536, shuffle=True)`.",
        "",
        "| data | N | fastpack.pack | numpy.sort | ratio | 1 thread | peak B/seq | packs | "
        "lower bound | sharded BFD packs | sharding extra | thread-independent | with groups: "
        "time, peak B/seq |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for dist in dists:
        for n in sizes:
            p, s = by.get(("pack", dist, n)), by.get(("numpy.sort", dist, n))
            one, g = by.get(("pack-1thread", dist, n)), by.get(("pack-sharded", dist, n))
            if not p:
                continue
            ratio = f"{p['time_s'] / s['time_s']:.2f}x" if s else "n/a"
            extra = "n/a"
            if g:
                more = g["packs"] - p["packs"]
                extra = f"{more / p['packs']:+.4%} ({more:+,})"
            same = ("yes" if one["digest"] == p["digest"] else "**NO**") if one else "n/a"
            sort_t = f"{s['time_s']:.2f} s" if s else "n/a"
            one_t = f"{one['time_s']:.2f} s" if one else "n/a"
            global_packs = f"{g['packs']:,}" if g else "n/a"
            gr = by.get(("pack-groups", dist, n))
            grouped = f"{gr['time_s']:.2f} s, {gr['peak_bytes_per_seq']:.1f}" if gr else "n/a"
            lines.append(
                f"| {dist} | {fmt_n(n)} | {p['time_s']:.2f} s | {sort_t} | {ratio} | {one_t} | "
                f"{p['peak_bytes_per_seq']:.1f} | {p['packs']:,} | {p['lower_bound']:,} | "
                f"{global_packs} | {extra} | {same} | {grouped} |"
            )
    group_rows = [r for r in results if r["task"].startswith("groups-")]
    if group_rows:
        lines += [
            "",
            "## Two-level packing against the alternatives at the same token budget B",
            "",
            "Tokens per step when a step gets B tokens: *two-level* = `pack(..., "
            "group_tokens=B, shuffle=True)` (level 1 packs of 4096, level 2 BFD of packs into "
            "groups of <= B, groups shuffled); *fixed batches* = the same shuffled level-1 "
            "packs taken B/4096 at a time (a plain dataloader); *single level* = "
            "`pack(lengths, max_len=B)` (one row of B tokens, no 4096 bound per row). "
            "Efficiency = tokens / (steps x B); p1 = 1st percentile.",
            "",
                "| data | N | B | method | steps | tokens/step min / p1 / median / max | steps "
            ">= 0.99 B | efficiency (level 1 / level 2) | time |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sorted(group_rows, key=lambda r: (r["dist"], r["n"], r["budget"])):
            t, f, s = r["two_level"], r["fixed_batches"], r["single_level"]
            head = f"| {r['dist']} | {fmt_n(r['n'])} | {r['budget']:,} |"

            def sp(x):
                return (f"{x['min']:,} / {x['p1']:,.0f} / {x['median']:,.0f} / {x['max']:,} | "
                        f"{x['full']:.2%}")

            lines.append(
                f"{head} two-level | {t['groups']:,} (bound {t['group_lower_bound']:,}) | "
                f"{sp(t['tokens'])} | {t['pack_efficiency']:.4%} / {t['group_efficiency']:.4%}"
                f" | {r['time_s']:.2f} s |"
            )
            lines.append(
                f"{head} fixed batches of {f['packs_per_batch']} packs | {f['batches']:,} | "
                f"{sp(f['tokens'])} | {t['pack_efficiency']:.4%} / {f['efficiency']:.4%} | |"
            )
            lines.append(
                f"{head} single level (max_len = B) | {s['packs']:,} (bound "
                f"{s['lower_bound']:,}) | {sp(s['tokens'])} | {s['efficiency']:.4%} | |"
            )
            nf = r["next_fit"]
            lines.append(
                f"{head} next_fit level 1, two-level | {nf['groups']:,} (bound "
                f"{nf['group_lower_bound']:,}) | {sp(nf['tokens'])} | "
                f"{nf['pack_efficiency']:.4%} / {nf['group_efficiency']:.4%} | |"
            )
            lines.append(
                f"{head} next_fit level 1, fixed batches | {nf['batches']:,} | "
                f"{sp(nf['batch_tokens'])} | {nf['pack_efficiency']:.4%} / "
                f"{nf['batch_efficiency']:.4%} | |"
            )
    for r in (r for r in results if r["task"] == "buckets"):
        lines += [
            "",
            f"## Buckets: {r['dist']}, {fmt_n(r['n'])}, long_max_len = {r['long_max_len']:,}, "
            f"group_tokens = {r['budget']:,}",
            "",
            f"`pack(lengths, 4096, overlong=\"split\", long_max_len={r['long_max_len']}, "
            f"group_tokens={r['budget']})` in {r['time_s']:.2f} s, peak "
            f"{r['peak_bytes_per_seq']:.1f} B/seq; {r['split_sequences']:,} sequences over "
            f"the long cap split. Overall group efficiency {r['group_efficiency']:.4%}.",
            "",
            "| bucket | cap | sequences | packs | lower bound | efficiency | groups | "
            "tokens/group min / p1 / median / max | groups >= 0.99 B |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for b in r["buckets"]:
            g = r["groups"].get(b["name"])
            gs = (f"{g['groups']:,} | {g['tokens']['min']:,} / {g['tokens']['p1']:,.0f} / "
                  f"{g['tokens']['median']:,.0f} / {g['tokens']['max']:,} | "
                  f"{g['tokens']['full']:.2%}") if g else "0 | n/a | n/a"
            lines.append(
                f"| {b['name']} | {b['max_len']:,} | {b['sequences']:,} | {b['packs']:,} | "
                f"{b['lower_bound']:,} | {b['efficiency']:.4%} | {gs} |"
            )
    return "\n".join(lines) + "\n"


def env_info() -> dict:
    import fastpack

    return {
        "cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
        "numpy": np.__version__, "fastpack": fastpack.__version__,
        "date": time.strftime("%Y-%m-%d"), "loadavg": os.getloadavg()[1],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default="1e7,1e8")
    ap.add_argument("--dists", default="sft,pretrain")
    ap.add_argument("--budgets", default="65536,1048576",
                    help="group_tokens budgets for the two-level comparison (at 10^7)")
    ap.add_argument("--out", default=str(HERE / "results" / "scale.md"))
    args = ap.parse_args(argv)
    if args.worker:
        task, dist, n, reps = json.loads(args.worker)
        print(json.dumps(worker(task, dist, n, reps)))
        return

    sizes = [int(float(s)) for s in args.sizes.split(",")]
    dists = args.dists.split(",")
    budgets = [int(b) for b in args.budgets.split(",")]
    results = []
    for n in sizes:
        reps = 3 if n <= 10**7 else 1
        for dist in dists:
            for task in ("numpy.sort", "pack", "pack-1thread", "pack-sharded", "pack-groups"):
                results.append(run(task, dist, n, reps))
    small = min(sizes)
    for dist in dists:
        for b in budgets:
            results.append(run(f"groups-{b}", dist, small, 1))
    if "pretrain" in dists:
        results.append(run("buckets", "pretrain", small, 1))
    env = env_info()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(results, env))
    out.with_suffix(".json").write_text(json.dumps({"env": env, "results": results}, indent=1))
    print(out.read_text())


if __name__ == "__main__":
    main()
