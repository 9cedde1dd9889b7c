"""What every benchmark's table names: the machine's CPU and its load at the time."""

from __future__ import annotations

import os
import platform
import subprocess


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
