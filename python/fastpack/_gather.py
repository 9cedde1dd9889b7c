"""`gather()`: a plan's packs as packed Arrow record batches, copied in Rust straight
from the input's Arrow buffers."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from . import _core
from ._arrow import list_columns
from ._checks import _int_arg, _threads
from ._errors import FastpackError
from ._materialize import IGNORE_INDEX
from ._plan import PackIndex, Plan, flat_plan

__all__ = [
    "DEFAULT_BATCH_TOKENS", "DEFAULT_SEPARATOR_VALUES", "WRITTEN", "Batches", "check_packable",
    "gather", "prepare", "separators", "written_fields",
]

#: Tokens per output record batch (a batch ends at the first pack boundary past it):
#: 4 Mi tokens is 16 MiB per int32 column, big enough that per-batch costs vanish and
#: small enough that one batch in flight is nothing next to the dataset.
DEFAULT_BATCH_TOKENS = 1 << 22
_MAX_BATCH_TOKENS = 1 << 30  # int32 list offsets inside one batch

#: The separator values of the usual columns: what a plan's reserved slots hold there,
#: unless ``separator_values`` says otherwise (``input_ids``: ``separator_id``); any other
#: column's is 0.
DEFAULT_SEPARATOR_VALUES: dict[str, int] = {"labels": IGNORE_INDEX, "attention_mask": 1}


#: The columns gather writes from the plan, never packed from the input: each segment's
#: tokens (TRL's ``seq_lengths``, int32) and the position ids (int64: docs/core.md#words).
#: Their one definition, for gather, the streams, ``hf.pack_dataset`` and the command.
WRITTEN = ("seq_lengths", "position_ids")


def written_fields(position_ids: bool = True) -> list[Any]:
    """The Arrow fields of the columns gather writes (:data:`WRITTEN`), in output order."""
    import pyarrow as pa

    fields = [pa.field("seq_lengths", pa.list_(pa.int32()))]
    if position_ids:
        fields.append(pa.field("position_ids", pa.list_(pa.int64())))
    return fields


def check_packable(columns: Sequence[str], by: str) -> None:
    """Raises if ``columns`` (to pack) names a column that ``by`` writes from the plan."""
    written = [c for c in columns if c in WRITTEN]
    if written:
        raise FastpackError(
            f"columns: {written[0]!r} is written by {by} from the plan; leave it out")


def _separator_bytes(name: str, value: Any, dtype: np.dtype, type_name: Any) -> bytes:
    """``value`` as the little-endian bytes of one ``dtype`` value, or a FastpackError
    naming the column and its type (``type_name``, else the dtype) when it does not fit."""
    if dtype.kind == "b":
        return bytes([1 if value else 0])
    try:
        array = np.array([value], dtype=dtype)
        if dtype.kind in "iu" and array[0] != value:
            raise OverflowError
    except (OverflowError, ValueError, TypeError):
        raise FastpackError(
            f"separator_values: {value!r} for column {name!r} does not fit its type "
            f"{dtype if type_name is None else type_name}"
        ) from None
    return array.astype(dtype.newbyteorder("<")).tobytes()


def separators(
    names: Sequence[str], dtypes: Sequence[np.dtype], reserve: int, separator_id: Any,
    separator_values: Mapping[str, Any] | None, type_names: Sequence[Any] | None = None,
) -> list[bytes]:
    """Each column's separator value (``separator_values``, ``separator_id`` in
    ``input_ids``, else :data:`DEFAULT_SEPARATOR_VALUES`), as the bytes the Rust gather
    writes into a plan's reserved slots: the one check of them, for the Arrow gather and
    the streams. ``dtypes``: the columns' value dtypes (``type_names``: how errors name
    their types). Without reserved slots nothing is written, so no value need fit."""
    values = dict(separator_values or {})
    unknown = [k for k in values if k not in names]
    if unknown:
        raise FastpackError(
            f"separator_values: {unknown[0]!r} is not a packed column ({', '.join(names)})")
    if separator_id is not None:
        values.setdefault("input_ids", _int_arg("separator_id", separator_id,
                                                minimum=-(2**63)))
    if reserve and "input_ids" in names and "input_ids" not in values:
        raise FastpackError(
            f"separator_id: the plan reserves {reserve} slot(s) after every sequence; "
            f"pass the separator token id (or separator_values={{'input_ids': ...}})"
        )
    if not reserve:
        return [b""] * len(names)
    type_names = [None] * len(names) if type_names is None else type_names
    return [_separator_bytes(n, values.get(n, DEFAULT_SEPARATOR_VALUES.get(n, 0)), d, t)
            for n, d, t in zip(names, dtypes, type_names)]


def _value_dtype(list_type: Any) -> np.dtype:
    """The numpy dtype of an Arrow list type's values (booleans: ``bool``)."""
    import pyarrow as pa

    # (not to_pandas_dtype(): that needs pandas, which a base install lacks)
    return pa.array([], type=list_type.value_type).to_numpy(zero_copy_only=False).dtype


def _batches(pack_tokens: np.ndarray, batch_tokens: int) -> list[tuple[int, int]]:
    """Cut the chosen packs into runs of about ``batch_tokens`` tokens."""
    bounds = [0]
    if len(pack_tokens):
        cumulative = np.cumsum(pack_tokens)
        while bounds[-1] < len(pack_tokens):
            base = cumulative[bounds[-1] - 1] if bounds[-1] else 0
            # The first pack boundary at or past the budget; always at least one pack.
            end = int(np.searchsorted(cumulative, base + batch_tokens, side="left")) + 1
            bounds.append(min(max(end, bounds[-1] + 1), len(pack_tokens)))
    return list(zip(bounds[:-1], bounds[1:]))


def gather(
    plan: Plan,
    data: Any,
    packs: PackIndex | None = None,
    *,
    columns: Sequence[str] | None = None,
    separator_id: int | None = None,
    separator_values: Mapping[str, Any] | None = None,
    position_ids: bool = True,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    threads: int | None = None,
) -> Batches:
    """The packs of ``plan`` as packed ``pyarrow.RecordBatch``es, one row per pack.

    The values are copied once, in Rust, from the input's Arrow buffers (every chunk in
    place; a ``datasets`` indices mapping read through, not applied) into the output
    batches, in parallel and the same on any thread count.

    Args:
        plan: from :func:`fastpack.pack` over the row lengths of ``data`` (every chosen
            column has the same length in each row).
        data: a ``datasets.Dataset`` (after ``shuffle``/``select``/``filter`` too), a
            ``pyarrow.Table`` / ``RecordBatch``, or a mapping of names to pyarrow list
            arrays / chunked arrays.
        packs: which packs, in which order (default: all, in plan order); an int, slice,
            range or array of pack indices.
        columns: the columns to pack, in output order (default: every column holding a
            list of integers, floats or booleans per row). Each keeps its Arrow type.
        separator_id: written into ``input_ids`` at the plan's reserved slots (required
            when ``plan.reserve > 0`` and ``input_ids`` is packed).
        separator_values: per column, its separator value: what the reserved slots hold
            (default: ``labels`` -100, ``attention_mask`` 1, any other column 0).
        position_ids: add ``position_ids`` (int64, restarting at 0 in every segment).
        batch_tokens: tokens per record batch (each ends at the first pack boundary past
            it), bounding the memory of a batch in flight.
        threads: worker threads (default: ``RAYON_NUM_THREADS`` or all cores).

    Returns:
        An iterator (with the output ``schema``, known up front) of record batches made as
        it is iterated: the chosen columns (a list per pack), ``seq_lengths``
        (list<int32>: every segment's tokens, reserved slots included, as TRL's
        ``pack_dataset`` writes) and ``position_ids`` (list<int64>).
    """
    plan = flat_plan(
        plan, "cannot be gathered into packed rows (a segment continues its parent; the rows "
        "would lose the tree); build its batches with PackedCollator(share_prefix=True)"
    )
    handles, types, _ = list_columns(data, columns)
    schema, batches = prepare(
        plan, handles, types, packs, separator_id=separator_id,
        separator_values=separator_values,
        position_ids=position_ids, batch_tokens=batch_tokens, threads=threads,
    )
    return Batches(schema, batches)


class Batches(Iterator[Any]):
    """The record batches of :func:`gather`, made one at a time as they are iterated;
    ``schema`` is their ``pyarrow.Schema``, known before the first (say, to open a
    parquet writer), even when there is none."""

    def __init__(self, schema: Any, batches: Iterator[Any]) -> None:
        self.schema = schema
        self._batches = batches

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> Any:
        return next(self._batches)


def prepare(
    plan: Plan,
    handles: list[Any],
    types: list[Any],
    packs: PackIndex | None,
    *,
    separator_id: int | None,
    separator_values: Mapping[str, Any] | None,
    position_ids: bool,
    batch_tokens: int,
    threads: int | None,
) -> tuple[Any, Iterator[Any]]:
    """Checks the options once; returns the output schema and the lazy batches."""
    import pyarrow as pa

    batch_tokens = _int_arg("batch_tokens", batch_tokens, minimum=1, maximum=_MAX_BATCH_TOKENS)
    threads = _threads(threads)
    names = [h.name for h in handles]
    check_packable([n for n in names if n != "position_ids" or position_ids], "gather")
    slots = separators(names, [_value_dtype(t) for t in types], plan.reserve, separator_id,
                       separator_values, [t.value_type for t in types])
    chosen = plan._packs(packs)
    pack_tokens = _core.pack_tokens(plan, chosen)
    out_types = [_output_type(t) for t in types]
    schema = pa.schema([pa.field(n, t) for n, t in zip(names, out_types)]
                       + written_fields(position_ids))
    return schema, _iterate(
        plan, chosen, pack_tokens, batch_tokens, handles, out_types, slots, position_ids,
        threads, schema,
    )


def _output_type(t: Any) -> Any:
    import pyarrow as pa

    if pa.types.is_large_list(t):
        return pa.large_list(t.value_field)
    return pa.list_(t.value_field)


def _iterate(
    plan: Plan, chosen: np.ndarray, pack_tokens: np.ndarray, batch_tokens: int,
    handles: list[Any], out_types: list[Any], separators: list[bytes], position_ids: bool,
    threads: int | None, schema: Any,
) -> Iterator[Any]:
    for lo, hi in _batches(pack_tokens, batch_tokens):
        out = _core.gather(plan, chosen[lo:hi], handles, separators, position_ids, threads)
        yield _record_batch(out, out_types, position_ids, schema)


def _record_batch(out: dict[str, Any], out_types: list[Any], position_ids: bool,
                  schema: Any) -> Any:
    """Arrow arrays over the buffers Rust wrote (no copy)."""
    import pyarrow as pa

    offsets64 = out["offsets"]
    rows = len(offsets64) - 1
    total = int(offsets64[-1])
    offsets: dict[str, Any] = {}

    def list_of(t: Any, values: Any) -> Any:
        key = "large" if pa.types.is_large_list(t) else "small"
        if key not in offsets:
            dtype = np.int64 if key == "large" else np.int32
            offsets[key] = pa.py_buffer(offsets64.astype(dtype, copy=False))
        return pa.Array.from_buffers(t, rows, [None, offsets[key]], children=[values])

    arrays = []
    for t, buf in zip(out_types, out["columns"]):
        vt = t.value_type
        if isinstance(buf, tuple):  # booleans: (bits, len)
            bits, n = buf
            values = pa.Array.from_buffers(vt, n, [None, pa.py_buffer(bits)])
        else:
            values = pa.Array.from_buffers(vt, total, [None, pa.py_buffer(buf)])
        arrays.append(list_of(t, values))
    seq = pa.Array.from_buffers(
        pa.list_(pa.int32()), rows,
        [None, pa.py_buffer(out["seq_offsets"].astype(np.int32))],
        children=[pa.Array.from_buffers(pa.int32(), len(out["seq_lengths"]),
                                        [None, pa.py_buffer(out["seq_lengths"])])],
    )
    arrays.append(seq)
    if position_ids:
        positions = pa.Array.from_buffers(pa.int64(), total,
                                          [None, pa.py_buffer(out["position_ids"])])
        arrays.append(list_of(pa.list_(pa.int64()), positions))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)
