"""Planning bench_vlm's mix of 10^6 items under each subset of its budgets, in one warm
process: tokens only, tokens + patches, tokens + images, all three. The variants run in
turn, 9 rounds; the table gives the median of the last 8 (wall clock, and the process's
CPU time, which a loaded machine disturbs less) and their ratios to tokens only. bench_vlm.py times the same plans in fresh processes (first call and warm).

    python benches/bench_vlm_budgets.py [--items 1000000] [--mix images60] [--strategy ffd]

``--mix images60``: 60% of items carry images (40% captions, 20% documents of 2-4
images), 10% videos, 30% text only, instead of bench_vlm's 50/20/10/20.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_vlm  # noqa: E402

import fastpack  # noqa: E402

# Shares of captions, multi-image documents, videos, text only.
MIXES = {"bench_vlm": bench_vlm.KINDS, "images60": (0.4, 0.2, 0.1, 0.3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--mix", choices=sorted(MIXES), default="bench_vlm")
    ap.add_argument("--strategy", choices=["bfd", "ffd"], default="bfd")
    a = ap.parse_args()
    data = bench_vlm.mix(a.items, kinds=MIXES[a.mix])
    patches = (data["patches"], bench_vlm.MAX_PATCHES)
    images = (data["images"], bench_vlm.MAX_IMAGES)
    variants: dict[str, dict[str, Any]] = {
        "tokens only": {},
        "tokens + patches": {"limits": {"patches": patches}},
        "tokens + images": {"limits": {"images": images}},
        "tokens + patches + images": {"limits": {"patches": patches, "images": images}},
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    packs: dict[str, int] = {}
    for _ in range(a.rounds):
        for name, kwargs in variants.items():
            start, cpu_start = time.perf_counter(), time.process_time()
            plan = fastpack.pack(data["lengths"], bench_vlm.MAX_LEN, shuffle=False,
                                 overlong="drop", strategy=a.strategy, **kwargs)
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - cpu_start)
            packs[name] = plan.num_packs
    print(f"{bench_vlm.cpu()}, load {os.getloadavg()[0]:.1f}; {a.items:,} items, mix {a.mix}, "
          f"{a.strategy}\n")
    print("| budgets | warm median | ÷ tokens only | CPU median | ÷ tokens only | packs |\n"
          "|---|---:|---:|---:|---:|---:|")
    base = statistics.median(times["tokens only"][1:])
    cpu_base = statistics.median(cpu["tokens only"][1:])
    for name in variants:
        median = statistics.median(times[name][1:])
        used = statistics.median(cpu[name][1:])
        print(f"| {name} | {median * 1e3:.1f} ms | {median / base:.2f}× | {used * 1e3:.1f} ms | "
              f"{used / cpu_base:.2f}× | {packs[name]:,} |")


if __name__ == "__main__":
    main()
