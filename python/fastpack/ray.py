"""Packing on a Ray cluster with Ray Data: the same plan, pack for pack and token for
token, as on one machine.

The passes of ``fastpack pack``, spread out:

1. **lengths** — a ``map_batches`` over the dataset's blocks gives each document's key
   and length; they stream through the driver to the planners.
2. **plan** — made once, by planner actors: one global plan (one planner), or a sharded
   plan (``plan_shards=K`` planners, each holding the documents whose key hashes to it)
   when the lengths outgrow one process. No per-document array stays on the driver.
3. **route and gather** — a ``map_batches`` asks the planners which output shard(s) need
   each document and tags it; ``groupby(shard).map_groups`` brings each shard's documents
   to one worker, which gathers them into packed rows in Rust (and, for the command,
   writes the shard's parquet file atomically).

Ray Data does not keep row order, so the document order is fastpack's own: a key per
document — an integer column (``order=``; :func:`read_files` adds ``doc``, the file and
row, which is the single-machine path's order), or a hash of the document's tokens (then
identical documents are interchangeable, and two different documents with the same hash
are detected and refused).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from ._errors import FastpackError
from ._offline.formats import megatron_dtypes, write_format_shard
from ._offline.gather import shard_batches
from ._offline.layout import output_schema
from ._offline.outdir import OutputDir
from ._offline.plan import (
    ROW_BITS,
    mix64,
    overlong_documents,
    overlong_error,
    plan_shard,
    shard_of,
    sorted_unique,
)
from ._offline.progress import log
from ._offline.report import PlanStats, make_report
from ._offline.scan import (
    TRAINING_COLUMNS,
    column_dtype,
    default_columns,
    load_tokenizer,
    merge_ranges,
    resolve_columns,
    text_left_out,
    uneven_reason,
    value_range,
)
from ._offline.settings import REFUSED, PackSettings, token_columns
from ._offline.sources import (
    InputError,
    Source,
    expand_inputs,
    field_kind,
    iter_batches,
    list_lengths,
)
from ._offline.stats import check_plot
from ._options import PackArgs, PackOptions, resolve
from ._plan import sub_plan

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["DOC", "content_keys", "pack_dataset", "pack_files", "read_files"]

#: The key column :func:`read_files` adds: ``file_index << 40 | row``.
DOC = "doc"
_KEY = "_fastpack_key"
_SHARD = "_fastpack_shard"
_PLAN = "_fastpack_plan"
# Lengths in flight from the driver to the planners before it waits for them.
_IN_FLIGHT = 64


def _unwrapped(error: BaseException) -> BaseException:
    """The FastpackError inside a Ray task's error (Ray wraps what a worker raises)."""
    seen = error
    for _ in range(8):
        if isinstance(seen, FastpackError) and type(seen).__module__.startswith("fastpack"):
            return seen
        inner = getattr(seen, "cause", None) or seen.__cause__
        if inner is None:
            break
        seen = inner
    return error


def _ray() -> Any:
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise FastpackError(
            "fastpack.ray needs Ray Data: pip install 'ray[data]>=2.40' aiohttp "
            "(the ray extra)") from None
    return ray


# ---------------------------------------------------------------------------------------
# document keys


_C1 = np.uint64(0x9E3779B97F4A7C15)
_C2 = np.uint64(0xD6E8FEB86659FD93)


def content_keys(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A 64-bit key (int64) per list of token ids from its length and tokens (position-
    sensitive), the same for int32 and int64 storage. Vectorized: no Python per row."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    lengths = np.asarray(np.diff(np.asarray(column.offsets)), dtype=np.int64)
    values = np.asarray(column.flatten().to_numpy(zero_copy_only=False), dtype=np.int64)
    starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    position = np.arange(len(values), dtype=np.int64) - np.repeat(starts[:-1], lengths)
    mixed = mix64(values.view(np.uint64) * _C1 + position.view(np.uint64) * _C2)
    sums = np.zeros(len(lengths), dtype=np.uint64)
    full = lengths > 0
    if values.size:
        sums[full] = np.add.reduceat(mixed, starts[:-1][full])
    return mix64(sums ^ mix64(lengths.view(np.uint64))).view(np.int64)


def _keys(table: pa.Table, column: str, order: str | None) -> np.ndarray:
    if order is None:
        return content_keys(table.column(column))
    keys = table.column(order)
    if not pa.types.is_integer(keys.type) or keys.null_count:
        raise FastpackError(f"order: column {order!r} must hold integers without nulls, "
                            f"got {keys.type}{' with nulls' if keys.null_count else ''}")
    return np.asarray(keys.to_numpy(), dtype=np.int64)


def _checked_lengths(table: pa.Table, columns: Sequence[str], order: str | None,
                     optional: Sequence[str] = ()) -> tuple[np.ndarray, int]:
    """Lengths of the first column, and a bit per ``optional`` column (bit i: the i-th)
    set when that column has another length on some row (it is not per token, and is
    left out); every column a list of integers, without nulls, and each of ``columns``
    of the same length on every row."""
    lengths = None
    uneven = 0
    for name in [*columns, *optional]:
        if name not in table.column_names:
            raise FastpackError(f"columns: no column {name!r}; the dataset has "
                                f"{', '.join(map(repr, table.column_names))}")
        column = table.column(name)
        t = column.type
        if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or \
                not pa.types.is_integer(t.value_type):
            raise FastpackError(f"column {name!r}: holds {t}; expected lists of integer "
                                "token ids")
        if column.null_count or pa.compute.list_flatten(column).null_count:
            raise FastpackError(f"column {name!r}: holds nulls")
        got = list_lengths(column)
        if lengths is None:
            lengths = got
        elif not np.array_equal(got, lengths):
            if name in optional:
                uneven |= 1 << list(optional).index(name)
                continue
            i = int(np.flatnonzero(got != lengths)[0])
            where = f" (key {int(_keys(table, columns[0], order)[i])})"
            raise FastpackError(f"column {name!r}: {got[i]} values where {columns[0]!r} has "
                                f"{lengths[i]} tokens{where}")
    assert lengths is not None
    return lengths, uneven


# ---------------------------------------------------------------------------------------
# reading files (the command's own reader, so documents keep their file and row)


def _read_file(batch: dict[str, np.ndarray], *, columns: dict[str, str],
               tokenizer: str | None, token_column: str) -> Iterator[pa.Table]:
    encode = load_tokenizer(tokenizer).encode if tokenizer else None
    for index, fields in zip(batch["index"], batch["source"]):
        source = Source(**fields)
        for part in iter_batches(source, columns):
            table = part.table
            if encode is not None:
                (text,) = columns
                ids = pa.array(encode(table.column(text).to_pylist()), type=pa.list_(pa.int32()))
                table = pa.table({token_column: ids})
            doc = (int(index) << ROW_BITS) + part.row + np.arange(table.num_rows, dtype=np.int64)
            yield table.append_column(DOC, pa.array(doc))


def read_files(
    inputs: Sequence[str],
    *,
    column: str = "input_ids",
    columns: Sequence[str] = (),
    text_column: str | None = None,
    tokenizer: str | None = None,
) -> Any:
    """A ``ray.data.Dataset`` of the documents in ``inputs`` (the files and directories
    ``fastpack pack`` reads), with the token columns and ``doc``: the document's place in
    fastpack's order (``file_index << 40 | row``). Each file is read by one task, in
    batches of bounded size. With ``text_column`` and ``tokenizer`` (a directory every
    node can read), the text is tokenized on the workers into ``column``."""
    ray = _ray()
    sources = expand_inputs(inputs)
    if text_column:
        wanted = {text_column: "text"}
    else:
        wanted = {c: "tokens" for c in token_columns(column, columns)}
    items = [{"index": k, "source": asdict(s)} for k, s in enumerate(sources)]
    return ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        _read_file, batch_size=1, batch_format="numpy",
        fn_kwargs={"columns": wanted, "tokenizer": tokenizer, "token_column": column})


# ---------------------------------------------------------------------------------------
# the planners


class _Planner:
    """One plan shard: its documents' keys and lengths, its plan, and for each document
    the output shards that need it. A Ray actor."""

    def __init__(self, shard: int, num_shards: int, settings: dict[str, Any],
                 unique: bool) -> None:
        self.shard, self.num_shards, self.unique = shard, num_shards, unique
        self.settings = PackSettings.from_json(settings)
        self.parts: list[tuple[np.ndarray, np.ndarray]] = []

    def add(self, keys: np.ndarray, lengths: np.ndarray) -> None:
        self.parts.append((keys, lengths))

    def plan(self) -> dict[str, Any]:
        """Plans this shard; returns its stats, packs and output shards, and any bad
        document (a duplicate key, one over the cap with ``overlong="error"``)."""
        settings = self.settings
        keys = np.concatenate([k for k, _ in self.parts]) if self.parts else \
            np.zeros(0, np.int64)
        lengths = np.concatenate([v for _, v in self.parts]) if self.parts else \
            np.zeros(0, np.int32)
        self.parts = []
        order = np.argsort(keys, kind="stable")
        self.keys, lengths = keys[order], lengths[order].astype(np.int32)
        result: dict[str, Any] = {"duplicate": None, "overlong": None}
        if self.unique and len(keys) > 1:
            same = np.flatnonzero(self.keys[1:] == self.keys[:-1])
            if same.size:
                result["duplicate"] = int(self.keys[same[0]])
                return result
        over = overlong_documents(lengths, settings)
        if over.size:
            result["overlong"] = (int(self.keys[over[0]]), int(lengths[over[0]]), int(over.size))
            return result
        plan = plan_shard(lengths, None if self.num_shards == 1 else self.shard,
                          settings.options)
        self.plan_ = plan
        assert settings.shard_rows is not None
        rows = settings.shard_rows
        self.num_out = -(-plan.num_packs // rows)
        # For each document (rank in key order), the output shards holding its segments:
        # one shard for a document in one segment (nearly all), a short sorted list for
        # the rest (split documents) -- no sort over every segment.
        width = max(self.num_out, 1)
        seg_out = np.repeat(np.arange(plan.num_packs, dtype=np.int64) // rows,
                            np.diff(plan.pack_offsets))
        self.out_of = np.full(len(lengths), -1, dtype=np.int64)
        self.out_of[plan.sample_ids] = seg_out
        many = np.bincount(plan.sample_ids, minlength=len(lengths))[plan.sample_ids] > 1
        pairs = sorted_unique(plan.sample_ids[many] * width + seg_out[many])
        self.many_ranks, self.many_outs = np.divmod(pairs, width)
        # Copies of one document (a key shared by identical documents) seen so far, per
        # first rank of their key: the k-th copy to arrive takes the k-th rank.
        self.arrived = np.zeros(len(lengths), dtype=np.int64)
        result.update(stats=PlanStats.of(plan, lengths, settings), packs=plan.num_packs,
                      outputs=self.num_out, group_offsets=plan.group_offsets)
        return result

    def route(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row, output shard) pairs: every output shard of this plan shard that needs the
        document of each key. Identical documents share a key and are interchangeable:
        each copy takes one rank of its key (the k-th to arrive, the k-th rank, counting
        round: a dataset consumed again routes every copy again), so it goes where that
        rank's segments are and nowhere else."""
        lo = np.searchsorted(self.keys, keys, side="left")
        if not len(self.keys):
            hi = lo
        elif self.unique:  # one document per key: its run is one long, if it is there
            hi = lo + (self.keys[np.minimum(lo, len(self.keys) - 1)] == keys)
        else:
            hi = np.searchsorted(self.keys, keys, side="right")
        if (hi == lo).any():
            missing = int(keys[np.flatnonzero(hi == lo)[0]])
            raise FastpackError(f"the document with key {missing} was not seen by the lengths "
                                "pass: the dataset changed between passes")
        count = hi - lo
        rows = np.arange(len(keys), dtype=np.int64)
        ranks = lo.astype(np.int64, copy=True)
        many = np.flatnonzero(count > 1)
        if many.size:
            first = lo[many]
            by_key = np.argsort(first, kind="stable")
            ordered = first[by_key]
            run_start = np.flatnonzero(np.concatenate([[True], ordered[1:] != ordered[:-1]]))
            runs = np.diff(np.concatenate([run_start, [len(ordered)]]))
            within = np.arange(len(ordered)) - np.repeat(run_start, runs)
            taken = np.empty(len(ordered), dtype=np.int64)
            taken[by_key] = (self.arrived[ordered] + within) % count[many][by_key]
            ranks[many] = first + taken
            np.add.at(self.arrived, ordered[run_start], runs)
        width = max(self.num_out, 1)
        first = np.searchsorted(self.many_ranks, ranks, side="left")
        count = np.searchsorted(self.many_ranks, ranks, side="right") - first
        single = (count == 0) & (self.out_of[ranks] >= 0)
        rows2, at = _expand(first, count)
        pairs = np.concatenate([rows[single] * width + self.out_of[ranks[single]],
                                rows[rows2] * width + self.many_outs[at]])
        return np.divmod(sorted_unique(pairs), width)

    def subplan(self, out: int) -> dict[str, Any]:
        """The packs of one output shard as a plan of their own, documents named by key."""
        plan = self.plan_
        assert self.settings.shard_rows is not None
        p0 = out * self.settings.shard_rows
        p1 = min(p0 + self.settings.shard_rows, plan.num_packs)
        s0, s1 = int(plan.pack_offsets[p0]), int(plan.pack_offsets[p1])
        return {"plan": sub_plan(plan, p0, p1, sample_ids=self.keys[plan.sample_ids[s0:s1]]),
                "first_pack": p0}


def _expand(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ranges ``starts[i] .. starts[i] + counts[i]``: (i, value) for every value."""
    owner = np.repeat(np.arange(len(starts), dtype=np.int64), counts)
    base = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    return owner, base + np.arange(int(counts.sum()), dtype=np.int64)


# ---------------------------------------------------------------------------------------
# the Ray Data stages (plain functions: tasks, not actors)


_INT64 = np.iinfo(np.int64)


def _lengths_stage(table: pa.Table, *, columns: list[str], optional: list[str],
                   order: str | None, num_shards: int, ranges: bool = False) -> pa.Table:
    lengths, uneven = _checked_lengths(table, columns, order, optional)
    keys = _keys(table, columns[0], order)
    # Bit i: column i (of columns, then optional) needs int64 in the output (as
    # column_dtype decides on one machine).
    wide = sum(1 << i for i, c in enumerate([*columns, *optional])
               if column_dtype(table.column(c)) == "int64")
    out = pa.table({_KEY: keys, "length": lengths.astype(np.int32),
                    _PLAN: shard_of(keys, num_shards).astype(np.int32),
                    "wide": np.full(len(keys), wide, dtype=np.int64),
                    "uneven": np.full(len(keys), uneven, dtype=np.int64)})
    if ranges:  # the megatron format's dtypes: each column's block range, lo{i} and hi{i}
        for i, c in enumerate([*columns, *optional]):
            lo, hi = value_range(table.column(c)) or (_INT64.max, _INT64.min)
            out = out.append_column(f"lo{i}", pa.array(np.full(len(keys), max(lo, _INT64.min),
                                                                dtype=np.int64)))
            out = out.append_column(f"hi{i}", pa.array(np.full(len(keys), min(hi, _INT64.max),
                                                                dtype=np.int64)))
    return out


def _route_stage(table: pa.Table, *, columns: list[str], order: str | None, planners: list[Any],
                 shard_base: np.ndarray, skip: frozenset[int],
                 dtypes: dict[str, str] | None = None) -> pa.Table:
    ray = _ray()
    keys = _keys(table, columns[0], order)
    plan_of = shard_of(keys, len(planners))
    parts = []
    calls = {s: planners[s].route.remote(keys[plan_of == s]) for s in np.unique(plan_of)}
    for s, call in calls.items():
        members = np.flatnonzero(plan_of == s)
        rows, outs = ray.get(call)
        outs = outs + shard_base[s]
        keep = ~np.isin(outs, list(skip)) if skip else slice(None)
        parts.append((members[rows[keep]], outs[keep]))
    rows = np.concatenate([r for r, _ in parts]) if parts else np.zeros(0, np.int64)
    outs = np.concatenate([o for _, o in parts]) if parts else np.zeros(0, np.int64)
    routed = table.select(columns).take(pa.array(rows))
    if dtypes is not None:
        # One type per column in every block: the shuffle concatenates blocks of several
        # files, and parquet's list<element: int32> and JSON's list<item: int64> do not
        # concatenate (the gather casts to the output's types anyway).
        routed = routed.cast(pa.schema([
            pa.field(c, pa.large_list(pa.from_numpy_dtype(np.dtype(dtypes[c]))))
            for c in columns]))
    return routed.append_column(_KEY, pa.array(keys[rows])).append_column(
        _SHARD, pa.array(outs.astype(np.int64)))


def _gather_stage(table: pa.Table, *, columns: list[str], planners: list[Any],
                  shard_base: np.ndarray, pack_base: np.ndarray, settings: dict[str, Any],
                  dtypes: dict[str, str], outdir: str | None, num_out: int,
                  stored: dict[str, str] | None = None) -> pa.Table:
    ray = _ray()
    settings_ = PackSettings.from_json(settings)
    out = int(table.column(_SHARD)[0].as_py())
    plan_shard_ = int(np.searchsorted(shard_base, out, side="right")) - 1
    sub = ray.get(planners[plan_shard_].subplan.remote(out - int(shard_base[plan_shard_])))
    window = sub["plan"]
    wanted = window.sample_ids  # keys
    keys = np.asarray(table.column(_KEY).to_numpy(), dtype=np.int64)
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    at = np.searchsorted(sorted_keys, wanted)
    if at.size and (at.max() >= len(keys) or (sorted_keys[at] != wanted).any()):
        raise FastpackError(f"output shard {out}: a document did not arrive")
    _check_collisions(sorted_keys, order, table.column(columns[0]))
    window = sub_plan(window, 0, window.num_packs, sample_ids=order[at])  # keys -> rows
    schema = output_schema(settings_, dtypes)
    batches = shard_batches(table.select(columns), window, settings_, schema)
    if outdir is None:
        first = int(pack_base[plan_shard_]) + int(sub["first_pack"])
        packed = pa.Table.from_batches(list(batches), schema=schema)
        return packed.append_column("pack_index", pa.array(
            np.arange(first, first + packed.num_rows, dtype=np.int64)))
    entry = write_format_shard(settings_.format, Path(outdir), out, num_out, schema,
                               settings_.token_columns, window.num_packs, batches, stored)
    return pa.table({"shard": [out], "entry": [json.dumps(entry)]})


def _check_collisions(sorted_keys: np.ndarray, order: np.ndarray,
                      tokens: pa.ChunkedArray) -> None:
    """Rows sharing a key must be the same document (content keys of identical documents);
    two different documents with one key would be a silent mix-up, so they are refused."""
    same = np.flatnonzero(sorted_keys[1:] == sorted_keys[:-1])
    for i in same:
        a, b = int(order[i]), int(order[i + 1])
        if tokens[a] != tokens[b]:
            raise FastpackError(
                f"two different documents share the content key {int(sorted_keys[i])}; pass "
                "order= a column of unique document ids")


# ---------------------------------------------------------------------------------------
# the pipeline


def _reraising(batches: Any) -> Iterator[Any]:
    """Batches of a Ray dataset, a worker's FastpackError raised as itself."""
    try:
        yield from batches
    except Exception as e:
        inner = _unwrapped(e)
        if inner is e:
            raise
        raise inner from None


class _Pipeline:
    """``columns``: the columns packed for sure (the token column first); ``candidates``:
    packed too where the lengths pass finds one value per token, else added to
    ``left_out`` (with ``settings.columns=None``, every per-token column is packed)."""

    def __init__(self, ds: Any, settings: PackSettings, order: str | None, quiet: bool,
                 locate: Any = None, columns: Sequence[str] | None = None,
                 candidates: Sequence[str] = (),
                 left_out: dict[str, str] | None = None) -> None:
        self.ray = _ray()
        self.ds, self.settings, self.order, self.quiet = ds, settings, order, quiet
        self.columns = list(columns or settings.token_columns)
        self.candidates = list(candidates)
        self.left_out = dict(left_out or {})
        self.locate = locate
        self.timings: dict[str, float] = {}

    def check_columns(self) -> None:
        """Names a missing column before any work (the schema costs a block or two)."""
        schema = self.ds.schema()
        if schema is None:
            return
        for name in [*self.columns, *([self.order] if self.order else [])]:
            if name not in schema.names:
                raise FastpackError(f"columns: no column {name!r}; the dataset has "
                                    f"{', '.join(map(repr, schema.names))}")

    def plan(self) -> None:
        ray, settings = self.ray, self.settings
        clock = time.monotonic()
        k = settings.plan_shards
        actor = ray.remote(num_cpus=0)(_Planner)
        self.planners = [actor.remote(s, k, settings.to_json(), self.order is not None)
                         for s in range(k)]
        lengths = self.ds.map_batches(
            _lengths_stage, batch_format="pyarrow",
            fn_kwargs={"columns": self.columns, "optional": self.candidates,
                       "order": self.order, "num_shards": k,
                       "ranges": settings.format == "megatron"})
        pending: list[Any] = []
        wide = uneven = 0
        bounds: list[tuple[int, int] | None] = [None] * (len(self.columns)
                                                         + len(self.candidates))
        documents = 0
        for batch in _reraising(lengths.iter_batches(batch_format="numpy",
                                                     batch_size=1 << 20)):
            keys, lens, shard = batch[_KEY], batch["length"], batch[_PLAN]
            wide |= int(np.bitwise_or.reduce(batch["wide"])) if len(keys) else 0
            uneven |= int(np.bitwise_or.reduce(batch["uneven"])) if len(keys) else 0
            if settings.format == "megatron" and len(keys):
                for i in range(len(bounds)):
                    lo, hi = int(batch[f"lo{i}"].min()), int(batch[f"hi{i}"].max())
                    bounds[i] = merge_ranges(bounds[i], (lo, hi) if lo <= hi else None)
            documents += len(keys)
            for s in np.unique(shard):
                mine = shard == s
                pending.append(self.planners[s].add.remote(keys[mine], lens[mine]))
            if len(pending) > _IN_FLIGHT:
                ray.get(pending)
                pending = []
        ray.get(pending)
        self.timings["lengths"] = time.monotonic() - clock
        clock = time.monotonic()
        results = ray.get([p.plan.remote() for p in self.planners])
        for r in results:
            if r["duplicate"] is not None:
                raise InputError(f"key {r['duplicate']} appears twice; the order column needs "
                                 "one key per document", column=self.order)
            if r["overlong"] is not None:
                key, length, count = r["overlong"]
                where = self.locate(key) if self.locate else {"path": f"key {key}"}
                raise overlong_error(length, count - 1, settings, " in its plan shard", **where)
        everything = [*self.columns, *self.candidates]
        for i, c in enumerate(self.candidates):
            if uneven >> i & 1:
                if c in TRAINING_COLUMNS:  # a model trains on it: a data bug, not a skip
                    raise InputError(
                        f"some rows have another length than {self.columns[0]!r}; a "
                        f"{c!r} column needs one value per token (pass --columns to choose "
                        f"the packed columns)", column=c)
                self.left_out[c] = uneven_reason(self.columns[0])
            else:
                self.columns.append(c)
        self.dtypes = {c: "int64" if wide >> everything.index(c) & 1 else "int32"
                       for c in self.columns}
        # As the single-machine path: the whole input's ranges decide, before any shard.
        self.stored = None if settings.format != "megatron" else megatron_dtypes(
            settings.token_dtype, {c: bounds[everything.index(c)] for c in self.columns},
            load_tokenizer(settings.tokenizer).vocab_size if settings.tokenizer else None)
        self.settings = replace(settings, columns=tuple(self.columns[1:]))
        self.stats = PlanStats.merge([r["stats"] for r in results])
        outputs = [r["outputs"] for r in results]
        self.shard_base = np.concatenate([[0], np.cumsum(outputs)]).astype(np.int64)
        self.pack_base = np.concatenate([[0], np.cumsum([r["packs"] for r in results])])
        self.num_out = int(self.shard_base[-1])
        groups = [r["group_offsets"] for r in results]
        self.group_offsets = None if groups[0] is None else np.concatenate(
            [[0]] + [g[1:] + b for g, b in zip(groups, self.pack_base)]).astype(np.int64)
        self.timings["plan"] = time.monotonic() - clock
        log(f"plan: {self.stats.packs:,} packs of {settings.max_len:,} tokens for "
            f"{documents:,} documents in {k} plan shard{'s' if k > 1 else ''} "
            f"({self.timings['lengths']:.1f} s lengths, {self.timings['plan']:.1f} s plan)",
            quiet=self.quiet)

    def routed(self, skip: frozenset[int] = frozenset()) -> Any:
        """The documents tagged with the output shard that needs them: a row per (copy of
        a) document and shard it goes to."""
        return self.ds.map_batches(
            _route_stage, batch_format="pyarrow",
            fn_kwargs={"columns": self.columns, "order": self.order, "planners": self.planners,
                       "shard_base": self.shard_base, "skip": skip, "dtypes": self.dtypes})

    def gather(self, outdir: str | None, skip: frozenset[int] = frozenset()) -> Any:
        routed = self.routed(skip)
        todo = self.num_out - len(skip)
        cpus = int(self.ray.cluster_resources().get("CPU", 1))
        return routed.groupby(_SHARD, num_partitions=max(1, min(todo, 2 * cpus))).map_groups(
            _gather_stage, batch_format="pyarrow",
            fn_kwargs={"columns": self.columns, "planners": self.planners,
                       "shard_base": self.shard_base, "pack_base": self.pack_base,
                       "settings": self.settings.to_json(), "dtypes": self.dtypes,
                       "stored": self.stored,
                       "outdir": outdir, "num_out": self.num_out})


def _read_of_files(ds: Any) -> list[str] | None:
    """The paths of a dataset that is a plain ``ray.data.read_parquet(paths)`` (nothing
    after it: no projection, filter or limit), else None. Ray Data keeps no row order and
    gives no row index, so such a dataset is read again by :func:`read_files`, which
    keys each document by its file and row: the order of ``fastpack pack PATHS``. (Ray
    has no public way to ask a dataset what it reads; this looks at its logical plan.)"""
    try:
        dag = ds._logical_plan.dag
        if type(dag).__name__ != "ReadFiles" or "parquet" not in dag.name.lower():
            return None
        (listing,) = dag.input_dependencies
        if type(listing).__name__ != "ListFiles" or listing.input_dependencies:
            return None
        if dag.get_projection_map() or dag.get_current_predicate() is not None or any(
                getattr(listing, a, None) is not None
                for a in ("projected_columns", "predicate", "limit", "partition_filter")):
            return None
        return [str(p) for p in listing.paths]
    except Exception:  # another Ray's plan: order by content instead
        return None


def _schema_columns(ds: Any, column: str, order: str | None,
                    columns: Sequence[str] | None) -> tuple[list[str], list[str], dict[str, str]]:
    """(named, candidates, left_out) of a dataset, as :func:`resolve_columns` for files:
    with ``columns=None`` every other column of lists of integers is a candidate."""
    if columns is not None:
        return token_columns(column, columns), [], {}
    schema = ds.schema()
    kinds = {name: field_kind(t) if isinstance(t, pa.DataType) else f"holds {t}"
             for name, t in (zip(schema.names, schema.types) if schema is not None else ())}
    return [column], *default_columns(column, [("the dataset", kinds)],
                                      skip=[order] if order else [])


def pack_dataset(
    ds: Any,
    max_len: int | None = None,
    *,
    options: PackOptions | None = None,
    column: str = "input_ids",
    columns: Sequence[str] | None = None,
    order: str | None = None,
    shard_rows: int | None = None,
    plan_shards: int = 1,
    **kwargs: Unpack[PackArgs],
) -> Any:
    """Packs a ``ray.data.Dataset`` of token lists into a ``ray.data.Dataset`` of packed
    rows: ``column`` and the other per-token columns packed, ``seq_lengths``,
    ``position_ids`` (the columns of ``fastpack.hf.pack_dataset(..., position_ids=True)``)
    and ``pack_index``, the row's place in the plan (Ray Data does not keep order: sort by
    it, or drop it).

    ``columns``: the other per-token columns to pack (default: every column holding a
    list of integers with one value per token, as ``fastpack pack``). ``order``: an
    integer column of unique document keys that fixes fastpack's document order
    (:func:`read_files` adds ``doc``). Without it, a dataset that is a plain
    ``ray.data.read_parquet(paths)`` is read in the order of its files and rows -- the
    packs of ``fastpack pack PATHS`` -- and any other is ordered by a hash of each
    document's tokens (identical documents share it; each copy is packed once).

    The plan is made before this returns (the lengths pass runs now); the gather runs
    when the result is consumed. ``plan_shards=K`` plans in ``K`` independent shards (for
    more lengths than one process holds; about half a pack more per shard).
    ``shard_rows`` packs are gathered per task. ``options`` and the keywords are the
    packing options of :func:`fastpack.pack` (:class:`fastpack.PackOptions`, with its
    defaults: shuffled packs, seed 0), checked before any data is read; ``reserve`` is
    refused (no separator is written).
    """
    made = resolve(pack_dataset, options, max_len, kwargs, refuse=REFUSED)
    settings = PackSettings(options=made, column=column, columns=columns,
                            shard_rows=shard_rows, plan_shards=plan_shards)
    files = _read_of_files(ds) if order is None else None
    if files is not None:
        named, candidates, left_out = resolve_columns(expand_inputs(files), column, columns)
        ds = read_files(files, column=column, columns=[*named[1:], *candidates])
        order = DOC
    else:
        named, candidates, left_out = _schema_columns(ds, column, order, columns)
    pipeline = _Pipeline(ds, settings, order, True, None, named, candidates, left_out)
    if files is None:
        pipeline.check_columns()
    pipeline.plan()
    result = pipeline.gather(None)
    result._fastpack_plan = pipeline  # the planners live as long as the dataset
    return result


def pack_files(
    inputs: Sequence[str],
    outdir: str,
    settings: PackSettings,
    *,
    address: str | None = "auto",
    resume: bool = False,
    overwrite: bool = False,
    quiet: bool = False,
    plot: bool | None = None,
) -> dict[str, Any]:
    """``fastpack pack --ray``: files to parquet shards, byte for byte those of the
    single-machine path, with the same manifest, report and resume."""
    if settings.mix is not None:
        raise FastpackError("mix: a mixture is planned on one machine (fastpack pack --mix, "
                            "or --shard jobs); not on Ray")
    if settings.affinity_column is not None:
        raise FastpackError("affinity_column: related documents are planned on one machine "
                            "(fastpack pack --affinity-column, or --shard jobs); not on Ray "
                            "yet")
    ray = _ray()
    check_plot(plot)
    if not ray.is_initialized():
        try:
            ray.init(address=None if address in (None, "local") else address,
                     log_to_driver=not quiet)
        except ConnectionError:
            if address != "auto":
                raise
            ray.init(log_to_driver=not quiet)  # no cluster running: a local one
    sources = expand_inputs(inputs)
    out = OutputDir(Path(outdir), settings, sources, quiet)
    out.prepare(resume=resume, overwrite=overwrite)
    candidates: list[str]
    left_out: dict[str, str]
    if settings.text_column:
        named, candidates = [settings.column], []
        left_out = text_left_out(sources, settings.text_column)
    else:
        named, candidates, left_out = resolve_columns(sources, settings.column,
                                                      settings.columns)
    ds = read_files(inputs, column=settings.column, columns=[*named[1:], *candidates],
                    text_column=settings.text_column, tokenizer=settings.tokenizer)
    if settings.text_column:
        ds = ds.materialize()  # tokenize once, not in both passes

    def locate(key: int) -> dict[str, Any]:
        return {"path": sources[key >> ROW_BITS].path, "row": key & ((1 << ROW_BITS) - 1)}

    pipeline = _Pipeline(ds, settings, DOC, quiet, locate, named, candidates, left_out)
    with out.abandoned_on_error():
        pipeline.plan()
    out.packing(pipeline.columns)
    done = out.verified_done(pipeline.num_out)
    clock = time.monotonic()
    entries = dict(done)
    if len(done) < pipeline.num_out:
        for row in _reraising(pipeline.gather(str(out.path), frozenset(done)).iter_rows()):
            entry = json.loads(row["entry"])
            out.record(int(row["shard"]), entry)
            entries[int(row["shard"])] = entry
    pipeline.timings["gather"] = time.monotonic() - clock
    run = {"ray": {"cpus": int(ray.cluster_resources().get("CPU", 0)),
                   "nodes": len(ray.nodes()), "plan_shards": settings.plan_shards},
           "seconds": {k: round(v, 3) for k, v in pipeline.timings.items()}}
    shards = [entries[i] for i in range(pipeline.num_out)]
    columns = output_schema(out.settings, pipeline.dtypes).names
    report = make_report(out, pipeline.stats, shards, columns, {}, plot=plot,
                         left_out=pipeline.left_out)
    return out.finish(report, run, shards, columns, pipeline.stats.packs,
                      pipeline.group_offsets)
