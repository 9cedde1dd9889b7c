"""The drop-ins against the originals, same data, same process, interleaved:

- ``fastpack.trl.pack_dataset`` vs ``trl.pack_dataset`` (strategies ``bfd``, ``bfd_split``,
  ``wrapped``; TRL's defaults: ``Dataset.map`` over 1,000-row windows) on a
  ``datasets.Dataset`` in memory with ``input_ids`` and ``labels`` (int32 lists; SFT-like
  lengths: log-normal, mean ~300, clipped to [1, 4096]; seed 0), ``seq_length`` 2048;
- ``fastpack.trl.truncate_dataset`` vs ``trl.experimental.utils.truncate_dataset``;
- ``fastpack.transformers.DataCollatorWithFlattening`` vs transformers' on 64 samples (the
  same lengths, first 64), as lists of ints and as numpy arrays, with and without
  ``return_flash_attn_kwargs`` / ``return_seq_idx``.

Each measurement: the median of ``--repeats`` calls (the tools alternate, so load on the
machine falls on both alike), after one warm-up call. Every output is checked equal to the
original's (packs row for row). The CPU, its core count and the load average are printed
with the table; results go to benches/results/dropin.md.

    python benches/bench_dropin.py                 # 20,000 rows
    python benches/bench_dropin.py --rows 5000 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(5.3, 0.8, n), 1, 4096).astype(np.int64)


def pair(name: str, ours, theirs, repeats: int, same) -> dict:
    # Interleave: ours, theirs, ours, theirs ...
    t_ours: list[float] = []
    t_theirs: list[float] = []
    out_ours, out_theirs = ours(), theirs()  # warm-up, and the outputs to check
    for _ in range(repeats):
        t = time.perf_counter()
        ours()
        t_ours.append(time.perf_counter() - t)
        t = time.perf_counter()
        theirs()
        t_theirs.append(time.perf_counter() - t)
    assert same(out_ours, out_theirs), f"{name}: outputs differ"
    a, b = statistics.median(t_ours), statistics.median(t_theirs)
    print(f"{name:<44} fastpack {a * 1e3:10.2f} ms   original {b * 1e3:10.2f} ms   "
          f"original/fastpack {b / a:6.1f}x", flush=True)
    return {"name": name, "fastpack_ms": a * 1e3, "original_ms": b * 1e3, "ratio": b / a}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "dropin.md"))
    args = parser.parse_args()

    import datasets
    import torch
    import trl
    import trl.data_utils as trl_data
    import trl.experimental.utils as trl_exp
    from transformers import DataCollatorWithFlattening as HFCollator

    import fastpack.trl as fp_trl
    from fastpack.transformers import DataCollatorWithFlattening as FPCollator

    datasets.disable_progress_bars()
    lens = lengths(args.rows)
    rng = np.random.default_rng(1)
    rows = [rng.integers(0, 32000, int(n), dtype=np.int32) for n in lens]
    ds = datasets.Dataset.from_dict(
        {"input_ids": rows, "labels": rows},
        features=datasets.Features({k: datasets.List(datasets.Value("int32"))
                                    for k in ("input_ids", "labels")}))
    print(f"CPU: {cpu_name()} ({os.cpu_count()} cores), load {os.getloadavg()[0]:.1f}; "
          f"{args.rows} rows, {int(lens.sum())} tokens, seq_length {args.seq_length}; "
          f"datasets {datasets.__version__}, trl {trl.__version__}, "
          f"torch {torch.__version__}", flush=True)

    def same_table(a, b) -> bool:
        return a.data.table.equals(b.data.table)

    results = []
    for strategy in ("bfd", "bfd_split", "wrapped"):
        results.append(pair(
            f"pack_dataset {strategy}",
            lambda s=strategy: fp_trl.pack_dataset(ds, args.seq_length, s),
            lambda s=strategy: trl_data.pack_dataset(ds, args.seq_length, s),
            args.repeats, same_table))
    results.append(pair(
        "truncate_dataset", lambda: fp_trl.truncate_dataset(ds, 512),
        lambda: trl_exp.truncate_dataset(ds, 512), args.repeats, same_table))

    def same_batch(a, b) -> bool:
        return list(a) == list(b) and all(
            (a[k] == b[k]) if isinstance(b[k], int) else bool((a[k] == b[k]).all())
            for k in b)

    batch = rows[:64]
    as_lists = [{"input_ids": r.tolist()} for r in batch]
    as_numpy = [{"input_ids": r.astype(np.int64)} for r in batch]
    for label, feats in (("lists", as_lists), ("numpy", as_numpy)):
        for kwargs in ({}, {"return_flash_attn_kwargs": True, "return_seq_idx": True}):
            ours, theirs = FPCollator(**kwargs), HFCollator(**kwargs)
            results.append(pair(
                f"collator 64 {label}{' +flash,seq_idx' if kwargs else ''}",
                lambda o=ours, f=feats: o(f), lambda t=theirs, f=feats: t(f),
                max(args.repeats, 50), same_batch))

    out = Path(args.out)
    lines = [
        "# Drop-ins vs the originals (`benches/bench_dropin.py`)", "",
        f"CPU: {cpu_name()} ({os.cpu_count()} cores), load average {os.getloadavg()[0]:.1f} "
        f"at the end; {args.rows} rows ({int(lens.sum())} tokens), seq_length "
        f"{args.seq_length}; medians of {args.repeats} calls (collators: "
        f"{max(args.repeats, 50)}), the tools interleaved in one process; every output "
        f"equal to the original's.", "",
        "| what | fastpack | original | original / fastpack |", "|---|---:|---:|---:|",
    ] + [f"| {r['name']} | {r['fastpack_ms']:.2f} ms | {r['original_ms']:.2f} ms | "
         f"{r['ratio']:.1f}x |" for r in results]
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
