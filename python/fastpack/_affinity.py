"""Related documents packed together: ``pack(..., affinity=keys)``.

The keys are whatever the caller computed per document (a cluster of embeddings, a MinHash
bucket, a URL domain); the core (``fastpack_core::pack_affinity``) packs best fit, keeping
packs of one key where that costs at most 0.1% of plain best fit's efficiency, and
measures how related the packs are. This module checks the keys and the options, and hashes
string keys to integers (the command's ``--affinity-column``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from . import _core
from ._errors import FastpackError, FastpackTypeError

if TYPE_CHECKING:
    from ._options import PackOptions



class PlanArrays(Protocol):
    """What :func:`measure_affinity` reads of a :class:`fastpack.Plan` (a protocol, so this
    module does not import ``_plan``, which imports it)."""

    @property
    def sample_ids(self) -> np.ndarray: ...
    @property
    def seqlens(self) -> np.ndarray: ...
    @property
    def pack_offsets(self) -> np.ndarray: ...


__all__ = ["Affinity", "as_keys", "check_options", "affinity_keys", "measure_affinity"]


@dataclass(frozen=True)
class Affinity:
    """How related a plan's packs are under the documents' keys.

    A *pair* is two tokens of two different sequences in one pack."""

    #: Distinct keys among the packed sequences.
    num_keys: int
    #: The share of pairs whose sequences have the same key.
    same_key_share: float
    #: The share a random packing is expected to give, computed from the keys' tokens:
    #: ``(Σ_k t_k² − Σ_i l_i²) / (T² − Σ_i l_i²)`` (``t_k`` the tokens of key ``k``,
    #: ``l_i`` of sequence ``i``, ``T`` all of them) — two tokens of different sequences
    #: drawn at random share a key with this probability.
    random_share: float
    #: Packs of two or more sequences that all have one key, over the packs of two or more.
    pure_packs: float
    #: The slack (tokens) the plan was placed with; 0 when the placement preferring keys
    #: would have cost more than 0.1% of efficiency and plain best fit's placement was kept
    #: (ties still go to the item's key), and when 0 was asked for (the default under
    #: ``max_len`` 128). 0 for :func:`measure_affinity`.
    slack: int
    #: Packs plain best fit (``strategy="bfd"``) makes of the same lengths (0 for
    #: :func:`measure_affinity`); the plan has at most ``bfd_packs + bfd_packs // 1000``.
    bfd_packs: int


def as_keys(keys: Any, n: int) -> np.ndarray:
    """``keys`` as a contiguous int64 array of ``n`` non-negative integers, or a
    FastpackError / FastpackTypeError naming ``affinity``."""
    from ._plan import as_lengths

    if isinstance(keys, np.ndarray) and keys.dtype.kind in "UOS" and keys.size:
        raise FastpackTypeError(
            f"affinity: expected integer keys, got dtype {keys.dtype}; hash strings to "
            "integers first (fastpack.affinity_keys does it deterministically)"
        )
    try:
        array = as_lengths(keys, name="affinity")
    except FastpackError as e:
        # as_lengths speaks of lengths; a key is any non-negative integer.
        raise type(e)(str(e).replace("lengths must be", "keys must be")) from None
    if array.size != n:
        raise FastpackError(
            f"affinity: got {array.size} keys for {n} sequences; expected one key per sequence"
        )
    if array.dtype == np.uint64 and array.size and int(array.max()) >= 2**63:
        raise FastpackError("affinity: keys must be below 2**63")
    keys64 = np.ascontiguousarray(array, dtype=np.int64)
    if keys64.size and int(keys64.min()) < 0:
        i = int(np.argmax(keys64 < 0))
        raise FastpackError(
            f"affinity: negative key {int(keys64[i])} at index {i}; keys must be "
            "non-negative integers"
        )
    return keys64


#: The options a plan with affinity keys cannot have: option attribute -> (its keyword,
#: what it is).
_REFUSED = {
    "long_max_len": ("long_max_len", "a long bucket"),
    "group_tokens": ("group_tokens", "level-2 groups"),
    "cp_size": ("cp_size", "context-parallel padding"),
    "budgets": ("limits", "budgets besides tokens"),
}


def check_options(opts: PackOptions) -> None:
    """Refuses the options affinity does not combine with, saying what to do instead."""
    if opts.strategy != "bfd":
        raise FastpackError(
            f"affinity: packs related documents together by best fit; strategy="
            f"{opts.strategy!r} {'keeps input order' if opts.strategy != 'ffd' else 'is first fit'}"
            "; use strategy='bfd' (the default) with affinity, or drop affinity"
        )
    for attribute, (name, what) in _REFUSED.items():
        if getattr(opts, attribute):
            raise FastpackError(
                f"affinity: not supported with {name} ({what}) yet; pack without one of them"
            )


def pack_affinity(array: np.ndarray, keys: Any, opts: PackOptions,
                  threads: int | None) -> dict[str, Any]:
    """The core's plan fields for ``pack(array, ..., affinity=keys)``."""
    check_options(opts)
    keys64 = as_keys(keys, len(array))
    lengths = np.ascontiguousarray(array, dtype=np.int64)
    if array.dtype == np.uint64 and array.size and int(array.max()) >= 2**63:
        lengths = np.minimum(array, 2**63 - 1).astype(np.int64)  # over-long either way
    return _core.pack_affinity(
        lengths, keys64, opts.max_len, opts.overlong, opts.reserve,
        opts.seed if opts.shuffle else None, threads,
    )


def measure_affinity(plan: PlanArrays, keys: Any) -> Affinity:
    """How related the packs of any ``plan`` are under ``keys`` (one per input sequence of
    the plan): the same measure ``pack(..., affinity=keys)`` reports, for comparing with a
    plan made without keys.

    >>> import numpy as np, fastpack
    >>> plan = fastpack.pack([4, 4, 4, 4], 8, shuffle=False)
    >>> fastpack.measure_affinity(plan, [0, 0, 1, 1]).same_key_share
    1.0
    """
    from ._plan import Plan

    if not isinstance(plan, Plan):
        raise FastpackTypeError(f"plan: expected a fastpack.Plan, got {type(plan).__name__}")
    n = int(plan.sample_ids.max()) + 1 if plan.sample_ids.size else 0
    keys64 = as_keys(keys, len(keys) if hasattr(keys, "__len__") else n)
    if keys64.size < n:
        raise FastpackError(
            f"affinity: got {keys64.size} keys; the plan has sequences up to index {n - 1}"
        )
    fields = _core.affinity_metrics(
        np.ascontiguousarray(plan.sample_ids), np.ascontiguousarray(plan.seqlens),
        np.ascontiguousarray(plan.pack_offsets), keys64,
    )
    return Affinity(**fields)


def affinity_keys(values: Any) -> np.ndarray:
    """Non-negative int64 keys of any column of values (numpy, list, pyarrow): integers as
    they are (negative ones refused), anything else by a fixed hash of its ``str`` (UTF-8)
    (BLAKE2b, 63 bits) — the same on every machine and run, unlike Python's ``hash``. Only
    the distinct values are hashed in Python. Equal values, equal keys; two distinct strings
    collide with probability 2^-63."""
    if type(values).__module__.startswith("pyarrow"):
        import pyarrow as pa
        import pyarrow.compute as pc

        if pa.types.is_integer(values.type):
            values = values.to_numpy()
        else:
            if isinstance(values, pa.ChunkedArray):
                values = values.combine_chunks()
            if values.null_count:
                raise FastpackError("affinity: the key column has missing values (nulls)")
            encoded = pc.dictionary_encode(values)
            hashed = _hash_distinct(encoded.dictionary.to_pylist())
            return hashed[encoded.indices.to_numpy(zero_copy_only=False)]
    array = np.asarray(values)
    if array.dtype.kind in "iu":
        return as_keys(array, array.size)
    distinct, inverse = np.unique(array.astype(str), return_inverse=True)
    return _hash_distinct(distinct.tolist())[inverse.reshape(-1)]


def _hash_distinct(values: list[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=np.int64)
    for i, v in enumerate(values):
        data = v if isinstance(v, bytes) else str(v).encode()
        out[i] = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1
    return out
