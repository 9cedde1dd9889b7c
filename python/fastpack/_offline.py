"""``fastpack pack``: a corpus on disk -> parquet shards of packed rows, in bounded memory.

The passes:

1. **lengths** — every input file is read once, as a stream of batches; only each
   document's length is kept (4 bytes per document). With ``--text-column`` this pass
   tokenizes and spills the token ids to a temporary parquet file per input, so text is
   tokenized once.
2. **plan** — one global plan (``fastpack.pack``) over all lengths, or a sharded plan.
3. **gather** — the output's row groups are grouped into passes whose documents' tokens
   fit the memory budget. With one pass the inputs are read once more, into memory; with
   several, that one read spills each pass's documents to its own file, which the pass
   then loads (``spill=False``: every pass reads the inputs again, skipping the files and
   parquet row groups it does not need). Rows are gathered in Rust (``fastpack.gather``).

Memory: about ``33 bytes × documents`` (lengths, plan, pass mask) + ``--memory`` (one
pass's tokens) + one input batch (``BATCH_BYTES`` of decoded rows, or one parquet row
group) + one output row group (``ROW_GROUP_TOKENS`` tokens). See docs/cli.md.

Nothing half-written: a shard is written to a hidden temporary name, flushed to disk and
renamed; every completed shard is appended to a journal; ``manifest.json`` (every shard
with its rows and sha256) is written last and is the mark of a complete output.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ._errors import FastpackError
from ._gather import gather
from ._plan import Plan
from ._progress import Progress, human_bytes, log
from ._sharded import PlanConfig, file_keys, sharded_plan, sorted_unique
from ._sources import InputError, Source, expand_inputs, iter_batches, list_lengths, peek_columns
from ._stats import LengthHistogram

__all__ = [
    "OutputDir",
    "PackSettings",
    "PlanStats",
    "check_plot",
    "default_shard_rows",
    "load_tokenizer",
    "plan_window",
    "resolve_columns",
    "pack_corpus",
    "parse_size",
    "scan_lengths",
    "shard_bounds",
    "text_left_out",
    "uneven_reason",
    "write_shard",
]

FORMAT = "fastpack-packed/1"
STATE_DIR = ".fastpack"
# Tokens per output row group: the unit of the output side of the memory bound.
ROW_GROUP_TOKENS = 1 << 20
# Tokens per shard when --shard-rows is not given (about 100 MB of zstd parquet).
SHARD_TOKENS = 1 << 25
# Bytes per document a pass keeps besides its tokens (its id and offset).
_PER_DOC = 16
# Columns the packing writes itself: an input's are never packed as token columns.
WRITTEN = ("seq_lengths", "position_ids")


def parse_size(text: str) -> int:
    """``"512M"``, ``"2G"``, ``"1.5GiB"``, ``"1000000"`` -> bytes (K/M/G/T are powers of
    1024)."""
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = 1
    for i, unit in enumerate("KMGT", start=1):
        if value.endswith(unit):
            value, scale = value[:-1], 1024**i
            break
    try:
        size = int(float(value) * scale)
    except ValueError:
        raise FastpackError(
            f"memory: cannot read {text!r}; expected bytes like 512M, 2G or 1.5GiB") from None
    if size <= 0:
        raise FastpackError(f"memory: got {text!r}; expected a positive size")
    return size


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def default_shard_rows(max_len: int) -> int:
    return max(1, SHARD_TOKENS // max_len)


@dataclass(frozen=True)
class PackSettings:
    """Everything that decides the output's bytes: the same settings and inputs give the
    same shards, and a run resumes only with the settings it started with."""

    max_len: int
    column: str = "input_ids"
    #: The other per-token columns to pack; None: every column of the inputs that holds
    #: one integer per token (:func:`resolve_columns`), as ``fastpack.hf.pack_dataset``.
    columns: tuple[str, ...] | None = None
    text_column: str | None = None
    tokenizer: str | None = None
    strategy: str = "bfd"
    overlong: str = "error"
    long_max_len: int | None = None
    group_tokens: int | None = None
    shuffle: bool = True
    seed: int = 0
    shard_rows: int | None = None
    plan_shards: int = 1

    def __post_init__(self) -> None:
        if self.shard_rows is None:
            object.__setattr__(self, "shard_rows", default_shard_rows(self.max_len))

    def validate(self) -> None:
        """The argument checks of ``fastpack.pack`` (caps, policies, the seed), before any
        input is read."""
        from ._plan import pack

        pack(np.zeros(0, np.int32), self.max_len, strategy=self.strategy,
             overlong=self.overlong, long_max_len=self.long_max_len,
             group_tokens=self.group_tokens, seed=self.seed)

    @property
    def token_columns(self) -> list[str]:
        """Packed per-token columns, the length column first (only those named: see
        :func:`resolve_columns` for ``columns=None``)."""
        return [self.column] + [c for c in self.columns or () if c != self.column]

    @property
    def plan_config(self) -> PlanConfig:
        return PlanConfig(self.max_len, self.strategy, self.overlong, self.shuffle, self.seed,
                          self.long_max_len, self.group_tokens)

    @property
    def max_cap(self) -> int:
        return self.long_max_len or self.max_len

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self),
                "columns": None if self.columns is None else list(self.columns)}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> PackSettings:
        columns = value["columns"]
        return cls(**{**value, "columns": None if columns is None else tuple(columns)})


@dataclass
class Scan:
    """What the lengths pass learns: every document's length, each file's rows, the dtype
    each packed column takes (the packed columns, in output order) and the columns left
    out with the reason."""

    lengths: np.ndarray
    file_rows: list[int]
    dtypes: dict[str, str]
    left_out: dict[str, str]

    @property
    def columns(self) -> list[str]:
        return list(self.dtypes)

    @property
    def row_starts(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.file_rows, dtype=np.int64)])

    def locate(self, doc: int, sources: Sequence[Source]) -> tuple[str, int]:
        """(file, row) of a global document index."""
        starts = self.row_starts
        f = int(np.searchsorted(starts, doc, side="right")) - 1
        return sources[f].path, doc - int(starts[f])


# ---------------------------------------------------------------------------------------
# pass 1: lengths (and tokens, for text)


_NARROW = (pa.int8(), pa.int16(), pa.int32(), pa.uint8(), pa.uint16())


def column_dtype(column: pa.ChunkedArray) -> str:
    """The dtype a packed column needs for these rows: int32 when every value fits (the
    same whatever the file format: JSON has no integer widths), else int64."""
    if column.type.value_type in _NARROW:
        return "int32"
    import pyarrow.compute as pc

    values = pc.list_flatten(column)
    if len(values) == 0:
        return "int32"
    bounds = pc.min_max(values)
    lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
    return "int32" if -(2**31) <= lo and hi < 2**31 else "int64"


def resolve_columns(
    sources: Sequence[Source], column: str, columns: Sequence[str] | None
) -> tuple[list[str], list[str], dict[str, str]]:
    """``(named, candidates, left_out)``: the columns to pack for sure (``column`` first,
    then ``columns``), and with ``columns=None`` every other column that holds lists of
    integers in every input (packed when the lengths pass finds one value per token) and
    why each of the rest is left out."""
    if columns is not None:
        return [column, *[c for c in columns if c != column]], [], {}
    kinds = [peek_columns(s) for s in sources]
    names = list(dict.fromkeys(n for k in kinds for n in k))
    candidates, left_out = [], {}
    for name in names:
        if name == column:
            continue
        missing = [s.path for s, k in zip(sources, kinds) if name not in k]
        reasons = [k[name] for k in kinds if k.get(name, "tokens") != "tokens"]
        if name in WRITTEN:
            left_out[name] = "written by the packing itself"
        elif missing:
            left_out[name] = f"not in every input (not in {missing[0]})"
        elif reasons:
            left_out[name] = reasons[0]
        else:
            candidates.append(name)
    return [column], candidates, left_out


def text_left_out(sources: Sequence[Source], text_column: str) -> dict[str, str]:
    """With ``--text-column`` only the tokenized text is packed: every other column of the
    inputs is left out, and named."""
    names = dict.fromkeys(n for s in sources for n in peek_columns(s))
    return {n: f"not packed with --text-column (only {text_column!r}, tokenized)"
            for n in names if n != text_column}


def uneven_reason(column: str) -> str:
    return f"not one value per token of {column!r}"


def scan_lengths(
    sources: Sequence[Source], columns: Sequence[str], *, candidates: Sequence[str] = (),
    left_out: dict[str, str] | None = None, quiet: bool = False
) -> Scan:
    """Pass 1: every document's length from the first of ``columns``; the others must have
    the same length on every row. Each of ``candidates`` is packed too if it has, and
    otherwise left out (added to ``left_out``)."""
    parts: list[np.ndarray] = []
    file_rows: list[int] = []
    alive = list(candidates)
    dtypes: dict[str, str] = {c: "int32" for c in [*columns, *alive]}
    left = dict(left_out or {})
    with Progress("lengths", sum(s.size for s in sources), unit="B", quiet=quiet) as bar:
        docs = 0
        for source in sources:
            rows, consumed = 0, 0
            wanted = {c: "tokens" for c in [*columns, *alive]}
            try:
                for batch in iter_batches(source, wanted):
                    table = batch.table
                    lengths = list_lengths(table.column(columns[0]))
                    for c in [*columns[1:], *alive]:
                        other = list_lengths(table.column(c))
                        bad = np.flatnonzero(other != lengths)
                        if not bad.size:
                            continue
                        if c in alive:  # a list column of another length: not per token
                            alive.remove(c)
                            del dtypes[c]
                            left[c] = uneven_reason(columns[0])
                            continue
                        i = int(bad[0])
                        raise InputError(
                            f"has {other[i]:,} values where {columns[0]!r} has "
                            f"{lengths[i]:,} tokens; packed columns need one value per token",
                            path=source.path, row=batch.row + i, column=c,
                            line=batch.line(i))
                    for c in [*columns, *alive]:
                        value_type = table.column(c).type.value_type
                        if column_dtype(table.column(c)) == "int64":
                            dtypes[c] = "int64"
                        if value_type == pa.uint64():
                            _check_uint64(table.column(c), source, batch.row, c)
                    if lengths.size and lengths.max() >= 2**31:
                        i = int(np.argmax(lengths >= 2**31))
                        raise InputError(f"{lengths[i]:,} tokens in one document (at most "
                                         "2^31-1)", path=source.path, row=batch.row + i,
                                         column=columns[0])
                    parts.append(lengths.astype(np.int32))
                    rows += len(lengths)
                    bar.update(batch.done_bytes - consumed)
                    consumed = batch.done_bytes
            except InputError as e:
                if e.column in alive:
                    raise InputError(
                        f"{e} (packed by default: it holds lists of integers; pass --columns "
                        "to name the per-token columns)") from None
                raise
            bar.update(source.size - consumed)
            file_rows.append(rows)
            docs += rows
            bar.set_postfix(f"{docs:,} documents")
    lengths = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    return Scan(lengths, file_rows, dtypes, left)


def _check_uint64(column: pa.ChunkedArray, source: Source, row: int, name: str) -> None:
    import pyarrow.compute as pc

    values = pc.list_flatten(column)
    if len(values) and pc.max(values).as_py() >= 2**63:
        raise InputError("holds a token id of 2^63 or more (does not fit in int64)",
                         path=source.path, row=row, column=name)


def load_tokenizer(directory: str) -> Any:
    """A function from a list of texts to their token ids, from a tokenizer saved with
    ``save_pretrained`` in ``directory`` (transformers if installed, else tokenizers)."""
    path = Path(directory)
    if not path.is_dir():
        raise InputError("no such tokenizer directory; expected a directory written by "
                         "save_pretrained (tokenizer.json, tokenizer_config.json)",
                         path=directory)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        if not (path / "tokenizer.json").exists():
            raise InputError("no tokenizer.json here (and transformers is not installed)",
                             path=directory) from None
        from tokenizers import Tokenizer

        raw = Tokenizer.from_file(str(path / "tokenizer.json"))
        return lambda texts: [e.ids for e in raw.encode_batch(texts)]
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise InputError(f"not a tokenizer saved with save_pretrained ({e})",
                         path=directory) from None
    return lambda texts: tokenizer(texts)["input_ids"]


def tokenize_inputs(
    sources: Sequence[Source], settings: PackSettings, spill: Path, *, quiet: bool = False
) -> tuple[list[Source], Scan]:
    """Pass 1 for text: tokenize every document once, spill the ids to parquet (one file
    per input) and learn the lengths on the way."""
    import pyarrow.parquet as pq

    assert settings.text_column and settings.tokenizer
    encode = load_tokenizer(settings.tokenizer)
    spill.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([(settings.column, pa.list_(pa.int32()))])
    parts: list[np.ndarray] = []
    file_rows: list[int] = []
    spilled: list[Source] = []
    with Progress("tokenize", sum(s.size for s in sources), unit="B", quiet=quiet) as bar:
        for k, source in enumerate(sources):
            path = spill / f"{k:05d}.parquet"
            rows, consumed = 0, 0
            with pq.ParquetWriter(path, schema, compression="zstd") as writer:
                for batch in iter_batches(source, {settings.text_column: "text"}):
                    texts = batch.table.column(settings.text_column).to_pylist()
                    ids = pa.array(encode(texts), type=pa.list_(pa.int32()))
                    writer.write_table(pa.table({settings.column: ids}))
                    parts.append(list_lengths(pa.chunked_array([ids])).astype(np.int32))
                    rows += len(texts)
                    bar.update(batch.done_bytes - consumed)
                    consumed = batch.done_bytes
            bar.update(source.size - consumed)
            file_rows.append(rows)
            st = path.stat()
            spilled.append(Source(str(path), "parquet", None, st.st_size, st.st_mtime_ns))
    lengths = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    return spilled, Scan(lengths, file_rows, {settings.column: "int32"}, {})


# ---------------------------------------------------------------------------------------
# pass 2: the plan


def check_overlong(scan: Scan, settings: PackSettings, sources: Sequence[Source]) -> None:
    """With ``--overlong error``, names the first document longer than the cap."""
    lengths = scan.lengths
    if settings.overlong != "error" or settings.strategy == "wrapped" or not lengths.size:
        return
    over = np.flatnonzero(lengths > settings.max_cap)
    if over.size:
        path, row = scan.locate(int(over[0]), sources)
        more = f" (and {over.size - 1:,} more over the cap)" if over.size > 1 else ""
        raise InputError(
            f"{int(lengths[over[0]]):,} tokens, longer than the cap of {settings.max_cap:,}"
            f"{more}; pass --overlong split, truncate or drop (or a larger --long-max-len)",
            path=path, row=row, column=settings.column)


def make_plan(scan: Scan, settings: PackSettings,
              sources: Sequence[Source]) -> tuple[Plan, list[int]]:
    """The plan and the packs of each plan shard (one entry for a global plan)."""
    check_overlong(scan, settings, sources)
    if settings.plan_shards > 1:
        return sharded_plan(scan.lengths, settings.plan_shards, settings.plan_config,
                            keys=file_keys(scan.file_rows))
    plan = settings.plan_config.pack(scan.lengths)
    return plan, [plan.num_packs]


FILL_BINS = 50


@dataclass
class PlanStats:
    """A plan's numbers for the report, mergeable across plan shards (a cluster's plan
    is never in one place)."""

    max_len: int
    documents: int
    empty: int
    input_tokens: int
    packed_tokens: int
    packs: int
    dropped: tuple[int, int]  # (documents, tokens)
    truncated: tuple[int, int]
    split: tuple[int, int]
    buckets: list[dict[str, int]]  # max_len, documents, packs, tokens
    group_cap: int | None
    groups: int
    fill: np.ndarray  # packs per 1/FILL_BINS of fill
    lengths: LengthHistogram

    @classmethod
    def of(cls, plan: Plan, lengths: np.ndarray, settings: PackSettings) -> PlanStats:
        long = lengths > settings.max_cap
        split = (int(long.sum()), int(lengths[long].sum(dtype=np.int64))) \
            if settings.overlong == "split" and settings.strategy != "wrapped" else (0, 0)
        buckets = [{"max_len": b.max_len, "documents": b.num_sequences, "packs": b.num_packs,
                    "tokens": b.total_tokens} for b in plan.buckets] or [
            {"max_len": plan.max_len, "documents": plan.num_sequences - plan.empty_sequences,
             "packs": plan.num_packs, "tokens": plan.total_tokens}]
        fill = plan.pack_fills / plan.pack_caps
        counts = np.histogram(fill, bins=FILL_BINS, range=(0.0, 1.0))[0].astype(np.int64)
        return cls(plan.max_len, int(len(lengths)), plan.empty_sequences,
                   int(lengths.sum(dtype=np.int64)), plan.total_tokens, plan.num_packs,
                   (plan.dropped_sequences, plan.dropped_tokens),
                   (plan.truncated_sequences, plan.truncated_tokens), split, buckets,
                   plan.group_tokens, plan.num_groups, counts, LengthHistogram.of(lengths))

    @classmethod
    def merge(cls, parts: Sequence[PlanStats]) -> PlanStats:
        first = parts[0]

        def total(name: str) -> Any:
            values = [getattr(p, name) for p in parts]
            if isinstance(values[0], tuple):
                return tuple(sum(v[i] for v in values) for i in range(len(values[0])))
            return sum(values)

        buckets = [{"max_len": b["max_len"], **{k: sum(p.buckets[i][k] for p in parts)
                                                for k in ("documents", "packs", "tokens")}}
                   for i, b in enumerate(first.buckets)]
        return cls(first.max_len, total("documents"), total("empty"), total("input_tokens"),
                   total("packed_tokens"), total("packs"), total("dropped"),
                   total("truncated"), total("split"), buckets, first.group_cap,
                   total("groups"), np.sum([p.fill for p in parts], axis=0),
                   LengthHistogram.merge([p.lengths for p in parts]))

    @property
    def lower_bound(self) -> int:
        """Fewest packs any plan can use: per bucket ``ceil(tokens / cap)``."""
        return sum(-(-b["tokens"] // b["max_len"]) for b in self.buckets)

    @property
    def efficiency(self) -> float:
        capacity = sum(b["packs"] * b["max_len"] for b in self.buckets)
        return self.packed_tokens / capacity if capacity else 1.0

    def report(self) -> dict[str, Any]:
        groups = None
        if self.group_cap is not None:
            cap = self.group_cap
            groups = {"group_tokens": cap, "groups": self.groups,
                      "lower_bound": sum(-(-b["tokens"] // cap) for b in self.buckets),
                      "efficiency": self.packed_tokens / (self.groups * cap)
                      if self.groups else 1.0}
        return {
            "documents": self.documents,
            "empty_documents": self.empty,
            "input_tokens": self.input_tokens,
            "packed_tokens": self.packed_tokens,
            "packs": self.packs,
            "lower_bound": self.lower_bound,
            "packs_over_lower_bound": self.packs - self.lower_bound,
            "efficiency": self.efficiency,
            "dropped": {"documents": self.dropped[0], "tokens": self.dropped[1]},
            "truncated": {"documents": self.truncated[0], "tokens": self.truncated[1]},
            "split": {"documents": self.split[0], "tokens": self.split[1]},
            "buckets": self.buckets if len(self.buckets) > 1 else [],
            "groups": groups,
            "lengths": self.lengths.summary(),
        }


# ---------------------------------------------------------------------------------------
# pass 3: gather and write


def shard_bounds(pack_counts: Sequence[int], shard_rows: int) -> np.ndarray:
    """Pack offsets (int64 [n+1]) of the output shards: ``shard_rows`` packs each, never
    across plan shards, so every plan shard's output is its own."""
    bounds = [0]
    base = 0
    for count in pack_counts:
        bounds.extend(range(base + shard_rows, base + count, shard_rows))
        base += count
        if count:
            bounds.append(base)
    return np.asarray(bounds, dtype=np.int64)


def shard_name(i: int, n: int) -> str:
    return f"shard-{i:05d}-of-{n:05d}.parquet"


def output_schema(settings: PackSettings, dtypes: dict[str, str]) -> pa.Schema:
    fields = [pa.field(c, pa.list_(pa.from_numpy_dtype(np.dtype(dtypes[c]))))
              for c in settings.token_columns]
    fields.append(pa.field("seq_lengths", pa.list_(pa.int32())))
    fields.append(pa.field("position_ids", pa.list_(pa.int32())))
    return pa.schema(fields)


def row_group_packs(settings: PackSettings) -> int:
    assert settings.shard_rows is not None
    return max(1, min(settings.shard_rows, ROW_GROUP_TOKENS // settings.max_cap))


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


def plan_window(plan: Plan, p: int, q: int, sample_ids: np.ndarray | None = None) -> Plan:
    """Packs ``p:q`` of ``plan`` as a plan of their own: the plan's options (caps, reserve,
    policies), these packs' segments -- their samples renamed ``sample_ids`` when given
    (the rows of the data they are gathered from) -- and the counts and metrics of what
    the window holds (what a plan lost is the whole plan's: a window holds none of it)."""
    s0, s1 = int(plan.pack_offsets[p]), int(plan.pack_offsets[q])
    ids = plan.sample_ids[s0:s1] if sample_ids is None else sample_ids
    seqlens = plan.seqlens[s0:s1]
    fields: dict[str, Any] = {
        "sample_ids": np.ascontiguousarray(ids, dtype=np.int64),
        "starts": plan.starts[s0:s1], "seqlens": seqlens,
        "pack_offsets": np.asarray(plan.pack_offsets[p:q + 1], dtype=np.int64) - s0,
        "max_len": plan.max_len, "reserve": plan.reserve, "strategy": plan.strategy,
        "overlong": plan.overlong, "long_max_len": plan.long_max_len,
        "num_sequences": len(sorted_unique(plan.sample_ids[s0:s1])),
        "empty_sequences": 0, "dropped_sequences": 0, "dropped_tokens": 0,
        "truncated_sequences": 0, "truncated_tokens": 0, "split_sequences": 0,
        "total_tokens": int(seqlens.sum(dtype=np.int64)) - plan.reserve * (s1 - s0),
    }
    if plan.long_max_len is not None:
        caps = np.asarray(plan.pack_caps[p:q])
        fields["pack_caps"] = caps
        # Each bucket's sequences: those with a segment in one of its packs here.
        cap_of_segment = np.repeat(caps, np.diff(fields["pack_offsets"]))
        window_ids = plan.sample_ids[s0:s1]
        fields["buckets"] = [
            {"num_sequences": len(sorted_unique(window_ids[cap_of_segment == cap]))}
            for cap in (plan.max_len, plan.long_max_len)
        ]
    return Plan(fields)


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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


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
        with pq.ParquetWriter(tmp, schema, compression="zstd", use_dictionary=[
                "seq_lengths.list.element", "position_ids.list.element"]) as writer:
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
        return resumed

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
        ours = all(n.startswith(("shard-", ".shard-", "report.")) for n in leftovers)
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
            elif (name.startswith(("shard-", ".shard-")) and ".parquet" in name) or name in (
                    "manifest.json", "report.json", "report.png", "group_offsets.npy",
                    ".manifest.json.tmp", ".report.json.tmp"):
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
            path = self.path / entry["file"]
            if path.exists() and path.stat().st_size == entry["bytes"]:
                done[entry["shard"]] = entry
        return done

    def verified_done(self, num_shards: int) -> dict[int, dict[str, Any]]:
        """Complete shards whose bytes still hash to the journal's; removes the temporary
        file of a shard interrupted halfway."""
        done = self.done()
        for i, entry in list(done.items()):
            if i >= num_shards or sha256_file(self.path / entry["file"]) != entry["sha256"]:
                log(f"resume: {entry['file']} does not match its checksum; writing it again",
                    quiet=self.quiet)
                del done[i]
        for path in self.path.glob(".shard-*.tmp"):
            path.unlink()
        if done:
            log(f"resume: {len(done)} of {num_shards} shards complete; writing "
                f"{num_shards - len(done)}", quiet=self.quiet)
        return done

    def _picture(self, stats: PlanStats, plot: bool | None) -> str:
        """Draws report.png; returns what became of it (for the report and summary)."""
        from ._stats import plot_report, plot_unavailable

        if plot is False:
            return "not asked (--no-plot)"
        missing = plot_unavailable()
        if missing:
            return f"report.png skipped: {missing}"
        settings = self.settings
        caps = [settings.max_len] + ([settings.long_max_len] if settings.long_max_len else [])
        try:
            plot_report(stats.lengths, stats.fill, caps,
                        f"{stats.packs:,} packs, efficiency {stats.efficiency:.3%} "
                        f"(lower bound {stats.lower_bound:,})", self.path / "report.png")
        except Exception as e:  # the shards are written: a picture never undoes that
            return f"report.png not written: {type(e).__name__}: {e}"
        return "report.png"

    def record(self, shard: int, entry: dict[str, Any]) -> None:
        with open(self.journal, "a") as f:
            f.write(json.dumps({"shard": shard, **entry}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def finish(self, stats: PlanStats, entries: Sequence[dict[str, Any]],
               dtypes: dict[str, str], extra: dict[str, Any], *, plot: bool | None,
               group_offsets: np.ndarray | None,
               left_out: dict[str, str] | None = None) -> dict[str, Any]:
        """report.png, report.json, group_offsets.npy, and last the manifest; then the
        state directory goes. ``plot``: None draws the picture where matplotlib is
        installed and notes why not elsewhere; a picture that fails is noted too, never
        the end of a run whose shards are written."""
        settings = self.settings
        picture = self._picture(stats, plot)
        report = {
            "format": FORMAT,
            "inputs": [s.path for s in self.sources],
            "settings": settings.to_json(),
            **stats.report(),
            "shards": len(entries),
            "rows": sum(e["rows"] for e in entries),
            "bytes": sum(e["bytes"] for e in entries),
            "columns": output_schema(settings, dtypes).names,
            "left_out": dict(left_out or {}),
            "picture": picture,
            **extra,
        }
        self.write_json(self.path / "report.json", report)
        if group_offsets is not None:
            np.save(self.path / "group_offsets.npy", group_offsets)
        manifest = {
            "format": FORMAT,
            "settings": settings.to_json(),
            "inputs": [s.fingerprint() for s in self.sources],
            "columns": output_schema(settings, dtypes).names,
            "num_packs": stats.packs,
            "shards": [{k: e[k] for k in ("file", "rows", "tokens", "bytes", "sha256")}
                       for e in entries],
        }
        self.write_json(self.path / "manifest.json", manifest)
        shutil.rmtree(self.state_dir, ignore_errors=True)
        return report


# ---------------------------------------------------------------------------------------
# the single-machine run


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
) -> dict[str, Any]:
    """Packs the documents of ``inputs`` into parquet shards in ``outdir``; returns the
    report (also written to ``outdir/report.json``).

    ``memory``: bytes of token data one gather pass may hold (default: half the available
    memory). More passes than one read the inputs once more and ``spill`` each pass's
    documents to a temporary file (as many bytes as the tokens), or, without ``spill``,
    read the inputs again for every pass. ``plot``: draw report.png (None: where
    matplotlib is installed; True: required, checked before any work)."""
    settings.validate()
    check_plot(plot)
    timings: dict[str, float] = {}
    clock = time.monotonic()
    sources = expand_inputs(inputs)
    out = OutputDir(Path(outdir), settings, sources, quiet)
    resumed = out.prepare(resume=resume, overwrite=overwrite)
    try:
        scan, read_sources = _lengths_pass(out, resumed)
        out.packing(scan.columns)
        settings = out.settings
        timings["lengths"] = time.monotonic() - clock
        clock = time.monotonic()
        plan, pack_counts = make_plan(scan, settings, read_sources)
    except BaseException:
        if not resumed:
            out.abandon()
        raise
    timings["plan"] = time.monotonic() - clock
    log(f"plan: {plan.num_packs:,} packs of {settings.max_len:,} tokens for "
        f"{len(scan.lengths):,} documents ({timings['plan']:.2f} s)", quiet=quiet)
    clock = time.monotonic()
    entries, passes, budget = _gather_passes(out, read_sources, scan, plan, pack_counts,
                                             memory, spill)
    timings["gather"] = time.monotonic() - clock
    stats = PlanStats.of(plan, scan.lengths, settings)
    extra = {"passes": passes, "memory_budget": budget, "spilled": spill and passes > 1,
             "seconds": {k: round(v, 3) for k, v in timings.items()}}
    return out.finish(stats, entries, scan.dtypes, extra, plot=plot,
                      group_offsets=plan.group_offsets, left_out=scan.left_out)


def _lengths_pass(out: OutputDir, resumed: bool) -> tuple[Scan, list[Source]]:
    """Pass 1, or its saved result when resuming."""
    settings, state_dir = out.settings, out.state_dir
    scan_file = state_dir / "scan.json"
    if resumed and scan_file.exists():
        saved = json.loads(scan_file.read_text())
        lengths = np.load(state_dir / "lengths.npy")
        log(f"resume: lengths of {len(lengths):,} documents from the interrupted run",
            quiet=out.quiet)
        return (Scan(lengths, saved["file_rows"], saved["dtypes"], saved.get("left_out", {})),
                [Source(**s) for s in saved["sources"]])
    if settings.text_column:
        sources, scan = tokenize_inputs(out.sources, settings, state_dir / "tokens",
                                        quiet=out.quiet)
        scan.left_out = text_left_out(out.sources, settings.text_column)
    else:
        sources = list(out.sources)
        named, candidates, left_out = resolve_columns(sources, settings.column,
                                                      settings.columns)
        scan = scan_lengths(sources, named, candidates=candidates, left_out=left_out,
                            quiet=out.quiet)
    np.save(state_dir / "lengths.npy", scan.lengths)
    out.write_json(scan_file, {"file_rows": scan.file_rows, "dtypes": scan.dtypes,
                               "left_out": scan.left_out,
                               "sources": [asdict(s) for s in sources]})
    return scan, sources


def _units(bounds: np.ndarray, shards: Sequence[int], group: int) -> list[tuple[int, int, int]]:
    """The row groups still to write, in order: (shard, first pack, end pack)."""
    return [(i, p, min(p + group, int(bounds[i + 1])))
            for i in shards for p in range(int(bounds[i]), int(bounds[i + 1]), group)]


def _pass_groups(plan: Plan, lengths: np.ndarray, units: Sequence[tuple[int, int, int]],
                 bytes_per_token: int, budget: int) -> list[list[tuple[int, int, int]]]:
    """Consecutive row groups grouped into passes whose documents fit ``budget`` bytes
    (at least one row group per pass, however large). A shard may span passes: its
    parquet writer stays open from its first row group to its last."""
    passes: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    used = 0
    for unit in units:
        _, p, q = unit
        docs = sorted_unique(plan.sample_ids[plan.pack_offsets[p]:plan.pack_offsets[q]])
        cost = int(lengths[docs].sum(dtype=np.int64)) * bytes_per_token + _PER_DOC * len(docs)
        if current and (used + cost > budget or p != current[-1][2]):
            passes.append(current)
            current, used = [], 0
        current.append(unit)
        used += cost
    if current:
        passes.append(current)
    return passes


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


def _gather_passes(out: OutputDir, sources: Sequence[Source], scan: Scan, plan: Plan,
                   pack_counts: Sequence[int], memory: int | None,
                   spill: bool = True) -> tuple[list[dict[str, Any]], int, int]:
    settings = out.settings
    assert settings.shard_rows is not None
    bounds = shard_bounds(pack_counts, settings.shard_rows)
    n = len(bounds) - 1
    done = out.verified_done(n)
    todo = [i for i in range(n) if i not in done]
    itemsize = sum(np.dtype(scan.dtypes[c]).itemsize for c in settings.token_columns)
    fixed = 33 * len(scan.lengths)
    budget = memory if memory is not None else max(64 << 20, _available_memory() // 2 - fixed)
    units = _units(bounds, todo, row_group_packs(settings))
    passes = _pass_groups(plan, scan.lengths, units, itemsize, budget)
    seg_ranges = [(int(plan.pack_offsets[units_[0][1]]), int(plan.pack_offsets[units_[-1][2]]))
                  for units_ in passes]
    spill_dir = out.state_dir / "spill"
    spilled = spill and len(passes) > 1
    if spill_dir.exists():
        shutil.rmtree(spill_dir)  # an interrupted run's: which passes were whole is unknown
    if spilled:
        _distribute(out, sources, scan, plan, seg_ranges, spill_dir)
    schema = output_schema(settings, scan.dtypes)

    def batches() -> Iterator[pa.RecordBatch]:
        """Every remaining row group in order, loading each pass's documents in turn."""
        for g, units_ in enumerate(passes):
            s_lo, s_hi = seg_ranges[g]
            needed = np.zeros(len(scan.lengths), dtype=bool)
            needed[plan.sample_ids[s_lo:s_hi]] = True
            kept = np.flatnonzero(needed)
            offsets = np.zeros(len(kept) + 1, dtype=np.int64)
            np.cumsum(scan.lengths[kept], out=offsets[1:])
            if spilled:
                values = {}
                for c in settings.token_columns:
                    path = _spill_path(spill_dir, g, c)
                    values[c] = np.fromfile(path, dtype=scan.dtypes[c]) if path.exists() \
                        else np.zeros(0, dtype=scan.dtypes[c])
                    if len(values[c]) != offsets[-1]:
                        raise FastpackError(f"{path}: {len(values[c]):,} tokens spilled, "
                                            f"{offsets[-1]:,} expected; rerun with --overwrite")
                    path.unlink()
                columns = Columns(values, offsets)
            else:
                columns = Columns({c: np.empty(int(offsets[-1]), dtype=scan.dtypes[c])
                                   for c in settings.token_columns}, offsets)
                label = "gather" if len(passes) == 1 else f"gather, pass {g + 1}/{len(passes)}"
                _read_pass(out, sources, scan, needed, columns, label)
            del needed
            data = columns.arrow()
            first, last = units_[0][1], units_[-1][2]  # a pass's packs are consecutive
            window = plan_window(plan, first, last,
                                 np.searchsorted(kept, plan.sample_ids[s_lo:s_hi]))
            for _, p, q in units_:
                yield gather_rows(data, window, range(p - first, q - first),
                                  settings.token_columns, schema)
            del columns, data, window

    stream = batches()
    entries = dict(done)
    for i in todo:
        count = sum(1 for unit in units if unit[0] == i)
        entry = write_shard(out.path, shard_name(i, n), schema,
                            itertools.islice(stream, count))
        out.record(i, entry)
        entries[i] = entry
        log(f"wrote {entry['file']} ({entry['rows']:,} packs, {human_bytes(entry['bytes'])})",
            quiet=out.quiet or len(todo) > 50)
    return [entries[i] for i in range(n)], len(passes), budget


def check_plot(plot: bool | None, name: str = "plot") -> None:
    """A picture asked for explicitly where none can be drawn: an error before any work."""
    from ._stats import plot_unavailable

    missing = plot_unavailable() if plot else None
    if missing:
        raise FastpackError(f"{name}: the picture needs matplotlib: {missing}")


def summary_lines(report: dict[str, Any], outdir: str) -> Iterator[str]:
    """The final summary a person reads: nothing lost goes unmentioned."""
    r = report
    yield (f"packed {r['documents']:,} documents, {r['input_tokens']:,} tokens -> "
           f"{r['packs']:,} packs of {r['settings']['max_len']:,} in {r['shards']} "
           f"shard{'s' if r['shards'] != 1 else ''} "
           f"({human_bytes(r['bytes'])}) in {outdir}")
    yield (f"efficiency {r['efficiency']:.4%}; packs over the lower bound: "
           f"{r['packs_over_lower_bound']:,} ({r['packs']:,} for {r['lower_bound']:,})")
    lost = r["input_tokens"] - r["packed_tokens"]
    yield (f"tokens dropped: {r['dropped']['tokens']:,} ({r['dropped']['documents']:,} "
           f"documents); truncated: {r['truncated']['tokens']:,} "
           f"({r['truncated']['documents']:,} documents); split: {r['split']['tokens']:,} "
           f"({r['split']['documents']:,} documents, no token lost); "
           f"empty documents: {r['empty_documents']:,}; tokens not packed: {lost:,}")
    yield "columns: " + ", ".join(r["columns"]) + (
        "; left out: " + "; ".join(f"{k!r} ({v})" for k, v in r["left_out"].items())
        if r["left_out"] else "; none left out")
    if r["picture"] != "report.png":
        yield f"picture: {r['picture']}"
    if r["groups"]:
        g = r["groups"]
        yield (f"groups of <= {g['group_tokens']:,} tokens: {g['groups']:,} (lower bound "
               f"{g['lower_bound']:,}), group efficiency {g['efficiency']:.4%}")
    if "ray" in r:
        nodes = r["ray"]["nodes"]
        how = f"on Ray ({nodes} node{'s' if nodes != 1 else ''}, {r['ray']['cpus']} CPUs)"
    else:
        how = (f"{r['passes']} gather pass{'es' if r['passes'] != 1 else ''} within a budget "
               f"of {human_bytes(r['memory_budget'])}")
    yield f"{how}; time: " + ", ".join(f"{k} {v:.1f} s" for k, v in r["seconds"].items())
