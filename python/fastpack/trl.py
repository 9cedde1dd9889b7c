"""Drop-ins for TRL's dataset functions: change one import, get the same rows.

>>> from fastpack.trl import pack_dataset, truncate_dataset  # was: from trl import ...

:func:`pack_dataset` and :func:`truncate_dataset` take TRL's arguments, with TRL's
defaults, and return TRL's columns in the input's format. They run as TRL does, through
``Dataset.map(batched=True, **map_kwargs)`` over windows of ``batch_size`` rows (1,000
unless ``map_kwargs`` says otherwise), so ``num_proc``, caching and streams behave as
with TRL; each window is packed by fastpack's Rust best fit, which breaks ties as TRL
does (the oldest of the packs with equal room), so the packs are TRL's, row for row.

fastpack's own :func:`fastpack.hf.pack_dataset` plans the whole dataset at once (fewer
packs past one window), refuses over-long rows unless told, and shuffles the packs: it is
the native API, not the drop-in. ``trl`` itself is not needed (only ``datasets``).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import _core
from ._errors import FastpackError, FastpackTypeError

__all__ = ["STRATEGIES", "pack_dataset", "truncate_dataset"]

#: TRL's packing strategies: ``"bfd"`` truncates over-long rows to ``seq_length``,
#: ``"bfd_split"`` cuts them into pieces of ``seq_length`` (the last one shorter), and
#: ``"wrapped"`` concatenates every row and cuts every ``seq_length`` tokens.
STRATEGIES = ("bfd", "bfd_split", "wrapped")


def pack_dataset(
    dataset: Any, seq_length: int, strategy: str = "bfd", map_kwargs: dict[str, Any] | None = None
) -> Any:
    """TRL's ``pack_dataset``: rows packed into rows of at most ``seq_length`` tokens.

    Args:
        dataset: a ``datasets.Dataset``, ``DatasetDict``, ``IterableDataset`` or
            ``IterableDatasetDict`` whose columns are all lists of one value per token.
        seq_length: tokens per packed row.
        strategy: ``"bfd"`` (best fit decreasing; over-long rows truncated, empty rows
            left out), ``"bfd_split"`` (over-long rows cut into pieces of ``seq_length``
            that are packed like rows) or ``"wrapped"`` (rows end to end, cut every
            ``seq_length`` tokens: sequences cross row boundaries and no boundaries are
            kept).
        map_kwargs: passed to ``Dataset.map`` as TRL passes them: ``batch_size`` is the
            window packed at once, ``num_proc``, ``cache_file_name``, ``desc`` ... mean
            what they mean there.

    Returns:
        The packed dataset, in the input's format. ``"bfd"`` / ``"bfd_split"`` add
        ``seq_lengths`` (the packed sequences' lengths, per row), which TRL's collator
        reads to restart positions; ``"wrapped"`` adds nothing.
    """
    seq_length = _positive(seq_length, "seq_length")
    if strategy not in STRATEGIES:
        raise FastpackError(
            f"strategy: expected one of {', '.join(map(repr, STRATEGIES))}, got {strategy!r}"
        )
    window: Any
    if strategy == "wrapped":
        window = functools.partial(_wrapped_window, seq_length=seq_length)
    else:
        window = functools.partial(_bfd_window, seq_length=seq_length,
                                   split=strategy == "bfd_split")
    fmt = _format(dataset)
    packed = _datasets_module(dataset).with_format("arrow").map(
        window, batched=True, **_map_kwargs(map_kwargs)
    )
    # (A dataset of no rows is never mapped: it has no seq_lengths to list.)
    if "columns" in fmt and "seq_lengths" in (packed.column_names or ()):
        fmt["columns"] = [*fmt["columns"], "seq_lengths"]
    return packed.with_format(**fmt)


def truncate_dataset(
    dataset: Any, max_length: int, map_kwargs: dict[str, Any] | None = None
) -> Any:
    """TRL's ``truncate_dataset``: every list column cut to its first ``max_length``
    values; other columns kept as they are. Same arguments and output as TRL's
    (``trl.experimental.utils.truncate_dataset``), in the input's format."""
    max_length = _positive(max_length, "max_length")
    fmt = _format(dataset)
    cut = _datasets_module(dataset).with_format("arrow").map(
        functools.partial(_truncate_window, max_length=max_length), batched=True,
        **_map_kwargs(map_kwargs),
    )
    return cut.with_format(**fmt)


def _positive(value: Any, name: str) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        raise FastpackTypeError(
            f"{name}: expected an int, got {type(value).__name__}") from None
    if number < 1:
        raise FastpackError(f"{name}: expected at least 1, got {number}")
    return number


def _map_kwargs(map_kwargs: Any) -> dict[str, Any]:
    if map_kwargs is None:
        return {}
    if not isinstance(map_kwargs, Mapping):
        raise FastpackTypeError(
            f"map_kwargs: expected a dict of Dataset.map arguments, got "
            f"{type(map_kwargs).__name__}")
    return dict(map_kwargs)


def _datasets_module(dataset: Any) -> Any:
    if not type(dataset).__module__.startswith("datasets"):
        raise FastpackTypeError(
            f"dataset: expected a datasets.Dataset, DatasetDict, IterableDataset or "
            f"IterableDatasetDict, got {type(dataset).__name__}")
    return dataset


def _format(dataset: Any) -> dict[str, Any]:
    """The format to give the result: a Dataset's whole format (type, columns, options),
    a stream's type; for a dict of splits, its first split's."""
    if isinstance(dataset, Mapping):
        dataset = next(iter(dataset.values()))
    if hasattr(dataset, "format"):
        fmt = dict(dataset.format)
        fmt.update(fmt.pop("format_kwargs", {}))
        return fmt
    formatting = getattr(dataset, "_formatting", None)
    return {"type": formatting.format_type if formatting is not None else None}


def _list_columns(table: Any) -> list[Any]:
    """The table's columns as single list arrays, all of one row structure."""
    import pyarrow as pa

    columns = []
    first: Any = None
    for name, column in zip(table.column_names, table.columns):
        array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        if not (pa.types.is_list(array.type) or pa.types.is_large_list(array.type)):
            raise FastpackTypeError(
                f"dataset: column {name!r} is {array.type}; packing needs every column to "
                f"hold a list per row (remove_columns the others)")
        if first is None:
            first = array.offsets
        elif not array.offsets.equals(first):  # equal offsets: the usual case, no copy
            want = np.diff(np.asarray(first, dtype=np.int64))
            lengths = np.diff(np.asarray(array.offsets, dtype=np.int64))
            if not np.array_equal(want, lengths):
                row = int(np.argmax(want != lengths))
                raise FastpackError(
                    f"dataset: column {name!r} has {int(lengths[row])} values in row {row}, "
                    f"column {table.column_names[0]!r} {int(want[row])}: every column "
                    f"needs one value per token")
        columns.append(array)
    return columns


def _list_array(like: Any, offsets: np.ndarray, values: Any) -> Any:
    import pyarrow as pa

    if pa.types.is_large_list(like.type):
        return pa.LargeListArray.from_arrays(pa.array(offsets, type=pa.int64()), values)
    return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), values)


def _bfd_window(table: Any, seq_length: int, split: bool) -> Any:
    """One window packed best fit decreasing, ties to the oldest pack (TRL's rows)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    columns = _list_columns(table)
    names = list(table.column_names)
    if not columns:
        raise FastpackError("dataset: no columns to pack")
    offsets = np.asarray(columns[0].offsets, dtype=np.int64)
    lengths = np.diff(offsets)
    rows = np.flatnonzero(lengths > 0)  # empty rows are left out, as TRL does
    lens = lengths[rows]
    if split:  # pieces of seq_length from each row's start, the last one shorter
        pieces = -(-lens // seq_length)
        first = np.cumsum(pieces) - pieces
        k = np.arange(int(pieces.sum()), dtype=np.int64) - np.repeat(first, pieces)
        starts = np.repeat(offsets[rows], pieces) + k * seq_length
        seg = np.minimum(np.repeat(lens, pieces) - k * seq_length, seq_length)
    else:
        seg = np.minimum(lens, seq_length)
    # Longest first, ties in row order (a stable sort), then best fit in Rust.
    order = np.argsort(-seg, kind="stable")
    pack_of = _core.best_fit_oldest(np.ascontiguousarray(seg[order], dtype=np.uint32),
                                    seq_length).astype(np.int64)
    # Each pack's segments in the order they were placed.
    placed = np.argsort(pack_of, kind="stable")
    order, pack_of = order[placed], pack_of[placed]
    seg_len = seg[order]
    num_packs = int(pack_of[-1]) + 1 if len(pack_of) else 0
    per_pack = np.bincount(pack_of, minlength=num_packs)
    pack_tokens = np.zeros(num_packs + 1, dtype=np.int64)
    np.cumsum(np.bincount(pack_of, weights=seg_len, minlength=num_packs).astype(np.int64),
              out=pack_tokens[1:])
    if split:  # pieces: one take of each column's values by token index
        seg_ends = np.cumsum(seg_len)
        index = pa.array(np.repeat(starts[order] - (seg_ends - seg_len), seg_len)
                         + np.arange(int(pack_tokens[-1]), dtype=np.int64))
        values = [c.values.take(index) for c in columns]
    else:  # whole rows (cut to seq_length): a take of rows, in Arrow
        if len(lens) and int(lens.max()) > seq_length:
            columns = [pc.list_slice(c, 0, seq_length) for c in columns]
        index = pa.array(rows[order])
        values = [c.take(index).flatten() for c in columns]
    packed = [_list_array(c, pack_tokens, v) for c, v in zip(columns, values)]
    seg_offsets = np.zeros(num_packs + 1, dtype=np.int64)
    np.cumsum(per_pack, out=seg_offsets[1:])
    # TRL's seq_lengths: list<int32> of the first column's length type.
    length_type = pa.int64() if pa.types.is_large_list(columns[0].type) else pa.int32()
    seq_lengths = pa.ListArray.from_arrays(pa.array(seg_offsets, type=pa.int32()),
                                           pa.array(seg_len, type=length_type))
    return pa.Table.from_arrays([*packed, seq_lengths], names=[*names, "seq_lengths"])


def _wrapped_window(table: Any, seq_length: int) -> Any:
    """One window's rows end to end, cut every ``seq_length`` tokens."""
    import pyarrow as pa

    columns = _list_columns(table)
    out = []
    for column in columns:
        values = column.flatten()  # this array's values only (a window is a slice)
        n = len(values)
        offsets = np.append(np.arange(0, n, seq_length, dtype=np.int64), n)
        out.append(_list_array(column, offsets, values))
    return pa.Table.from_arrays(out, names=list(table.column_names))


def _truncate_window(table: Any, max_length: int) -> Any:
    import pyarrow as pa
    import pyarrow.compute as pc

    out = []
    for column in table.columns:
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
            column = pc.list_slice(column, 0, max_length)
        out.append(column)
    return pa.Table.from_arrays(out, names=list(table.column_names))
