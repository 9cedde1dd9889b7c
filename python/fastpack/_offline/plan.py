"""Pass 2, the plan: one global plan (``fastpack.pack``) over every document's length, or
a sharded plan. (The packs a gather pass or a worker writes, as a plan of their own, are
``fastpack._plan.sub_plan``'s.)

Sharded plans: when one global plan does not fit one machine, documents are dealt to
``K`` plan shards by a hash of their key, each shard is packed on its own (best fit over
its own documents) and the plans are laid end to end. Every machine computes the same
shard of a document from its key alone, so Ray workers and the single-machine path agree.

Each shard leaves about half a pack more than its share of one global plan: 10 shards of
10^7 lengths cost 5-7 packs in all (``benches/results/cli.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._options import PackOptions
from .._plan import Plan, pack
from .sources import InputError, Source

if TYPE_CHECKING:
    from .scan import Scan
    from .settings import PackSettings

__all__ = [
    "ROW_BITS",
    "check_overlong",
    "combine_plans",
    "file_keys",
    "make_plan",
    "mix64",
    "overlong_documents",
    "overlong_error",
    "plan_shard",
    "shard_of",
    "shard_seed",
    "sharded_plan",
    "sorted_unique",
]

#: A document read from files is keyed ``file_index << ROW_BITS | row``: its place in
#: fastpack's order, computable by whichever machine reads the row.
ROW_BITS = 40


def make_plan(scan: Scan, settings: PackSettings, sources: Sequence[Source],
              key_sources: Sequence[Source] | None = None) -> tuple[Plan, list[int]]:
    """The plan and the packs of each plan shard (one entry for a global plan);
    ``key_sources``: the files holding ``--affinity-column`` (default: ``sources``)."""
    check_overlong(scan, settings, sources)
    affinity = None
    if settings.affinity_column is not None:
        from .affinity import read_keys

        affinity = read_keys(key_sources or sources, settings.affinity_column)
        if len(affinity) != len(scan.lengths):
            raise InputError(f"{len(affinity):,} keys for {len(scan.lengths):,} documents",
                             column=settings.affinity_column)
    if settings.plan_shards > 1:
        return sharded_plan(scan.lengths, settings.plan_shards, settings.options,
                            keys=file_keys(scan.file_rows), affinity=affinity)
    plan = plan_shard(scan.lengths, None, settings.options, affinity=affinity)
    return plan, [plan.num_packs]


def check_overlong(scan: Scan, settings: PackSettings, sources: Sequence[Source]) -> None:
    """With ``--overlong error``, names the first document longer than the cap."""
    over = overlong_documents(scan.lengths, settings)
    if over.size:
        path, row = scan.locate(int(over[0]), sources)
        raise overlong_error(int(scan.lengths[over[0]]), over.size - 1, settings,
                             path=path, row=row)


def overlong_documents(lengths: np.ndarray, settings: PackSettings) -> np.ndarray:
    """The documents (indices into ``lengths``) that ``--overlong error`` refuses: longer
    than the largest cap. None for another policy, nor for ``wrapped`` (which cuts every
    document at the cap). The one rule, on one machine and in Ray's planners."""
    if settings.overlong != "error" or settings.strategy == "wrapped" or not lengths.size:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(lengths > settings.max_cap)


def overlong_error(length: int, more: int, settings: PackSettings, scope: str = "",
                   **where: Any) -> InputError:
    """The error naming a document of ``length`` tokens over the cap (``more``: how many
    others are, in ``scope``; ``where``: its path and row)."""
    others = f" (and {more:,} more over the cap{scope})" if more else ""
    return InputError(
        f"{length:,} tokens, longer than the cap of {settings.max_cap:,}{others}; pass "
        "--overlong split, truncate or drop (or a larger --long-max-len)",
        column=settings.column, **where)


# ---------------------------------------------------------------------------------------
# sharded plans


_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a fixed, well-spread hash of 64-bit keys."""
    z = z.astype(np.uint64, copy=True)
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    z ^= z >> np.uint64(31)
    return z


def shard_seed(seed: int, shard: int) -> int:
    """The shuffle seed of plan shard ``shard`` (each shard its own pack order, the same on
    every machine), for any seed ``fastpack.pack`` takes (0 to 2^64-1): the mixing is
    modulo 2^64, so no seed overflows it."""
    value = np.array([(seed * 1_000_003 + shard) % 2**64], dtype=np.uint64)
    return int(mix64(value)[0] >> np.uint64(1))


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """``np.unique`` by sorting: numpy 2's hash-based unique takes seconds per 10^7 values
    where a sort takes a fraction of one."""
    ordered = np.sort(values)
    if ordered.size < 2:
        return ordered
    keep = np.empty(ordered.size, dtype=bool)
    keep[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return ordered[keep]


def file_keys(file_rows: Sequence[int]) -> np.ndarray:
    """The keys of every document of files holding ``file_rows`` rows, in order."""
    if not file_rows:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([(np.int64(k) << ROW_BITS) + np.arange(n, dtype=np.int64)
                           for k, n in enumerate(file_rows)])


def shard_of(keys: np.ndarray, num_shards: int) -> np.ndarray:
    """The plan shard (int64) of each document key."""
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    if num_shards == 1:
        return np.zeros(len(keys), dtype=np.int64)
    return (mix64(keys.view(np.uint64)) % np.uint64(num_shards)).astype(np.int64)


def plan_shard(lengths: np.ndarray, shard: int | None, options: PackOptions,
               threads: int | None = None, affinity: np.ndarray | None = None) -> Plan:
    """The plan of one plan shard (None: the one global plan) from its documents' lengths
    in key order: ``fastpack.pack`` with ``options`` (and ``affinity`` keys), each shard
    shuffled by its own seed (:func:`shard_seed`)."""
    if shard is not None:
        options = options.replace(seed=shard_seed(options.seed, shard))
    return pack(lengths, options=options, threads=threads, affinity=affinity)


def combine_plans(plans: Sequence[Plan], sample_maps: Sequence[np.ndarray],
                  options: PackOptions,
                  start_maps: Sequence[np.ndarray] | None = None) -> Plan:
    """Plans laid end to end as one plan; ``sample_maps[k]`` maps plan ``k``'s sample ids to
    global document ids (and ``start_maps[k]``, where plan ``k`` packed pieces of
    documents, to each piece's first token in its document). The joined plan records
    ``options`` (``plan.options``: the shards were made with them, each shuffled by its
    own seed derived from ``options.seed``)."""
    first = plans[0]
    fields: dict[str, Any] = {}
    fields["sample_ids"] = np.concatenate(
        [m[p.sample_ids] for p, m in zip(plans, sample_maps)]).astype(np.int64)
    fields["starts"] = np.concatenate(
        [p.starts for p in plans] if start_maps is None else
        [p.starts + m[p.sample_ids] for p, m in zip(plans, start_maps)]).astype(np.int64)
    fields["seqlens"] = np.concatenate([p.seqlens for p in plans])
    seg_base = np.cumsum([0] + [p.num_segments for p in plans])
    fields["pack_offsets"] = np.concatenate(
        [np.zeros(1, dtype=np.int64)]
        + [p.pack_offsets[1:] + seg_base[k] for k, p in enumerate(plans)])
    for name in ("max_len", "reserve", "strategy", "overlong", "long_max_len", "group_tokens",
                 "shuffle", "seed"):
        fields[name] = getattr(options, name)
    for name in ("num_sequences", "empty_sequences", "dropped_sequences", "dropped_tokens",
                 "truncated_sequences", "truncated_tokens", "split_sequences", "total_tokens"):
        fields[name] = sum(getattr(p, name) for p in plans)
    if first.long_max_len is not None:
        fields["pack_caps"] = np.concatenate([p.pack_caps for p in plans])
    # Every metric (lower bound, efficiency, the buckets' and the groups') is the core's,
    # computed by Plan() over the joined arrays: the whole input's bound, not a sum of the
    # shards'. Only each bucket's sequences, an input count, come from the shards.
    if first.buckets:
        fields["buckets"] = [
            {"num_sequences": sum(p.buckets[i].num_sequences for p in plans)}
            for i in range(len(first.buckets))
        ]
    if first.group_offsets is not None:
        pack_base = np.cumsum([0] + [p.num_packs for p in plans])
        group_offsets = [np.zeros(1, dtype=np.int64)]
        for k, p in enumerate(plans):
            assert p.group_offsets is not None and p.group_fills is not None
            group_offsets.append(p.group_offsets[1:] + pack_base[k])
        fields["group_offsets"] = np.concatenate(group_offsets).astype(np.int64)
        fields["group_fills"] = np.concatenate([p.group_fills for p in plans
                                                if p.group_fills is not None])
    return Plan(fields)


def sharded_plan(lengths: np.ndarray, num_shards: int, options: PackOptions,
                 keys: np.ndarray | None = None,
                 affinity: np.ndarray | None = None) -> tuple[Plan, list[int]]:
    """The sharded plan of documents ``0..N`` (keys: their own index unless given), the one
    a cluster computes shard by shard, and the packs of each shard; with ``affinity``, each
    shard packs its documents' affinity keys together, and the joined plan measures them."""
    keys = np.arange(len(lengths), dtype=np.int64) if keys is None else keys
    shards = shard_of(keys, num_shards)
    order = np.lexsort((keys, shards))  # by shard, then by key
    bounds = np.searchsorted(shards[order], np.arange(num_shards + 1))
    plans, maps = [], []
    for s in range(num_shards):
        members = order[bounds[s]:bounds[s + 1]]
        part = None if affinity is None else affinity[members]
        plans.append(plan_shard(lengths[members], s, options, affinity=part))
        maps.append(members.astype(np.int64))
    plan = combine_plans(plans, maps, options)
    if affinity is not None:
        from .._affinity import measure_affinity

        plan.affinity = measure_affinity(plan, affinity)
    return plan, [p.num_packs for p in plans]
