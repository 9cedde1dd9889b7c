"""This tree against a baseline tree, in one run: the CPU time of the calls a change to
the core, the collator or the Arrow gather could slow down. Writes
benches/results/compare.md (or ``--out``).

    python benches/bench_compare.py BASELINE [--repeats 7] [--out FILE]

BASELINE is the ``python/`` folder of another fastpack with its own built ``_core`` (e.g.
``git archive main python | tar -x -C /tmp/base`` and main's ``_core.abi3.so`` copied
into ``/tmp/base/python/fastpack``). Each repeat starts one fresh process per tree, the
two in turn (base first on even repeats, this tree first on odd ones), so load on the
shared machine falls on both alike; a process runs every case and reports, per case,
the median CPU time (user + system, every thread: ``time.process_time``) of its timed
calls. The table gives the median over the repeats of those medians, and their ratio.

Cases:

- ``pack``: ``fastpack.pack`` of SFT-like lengths (log-normal, mean ~300, clipped to
  [1, 4096], seed 0), ``max_len`` 4096, ``shuffle=False``, at 10^4 and 10^5 lengths, for
  ``bfd``, ``next_fit`` and ``wrapped`` (the order-preserving walk); one call per timing
  at 10^5, ten at 10^4.
- ``collate``: ``PackedCollator(backend=...)(batch)`` for 64 SFT-like samples as Python
  lists (``input_ids`` and ``labels``), ``threads=1``: ``padded`` (the baseline one sample
  per row) and ``flash`` (the flat row), over 8 batches.
- ``pack_dataset``: ``fastpack.hf.pack_dataset(ds, 4096)`` of a ``datasets.Dataset`` of
  10^5 SFT-like rows, two int32 columns (``input_ids``, ``labels``), in memory, its
  defaults, and with ``position_ids=True``: the first call of the process and the median
  of 3 more.
- ``stream``: every row of ``pack_dataset`` of the same rows' first 2*10^4 as a
  ``datasets.IterableDataset`` (windows of 10^4 samples; it writes ``position_ids``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
THIS = str(HERE.parent / "python")

_WORKER = textwrap.dedent("""
    import json, statistics, sys, time
    import numpy as np

    def sft(n, seed=0):
        rng = np.random.default_rng(seed)
        return np.clip(rng.lognormal(5.4, 0.8, n), 1, 4096).astype(np.int64)

    def cpu(fn, calls=1, repeats=15):
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.process_time()
            for _ in range(calls):
                fn()
            times.append((time.process_time() - t0) / calls)
        return statistics.median(times)

    import fastpack
    out = {}
    for n, calls in ((10**4, 10), (10**5, 1)):
        lengths = sft(n)
        for strategy in ("bfd", "next_fit", "wrapped"):
            out[f"pack {strategy} {n:.0e}"] = cpu(
                lambda: fastpack.pack(lengths, 4096, strategy=strategy, shuffle=False),
                calls=calls)

    from fastpack.torch import PackedCollator
    rng = np.random.default_rng(1)
    batches = []
    for _ in range(8):
        batch = []
        for n in sft(64, seed=int(rng.integers(1 << 30))):
            ids = rng.integers(0, 32000, n).tolist()
            batch.append({"input_ids": ids, "labels": ids})
        batches.append(batch)
    for backend in ("padded", "flash"):
        collator = PackedCollator(max_len=4096, backend=backend, threads=1)
        out[f"collate {backend}"] = cpu(lambda: [collator(b) for b in batches]) / len(batches)

    import datasets
    from fastpack.hf import pack_dataset
    lengths = sft(10**5, seed=2)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    values = rng.integers(0, 32000, int(offsets[-1]), dtype=np.int32)
    import pyarrow as pa
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
    ds = datasets.Dataset(pa.table({"input_ids": column, "labels": column}))
    for name, kwargs in (("pack_dataset", {}), ("pack_dataset position_ids", {"position_ids": True})):
        t0 = time.process_time()
        pack_dataset(ds, 4096, **kwargs)
        out[f"{name} (first call)"] = time.process_time() - t0
        warm = []
        for _ in range(3):
            t0 = time.process_time()
            pack_dataset(ds, 4096, **kwargs)
            warm.append(time.process_time() - t0)
        out[f"{name} (warm)"] = statistics.median(warm)
    stream = ds.select(range(2 * 10**4)).to_iterable_dataset()
    out["stream"] = cpu(lambda: sum(1 for _ in pack_dataset(stream, 4096)), repeats=3)
    print(json.dumps(out))
""")


def run(tree: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=tree)
    done = subprocess.run([sys.executable, "-c", _WORKER], env=env, capture_output=True,
                          text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    result: dict[str, float] = json.loads(done.stdout.splitlines()[-1])
    return result


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines()
                    if line.startswith("Model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def fmt(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds < 1 else f"{seconds:.2f} s"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("baseline")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=str(HERE / "results" / "compare.md"))
    args = parser.parse_args()
    load_start = os.getloadavg()
    results: dict[str, list[dict[str, float]]] = {"base": [], "this": []}
    for r in range(args.repeats):
        for tree in ("base", "this") if r % 2 == 0 else ("this", "base"):
            results[tree].append(run(args.baseline if tree == "base" else THIS))
        print(f"repeat {r + 1}/{args.repeats} done", flush=True)
    load_end = os.getloadavg()
    lines = [
        "## This tree against a baseline: CPU time of the calls a change could slow", "",
        f"`python benches/bench_compare.py {args.baseline}`: {cpu_name()}, "
        f"{os.cpu_count()} cores shared with other jobs (load average "
        f"{', '.join(f'{x:.1f}' for x in load_start)} at the start, "
        f"{', '.join(f'{x:.1f}' for x in load_end)} at the end); {args.repeats} fresh "
        "processes per tree, alternating; medians of per-process medians of CPU time "
        "(user + system, all threads). See the script's docstring for the cases.", "",
        "| case | baseline | this tree | this / baseline |", "|---|---:|---:|---:|",
    ]
    for case in results["base"][0]:
        base = statistics.median(r[case] for r in results["base"])
        this = statistics.median(r[case] for r in results["this"])
        lines.append(f"| {case} | {fmt(base)} | {fmt(this)} | {this / base:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    start = time.time()
    main()
    print(f"({time.time() - start:.0f} s)")
