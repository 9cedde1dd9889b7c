"""One plan written by many jobs: ``fastpack pack --shard i/N`` (a Slurm array of ``N``
jobs, or any ``N`` processes sharing the output directory) and ``fastpack pack
--finalize``.

Every job runs the lengths pass and plans the whole corpus (planning is cheap and
deterministic: every job computes the same plan), then writes only its share of the
output shards -- shards ``floor(i·n/N) .. floor((i+1)·n/N)`` of ``n`` -- atomically, under
the names one job would give them. Each job keeps its own state in
``OUTDIR/.fastpack/part-i-of-N/`` (settings, lengths, journal), so a killed job resumes
with ``--resume`` as a single run does, touching nothing of the others'. A finished job
writes ``complete.json`` there. ``--finalize`` checks that every part is complete with the
same settings and inputs, plans once more from the saved lengths, and writes
report.json, report.png, group_offsets.npy and last manifest.json: the output is byte for
byte the output of one job. Only ``run.json`` (how the run went, not part of the output's
bytes) says it was written by jobs: each job's passes, budget and seconds, and the
slowest's.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._errors import FastpackError
from .outdir import STATE_DIR, OutputDir, sha256_file
from .progress import log
from .settings import PackSettings
from .sources import Source, expand_inputs

__all__ = ["PartDir", "finalize", "parse_part"]

_PART = re.compile(r"part-(\d+)-of-(\d+)")


def parse_part(text: str) -> tuple[int, int]:
    """``"i/N"`` (0 <= i < N) -> ``(i, N)``."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m or not 0 <= int(m.group(1)) < int(m.group(2)):
        raise FastpackError(f"--shard: got {text!r}; expected i/N with 0 <= i < N (job i of "
                            "N, e.g. --shard $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT)")
    return int(m.group(1)), int(m.group(2))


def _part_name(i: int, n: int) -> str:
    return f"part-{i:05d}-of-{n:05d}"


class PartDir(OutputDir):
    """The output directory as job ``i`` of ``n`` sees it: its own state directory, its
    own shards; the other jobs' files are left alone."""

    def __init__(self, path: Path, settings: PackSettings, sources: Sequence[Source],
                 quiet: bool, part: tuple[int, int]) -> None:
        super().__init__(path, settings, sources, quiet)
        self.part = part
        self.state_dir = path / STATE_DIR / _part_name(*part)
        self.journal = self.state_dir / "journal.jsonl"

    def wanted(self, num_shards: int) -> range:
        i, n = self.part
        return range(i * num_shards // n, (i + 1) * num_shards // n)

    def _check(self, *, resume: bool, overwrite: bool) -> bool:
        out = self.path
        if out.exists() and not out.is_dir():
            raise FastpackError(f"-o {out}: exists and is not a directory")
        (out / STATE_DIR).mkdir(parents=True, exist_ok=True)  # N jobs may race here
        if (out / "manifest.json").exists():
            raise FastpackError(f"-o {out}: already holds a complete packed dataset; "
                                "--shard jobs write into a new or empty directory")
        state = self.state_dir / "state.json"
        if state.exists():
            if overwrite:
                shutil.rmtree(self.state_dir)
                return False
            if not resume:
                raise FastpackError(
                    f"-o {out}: holds an interrupted run of job {self.part[0]}/{self.part[1]} "
                    f"({len(self.done())} shards complete); pass --resume to finish it, or "
                    "--overwrite to start it over")
            before = json.loads(state.read_text())
            now = self.state()
            for key in ("settings", "inputs"):
                if before.get(key) != now[key]:
                    raise FastpackError(
                        f"--resume: the interrupted job in {out} used other {key}:\n"
                        f"  then {json.dumps(before.get(key))}\n"
                        f"  now  {json.dumps(now[key])}\n"
                        "pass the same options and inputs, or --overwrite to start over")
            return True
        others = sorted(p.name for p in out.iterdir()
                        if not p.name.startswith(("shard-", ".shard-", STATE_DIR)))
        if others:
            raise FastpackError(f"-o {out}: holds files that are not fastpack's "
                                f"({', '.join(others[:3])}); pick a new or empty directory")
        return False

    def abandon(self) -> None:
        shutil.rmtree(self.state_dir, ignore_errors=True)

    def verified_done(self, num_shards: int) -> dict[int, dict[str, Any]]:
        """As a single run's, but only this job's shards and temporary files: the other
        jobs may be writing theirs right now."""
        mine = self.wanted(num_shards)
        done = {i: e for i, e in self.done().items() if i in mine}
        for i, entry in list(done.items()):
            if sha256_file(self.path / entry["file"]) != entry["sha256"]:
                log(f"resume: {entry['file']} does not match its checksum; writing it again",
                    quiet=self.quiet)
                del done[i]
        from .layout import shard_name

        for i in mine:
            tmp = self.path / f".{shard_name(i, num_shards)}.tmp"
            if tmp.exists():
                tmp.unlink()
        if done:
            log(f"resume: {len(done)} of {len(mine)} shards of job {self.part[0]}/"
                f"{self.part[1]} complete; writing {len(mine) - len(done)}", quiet=self.quiet)
        return done

    def complete(self, entries: Sequence[dict[str, Any]],
                 run: dict[str, Any]) -> dict[str, Any]:
        """Marks this job done (``complete.json``, with how its run went: ``run``, for
        finalize's run.json); returns what the summary says."""
        i, n = self.part
        value = {"part": [i, n], "shards": [e["file"] for e in entries],
                 "rows": sum(e["rows"] for e in entries),
                 "tokens": sum(e["tokens"] for e in entries),
                 "bytes": sum(e["bytes"] for e in entries), **run}
        self.write_json(self.state_dir / "complete.json", value)
        return value


def _parts(out: Path) -> tuple[int, list[Path]]:
    """The parts' state directories (every one of ``0..N-1`` present and complete)."""
    state = out / STATE_DIR
    found: dict[int, set[int]] = {}
    if state.is_dir():
        for p in state.iterdir():
            m = _PART.fullmatch(p.name)
            if m:
                found.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    if not found:
        if (out / "manifest.json").exists():
            raise FastpackError(f"--finalize: {out} is already complete (manifest.json)")
        raise FastpackError(f"--finalize: {out} holds no --shard job's output; run the "
                            "jobs (fastpack pack ... --shard i/N) first")
    if len(found) > 1:
        raise FastpackError(f"--finalize: {out} holds jobs of different splits "
                            f"({', '.join(f'N={n}' for n in sorted(found))}); start over")
    ((n, seen),) = found.items()
    dirs = [state / _part_name(i, n) for i in range(n)]
    waiting = [i for i in range(n) if i not in seen or
               not (dirs[i] / "complete.json").exists()]
    if waiting:
        raise FastpackError(
            f"--finalize: {len(waiting)} of {n} jobs are not complete (--shard "
            f"{', '.join(f'{i}/{n}' for i in waiting[:5])}{' ...' if len(waiting) > 5 else ''})"
            "; run them (a killed one: the same command with --resume) and finalize again")
    return n, dirs


def finalize(outdir: str | Path, *, quiet: bool = False,
             plot: bool | None = None) -> dict[str, Any]:
    """``fastpack pack -o OUTDIR --finalize``: once every ``--shard`` job is complete, the
    report and the manifest, as one job would have written them; returns the report."""
    from .driver import conclude
    from .layout import shard_bounds
    from .mix import plan_run
    from .scan import Scan
    from .stats import check_plot

    check_plot(plot)
    out_path = Path(outdir)
    n, dirs = _parts(out_path)
    states = [json.loads((d / "state.json").read_text()) for d in dirs]
    for i, st in enumerate(states[1:], start=1):
        for key in ("settings", "inputs"):
            if st.get(key) != states[0].get(key):
                raise FastpackError(f"--finalize: jobs 0/{n} and {i}/{n} used other {key}; "
                                    "every job must run the same command")
    settings = PackSettings.from_json(states[0]["settings"])
    sources = expand_inputs([f["path"] for f in states[0]["inputs"]]) \
        if states[0]["inputs"] else []
    out = OutputDir(out_path, settings, sources, quiet)
    if [s.fingerprint() for s in sources] != states[0]["inputs"]:
        raise FastpackError("--finalize: the inputs changed since the jobs read them; rerun "
                            "the jobs with --overwrite")
    part = PartDir(out_path, settings, sources, quiet, (0, n))
    part.state_dir = dirs[0]
    saved = Scan.saved(part)
    assert saved is not None, "a complete job keeps its lengths"
    scan, read_sources = saved
    out.packing(scan.columns)
    plan, pack_counts, mixed = plan_run(scan, out.settings, read_sources, sources)
    assert settings.shard_rows is not None
    total = len(shard_bounds(pack_counts, settings.shard_rows)) - 1
    entries: dict[int, dict[str, Any]] = {}
    for i, d in enumerate(dirs):
        part = PartDir(out_path, settings, sources, quiet, (i, n))
        part.state_dir, part.journal = d, d / "journal.jsonl"
        entries.update(part.done())
    missing = [i for i in range(total) if i not in entries]
    if missing:
        raise FastpackError(f"--finalize: shard {missing[0]} is missing or not whole; rerun "
                            "its job with --resume")
    done = [json.loads((d / "complete.json").read_text()) for d in dirs]
    seconds: dict[str, float] = {}
    for d in done:
        for k, v in d["seconds"].items():
            seconds[k] = max(seconds.get(k, 0.0), v)
    keys = ("passes", "memory_budget", "spilled", "seconds")
    run = {"passes": max(d["passes"] for d in done),
           "memory_budget": max(d["memory_budget"] for d in done),
           "spilled": any(d["spilled"] for d in done), "parts": n, "seconds": seconds,
           "jobs": [{"part": d["part"], **{k: d[k] for k in keys}} for d in done]}
    log(f"finalize: {len(entries):,} shards written by {n} jobs", quiet=quiet)
    return conclude(out, scan, plan, mixed, [entries[i] for i in range(total)], run,
                    plot=plot)
