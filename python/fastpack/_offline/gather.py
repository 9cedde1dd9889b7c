"""Pass 3, the gather: the output's row groups are grouped into passes whose documents'
tokens fit the memory budget. With one pass the inputs are read once more, into memory;
with several, that one read spills each pass's documents to its own file, which the pass
then loads (``spill=False``: every pass reads the inputs again, skipping the files and
parquet row groups it does not need). Rows are gathered in Rust (``fastpack.gather``) and
written shard by shard, each shard atomically and into the journal. The budget bounds one
pass's tokens (the whole run's memory: the package's docstring)."""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from .._errors import FastpackError
from .._gather import gather
from .._plan import Plan, sub_plan
from .formats import write_format_shard
from .layout import output_schema, row_group_packs, shard_bounds
from .outdir import OutputDir
from .plan import sorted_unique
from .progress import Progress, human_bytes, log
from .scan import Scan
from .settings import PackSettings
from .sources import InputError, Source, iter_batches

__all__ = ["Columns", "gather_passes", "gather_rows", "shard_batches"]

# Bytes per document a pass keeps besides its tokens (its id and offset).
_PER_DOC = 16
# Bytes per document the run holds besides the budget (lengths, plan, pass mask).
_FIXED_PER_DOC = 33


#: A row group still to write: (output shard, first pack, end pack).
RowGroup = tuple[int, int, int]


def gather_passes(out: OutputDir, sources: Sequence[Source], scan: Scan, plan: Plan,
                  pack_counts: Sequence[int], memory: int | None,
                  spill: bool = True) -> tuple[list[dict[str, Any]], int, int]:
    """Writes every output shard the journal does not hold complete, in as many passes as
    the ``memory`` budget needs (None: half the available memory); returns every shard's
    journal entry, the number of passes and the budget."""
    settings = out.settings
    assert settings.shard_rows is not None
    bounds = shard_bounds(pack_counts, settings.shard_rows)
    n = len(bounds) - 1
    done = out.verified_done(n)
    todo = [i for i in out.wanted(n) if i not in done]
    itemsize = sum(np.dtype(scan.dtypes[c]).itemsize for c in settings.token_columns)
    budget = memory if memory is not None else memory_budget(len(scan.lengths))
    row_groups = _row_groups(bounds, todo, row_group_packs(settings))
    passes = _passes(plan, scan.lengths, row_groups, itemsize, budget)
    spill_dir = out.state_dir / "spill"
    if spill_dir.exists():
        shutil.rmtree(spill_dir)  # an interrupted run's: which passes were whole is unknown
    spilled = spill and len(passes) > 1
    if spilled:
        _distribute(out, sources, scan, plan, [_segments(plan, p) for p in passes],
                    spill_dir)
    schema = output_schema(settings, scan.dtypes)
    stored = scan.stored(settings)
    stream = _batches(out, sources, scan, plan, passes, spill_dir if spilled else None,
                      schema)
    entries = dict(done)
    for i in todo:
        count = sum(1 for group in row_groups if group[0] == i)
        entry = write_format_shard(settings.format, out.path, i, n, schema,
                                   settings.token_columns, int(bounds[i + 1] - bounds[i]),
                                   itertools.islice(stream, count), stored)
        out.record(i, entry)
        entries[i] = entry
        log(f"wrote {entry['file']} ({entry['rows']:,} packs, {human_bytes(entry['bytes'])})",
            quiet=out.quiet or len(todo) > 50)
    return [entries[i] for i in out.wanted(n)], len(passes), budget


def memory_budget(documents: int) -> int:
    """The default budget of a pass's tokens: half the available memory, less what the
    run holds per document (at least 64 MiB)."""
    return max(64 << 20, _available_memory() // 2 - _FIXED_PER_DOC * documents)


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


# ---------------------------------------------------------------------------------------
# the pass planner


def _row_groups(bounds: np.ndarray, shards: Sequence[int], packs: int) -> list[RowGroup]:
    """The row groups of ``shards``, in order: ``packs`` packs each (a shard's last may
    hold fewer)."""
    return [(i, p, min(p + packs, int(bounds[i + 1])))
            for i in shards for p in range(int(bounds[i]), int(bounds[i + 1]), packs)]


def _passes(plan: Plan, lengths: np.ndarray, row_groups: Sequence[RowGroup],
            bytes_per_token: int, budget: int) -> list[list[RowGroup]]:
    """Consecutive row groups grouped into passes whose documents fit ``budget`` bytes
    (at least one row group per pass, however large; a pass's packs are consecutive, so
    complete shards skipped on resume end a pass). A shard may span passes: its parquet
    writer stays open from its first row group to its last."""
    passes: list[list[RowGroup]] = []
    current: list[RowGroup] = []
    used = 0
    for group in row_groups:
        _, p, q = group
        docs = sorted_unique(plan.sample_ids[plan.pack_offsets[p]:plan.pack_offsets[q]])
        cost = int(lengths[docs].sum(dtype=np.int64)) * bytes_per_token + _PER_DOC * len(docs)
        if current and (used + cost > budget or p != current[-1][2]):
            passes.append(current)
            current, used = [], 0
        current.append(group)
        used += cost
    if current:
        passes.append(current)
    return passes


def _segments(plan: Plan, row_groups: Sequence[RowGroup]) -> tuple[int, int]:
    """The plan's segments a pass writes (its packs are consecutive)."""
    return (int(plan.pack_offsets[row_groups[0][1]]),
            int(plan.pack_offsets[row_groups[-1][2]]))


# ---------------------------------------------------------------------------------------
# a pass's documents: read from the inputs, or from the spill


def _batches(out: OutputDir, sources: Sequence[Source], scan: Scan, plan: Plan,
             passes: Sequence[Sequence[RowGroup]], spill: Path | None,
             schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    """Every remaining row group in order, loading each pass's documents in turn (from
    the ``spill`` directory when given, else from the inputs)."""
    names = out.settings.token_columns
    for g, groups in enumerate(passes):
        lo, hi = _segments(plan, groups)
        needed = np.zeros(len(scan.lengths), dtype=bool)
        needed[plan.sample_ids[lo:hi]] = True
        kept = np.flatnonzero(needed)
        offsets = np.zeros(len(kept) + 1, dtype=np.int64)
        np.cumsum(scan.lengths[kept], out=offsets[1:])
        if spill is not None:
            columns = _load_spilled(spill, g, names, scan.dtypes, offsets)
        else:
            columns = Columns({c: np.empty(int(offsets[-1]), dtype=scan.dtypes[c])
                               for c in names}, offsets)
            label = "gather" if len(passes) == 1 else f"gather, pass {g + 1}/{len(passes)}"
            _read_pass(out, sources, scan, needed, columns, label)
        del needed
        data = columns.arrow()
        first, last = groups[0][1], groups[-1][2]
        window = sub_plan(plan, first, last,
                          sample_ids=np.searchsorted(kept, plan.sample_ids[lo:hi]))
        for _, p, q in groups:
            yield gather_rows(data, window, range(p - first, q - first), names, schema)
        del columns, data, window


def _needed_rows(out: OutputDir, sources: Sequence[Source], scan: Scan, needed: np.ndarray,
                 label: str) -> Iterator[tuple[dict[str, pa.Array], np.ndarray]]:
    """Reads every input holding a needed document (skipping other files and parquet row
    groups) and yields, batch by batch, the needed rows' token columns and their global
    document ids, checked against the lengths pass."""
    names = out.settings.token_columns
    wanted = {c: "tokens" for c in names}
    starts = scan.row_starts
    need_bytes = sum(s.size for k, s in enumerate(sources)
                     if needed[starts[k]:starts[k + 1]].any())
    with Progress(label, need_bytes, unit="B", quiet=out.quiet) as bar:
        for k, source in enumerate(sources):
            need = needed[starts[k]:starts[k + 1]]
            if not need.any():
                continue
            rows = consumed = 0
            for batch in iter_batches(source, wanted, need=need):
                n = batch.table.num_rows
                sel = np.flatnonzero(need[batch.row:batch.row + n])
                rows = batch.row + n
                bar.update(batch.done_bytes - consumed)
                consumed = batch.done_bytes
                if sel.size == 0:
                    continue
                docs = starts[k] + batch.row + sel
                expect = scan.lengths[docs]
                picked = {}
                for c in names:
                    column = batch.table.column(c).combine_chunks()
                    if sel.size != n:
                        column = column.take(pa.array(sel))
                    got = np.diff(np.asarray(column.offsets))
                    if not np.array_equal(got, expect):
                        i = int(np.flatnonzero(got != expect)[0])
                        raise InputError(
                            f"changed since the lengths pass (now {got[i]:,} tokens, then "
                            f"{expect[i]:,}); rerun with --overwrite", path=source.path,
                            row=int(batch.row + sel[i]), column=c)
                    picked[c] = column
                yield picked, docs
            bar.update(source.size - consumed)
            if rows < need.size and need[rows:].any():
                raise InputError(f"changed since the lengths pass: it had {need.size:,} rows, "
                                 f"now {rows:,}; rerun with --overwrite", path=source.path)


def _read_pass(out: OutputDir, sources: Sequence[Source], scan: Scan, needed: np.ndarray,
               columns: Columns, label: str) -> None:
    """Copies the pass's documents' tokens from the inputs into ``columns`` (preallocated:
    the pass's documents are known from the plan)."""
    cursor = 0
    for picked, _docs in _needed_rows(out, sources, scan, needed, label):
        size = 0
        for c, column in picked.items():
            values = column.flatten()
            size = len(values)
            columns.values[c][cursor:cursor + size] = values
        cursor += size
    assert cursor == len(next(iter(columns.values.values())))


def _spill_path(spill: Path, g: int, column: str) -> Path:
    return spill / f"{g:05d}.{column}.bin"


def _distribute(out: OutputDir, sources: Sequence[Source], scan: Scan, plan: Plan,
                seg_ranges: Sequence[tuple[int, int]], spill: Path) -> None:
    """One read of the inputs for every pass: each needed document's tokens are appended
    to the spill file of every pass that needs it, in document order, so pass ``g`` later
    loads its documents as one contiguous array (the layout a direct read would build)."""
    names = out.settings.token_columns
    num = len(seg_ranges)
    pairs = sorted_unique(np.concatenate([plan.sample_ids[lo:hi] * num + g
                                      for g, (lo, hi) in enumerate(seg_ranges)]))
    pair_docs, pair_pass = np.divmod(pairs, num)
    del pairs
    needed = np.zeros(len(scan.lengths), dtype=bool)
    needed[pair_docs] = True
    spill.mkdir(parents=True, exist_ok=True)
    files: dict[tuple[int, str], Any] = {}
    try:
        for picked, docs in _needed_rows(out, sources, scan, needed, "spill"):
            lo, hi = np.searchsorted(pair_docs, [docs[0], docs[-1] + 1])
            passes = pair_pass[lo:hi]
            by_pass = np.argsort(passes, kind="stable")  # documents stay in order per pass
            rows = np.searchsorted(docs, pair_docs[lo:hi])[by_pass]
            passes = passes[by_pass]
            cuts = np.flatnonzero(np.diff(passes)) + 1
            bounds = np.concatenate([[0], cuts, [len(passes)]])
            for c in names:
                column = picked[c].take(pa.array(rows))
                values = column.flatten().to_numpy().astype(scan.dtypes[c], copy=False)
                token_at = np.asarray(column.offsets)[bounds]
                for k in range(len(bounds) - 1):
                    key = (int(passes[bounds[k]]), c)
                    if key not in files:
                        if len(files) >= 256:  # few descriptors open at once
                            files.pop(next(iter(files))).close()
                        files[key] = open(_spill_path(spill, *key), "ab")
                    files[key].write(values[token_at[k]:token_at[k + 1]])
    finally:
        for f in files.values():
            f.close()


def _load_spilled(spill: Path, g: int, names: Sequence[str], dtypes: dict[str, str],
                  offsets: np.ndarray) -> Columns:
    """Pass ``g``'s documents from its spill files (removed once loaded)."""
    values = {}
    for c in names:
        path = _spill_path(spill, g, c)
        values[c] = np.fromfile(path, dtype=dtypes[c]) if path.exists() \
            else np.zeros(0, dtype=dtypes[c])
        if len(values[c]) != offsets[-1]:
            raise FastpackError(f"{path}: {len(values[c]):,} tokens spilled, "
                                f"{offsets[-1]:,} expected; rerun with --overwrite")
        path.unlink()
    return Columns(values, offsets)


# ---------------------------------------------------------------------------------------
# rows: packs gathered in Rust from documents in memory


class Columns:
    """Token data of some documents in the Arrow list layout: every column shares
    ``offsets`` (int64 [D+1]); document ``i`` of column ``c`` is
    ``values[c][offsets[i]:offsets[i+1]]``."""

    __slots__ = ("offsets", "values")

    def __init__(self, values: dict[str, np.ndarray], offsets: np.ndarray) -> None:
        self.values, self.offsets = values, offsets

    def arrow(self) -> dict[str, pa.Array]:
        """The columns as Arrow large lists over the same buffers (no copy)."""
        offsets = pa.array(self.offsets)
        return {c: pa.LargeListArray.from_arrays(offsets, pa.array(v))
                for c, v in self.values.items()}



def gather_rows(data: Any, plan: Plan, packs: range, columns: Sequence[str],
                schema: pa.Schema) -> pa.RecordBatch:
    """Packs ``packs`` of ``plan`` as rows, gathered in Rust by ``fastpack.gather`` from
    ``data`` (Arrow list columns the plan's sample ids index) and given the output
    schema's types."""
    batches = list(gather(plan, data, packs=packs, columns=list(columns),
                          batch_tokens=1 << 30))
    if not batches:
        return pa.RecordBatch.from_pylist([], schema=schema)
    (batch,) = batches
    return pa.RecordBatch.from_arrays(
        [batch.column(i).cast(field.type) for i, field in enumerate(schema)], schema=schema)


def shard_batches(data: Any, plan: Plan, settings: PackSettings,
                  schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    """Every pack of ``plan`` (one shard's window, its sample ids ``data``'s rows),
    ``row_group_packs`` packs per record batch (one parquet row group)."""
    group = row_group_packs(settings)
    for p in range(0, plan.num_packs, group):
        yield gather_rows(data, plan, range(p, min(p + group, plan.num_packs)),
                          settings.token_columns, schema)
