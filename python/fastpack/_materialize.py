"""`materialize()`: packs of a plan plus token data -> training rows (numpy, zero-copy).

Token data is held as :class:`Ragged` — one flat value array plus ``offsets`` (the Arrow
list layout) — so a Hugging Face ``datasets`` column or a pyarrow ``ListArray`` is read
in place, with no Python object per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import numpy as np

from . import _core
from ._errors import FastpackError, FastpackTypeError
from ._plan import PackIndex, Plan, _bool_arg, _choice, _int_arg, _threads, as_lengths

__all__ = ["IGNORE_INDEX", "Ragged", "as_ragged", "loss_mask_from_spans", "materialize"]

IGNORE_INDEX = -100
LAYOUTS = ("flat", "rows")

_INT_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


class Ragged:
    """Ragged data in the Arrow list layout: row ``i`` is ``values[offsets[i]:offsets[i+1]]``.

    ``values`` is int32/int64 (token ids, labels) or uint8 (loss masks); ``offsets`` is
    int32/int64 with ``len(offsets) == num_rows + 1``. Both are kept as given when they
    already have those dtypes (no copy). Build one with :func:`as_ragged` from a list of
    sequences, a pyarrow array or a ``datasets`` column, once per dataset.
    """

    __slots__ = ("offsets", "values")

    values: np.ndarray
    offsets: np.ndarray

    def __init__(self, values: Any, offsets: Any, *, mask: bool = False) -> None:
        self.values = _as_mask_values(values) if mask else _as_int_values(values, "values")
        self.offsets = _as_int_values(offsets, "offsets")
        offsets = self.offsets
        if offsets.size == 0:
            raise FastpackError("offsets: expected at least one entry (num_rows + 1)")
        # Checked once here, so a bad layout fails where it is built (O(rows), no copy).
        if offsets[0] < 0:
            raise FastpackError(f"offsets: starts at {int(offsets[0])}; expected >= 0")
        steps = np.diff(offsets)
        if steps.size and steps.min() < 0:
            i = int(np.argmax(steps < 0))
            raise FastpackError(
                f"offsets: not monotone: offsets[{i}] = {int(offsets[i])} > offsets[{i + 1}] "
                f"= {int(offsets[i + 1])}; expected non-decreasing offsets"
            )
        if offsets[-1] > self.values.size:
            raise FastpackError(
                f"offsets: ends at {int(offsets[-1])}, past the end of values "
                f"({self.values.size} values)"
            )

    @property
    def lengths(self) -> np.ndarray:
        """Length of every row (int64), for :func:`fastpack.pack`."""
        return np.diff(self.offsets.astype(np.int64, copy=False))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.values[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def __repr__(self) -> str:
        return f"Ragged({len(self)} rows, {self.values.size} values of {self.values.dtype})"


def _as_int_values(values: Any, name: str) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise FastpackError(f"{name}: expected a 1-D array, got shape {array.shape}")
    if array.dtype in _INT_DTYPES and array.dtype.isnative:
        return np.ascontiguousarray(array)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.dtype.kind not in "iub":
        raise FastpackTypeError(f"{name}: expected integers, got dtype {array.dtype}")
    return np.ascontiguousarray(array, dtype=np.int64)


def _as_mask_values(values: Any) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise FastpackError(f"loss_mask: expected a 1-D array, got shape {array.shape}")
    if array.dtype == np.uint8 or array.dtype == np.bool_:
        return np.ascontiguousarray(array).view(np.uint8)
    if array.size == 0:
        return np.zeros(0, dtype=np.uint8)
    if array.dtype.kind not in "iuf":
        raise FastpackTypeError(f"loss_mask: expected 0/1 values, got dtype {array.dtype}")
    return (array != 0).view(np.uint8)


def _from_arrow(array: Any, mask: bool, name: str) -> Ragged:
    import pyarrow as pa

    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks() if array.num_chunks != 1 else array.chunk(0)
    if not isinstance(array, (pa.ListArray, pa.LargeListArray)):
        raise FastpackTypeError(
            f"{name}: expected a pyarrow list array (list<int>), got {type(array).__name__} "
            f"of type {array.type}"
        )
    # `.values` is the whole child array and `.offsets` index into it, sliced or not.
    child = array.values
    if child.null_count:
        raise FastpackError(f"{name}: the lists hold {child.null_count} null values")
    values = child.to_numpy(zero_copy_only=False)
    return Ragged(values, array.offsets.to_numpy(zero_copy_only=False), mask=mask)


def _from_dataset(dataset: Any, column: str, mask: bool, name: str = "column") -> Ragged:
    if column not in dataset.column_names:
        raise FastpackError(
            f"{name}: no column {column!r} in the dataset; it has "
            f"{', '.join(map(repr, dataset.column_names))}"
        )
    chunked = dataset.data.column(column)
    indices = getattr(dataset, "_indices", None)
    if indices is not None:  # after select/shuffle: rows are read through an index column
        import pyarrow.compute as pc

        chunked = pc.take(chunked, indices.column(0))
    return _from_arrow(chunked, mask, name)


TokenData = Union[Ragged, tuple[Any, Any], Sequence[Any], Any]


def as_ragged(
    data: TokenData, *, column: str = "input_ids", mask: bool = False, name: str = "data"
) -> Ragged:
    """Token data (or labels, or with ``mask=True`` a 0/1 loss mask) as :class:`Ragged`.

    Accepts a :class:`Ragged`; a ``(values, offsets)`` pair; a pyarrow ``ListArray`` /
    ``ChunkedArray``; a Hugging Face ``datasets.Dataset`` (its ``column``) or a column of
    one (``dataset["input_ids"]``), read from the Arrow buffers without per-row Python
    objects; or a sequence of per-row arrays or lists (concatenated once). ``name`` is the
    argument errors name.
    """
    if not isinstance(column, str):
        raise FastpackTypeError(f"column: expected a string, got {type(column).__name__}")
    if isinstance(data, Ragged):
        if mask and data.values.dtype != np.uint8:
            return Ragged(data.values, data.offsets, mask=True)
        return data
    if isinstance(data, tuple) and len(data) == 2:
        return Ragged(data[0], data[1], mask=mask)
    module = type(data).__module__
    if module.startswith("pyarrow"):
        return _from_arrow(data, mask, name)
    if module.startswith("datasets"):
        if hasattr(data, "column_names") and hasattr(data, "data"):
            return _from_dataset(data, column, mask, name)
        if hasattr(data, "source") and hasattr(data, "column_name"):
            return _from_dataset(data.source, data.column_name, mask, name)
    if isinstance(data, (str, bytes, dict)) or not isinstance(data, Sequence):
        raise FastpackTypeError(
            f"{name}: expected Ragged, (values, offsets), a pyarrow list array, a "
            f"datasets column or a sequence of sequences; got {type(data).__name__}"
        )
    return _from_rows(data, mask, name)


def _from_rows(rows: Sequence[Any], mask: bool, name: str = "data") -> Ragged:
    if isinstance(rows, list) and rows and isinstance(rows[0], list):
        try:  # lists of Python ints, read in Rust straight from the list objects
            values, offsets = _core.flatten_int_lists(rows, mask)
            return Ragged(values, offsets, mask=mask)
        except FastpackError:
            pass  # not all lists of ints: the general path below says what is wrong
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


def _ragged(values: Any, offsets: Any, mask: bool, name: str) -> Ragged:
    try:
        return Ragged(values, offsets, mask=mask)
    except FastpackError as e:  # name the argument the rows came from
        raise type(e)(f"{name}: {e}") from None


def _to_numpy(row: Any) -> np.ndarray:
    if type(row).__module__.startswith("torch"):
        row = row.detach().cpu().numpy()
    array = np.asarray(row).reshape(-1)
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


def _packs(plan: Plan, packs: PackIndex | None) -> np.ndarray:
    if packs is None:
        return np.arange(plan.num_packs, dtype=np.int64)
    return plan._packs(packs)


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
    if not isinstance(plan, Plan):
        raise FastpackTypeError(f"plan: expected a fastpack.Plan, got {type(plan).__name__}")
    layout = _choice("layout", layout, LAYOUTS)
    multiple = 1 if pad_to_multiple_of is None else _int_arg(
        "pad_to_multiple_of", pad_to_multiple_of, minimum=1, maximum=2**31 - 1
    )
    if pad_to is not None:
        pad_to = _int_arg("pad_to", pad_to, minimum=0, maximum=2**63 - 1)
    if separator_id is not None:
        separator_id = _int_arg("separator_id", separator_id, minimum=-(2**63),
                                maximum=2**63 - 1)
    train_separators = _bool_arg("train_separators", train_separators)
    pad_id = _int_arg("pad_id", pad_id, minimum=-(2**63), maximum=2**63 - 1)
    threads = _threads(threads)
    dataset = tokens if _is_dataset(tokens) else None
    token_data = as_ragged(tokens, name="tokens")
    label_data = _side(labels, dataset, mask=False, name="labels")
    mask_data = _side(loss_mask, dataset, mask=True, name="loss_mask")
    out: dict[str, Any] = _core.materialize(
        plan.sample_ids, plan.starts, plan.seqlens, plan.pack_offsets, plan.reserve,
        plan.strategy, plan.overlong, _packs(plan, packs),
        token_data.values, token_data.offsets,
        None if label_data is None else label_data.values,
        None if label_data is None else label_data.offsets,
        None if mask_data is None else mask_data.values,
        None if mask_data is None else mask_data.offsets,
        separator_id, train_separators, layout, pad_to, multiple, pad_id, threads,
    )
    shape = (out.pop("rows"), out.pop("width"))
    for key in ("input_ids", "position_ids", "labels", "seq_idx"):
        out[key] = out[key].reshape(shape)
    return out


def _is_dataset(obj: Any) -> bool:
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
    return as_ragged(data, mask=mask, name=name)
