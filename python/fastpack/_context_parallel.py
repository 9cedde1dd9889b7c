"""Context parallelism (CP): which positions of a packed row each rank of a CP group
holds, computed once in Rust (``rust/fastpack-core/src/context_parallel.rs``).

:func:`cp_layout` takes a row's real ``cu_seqlens`` and returns a :class:`CPLayout`: both
``cu_seqlens`` forms, and for every rank its indices into the padded row, its pads, its
positions and the metadata its attention kernel reads. The arrays match the contracts of
TransformerEngine (zigzag), ring-flash-attn (llama3 / contiguous) and Ulysses exactly;
docs/context_parallel.md says which array is which contract's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from . import _core
from ._checks import _int_arg, _threads
from ._errors import FastpackError, FastpackTypeError
from ._options import CP_MODES, check_cp, cp_divisor

if TYPE_CHECKING:
    from ._options import PackOptions

__all__ = ["CP_MODES", "CPLayout", "RankLayout", "cp_layout"]


def as_cu_seqlens(value: Any, name: str = "cu_seqlens") -> np.ndarray:
    """``value`` (a tensor on any device, an array or a list of ints) as a contiguous int32
    numpy array; the values are checked by the core."""
    if type(value).__module__.startswith("torch"):
        value = value.detach().to("cpu").numpy()
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as e:
        raise FastpackTypeError(f"{name}: expected a 1-D array of integers ({e})") from None
    if array.ndim != 1:
        raise FastpackError(f"{name}: expected a 1-D array [N+1], got shape {array.shape}")
    if array.size and array.dtype.kind not in "iu":
        raise FastpackTypeError(f"{name}: expected integers, got dtype {array.dtype}")
    if array.size and (int(array.max()) > 2**31 - 1 or int(array.min()) < -(2**31)):
        raise FastpackError(f"{name}: a value does not fit in int32 (flash-attn's dtype)")
    return np.ascontiguousarray(array, dtype=np.int32)


def _readonly(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


@dataclass(frozen=True)
class RankLayout:
    """What attention and the other sequence-mixing layers on one rank need.

    A *run* is a piece of one sequence that is contiguous both in the rank's tokens and
    in the padded row: one per sequence the rank's slice touches (contiguous, Ulysses),
    two per sequence (zigzag: chunks ``r`` and ``2·cp−1−r``).

    ``cu_seqlens_q`` (int32 [R+1]): the runs' boundaries in the rank's tokens — ring-flash
    -attn's llama3 ``cu_seqlens_q`` in the contiguous modes, and the rank-local
    ``cu_seqlens`` that convolution and linear-attention layers need (``seq_idx`` is the
    run index of every token, from 0 on every rank). ``cu_seqlens_k`` (int32 [R+1]): each
    run's keys, its sequence from the first token through the run's last (llama3's
    ``cu_seqlens_k``); ``max_seqlen_q`` / ``max_seqlen_k``: the longest of each (llama3's).
    ``local_k_slice`` (contiguous and Ulysses): llama3's ``slice`` of the padded row (K/V
    all-gathered in rank order) that holds every run's keys. ``k_index`` (zigzag, int64):
    the rows of K/V all-gathered in rank order that hold each run's keys, run after run.
    ``run_sequences`` (int64 [R]): the sequence of each run.
    """

    cu_seqlens_q: np.ndarray
    cu_seqlens_k: np.ndarray
    max_seqlen_q: int
    max_seqlen_k: int
    run_sequences: np.ndarray
    local_k_slice: slice | None
    k_index: np.ndarray | None

    @property
    def seq_idx(self) -> np.ndarray:
        """int32 [local tokens]: the run of every local token (0, 1, ...: rank-local)."""
        return np.repeat(np.arange(len(self.run_sequences), dtype=np.int32),
                         np.diff(self.cu_seqlens_q))


@dataclass(frozen=True)
class CPLayout:
    """A packed row's context-parallel layout (from :func:`cp_layout`).

    ``cu_seqlens`` (int32 [N+1]) are the real lengths (TransformerEngine's
    ``cu_seqlens_q/kv``); ``cu_seqlens_padded`` (int32 [N+1]) the offsets in the padded row
    (TE's ``cu_seqlens_q/kv_padded``; in the contiguous modes only the last entry differs:
    the last sequence absorbs the row's pad, NeMo-RL's rule). ``padded_total`` tokens are
    split evenly, ``padded_total // cp_size`` per rank; ``pad_tokens`` of them are
    padding. ``work`` (int64 [cp]): the (query, key) pairs each rank's real queries attend
    to, causally — what a rank's attention costs.
    """

    cp_size: int
    mode: str
    pad_multiple: int
    cu_seqlens: np.ndarray
    cu_seqlens_padded: np.ndarray
    work: np.ndarray
    threads: int | None = None
    _tokens: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(
        default_factory=dict, repr=False, compare=False)
    _local: dict[int, RankLayout] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_sequences(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def padded_total(self) -> int:
        return int(self.cu_seqlens_padded[-1])

    @property
    def real_total(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def pad_tokens(self) -> int:
        return self.padded_total - self.real_total

    @property
    def local_tokens(self) -> int:
        """Tokens every rank holds."""
        return self.padded_total // self.cp_size

    @property
    def divisor(self) -> int:
        """What padded lengths are multiples of (:func:`fastpack._options.cp_divisor`)."""
        return cp_divisor(self.cp_size, self.mode, self.pad_multiple)

    @property
    def max_seqlen_padded(self) -> int:
        """The longest padded sequence (TE's ``max_seqlen_q``)."""
        return int(np.diff(self.cu_seqlens_padded).max()) if self.num_sequences else 0

    def imbalance(self) -> float:
        """The busiest rank's attention work over the mean (1.0: balanced)."""
        mean = float(self.work.mean())
        return float(self.work.max()) / mean if mean > 0 else 1.0

    def _rank(self, rank: Any) -> int:
        return _int_arg("cp_rank", rank, minimum=0, maximum=self.cp_size - 1,
                        why=f" (cp_size is {self.cp_size})")

    @property
    def _workers(self) -> int | None:
        # A rank's share of one row is small: below 2^17 tokens the calling thread alone
        # is faster than waking a pool (the arrays are the same on any number).
        if self.threads is None and self.local_tokens < 1 << 17:
            return 1
        return self.threads

    def _rank_tokens(self, rank: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        r = self._rank(rank)
        if r not in self._tokens:
            arrays = _core.cp_rank_tokens(self.cu_seqlens, self.cp_size, self.mode,
                                          self.pad_multiple, r, self._workers)
            self._tokens[r] = tuple(_readonly(a) for a in arrays)  # type: ignore[assignment]
        return self._tokens[r]

    def indices(self, rank: int) -> np.ndarray:
        """int64 [local tokens]: the positions in the padded row that ``rank`` holds, in
        its local order (zigzag: TE's ``thd_get_partitioned_indices``)."""
        return self._rank_tokens(rank)[0]

    def positions(self, rank: int) -> np.ndarray:
        """int64: each local token's position inside its sequence, computed on the padded
        row before slicing and continuing through pads (TE's
        ``generate_positional_ids_for_cp``)."""
        return self._rank_tokens(rank)[1]

    def sources(self, rank: int) -> np.ndarray:
        """int64: each local token's index in the real (unpadded) row, -1 for a pad."""
        return self._rank_tokens(rank)[2]

    def pad_mask(self, rank: int) -> np.ndarray:
        """bool: ``True`` where the local token is padding (label -100, pad id)."""
        return self.sources(rank) < 0

    def local(self, rank: int) -> RankLayout:
        """The rank's runs and keys (:class:`RankLayout`)."""
        r = self._rank(rank)
        if r not in self._local:
            d = _core.cp_rank_attention(self.cu_seqlens, self.cp_size, self.mode,
                                        self.pad_multiple, r, self._workers)
            k_slice = d["local_k_slice"]
            k_index = d["k_index"]
            self._local[r] = RankLayout(
                cu_seqlens_q=_readonly(d["cu_seqlens_q"]),
                cu_seqlens_k=_readonly(d["cu_seqlens_k"]),
                max_seqlen_q=int(d["max_seqlen_q"]), max_seqlen_k=int(d["max_seqlen_k"]),
                run_sequences=_readonly(d["run_sequences"]),
                local_k_slice=None if k_slice is None else slice(*k_slice),
                k_index=None if k_index is None else _readonly(k_index),
            )
        return self._local[r]


def cp_layout(
    cu_seqlens: Any,
    cp_size: int,
    *,
    mode: str = "zigzag",
    pad_multiple: int = 1,
    threads: int | None = None,
) -> CPLayout:
    """The context-parallel layout of one packed row for a CP group of ``cp_size`` ranks.

    Args:
        cu_seqlens: the row's real ``cu_seqlens`` (``[N+1]``, from 0, non-decreasing; a
            tensor, array or list). A negative entry (a fixed-shape sentinel) raises.
        cp_size: ranks in the CP group (1 gives every token to rank 0).
        mode: ``"zigzag"``, ``"contiguous"`` or ``"ulysses"`` (see :data:`CP_MODES`).
        pad_multiple: also make every rank's share of a sequence (zigzag) or of the row a
            multiple of this: the tensor-parallel size with sequence parallelism, an FP8
            kernel's divisor (NeMo-RL's rules). Lengths are padded up, never rounded down.
        threads: for the per-rank arrays (default: all cores).

    >>> import fastpack
    >>> layout = fastpack.cp_layout([0, 8, 16], 2)
    >>> layout.indices(0).tolist(), layout.indices(1).tolist()
    ([0, 1, 6, 7, 8, 9, 14, 15], [2, 3, 4, 5, 10, 11, 12, 13])
    """
    cp, mode, multiple = check_cp(cp_size, mode, pad_multiple)
    cu = _readonly(as_cu_seqlens(cu_seqlens))
    padded, work = _core.cp_stream(cu, cp, mode, multiple)
    return CPLayout(cp_size=cp, mode=mode, pad_multiple=multiple, cu_seqlens=cu,
                    cu_seqlens_padded=_readonly(padded),
                    work=_readonly(work.astype(np.int64)), threads=_threads(threads))


class CPGroup(Protocol):
    """What :func:`cp_rows` reads of a plan: its CP group (a :class:`fastpack.Plan`; a
    protocol so this module never imports the plan's)."""

    cp_size: int | None
    cp_mode: str | None
    pad_multiple: int | None


def cp_rows(plan: CPGroup, seqlens: np.ndarray, offsets: np.ndarray,
            work: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Padded tokens (int64 [N]) and each CP rank's attention work (int64 [N, cp]; [N, 0]
    with ``work=False``, which skips it) of the rows ``offsets[i]:offsets[i+1]`` of
    ``seqlens`` (a plan's packs, a step's row, a piece of one), each sharded on its own for
    the plan's CP group: the one reading of a CP plan's padding and work
    (``Plan.pad_tokens``, ``StepTable``, the sampler's cost)."""
    assert plan.cp_size is not None and plan.cp_mode is not None
    padded, per_rank = _core.cp_streams(
        np.ascontiguousarray(seqlens, dtype=np.int32), np.ascontiguousarray(offsets, np.int64),
        plan.cp_size, plan.cp_mode, plan.pad_multiple or 1, work=work)
    if per_rank is None:
        return padded, np.empty((len(padded), 0), np.int64)
    return padded, per_rank.astype(np.int64).reshape(len(padded), plan.cp_size)


def pack_for_context_parallel(lengths: np.ndarray, options: PackOptions,
                              threads: int | None) -> dict[str, Any]:
    """The plan's fields (for :class:`fastpack.Plan`) of :func:`fastpack.pack` with
    ``options.cp_size`` (``lengths`` a native integer array; the options checked, so every
    cap holds at least one padded sequence): the existing
    core plans the padded lengths under caps rounded down to the padding divisor, and the
    real lengths are mapped back.

    Zigzag pads every (reserve-extended) sequence to ``roundup(len, d)``; with the caps
    multiples of ``d``, every piece of a split (or wrapped) sequence starts at a multiple
    of ``d`` below its real end, so its real length is ``min(seqlen, len - start)`` and no
    piece is all padding. The contiguous modes pad a pack's end only: planning under
    ``floor(max_len / d) · d`` leaves room for it; the plan's metrics come from the real
    seqlens, against the real caps."""
    o = options
    assert o.cp_size is not None
    d = cp_divisor(o.cp_size, o.cp_mode, o.pad_multiple)
    cap = o.max_len // d * d
    long_cap = None if o.long_max_len is None else o.long_max_len // d * d
    top = cap if long_cap is None else long_cap
    given = lengths
    if lengths.dtype == np.uint64:  # past 2^63 - 1 (no pack holds it) read as 2^63 - 1
        lengths = np.minimum(lengths, np.iinfo(np.int64).max)
    if lengths.dtype not in (np.int32, np.int64):
        lengths = lengths.astype(np.int64)
    # One pass in the core: the padded lengths zigzag plans on, and the overlong ones.
    planned, over, first, over_tokens, over_excess = _core.cp_plan_lengths(
        lengths, o.cp_size, o.cp_mode, o.pad_multiple, o.reserve, top, threads)
    if over and o.overlong == "error" and o.strategy != "wrapped":
        assert first is not None
        what = "every sequence" if o.cp_mode == "zigzag" else "every pack"
        raise FastpackError(
            f"lengths: {over} sequence(s) longer than {top} tokens (first at index "
            f"{first}, length {int(given[first])}"
            f"{f' + reserve {o.reserve}' if o.reserve else ''}): "
            f"{'long_max_len' if long_cap else 'max_len'} ({o.long_max_len or o.max_len}) "
            f"holds {top} once {what} is padded to a multiple of {d} (cp_size={o.cp_size}, "
            f"cp_mode={o.cp_mode!r}, pad_multiple={o.pad_multiple}); pass "
            f'overlong="truncate", "split" or "drop", or raise the cap'
        )
    zigzag = planned is not None
    fields = _core.pack(lengths if planned is None else planned, cap, o.strategy, o.overlong,
                        o.reserve, o.seed if o.shuffle else None, threads, None, long_cap,
                        o.group_tokens)
    if zigzag:
        _core.cp_real_seqlens(fields, lengths, o.reserve, threads)
        if o.strategy != "wrapped":  # wrapped never drops nor truncates
            if o.overlong == "drop":
                fields["dropped_tokens"] = over_tokens
            elif o.overlong == "truncate":
                fields["truncated_tokens"] = over_excess
    if fields.get("pack_caps") is not None:
        assert o.long_max_len is not None
        fields["pack_caps"] = np.where(fields["pack_caps"] == cap, o.max_len,
                                       o.long_max_len).astype(np.int32)
        fields["long_max_len"] = o.long_max_len
    fields.update(max_len=o.max_len, cp_size=o.cp_size, cp_mode=o.cp_mode,
                  pad_multiple=o.pad_multiple, shuffle=o.shuffle, seed=o.seed)
    return fields
