"""Small corpora on disk for the command's tests, and an independent check of its output.

Token ids spell out where they come from: token ``j`` of document ``d`` is
``d * STRIDE + j`` (``d`` is the document's place in fastpack's order: files in the order
given, rows in order), so a packed row can be checked without trusting any part of
fastpack.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

STRIDE = 1000
LABEL_OFFSET = 7  # labels are tokens + 7, so the two columns can't be confused


def documents(lengths: Sequence[int], first: int = 0) -> list[np.ndarray]:
    return [np.arange(n, dtype=np.int64) + (first + d) * STRIDE for d, n in enumerate(lengths)]


def write(path: Path, docs: Sequence[np.ndarray], *, labels: bool = False,
          row_group_size: int | None = None, dtype: Any = None) -> Path:
    """``docs`` in the format ``path``'s name says: .parquet, .jsonl(.gz/.zst), or a
    directory ending in ``.ds`` (datasets.save_to_disk)."""
    name = path.name
    dtype = dtype or pa.int32()
    columns: dict[str, Any] = {"input_ids": [d.tolist() for d in docs],
                               "text": [f"doc {i}" for i in range(len(docs))]}
    if labels:
        columns["labels"] = [(d + LABEL_OFFSET).tolist() for d in docs]
    if name.endswith(".parquet"):
        table = pa.table({k: (pa.array(v, pa.list_(dtype)) if k != "text" else v)
                          for k, v in columns.items()})
        pq.write_table(table, path, row_group_size=row_group_size)
    elif ".jsonl" in name:
        lines = "".join(json.dumps({k: v[i] for k, v in columns.items()}) + "\n"
                        for i in range(len(docs))).encode()
        if name.endswith(".gz"):
            lines = gzip.compress(lines)
        elif name.endswith(".zst"):
            sink = pa.BufferOutputStream()
            with pa.CompressedOutputStream(sink, "zstd") as out:
                out.write(lines)
            lines = sink.getvalue().to_pybytes()
        path.write_bytes(lines)
    elif name.endswith(".ds"):
        import datasets

        datasets.disable_progress_bars()
        datasets.Dataset.from_dict(columns).save_to_disk(str(path))
    else:
        raise ValueError(name)
    return path


def corpus(tmp: Path, lengths_per_file: Sequence[Sequence[int]], names: Sequence[str],
           **kwargs: Any) -> tuple[list[str], list[np.ndarray]]:
    """Files named ``names`` holding documents of the given lengths; returns the paths
    and every document in fastpack's order."""
    paths, docs = [], []
    for name, lengths in zip(names, lengths_per_file):
        mine = documents(lengths, first=len(docs))
        paths.append(str(write(tmp / name, mine, **kwargs)))
        docs.extend(mine)
    return paths, docs


def read_rows(outdir: Path) -> pa.Table:
    manifest = json.loads((outdir / "manifest.json").read_text())
    tables = [pq.read_table(outdir / s["file"]) for s in manifest["shards"]]
    return pa.concat_tables(tables) if tables else pa.table({})


def check_output(outdir: Path, docs: Sequence[np.ndarray], *, max_len: int,
                 overlong: str = "error", long_max_len: int | None = None,
                 labels: bool = False) -> pa.Table:
    """Every packed row is whole documents or pieces of them, positions restart per
    piece, no row is over its cap, and every document's tokens are there exactly once
    (as the over-long policy says); the manifest's checksums and counts hold."""
    import hashlib

    manifest = json.loads((outdir / "manifest.json").read_text())
    for shard in manifest["shards"]:
        data = (outdir / shard["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == shard["sha256"]
        assert len(data) == shard["bytes"]
        assert pq.ParquetFile(outdir / shard["file"]).metadata.num_rows == shard["rows"]
    rows = read_rows(outdir)
    cap = long_max_len or max_len
    pieces: dict[int, list[tuple[int, int]]] = {}
    if rows.num_rows == 0:
        assert all(len(d) == 0 or overlong == "drop" for d in docs)
        return rows
    assert rows.column_names[-2:] == ["seq_lengths", "position_ids"]
    for r, (tokens, seqlens, positions) in enumerate(zip(
            rows.column("input_ids").to_pylist(), rows.column("seq_lengths").to_pylist(),
            rows.column("position_ids").to_pylist())):
        assert 0 < len(tokens) <= cap and sum(seqlens) == len(tokens)
        assert positions == [j for n in seqlens for j in range(n)]
        if labels:
            assert rows.column("labels")[r].as_py() == [t + LABEL_OFFSET for t in tokens]
        at = 0
        for n in seqlens:
            segment = np.asarray(tokens[at:at + n])
            doc, start = divmod(int(segment[0]), STRIDE)
            assert np.array_equal(segment, np.arange(n) + doc * STRIDE + start)
            pieces.setdefault(doc, []).append((start, n))
            at += n
    for d, doc in enumerate(docs):
        got = sorted(pieces.pop(d, []))
        n = len(doc)
        if n == 0 or (n > cap and overlong == "drop"):
            assert got == []
        elif n > cap and overlong == "truncate":
            assert got == [(0, cap)]
        else:  # whole, or split into pieces that tile it
            assert [s for s, _ in got] == list(np.cumsum([0] + [k for _, k in got])[:-1])
            assert sum(k for _, k in got) == n
            assert all(k <= cap for _, k in got)
    assert not pieces, f"rows hold documents that do not exist: {sorted(pieces)[:5]}"
    return rows


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300,
        **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``python -m fastpack ARGS`` in a fresh process."""
    full_env = {**os.environ, "FASTPACK_PROGRESS_INTERVAL": "0", **(env or {})}
    return subprocess.run([sys.executable, "-m", "fastpack", *args], capture_output=True,
                          text=True, timeout=timeout, env=full_env, **kwargs)


def shard_bytes(outdir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(outdir.glob("shard-*.parquet"))}


# How a run went (seconds, passes, Ray, --shard jobs): the one file of an output directory
# that differs between ways of writing the same output.
RUN_FILE = "run.json"


def output_files(outdir: Path) -> dict[str, bytes]:
    """Every file of a complete output directory (hidden ones too) by name, but run.json."""
    return {p.name: p.read_bytes() for p in sorted(outdir.iterdir())
            if p.is_file() and p.name != RUN_FILE}


def assert_same_output(a: Path, b: Path) -> None:
    """``a`` and ``b`` hold the same files, byte for byte (report.json included), and
    neither keeps a state directory."""
    fa, fb = output_files(a), output_files(b)
    assert sorted(fa) == sorted(fb), (sorted(fa), sorted(fb))
    assert not (a / ".fastpack").exists() and not (b / ".fastpack").exists()
    differ = [n for n in fa if fa[n] != fb[n]]
    assert not differ, f"{a} and {b} differ in {differ}"
    assert (a / RUN_FILE).exists() and (b / RUN_FILE).exists()
