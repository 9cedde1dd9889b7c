"""`fastpack.pack`: invariants (hypothesis), inputs, errors, zero copy, threads, fork."""

from __future__ import annotations

import multiprocessing as mp
import pickle
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from invariants import check_plan

import fastpack
from fastpack._plan import as_lengths

STRATEGIES = list(fastpack.STRATEGIES)
POLICIES = list(fastpack.OVERLONG_POLICIES)


@st.composite
def packing_inputs(draw):
    max_len = draw(st.integers(1, 200))
    lengths = draw(st.lists(st.integers(0, 3 * max_len), max_size=300))
    reserve = draw(st.integers(0, min(3, max_len - 1)))
    return np.array(lengths, dtype=np.int64), max_len, reserve


@settings(max_examples=150, deadline=None)
@given(packing_inputs(), st.sampled_from(STRATEGIES), st.sampled_from(POLICIES))
def test_invariants_hold_for_every_strategy_and_policy(inputs, strategy, overlong):
    lengths, max_len, reserve = inputs
    overlong_count = int(((lengths > 0) & (lengths + reserve > max_len)).sum())
    if overlong == "error" and strategy != "wrapped" and overlong_count:
        with pytest.raises(fastpack.FastpackError, match=f"{overlong_count} sequence"):
            fastpack.pack(lengths, max_len, strategy=strategy, overlong=overlong, reserve=reserve)
        return
    plan = fastpack.pack(lengths, max_len, strategy=strategy, overlong=overlong, reserve=reserve)
    check_plan(plan, lengths, strategy=strategy, overlong=overlong, reserve=reserve)


@settings(max_examples=60, deadline=None)
@given(packing_inputs(), st.sampled_from(STRATEGIES), st.integers(0, 2**64 - 1))
def test_same_plan_on_one_and_many_threads(inputs, strategy, seed):
    lengths, max_len, reserve = inputs
    plans = [
        fastpack.pack(lengths, max_len, strategy=strategy, overlong="split", reserve=reserve,
                      shuffle=True, seed=seed, threads=t)
        for t in (1, 2, 3)
    ]
    for other in plans[1:]:
        for name in ("sample_ids", "starts", "seqlens", "pack_offsets"):
            np.testing.assert_array_equal(getattr(plans[0], name), getattr(other, name))


def _mixed_lengths(n: int, max_len: int, seed: int) -> np.ndarray:
    """Mostly short, some near max_len, 5% over-long (up to 6x), 1% empty."""
    rng = np.random.default_rng(seed)
    kind = rng.integers(0, 100, n)
    lengths = rng.integers(1, 200, n)
    lengths = np.where(kind < 21, rng.integers(max_len // 2, max_len + 1, n), lengths)
    lengths = np.where(kind < 6, rng.integers(max_len + 1, 6 * max_len, n), lengths)
    return np.where(kind < 1, 0, lengths)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_same_plan_on_any_thread_count_across_chunks(strategy):
    # 2^20 lengths: the input is cut into 4, 8 or 12 chunks on 1, 2 or 3 threads (at most 4
    # per thread, of at least 2^16), so sort cursors, split sequences and the parallel
    # writers all cross chunk boundaries, differently on each thread count.
    lengths = _mixed_lengths(1 << 20, 512, seed=11).astype(np.int32)
    for kwargs in (dict(overlong="split", reserve=1), dict(overlong="truncate"),
                   dict(overlong="split", long_max_len=2048, group_tokens=8192)):
        if strategy == "wrapped" and "long_max_len" in kwargs:
            continue
        plans = [fastpack.pack(lengths, 512, strategy=strategy, seed=3, threads=t, **kwargs)
                 for t in (1, 2, 3)]
        if strategy == "bfd" and kwargs.get("reserve"):
            check_plan(plans[0], lengths, strategy=strategy, overlong="split", reserve=1)
        for other in plans[1:]:
            for name in ("sample_ids", "starts", "seqlens", "pack_offsets", "pack_caps"):
                np.testing.assert_array_equal(getattr(plans[0], name), getattr(other, name))
            assert plans[0].group_offsets is None or np.array_equal(
                plans[0].group_offsets, other.group_offsets)


@settings(max_examples=60, deadline=None)
@given(packing_inputs(), st.lists(st.integers(0, 10**6), max_size=8))
def test_cu_seqlens_and_position_ids_match_seqlens(inputs, picks):
    lengths, max_len, reserve = inputs
    plan = fastpack.pack(lengths, max_len, overlong="split", reserve=reserve)
    if plan.num_packs == 0:
        return
    packs = [p % plan.num_packs for p in picks]
    seqlens = np.concatenate([plan.segments(p)[2] for p in packs] or [np.zeros(0, np.int32)])
    cu, positions = plan.varlen(packs)
    assert cu.dtype == np.int32 and positions.dtype == np.int64
    np.testing.assert_array_equal(cu, np.concatenate(([0], np.cumsum(seqlens))))
    expected = np.concatenate([np.arange(n) for n in seqlens] or [np.zeros(0, np.int64)])
    np.testing.assert_array_equal(positions, expected)
    for p in packs[:2]:
        np.testing.assert_array_equal(plan.cu_seqlens(p), plan.varlen([p])[0])
        np.testing.assert_array_equal(plan.position_ids(p), plan.varlen(p)[1])


def test_bfd_fills_packs_near_the_lower_bound_on_realistic_lengths():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(300) - 0.5, 1.0, 200_000), 1, 4096).astype(np.int64)
    plan = fastpack.pack(lengths, 4096)
    check_plan(plan, lengths, strategy="bfd", overlong="error")
    assert plan.num_packs <= plan.lower_bound * 1.001
    ffd = fastpack.pack(lengths, 4096, strategy="ffd")
    next_fit = fastpack.pack(lengths, 4096, strategy="next_fit")
    assert plan.num_packs <= ffd.num_packs < next_fit.num_packs


def test_shuffle_is_deterministic_and_changes_the_order():
    lengths = np.arange(1, 2000) % 500 + 1
    a = fastpack.pack(lengths, 1024, shuffle=True, seed=7)
    b = fastpack.pack(lengths, 1024, shuffle=True, seed=7)
    c = fastpack.pack(lengths, 1024, shuffle=True, seed=8)
    plain = fastpack.pack(lengths, 1024, shuffle=False)
    np.testing.assert_array_equal(a.sample_ids, b.sample_ids)
    assert not np.array_equal(a.sample_ids, c.sample_ids)
    assert not np.array_equal(a.pack_fills, plain.pack_fills)
    np.testing.assert_array_equal(np.sort(a.pack_fills), np.sort(plain.pack_fills))


@pytest.mark.parametrize(
    "dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
)
def test_integer_dtypes_are_read_in_place(dtype):
    lengths = np.array([3, 5, 2, 6, 0, 7], dtype=dtype)
    assert as_lengths(lengths) is lengths
    plan = fastpack.pack(lengths, 8)
    check_plan(plan, lengths, strategy="bfd", overlong="error")


def test_outputs_are_moved_from_rust_not_copied():
    plan = fastpack.pack(np.arange(1, 1000), 2048)
    for name in ("sample_ids", "starts", "seqlens", "pack_offsets"):
        array = getattr(plan, name)
        # numpy does not own the buffer: it wraps the Rust Vec (the base is its capsule).
        assert not array.flags.owndata, name
        assert not isinstance(array.base, np.ndarray), name
        assert not array.flags.writeable, name


def test_lists_tuples_and_integral_floats_are_accepted():
    expected = fastpack.pack(np.array([3, 5, 2, 6]), 8)
    inputs = [[3, 5, 2, 6], (3, 5, 2, 6), np.array([3.0, 5.0, 2.0, 6.0]), iter([3, 5, 2, 6]),
              [np.int64(3), np.int32(5), np.array(2), 6.0]]
    for value in inputs:
        plan = fastpack.pack(value, 8)
        np.testing.assert_array_equal(plan.sample_ids, expected.sample_ids)
    noncontiguous = np.array([3, 99, 5, 99, 2, 99, 6, 99])[::2]
    np.testing.assert_array_equal(fastpack.pack(noncontiguous, 8).seqlens, expected.seqlens)
    big_endian = np.array([3, 5, 2, 6], dtype=">i8")
    np.testing.assert_array_equal(fastpack.pack(big_endian, 8).seqlens, expected.seqlens)


def test_torch_tensors_are_accepted():
    torch = pytest.importorskip("torch")
    expected = fastpack.pack(np.array([3, 5, 2, 6]), 8)
    inputs = [torch.tensor([3, 5, 2, 6]), torch.tensor([3, 5, 2, 6], dtype=torch.int32),
              torch.tensor([3, 99, 5, 99, 2, 99, 6, 99])[::2], torch.tensor([3.0, 5.0, 2.0, 6.0])]
    for value in inputs:
        plan = fastpack.pack(value, 8)
        np.testing.assert_array_equal(plan.sample_ids, expected.sample_ids)


def test_empty_input_and_empty_sequences():
    for strategy in STRATEGIES:
        plan = fastpack.pack([], 16, strategy=strategy)
        assert plan.num_packs == 0 and len(plan) == 0 and plan.pack_offsets.tolist() == [0]
        assert plan.efficiency == 1.0 and plan.lower_bound == 0
        plan = fastpack.pack([0, 4, 0], 16, strategy=strategy, reserve=1)
        assert plan.empty_sequences == 2 and plan.sample_ids.tolist() == [1]
        assert plan.seqlens.tolist() == [5]


def test_overlong_policies_count_every_token():
    lengths = [5, 20, 8, 13]
    truncated = fastpack.pack(lengths, 8, overlong="truncate", reserve=1)
    # With the reserved separator, 8 tokens no longer fit in 8 either.
    assert truncated.truncated_sequences == 3
    assert truncated.truncated_tokens == (21 - 8) + (9 - 8) + (14 - 8)
    dropped = fastpack.pack(lengths, 8, overlong="drop")
    assert dropped.dropped_sequences == 2 and dropped.dropped_tokens == 33
    split = fastpack.pack(lengths, 8, overlong="split")
    assert split.split_sequences == 2 and split.total_tokens == sum(lengths)
    assert "dropped 33 tokens (2 sequences)" in dropped.summary()
    assert "truncated 20 tokens (3 sequences)" in truncated.summary()


def test_pack_index_forms():
    plan = fastpack.pack(np.arange(1, 50), 64)
    n = plan.num_packs
    np.testing.assert_array_equal(plan.cu_seqlens(-1), plan.cu_seqlens(n - 1))
    np.testing.assert_array_equal(plan.cu_seqlens(slice(0, 3)), plan.cu_seqlens(range(3)))
    np.testing.assert_array_equal(plan.cu_seqlens(np.array([0, 1, 2])), plan.cu_seqlens([0, 1, 2]))
    assert "Plan(num_packs=" in repr(plan)


def _pack_in_child(queue):
    small = fastpack.pack(np.arange(1, 1000) % 700 + 1, 1024).num_packs
    plan = fastpack.pack(np.arange(1, 300_000) % 700 + 1, 1024, threads=2, shuffle=True)
    again = fastpack.pack(np.arange(1, 1000) % 700 + 1, 1024, threads=1).num_packs
    queue.put((plan.num_packs, small, again))


@pytest.mark.timeout(60)
def test_works_in_a_forked_child_after_the_parent_used_threads():
    # Both kinds of pool in the parent first: the shared 2-thread one, and the one-thread
    # "pool" made of the calling thread itself (small inputs run there).
    lengths = np.arange(1, 300_000) % 700 + 1
    expected = fastpack.pack(lengths, 1024, threads=2, shuffle=True).num_packs
    small = fastpack.pack(np.arange(1, 1000) % 700 + 1, 1024).num_packs
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_pack_in_child, args=(queue,))
    child.start()
    assert queue.get(timeout=50) == (expected, small, small)
    child.join(10)
    assert child.exitcode == 0


def test_python_threads_pack_concurrently_and_agree():
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(5)
    inputs = [rng.integers(1, 900, size) for size in (50, 5_000, 200_000)] * 4
    expected = [fastpack.pack(x, 1024, shuffle=True, seed=1) for x in inputs]
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda x: fastpack.pack(x, 1024, shuffle=True, seed=1), inputs))
    for e, g in zip(expected, got):
        np.testing.assert_array_equal(e.sample_ids, g.sample_ids)
        np.testing.assert_array_equal(e.pack_offsets, g.pack_offsets)


def test_plan_is_picklable_for_dataloader_workers():
    plan = fastpack.pack([3, 5, 2, 6], 8)
    clone = pickle.loads(pickle.dumps(plan))
    np.testing.assert_array_equal(clone.sample_ids, plan.sample_ids)
    assert clone.num_packs == plan.num_packs


def _fields(plan, **change):
    """The fields a Plan is built from, without its metrics (Python assembles plans so)."""
    fields = {name: getattr(plan, name) for name in fastpack.Plan._FIELDS}
    for name in ("lower_bound", "efficiency", "total_tokens"):
        fields[name] = -1  # must not be read
    return {**fields, **change}


@pytest.mark.parametrize(
    ("offsets", "match"),
    [
        ([0, 2, 1, 5], r"^pack_offsets: decreases at index 2: 2 then 1; expected non-decreasing"),
        ([1, 2, 4, 5], r"^pack_offsets: starts at 1; expected 0"),
        ([0, 2, 4, 4], r"^pack_offsets: ends at 4 \(index 3\); expected the number of segments, 5"),
        ([], r"^pack_offsets: is empty"),
    ],
)
def test_a_plan_of_bad_pack_offsets_is_refused(offsets, match):
    plan = fastpack.pack([3, 2, 5, 7, 1], 8, shuffle=False)
    assert plan.pack_offsets.tolist() == [0, 2, 4, 5]
    with pytest.raises(fastpack.FastpackError, match=match):
        fastpack.Plan(_fields(plan, pack_offsets=np.array(offsets, dtype=np.int64)))


def test_layout_of_bad_pack_offsets_names_them_without_a_panic(capfd):
    # A plan whose arrays nobody checked (the core's path into Plan, or arrays changed
    # after the plan was built): the layout checks the packs it reads.
    plan = fastpack.pack([3, 2, 5, 7, 1], 8, shuffle=False)
    fields = {**_fields(plan), "pack_offsets": np.array([0, 2, 1, 5], dtype=np.int64)}
    for name in ("lower_bound", "efficiency", "total_tokens"):
        fields[name] = getattr(plan, name)
    bad = fastpack.Plan._from_core(fields)
    match = r"^pack_offsets: entries 1 and 2 are 2 and 1: not a range of the 5 segments"
    with pytest.raises(fastpack.FastpackError, match=match):
        bad.cu_seqlens([1])
    with pytest.raises(fastpack.FastpackError, match=match):
        bad.varlen([0, 1])
    offsets = np.array([0, 2, 9, 5], dtype=np.int64)
    with pytest.raises(fastpack.FastpackError, match=r"^pack_offsets: entries 1 and 2 are 2 and 9"):
        fastpack._core.cu_seqlens(plan.seqlens, offsets, np.array([1], dtype=np.int64))
    assert "panicked" not in capfd.readouterr().err


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"sample_ids": np.zeros(4, np.int64)}, fastpack.FastpackError,
         r"^sample_ids: has 4 entries; seqlens has 5"),
        ({"seqlens": np.array([3.0, 2, 5, 7, 1])}, fastpack.FastpackTypeError,
         r"^seqlens: expected integers, got dtype float64"),
        ({"seqlens": np.array([3, 2, -5, 7, 1])}, fastpack.FastpackError,
         r"^seqlens: negative length -5 at index 2"),
        ({"seqlens": np.array([3, 2, 2**40, 7, 1])}, fastpack.FastpackError,
         r"^seqlens: a value does not fit in int32"),
        ({"pack_offsets": np.array([[0, 2, 4, 5]])}, fastpack.FastpackError,
         r"^pack_offsets: expected a 1-D array, got shape \(1, 4\)"),
        ({"pack_caps": np.array([8, 9, 8], np.int32)}, fastpack.FastpackError,
         r"^pack_caps: pack 1 has cap 9; expected max_len \(8\)"),
        ({"pack_caps": np.array([8, 8], np.int32)}, fastpack.FastpackError,
         r"^pack_caps: has 2 entries for 3 packs"),
        ({"group_offsets": np.array([0, 3]), "group_tokens": None}, fastpack.FastpackError,
         r"^group_tokens: missing: the plan has group_offsets"),
        ({"group_offsets": np.array([0, 2]), "group_tokens": 16}, fastpack.FastpackError,
         r"^group_offsets: ends at 2 \(index 1\); expected the number of packs, 3"),
    ],
)
def test_a_plan_of_bad_arrays_is_refused(change, error, match):
    plan = fastpack.pack([3, 2, 5, 7, 1], 8, shuffle=False)
    with pytest.raises(error, match=match):
        fastpack.Plan(_fields(plan, **change))


METRICS = ("total_tokens", "lower_bound", "efficiency", "group_lower_bound", "group_efficiency")


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 90), max_size=120),
    max_len=st.integers(8, 40),
    long=st.one_of(st.none(), st.integers(1, 60)),
    budget=st.one_of(st.none(), st.integers(0, 200)),
    overlong=st.sampled_from(["truncate", "split", "drop"]),
    reserve=st.integers(0, 2),
    seed=st.integers(0, 3),
)
def test_metrics_of_an_assembled_plan_are_the_cores(lengths, max_len, long, budget, overlong,
                                                   reserve, seed):
    long_max_len = None if long is None else max_len + long
    group_tokens = None if budget is None else (long_max_len or max_len) + budget
    plan = fastpack.pack(lengths, max_len, overlong=overlong, reserve=reserve, seed=seed,
                         long_max_len=long_max_len, group_tokens=group_tokens)
    # The same arrays assembled in Python, as a joined or restored plan is: no metric given.
    fields = _fields(plan, long_max_len=plan.long_max_len, group_tokens=plan.group_tokens,
                     group_offsets=plan.group_offsets, group_fills=None)
    if plan.long_max_len is not None:
        fields["pack_caps"] = plan.pack_caps
    fields["buckets"] = [{"max_len": b.max_len, "num_sequences": b.num_sequences}
                         for b in plan.buckets]
    assembled = fastpack.Plan(fields)
    for name in METRICS:
        assert getattr(assembled, name) == getattr(plan, name), name
    assert assembled.buckets == plan.buckets
    if plan.group_fills is None:
        assert assembled.group_fills is None
    else:
        np.testing.assert_array_equal(assembled.group_fills, plan.group_fills)


def test_a_slice_of_a_plan_has_its_own_metrics():
    plan = fastpack.pack(np.arange(1, 40) % 13 + 1, 16, shuffle=False)
    lo, hi = int(plan.pack_offsets[2]), int(plan.pack_offsets[5])
    fields = _fields(plan, sample_ids=plan.sample_ids[lo:hi], starts=plan.starts[lo:hi],
                     seqlens=plan.seqlens[lo:hi], pack_offsets=plan.pack_offsets[2:6] - lo)
    fields["lower_bound"], fields["efficiency"] = plan.lower_bound, plan.efficiency
    part = fastpack.Plan(fields)
    tokens = int(plan.seqlens[lo:hi].sum())
    assert part.num_packs == 3 and part.total_tokens == tokens
    assert part.lower_bound == -(-tokens // 16) and part.efficiency == tokens / (3 * 16)
    assert part.buckets[0].num_packs == 3 and part.buckets[0].total_tokens == tokens


def test_a_step_sub_plan_has_its_own_metrics():
    from fastpack._plan import sub_plan

    plan = fastpack.pack(np.arange(1, 60) % 17 + 1, 32, seed=3)
    lo, hi = int(plan.pack_offsets[1]), int(plan.pack_offsets[3]) - 1  # a cut step
    sub = sub_plan(plan, 1, 3, lo, hi)
    tokens = int(plan.seqlens[lo:hi].sum())
    assert sub.num_packs == 2 and sub.total_tokens == tokens != plan.total_tokens
    assert sub.lower_bound == -(-tokens // 32) and sub.efficiency == tokens / (2 * 32)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), max_size=40), data=st.data())
def test_part_of_a_plan_is_a_plan_of_its_own(lengths: list[int], data: Any) -> None:
    # The one way to take part of a plan (a step, a gather pass, a Ray task's packs): its
    # segments, renamed or not, the plan's options, its own counts and metrics.
    from fastpack._plan import sub_plan

    plan = fastpack.pack(lengths, 8, overlong="truncate", long_max_len=16, seed=5)
    assume(plan.num_packs > 0)
    p0 = data.draw(st.integers(0, plan.num_packs - 1))
    p1 = data.draw(st.integers(p0 + 1, plan.num_packs))
    lo, hi = int(plan.pack_offsets[p0]), int(plan.pack_offsets[p1])
    rename = data.draw(st.booleans())
    ids = np.arange(hi - lo, dtype=np.int64)[::-1].copy() if rename else None
    part = sub_plan(plan, p0, p1, sample_ids=ids)
    assert part.sample_ids.tolist() == (ids if rename else plan.sample_ids[lo:hi]).tolist()
    assert part.seqlens.tolist() == plan.seqlens[lo:hi].tolist()
    assert part.pack_caps.tolist() == plan.pack_caps[p0:p1].tolist()
    assert part.options == plan.options.replace(group_tokens=None)
    assert part.num_sequences == hi - lo == sum(b.num_sequences for b in part.buckets)
    assert part.truncated_tokens == part.dropped_tokens == part.empty_sequences == 0
    tokens = int(plan.seqlens[lo:hi].sum())
    assert part.total_tokens == tokens
    assert part.efficiency == tokens / int(plan.pack_caps[p0:p1].sum())
    for b in part.buckets:
        mine = plan.pack_caps[p0:p1] == b.max_len
        assert b.num_packs == int(mine.sum())
        assert b.lower_bound == -(-b.total_tokens // b.max_len)
