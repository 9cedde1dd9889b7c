"""`materialize()`: packs of a plan plus token data -> training rows (numpy, zero-copy).

Token data is held as :class:`Ragged` — list data in the Arrow layout (value arrays plus
``offsets``, one or more chunks, optionally read through a row mapping) — so a Hugging
Face ``datasets`` column, a pyarrow ``Table`` / ``ChunkedArray`` or a parquet file's
column is read where it lies, with no Python object per row and no concatenation.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Union

import numpy as np

from . import _core
from ._arrow import _aligned, dataset_parts, list_column
from ._checks import _bool_arg, _choice, _int_arg, _threads
from ._errors import FastpackError, FastpackTypeError
from ._plan import PackIndex, Plan, as_lengths, flat_plan

__all__ = ["IGNORE_INDEX", "Ragged", "as_ragged", "loss_mask_from_spans", "materialize"]

IGNORE_INDEX = -100
LAYOUTS = ("flat", "rows")


class Ragged:
    """Ragged data in the Arrow list layout: row ``i`` is ``values[offsets[i]:offsets[i+1]]``.

    Built from numpy, ``values`` is any integer dtype (token ids, labels) or, for a loss
    mask, any numeric or bool dtype; ``offsets`` is int32/int64 with
    ``len(offsets) == num_rows + 1``. Both are kept as given when they already have such
    dtypes (no copy). :func:`as_ragged` also builds one over Arrow data — every chunk of a
    pyarrow ``ChunkedArray``, a ``datasets`` column through its indices mapping, a parquet
    column — read in place: then :attr:`values` / :attr:`offsets` are a concatenated copy
    made on first access, which :func:`materialize` and the sampler never need.

    Indexing follows Python (``ragged[-1]`` is the last row); an index out of range
    raises :class:`~fastpack.FastpackError`. A Ragged pickles (for spawned DataLoader
    workers): over a ``datasets.Dataset`` as the dataset itself pickles — a memory-mapped
    one by its file paths, never its data — and is read in place again where it lands.
    """

    __slots__ = ("_arrow", "_column", "_indices", "_mask", "_name", "_offsets", "_source",
                 "_values")

    def __init__(self, values: Any, offsets: Any, *, mask: bool = False) -> None:
        self._values: np.ndarray | None = (
            _as_mask_values(values) if mask else _as_int_values(values, "values")
        )
        self._offsets: np.ndarray | None = _as_offsets(offsets)
        if self._offsets.size == 0:
            raise FastpackError("offsets: expected at least one entry (num_rows + 1)")
        if self._offsets[0] < 0:
            raise FastpackError(f"offsets: starts at {int(self._offsets[0])}; expected >= 0")
        self._mask = mask
        self._arrow: Any = None
        self._indices: list[np.ndarray] | None = None
        self._name = "loss_mask" if mask else "tokens"
        self._column: Any = None
        self._source: tuple[Any, Any, str] | None = None

    @classmethod
    def _from_arrow(
        cls, array: Any, name: str, indices: list[np.ndarray] | None, mask: bool
    ) -> Ragged:
        self = cls.__new__(cls)
        self._values = self._offsets = None
        self._mask = mask
        self._name = name
        self._indices = indices
        self._source = None
        column = list_column(array, name, indices=indices)
        if not mask and column.dtype.startswith(("float", "bool")):
            raise FastpackTypeError(
                f"{name}: expected integer values, got {column.dtype} (pass it as a loss mask?)"
            )
        self._column = column
        import pyarrow as pa

        # A new object over the same chunks: the source itself is not kept (see _reuse).
        chunks = array.chunks if isinstance(array, pa.ChunkedArray) else [array]
        self._arrow = pa.chunked_array(chunks, type=array.type)
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # The ListColumn (views of buffers in this process) is rebuilt where it lands.
        if self._source is not None:
            return (_ragged_of_dataset, (*self._source, self._mask, self._name))
        if self._arrow is not None:
            return (_ragged_of_arrow, (self._arrow, self._indices, self._mask, self._name))
        return (_ragged_of_arrays, (self._values, self._offsets, self._mask, self._name))

    @property
    def column(self) -> Any:
        """The data as a ``fastpack._core.ListColumn`` (built once, read in place)."""
        if self._column is None:
            assert self._values is not None and self._offsets is not None
            values = self._values
            dtype = "uint8" if values.dtype == np.bool_ else str(values.dtype)
            self._column = _core.ListColumn(
                self._name, dtype, [(self._offsets, values, 0, values.size)], None
            )
        return self._column

    @property
    def num_chunks(self) -> int:
        return 1 if self._arrow is None else int(self._arrow.num_chunks)

    @property
    def values(self) -> np.ndarray:
        """The values, rows end to end (for Arrow data with several chunks or a row
        mapping: a concatenated copy, made once)."""
        if self._values is None:
            self._materialize_arrays()
        assert self._values is not None
        return self._values

    @property
    def offsets(self) -> np.ndarray:
        if self._offsets is None:
            self._materialize_arrays()
        assert self._offsets is not None
        return self._offsets

    def _materialize_arrays(self) -> None:
        import pyarrow as pa

        array = self._arrow
        if self._indices is not None:
            import pyarrow.compute as pc

            array = pc.take(array, pa.chunked_array(self._indices, type=pa.int64()))
        array = array.combine_chunks() if array.num_chunks != 1 else array.chunk(0)
        if pa.types.is_fixed_size_list(array.type):
            array = array.cast(pa.list_(array.type.value_type))
        values = array.flatten().to_numpy(zero_copy_only=False)
        offsets = array.offsets.to_numpy(zero_copy_only=False)
        self._values = values.view(np.uint8) if values.dtype == np.bool_ else values
        self._offsets = (offsets - offsets[0]) if offsets.size and offsets[0] else offsets

    @property
    def lengths(self) -> np.ndarray:
        """Length of every row (int64), for :func:`fastpack.pack`; every row is checked."""
        if self._offsets is not None:
            return np.diff(self._offsets.astype(np.int64, copy=False))
        lengths: np.ndarray = _core.column_lengths([self.column])
        return lengths

    def __len__(self) -> int:
        if self._offsets is not None:
            return len(self._offsets) - 1
        return int(self.column.rows)

    def __getitem__(self, i: int) -> np.ndarray:
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
            raise FastpackTypeError(f"index: expected an int, got {type(i).__name__}")
        n = len(self)
        if not -n <= i < n:
            raise FastpackError(f"index: row {int(i)} out of range; the data has {n} rows")
        i = int(i) % n
        if self._values is not None and self._offsets is not None:
            return self._values[int(self._offsets[i]) : int(self._offsets[i + 1])]
        if self._indices is not None:
            starts = np.cumsum([0] + [len(p) for p in self._indices])
            k = int(np.searchsorted(starts, i, side="right")) - 1
            i = int(self._indices[k][i - starts[k]])
        row = self._arrow[i].values
        out = row.to_numpy(zero_copy_only=False)
        return out.view(np.uint8) if out.dtype == np.bool_ else out

    def __repr__(self) -> str:
        if self._arrow is not None:
            return (f"Ragged({len(self)} rows, {self.num_chunks} Arrow chunk(s) of "
                    f"{self._arrow.type.value_type}"
                    + (", through a row mapping" if self._indices is not None else "") + ")")
        return f"Ragged({len(self)} rows, {self.values.size} values of {self.values.dtype})"


def _ragged_of_arrays(values: np.ndarray, offsets: np.ndarray, mask: bool, name: str
                      ) -> Ragged:
    ragged = Ragged(values, offsets, mask=mask)
    ragged._name = name
    return ragged


def _ragged_of_arrow(array: Any, indices: list[np.ndarray] | None, mask: bool, name: str
                     ) -> Ragged:
    return Ragged._from_arrow(array, name, indices, mask)


def _ragged_of_dataset(data: Any, mapping: Any, column: str, mask: bool, name: str
                       ) -> Ragged:
    table = getattr(data, "table", data)  # datasets' Table wraps a pyarrow.Table
    indices = None if mapping is None else indices_of(mapping)
    ragged = Ragged._from_arrow(table.column(column), column, indices, mask)
    ragged._name = name
    ragged._source = (data, mapping, column)
    return ragged


def indices_of(mapping: Any) -> list[np.ndarray]:
    """A ``datasets`` indices table as int64 views of its chunks (as ``dataset_parts``)."""
    return [_aligned(c.to_numpy(zero_copy_only=True).view(np.int64))
            for c in mapping.column(0).chunks]


def _shallow(table: Any) -> Any:
    """Another datasets ``Table`` object over the same Arrow table (no data copied): what a
    Ragged keeps to pickle by, without keeping alive the object its cache entry is keyed on."""
    cls: Any = type(table)
    copy = cls.__new__(cls)
    copy.__dict__.update(table.__dict__)
    return copy


def _as_offsets(offsets: Any) -> np.ndarray:
    array = np.asarray(offsets)
    if array.ndim != 1:
        raise FastpackError(f"offsets: expected a 1-D array, got shape {array.shape}")
    if array.dtype in (np.dtype(np.int32), np.dtype(np.int64)) and array.dtype.isnative:
        return np.ascontiguousarray(array)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.dtype.kind not in "iu":
        raise FastpackTypeError(f"offsets: expected integers, got dtype {array.dtype}")
    return np.ascontiguousarray(array, dtype=np.int64)


def _as_int_values(values: Any, name: str) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise FastpackError(f"{name}: expected a 1-D array, got shape {array.shape}")
    if array.dtype.kind in "iu" and array.dtype.isnative:
        return np.ascontiguousarray(array)  # every integer width is read in place
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.dtype.kind not in "iub":
        raise FastpackTypeError(f"{name}: expected integers, got dtype {array.dtype}")
    return np.ascontiguousarray(array, dtype=np.int64)


def _as_mask_values(values: Any) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise FastpackError(f"loss_mask: expected a 1-D array, got shape {array.shape}")
    if array.dtype == np.bool_:
        return np.ascontiguousarray(array).view(np.uint8)
    if array.dtype.kind in "iuf" and array.dtype.isnative:
        return np.ascontiguousarray(array)  # zero means "not a target", in any dtype
    if array.size == 0:
        return np.zeros(0, dtype=np.uint8)
    if array.dtype.kind not in "iuf":
        raise FastpackTypeError(f"loss_mask: expected 0/1 values, got dtype {array.dtype}")
    return (array != 0).view(np.uint8)


# The Ragged of each live Arrow source (per column, mask and row mapping), so that
# passing the same dataset or chunked array on every step does not redo its per-chunk work
# (a dataset often has thousands of chunks). Keyed weakly: an entry goes with its source.
_RAGGED: dict[int, tuple[Any, dict[tuple[Any, ...], tuple[Any, Ragged]]]] = {}


def _reuse(source: Any, mapping: Any, key: tuple[Any, ...], build: Callable[[], Ragged]
           ) -> Ragged:
    # Arrow tables and arrays are unhashable: keyed by id, checked by a weak reference.
    entry = _RAGGED.get(id(source))
    if entry is None or entry[0]() is not source:
        try:
            ref = weakref.ref(source)
        except TypeError:  # not weakly referenceable: no reuse
            return build()
        entry = (ref, {})
        _RAGGED[id(source)] = entry
        weakref.finalize(source, _RAGGED.pop, id(source), None)
    entries = entry[1]
    hit = entries.get((id(mapping), *key))
    if hit is not None and hit[0] is mapping:
        return hit[1]
    ragged = build()
    entries[(id(mapping), *key)] = (mapping, ragged)
    return ragged


def _from_arrow(array: Any, mask: bool, name: str = "tokens") -> Ragged:
    import pyarrow as pa

    kind = array.type if isinstance(array, (pa.Array, pa.ChunkedArray)) else None
    if kind is None or not (pa.types.is_list(kind) or pa.types.is_large_list(kind)
                            or pa.types.is_fixed_size_list(kind)):
        raise FastpackTypeError(
            f"{name}: expected a pyarrow list array (list<int>), got {type(array).__name__}"
            + (f" of {kind}" if kind is not None else "")
        )
    return _reuse(array, None, (name, mask),
                  lambda: Ragged._from_arrow(array, name, None, mask))


def _from_dataset(dataset: Any, column: str, mask: bool, name: str = "column") -> Ragged:
    if column not in dataset.column_names:
        raise FastpackError(
            f"{name}: no column {column!r} in the dataset; it has "
            f"{', '.join(map(repr, dataset.column_names))}"
        )

    def build() -> Ragged:
        table, indices = dataset_parts(dataset)
        ragged = Ragged._from_arrow(table.column(column), column, indices, mask)
        ragged._source = (_shallow(dataset.data), getattr(dataset, "_indices", None), column)
        return ragged

    return _reuse(dataset.data, getattr(dataset, "_indices", None), (column, mask), build)


def _from_table(table: Any, column: str, mask: bool) -> Ragged:
    if column not in table.column_names:
        raise FastpackError(
            f"column {column!r} not in the table; it has {', '.join(table.column_names)}"
        )
    return _reuse(table, None, (column, mask),
                  lambda: Ragged._from_arrow(table.column(column), column, None, mask))


def _from_parquet(source: Any, column: str, mask: bool) -> Ragged:
    """One column of parquet files, read through ``pyarrow.dataset``: only that column is
    read, row group by row group, and its batches stay the chunks (never concatenated)."""
    import pyarrow.dataset as pads

    dataset = source if isinstance(source, pads.Dataset) else pads.dataset(
        source if isinstance(source, (str, os.PathLike)) else [os.fspath(p) for p in source],
        format="parquet",
    )
    if column not in dataset.schema.names:
        raise FastpackError(
            f"column {column!r} not in the parquet data; it has {', '.join(dataset.schema.names)}"
        )
    table = dataset.to_table(columns=[column])
    return Ragged._from_arrow(table.column(column), column, None, mask)


def _is_parquet_source(data: Any) -> bool:
    def is_path(p: Any) -> bool:
        return isinstance(p, (str, os.PathLike)) and (
            os.fspath(p).endswith((".parquet", ".pq")) or os.path.isdir(os.fspath(p))
        )

    if type(data).__module__.startswith("pyarrow._dataset"):
        return True
    if is_path(data):
        return True
    return (isinstance(data, (list, tuple)) and bool(data)
            and all(isinstance(p, (str, os.PathLike)) for p in data) and is_path(data[0]))


TokenData = Union[Ragged, tuple[Any, Any], Sequence[Any], Any]


def as_ragged(
    data: TokenData, *, column: str = "input_ids", mask: bool = False, name: str = "data"
) -> Ragged:
    """Token data (or labels, or with ``mask=True`` a loss mask: zero = not a target) as
    :class:`Ragged`.

    Accepts a :class:`Ragged`; a ``(values, offsets)`` pair; a pyarrow list ``Array`` /
    ``ChunkedArray`` (every chunk read in place) or a ``Table`` / ``RecordBatch`` (its
    ``column``); a Hugging Face ``datasets.Dataset`` (its ``column``, read through its
    indices mapping after ``shuffle``/``select``/``filter``) or a column of one
    (``dataset["input_ids"]``); parquet files — a path, a directory, a list of paths or a
    ``pyarrow.dataset.Dataset`` — of which only ``column`` is read; or a sequence of
    per-row arrays or lists (concatenated once). Arrow and parquet data are never
    concatenated: batches of one plan cost their rows, whatever the chunking. ``name`` is
    the argument that errors name.
    """
    if not isinstance(column, str):
        raise FastpackTypeError(f"column: expected a string, got {type(column).__name__}")
    if isinstance(data, Ragged):
        if mask and not data._mask and data._values is not None:
            return Ragged(data._values, data._offsets, mask=True)
        return data
    if isinstance(data, tuple) and len(data) == 2:
        return Ragged(data[0], data[1], mask=mask)
    if _is_parquet_source(data):
        return _from_parquet(data, column, mask)
    module = type(data).__module__
    if module.startswith("pyarrow"):
        import pyarrow as pa

        if isinstance(data, pa.Table):
            return _from_table(data, column, mask)
        if isinstance(data, pa.RecordBatch):
            return _from_table(pa.Table.from_batches([data]), column, mask)
        return _from_arrow(data, mask, name)
    if module.startswith("datasets"):
        if hasattr(data, "column_names") and hasattr(data, "data"):
            return _from_dataset(data, column, mask, name)
        if hasattr(data, "source") and hasattr(data, "column_name"):
            return _from_dataset(data.source, data.column_name, mask, name)
    if isinstance(data, (str, bytes, dict)) or not isinstance(data, Sequence):
        raise FastpackTypeError(
            f"{name}: expected Ragged, (values, offsets), a pyarrow list array or table, "
            f"a datasets column, parquet files or a sequence of sequences; got "
            f"{type(data).__name__}"
        )
    return _from_rows(data, mask, name)


def _from_rows(rows: Sequence[Any], mask: bool, name: str = "data") -> Ragged:
    if isinstance(rows, list) and rows and isinstance(rows[0], list):
        try:  # lists of Python ints, read in Rust straight from the list objects
            values, offsets = _core.flatten_int_lists(rows, mask)
            return _ragged(values, offsets, mask, name)
        except FastpackError:
            pass  # not all lists of ints: the general path below says what is wrong
    same = _same_arrays(rows)
    if same is not None:
        return _ragged(*same, mask, name)
    for i, row in enumerate(rows):
        if isinstance(row, (str, bytes, dict)) or not hasattr(row, "__len__"):
            raise FastpackTypeError(
                f"{name}: row {i} is {type(row).__name__}; expected a sequence of integers "
                f"(list, tuple, numpy array or tensor)"
            )
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    # Rows that are not all lists of Python ints (those went to Rust above): each row to
    # numpy once, so a float or a string is an error below, never silently truncated.
    try:
        if len(rows):
            values = np.concatenate([_to_numpy(r) for r in rows])
        else:
            values = np.zeros(0, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as e:
        raise FastpackTypeError(f"{name}: expected rows of integers ({e})") from None
    return _ragged(values, offsets, mask, name)


#: Names of the torch dtypes read in place by ``_same_arrays`` (numpy has each of them).
_TORCH_INTEGER_NAMES = ("int8", "int16", "int32", "int64", "uint8", "bool")


def _same_arrays(rows: Sequence[Any]) -> tuple[np.ndarray, np.ndarray] | None:
    """``(values, offsets)`` of rows that are all 1-D numpy arrays of one dtype (what a
    ``with_format("numpy")`` dataset gives), or CPU torch tensors of one dtype: one
    concatenation, no per-row conversion. None for anything else (the general path)."""
    if not isinstance(rows, list) or not rows:
        return None
    kind = type(rows[0])
    if kind is np.ndarray:
        if set(map(type, rows)) != {kind} or len({r.dtype for r in rows}) != 1:
            return None
        try:
            values = np.concatenate(rows)
        except ValueError:  # rows of different or no dimensions: the general path's error
            return None
        if values.ndim != 1:
            return None
    elif kind.__module__.startswith("torch") and kind.__name__ == "Tensor":
        dtype = rows[0].dtype
        if str(dtype).removeprefix("torch.") not in _TORCH_INTEGER_NAMES or not all(
                type(r) is kind and r.ndim == 1 and r.dtype == dtype and r.device.type == "cpu"
                for r in rows):
            return None
        import torch

        values = torch.cat([r.detach() for r in rows]).numpy()
    else:
        return None
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, rows), dtype=np.int64, count=len(rows)), out=offsets[1:])
    return values, offsets


def _ragged(values: Any, offsets: Any, mask: bool, name: str) -> Ragged:
    try:
        ragged = Ragged(values, offsets, mask=mask)
    except FastpackError as e:  # name the argument the rows came from
        message = str(e)
        raise type(e)(message if message.startswith(f"{name}:") else f"{name}: {message}") from None
    if name != "data":
        ragged._name = name  # errors found later (in Rust) name the same argument
    return ragged


def _to_numpy(row: Any) -> np.ndarray:
    if type(row).__module__.startswith("torch"):
        row = row.detach().cpu().numpy()
    array = np.asarray(row)
    if array.ndim > 1:  # a nested row is an error, never silently flattened
        raise ValueError(f"a row has shape {array.shape}; expected one flat list per row")
    array = array.reshape(-1)
    # An empty list becomes float64 in numpy; it must not change the dtype of the rest.
    return array if array.size else np.zeros(0, dtype=np.int32)


def loss_mask_from_spans(lengths: Any, spans: Sequence[Sequence[tuple[int, int]]]) -> Ragged:
    """A 0/1 loss mask from role spans: ``spans[i]`` lists the ``(start, end)`` token
    ranges of row ``i`` that are trained on (say, the assistant turns); everything else
    gets label -100. Spans may overlap; ends past the row are clipped."""
    lengths = as_lengths(lengths).astype(np.int64, copy=False)
    if (lengths < 0).any():
        i = int(np.argmax(lengths < 0))
        raise FastpackError(f"lengths: negative length {int(lengths[i])} at index {i}")
    if isinstance(spans, (str, bytes, dict)) or not isinstance(spans, Sequence):
        raise FastpackTypeError(
            f"spans: expected a sequence of per-row lists of (start, end) pairs, got "
            f"{type(spans).__name__}"
        )
    if len(spans) != len(lengths):
        raise FastpackError(f"spans: got {len(spans)} rows for {len(lengths)} lengths")
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    counts = np.fromiter((len(s) for s in spans), dtype=np.int64, count=len(spans))
    try:
        flat = np.array([pair for row in spans for pair in row], dtype=np.int64).reshape(-1, 2)
    except (TypeError, ValueError, OverflowError):
        raise FastpackError(
            "spans: expected (start, end) pairs of integers, e.g. [[(0, 4), (9, 12)], []]"
        ) from None
    if len(flat) != int(counts.sum()):
        raise FastpackError("spans: expected (start, end) pairs, e.g. [[(0, 4), (9, 12)], []]")
    rows = np.repeat(np.arange(len(lengths)), counts)
    if flat.size and ((flat < 0).any() or (flat[:, 1] < flat[:, 0]).any()):
        bad = int(np.argmax((flat < 0).any(axis=1) | (flat[:, 1] < flat[:, 0])))
        raise FastpackError(
            f"spans: row {int(rows[bad])} has the span {tuple(flat[bad].tolist())}; expected "
            f"(start, end) pairs with 0 <= start <= end"
        )
    lo = offsets[rows] + np.minimum(flat[:, 0], lengths[rows])
    hi = offsets[rows] + np.minimum(flat[:, 1], lengths[rows])
    delta = np.zeros(int(offsets[-1]) + 1, dtype=np.int64)
    np.add.at(delta, lo, 1)
    np.add.at(delta, hi, -1)
    values = (np.cumsum(delta[:-1]) > 0).view(np.uint8)
    return Ragged(values, offsets, mask=True)


def materialize(
    plan: Plan,
    tokens: TokenData,
    packs: PackIndex | None = None,
    *,
    labels: TokenData | None = None,
    loss_mask: TokenData | None = None,
    separator_id: int | None = None,
    train_separators: bool = False,
    layout: str = "flat",
    pad_to: int | None = None,
    pad_to_multiple_of: int | None = None,
    pad_id: int = 0,
    threads: int | None = None,
) -> dict[str, Any]:
    """Build training rows for ``packs`` (default: all) of ``plan`` from the token data.

    Args:
        plan: from :func:`fastpack.pack` over the lengths of ``tokens``.
        tokens: the token ids: see :func:`as_ragged` (Ragged, ``(values, offsets)``,
            pyarrow list array, ``datasets`` Dataset/column, or a list of sequences).
            int32 and int64 ids are read in place.
        labels: per-token labels in the same row layout (default: the token ids).
            Labels are *unshifted*, as Hugging Face causal LMs expect (the model shifts).
        loss_mask: per-token 0/1 (bool or uint8), same rows: 0 makes the label -100 —
            e.g. ``assistant_masks`` from ``apply_chat_template(...,
            return_assistant_tokens_mask=True)`` or :func:`loss_mask_from_spans`. With a
            ``datasets.Dataset`` as ``tokens``, ``labels`` and ``loss_mask`` may be
            column names.
        separator_id: token written into the plan's ``reserve`` slots (required when
            ``plan.reserve > 0``); ``train_separators`` makes them targets.
        layout: ``"flat"`` — every pack end to end in one row ``[1, T]`` (flash-attn's
            varlen layout); ``"rows"`` — one row per pack ``[P, W]``.
        pad_to: flat: pad the row to exactly this many tokens; rows: pad every row to this
            width (default: the longest chosen pack). Raises if the tokens do not fit.
        pad_to_multiple_of: round the row width up to a multiple of this.
        pad_id: token id of padding. Padding is its own trailing segment of every row
            (in ``cu_seqlens``, ``seq_idx`` and restarting ``position_ids``), label -100.

    Returns:
        A dict of numpy arrays moved out of Rust without a copy: ``input_ids``,
        ``position_ids``, ``labels`` (int64 ``[rows, width]``), ``seq_idx`` (int32
        ``[rows, width]``: segment index restarting at 0 in each row),
        ``cu_seqlens`` (int32, every segment of all rows end to end, padding included),
        and ints ``max_seqlen`` (the longest segment), ``num_targets`` (labels other than
        -100: the loss's ``num_items_in_batch``), ``total_tokens`` (tokens of the chosen
        packs, separators included, padding not: the packs' share of
        ``Plan.total_tokens``).

    In every segment the label of the first position is -100, so no sequence is trained
    to predict the next one's first token, and positions restart at 0.
    """
    plan = flat_plan(
        plan, "has no per-token labels (a shared token has one next token per child); build "
        "its batch with fastpack.tree_rows or PackedCollator(share_prefix=True)"
    )
    layout = _choice("layout", layout, LAYOUTS)
    pad_to, multiple, pad_id = padding(pad_to, pad_to_multiple_of, pad_id)
    if separator_id is not None:
        separator_id = _int_arg("separator_id", separator_id, minimum=-(2**63),
                                maximum=2**63 - 1)
    train_separators = _bool_arg("train_separators", train_separators)
    threads = _threads(threads)
    token_data, label_data, mask_data = token_sources(tokens, labels, loss_mask)
    out: dict[str, Any] = _core.materialize(
        plan, plan._packs(packs), token_data.column,
        None if label_data is None else label_data.column,
        None if mask_data is None else mask_data.column,
        separator_id, bool(train_separators), layout, pad_to, multiple, int(pad_id), threads,
    )
    shape = (out.pop("rows"), out.pop("width"))
    for key in ("input_ids", "position_ids", "labels", "seq_idx"):
        out[key] = out[key].reshape(shape)
    return out


def padding(pad_to: Any, pad_to_multiple_of: Any, pad_id: Any) -> tuple[int | None, int, int]:
    """``(pad_to, multiple, pad_id)`` checked: the row width options of every row builder
    (``materialize``, ``tree_rows``)."""
    multiple = 1 if pad_to_multiple_of is None else _int_arg(
        "pad_to_multiple_of", pad_to_multiple_of, minimum=1, maximum=2**31 - 1
    )
    if pad_to is not None:
        pad_to = _int_arg("pad_to", pad_to, minimum=0, maximum=2**63 - 1)
    return pad_to, multiple, _int_arg("pad_id", pad_id, minimum=-(2**63), maximum=2**63 - 1)


def token_sources(
    tokens: TokenData, labels: TokenData | str | None, loss_mask: TokenData | str | None
) -> tuple[Ragged, Ragged | None, Ragged | None]:
    """The token data with its labels and loss mask (column names of a dataset given as
    ``tokens``), as the row builders read them."""
    dataset = tokens if _is_dataset(tokens) else None
    return (as_ragged(tokens, name="tokens"), _side(labels, dataset, mask=False, name="labels"),
            _side(loss_mask, dataset, mask=True, name="loss_mask"))


def _is_dataset(obj: Any) -> bool:
    """A ``datasets.Dataset`` (or one of its dict-like kin), known without importing
    ``datasets``: the one test of it (``materialize``, ``PackedDataset``)."""
    return type(obj).__module__.startswith("datasets") and hasattr(obj, "column_names")


def _side(
    data: TokenData | str | None, dataset: Any, *, mask: bool, name: str
) -> Ragged | None:
    if data is None:
        return None
    if isinstance(data, str):
        if dataset is None:
            raise FastpackTypeError(
                f"{name}: got the column name {data!r}, which needs a datasets.Dataset as "
                f"tokens; pass the values instead"
            )
        return _from_dataset(dataset, data, mask, name)
    ragged = as_ragged(data, mask=mask, name=name)
    if ragged is not data and ragged._column is None:
        ragged._name = "loss_mask" if mask else "labels"  # for error messages
    return ragged
