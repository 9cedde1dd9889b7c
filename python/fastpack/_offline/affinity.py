"""``fastpack pack --affinity-column NAME``: each document's key read from a column of the
inputs (integers as they are, strings hashed by :func:`fastpack.affinity_keys`), for
``fastpack.pack(..., affinity=keys)``. Only that column is read: one value per document."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from .._affinity import affinity_keys
from .._errors import FastpackError
from .sources import BATCH_BYTES, InputError, Source, _arrow_batches, _jsonl_batches

__all__ = ["read_keys"]


def read_keys(sources: Sequence[Source], column: str) -> np.ndarray:
    """Every document's key (int64, non-negative), file after file, row after row."""
    parts = [_file_keys(s, column) for s in sources]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _file_keys(source: Source, column: str) -> np.ndarray:
    values = _read_column(source, column)
    t = values.type
    if not (pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)
            or pa.types.is_binary(t) or pa.types.is_large_binary(t)):
        raise InputError(f"holds {t}; --affinity-column needs integers or strings",
                         path=source.path, column=column)
    if values.null_count:
        row = int(np.argmax(~np.asarray(values.is_valid(), dtype=bool)))
        raise InputError("is null; every document needs a key", path=source.path, row=row,
                         column=column)
    try:
        return affinity_keys(values)
    except FastpackError as e:
        raise InputError(str(e).removeprefix("affinity: "), path=source.path,
                         column=column) from None


def _read_column(source: Source, column: str) -> pa.ChunkedArray:
    if source.kind == "parquet":
        import pyarrow.parquet as pq

        try:
            file = pq.ParquetFile(source.path)
        except (pa.ArrowException, OSError) as e:
            raise InputError(f"not a readable parquet file ({e})", path=source.path) from None
        if column not in file.schema_arrow.names:
            names = ", ".join(map(repr, file.schema_arrow.names))
            raise InputError(f"no such column; the file has {names}", path=source.path,
                             column=column)
        return file.read(columns=[column], use_threads=False).column(column)
    if source.kind == "arrow":
        batches = [b.table.column(column) for b in _arrow_batches(source, [column])]
    else:
        # JSON has integers or strings: read as integers, else as strings.
        try:
            batches = [b.table.column(column)
                       for b in _jsonl_batches(source, {column: "int"}, BATCH_BYTES)]
        except (InputError, pa.ArrowException):
            batches = [b.table.column(column)
                       for b in _jsonl_batches(source, {column: "text"}, BATCH_BYTES)]
    chunks = [c for b in batches for c in b.chunks]
    if not chunks:
        return pa.chunked_array([], type=pa.int64())
    return pa.chunked_array(chunks)
