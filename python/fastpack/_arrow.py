"""Arrow list columns as :class:`fastpack._core.ListColumn`: every chunk read in place.

A Hugging Face ``datasets.Dataset`` keeps each column as a pyarrow ``ChunkedArray``
(often thousands of chunks: one per written batch) and, after ``shuffle`` / ``select`` /
``filter``, an indices mapping beside it. Both are handed to Rust as they lie: numpy
views of the Arrow buffers, never concatenated, never taken through the mapping.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import _core
from ._errors import FastpackError, FastpackTypeError

__all__ = ["dataset_parts", "list_column", "list_columns", "per_token_columns"]


def _pa() -> Any:
    try:
        import pyarrow as pa
    except ImportError as e:  # pragma: no cover - pyarrow comes with datasets
        raise FastpackTypeError("reading Arrow data needs pyarrow: pip install pyarrow") from e
    return pa


def is_per_token_type(t: Any) -> bool:
    """A list (list, large_list, fixed_size_list) of integers, floats or booleans."""
    pa = _pa()
    if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
        return False
    v = t.value_type
    return bool(pa.types.is_integer(v) or pa.types.is_floating(v) or pa.types.is_boolean(v))


def _preview(chunked: Any, physical_row: int) -> str:
    try:
        text = repr(chunked[physical_row].as_py())
    except Exception:  # pragma: no cover - a preview must never hide the real error
        return "?"
    return text if len(text) <= 60 else text[:57] + "..."


def _user_row(physical: int, indices: Sequence[np.ndarray] | None) -> int | None:
    """The dataset row that reads physical row ``physical`` (None: no row reads it)."""
    if indices is None:
        return physical
    start = 0
    for part in indices:
        hit = np.flatnonzero(part == physical)
        if hit.size:
            return start + int(hit[0])
        start += len(part)
    return None


def _check_type(name: str, chunked: Any, indices: Sequence[np.ndarray] | None) -> None:
    pa = _pa()
    t = chunked.type
    if is_per_token_type(t):
        return
    row = 0 if indices is None else (int(indices[0][0]) if indices and len(indices[0]) else 0)
    example = f" (row 0 is {_preview(chunked, row)})" if len(chunked) else ""
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        v = t.value_type
        nested = pa.types.is_list(v) or pa.types.is_large_list(v) or pa.types.is_fixed_size_list(v)
        what = "nested lists" if nested else f"lists of {v}"
        raise FastpackError(
            f"columns: column {name!r} holds {what} ({t}){example}; a packed column needs one "
            f"number per token: a list of integers, floats or booleans"
        )
    raise FastpackError(
        f"columns: column {name!r} is {t}, not a list per token{example}; a packed column "
        f"needs one number per token: a list of integers, floats or booleans"
    )


def _check_nulls(name: str, chunked: Any, indices: Sequence[np.ndarray] | None) -> None:
    """Nulls (a missing row, or a missing value in a row) of rows that the dataset reads."""
    pa = _pa()
    import pyarrow.compute as pc

    start = 0
    for chunk in chunked.chunks:
        bad_rows: np.ndarray | None = None
        if chunk.null_count:
            bad_rows = np.flatnonzero(pc.is_null(chunk).to_numpy(zero_copy_only=False))
        values = chunk.flatten()
        if values.null_count:
            lengths = pc.list_value_length(chunk).fill_null(0).to_numpy(zero_copy_only=False)
            owner = np.repeat(np.arange(len(chunk)), lengths)
            nulls = owner[np.flatnonzero(pc.is_null(values).to_numpy(zero_copy_only=False))]
            bad_rows = nulls if bad_rows is None else np.union1d(bad_rows, nulls)
        if bad_rows is not None and bad_rows.size:
            for local in np.unique(bad_rows):
                row = _user_row(start + int(local), indices)
                if row is not None:
                    value = chunk[int(local)]
                    what = "is null" if not value.is_valid else "holds a null value"
                    raise FastpackError(
                        f"columns: column {name!r}: row {row} {what} "
                        f"({_preview(pa.chunked_array([chunk]), int(local))}); fill or filter "
                        f"out missing values before packing"
                    )
        start += len(chunk)


def _aligned(array: np.ndarray) -> np.ndarray:
    if array.size and array.ctypes.data % array.dtype.itemsize:
        return array.copy()  # an odd buffer position (rare in IPC files): read it once
    return array


def _chunk_spec(chunk: Any) -> tuple[np.ndarray, np.ndarray, int, int]:
    pa = _pa()
    t = chunk.type
    if pa.types.is_fixed_size_list(t):
        size = t.list_size
        offsets = (np.arange(len(chunk) + 1, dtype=np.int64) + chunk.offset) * size
    else:
        offsets = _aligned(chunk.offsets.to_numpy(zero_copy_only=True))
    child = chunk.values  # the whole child array; offsets index into it
    data = child.buffers()[1]
    if data is None or len(child) == 0:
        return offsets, np.zeros(8, dtype=np.uint8), 0, 0
    v = t.value_type
    if pa.types.is_boolean(v):
        return offsets, np.frombuffer(data, dtype=np.uint8), child.offset, len(child)
    width = v.bit_width // 8
    raw = np.frombuffer(data, dtype=np.uint8)
    if data.address % width:
        raw = raw[child.offset * width : (child.offset + len(child)) * width].copy()
        return offsets, raw, 0, len(child)
    return offsets, raw, child.offset, len(child)


def _dtype_name(t: Any) -> str:
    pa = _pa()
    v = t.value_type
    return "bool" if pa.types.is_boolean(v) else str(v)


def list_column(
    array: Any, name: str = "input_ids", *, indices: Sequence[np.ndarray] | None = None,
    check_nulls: bool = True,
) -> Any:
    """A pyarrow list ``Array`` / ``ChunkedArray`` as a ``ListColumn`` read in place;
    ``indices`` (int64 arrays) maps each row to a physical row."""
    pa = _pa()
    if isinstance(array, pa.Array):
        array = pa.chunked_array([array], type=array.type)
    if not isinstance(array, pa.ChunkedArray):
        raise FastpackTypeError(
            f"{name}: expected a pyarrow list array or ChunkedArray, got {type(array).__name__}"
        )
    _check_type(name, array, indices)
    if check_nulls:
        _check_nulls(name, array, indices)
    chunks = [_chunk_spec(c) for c in array.chunks]
    return _core.ListColumn(
        name, _dtype_name(array.type), chunks, None if indices is None else list(indices)
    )


def dataset_parts(dataset: Any) -> tuple[Any, list[np.ndarray] | None]:
    """A ``datasets.Dataset``'s pyarrow table and indices mapping (int64 views)."""
    table = dataset.data
    table = getattr(table, "table", table)  # datasets' Table wraps a pyarrow.Table
    mapping = getattr(dataset, "_indices", None)
    if mapping is None:
        return table, None
    parts = [
        _aligned(c.to_numpy(zero_copy_only=True).view(np.int64))
        for c in mapping.column(0).chunks
    ]
    return table, parts


def per_token_columns(table: Any) -> list[str]:
    """Names of the columns that hold a list of numbers per row."""
    return [f.name for f in table.schema if is_per_token_type(f.type)]


def list_columns(
    data: Any, columns: Sequence[str] | None,
) -> tuple[list[Any], list[Any], list[str]]:
    """``(ListColumns, their pyarrow types, skipped column names)`` of ``data``: a
    ``datasets.Dataset``, a ``pyarrow.Table`` or a mapping of names to list arrays.
    ``columns`` chooses (default: every per-token column)."""
    pa = _pa()
    indices = None
    if type(data).__module__.startswith("datasets") and hasattr(data, "column_names"):
        table, indices = dataset_parts(data)
    elif isinstance(data, pa.Table):
        table = data
    elif isinstance(data, pa.RecordBatch):
        table = pa.Table.from_batches([data])
    elif isinstance(data, Mapping):
        arrays = {
            str(k): v if isinstance(v, pa.ChunkedArray) else pa.chunked_array([v])
            for k, v in data.items()
        }
        table = pa.table(arrays)
    else:
        raise FastpackTypeError(
            f"data: expected a datasets.Dataset, a pyarrow.Table or a mapping of names to "
            f"pyarrow list arrays; got {type(data).__name__}"
        )
    names = list(table.column_names)
    if columns is None:
        chosen = per_token_columns(table)
        if not chosen:
            raise FastpackError(
                f"columns: no column holds a list of numbers per row; the columns are "
                f"{', '.join(f'{n} ({table.schema.field(n).type})' for n in names)}"
            )
    else:
        if isinstance(columns, str):
            raise FastpackTypeError("columns: expected a list of column names, got a string")
        chosen = [str(c) for c in columns]
        missing = [c for c in chosen if c not in names]
        if missing:
            raise FastpackError(
                f"columns: {', '.join(map(repr, missing))} not in the data; it has "
                f"{', '.join(names)}"
            )
        if len(set(chosen)) != len(chosen):
            raise FastpackError(f"columns: a column is named twice in {chosen}")
        if not chosen:
            raise FastpackError("columns: expected at least one column")
    handles = [list_column(table.column(n), n, indices=indices) for n in chosen]
    types = [table.schema.field(n).type for n in chosen]
    skipped = [n for n in names if n not in chosen]
    return handles, types, skipped
