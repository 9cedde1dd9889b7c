#!/usr/bin/env python
"""Streams: packing efficiency against buffer size, and packed samples per second.

    python benches/bench_stream.py             # N = 3*10^5 samples, buffers 10^2 .. 10^5
    python benches/bench_stream.py --quick     # N = 3*10^4, buffers 10^2 .. 10^4

SFT-like lengths (log-normal, mean about 300, clipped to [1, 4096], the same generator as
bench_pack.py), max_len 4096, int32 tokens.

Efficiency (total tokens / (packs * max_len)) for each buffer size B, side by side:

  fastpack stream   fastpack.StreamPacker(4096, buffer_size=B): best fit decreasing over
                    each window, under-filled packs wait for later samples; the end of the
                    stream is flushed. Time = the planning core alone (lengths in, packs
                    out, the window's token buffer concatenated), median of --repeat runs.
  plain windows     fastpack.pack over each window of B samples, every pack emitted (the
                    stream packer without its carry: what windowing costs).
  TRL windowed bfd  trl.pack_dataset(IterableDataset, 4096, "bfd",
                    map_kwargs={"batch_size": B}): TRL packs a stream one map batch at a
                    time; its time includes moving the tokens through Arrow (one run).
  offline           fastpack.pack over all N lengths (the bound a stream approaches).

Throughput at B = 10^4 (the default) on --tput-n samples with real token ids, median of
--repeat runs, each from a fresh iterator:

  HF stream, read only      iterate the datasets.IterableDataset (python rows): the floor
  PackedIterableDataset     ... the same stream -> ready sdpa batches of 8 packs (torch)
  list of numpy samples     PackedIterableDataset over a Python list of {"input_ids": array}
  pack_iterable_dataset     IterableDataset -> packed IterableDataset, read as Arrow batches
  TRL pack_dataset (bfd)    the same stream through TRL, read the same way
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

MAX_LEN = 4096
SEED = 1234
HERE = Path(__file__).resolve().parent


def sft_lengths(n: int, seed: int = SEED) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.lognormal(math.log(300) - 0.5, 1.0, n)
    return np.clip(np.rint(x), 1, MAX_LEN).astype(np.int64)


def median_time(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


# --------------------------------------------------------------------------- efficiency
def fastpack_stream(lengths: np.ndarray, buffer_size: int) -> tuple[float, int]:
    """Feed the lengths window by window (token values: a zero-copy view of zeros)."""
    import fastpack

    packer = fastpack.StreamPacker(MAX_LEN, buffer_size=buffer_size)
    zeros = np.zeros(1, dtype=np.int32)
    pos, n = 0, len(lengths)
    while not packer.finished:
        room = packer.room
        chunk = lengths[pos : pos + room]
        offsets = np.zeros(len(chunk) + 1, dtype=np.int64)
        np.cumsum(chunk, out=offsets[1:])
        values = np.broadcast_to(zeros, (int(offsets[-1]),))
        rnd = packer.push({"input_ids": (values, offsets)}, final=len(chunk) < room)
        rnd.take(rnd.remaining)
        pos += len(chunk)
    assert packer.stats.num_sequences == n
    return packer.stats.efficiency, packer.stats.num_packs


def plain_windows(lengths: np.ndarray, buffer_size: int) -> tuple[float, int]:
    import fastpack

    tokens = packs = 0
    for i in range(0, len(lengths), buffer_size):
        plan = fastpack.pack(lengths[i : i + buffer_size], MAX_LEN)
        tokens += plan.total_tokens
        packs += plan.num_packs
    return tokens / (packs * MAX_LEN), packs


def token_dataset(lengths: np.ndarray, *, ids: bool) -> Any:
    import datasets
    import pyarrow as pa

    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    rng = np.random.default_rng(SEED)
    values = (rng.integers(1, 32_000, int(offsets[-1])) if ids
              else np.zeros(int(offsets[-1]))).astype(np.int32)
    column = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values))
    return datasets.Dataset(pa.table({"input_ids": column}))


def count_packed(packed: Any) -> tuple[int, int]:
    packs = tokens = 0
    for batch in packed.with_format("arrow").iter(batch_size=1000):
        offsets = batch.column("input_ids").combine_chunks().offsets.to_numpy()
        packs += batch.num_rows
        tokens += int(offsets[-1] - offsets[0])
    return packs, tokens


def trl_windows(stream: Any, buffer_size: int) -> tuple[float, int, float]:
    import trl

    t = time.perf_counter()
    packed = trl.pack_dataset(stream, MAX_LEN, strategy="bfd",
                              map_kwargs={"batch_size": buffer_size})
    packs, tokens = count_packed(packed)
    return tokens / (packs * MAX_LEN), packs, time.perf_counter() - t


# --------------------------------------------------------------------------- throughput
def throughput(n: int, buffer_size: int, repeat: int) -> list[dict[str, Any]]:
    import trl

    from fastpack._stream import pack_iterable_dataset
    from fastpack.torch import PackedCollator, PackedIterableDataset

    lengths = sft_lengths(n, seed=SEED + 1)
    data = token_dataset(lengths, ids=True)
    stream = data.to_iterable_dataset(num_shards=1)
    collator = PackedCollator(max_len=MAX_LEN, backend="sdpa")
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.asarray(data.data.column("input_ids").combine_chunks().values)
    arrays = [{"input_ids": flat[offsets[i] : offsets[i + 1]]} for i in range(n)]
    rows: list[dict[str, Any]] = []

    def add(name: str, fn: Callable[[], Any], note: str = "") -> None:
        seconds, _ = median_time(fn, repeat)
        rows.append({"name": name, "seconds": seconds, "samples_per_s": n / seconds,
                     "note": note})
        print(f"  {name:<28} {seconds:8.3f} s  {n / seconds:12,.0f} samples/s", flush=True)

    def batches(source: Any) -> int:
        ds = PackedIterableDataset(source, collator, buffer_size=buffer_size, packs_per_batch=8)
        return sum(1 for _ in ds)

    add("HF stream, read only", lambda: sum(1 for _ in stream))
    add("PackedIterableDataset (HF)", lambda: batches(stream), "sdpa batches of 8 packs")
    add("PackedIterableDataset (list)", lambda: batches(arrays), "numpy int32 samples")
    add("pack_iterable_dataset", lambda: count_packed(
        pack_iterable_dataset(stream, MAX_LEN, buffer_size=buffer_size)))
    add("TRL pack_dataset (bfd)", lambda: count_packed(
        trl.pack_dataset(stream, MAX_LEN, strategy="bfd",
                         map_kwargs={"batch_size": buffer_size})))
    return rows


# --------------------------------------------------------------------------- report
def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown CPU"


def versions() -> str:
    import datasets
    import torch
    import trl

    import fastpack

    return (f"fastpack {fastpack.__version__}, trl {trl.__version__}, datasets "
            f"{datasets.__version__}, torch {torch.__version__}, Python "
            f"{platform.python_version()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=float, default=3e5, help="samples for efficiency")
    parser.add_argument("--buffers", default="1e2,1e3,1e4,1e5")
    parser.add_argument("--tput-n", type=float, default=1e5, help="samples for throughput")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-trl", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(HERE / "results" / "stream.md"))
    args = parser.parse_args()
    if args.quick:
        args.n, args.buffers, args.tput_n, args.repeat = 3e4, "1e2,1e3,1e4", 2e4, 1
    n = int(args.n)
    buffers = [int(float(b)) for b in args.buffers.split(",")]
    import fastpack

    lengths = sft_lengths(n)
    offline = fastpack.pack(lengths, MAX_LEN)
    print(f"{n:,} SFT-like lengths, mean {lengths.mean():.0f}; offline BFD efficiency "
          f"{offline.efficiency:.4%} ({offline.num_packs:,} packs)", flush=True)
    stream = None if args.no_trl else token_dataset(lengths, ids=False).to_iterable_dataset()
    eff_rows = []
    for b in buffers:
        seconds, (eff, packs) = median_time(lambda b=b: fastpack_stream(lengths, b), args.repeat)
        plain_eff, plain_packs = plain_windows(lengths, b)
        row: dict[str, Any] = {
            "buffer_size": b, "stream_efficiency": eff, "stream_packs": packs,
            "stream_seconds": seconds, "stream_samples_per_s": n / seconds,
            "plain_efficiency": plain_eff, "plain_packs": plain_packs,
        }
        if stream is not None:
            trl_eff, trl_packs, trl_seconds = trl_windows(stream, b)
            row.update(trl_efficiency=trl_eff, trl_packs=trl_packs, trl_seconds=trl_seconds)
        eff_rows.append(row)
        print(f"  B={b:>7,}: stream {eff:.4%} ({packs:,} packs, {n / seconds:,.0f} samples/s)"
              f"  plain {plain_eff:.4%}"
              + (f"  TRL {row['trl_efficiency']:.4%} ({row['trl_seconds']:.1f} s)"
                 if stream is not None else ""), flush=True)
    tput_n = int(args.tput_n)
    print(f"throughput, {tput_n:,} samples, buffer 10^4:", flush=True)
    tput_rows = throughput(tput_n, 10_000, args.repeat)
    write(Path(args.out), n, lengths, offline, eff_rows, tput_n, tput_rows, args.repeat)


def write(path: Path, n: int, lengths: np.ndarray, offline: Any, eff_rows: list[dict[str, Any]],
          tput_n: int, tput_rows: list[dict[str, Any]], repeat: int) -> None:
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    lines = [
        "# Streams: efficiency against buffer size, packed samples per second",
        "",
        f"{cpu_name()}, {versions()}. `python benches/bench_stream.py` "
        f"(load average at the end: {' '.join(load)}).",
        "",
        f"## Efficiency: {n:,} SFT-like samples (log-normal, mean {lengths.mean():.0f}, cap "
        f"{MAX_LEN}), max_len {MAX_LEN}",
        "",
        f"Offline BFD over the whole set: **{offline.efficiency:.4%}** "
        f"({offline.num_packs:,} packs; lower bound {offline.lower_bound:,}). The stream "
        "flushes its last window at the end, as a finite stream must.",
        "",
        "| buffer (samples) | fastpack stream | packs | plain windows (no carry) | "
        "TRL windowed bfd | TRL packs | fastpack planning | TRL time |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in eff_rows:
        trl = (f"{r['trl_efficiency']:.4%} | {r['trl_packs']:,} | "
               if "trl_efficiency" in r else "n/a | n/a | ")
        trl_time = f"{r['trl_seconds']:.1f} s" if "trl_seconds" in r else "n/a"
        lines.append(
            f"| {r['buffer_size']:,} | **{r['stream_efficiency']:.4%}** | "
            f"{r['stream_packs']:,} | {r['plain_efficiency']:.4%} | {trl}"
            f"{r['stream_samples_per_s'] / 1e6:.2f} M samples/s | {trl_time} |"
        )
    lines += [
        "",
        "fastpack planning: the stream packer alone (lengths in, packs out; median of "
        f"{repeat}). TRL time: `pack_dataset` on the IterableDataset, read to the end "
        "(tokens through Arrow included, one run).",
        "",
        f"## Packed samples per second: {tput_n:,} SFT-like samples, buffer 10^4, "
        f"median of {repeat}",
        "",
        "| path | time | samples/s | vs. reading the HF stream |",
        "|---|---:|---:|---:|",
    ]
    floor = tput_rows[0]["seconds"]
    for r in tput_rows:
        note = f" ({r['note']})" if r["note"] else ""
        lines.append(f"| {r['name']}{note} | {r['seconds']:.2f} s | "
                     f"{r['samples_per_s']:,.0f} | {r['seconds'] / floor:.2f}x |")
    trl_row = next(r for r in tput_rows if r["name"].startswith("TRL"))
    ours = next(r for r in tput_rows if r["name"] == "pack_iterable_dataset")
    lines += [
        "",
        f"`pack_iterable_dataset` is {trl_row['seconds'] / ours['seconds']:.1f}x faster than "
        "TRL's `pack_dataset` on the same stream, at higher efficiency (table above).",
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    path.with_suffix(".json").write_text(json.dumps(
        {"n": n, "efficiency": eff_rows, "throughput_n": tput_n, "throughput": tput_rows,
         "offline_efficiency": offline.efficiency}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
