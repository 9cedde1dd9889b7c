"""Collate time per batch: fastpack.torch.PackedCollator vs transformers'
DataCollatorWithFlattening, on the same samples (64 per batch by default).

Samples are dicts with ``input_ids`` and ``labels`` as Python lists (what a Hugging Face
``datasets`` row gives) or numpy arrays, with SFT-like lengths (log-normal, mean ~300,
capped at max_len). Each collator builds flash-attention inputs (flat row, position_ids,
cu_seq_lens, max_length) as torch tensors. Times are the median of ``--repeats`` calls,
over ``--batches`` different batches. Writes benches/results/collate.md.

    python benches/bench_collate.py [--batch-size 64] [--repeats 30]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from transformers import DataCollatorWithFlattening

import fastpack
from fastpack.torch import PackedCollator


def make_batches(
    n_batches: int, batch_size: int, max_len: int, kind: str
) -> list[list[dict[str, Any]]]:
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(n_batches):
        lengths = np.clip(rng.lognormal(5.4, 0.8, batch_size).astype(int), 1, max_len)
        batch = []
        for n in lengths:
            ids = rng.integers(0, 32000, n)
            if kind == "list":
                batch.append({"input_ids": ids.tolist(), "labels": ids.tolist()})
            else:
                batch.append({"input_ids": ids, "labels": ids.copy()})
        batches.append(batch)
    return batches


def time_per_batch(fn: Callable[[Any], Any], batches: list[Any], repeats: int) -> float:
    for b in batches[:2]:
        fn(b)  # warm-up
    times = []
    for _ in range(repeats):
        for b in batches:
            t0 = time.perf_counter()
            fn(b)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "collate.md"))
    args = ap.parse_args()

    hf = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)
    ours = {
        "flash": PackedCollator(max_len=args.max_len, backend="flash", threads=1),
        "sdpa": PackedCollator(max_len=args.max_len, backend="sdpa", threads=1),
    }
    rows = []
    for kind in ("list", "numpy"):
        batches = make_batches(args.batches, args.batch_size, args.max_len, kind)
        tokens = statistics.mean(sum(len(f["input_ids"]) for f in b) for b in batches)
        # Same samples -> same tokens and labels (fastpack reorders sequences by BFD).
        a, b = hf(batches[0]), ours["flash"](batches[0])
        assert sorted(a["input_ids"][0].tolist()) == sorted(b["input_ids"][0].tolist())
        assert int((a["labels"] != -100).sum()) == int((b["labels"] != -100).sum())
        t_hf = time_per_batch(hf, batches, args.repeats)
        for name, col in ours.items():
            t = time_per_batch(col, batches, args.repeats)
            rows.append((kind, tokens, name, t_hf, t))
    lines = [
        f"# Collate time per batch ({args.batch_size} sequences, SFT-like lengths, "
        f"max_len {args.max_len})",
        "",
        f"fastpack {fastpack.__version__}, torch {torch.__version__}, "
        f"{platform.processor() or platform.machine()}, median of {args.repeats} x "
        f"{args.batches} batches, fastpack threads=1.",
        "",
        "| samples as | tokens/batch | fastpack backend | DataCollatorWithFlattening | fastpack "
        "| speed-up |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for kind, tokens, name, t_hf, t in rows:
        lines.append(
            f"| {kind} | {tokens:,.0f} | {name} | {t_hf * 1e3:.2f} ms | {t * 1e3:.3f} ms | "
            f"{t_hf / t:.1f}x |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
