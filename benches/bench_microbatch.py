"""Micro-batches under a token cap, same run, same lengths: fastpack's planner against
verl's ``rearrange_micro_batches`` (before and after verl PR #7553) and slime's balance by
FLOPs.

Every method gets the same global steps (consecutive chunks of ``batch`` sequences of one
length distribution), ``R = 8`` data-parallel ranks and a token cap ``T`` per micro-batch,
and is scored on the same cost ``w(l) = 24576·l + l²`` (verl's ``calculate_workload``;
fastpack's ``6·h·l + l²`` with ``h = 4096``):

- max/mean cost over the micro-batches of a global step (all ranks), and over its ranks
  (a rank's cost: the sum of its micro-batches), each averaged over the steps;
- micro-batches per rank per step (mean; the pipeline runs this many);
- caps exceeded: micro-batches holding more than ``T`` tokens (must be 0);
- planning time of the whole run, one process.

The peers, re-implemented here from their source (our own code, same algorithms):

- **verl before #7553** (volcengine/verl @ b178a3c, 2026-01-29,
  ``verl/utils/seqlen_balancing.py`` and ``ray_trainer._balance_batch``): the global batch
  is dealt to the DP ranks by Karmarkar–Karp with equal sizes on ``w``; each rank then
  takes ``k = min(n, ceil(Σl / T))`` micro-batches, the MAX over ranks (``all_reduce``),
  partitions its sequences by Karmarkar–Karp on ``w`` (unequal sizes), sorts them by
  ``Σw`` descending and runs ``idx[::2][::-1] + idx[1::2]`` (light ones at both ends).
- **verl after #7553** (merged 2026-08-25; PR description): the same, but while a
  micro-batch holds more than ``T`` tokens, ``k`` grows by one and the rank partitions
  again (the decision is made collectively: every rank takes the largest ``k`` any rank
  needed, and the loop repeats until all fit).
- **slime balance by FLOPs** (THUDM/slime @ 624b824, 2026-08-21, ``slime/utils/
  dp_schedule.py``, ``--balance-by-flops --balance-data``): pack first, distribute second —
  the whole global step into ``K = ceil(Σl / T)`` micro-batches by Karmarkar–Karp on FLOPs
  (unequal sizes; the token cap is not enforced in this mode, as its docs say), ``K``
  raised to a multiple of R by splitting the largest multi-sample micro-batch in two
  (LPT on tokens), then the micro-batches dealt to the ranks by Karmarkar–Karp with equal
  counts on their FLOPs. slime's coefficient is computed from the model config; here it
  is the same ``24576`` as everyone's.
- **fastpack**: :func:`fastpack.plan_micro_batches` (longest-processing-time first over
  the ``R·k`` micro-batches of each step, ``k`` grown until every micro-batch fits).

Run: ``PYTHONPATH=python python3 benches/bench_microbatch.py`` (writes
``benches/results/microbatch.md``).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "python"))
from _machine import cpu  # noqa: E402
from bench_scale import gen_lengths  # noqa: E402

import fastpack  # noqa: E402

RANKS = 8
LINEAR = 24576.0
#: (global batch in sequences, token cap per micro-batch) per distribution.
SETUPS = {"sft": (1024, 16384), "pretrain": (256, 65536), "rl": (512, 16384)}


def lengths_of(dist: str, n: int, seed: int = 0) -> np.ndarray:
    if dist == "sft":
        return gen_lengths("sft", n, seed).astype(np.int64)
    if dist == "pretrain":  # long-tail documents, kept whole up to 32k
        return np.minimum(gen_lengths("pretrain", n, seed), 32768).astype(np.int64)
    # RL rollouts: groups of 8 responses to one prompt; responses log-normal around
    # 1,500 tokens, 30% running to the 8,192 limit (the long tail RL batches have).
    rng = np.random.default_rng(seed)
    prompts = np.clip(rng.lognormal(math.log(500) - 0.5, 0.8, -(-n // 8)), 32, 2048)
    prompt = np.repeat(np.rint(prompts), 8)[:n]
    response = np.clip(rng.lognormal(math.log(1500) - 0.5, 1.0, n), 1, 8192)
    response[rng.random(n) < 0.3] = 8192
    return (prompt + np.rint(response)).astype(np.int64)


def work(lengths: np.ndarray) -> np.ndarray:
    x = lengths.astype(np.float64)
    return LINEAR * x + x * x


# ---------------------------------------------------------------------- Karmarkar–Karp
def karmarkar_karp(weights: list[float], k: int, equal_size: bool) -> list[list[int]]:
    """The largest differencing method into ``k`` sets (our own code): every item (or,
    with ``equal_size``, every run of ``k`` consecutive items in sorted order) starts as
    a partial solution of ``k`` sets; the two partials with the largest spread are merged,
    the heaviest set of one with the lightest of the other, until one is left."""
    order = sorted(range(len(weights)), key=lambda i: weights[i])
    heap: list[tuple[float, int, list[float], list[list[int]]]] = []
    tie = itertools.count()

    def push(sums: list[float], members: list[list[int]]) -> None:
        pairs = sorted(zip(sums, members), key=lambda p: -p[0])
        s = [p[0] for p in pairs]
        heapq.heappush(heap, (-(s[0] - s[-1]), next(tie), s, [p[1] for p in pairs]))

    if equal_size:
        for off in range(0, len(order), k):
            chunk = order[off : off + k]
            push([weights[i] for i in chunk], [[i] for i in chunk])
    else:
        for i in order:
            push([weights[i]] + [0.0] * (k - 1), [[i]] + [[] for _ in range(k - 1)])
    while len(heap) > 1:
        _, _, s1, m1 = heapq.heappop(heap)
        _, _, s2, m2 = heapq.heappop(heap)
        push([s1[j] + s2[k - 1 - j] for j in range(k)],
             [m1[j] + m2[k - 1 - j] for j in range(k)])
    return heap[0][3]


def verl_micro(lengths: np.ndarray, cap: int, strict: bool) -> tuple[list[list[list[int]]], int]:
    """One global step under verl: DP ranks by KK (equal sizes), then micro-batches per
    rank. Returns each rank's micro-batches (indices into ``lengths``) in running order."""
    w = work(lengths).tolist()
    ranks = karmarkar_karp(w, RANKS, equal_size=True)
    k = max(min(len(r), -(-int(lengths[r].sum()) // cap)) for r in ranks)
    while True:
        parts = [karmarkar_karp([w[i] for i in r], k, equal_size=False) for r in ranks]
        if not strict:
            break
        fits = all(sum(int(lengths[r[i]]) for i in p) <= cap for r, ps in zip(ranks, parts)
                   for p in ps)
        if fits or k >= min(len(r) for r in ranks):
            break
        k += 1
    out = []
    for r, ps in zip(ranks, parts):
        ps = sorted(ps, key=lambda p: -sum(w[r[i]] for i in p))
        ps = ps[::2][::-1] + ps[1::2]
        out.append([[r[i] for i in p] for p in ps])
    return out, k


def slime_micro(lengths: np.ndarray, cap: int) -> tuple[list[list[list[int]]], int]:
    """One global step under slime's --balance-by-flops --balance-data."""
    w = work(lengths).tolist()
    count = max(1, -(-int(lengths.sum()) // cap))
    if count >= len(lengths):
        bins = [[i] for i in range(len(lengths))]
    else:
        bins = karmarkar_karp(w, count, equal_size=False)
    target = max(-(-len(bins) // RANKS) * RANKS, RANKS)
    while len(bins) < target:  # split the heaviest (by tokens) multi-sample bin in two
        options = [(sum(int(lengths[i]) for i in b), j) for j, b in enumerate(bins) if len(b) > 1]
        if not options:
            break
        _, j = max(options)
        halves: list[list[int]] = [[], []]
        sums = [0, 0]
        for i in sorted(bins[j], key=lambda i: -int(lengths[i])):
            h = 0 if sums[0] <= sums[1] else 1
            halves[h].append(i)
            sums[h] += int(lengths[i])
        bins[j] = halves[0]
        bins.append(halves[1])
    weights = [sum(w[i] for i in b) for b in bins]
    ranks = karmarkar_karp(weights, RANKS, equal_size=True)
    return [[bins[j] for j in r] for r in ranks], len(bins) // RANKS


# ---------------------------------------------------------------------- scoring
def score(step_plans: list[list[list[list[int]]]], lengths: np.ndarray, batch: int, cap: int
          ) -> dict[str, float]:
    w = work(lengths)
    micro_ratio, rank_ratio, counts, exceeded = [], [], [], 0
    for s, plan in enumerate(step_plans):
        base = s * batch
        mb_cost = [float(w[base + np.asarray(m, dtype=np.int64)].sum()) for r in plan for m in r]
        mb_tok = [int(lengths[base + np.asarray(m, dtype=np.int64)].sum()) for r in plan for m in r]
        rank_cost = [sum(float(w[base + np.asarray(m, dtype=np.int64)].sum()) for m in r)
                     for r in plan]
        micro_ratio.append(max(mb_cost) / np.mean(mb_cost))
        rank_ratio.append(max(rank_cost) / np.mean(rank_cost))
        counts.append(np.mean([len(r) for r in plan]))
        exceeded += sum(t > cap for t in mb_tok)
    return {"micro": float(np.mean(micro_ratio)), "rank": float(np.mean(rank_ratio)),
            "k": float(np.mean(counts)), "exceeded": exceeded}


def fastpack_plan(lengths: np.ndarray, batch: int, cap: int) -> fastpack.MicroBatches:
    steps = np.arange(len(lengths)) // batch
    return fastpack.plan_micro_batches(lengths, ranks=RANKS, token_cap=cap, steps=steps,
                                       cost=LINEAR, pipeline_order=True)


def fastpack_score(mb: fastpack.MicroBatches, lengths: np.ndarray, cap: int
                   ) -> dict[str, float]:
    micro, rank = mb.imbalance()
    return {"micro": micro, "rank": rank, "k": float(mb.num_micro.mean()),
            "exceeded": int((mb.batch_tokens > cap).sum())}


def peer_run(fn: Callable[[np.ndarray, int], tuple[list[list[list[int]]], int]],
             lengths: np.ndarray, batch: int, cap: int) -> tuple[list[list[list[list[int]]]], float]:
    start = time.perf_counter()
    plans = [fn(lengths[s : s + batch], cap)[0] for s in range(0, len(lengths), batch)]
    return plans, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=100_000, help="sequences for the table")
    parser.add_argument("--timing", type=int, nargs="*", default=[1_000_000, 10_000_000])
    parser.add_argument("--out", default=str(HERE / "results" / "microbatch.md"))
    args = parser.parse_args()

    methods: dict[str, Callable[[np.ndarray, int], tuple[list[list[list[int]]], int]]] = {
        "verl before #7553": lambda x, c: verl_micro(x, c, strict=False),
        "verl after #7553": lambda x, c: verl_micro(x, c, strict=True),
        "slime balance-by-flops": slime_micro,
    }
    rows = []
    for dist, (batch, cap) in SETUPS.items():
        lengths = lengths_of(dist, args.n)
        n = len(lengths) - len(lengths) % batch
        lengths = lengths[:n]
        for name, fn in methods.items():
            plans, seconds = peer_run(fn, lengths, batch, cap)
            rows.append((dist, name, score(plans, lengths, batch, cap), seconds))
            print(rows[-1], flush=True)
        start = time.perf_counter()
        mb = fastpack_plan(lengths, batch, cap)
        seconds = time.perf_counter() - start
        rows.append((dist, "fastpack", fastpack_score(mb, lengths, cap), seconds))
        print(rows[-1], flush=True)

    timing = []
    for n in args.timing:
        for dist, (batch, cap) in SETUPS.items():
            lengths = lengths_of(dist, n)
            lengths = lengths[: len(lengths) - len(lengths) % batch]
            start = time.perf_counter()
            fastpack_plan(lengths, batch, cap)
            timing.append((n, dist, time.perf_counter() - start))
            print(timing[-1], flush=True)

    lines = [
        "# Micro-batches under a token cap: fastpack vs verl and slime",
        "",
        f"Machine: {cpu()}, load average {os.getloadavg()[0]:.1f} at the end. "
        f"`benches/bench_microbatch.py`, R = {RANKS} ranks, cost `24576·l + l²`, "
        f"{args.n:,} sequences per distribution (consecutive global batches). Peers "
        "re-implemented from verl @ b178a3c (+ PR #7553's rule) and slime @ 624b824.",
        "",
        "| lengths (batch, cap) | method | max/mean cost per micro-batch | max/mean cost "
        "per rank | micro-batches per rank per step | caps exceeded | planning time |",
        "|---|---|---|---|---|---|---|",
    ]
    for dist, name, m, seconds in rows:
        batch, cap = SETUPS[dist]
        lines.append(f"| {dist} ({batch}, {cap}) | {name} | {m['micro']:.3f} | "
                     f"{m['rank']:.4f} | {m['k']:.2f} | {m['exceeded']} | {seconds:.2f} s |")
    lines += ["", "Planning time of fastpack alone (whole run, one process):", "",
              "| sequences | lengths | time |", "|---|---|---|"]
    for n, dist, seconds in timing:
        lines.append(f"| {n:,} | {dist} | {seconds:.2f} s |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
