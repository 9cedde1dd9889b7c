"""``fastpack pack``: a corpus on disk -> parquet shards of packed rows, in bounded memory.
:func:`pack_corpus` runs the passes, each a module of this package:

0. :mod:`.outdir` — the output directory is checked and a run started (or an interrupted
   one resumed: its settings and inputs must be the same). Nothing in it is ever
   half-written: shards are written atomically and listed in a journal with their sha256;
   ``manifest.json``, written last, marks the output complete.
1. :mod:`.scan` — **lengths**: every input (:mod:`.sources`: parquet, JSON lines, Arrow)
   is read once, as a stream of batches; only each document's length is kept (4 bytes per
   document), and which columns are packed, in which dtype. With ``--text-column`` this
   pass tokenizes and spills the ids to parquet, so text is tokenized once.
2. :mod:`.plan` — **plan**: one global plan (``fastpack.pack``) over all lengths, or a
   sharded plan (``--plan-shards``: the documents dealt to shards by a hash of their key).
3. :mod:`.gather` — **gather**: the output's row groups (:mod:`.layout`) are grouped into
   passes whose documents' tokens fit the memory budget; each pass loads its documents
   (one pass: read from the inputs; several: spilled to a file per pass by one more read)
   and gathers their rows in Rust (``fastpack.gather``), shard by shard.
4. :mod:`.report` — **report**: the plan's numbers, report.json, report.png and the
   summary: every token dropped, truncated or split is counted, every column left out
   named. How the run went (times, passes) goes to run.json, apart: every other file is
   the same bytes however the output was written.

Memory: about ``33 bytes × documents`` (lengths, plan, pass mask) + ``--memory`` (one
pass's tokens) + one input batch (``BATCH_BYTES`` of decoded rows, or one parquet row
group) + one output row group (``ROW_GROUP_TOKENS`` tokens). See docs/cli.md.

``fastpack.ray`` runs the same passes on a Ray cluster with these modules' pieces (the
settings, the columns to pack, the over-the-cap rule, the row gather, the output directory and the
report), byte for byte the same shards. ``fastpack stats`` is the lengths pass and
:mod:`.stats`. The layers of fastpack and who owns what: docs/architecture.md.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .._mix import MixedPlan
from .._plan import Plan
from .gather import gather_passes
from .layout import output_schema
from .mix import mix_inputs, plan_run
from .outdir import OutputDir
from .progress import log
from .report import PlanStats, make_report
from .scan import Scan, lengths_pass
from .settings import PackSettings
from .sources import expand_inputs
from .stats import check_plot

__all__ = ["conclude", "pack_corpus"]


def pack_corpus(
    inputs: Sequence[str],
    outdir: str | os.PathLike[str],
    settings: PackSettings,
    *,
    memory: int | None = None,
    spill: bool = True,
    resume: bool = False,
    overwrite: bool = False,
    quiet: bool = False,
    plot: bool | None = None,
    part: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Packs the documents of ``inputs`` into parquet shards in ``outdir``; returns the
    report (also written to ``outdir/report.json``) with, under ``run``, how the run went
    (``outdir/run.json``: seconds, gather passes, memory budget; not part of the output's
    bytes, which are the same however it was written).

    ``memory``: bytes of token data one gather pass may hold (default: half the available
    memory). More passes than one read the inputs once more and ``spill`` each pass's
    documents to a temporary file (as many bytes as the tokens), or, without ``spill``,
    read the inputs again for every pass. ``plot``: draw report.png (None: where
    matplotlib is installed; True: required, checked before any work). With
    ``settings.mix``, ``inputs`` may be empty: the mixture's sources name the files.
    ``part=(i, n)``: job ``i`` of ``n`` (``--shard i/n``) plans everything and writes
    only its share of the shards; :func:`~fastpack._offline.parts.finalize` then writes
    the manifest and report."""
    from .parts import PartDir

    check_plot(plot)
    if settings.mix is not None and not inputs:
        inputs = mix_inputs(settings.mix)[0]
    seconds: dict[str, float] = {}
    clock = time.monotonic()
    sources = expand_inputs(inputs)
    out = OutputDir(Path(outdir), settings, sources, quiet) if part is None else \
        PartDir(Path(outdir), settings, sources, quiet, part)
    resumed = out.prepare(resume=resume, overwrite=overwrite)
    with out.abandoned_on_error():
        scan, read_sources = lengths_pass(out, resumed)
        out.packing(scan.columns)
        scan.stored(out.settings)  # an id the --token-dtype cannot hold: refused now
        seconds["lengths"] = time.monotonic() - clock
        clock = time.monotonic()
        plan, pack_counts, mixed = plan_run(scan, out.settings, read_sources, out.sources)
    seconds["plan"] = time.monotonic() - clock
    log(f"plan: {plan.num_packs:,} packs of {settings.max_len:,} tokens for "
        f"{len(scan.lengths):,} documents ({seconds['plan']:.2f} s)", quiet=quiet)
    clock = time.monotonic()
    entries, passes, budget = gather_passes(out, read_sources, scan, plan, pack_counts,
                                            memory, spill)
    seconds["gather"] = time.monotonic() - clock
    run = {"passes": passes, "memory_budget": budget, "spilled": spill and passes > 1,
           "seconds": {k: round(v, 3) for k, v in seconds.items()}}
    if isinstance(out, PartDir):
        return out.complete(entries, run)
    return conclude(out, scan, plan, mixed, entries, run, plot=plot)


def conclude(out: OutputDir, scan: Scan, plan: Plan, mixed: MixedPlan | None,
             entries: Sequence[dict[str, Any]], run: dict[str, Any], *,
             plot: bool | None) -> dict[str, Any]:
    """Pass 4: the report (report.json, report.png), the run record (``run``: run.json),
    then the manifest; returns the report with the run record under ``run``. The last
    step of a run, and of ``--finalize`` after ``--shard`` jobs."""
    lengths = scan.lengths if mixed is None else mixed.lengths
    stats = PlanStats.of(plan, lengths, out.settings)
    columns = output_schema(out.settings, scan.dtypes).names
    extra: dict[str, Any] = {}
    if mixed is not None:
        extra["mix"] = mixed.report()
    if plan.affinity is not None:
        extra["affinity"] = asdict(plan.affinity)
    report = make_report(out, stats, entries, columns, extra, plot=plot,
                         left_out=scan.left_out)
    return out.finish(report, run, entries, columns, stats.packs,
                      plan.group_offsets if mixed is None else mixed.step_offsets)
