"""Buckets (`long_max_len`) and two-level packing (`group_tokens`): invariants and errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastpack
from fastpack import FastpackError

FIELDS = ("sample_ids", "starts", "seqlens", "pack_offsets")


def kept(length: int, plan: fastpack.Plan, reserve: int) -> int:
    """Tokens of a sequence the plan should hold: its bucket's cap and over-long policy."""
    if length == 0:
        return 0
    extended = length + reserve
    cap = plan.max_len
    if plan.long_max_len is not None and extended > plan.max_len:
        cap = plan.long_max_len
    if extended <= cap:
        return extended
    return {"truncate": cap, "split": extended, "drop": 0}[plan.overlong]


def check(plan: fastpack.Plan, lengths: np.ndarray, reserve: int = 0) -> None:
    """Every invariant of a plan with buckets and/or groups, metrics included."""
    p = plan.num_packs
    caps = plan.pack_caps
    assert caps.dtype == np.int32 and caps.shape == (p,)
    fills = plan.pack_fills
    assert (fills > 0).all() and (fills <= caps).all()

    # Long and short never share a pack: a segment's bucket follows its sequence's length.
    pack_of = np.repeat(np.arange(p), np.diff(plan.pack_offsets))
    if plan.long_max_len is not None:
        is_long = lengths[plan.sample_ids] + reserve > plan.max_len
        assert np.array_equal(is_long, caps[pack_of] == plan.long_max_len)
        assert set(np.unique(caps)) <= {plan.max_len, plan.long_max_len}
    else:
        assert (caps == plan.max_len).all()

    # Every token accounted for: kept + dropped + truncated = input (reserve slots included).
    nonzero = lengths > 0
    tokens_in = int(lengths.sum()) + reserve * int(nonzero.sum())
    lost = plan.dropped_tokens + reserve * plan.dropped_sequences + plan.truncated_tokens
    assert int(plan.seqlens.sum(dtype=np.int64)) == plan.total_tokens
    assert plan.total_tokens + lost == tokens_in
    assert sum(b.total_tokens for b in plan.buckets) == plan.total_tokens
    assert sum(b.num_packs for b in plan.buckets) == p
    assert sum(b.num_sequences for b in plan.buckets) == int(nonzero.sum())
    # Each sequence's segments tile exactly what its bucket keeps, from 0, without gaps.
    order = np.lexsort((plan.starts, plan.sample_ids))
    ids, starts, lens = plan.sample_ids[order], plan.starts[order], plan.seqlens[order]
    first = np.ones(len(ids), dtype=bool)
    first[1:] = ids[1:] != ids[:-1]
    prev_end = np.zeros(len(ids), dtype=np.int64)
    prev_end[1:] = starts[:-1] + lens[:-1]
    np.testing.assert_array_equal(starts, np.where(first, 0, prev_end))
    covered = np.bincount(ids, weights=lens, minlength=len(lengths)).astype(np.int64)
    expected = np.array([kept(int(n), plan, reserve) for n in lengths], dtype=np.int64)
    np.testing.assert_array_equal(covered, expected)

    # Metrics (from the core) against their definitions.
    capacity = int(caps.sum(dtype=np.int64))
    assert plan.efficiency == pytest.approx(plan.total_tokens / capacity if capacity else 1.0)
    for b in plan.buckets:
        mine = caps == b.max_len
        assert b.num_packs == int(mine.sum())
        assert b.total_tokens == int(fills[mine].sum())
        assert b.lower_bound == -(-b.total_tokens // b.max_len)
        assert b.efficiency == pytest.approx(
            b.total_tokens / (b.num_packs * b.max_len) if b.num_packs else 1.0)
    assert plan.lower_bound == sum(-(-b.total_tokens // b.max_len) for b in plan.buckets)
    assert plan.num_packs >= plan.lower_bound

    if plan.group_offsets is None:
        assert plan.group_fills is None and plan.group_tokens is None and plan.num_groups == 0
        assert plan.group_efficiency is None and plan.group_lower_bound is None
        return
    offsets, tokens, cap = plan.group_offsets, plan.group_fills, plan.group_tokens
    assert cap is not None
    g = plan.num_groups
    assert offsets.dtype == np.int64 and tokens.dtype == np.int64 and tokens.shape == (g,)
    assert offsets[0] == 0 and offsets[-1] == p and (np.diff(offsets) > 0).all()
    cumulative = np.concatenate(([0], np.cumsum(fills)))
    assert np.array_equal(cumulative[offsets[1:]] - cumulative[offsets[:-1]], tokens)
    assert (tokens <= cap).all()
    group_of = np.repeat(np.arange(g), np.diff(offsets))
    # Groups never mix buckets.
    assert all((caps[group_of == i] == caps[offsets[i]]).all() for i in range(g))
    assert plan.group_lower_bound == sum(-(-b.total_tokens // cap) for b in plan.buckets)
    assert plan.num_groups >= plan.group_lower_bound
    assert plan.group_efficiency == pytest.approx(plan.total_tokens / (g * cap) if g else 1.0)
    if g:
        i = g - 1
        cu = plan.group_cu_seqlens(i)
        seg = plan.seqlens[plan.pack_offsets[offsets[i]] : plan.pack_offsets[offsets[i + 1]]]
        assert np.array_equal(cu, np.concatenate(([0], np.cumsum(seg))).astype(np.int32))


lengths_st = st.lists(st.integers(0, 300), max_size=250).map(lambda x: np.array(x, np.int64))


@settings(max_examples=300, deadline=None)
@given(
    lengths=lengths_st,
    max_len=st.integers(16, 80),
    long_extra=st.one_of(st.none(), st.integers(1, 200)),
    budget_extra=st.one_of(st.none(), st.integers(0, 400)),
    overlong=st.sampled_from(["truncate", "split", "drop"]),
    strategy=st.sampled_from(["bfd", "ffd", "next_fit"]),
    reserve=st.integers(0, 2),
    shuffle=st.booleans(),
)
def test_invariants(lengths, max_len, long_extra, budget_extra, overlong, strategy, reserve,
                    shuffle):
    long_max_len = None if long_extra is None else max_len + long_extra
    cap = long_max_len or max_len
    group_tokens = None if budget_extra is None else cap + budget_extra
    kwargs = dict(strategy=strategy, overlong=overlong, reserve=reserve, shuffle=shuffle,
                  seed=7, long_max_len=long_max_len, group_tokens=group_tokens)
    one = fastpack.pack(lengths, max_len, threads=1, **kwargs)
    check(one, lengths, reserve)
    two = fastpack.pack(lengths, max_len, threads=2, **kwargs)
    for name in (*FIELDS, "pack_caps", "group_offsets", "group_tokens"):
        assert np.array_equal(getattr(one, name), getattr(two, name)), name
    assert one.buckets == two.buckets


def test_buckets_route_by_length():
    lengths = np.array([3, 5, 20, 6, 9, 40, 0, 8])
    plan = fastpack.pack(lengths, 8, long_max_len=32, overlong="split", shuffle=False)
    assert plan.max_len == 8 and plan.long_max_len == 32
    short, long = plan.buckets
    assert (short.name, short.max_len, short.num_sequences) == ("short", 8, 4)
    assert (long.name, long.max_len, long.num_sequences) == ("long", 32, 3)
    assert plan.split_sequences == 1  # 40 > 32: split against the long cap
    # Unshuffled: short packs first, then long packs.
    caps = plan.pack_caps
    assert list(caps) == sorted(caps)
    check(plan, lengths)
    assert "long bucket (cap 32)" in plan.summary()


def test_groups_balance_tokens_and_shuffle_keeps_groups():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(300) - 0.5, 1.0, 20_000), 1, 4096).astype(np.int32)
    plain = fastpack.pack(lengths, 4096, group_tokens=65536, shuffle=False)
    check(plain, lengths)
    assert plain.group_efficiency is not None and plain.group_efficiency > 0.99
    assert np.median(plain.group_fills) > 0.99 * 65536
    shuffled = fastpack.pack(lengths, 4096, group_tokens=65536, shuffle=True, seed=3)
    check(shuffled, lengths)
    # The same groups (as sets of samples), in another order.
    def groups(plan):
        out = []
        for g in range(plan.num_groups):
            r = plan.group_packs(g)
            lo, hi = plan.pack_offsets[r.start], plan.pack_offsets[r.stop]
            out.append(tuple(sorted(plan.sample_ids[lo:hi])))
        return out
    a, b = groups(plain), groups(shuffled)
    assert sorted(a) == sorted(b) and a != b
    cu, pos = plain.group_varlen(0)
    assert cu[-1] == plain.group_fills[0] and len(pos) == cu[-1]
    assert "tokens per group min/median/max" in plain.summary()


def test_plain_plan_unchanged():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 600, 5000)
    plan = fastpack.pack(lengths, 512, overlong="split", shuffle=True, seed=5)
    assert plan.long_max_len is None and plan.group_offsets is None
    assert len(plan.buckets) == 1 and plan.buckets[0].num_packs == plan.num_packs
    assert plan.lower_bound == -(-plan.total_tokens // 512)
    assert (plan.pack_caps == 512).all()
    with pytest.raises(FastpackError, match="group: the plan has no groups"):
        plan.group_packs(0)
