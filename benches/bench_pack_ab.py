"""One process's warm CPU times of fastpack.pack from a given python/ folder, as JSON: run
it alternately for two trees (each with its own built _core) to compare cores in one run
(benches/results/compare.md).

    python benches/bench_pack_ab.py PYTHON_DIR
"""

from __future__ import annotations

import json
import statistics
import sys
import time

sys.path.insert(0, sys.argv[1])
import numpy as np  # noqa: E402

import fastpack  # noqa: E402


def median_cpu(call, repeats: int = 5):
    """The median CPU time (every thread) of warm calls, and the last call's result."""
    call()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        result = call()
        times.append(time.process_time() - start)
    return statistics.median(times), result


rng = np.random.default_rng(0)
out = {}
for n in (10**6, 10**7):
    lens = np.clip(rng.lognormal(5.3, 0.9, n), 1, 4096).astype(np.int64)
    seconds, plan = median_cpu(lambda lens=lens: fastpack.pack(lens, 4096, shuffle=False))
    out[f"bfd {n:.0e}"] = (seconds, plan.num_packs)
n = 10**6
lens = np.clip(rng.lognormal(5.3, 0.9, n), 1, 4096).astype(np.int64)
patches = np.where(rng.random(n) < 0.6, rng.integers(64, 2048, n), 0).astype(np.int64)
limits = {"patches": (patches, 32768), "images": ((patches > 0).astype(np.int64), 16)}
seconds, plan = median_cpu(lambda: fastpack.pack(lens, 8192, shuffle=False, limits=limits))
out["limits 1e6"] = (seconds, plan.num_packs)
print(json.dumps(out))
