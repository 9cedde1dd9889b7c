"""Related documents packed together: ``pack(..., affinity=keys)`` against plain ``bfd`` in
the same run — planning time, efficiency, and how related the packs are (the share of
token pairs in a pack whose documents share a key) against plain best fit and the random
packing baseline. Writes benches/results/affinity.md.

    python benches/bench_affinity.py            # 10^7 documents (BENCH_N to change)
    python benches/bench_affinity.py slack      # the slack sweep behind the default, 10^6

Lengths: SFT-like (log-normal, cap 4096) and pre-training-like (Pareto tail, cap 8192,
long documents split). Keys: a few (8) and several thousand (5,000), Zipf-weighted, drawn
independently of the lengths (the hard case: a key's documents are no easier to pack
together than any others).
"""

from __future__ import annotations

import os
import sys
from functools import partial
from pathlib import Path

import numpy as np
from _machine import best_of, cpu, load

import fastpack
from fastpack import _core

RESULTS = Path(__file__).resolve().parent / "results"


def lengths_of(kind: str, n: int, seed: int) -> tuple[np.ndarray, int, str]:
    rng = np.random.default_rng(seed)
    if kind == "sft":
        return np.clip(rng.lognormal(5.5, 1.2, n), 1, 4096).astype(np.int32), 4096, "error"
    return np.clip(rng.pareto(1.3, n) * 400 + 50, 1, 200_000).astype(np.int32), 8192, "split"


def keys_of(num_keys: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed + 1)
    weights = 1.0 / np.arange(1, num_keys + 1) ** 0.8
    return rng.choice(num_keys, size=n, p=weights / weights.sum()).astype(np.int64)


def main(n: int) -> list[str]:
    rows = []
    for kind in ("sft", "pretrain"):
        lengths, max_len, overlong = lengths_of(kind, n, 0)
        for num_keys in (8, 5000):
            keys = keys_of(num_keys, n, 0)
            plain_run = partial(fastpack.pack, lengths, max_len, overlong=overlong)
            t_bfd, bfd = best_of(2, plain_run)
            t_aff, aff = best_of(2, partial(plain_run, affinity=keys))
            plain = fastpack.measure_affinity(bfd, keys)
            a = aff.affinity
            assert a is not None
            rows.append(
                f"| {kind} | {num_keys:,} | {t_bfd:.2f} | {t_aff:.2f} | {bfd.num_packs:,} | "
                f"{aff.num_packs:,} (+{aff.num_packs - bfd.num_packs:,}, "
                f"{(aff.num_packs / bfd.num_packs - 1):.3%}) | {bfd.efficiency:.4%} | "
                f"{aff.efficiency:.4%} | {plain.same_key_share:.3f} | {a.same_key_share:.3f} | "
                f"{a.random_share:.3f} | {a.pure_packs:.3f} | {a.slack} |")
            print(rows[-1], flush=True)
    head = [
        f"## pack(..., affinity=keys) vs plain bfd, {n:,} documents",
        "",
        f"Machine: {cpu()}; load average at the start {LOAD0}, at the end {load()}. "
        "Times are the best of 2 runs, threads = all cores; the machine was shared with "
        "other jobs, so times are indicative.",
        "",
        "Share = of the token pairs from two different documents in one pack, the share "
        "whose documents have the same key (`Affinity.same_key_share`); random = the "
        "share a random packing gives, from the keys' token counts (analytic: "
        "`(Σ_k t_k² − Σ_i l_i²) / (T² − Σ_i l_i²)`); pure = packs of 2+ documents all "
        "of one key.",
        "",
        "| lengths | keys | bfd s | affinity s | bfd packs | affinity packs | bfd eff. | "
        "affinity eff. | share, bfd | share, affinity | share, random | pure packs | "
        "slack |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    return head + rows


def slack_sweep(n: int) -> list[str]:
    lengths, max_len, _ = lengths_of("sft", n, 1)
    rows = [f"## Slack sweep ({n:,} SFT-like documents, cap 4096, 5,000 keys)", "",
            "| slack (tokens) | packs over bfd | share, affinity | pure packs | time s |",
            "|---|---|---|---|---|"]
    keys = keys_of(5000, n, 1)
    bfd = fastpack.pack(lengths, max_len).num_packs
    for slack in (0, 8, 16, 32, 64, 128, 512):
        t, d = best_of(1, partial(_core.pack_affinity, lengths.astype(np.int64), keys,
                                  max_len, "error", 0, None, None, slack))
        packs = len(d["pack_offsets"]) - 1
        a = d["affinity"]
        used = "" if a["slack"] == slack else " (fell back to 0)"
        rows.append(f"| {slack}{used} | {packs - bfd:+,} ({packs / bfd - 1:.3%}) | "
                    f"{a['same_key_share']:.3f} | {a['pure_packs']:.3f} | {t:.2f} |")
        print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    LOAD0 = load()
    what = sys.argv[1] if len(sys.argv) > 1 else "main"
    n = int(os.environ.get("BENCH_N", "10000000" if what == "main" else "1000000"))
    lines = main(n) if what == "main" else slack_sweep(n)
    out = RESULTS / "affinity.md"
    text = out.read_text() if out.exists() else "# Related documents packed together\n\n"
    out.write_text(text + "\n".join(lines) + "\n\n")
    print(f"wrote {out}")
