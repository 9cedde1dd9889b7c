"""Pass 1, the lengths: every input file is read once, as a stream of batches, and only
each document's length is kept (4 bytes per document), with what the output needs to know
of the columns -- which are packed, the dtype each needs, and why each of the others is
left out. With ``--text-column`` this pass tokenizes and spills the token ids to a
temporary parquet file per input, so text is tokenized once; the gather passes then read
those files."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from .._errors import FastpackError
from .._gather import WRITTEN
from .progress import Progress, log
from .settings import PackSettings, token_columns
from .sources import InputError, Source, iter_batches, list_lengths, peek_columns

if TYPE_CHECKING:
    from .outdir import OutputDir

__all__ = [
    "TRAINING_COLUMNS",
    "Scan",
    "column_dtype",
    "default_columns",
    "lengths_pass",
    "load_tokenizer",
    "resolve_columns",
    "scan_lengths",
    "text_left_out",
    "tokenize_inputs",
    "uneven_reason",
    "value_range",
]


@dataclass
class Scan:
    """What the lengths pass learns: every document's length, each file's rows, the dtype
    each packed column takes (the packed columns, in output order) and the columns left
    out with the reason. For ``--format megatron``, which stores the narrowest dtype the
    values need, also each packed column's ``ranges`` (smallest and largest value; None for
    a column without values) and, when the run tokenizes, the tokenizer's ``vocab_size``."""

    lengths: np.ndarray
    file_rows: list[int]
    dtypes: dict[str, str]
    left_out: dict[str, str]
    ranges: dict[str, tuple[int, int] | None] | None = None
    vocab_size: int | None = None

    @property
    def columns(self) -> list[str]:
        return list(self.dtypes)

    def stored(self, settings: PackSettings) -> dict[str, str] | None:
        """The dtype each token column is stored in by ``--format megatron`` (None for the
        other formats: they store :attr:`dtypes`); refuses a value an explicit
        ``--token-dtype`` cannot hold."""
        if settings.format != "megatron":
            return None
        from .formats import megatron_dtypes

        ranges = self.ranges or {}
        return megatron_dtypes(settings.token_dtype,
                               {c: ranges.get(c) for c in settings.token_columns},
                               self.vocab_size)

    @property
    def row_starts(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.file_rows, dtype=np.int64)])

    def locate(self, doc: int, sources: Sequence[Source]) -> tuple[str, int]:
        """(file, row) of a global document index."""
        starts = self.row_starts
        f = int(np.searchsorted(starts, doc, side="right")) - 1
        return sources[f].path, doc - int(starts[f])

    def save(self, out: OutputDir, sources: Sequence[Source]) -> None:
        """Kept in the state directory, so that a resumed run skips this pass."""
        np.save(out.state_dir / "lengths.npy", self.lengths)
        out.write_json(out.state_dir / "scan.json", {
            "file_rows": self.file_rows, "dtypes": self.dtypes, "left_out": self.left_out,
            "ranges": self.ranges, "vocab_size": self.vocab_size,
            "sources": [asdict(s) for s in sources]})

    @classmethod
    def saved(cls, out: OutputDir) -> tuple[Scan, list[Source]] | None:
        """The scan an interrupted run saved, and the files it read, or None."""
        path = out.state_dir / "scan.json"
        if not path.exists():
            return None
        saved = json.loads(path.read_text())
        lengths = np.load(out.state_dir / "lengths.npy")
        ranges = saved.get("ranges")
        return (cls(lengths, saved["file_rows"], saved["dtypes"], saved.get("left_out", {}),
                    None if ranges is None else {
                        c: None if r is None else (r[0], r[1]) for c, r in ranges.items()},
                    saved.get("vocab_size")),
                [Source(**s) for s in saved["sources"]])


def lengths_pass(out: OutputDir, resumed: bool) -> tuple[Scan, list[Source]]:
    """Pass 1, or its saved result when resuming; returns the scan and the files the
    gather passes read (the inputs, or for text the tokenized ids)."""
    settings = out.settings
    saved = Scan.saved(out) if resumed else None
    if saved is not None and settings.format == "megatron" and saved[0].ranges is None:
        saved = None  # saved by a version that did not keep the ranges: scan again
    if saved is not None:
        log(f"resume: lengths of {len(saved[0].lengths):,} documents from the interrupted "
            "run", quiet=out.quiet)
        return saved
    if settings.text_column:
        sources, scan = tokenize_inputs(out.sources, settings, out.state_dir / "tokens",
                                        quiet=out.quiet)
        scan.left_out = text_left_out(out.sources, settings.text_column)
    else:
        sources = list(out.sources)
        named, candidates, left_out = resolve_columns(sources, settings.column,
                                                      settings.columns)
        scan = scan_lengths(sources, named, candidates=candidates, left_out=left_out,
                            quiet=out.quiet, ranges=settings.format == "megatron")
    scan.save(out, sources)
    return scan, sources


# ---------------------------------------------------------------------------------------
# the columns to pack

_NARROW = (pa.int8(), pa.int16(), pa.int32(), pa.uint8(), pa.uint16())


def value_range(column: pa.ChunkedArray) -> tuple[int, int] | None:
    """The smallest and largest value of a list column (None: no values)."""
    import pyarrow.compute as pc

    values = pc.list_flatten(column)
    if len(values) == 0:
        return None
    bounds = pc.min_max(values)
    return bounds["min"].as_py(), bounds["max"].as_py()


def merge_ranges(a: tuple[int, int] | None, b: tuple[int, int] | None
                 ) -> tuple[int, int] | None:
    if a is None or b is None:
        return a if b is None else b
    return min(a[0], b[0]), max(a[1], b[1])


def _dtype_of(bounds: tuple[int, int] | None) -> str:
    return "int32" if bounds is None or (-(2**31) <= bounds[0] and bounds[1] < 2**31) \
        else "int64"


def column_dtype(column: pa.ChunkedArray) -> str:
    """The dtype a packed column needs for these rows: int32 when every value fits (the
    same whatever the file format: JSON has no integer widths), else int64."""
    if column.type.value_type in _NARROW:
        return "int32"
    return _dtype_of(value_range(column))


def resolve_columns(
    sources: Sequence[Source], column: str, columns: Sequence[str] | None
) -> tuple[list[str], list[str], dict[str, str]]:
    """``(named, candidates, left_out)``: the columns to pack for sure (``column`` first,
    then ``columns``), and with ``columns=None`` every other column that holds lists of
    integers in every input (packed when the lengths pass finds one value per token) and
    why each of the rest is left out."""
    if columns is not None:
        return token_columns(column, columns), [], {}
    return [column], *default_columns(column, [(s.path, peek_columns(s)) for s in sources])


def default_columns(
    column: str, inputs: Sequence[tuple[str, dict[str, str]]], skip: Sequence[str] = ()
) -> tuple[list[str], dict[str, str]]:
    """``(candidates, left_out)`` when no columns are named: of ``inputs`` (each a name
    and its columns' kinds, as :func:`~fastpack._offline.sources.peek_columns` gives
    them), every column but ``column`` and ``skip`` that holds lists of integers in every
    input is a candidate; each of the others is left out, with the reason."""
    names = list(dict.fromkeys(n for _, kinds in inputs for n in kinds))
    candidates, left_out = [], {}
    for name in names:
        if name == column or name in skip:
            continue
        missing = [path for path, kinds in inputs if name not in kinds]
        reasons = [kinds[name] for _, kinds in inputs if kinds.get(name, "tokens") != "tokens"]
        if name in WRITTEN:
            left_out[name] = "written by the packing itself"
        elif missing:
            left_out[name] = f"not in every input (not in {missing[0]})"
        elif reasons:
            left_out[name] = reasons[0]
        else:
            candidates.append(name)
    return candidates, left_out


def text_left_out(sources: Sequence[Source], text_column: str) -> dict[str, str]:
    """With ``--text-column`` only the tokenized text is packed: every other column of the
    inputs is left out, and named."""
    names = dict.fromkeys(n for s in sources for n in peek_columns(s))
    return {n: f"not packed with --text-column (only {text_column!r}, tokenized)"
            for n in names if n != text_column}


#: Columns that are never left out for a length that differs from the tokens': a model
#: trains on them, so a mismatch is a data bug (rc 2), not a column to skip.
TRAINING_COLUMNS = ("labels", "assistant_masks", "completion_mask", "loss_mask")


def uneven_reason(column: str) -> str:
    return f"not one value per token of {column!r}"


def scan_lengths(
    sources: Sequence[Source], columns: Sequence[str], *, candidates: Sequence[str] = (),
    left_out: dict[str, str] | None = None, quiet: bool = False, ranges: bool = False
) -> Scan:
    """Pass 1: every document's length from the first of ``columns``; the others must have
    the same length on every row. Each of ``candidates`` is packed too if it has, and
    otherwise left out (added to ``left_out``). ``ranges``: keep each packed column's
    smallest and largest value (one min/max per batch and column)."""
    parts: list[np.ndarray] = []
    file_rows: list[int] = []
    alive = list(candidates)
    dtypes: dict[str, str] = {c: "int32" for c in [*columns, *alive]}
    bounds: dict[str, tuple[int, int] | None] = {c: None for c in dtypes}
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
                        if c in alive and c not in TRAINING_COLUMNS:
                            # a list column of another length: not per token
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
                    _check_token_ids(table.column(columns[0]), lengths, source, batch,
                                     columns[0])
                    for c in [*columns, *alive]:
                        value_type = table.column(c).type.value_type
                        if ranges or value_type not in _NARROW:
                            here = value_range(table.column(c))
                            bounds[c] = merge_ranges(bounds[c], here)
                            if value_type not in _NARROW and _dtype_of(here) == "int64":
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
    return Scan(lengths, file_rows, dtypes, left,
                {c: bounds[c] for c in dtypes} if ranges else None)


def _check_token_ids(column: pa.ChunkedArray, lengths: np.ndarray, source: Source,
                     batch: Any, name: str) -> None:
    """Token ids index the vocabulary: a negative one would be packed and fail far away,
    in the embedding of a training run."""
    import pyarrow.compute as pc

    if pa.types.is_unsigned_integer(column.type.value_type):
        return
    values = pc.list_flatten(column)
    if not len(values) or pc.min(values).as_py() >= 0:
        return
    at = int(np.argmax(np.asarray(values) < 0))
    i = int(np.searchsorted(np.cumsum(lengths), at, side="right"))
    raise InputError(f"holds the negative token id {np.asarray(values)[at]} (token ids index "
                     "the vocabulary from 0)", path=source.path, row=batch.row + i,
                     column=name, line=batch.line(i))


def _check_uint64(column: pa.ChunkedArray, source: Source, row: int, name: str) -> None:
    import pyarrow.compute as pc

    values = pc.list_flatten(column)
    if len(values) and pc.max(values).as_py() >= 2**63:
        raise InputError("holds a token id of 2^63 or more (does not fit in int64)",
                         path=source.path, row=row, column=name)


# ---------------------------------------------------------------------------------------
# text: tokenized once, in this pass


@dataclass(frozen=True)
class Tokenizer:
    """A tokenizer saved with ``save_pretrained``: ``encode`` maps a list of texts to their
    token ids; ``vocab_size`` counts every id it gives (added tokens included)."""

    encode: Callable[[list[str]], list[list[int]]]
    vocab_size: int


def load_tokenizer(directory: str) -> Tokenizer:
    """The tokenizer saved with ``save_pretrained`` in ``directory`` (transformers if
    installed, else tokenizers)."""
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
        import tokenizers

        raw = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        return Tokenizer(lambda texts: [e.ids for e in raw.encode_batch(texts)],
                         raw.get_vocab_size(with_added_tokens=True))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise InputError(f"not a tokenizer saved with save_pretrained ({e})",
                         path=directory) from None
    return Tokenizer(lambda texts: tokenizer(texts)["input_ids"], len(tokenizer))


def id_lists(lists: list[list[int]]) -> pa.ListArray:
    """A tokenizer's id lists as an Arrow ``list<int32>`` array, through numpy (about 1.5x
    faster than ``pa.array`` on lists of Python ints, and without its first call's 0.5 s;
    either is a few percent of the tokenizer's time: benches/results/formats.md)."""
    lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    offsets = np.zeros(len(lists) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] >= 2**31:
        raise FastpackError(f"tokenize: {int(offsets[-1]):,} tokens in one batch of texts; "
                            "at most 2^31 - 1")
    values = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int32,
                         count=int(offsets[-1]))
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values))


def tokenize_inputs(
    sources: Sequence[Source], settings: PackSettings, spill: Path, *, quiet: bool = False
) -> tuple[list[Source], Scan]:
    """Pass 1 for text: tokenize every document once, spill the ids to parquet (one file
    per input) and learn the lengths on the way."""
    import pyarrow.parquet as pq

    assert settings.text_column and settings.tokenizer
    tokenizer = load_tokenizer(settings.tokenizer)
    largest = -1
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
                    ids = id_lists(tokenizer.encode(texts))
                    if len(ids.values):
                        largest = max(largest, int(np.max(ids.values)))
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
    return spilled, Scan(lengths, file_rows, {settings.column: "int32"}, {},
                         {settings.column: (0, largest) if largest >= 0 else None},
                         tokenizer.vocab_size)
