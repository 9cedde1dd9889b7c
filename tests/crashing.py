"""A ``fastpack pack`` run killed the hard way (SIGKILL, as a machine dying) halfway
through a shard, injected from the test: ``python tests/crashing.py N ARGS...`` runs the
command with ARGS and kills its own process once N shards are complete and the next one
has its first row group written. Nothing in fastpack knows about it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any


def crash_after(shards: int, *args: str, timeout: float = 300,
                **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``fastpack ARGS``, killed after ``shards`` complete shards, in a fresh process."""
    env = {**os.environ, "FASTPACK_PROGRESS_INTERVAL": "0"}
    return subprocess.run([sys.executable, str(Path(__file__)), str(shards), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, **kwargs)


def _run(shards: int, args: list[str]) -> None:
    import pyarrow.parquet as pq

    from fastpack._offline import outdir
    from fastpack.cli import main

    done = 0
    record = outdir.OutputDir.record

    def counting_record(self: Any, shard: int, entry: dict[str, Any]) -> None:
        nonlocal done
        record(self, shard, entry)
        done += 1

    write_batch = pq.ParquetWriter.write_batch

    def dying_write_batch(self: Any, *a: Any, **k: Any) -> None:
        write_batch(self, *a, **k)
        if done >= shards:
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    outdir.OutputDir.record = counting_record  # type: ignore[method-assign]
    pq.ParquetWriter.write_batch = dying_write_batch  # type: ignore[method-assign]
    main(args)


if __name__ == "__main__":
    _run(int(sys.argv[1]), sys.argv[2:])
