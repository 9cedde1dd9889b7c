"""The output directory, where nothing is half-written: a shard is written to a hidden
temporary name, flushed to disk and renamed; every complete shard is appended to a journal
with its rows and sha256; ``manifest.json`` (every shard with its checksum) is written last
and is the mark of a complete output. Every file but ``run.json`` (how the run went) is
the same bytes however the output was written. An interrupted run keeps its state in
``.fastpack/`` (its settings and inputs, the lengths pass's result, the journal) and
resumes from it."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from .._errors import FastpackError
from .._gather import WRITTEN
from .formats import entry_files, finish_format, is_format_file, sha256_file
from .progress import log
from .settings import PackSettings
from .sources import Source

__all__ = ["FORMAT", "RUN_FILE", "STATE_DIR", "OutputDir", "sha256_file", "write_shard"]

FORMAT = "fastpack-packed/1"
STATE_DIR = ".fastpack"
# How this run went (seconds, passes, budget, Ray, --shard jobs): beside the output, not
# part of its bytes -- no manifest checksum covers it, and it differs from run to run.
RUN_FILE = "run.json"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_shard(outdir: Path, name: str, schema: pa.Schema,
                batches: Iterator[pa.RecordBatch]) -> dict[str, Any]:
    """Writes one parquet shard atomically: a hidden temporary name, flushed to disk, then
    renamed. Returns its journal entry (rows, tokens, bytes, sha256)."""
    import pyarrow.parquet as pq

    final = outdir / name
    tmp = outdir / f".{name}.tmp"
    rows = tokens = 0
    try:
        # Dictionaries only where values repeat (positions, lengths): a dictionary of token
        # ids costs readers 3x the decode time for no smaller files.
        with pq.ParquetWriter(tmp, schema, compression="zstd",
                              use_dictionary=[f"{c}.list.element" for c in WRITTEN]) as writer:
            for batch in batches:
                writer.write_batch(batch)
                rows += batch.num_rows
                tokens += len(batch.column(0).values)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        digest = sha256_file(tmp)
        os.replace(tmp, final)
        _fsync_dir(outdir)
    finally:
        if tmp.exists():
            tmp.unlink()
    return {"file": name, "rows": rows, "tokens": tokens, "bytes": final.stat().st_size,
            "sha256": digest}


class OutputDir:
    """An output directory: what it holds, the state of an unfinished run, the journal of
    complete shards, and the manifest that marks it complete."""

    def __init__(self, path: Path, settings: PackSettings, sources: Sequence[Source],
                 quiet: bool) -> None:
        self.path, self.settings, self.sources, self.quiet = path, settings, sources, quiet
        #: The settings as asked (what a resumed run must match); ``settings`` names the
        #: packed columns once the lengths pass has found them.
        self.requested = settings
        self.state_dir = path / STATE_DIR
        self.journal = self.state_dir / "journal.jsonl"
        self.created = False
        self.resumed = False

    def state(self) -> dict[str, Any]:
        return {"format": FORMAT, "settings": self.requested.to_json(),
                "inputs": [s.fingerprint() for s in self.sources]}

    def packing(self, columns: Sequence[str]) -> None:
        """From now on ``settings`` names the packed columns (``columns``, the token
        column first)."""
        self.settings = replace(self.requested, columns=tuple(columns[1:]))

    @staticmethod
    def write_json(path: Path, value: Any) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "w") as f:
            json.dump(value, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def prepare(self, *, resume: bool, overwrite: bool) -> bool:
        """Checks what the directory holds and starts (or resumes) a run; returns True when
        an interrupted run is resumed."""
        resumed = self._check(resume=resume, overwrite=overwrite)
        self.state_dir.mkdir(exist_ok=True)
        if not resumed:
            self.write_json(self.state_dir / "state.json", self.state())
        self.resumed = resumed
        return resumed

    @contextmanager
    def abandoned_on_error(self) -> Iterator[None]:
        """Around the passes before any shard (lengths, plan): bad input found there
        leaves nothing behind, unless the run resumes an interrupted one."""
        try:
            yield
        except BaseException:
            if not self.resumed:
                self.abandon()
            raise

    def _check(self, *, resume: bool, overwrite: bool) -> bool:
        out = self.path
        if not out.exists():
            out.mkdir(parents=True)
            self.created = True
            return False
        if not out.is_dir():
            raise FastpackError(f"-o {out}: exists and is not a directory")
        state = self.state_dir / "state.json"
        if (out / "manifest.json").exists():
            if overwrite:
                self.clean()
                return False
            shards = len(json.loads((out / "manifest.json").read_text()).get("shards", []))
            raise FastpackError(
                f"-o {out}: already holds a complete packed dataset ({shards} shards); "
                "pass --overwrite to replace it")
        if state.exists():
            if overwrite:
                self.clean()
                return False
            if not resume:
                raise FastpackError(
                    f"-o {out}: holds an interrupted run ({len(self.done())} shards "
                    "complete); pass --resume to finish it, or --overwrite to start over")
            before = json.loads(state.read_text())
            now = self.state()
            for key in ("settings", "inputs"):
                if before.get(key) != now[key]:
                    raise FastpackError(
                        f"--resume: the interrupted run in {out} used other {key}:\n"
                        f"  then {json.dumps(before.get(key))}\n"
                        f"  now  {json.dumps(now[key])}\n"
                        "pass the same options and inputs, or --overwrite to start over")
            return True
        leftovers = sorted(p.name for p in out.iterdir())
        ours = all(n.startswith("report.") or n == RUN_FILE or is_format_file(n)
                   for n in leftovers)
        if leftovers and not (overwrite and ours):
            raise FastpackError(
                f"-o {out}: not empty and holds no fastpack output ({', '.join(leftovers[:3])}"
                f"{' ...' if len(leftovers) > 3 else ''}); pick a new or empty directory")
        self.clean()
        return False

    def clean(self) -> None:
        """Removes fastpack's own files (nothing else)."""
        for path in self.path.iterdir():
            name = path.name
            if name == STATE_DIR:
                shutil.rmtree(path)
            elif is_format_file(name) or name in (
                    "manifest.json", "report.json", "report.png", "group_offsets.npy",
                    RUN_FILE, ".manifest.json.tmp", ".report.json.tmp", f".{RUN_FILE}.tmp"):
                path.unlink()

    def abandon(self) -> None:
        """After bad input found before any shard: leave nothing behind."""
        shutil.rmtree(self.state_dir, ignore_errors=True)
        if self.created and not any(self.path.iterdir()):
            self.path.rmdir()

    def done(self) -> dict[int, dict[str, Any]]:
        """Shards the journal lists whose file is there with its size (a torn last line,
        from a crash while appending, is ignored)."""
        done: dict[int, dict[str, Any]] = {}
        if not self.journal.exists():
            return done
        for line in self.journal.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if all((self.path / f["file"]).exists()
                   and (self.path / f["file"]).stat().st_size == f["bytes"]
                   for f in entry_files(entry)):
                done[entry["shard"]] = entry
        return done

    def verified_done(self, num_shards: int) -> dict[int, dict[str, Any]]:
        """Complete shards whose bytes still hash to the journal's; removes the temporary
        file of a shard interrupted halfway."""
        done = self.done()
        for i, entry in list(done.items()):
            if i >= num_shards or any(sha256_file(self.path / f["file"]) != f["sha256"]
                                      for f in entry_files(entry)):
                log(f"resume: {entry['file']} does not match its checksum; writing it again",
                    quiet=self.quiet)
                del done[i]
        for path in self.path.glob(".shard-*.tmp"):
            path.unlink()
        if done:
            log(f"resume: {len(done)} of {num_shards} shards complete; writing "
                f"{num_shards - len(done)}", quiet=self.quiet)
        return done

    def wanted(self, num_shards: int) -> range:
        """The output shards this run writes: all of them (a ``--shard`` job: its share)."""
        return range(num_shards)

    def record(self, shard: int, entry: dict[str, Any]) -> None:
        with open(self.journal, "a") as f:
            f.write(json.dumps({"shard": shard, **entry}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def finish(self, report: dict[str, Any], run: dict[str, Any],
               entries: Sequence[dict[str, Any]], columns: Sequence[str], num_packs: int,
               group_offsets: np.ndarray | None) -> dict[str, Any]:
        """report.json, run.json (``run``: how this run went, outside the manifest),
        group_offsets.npy, and last the manifest (``columns``: the output's, ``entries``:
        every shard's journal entry); then the state directory goes. Returns the report
        with the run record under ``run`` (what ``pack_corpus`` returns)."""
        self.write_json(self.path / "report.json", report)
        self.write_json(self.path / RUN_FILE, run)
        finish_format(self.settings.format, self.path, entries)
        if group_offsets is not None:
            np.save(self.path / "group_offsets.npy", group_offsets)
        manifest = {
            "format": FORMAT,
            "settings": self.settings.to_json(),
            "inputs": [s.fingerprint() for s in self.sources],
            "columns": list(columns),
            "num_packs": num_packs,
            "shards": [{k: e[k] for k in ("file", "rows", "tokens", "bytes", "sha256", "parts")
                        if k in e} for e in entries],
        }
        self.write_json(self.path / "manifest.json", manifest)
        shutil.rmtree(self.state_dir, ignore_errors=True)
        return {**report, "run": run}
