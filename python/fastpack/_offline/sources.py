"""Corpora on disk for the ``fastpack`` command: parquet, JSON lines (plain, ``.gz``,
``.zst``) and Arrow files or ``datasets.save_to_disk`` directories, read as a stream of
record batches of bounded size, with every defect reported as an :class:`InputError`
naming the file, the row and the column.

A document's place in fastpack's own order is its row: files in the order given
(a directory's files sorted by name), rows in file order. Every pass and every machine
sees the same order, whatever the reader's batching.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from .._errors import FastpackError

__all__ = [
    "Batch",
    "InputError",
    "Source",
    "expand_inputs",
    "iter_batches",
    "list_lengths",
    "field_kind",
    "peek_columns",
]

PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
ARROW_SUFFIXES = (".arrow",)
ACCEPTED = "parquet (.parquet), JSON lines (.jsonl/.ndjson/.json, optionally .gz or .zst), " \
    "Arrow (.arrow) or a directory written by datasets.save_to_disk"

# Input bytes a reader decodes at a time: the unit of the memory bound for reading.
BATCH_BYTES = 32 << 20
# A compressed stream is read in pieces of this many decoded bytes, so that a corrupt or
# truncated file is reported at the line where its readable data ends (a failed read
# returns nothing of what it decoded).
READ_PIECE = 1 << 16


class InputError(FastpackError):
    """A defect in an input: the message names the file, the row (0-based; JSON lines
    also give the 1-based line) and the column."""

    def __init__(
        self,
        detail: str,
        *,
        path: str | None = None,
        row: int | None = None,
        line: int | None = None,
        column: str | None = None,
    ) -> None:
        where = [path] if path else []
        if row is not None:
            where.append(f"row {row:,}" + (f" (line {line:,})" if line is not None else ""))
        elif line is not None:
            where.append(f"line {line:,}")
        if column is not None:
            where.append(f"column {column!r}")
        super().__init__(": ".join([", ".join(where), detail]) if where else detail)
        self.path, self.row, self.line, self.column = path, row, line, column


@dataclass(frozen=True)
class Source:
    """One input file."""

    path: str
    kind: str  # "parquet" | "jsonl" | "arrow"
    compression: str | None
    size: int
    mtime_ns: int

    def fingerprint(self) -> dict[str, Any]:
        """What a resumed run checks to know the file has not changed."""
        return {"path": self.path, "size": self.size, "mtime_ns": self.mtime_ns}


def _kind(path: Path) -> tuple[str, str | None] | None:
    name = path.name.lower()
    compression = None
    for suffix, codec in COMPRESSIONS.items():
        if name.endswith(suffix):
            compression, name = codec, name[: -len(suffix)]
            break
    if name.endswith(PARQUET_SUFFIXES) and compression is None:
        return "parquet", None
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl", compression
    if name.endswith(ARROW_SUFFIXES) and compression is None:
        return "arrow", None
    return None


def _source(path: Path, kind: str, compression: str | None) -> Source:
    if not os.access(path, os.R_OK):
        raise InputError("permission denied: the file cannot be read", path=str(path))
    st = path.stat()
    return Source(str(path), kind, compression, st.st_size, st.st_mtime_ns)


def _expand_dir(directory: Path) -> list[Source]:
    if not os.access(directory, os.R_OK | os.X_OK):
        raise InputError("permission denied: the directory cannot be listed",
                         path=str(directory))
    if (directory / "dataset_dict.json").exists():
        splits = json.loads((directory / "dataset_dict.json").read_text()).get("splits", [])
        raise InputError(
            f"a DatasetDict (splits {', '.join(splits)}); pass one split's directory, "
            f"e.g. {directory / (splits[0] if splits else 'train')}", path=str(directory))
    state = directory / "state.json"
    if state.exists():  # datasets.save_to_disk: its Arrow files, in its own order
        try:
            files = [f["filename"] for f in json.loads(state.read_text())["_data_files"]]
        except (ValueError, KeyError, TypeError) as e:
            raise InputError(f"state.json is not a datasets state file ({e})",
                             path=str(directory)) from None
        return [_source(directory / f, "arrow", None) for f in files]
    sources = []
    for path in sorted(directory.iterdir()):
        kind = _kind(path)
        if kind is not None and path.is_file():
            sources.append(_source(path, *kind))
    if not sources:
        raise InputError(f"no input files in this directory; expected {ACCEPTED}",
                         path=str(directory))
    return sources


def expand_inputs(inputs: Sequence[str]) -> list[Source]:
    """The input files, in fastpack's order. Raises InputError for a path that is missing,
    unreadable or of a kind fastpack does not read."""
    if not inputs:
        raise FastpackError("INPUT: no input given; expected files or directories")
    sources: list[Source] = []
    for name in inputs:
        path = Path(name)
        if not path.exists():
            raise InputError("no such file or directory", path=name)
        if path.is_dir():
            sources.extend(_expand_dir(path))
            continue
        kind = _kind(path)
        if kind is None:
            raise InputError(f"unknown file type; expected {ACCEPTED}", path=name)
        sources.append(_source(path, *kind))
    seen: set[str] = set()
    for s in sources:
        real = os.path.realpath(s.path)
        if real in seen:
            raise InputError("given twice: every document would be packed twice", path=s.path)
        seen.add(real)
    return sources


@dataclass
class Batch:
    """Rows ``row .. row + table.num_rows`` of a file, the requested columns only."""

    table: pa.Table
    row: int
    #: Bytes of the file consumed once this batch is read (for progress).
    done_bytes: int
    #: The block of JSON lines the rows come from and its first line's number, to name
    #: the line of a bad row (found only when one is).
    block: tuple[bytes, int] | None = None

    def line(self, row_in_batch: int) -> int | None:
        """The 1-based line of a row of ``table`` (JSON lines only)."""
        if self.block is None:
            return None
        data, first = self.block
        raw = np.frombuffer(data, dtype=np.uint8)
        ends = np.flatnonzero(raw == 10)
        if len(raw) and raw[-1] != 10:  # the file's last line, without a newline
            ends = np.append(ends, len(raw))
        starts = np.concatenate([[0], ends[:-1] + 1])
        # Blank lines hold no row: a line counts when it has a byte other than whitespace.
        solid = np.concatenate([[0], np.cumsum(~np.isin(raw, (9, 10, 13, 32)))])
        rows = np.flatnonzero(solid[ends] > solid[starts])
        return first + int(rows[row_in_batch]) if row_in_batch < len(rows) else None


def _column_types(columns: dict[str, str]) -> pa.Schema:
    return pa.schema([
        (name, pa.string() if kind == "text" else pa.int64() if kind == "int"
         else pa.list_(pa.int64()))
        for name, kind in columns.items()
    ])


def iter_batches(
    source: Source,
    columns: dict[str, str],
    *,
    batch_bytes: int = BATCH_BYTES,
    need: np.ndarray | None = None,
) -> Iterator[Batch]:
    """Batches of ``columns`` (name -> ``"tokens"`` or ``"text"``) from one file, checked:
    every column present, tokens as lists of integers without nulls, text as strings.

    ``need`` (bool per row of the file): parquet row groups with no needed row are
    skipped; other formats are streams and read whole."""
    if source.kind == "parquet":
        reader = _parquet_batches(source, list(columns), batch_bytes, need)
    elif source.kind == "arrow":
        reader = _arrow_batches(source, list(columns))
    else:
        reader = _jsonl_batches(source, columns, batch_bytes)
    rows = 0
    for batch in reader:
        _check(batch, columns, source)
        rows += batch.table.num_rows
        yield batch
    if rows == 0 and need is None:
        raise InputError("the file holds no rows", path=source.path)


def _parquet_batches(
    source: Source, names: list[str], batch_bytes: int, need: np.ndarray | None
) -> Iterator[Batch]:
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(source.path)
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"not a readable parquet file ({e})", path=source.path) from None
    missing = [n for n in names if n not in file.schema_arrow.names]
    if missing:
        raise InputError(
            f"no such column; the file has {', '.join(map(repr, file.schema_arrow.names))}",
            path=source.path, column=missing[0])
    meta = file.metadata
    total_rows = max(meta.num_rows, 1)
    row = 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        if need is not None and not need[row:row + group.num_rows].any():
            row += group.num_rows
            continue
        # Rows per batch from the group's uncompressed bytes: long documents, short batches.
        per_row = group.total_byte_size / max(group.num_rows, 1)
        batch_rows = int(min(max(batch_bytes // max(per_row, 1), 1), 1 << 16))
        try:
            for rb in file.iter_batches(batch_size=batch_rows, row_groups=[g], columns=names,
                                        use_threads=False):
                table = pa.Table.from_batches([rb])
                yield Batch(table, row, source.size * (row + rb.num_rows) // total_rows)
                row += rb.num_rows
        except (pa.ArrowException, OSError) as e:
            raise InputError(f"corrupt parquet data in row group {g} ({e})", path=source.path,
                             row=row) from None


def _arrow_batches(source: Source, names: list[str]) -> Iterator[Batch]:
    handle = pa.OSFile(source.path)  # not memory-mapped: pages read count, not the file
    try:
        reader: Any = pa.ipc.open_stream(handle)
    except pa.ArrowException:
        try:
            handle.seek(0)
            file_reader = pa.ipc.open_file(handle)
            reader = (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))
            schema = file_reader.schema
        except pa.ArrowException as e:
            handle.close()
            raise InputError(f"not a readable Arrow file ({e})", path=source.path) from None
    else:
        schema = reader.schema
    missing = [n for n in names if n not in schema.names]
    if missing:
        handle.close()
        raise InputError(f"no such column; the file has {', '.join(map(repr, schema.names))}",
                         path=source.path, column=missing[0])
    row = 0
    try:
        for rb in reader:
            table = pa.Table.from_batches([rb.select(names)])
            yield Batch(table, row, handle.tell())
            row += rb.num_rows
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"corrupt Arrow data ({e})", path=source.path, row=row) from None
    finally:
        handle.close()


def _jsonl_batches(
    source: Source, columns: dict[str, str], batch_bytes: int
) -> Iterator[Batch]:
    import pyarrow.json as pj

    parse = pj.ParseOptions(explicit_schema=_column_types(columns),
                            unexpected_field_behavior="ignore")
    read = pj.ReadOptions(use_threads=False, block_size=max(batch_bytes, 1 << 20))
    raw = pa.OSFile(source.path)
    stream = pa.CompressedInputStream(raw, source.compression) if source.compression else raw
    row, line, tail = 0, 1, b""
    piece = min(READ_PIECE, batch_bytes) if source.compression else batch_bytes
    try:
        while True:
            pieces: list[bytes] = []
            got = 0
            try:
                while got < batch_bytes:
                    part = stream.read(piece)
                    if not part:
                        break
                    pieces.append(part)
                    got += len(part)
            except (pa.ArrowException, OSError) as e:
                # The line holding the first byte that could not be decoded.
                at = line + tail.count(b"\n") + sum(p.count(b"\n") for p in pieces)
                raise InputError(f"cannot be decompressed from this line on "
                                 f"({source.compression}: {e})", path=source.path,
                                 line=at) from None
            chunk = b"".join(pieces)
            del pieces
            data = tail + chunk
            if not chunk:
                if not data.strip():
                    return
                block, tail = data, b""
            else:
                cut = data.rfind(b"\n") + 1
                if cut == 0:  # one line longer than a batch: read on
                    tail = data
                    continue
                block, tail = data[:cut], data[cut:]
            if block.strip():
                try:
                    table = pj.read_json(pa.BufferReader(block), read_options=read,
                                         parse_options=parse)
                except pa.ArrowException as e:
                    _diagnose_jsonl(source, block, columns, row, line)
                    raise InputError(f"cannot be parsed ({e})", path=source.path, row=row,
                                     line=line) from None
                yield Batch(table, row, raw.tell(), (block, line))
                row += table.num_rows
            line += block.count(b"\n")
            if not chunk:
                return
    finally:
        raw.close()


def _diagnose_jsonl(
    source: Source, block: bytes, columns: dict[str, str], row: int, line: int
) -> None:
    """Finds the first bad line of a block pyarrow refused and raises for it (the slow
    path: runs only on an error)."""
    for offset, text in enumerate(block.split(b"\n")):
        if not text.strip():
            continue
        where: dict[str, Any] = {"path": source.path, "row": row, "line": line + offset}
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise InputError(f"not valid JSON ({e})", **where) from None
        if not isinstance(obj, dict):
            raise InputError(f"expected a JSON object, got {type(obj).__name__}", **where)
        for name, kind in columns.items():
            value = obj.get(name)
            if kind == "text":
                if not isinstance(value, str):
                    raise InputError(f"expected a string, got {_show(value)}", column=name,
                                     **where)
                continue
            if not isinstance(value, list):
                raise InputError(f"expected a list of integer token ids, got {_show(value)}",
                                 column=name, **where)
            for i, v in enumerate(value):
                if isinstance(v, bool) or not isinstance(v, int):
                    raise InputError(f"element {i} is {_show(v)}; expected integer token ids",
                                     column=name, **where)
                if not -(2**63) <= v < 2**63:
                    raise InputError(f"element {i} ({v}) does not fit in int64", column=name,
                                     **where)
        row += 1


def _show(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, (bytes, bytearray)) else repr(value)
    kind = "null" if value is None else type(value).__name__
    return kind if value is None else f"{kind} {text[:40]}{'...' if len(text) > 40 else ''}"


def _is_list(t: pa.DataType) -> bool:
    return bool(pa.types.is_list(t) or pa.types.is_large_list(t))


def _check(batch: Batch, columns: dict[str, str], source: Source) -> None:
    table = batch.table

    def fail(detail: str, row_in_batch: int, name: str) -> None:
        line = batch.line(row_in_batch)
        raise InputError(detail, path=source.path, row=batch.row + row_in_batch, line=line,
                         column=name)

    for name, kind in columns.items():
        column = table.column(name)
        t = column.type
        if kind == "text":
            if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
                fail(f"holds {t}; --text-column needs strings", 0, name)
            if column.null_count:
                fail("is null; expected a string", _first_null(column), name)
            continue
        if not _is_list(t) or not (pa.types.is_integer(t.value_type)):
            first = _first_value_row(column)
            value = column[first].as_py() if len(column) else None
            held = f"lists of {t.value_type}" if _is_list(t) else str(t)
            fail(f"holds {held} (here {_show(value)}); expected lists of integer token ids",
                 first, name)
        if column.null_count:
            fail("is null; expected a list of integer token ids", _first_null(column), name)
        for chunk in column.chunks:
            values = chunk.flatten()
            if values.null_count:
                lengths = np.asarray(pa.compute.list_value_length(column))
                where = int(np.argmax(~np.asarray(values.is_valid(), dtype=bool)))
                rows = np.searchsorted(np.cumsum(lengths), where, side="right")
                fail("holds a null token id", int(rows), name)


def _first_null(column: pa.ChunkedArray) -> int:
    valid = np.asarray(column.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    return int(np.argmax(~valid))


def _first_value_row(column: pa.ChunkedArray) -> int:
    if column.null_count == len(column):
        return 0
    return int(np.argmax(np.asarray(column.is_valid().to_numpy(zero_copy_only=False))))


def list_lengths(column: pa.ChunkedArray) -> np.ndarray:
    """Tokens in each row (int64) of a checked token column."""
    import pyarrow.compute as pc

    return np.asarray(pc.list_value_length(column).to_numpy(), dtype=np.int64)


def field_kind(t: pa.DataType) -> str:
    """``"tokens"`` for a column the command can pack (lists of integers), else why not."""
    if _is_list(t):
        if pa.types.is_integer(t.value_type):
            return "tokens"
        return f"holds lists of {t.value_type}, not integer token ids"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "a string column"
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        return "one value per document, not per token"
    return f"holds {t}, not lists of integer token ids"


def _json_kind(value: Any) -> str:
    if isinstance(value, list):
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return "tokens"
        return "holds lists that are not all integers, not integer token ids"
    if isinstance(value, str):
        return "a string column"
    if isinstance(value, (int, float, bool)):
        return "one value per document, not per token"
    return f"holds {_show(value)}, not lists of integer token ids"


def peek_columns(source: Source) -> dict[str, str]:
    """The columns of a file, each ``"tokens"`` (lists of integers: packable) or why it
    is not, from the schema (parquet, Arrow) or the first row (JSON lines, which have no
    schema) -- without reading the data."""
    if source.kind == "parquet":
        import pyarrow.parquet as pq

        try:
            schema = pq.read_schema(source.path)
        except (pa.ArrowException, OSError) as e:
            raise InputError(f"not a readable parquet file ({e})", path=source.path) from None
        return {f.name: field_kind(f.type) for f in schema}
    if source.kind == "arrow":
        with pa.OSFile(source.path) as handle:
            try:
                schema = pa.ipc.open_stream(handle).schema
            except pa.ArrowException:
                try:
                    handle.seek(0)
                    schema = pa.ipc.open_file(handle).schema
                except pa.ArrowException as e:
                    raise InputError(f"not a readable Arrow file ({e})",
                                     path=source.path) from None
        return {f.name: field_kind(f.type) for f in schema}
    raw = pa.OSFile(source.path)
    stream = pa.CompressedInputStream(raw, source.compression) if source.compression else raw
    data, line = b"", 1
    try:
        while True:
            try:
                part = stream.read(READ_PIECE)
            except (pa.ArrowException, OSError) as e:
                raise InputError(f"cannot be decompressed from this line on "
                                 f"({source.compression}: {e})", path=source.path,
                                 line=line + data.count(b"\n")) from None
            data += part
            if part and b"\n" not in part:  # the first row is not complete yet
                continue
            for offset, text in enumerate(data.split(b"\n")[:-1] if part else
                                          data.split(b"\n")):
                if text.strip():
                    try:
                        obj = json.loads(text)
                    except ValueError as e:
                        raise InputError(f"not valid JSON ({e})", path=source.path, row=0,
                                         line=line + offset) from None
                    if not isinstance(obj, dict):
                        raise InputError(f"expected a JSON object, got {type(obj).__name__}",
                                         path=source.path, row=0, line=line + offset)
                    return {k: _json_kind(v) for k, v in obj.items()}
            if not part:
                return {}
    finally:
        raw.close()
