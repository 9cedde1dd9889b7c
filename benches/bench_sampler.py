"""Per-step imbalance across data-parallel ranks, and the time to build an epoch's schedule:
fastpack's PackedSampler against torch's DistributedSampler over the same PackedDataset and
axolotl's multipack sampler.

What runs (one process, the same lengths for every sampler):

- *fastpack*: ``PackedDataset(..., group_tokens=B)`` (packs of 4096 bin-packed into steps
  of at most B tokens; pretraining-like: ``long_max_len=32768``) and
  ``PackedSampler(balance="flops")``; also ``balance=None`` (the same steps, not
  balanced) and ``balance="tokens"``.
- *DistributedSampler*: ``torch.utils.data.DistributedSampler(dataset, R, r, shuffle=True)``
  over that same PackedDataset (it repeats steps to even the ranks out).
- *axolotl multipack*: ``axolotl.utils.samplers.multipack.MultipackBatchSampler`` over a
  ``RandomSampler`` of the sequences, as axolotl's trainer builds it (``batch_size=1``
  bin of ``batch_max_len=B`` tokens per step, ``bin_size=200``, ``group_size=100000``),
  its batches then dealt to the ranks as accelerate does (rank r takes batches r, R + r, ...;
  the last global step is completed by repeating the first batches).

Per global step, the work of each rank is ``6·h·Σl + Σl²`` (h = 4096) over its sequences,
or its tokens Σl; the imbalance of a global step is max/mean over the R ranks. The
per-segment targets are taken from the lengths (no loss mask: ``seqlen - 1`` per segment),
so no token data is needed; the pass that counts them from real labels is timed on its own.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import fastpack
from fastpack import Ragged
from fastpack._targets import segment_targets
from fastpack.torch import PackedCollator, PackedDataset, PackedSampler
from fastpack.torch.data import step_table

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_scale import gen_lengths  # noqa: E402

MAX_LEN = 4096
LONG_MAX_LEN = 32768
HIDDEN = 4096
BUDGETS = {"sft": 16384, "pretrain": 65536}


def lengths_of(dist: str, n: int, seed: int = 0) -> np.ndarray:
    lengths = gen_lengths(dist, n, seed)
    if dist == "pretrain":  # long documents kept whole up to 32k
        np.minimum(lengths, LONG_MAX_LEN, out=lengths)
    return lengths


def dataset(
    dist: str, lengths: np.ndarray, packs_per_batch: int | None = None
) -> tuple[PackedDataset, dict[str, float]]:
    """The PackedDataset of these lengths (tokens never read), its steps from the lengths:
    groups of B tokens, or ``packs_per_batch`` packs."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = Ragged(np.zeros(1, dtype=np.int32), offsets)  # only the plan is used
    long = LONG_MAX_LEN if dist == "pretrain" else None
    t0 = time.perf_counter()
    steps: dict[str, Any] = (
        {"packs_per_batch": packs_per_batch} if packs_per_batch else
        {"group_tokens": BUDGETS[dist]})
    ds = PackedDataset(tokens, PackedCollator(max_len=MAX_LEN, backend="flash"),
                       long_max_len=long, **steps)
    t1 = time.perf_counter()
    per_segment = (ds.plan.seqlens - 1).astype(np.uint32)
    ds.__dict__["steps"] = step_table(ds.plan, ds.step_pack_offsets, per_segment)
    t2 = time.perf_counter()
    return ds, {"plan_s": t1 - t0, "steps_s": t2 - t1}


def spread(imbalance: np.ndarray) -> dict[str, float]:
    return {
        "p50": float(np.median(imbalance)), "p99": float(np.percentile(imbalance, 99)),
        "max": float(imbalance.max()), "le102": float((imbalance <= 1.02).mean()),
        "le105": float((imbalance <= 1.05).mean()),
    }


def ratios(values: np.ndarray) -> np.ndarray:
    mean = values.mean(axis=1)
    return np.divide(values.max(axis=1), mean, out=np.ones_like(mean), where=mean > 0)


def measure(tokens: np.ndarray, squared: np.ndarray) -> dict[str, Any]:
    """tokens, squared: [G, R] per rank and global step."""
    cost = 6.0 * HIDDEN * tokens + squared
    return {"steps": int(tokens.shape[0]), "tokens": spread(ratios(tokens.astype(np.float64))),
            "cost": spread(ratios(cost))}


# --------------------------------------------------------------------------- samplers
def fastpack_rows(ds: PackedDataset, ranks: int, balance: Any) -> dict[str, Any]:
    sampler = PackedSampler(ds, num_replicas=ranks, balance=balance, hidden_size=HIDDEN)
    t0 = time.perf_counter()
    schedule = sampler.schedule(0)
    build = time.perf_counter() - t0
    seqlens = ds.plan.seqlens.astype(np.int64)
    squared = np.concatenate(([0], np.cumsum(seqlens * seqlens)))
    sq = squared[schedule.hi] - squared[schedule.lo]
    out = measure(schedule.tokens, sq)
    out.update(repeated=0, dropped=0, build_s=build)
    return out


def distributed_rows(ds: PackedDataset, ranks: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    per_rank = [list(torch.utils.data.DistributedSampler(
        ds, num_replicas=ranks, rank=r, shuffle=True, seed=0)) for r in range(ranks)]
    build = time.perf_counter() - t0
    index = np.array(per_rank, dtype=np.int64).T  # [G, R]
    table = ds.steps
    out = measure(table.tokens[index], table.squared_tokens[index].astype(np.float64))
    out.update(repeated=int(index.size - len(ds)), dropped=0, build_s=build)
    return out


def axolotl_bins(lengths: np.ndarray, budget: int) -> tuple[list[Any], float] | str:
    try:
        from axolotl.utils.samplers.multipack import MultipackBatchSampler
    except Exception as e:  # noqa: BLE001 - reported in the table
        return f"axolotl not importable ({type(e).__name__}: {e})"
    generator = torch.Generator().manual_seed(0)
    base = torch.utils.data.RandomSampler(range(len(lengths)), generator=generator)
    sampler = MultipackBatchSampler(
        base, batch_size=1, batch_max_len=budget, lengths=lengths, bin_size=200,
        group_size=100_000, num_processes=1, drop_last=True,
    )
    t0 = time.perf_counter()
    batches = sampler.generate_batches()
    return batches, time.perf_counter() - t0


def axolotl_rows(lengths: np.ndarray, batches: list[Any], ranks: int) -> dict[str, Any]:
    tokens = np.array([int(lengths[b[0]].sum()) for b in batches], dtype=np.int64)
    squared = np.array([float((lengths[b[0]].astype(np.float64) ** 2).sum()) for b in batches])
    g = -(-len(batches) // ranks)
    # accelerate's even_batches: the last global step is completed from the first batches.
    index = np.arange(g * ranks) % len(batches)
    out = measure(tokens[index].reshape(g, ranks), squared[index].reshape(g, ranks))
    packed = sum(len(b[0]) for b in batches)
    out.update(repeated=int(g * ranks - len(batches)), dropped=int(len(lengths) - packed))
    return out


# --------------------------------------------------------------------------- timing
def time_schedule(
    dist: str, n: int, packs_per_batch: int | None = None, reps: int = 3
) -> dict[str, Any]:
    lengths = lengths_of(dist, n)
    ds, prep = dataset(dist, lengths, packs_per_batch)
    mode = f"{packs_per_batch} pack" if packs_per_batch else f"<= {BUDGETS[dist]:,} tokens"
    out: dict[str, Any] = {"dist": dist, "n": n, "mode": mode, **prep, "steps": len(ds)}
    for ranks in (8,):
        times = []
        for epoch in range(reps):
            sampler = PackedSampler(ds, num_replicas=ranks, hidden_size=HIDDEN)
            t0 = time.perf_counter()
            sampler.schedule(epoch)
            times.append(time.perf_counter() - t0)
        out[f"schedule_r{ranks}"] = float(np.median(times))
        times = []
        for epoch in range(reps):
            s = torch.utils.data.DistributedSampler(ds, num_replicas=ranks, rank=0, seed=0)
            s.set_epoch(epoch)
            t0 = time.perf_counter()
            list(s)
            times.append(time.perf_counter() - t0)
        out["distributed"] = float(np.median(times))
    # The per-epoch axolotl cost: it packs every epoch (first-fit over groups of 100k).
    if not packs_per_batch:
        bins = axolotl_bins(lengths, BUDGETS[dist])
        out["axolotl"] = bins if isinstance(bins, str) else bins[1]
    return out


def time_targets(n: int) -> dict[str, float]:
    """The one pass that counts targets from real token ids, labels and a loss mask."""
    lengths = lengths_of("sft", n)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50_000, int(offsets[-1]), dtype=np.int32)
    labels = np.where(rng.random(len(ids)) < 0.3, -100, ids).astype(np.int32)
    mask = rng.random(len(ids)) < 0.7
    plan = fastpack.pack(lengths, MAX_LEN, group_tokens=BUDGETS["sft"], shuffle=True)
    out = {"tokens": float(offsets[-1])}
    for name, kwargs in (("ids", {}), ("labels+mask", {
            "labels": Ragged(labels, offsets), "loss_mask": Ragged(mask, offsets, mask=True)})):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            segment_targets(plan, Ragged(ids, offsets), **kwargs)
            times.append(time.perf_counter() - t0)
        out[name] = float(np.median(times))
    return out


# --------------------------------------------------------------------------- report
def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines()
                    if line.startswith("Model name"))
    except Exception:  # noqa: BLE001
        return platform.processor() or "unknown"


def fmt_n(n: int) -> str:
    e = round(math.log10(n))
    return f"10^{e}" if 10**e == n else f"{n:,}"


def render(imbalance: list[dict[str, Any]], timing: list[dict[str, Any]],
           targets: dict[str, float], env: dict[str, Any]) -> str:
    lines = [
        "# Steps across data-parallel ranks",
        "",
        f"`python benches/bench_sampler.py` on {env['cpus']} CPU cores ({env['cpu']}), "
        f"{env['date']}, fastpack {env['fastpack']}, torch {env['torch']}, "
        f"axolotl {env['axolotl']}, numpy {env['numpy']}; 5-minute load average "
        f"{env['loadavg']:.1f} (the machine was shared: times are wall clock).",
        "",
        "Lengths as in `bench_pack.py`: SFT-like (log-normal, mean ~300, cap 4096) and "
        "pretraining-like (log-normal + Pareto tail, mean ~1,500, 6.5% over 4096, documents "
        f"kept whole up to {LONG_MAX_LEN:,} in a long bucket). A step holds at most B tokens "
        f"(SFT B = {BUDGETS['sft']:,}, pretraining B = {BUDGETS['pretrain']:,}). Imbalance "
        "of a global step = max/mean over the R ranks of the work `6·h·Σl + Σl²` "
        f"(h = {HIDDEN}) or of the tokens Σl; p50/p99 over the global steps of one epoch; "
        "'<= 1.02' = share of global steps within 2%. 'repeated' = steps (bins) run twice "
        "to even the ranks out; 'dropped' = sequences left out.",
        "",
        "## Imbalance per global step",
        "",
        "| data | N | R | sampler | steps/rank | cost p50 | cost p99 | cost <= 1.02 | "
        "cost <= 1.05 | tokens p50 | tokens p99 | repeated | dropped |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in imbalance:
        if "error" in row:
            lines.append(f"| {row['dist']} | {fmt_n(row['n'])} | {row['ranks']} | "
                         f"{row['sampler']} | n/a ({row['error']}) |||||||||")
            continue
        c, t = row["cost"], row["tokens"]
        lines.append(
            f"| {row['dist']} | {fmt_n(row['n'])} | {row['ranks']} | {row['sampler']} | "
            f"{row['steps']:,} | {c['p50']:.4f} | {c['p99']:.4f} | {c['le102']:.2%} | "
            f"{c['le105']:.2%} | {t['p50']:.4f} | {t['p99']:.4f} | {row['repeated']:,} | "
            f"{row['dropped']:,} |"
        )
    lines += [
        "",
        "## Time to build an epoch's schedule",
        "",
        "plan = `PackedDataset(...)` (the global plan with groups, once per run); steps = "
        "its per-step arrays from the plan (Σl, Σl², targets, sequences; once per run); "
        "schedule = `PackedSampler(num_replicas=8).schedule(epoch)` for a new epoch (median "
        "of 3 epochs), the per-epoch cost; DistributedSampler = `list(sampler)` for one "
        "rank; axolotl = `MultipackBatchSampler.generate_batches()`, which re-packs every "
        "epoch (one process; steps of B tokens only).",
        "",
        "| data | N | a step | steps | plan | step arrays | schedule (R = 8) | "
        "DistributedSampler | axolotl multipack | axolotl ÷ schedule |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in timing:
        ax = row.get("axolotl")
        ax_s = "not run" if ax is None else (ax if isinstance(ax, str) else f"{ax:.2f} s")
        ratio = f"{ax / row['schedule_r8']:,.0f}x" if isinstance(ax, float) else ""
        lines.append(
            f"| {row['dist']} | {fmt_n(row['n'])} | {row['mode']} | {row['steps']:,} | "
            f"{row['plan_s']:.2f} s | "
            f"{row['steps_s']:.3f} s | {row['schedule_r8']:.3f} s | {row['distributed']:.3f} s "
            f"| {ax_s} | {ratio} |"
        )
    ns = targets["tokens"]
    lines += [
        "",
        f"Counting targets from real data (once per run, Rust, {ns / 1e6:,.0f}M tokens of "
        f"SFT-like data, median of 3): token ids only {targets['ids']:.2f} s "
        f"({targets['ids'] / ns * 1e9:.2f} ns/token); labels + loss mask "
        f"{targets['labels+mask']:.2f} s ({targets['labels+mask'] / ns * 1e9:.2f} ns/token).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", default="1e6", help="sequences for the imbalance table")
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--timing-sizes", default="1e6,1e7")
    ap.add_argument("--targets-n", default="1e6")
    ap.add_argument("--out", default=str(HERE / "results" / "sampler.md"))
    args = ap.parse_args(argv)
    n = int(float(args.n))
    ranks_list = [int(r) for r in args.ranks.split(",")]

    imbalance: list[dict[str, Any]] = []
    for dist in ("sft", "pretrain"):
        lengths = lengths_of(dist, n)
        ds, _ = dataset(dist, lengths)
        bins = axolotl_bins(lengths, BUDGETS[dist])
        for ranks in ranks_list:
            base = {"dist": dist, "n": n, "ranks": ranks}
            for name, balance in (("fastpack PackedSampler (flops)", "flops"),
                                  ("fastpack PackedSampler (tokens)", "tokens"),
                                  ("fastpack PackedSampler (None)", None)):
                imbalance.append({**base, "sampler": name, **fastpack_rows(ds, ranks, balance)})
            imbalance.append({**base, "sampler": "torch DistributedSampler",
                              **distributed_rows(ds, ranks)})
            if isinstance(bins, str):
                imbalance.append({**base, "sampler": "axolotl multipack", "error": bins})
            else:
                imbalance.append({**base, "sampler": "axolotl multipack",
                                  **axolotl_rows(lengths, bins[0], ranks)})
            print(json.dumps(imbalance[-5:])[:300], file=sys.stderr)

    timing = []
    for size in (int(float(s)) for s in args.timing_sizes.split(",")):
        for dist in ("sft", "pretrain"):
            for packs in (None, 1):
                row = time_schedule(dist, size, packs)
                timing.append(row)
                print(json.dumps(row), file=sys.stderr)
    targets = time_targets(int(float(args.targets_n)))

    try:
        import axolotl

        axolotl_version = axolotl.__version__
    except Exception:  # noqa: BLE001
        axolotl_version = "not installed"
    env = {
        "cpus": os.cpu_count(), "cpu": cpu_name(), "date": time.strftime("%Y-%m-%d"),
        "fastpack": fastpack.__version__, "torch": torch.__version__.split("+")[0],
        "axolotl": axolotl_version, "numpy": np.__version__, "loadavg": os.getloadavg()[1],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(imbalance, timing, targets, env))
    out.with_suffix(".json").write_text(json.dumps(
        {"env": env, "imbalance": imbalance, "timing": timing, "targets": targets}, indent=1))
    print(out.read_text())


if __name__ == "__main__":
    main()
