"""What every benchmark's table names (the machine's CPU and its load at the time), and the
best-of-N timing loop the benches share."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from collections.abc import Callable
from typing import Any


def cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next(line.split(":", 1)[1].strip() for line in out.splitlines()
                    if line.startswith("Model name"))
    except (OSError, StopIteration):
        name = platform.processor()
    return f"{name}, {os.cpu_count()} cores (shared)"


def load() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def best_of(repeats: int, run: Callable[[], Any]) -> tuple[float, Any]:
    """The fastest of ``repeats`` calls of ``run`` (seconds) and the last call's result."""
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = run()
        best = min(best, time.perf_counter() - t)
    return best, out
