"""`pack()` and the `Plan` it returns: a thin, typed layer over the Rust core."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from . import _core
from ._affinity import Affinity
from ._checks import _int_arg, _threads
from ._context_parallel import cp_rows, pack_for_context_parallel
from ._errors import FastpackError, FastpackTypeError
from ._options import OVERLONG_POLICIES, STRATEGIES, PackArgs, PackOptions, resolve

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["OVERLONG_POLICIES", "STRATEGIES", "Bucket", "LimitUse", "Plan", "pack", "sub_plan"]

# Below this many sequences one thread (the calling one) is as fast as two and skips
# waking the pool (medians, 2 cores: 3*10^4 SFT-like lengths 0.31 ms on 1 thread, 0.64 ms
# on 2; from about 10^5 both distributions gain from 2 threads: 3*10^5 2.2 vs 1.9 ms).
_SMALL_INPUT = 1 << 17

# Dtypes the core reads in place; anything else integral is converted once to int64.
_NATIVE_DTYPES = frozenset(
    np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                          np.uint64)
)

PackIndex = Union[int, slice, range, Sequence[int], np.ndarray]


# What a user who passed token rows instead of their lengths is told.
_TOKEN_LISTS = "this looks like token lists; pass the lengths (e.g. [len(x) for x in rows])"


def _is_row(value: Any) -> bool:
    """A sequence of tokens rather than one length: a list, tuple, array or tensor of any
    size other than a 0-d one."""
    if isinstance(value, (list, tuple)):
        return True
    shape = getattr(value, "shape", None)
    return shape is not None and len(shape) > 0


def _from_torch(tensor: Any, name: str) -> np.ndarray:
    import torch

    if tensor.device.type == "meta":
        raise FastpackError(
            f"{name}: got a tensor on the 'meta' device, which holds no values; pass the "
            f"lengths on the CPU (or on an accelerator, which is copied to the CPU)"
        )
    if tensor.is_floating_point() and tensor.dtype not in (torch.float32, torch.float64):
        # bfloat16 holds whole numbers exactly only up to 256, float16 up to 2048: the
        # lengths were rounded before they got here.
        raise FastpackTypeError(
            f"{name}: expected integers, got a {tensor.dtype} tensor, which cannot hold every "
            f"length exactly; keep the lengths in an integer tensor (e.g. lengths.long())"
        )
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor.contiguous().numpy()


def as_lengths(lengths: Any, name: str = "lengths") -> np.ndarray:
    """`lengths` as a 1-D contiguous integer numpy array, without a copy when it already
    is one (any integer dtype, numpy or torch). A tensor on an accelerator is copied to
    the CPU (one device-to-host copy); a meta tensor, or a float tensor narrower than
    float32, is refused."""
    if type(lengths).__module__.startswith("torch"):
        # Floating tensors go through the same whole-number check as numpy floats below.
        lengths = _from_torch(lengths, name)
    if isinstance(lengths, Iterator):  # a generator or map(...): read it once, in order
        lengths = list(lengths)
    if lengths is None or isinstance(lengths, (str, bytes, dict, set, frozenset)) or \
            np.isscalar(lengths):
        raise FastpackTypeError(
            f"{name}: expected a 1-D array-like of integers (numpy array, list, tuple, range, "
            f"iterator or tensor), got {type(lengths).__name__}"
        )
    # A masked array exists only once numpy.ma is loaded: importing it here (``np.ma``)
    # would cost the first pack() of a process ~8 ms.
    masked = sys.modules.get("numpy.ma")
    if masked is not None and isinstance(lengths, masked.MaskedArray):
        raise FastpackTypeError(
            f"{name}: got a masked array, whose masked entries would be read as lengths; pass "
            f"lengths.compressed() or lengths.filled(0)"
        )
    if isinstance(lengths, np.ndarray):
        array = lengths
    else:
        try:
            array = np.asarray(lengths)
        except ValueError:  # numpy refuses rows of different lengths
            if any(_is_row(v) for v in lengths):
                raise FastpackError(f"{name}: rows of different lengths; {_TOKEN_LISTS}") from None
            raise
    if array.ndim != 1:
        hint = ""
        if array.ndim == 2 and not isinstance(lengths, np.ndarray):
            hint = f"; {_TOKEN_LISTS}"
        raise FastpackError(f"{name}: expected a 1-D array, got shape {array.shape}{hint}")
    kind = array.dtype.kind
    if kind == "b":
        raise FastpackTypeError(f"{name}: expected integers, got booleans (dtype bool)")
    if kind in "iu":
        if array.dtype not in _NATIVE_DTYPES or not array.dtype.isnative:
            array = array.astype(np.int64)
    elif kind == "f" and array.dtype.itemsize < 4:
        raise FastpackTypeError(
            f"{name}: expected integers, got dtype {array.dtype}, which cannot hold every "
            f"length exactly; keep the lengths in an integer array"
        )
    elif kind == "f" or (kind == "O" and array.size == 0):
        array = _integral_floats(array.astype(np.float64), name)
    elif kind == "O":
        array = _integral_objects(array, name)
    else:
        raise FastpackTypeError(
            f"{name}: expected integers, got dtype {array.dtype} ({type(lengths).__name__})"
        )
    return np.ascontiguousarray(array)


def _integral_floats(array: np.ndarray, name: str) -> np.ndarray:
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    bad = ~np.isfinite(array) | (array != np.floor(array))
    if bad.any():
        i = int(np.argmax(bad))
        raise FastpackError(
            f"{name}: {float(array[i])!r} at index {i} is not a whole number; lengths must be "
            f"non-negative integers"
        )
    if array.max() >= 2.0**63:
        raise FastpackError(f"{name}: {float(array.max())!r} does not fit in int64")
    return array.astype(np.int64)


def _integral_objects(array: np.ndarray, name: str) -> np.ndarray:
    for i, value in enumerate(array):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            if isinstance(value, (float, np.floating)) and float(value).is_integer():
                continue
            if _is_row(value):
                raise FastpackError(
                    f"{name}: element {i} is a {type(value).__name__} of values; {_TOKEN_LISTS}"
                )
            raise FastpackTypeError(
                f"{name}: element {i} is {type(value).__name__} {value!r}; expected integers"
            )
    try:
        return array.astype(np.int64)
    except OverflowError as e:
        raise FastpackError(f"{name}: a length does not fit in int64 ({e})") from None


def _readonly(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


# Each array of a plan and its dtype (see `Plan`).
_ARRAYS: dict[str, type[np.signedinteger[Any]]] = {
    "sample_ids": np.int64, "starts": np.int64, "seqlens": np.int32, "pack_offsets": np.int64,
    "pack_caps": np.int32, "group_offsets": np.int64, "group_fills": np.int64,
    "parents": np.int64, "path_sample_ids": np.int64, "path_ends": np.int64,
}


def _plan_array(name: str, value: Any) -> np.ndarray:
    """A plan array given by Python code or a user, as the 1-D contiguous array of its dtype
    (no copy when it already is one)."""
    dtype = np.dtype(_ARRAYS[name])
    array = value if isinstance(value, np.ndarray) else np.asarray(value)
    if array.ndim != 1:
        raise FastpackError(f"{name}: expected a 1-D array, got shape {array.shape}")
    if array.dtype != dtype:
        if array.size and array.dtype.kind not in "iu":
            raise FastpackTypeError(f"{name}: expected integers, got dtype {array.dtype}")
        bounds = np.iinfo(_ARRAYS[name])
        if array.size and (array.min() < bounds.min or array.max() > bounds.max):
            raise FastpackError(f"{name}: a value does not fit in {dtype}")
        array = array.astype(dtype)
    return np.ascontiguousarray(array)


# What `_with_metrics` computes (with the buckets' and the groups').
_METRICS = ("total_tokens", "lower_bound", "efficiency")


def _with_metrics(fields: dict[str, Any]) -> dict[str, Any]:
    """The fields of a plan assembled in Python (a step's sub-plan, shards joined, a
    stream's window restored), with every metric (``total_tokens``, ``lower_bound``,
    ``efficiency``, the buckets' and the groups') computed by the core from its arrays,
    as for the plans the core makes; metrics given in ``fields`` are replaced. The arrays
    are checked first (``pack_offsets`` from 0, non-decreasing, ending at the number of
    segments; ``pack_caps``; ``group_offsets``): a bad one raises a FastpackError naming
    it. Each bucket's ``num_sequences`` (an input count the arrays cannot give) comes
    from ``fields["buckets"]``, else, with one bucket, from the plan's counts."""
    if not isinstance(fields, Mapping):
        raise FastpackTypeError(
            f"fields: expected a dict of the plan's arrays and counts, got {type(fields).__name__}"
        )
    needed = [name for name in Plan._FIELDS if name not in _METRICS]
    missing = [name for name in needed if name not in fields]
    if missing:
        raise FastpackError(
            f"fields: missing {', '.join(map(repr, missing))}; a plan needs "
            f"{', '.join(map(repr, needed))} (its metrics are computed)"
        )
    fields = dict(fields)
    fields["max_len"] = _int_arg("max_len", fields["max_len"], minimum=1)
    for name in ("long_max_len", "group_tokens"):
        if fields.get(name) is not None:
            fields[name] = _int_arg(name, fields[name], minimum=1)
    for name in _ARRAYS:
        if fields.get(name) is not None:
            fields[name] = _plan_array(name, fields[name])
    segments = len(fields["seqlens"])
    for name in ("sample_ids", "starts", *(("parents",) if fields.get("parents") is not None
                                           else ())):
        if len(fields[name]) != segments:
            raise FastpackError(
                f"{name}: has {len(fields[name])} entries; seqlens has {segments} (one per "
                f"segment)"
            )
    long_max_len = fields.get("long_max_len")
    buckets = fields.get("buckets") or ()
    if buckets:
        sequences = [int(b["num_sequences"]) for b in buckets]
    elif long_max_len is None:
        sequences = [int(fields["num_sequences"]) - int(fields["empty_sequences"])]
    else:
        raise FastpackError(
            "buckets: a plan with long_max_len needs each bucket's num_sequences"
        )
    metrics = _core.plan_metrics(
        fields["seqlens"], fields["pack_offsets"], fields["max_len"], sequences,
        fields.get("pack_caps"), long_max_len, fields.get("group_offsets"),
        fields.get("group_tokens"),
    )
    fields.update(metrics)
    return fields


@dataclass(frozen=True)
class Bucket:
    """One bucket of a plan: packs of one cap. A plan has the short bucket (``max_len``)
    and, with ``long_max_len``, the long one. The metrics come from the core."""

    name: str
    max_len: int
    #: Non-empty input sequences routed here (before the bucket's over-long policy).
    num_sequences: int
    num_packs: int
    total_tokens: int
    #: ``ceil(total_tokens / max_len)``.
    lower_bound: int
    #: ``total_tokens / (num_packs * max_len)``; 1.0 for an empty bucket.
    efficiency: float


@dataclass(frozen=True)
class LimitUse:
    """How a plan uses one budget besides tokens (``pack(..., limits=...)``)."""

    name: str
    #: The most any pack holds.
    cap: int
    #: Sum over the packed sequences.
    total: int
    #: ``ceil(total / cap)``: no plan can use fewer packs.
    lower_bound: int
    #: The fullest pack's use (at most ``cap``).
    max_used: int


def _limit_values(spec: Any) -> tuple[dict[str, Any] | Any, dict[str, np.ndarray] | None]:
    """``limits={name: (values, cap)}`` split into the caps (the option) and the values
    (int64, one per sequence); any other ``limits`` is left to the option's check."""
    if not isinstance(spec, Mapping) or not any(
            isinstance(v, (tuple, list)) for v in spec.values()):
        return spec, None
    caps: dict[str, Any] = {}
    values: dict[str, np.ndarray] = {}
    for name, pair in spec.items():
        arg = f"limits[{name!r}]"
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or np.isscalar(pair[0]):
            raise FastpackTypeError(
                f"{arg}: expected (values, cap): one value per sequence and the most a pack "
                f"holds, got {type(pair).__name__} {pair!r}"
            )
        values[name] = np.ascontiguousarray(as_lengths(pair[0], name=arg), dtype=np.int64)
        caps[name] = pair[1]
    return caps, values


class Plan:
    """A packing plan: which segment of which sequence goes into which pack.

    Flat CSR arrays (numpy, read-only, moved out of Rust without a copy):

    - ``sample_ids`` (int64 [S]): the input sequence each segment comes from,
    - ``starts`` (int64 [S]): the segment's token offset inside its sequence,
    - ``seqlens`` (int32 [S]): tokens the segment occupies, its reserved separator slots
      included,
    - ``pack_offsets`` (int64 [P+1]): pack ``p`` holds segments
      ``pack_offsets[p]:pack_offsets[p+1]``.

    With ``long_max_len`` (buckets), ``pack_caps`` (int32 [P]) gives each pack's cap, and
    ``buckets`` each bucket's packs, tokens and efficiency. ``max_len`` stays the short cap.
    Packs come short first, then long; shuffled, they are interleaved.

    With ``group_tokens`` (two-level packing), packs are ordered so that each group's packs
    are contiguous: group ``g`` holds packs ``group_offsets[g]:group_offsets[g+1]``
    (int64 [G+1]) and ``group_fills[g]`` tokens (int64 [G]), at most ``group_tokens``.
    Groups never mix buckets; shuffled, the groups are shuffled and packs stay in their
    group.

    With ``limits`` (budgets besides tokens), ``limits`` maps each budget's name to its
    :class:`LimitUse`: the packed total, the cap, the lower bound ``ceil(total / cap)``
    and the fullest pack. A plan built from arrays (``Plan(fields)``) has none.

    Every metric (``lower_bound``, ``efficiency``, the buckets' and the groups') is computed
    by the core with the plan; a *fill* is the number of tokens a pack or group holds.

    A plan of shared-prefix trees (:func:`fastpack.pack_trees`) adds ``parents`` (int64
    [S]: the segment whose tokens precede this one in its sample, ``-1`` for a root; a
    segment's ``starts`` is then its first token's position in its sample, where it
    continues its parent) and its *paths*: sample ``path_sample_ids[j]`` ends at segment
    ``path_ends[j]`` (int64 [M], ascending), and is the segments from a root to there.
    Every kept sample is exactly one path; a shared segment is in several.
    ``sample_tokens`` counts the tokens of the kept samples in full (what packing them
    without sharing would compute), ``total_tokens`` the tokens the plan computes.
    """

    _FIELDS = (
        "sample_ids", "starts", "seqlens", "pack_offsets", "max_len", "reserve", "strategy",
        "overlong", "num_sequences", "empty_sequences", "dropped_sequences", "dropped_tokens",
        "truncated_sequences", "truncated_tokens", "split_sequences", "total_tokens",
        "lower_bound", "efficiency",
    )
    _OPTIONAL = (
        "long_max_len", "group_tokens", "group_offsets", "group_fills", "group_lower_bound",
        "group_efficiency", "cp_size", "cp_mode", "pad_multiple", "parents",
        "path_sample_ids", "path_ends", "sample_tokens",
    )

    __slots__ = (*_FIELDS, *_OPTIONAL, "buckets", "limits", "affinity", "_pack_caps", "_options",
                 "_order")

    sample_ids: np.ndarray
    starts: np.ndarray
    seqlens: np.ndarray
    pack_offsets: np.ndarray
    max_len: int
    reserve: int
    strategy: str
    overlong: str
    num_sequences: int
    empty_sequences: int
    dropped_sequences: int
    dropped_tokens: int
    truncated_sequences: int
    truncated_tokens: int
    split_sequences: int
    total_tokens: int
    #: ``ceil(total_tokens / max_len)``: no plan can use fewer packs. With buckets, the sum
    #: of each bucket's bound (packs never mix buckets).
    lower_bound: int
    #: ``total_tokens / (num_packs * max_len)``; with buckets, over each pack's own cap:
    #: ``total_tokens / sum(pack_caps)``. 1.0 for an empty plan.
    efficiency: float
    #: Cap of the long bucket, or None without buckets.
    long_max_len: int | None
    #: The token budget of a group (the ``group_tokens`` argument), or None without groups.
    group_tokens: int | None
    group_offsets: np.ndarray | None
    #: Tokens in each group (int64 [G]), or None without groups.
    group_fills: np.ndarray | None
    #: Fewest groups possible: per bucket ``ceil(total_tokens / group_tokens)``, summed.
    group_lower_bound: int | None
    #: ``total_tokens / (num_groups * group_tokens)``, or None without groups.
    group_efficiency: float | None
    #: The context-parallel group the plan was made for (``cp_size``, ``cp_mode``,
    #: ``pad_multiple`` of :class:`fastpack.PackOptions`): every pack fits ``max_len`` once
    #: padded for it. None for a plain plan.
    cp_size: int | None
    cp_mode: str | None
    pad_multiple: int | None
    #: Trees (see the class docs): each segment's parent, or None for a plan of sequences.
    parents: np.ndarray | None
    path_sample_ids: np.ndarray | None
    path_ends: np.ndarray | None
    sample_tokens: int | None
    buckets: tuple[Bucket, ...]
    #: Each budget besides tokens, by name (empty without ``limits``).
    limits: dict[str, LimitUse]
    #: How related the packs are under the keys given as ``pack(..., affinity=keys)``
    #: (see :class:`fastpack.Affinity`); None for a plan made without keys.
    affinity: Affinity | None
    _pack_caps: np.ndarray | None
    _options: PackOptions | None
    #: ``(shuffle, seed)`` of a plan assembled from its fields.
    _order: tuple[bool, int]

    def __init__(self, fields: dict[str, Any]) -> None:
        """A plan from its fields (the arrays and counts above). Every metric is computed
        by the core from the arrays, after checking them (see ``_with_metrics``); metrics
        in ``fields`` are not read, nor ``limits`` (the budgets' values are not in the
        arrays)."""
        fields = _with_metrics(fields)
        fields.pop("limits", None)
        fields.pop("affinity", None)
        self._set(fields)
        self._options = None
        self._order = (bool(fields.get("shuffle", False)), int(fields.get("seed", 0)))

    @classmethod
    def _from_core(cls, fields: dict[str, Any], options: PackOptions | None = None) -> Plan:
        """The plan the core made (with ``options``): its arrays and metrics are taken as
        they are."""
        plan = cls.__new__(cls)
        plan._set(fields)
        plan._options = options
        plan._order = (False, 0) if options is None else (options.shuffle, options.seed)
        return plan

    def _set(self, fields: dict[str, Any]) -> None:
        for name in self._FIELDS:
            value = fields[name]
            setattr(self, name, _readonly(value) if isinstance(value, np.ndarray) else value)
        for name in self._OPTIONAL:
            value = fields.get(name)
            setattr(self, name, _readonly(value) if isinstance(value, np.ndarray) else value)
        caps = fields.get("pack_caps")
        self._pack_caps = None if caps is None else _readonly(caps)
        names = ("short", "long")
        self.buckets = tuple(
            Bucket(name=names[i], **b) for i, b in enumerate(fields.get("buckets", ()))
        )
        self.limits = {u["name"]: LimitUse(**u) for u in fields.get("limits", ())}
        found = fields.get("affinity")
        self.affinity = None if found is None else Affinity(**found)

    @property
    def options(self) -> PackOptions:
        """The :class:`fastpack.PackOptions` the plan was made with; two plans made with
        equal options (on any number of threads) from equal lengths are equal. A plan
        assembled from its arrays (``Plan(fields)``) has the options its fields record;
        its ``shuffle`` and ``seed`` are ``fields["shuffle"]``/``fields["seed"]`` when
        given, else ``False`` and 0 (its packs are in the order given)."""
        if self._options is None:
            shuffle, seed = self._order
            self._options = PackOptions(
                self.max_len, strategy=self.strategy, overlong=self.overlong,
                reserve=self.reserve, shuffle=shuffle, seed=seed,
                long_max_len=self.long_max_len, group_tokens=self.group_tokens,
                cp_size=self.cp_size, cp_mode=self.cp_mode or "zigzag",
                pad_multiple=self.pad_multiple or 1, share_prefix=self.parents is not None,
            )
        return self._options

    @property
    def num_packs(self) -> int:
        return len(self.pack_offsets) - 1

    @property
    def pad_tokens(self) -> int:
        """Tokens of padding context parallelism adds when each pack is one row (0 for a
        plain plan): zigzag pads every segment to a multiple of ``2·cp·pad_multiple``, the
        contiguous modes every pack to a multiple of ``cp·pad_multiple``. Not in
        ``total_tokens`` (the real ones); every padded pack fits ``max_len``."""
        if self.cp_size is None:
            return 0
        padded, _ = cp_rows(self, self.seqlens, self.pack_offsets, work=False)
        return int(padded.sum()) - self.total_tokens

    @property
    def num_segments(self) -> int:
        return len(self.seqlens)

    def __len__(self) -> int:
        return self.num_packs

    @property
    def pack_caps(self) -> np.ndarray:
        """Each pack's cap (int32 [P]): ``max_len``, or ``long_max_len`` for long packs."""
        if self._pack_caps is None:
            return _readonly(np.full(self.num_packs, self.max_len, dtype=np.int32))
        return self._pack_caps

    @property
    def num_groups(self) -> int:
        """Level-2 groups; 0 when the plan was made without ``group_tokens``."""
        return 0 if self.group_offsets is None else len(self.group_offsets) - 1

    def _group(self, group: int) -> int:
        if self.group_offsets is None:
            raise FastpackError("group: the plan has no groups; pass group_tokens= to pack()")
        g = _int_arg("group", group, minimum=-self.num_groups, maximum=self.num_groups - 1)
        return g % self.num_groups

    def group_packs(self, group: int) -> range:
        """The packs of one group (contiguous)."""
        g = self._group(group)
        assert self.group_offsets is not None
        return range(int(self.group_offsets[g]), int(self.group_offsets[g + 1]))

    def group_cu_seqlens(self, group: int) -> np.ndarray:
        """``cu_seqlens`` (int32) of one group as one varlen row, at sequence granularity."""
        return self.cu_seqlens(self.group_packs(group))

    def group_varlen(
        self, group: int, *, threads: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(cu_seqlens, position_ids)`` of one group as one varlen row."""
        return self.varlen(self.group_packs(group), threads=threads)

    @property
    def pack_fills(self) -> np.ndarray:
        """Tokens in each pack (int64 [P]), from ``seqlens`` and ``pack_offsets``."""
        cumulative = np.concatenate(([0], np.cumsum(self.seqlens, dtype=np.int64)))
        return np.diff(cumulative[self.pack_offsets])

    def _packs(self, packs: PackIndex | None) -> np.ndarray:
        """Pack indices as int64 (``None``: every pack, in plan order): the one reading of
        a ``packs`` argument (``cu_seqlens``, ``materialize``, ``gather``)."""
        n = self.num_packs
        if packs is None:
            return np.arange(n, dtype=np.int64)
        if isinstance(packs, (bool, np.bool_)):
            raise FastpackTypeError("packs: expected an int, slice, range or array of ints")
        if isinstance(packs, (int, np.integer)):
            p = int(packs)
            if not -n <= p < n:
                raise FastpackError(f"packs: pack {p} out of range; the plan has {n} packs")
            return np.array([p % n], dtype=np.int64)
        if isinstance(packs, slice):
            return np.arange(n, dtype=np.int64)[packs]
        if isinstance(packs, range):
            return np.asarray(packs, dtype=np.int64)
        index = np.asarray(packs)
        if index.ndim != 1 or (index.size and index.dtype.kind not in "iu"):
            raise FastpackTypeError("packs: expected an int, slice, range or 1-D array of ints")
        return np.ascontiguousarray(index, dtype=np.int64)

    def segments(self, pack: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(sample_ids, starts, seqlens)`` of one pack, as views."""
        p = int(self._packs(pack)[0])
        lo, hi = int(self.pack_offsets[p]), int(self.pack_offsets[p + 1])
        return self.sample_ids[lo:hi], self.starts[lo:hi], self.seqlens[lo:hi]

    def cu_seqlens(self, packs: PackIndex) -> np.ndarray:
        """``cu_seqlens`` (int32, from 0) of one pack, or of several laid end to end as one
        varlen row (boundaries at every segment)."""
        return _core.cu_seqlens(self.seqlens, self.pack_offsets, self._packs(packs))

    def position_ids(self, packs: PackIndex) -> np.ndarray:
        """Position ids (int64) restarting at 0 in every segment."""
        return self.varlen(packs)[1]

    def varlen(
        self, packs: PackIndex, *, threads: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(cu_seqlens, position_ids)`` for ``packs`` in one Rust call."""
        return _core.varlen(
            self.seqlens, self.pack_offsets, self._packs(packs), _threads(threads)
        )

    def summary(self) -> str:
        """A few lines a person can read: packs, efficiency and every token not packed."""
        lines = [
            f"{self.num_sequences:,} sequences -> {self.num_packs:,} packs of {self.max_len:,} "
            f"tokens ({self.strategy}, overlong={self.overlong!r})",
            f"tokens packed: {self.total_tokens:,}; efficiency {self.efficiency:.4%}; "
            f"packs / lower bound {self.num_packs}/{self.lower_bound}",
        ]
        if self.long_max_len is not None:
            for b in self.buckets:
                lines.append(
                    f"  {b.name} bucket (cap {b.max_len:,}): {b.num_sequences:,} sequences, "
                    f"{b.num_packs:,} packs, efficiency {b.efficiency:.4%}, "
                    f"lower bound {b.lower_bound:,}"
                )
        for use in self.limits.values():
            lines.append(
                f"{use.name}: {use.total:,} in all, at most {use.cap:,} per pack (fullest "
                f"{use.max_used:,}); packs / lower bound {self.num_packs}/{use.lower_bound}"
            )
        if self.affinity is not None:
            a = self.affinity
            lines.append(
                f"affinity: {a.num_keys:,} keys; token pairs of one key in a pack "
                f"{a.same_key_share:.2%} (random packing {a.random_share:.2%}); packs of one "
                f"key {a.pure_packs:.2%}; packs {self.num_packs:,} vs plain best fit "
                f"{a.bfd_packs:,}"
            )
        if self.group_fills is not None:
            fills = self.group_fills
            spread = (
                f"tokens per group min/median/max {int(fills.min()):,}/"
                f"{int(np.median(fills)):,}/{int(fills.max()):,}" if fills.size else "no tokens"
            )
            lines.append(
                f"groups of <= {self.group_tokens:,} tokens: {self.num_groups:,} "
                f"(lower bound {self.group_lower_bound:,}); group efficiency "
                f"{self.group_efficiency:.4%}; {spread}"
            )
        lost = []
        if self.dropped_sequences:
            lost.append(f"dropped {self.dropped_tokens:,} tokens "
                        f"({self.dropped_sequences:,} sequences)")
        if self.truncated_sequences:
            lost.append(f"truncated {self.truncated_tokens:,} tokens "
                        f"({self.truncated_sequences:,} sequences)")
        if self.split_sequences:
            lost.append(f"split {self.split_sequences:,} sequences (no token lost)")
        if self.sample_tokens is not None:
            ratio = self.sample_tokens / self.total_tokens if self.total_tokens else 1.0
            lines.append(
                f"shared prefixes: {self.sample_tokens:,} sample tokens computed as "
                f"{self.total_tokens:,} ({ratio:.2f}x fewer)"
            )
        if self.empty_sequences:
            lost.append(f"skipped {self.empty_sequences:,} empty sequences")
        if self.cp_size is not None:
            pads = self.pad_tokens
            share = pads / max(self.total_tokens + pads, 1)
            lines.append(f"context parallel: cp_size={self.cp_size}, {self.cp_mode}, "
                         f"pad_multiple={self.pad_multiple}: {pads:,} pad tokens "
                         f"({share:.2%} of the padded packs)")
        if lost:
            lines.append("; ".join(lost))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"Plan(num_packs={self.num_packs}, num_segments={self.num_segments}, "
            f"max_len={self.max_len}, strategy={self.strategy!r}, "
            f"efficiency={self.efficiency:.4f}, lower_bound={self.lower_bound}, "
            f"dropped_tokens={self.dropped_tokens}, truncated_tokens={self.truncated_tokens}"
            + (f", long_max_len={self.long_max_len}" if self.long_max_len is not None else "")
            + (f", num_groups={self.num_groups}" if self.group_tokens is not None else "")
            + (f", limits={sorted(self.limits)}" if self.limits else "")
            + ")"
        )


def sub_plan(plan: Plan, p0: int, p1: int, lo: int | None = None, hi: int | None = None,
             sample_ids: np.ndarray | None = None) -> Plan:
    """Packs ``p0:p1`` of ``plan`` -- or segments ``lo:hi`` of them (a piece of a step may
    cut a pack) -- as a plan of their own: the one way to take part of a plan (a step's
    batch, the packs a gather pass or a Ray task writes). Arrays are views where they can
    be; ``sample_ids`` renames the segments' samples (the rows of the data they are
    gathered from; default: the plan's ids, indexing the whole input).

    The part keeps the plan's options (caps, reserve, strategy, policy, shuffle, seed and
    the context-parallel group) and each pack's cap, has no groups, and counts only what
    it holds: each of its segments is one of its sequences (a piece of a split sample
    trains as a sequence), in the bucket of its pack; what planning lost (empty, dropped,
    truncated and split sequences) is the whole plan's to report, so a part counts none.
    Its metrics are its own, computed by the core from its arrays. A part of a plan of
    trees holds whole trees (a cut inside one raises) and the paths that end in it."""
    bounds = np.asarray(plan.pack_offsets[p0 : p1 + 1], dtype=np.int64)
    lo = int(bounds[0]) if lo is None else lo
    hi = int(bounds[-1]) if hi is None else hi
    inner = bounds[(bounds > lo) & (bounds < hi)]
    offsets = np.concatenate(([lo], inner, [hi])).astype(np.int64) - lo
    ids = plan.sample_ids[lo:hi] if sample_ids is None else sample_ids
    fields = _part_fields(plan, ids, plan.starts[lo:hi], plan.seqlens[lo:hi], offsets)
    if plan.long_max_len is not None:
        # The pack of the whole plan each of the part's packs is (a piece of).
        parents = p0 + np.searchsorted(bounds - lo, offsets[:-1], side="right") - 1
        fields.update(_part_caps(plan, parents, offsets))
    if plan.parents is not None:
        fields.update(_sub_trees(plan, lo, hi))
    return Plan(fields)


def select_plan(plan: Plan, segments: np.ndarray) -> Plan:
    """Segments ``segments`` of ``plan`` (ascending, from any packs and steps) as a plan
    of their own, as :func:`sub_plan` takes a range: each pack keeps the selected
    segments it holds (a micro-batch of a global step is such a selection). Not for a
    plan of trees (a selection may cut one)."""
    if plan.parents is not None:
        raise FastpackError("segments: a selection of segments would cut a plan's trees; "
                            "take a range with sub_plan")
    segments = np.asarray(segments, dtype=np.int64)
    packs = np.searchsorted(np.asarray(plan.pack_offsets), segments, side="right") - 1
    starts = np.flatnonzero(np.diff(packs)) + 1
    offsets = np.concatenate(([0], starts, [len(segments)])).astype(np.int64)
    fields = _part_fields(plan, plan.sample_ids[segments], plan.starts[segments],
                          plan.seqlens[segments], offsets)
    if plan.long_max_len is not None:
        fields.update(_part_caps(plan, packs[offsets[:-1]], offsets))
    return Plan(fields)


def _part_caps(plan: Plan, parents: np.ndarray, offsets: np.ndarray) -> dict[str, Any]:
    """A part's pack caps and buckets, from the whole plan's packs it takes from."""
    caps = np.ascontiguousarray(plan.pack_caps[parents], dtype=np.int32)
    segments = np.repeat(caps, np.diff(offsets))
    return {"pack_caps": caps,
            "buckets": [{"num_sequences": int(np.count_nonzero(segments == b.max_len))}
                        for b in plan.buckets]}


def _part_fields(plan: Plan, ids: np.ndarray, starts: np.ndarray, seqlens: np.ndarray,
                 offsets: np.ndarray) -> dict[str, Any]:
    """The fields of a part of ``plan`` (its options, its own counts)."""
    return {
        "sample_ids": ids, "starts": starts, "seqlens": seqlens,
        "pack_offsets": offsets, "num_sequences": len(seqlens), "empty_sequences": 0,
        "dropped_sequences": 0, "dropped_tokens": 0, "truncated_sequences": 0,
        "truncated_tokens": 0, "split_sequences": 0,
        **{name: getattr(plan.options, name) for name in (
            "max_len", "reserve", "strategy", "overlong", "long_max_len", "shuffle", "seed")},
        "cp_size": plan.cp_size, "cp_mode": plan.cp_mode, "pad_multiple": plan.pad_multiple,
    }


def _sub_trees(plan: Plan, lo: int, hi: int) -> dict[str, Any]:
    """The tree arrays of segments ``lo:hi`` (whole trees: a cut inside one raises)."""
    assert plan.parents is not None and plan.path_ends is not None
    assert plan.path_sample_ids is not None
    parents = np.asarray(plan.parents[lo:hi], dtype=np.int64)
    if len(parents) and (parents[0] >= 0 or np.any((parents >= 0) & (parents < lo))):
        raise FastpackError(
            f"segments: {lo}..{hi} cuts through a tree (a segment's parent lies outside); a "
            f"plan of trees is cut only where a tree begins"
        )
    a, b = (int(x) for x in np.searchsorted(plan.path_ends, (lo, hi)))
    ends = np.asarray(plan.path_ends[a:b], dtype=np.int64)
    return {
        "num_sequences": b - a,  # a tree's sequences are its paths
        "parents": np.where(parents >= 0, parents - lo, -1),
        "path_sample_ids": plan.path_sample_ids[a:b], "path_ends": ends - lo,
        "sample_tokens": int((np.asarray(plan.starts)[ends]
                              + np.asarray(plan.seqlens)[ends]).sum()),
    }


#: The options :func:`pack` cannot honour (it plans lengths).
PACK_REFUSES = {
    "share_prefix": "trees are found from the samples' tokens, and pack() plans lengths; "
                    "use fastpack.pack_trees(tokens, ...)",
}


def pack(
    lengths: Any,
    max_len: int | None = None,
    *,
    options: PackOptions | None = None,
    threads: int | None = None,
    affinity: Any = None,
    **kwargs: Unpack[PackArgs],
) -> Plan:
    """Pack sequences of the given token ``lengths`` into packs of at most ``max_len``.

    Args:
        lengths: 1-D integers: a numpy array (any integer dtype; int32/int64/uint16/uint32
            and the other native widths are read in place), a list, an iterator, or a torch
            tensor (one on an accelerator is copied to the CPU once; meta tensors and
            float16/bfloat16 ones, which cannot hold every length, are refused). Whole-number
            floats are accepted. Token rows instead of lengths are refused, saying so.
        max_len: tokens per pack.
        options: a :class:`fastpack.PackOptions`, instead of (or agreeing with) ``max_len``
            and the keywords.
        threads: worker threads (default: ``RAYON_NUM_THREADS`` or all cores; one for
            fewer than 2^17 lengths). ``threads=1`` runs on the calling thread. The plan
            does not depend on it.
        affinity: a key per sequence (non-negative integers: a cluster id from embeddings,
            a MinHash bucket, a URL domain hashed): best fit that packs sequences of one key
            together where that keeps the plan's efficiency within 0.1% of plain best fit
            (at most ``bfd_packs + bfd_packs // 1000`` packs). Strategy ``"bfd"`` only,
            without ``long_max_len``, ``group_tokens``, ``limits`` or ``cp_size``. The plan's
            :attr:`Plan.affinity` says how related its packs are, against a random packing.
        **kwargs: the other packing options, as keywords (see :class:`fastpack.PackOptions`):

            - ``strategy``: ``"bfd"`` best-fit decreasing (fewest packs), ``"ffd"``
              first-fit decreasing, ``"next_fit"`` (keeps input order), ``"wrapped"``
              (concatenate and cut every ``max_len`` tokens; ``overlong`` does not apply),
              ``"one_per_pack"`` (every sequence, or piece of a split one, in a pack of its
              own, in input order: the padded baseline).
            - ``overlong``: what to do with a sequence longer than ``max_len - reserve``:
              ``"error"`` (raise, giving how many and the first index), ``"truncate"``,
              ``"split"`` into pieces each packed on its own, or ``"drop"``. Every dropped
              or truncated token is counted in the plan.
            - ``reserve``: tokens to reserve after every sequence (say an EOS inserted
              later), so no pack overflows once they are added. ``seqlens`` include them.
            - ``shuffle``: shuffle the pack order (default; the same order for the same
              ``seed``). ``shuffle=False`` keeps the packs as placed: roughly sorted by
              size for ``"bfd"``/``"ffd"`` (which hurts training), in input order for the
              others.
            - ``seed``: the shuffle's seed (0 to 2**64 - 1).
            - ``long_max_len``: a second, long bucket: sequences longer than ``max_len -
              reserve`` are packed separately into packs of ``long_max_len`` (``overlong``
              then applies against ``long_max_len``), so no pack mixes short and long
              sequences. See ``Plan.pack_caps`` and ``Plan.buckets``.
            - ``group_tokens``: two-level packing: bin-pack the packs, by their tokens, into
              groups of at most ``group_tokens`` (at least the largest pack cap), so every
              group (a step or micro-batch) carries nearly the same number of tokens. See
              ``Plan.group_offsets``, ``Plan.group_fills`` and ``Plan.group_cu_seqlens``.
            - ``cp_size``, ``cp_mode``, ``pad_multiple``: plan for context parallelism over
              ``cp_size`` ranks (see :func:`fastpack.cp_layout`): packs are planned on their
              padded lengths, so none exceeds ``max_len`` (or ``long_max_len``) once padded
              — zigzag pads every sequence to a multiple of ``2·cp_size·pad_multiple``, the
              contiguous modes a pack to a multiple of ``cp_size·pad_multiple``. The plan's
              ``seqlens`` and counts stay the real tokens; ``Plan.pad_tokens`` counts the
              padding.
            - ``limits``: budgets besides tokens, ``{name: (values, cap)}`` (at most 4):
              sequence ``i`` needs ``values[i]`` of the budget and no pack holds more than
              ``cap`` — say ``{"patches": (patches, 16384), "images": (images, 8)}`` for a
              vision-language dataset (see :func:`fastpack.vlm.media_tokens`). Best/first
              fit on tokens among the packs with room in every budget; a sequence is never
              cut (``overlong`` ``"error"`` or ``"drop"``, counted). ``Plan.limits`` gives
              each budget's lower bound. With ``options`` holding the caps, ``limits`` here
              gives the values (and the same caps).

    Sequences of length 0 are skipped and counted in ``empty_sequences``.
    """
    array = as_lengths(lengths)
    values = None
    if "limits" in kwargs:
        caps, values = _limit_values(kwargs["limits"])
        kwargs = {**kwargs, "limits": caps}  # type: ignore[typeddict-item]
    opts = resolve(pack, options, max_len, kwargs, refuse=PACK_REFUSES)
    budgets = None
    if opts.budgets:
        if values is None:
            raise FastpackError(
                f"limits: {dict(opts.budgets)} has no values per sequence; pass limits={{name: "
                f"(values, cap)}} to pack()"
            )
        budgets = [(name, values[name], cap) for name, cap in opts.budgets]
    threads = _threads(threads)
    if threads is None and len(array) < _SMALL_INPUT:
        threads = 1  # waking a pool costs more than it saves here; the plan is the same
    if affinity is not None:
        from ._affinity import pack_affinity

        return Plan._from_core(pack_affinity(array, affinity, opts, threads), opts)
    if opts.cp_size is not None:
        plan = Plan(pack_for_context_parallel(array, opts, threads))
        plan._options = opts
        return plan
    fields = _core.pack(
        array, opts.max_len, opts.strategy, opts.overlong, opts.reserve,
        opts.seed if opts.shuffle else None, threads, None, opts.long_max_len,
        opts.group_tokens, budgets,
    )
    return Plan._from_core(fields, opts)


def flat_plan(plan: object, instead: str, name: str = "plan") -> Plan:
    """``plan`` if it is a plan of flat rows; a plan of shared-prefix trees raises with
    ``instead`` (why its rows cannot be made this way, and what makes them)."""
    if not isinstance(plan, Plan):
        raise FastpackTypeError(f"{name}: expected a fastpack.Plan, got {type(plan).__name__}")
    if plan.parents is not None:
        raise FastpackError(f"{name}: a plan of shared-prefix trees {instead}")
    return plan
