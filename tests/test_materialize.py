"""fastpack.materialize: rows from a plan and token data (no torch needed)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastpack
from fastpack import IGNORE_INDEX, FastpackError

SEP = -7


def _seqs(lengths: list[int]) -> list[list[int]]:
    # Token ids encode (sequence, position) and are all > 0, so pad (0) and SEP differ.
    return [[1000 * i + j + 1 for j in range(n)] for i, n in enumerate(lengths)]


def _kept(lengths: list[int], max_len: int, reserve: int, overlong: str) -> list[int]:
    kept = []
    for s in _seqs(lengths):
        if len(s) + reserve <= max_len or overlong == "split":
            kept += s
        elif overlong == "truncate":
            kept += s[: max_len - reserve]
    return sorted(kept)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 50), max_size=40),
    max_len=st.integers(8, 64),
    reserve=st.integers(0, 2),
    overlong=st.sampled_from(["split", "truncate", "drop"]),
    strategy=st.sampled_from(["bfd", "next_fit", "wrapped"]),
    layout=st.sampled_from(["flat", "rows"]),
    multiple=st.sampled_from([None, 1, 8]),
    masked=st.booleans(),
)
def test_properties(
    lengths: list[int], max_len: int, reserve: int, overlong: str, strategy: str,
    layout: str, multiple: int | None, masked: bool,
) -> None:
    plan = fastpack.pack(lengths, max_len, reserve=reserve, overlong=overlong, strategy=strategy)
    seqs = _seqs(lengths)
    mask = [[(j % 3) != 0 for j in range(n)] for n in lengths] if masked else None
    packs = np.arange(plan.num_packs)[::-1].copy()
    kwargs = dict(loss_mask=mask, separator_id=SEP if reserve else None, layout=layout,
                  pad_to_multiple_of=multiple)
    out = fastpack.materialize(plan, seqs, packs, threads=1, **kwargs)
    many = fastpack.materialize(plan, seqs, packs, threads=3, **kwargs)
    for key, value in out.items():
        np.testing.assert_array_equal(value, many[key])  # thread-count independent

    ids, pos, labels, seq_idx = (out[k] for k in ("input_ids", "position_ids", "labels", "seq_idx"))
    cu = out["cu_seqlens"]
    assert ids.dtype == pos.dtype == labels.dtype == np.int64
    assert cu.dtype == seq_idx.dtype == np.int32
    # Every kept token appears exactly once (wrapped ignores the overlong policy).
    policy = "split" if strategy == "wrapped" else overlong
    assert sorted(ids[ids > 0].tolist()) == _kept(lengths, max_len, reserve, policy)
    # cu_seqlens tiles every row; positions restart; first label of a segment is -100.
    assert cu[0] == 0 and cu[-1] == ids.size and (np.diff(cu) > 0).all()
    flat_pos, flat_labels, flat_seq = pos.reshape(-1), labels.reshape(-1), seq_idx.reshape(-1)
    starts = cu[:-1]
    assert (flat_pos[starts] == 0).all()
    assert (flat_labels[starts] == IGNORE_INDEX).all()
    expected_pos = np.arange(ids.size) - np.repeat(starts, np.diff(cu))
    np.testing.assert_array_equal(flat_pos, expected_pos)
    assert out["max_seqlen"] == np.diff(cu).max(initial=0)
    assert (flat_seq[starts[1:]] != flat_seq[starts[1:] - 1]).all() or layout == "rows"
    # Labels: the token itself, except segment starts, masked tokens, separators, padding.
    flat_ids = ids.reshape(-1)
    is_target = flat_labels != IGNORE_INDEX
    np.testing.assert_array_equal(flat_labels[is_target], flat_ids[is_target])
    assert not is_target[flat_ids <= 0].any()
    if masked:  # masked tokens (j % 3 == 0, j = id % 1000 - 1) are never targets
        real = flat_ids > 0
        assert not is_target[real & ((flat_ids % 1000 - 1) % 3 == 0)].any()
    assert out["num_targets"] == is_target.sum()
    assert out["total_tokens"] == plan.total_tokens == (flat_ids != 0).sum()
    # Rows layout: one pack per row, all the same width.
    if layout == "rows":
        assert ids.shape[0] == plan.num_packs
        assert ids.shape[1] % (multiple or 1) == 0


def test_example_and_separators() -> None:
    seqs = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]]
    plan = fastpack.pack([3, 2, 5], 8, reserve=1)
    out = fastpack.materialize(plan, seqs, separator_id=99, pad_to_multiple_of=4)
    assert out["input_ids"].tolist() == [[6, 7, 8, 9, 10, 99, 1, 2, 3, 99, 4, 5, 99, 0, 0, 0]]
    assert out["labels"].tolist() == [
        [-100, 7, 8, 9, 10, -100, -100, 2, 3, -100, -100, 5, -100, -100, -100, -100]
    ]
    assert out["cu_seqlens"].tolist() == [0, 6, 10, 13, 16]
    trained = fastpack.materialize(plan, seqs, separator_id=99, train_separators=True)
    assert trained["labels"].tolist()[0][:6] == [-100, 7, 8, 9, 10, 99]


def test_labels_and_spans() -> None:
    seqs = [[1, 2, 3, 4], [5, 6]]
    plan = fastpack.pack([4, 2], 8, strategy="next_fit")
    labels = [[11, 12, 13, 14], [15, 16]]
    mask = fastpack.loss_mask_from_spans([4, 2], [[(2, 4)], []])
    out = fastpack.materialize(plan, seqs, labels=labels, loss_mask=mask)
    assert out["labels"].tolist() == [[-100, -100, 13, 14, -100, -100]]


def test_input_kinds_agree() -> None:
    pa = pytest.importorskip("pyarrow")
    datasets = pytest.importorskip("datasets")
    seqs = _seqs([3, 0, 5, 2, 7])
    plan = fastpack.pack([len(s) for s in seqs], 8)
    want = fastpack.materialize(plan, seqs)
    flat = np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs if s])
    offsets = np.concatenate(([0], np.cumsum([len(s) for s in seqs]))).astype(np.int32)
    arrow = pa.array(seqs, type=pa.list_(pa.int32()))
    sliced = pa.array([[42], *seqs], type=pa.list_(pa.int64())).slice(1)
    ds = datasets.Dataset.from_dict({"input_ids": seqs, "m": [[1] * len(s) for s in seqs]})
    for tokens in (
        (flat, offsets), [np.asarray(s) for s in seqs], arrow, sliced,
        pa.chunked_array([arrow.slice(0, 2), arrow.slice(2)]), ds, ds["input_ids"],
    ):
        got = fastpack.materialize(plan, tokens)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=str(type(tokens)))
    # datasets read in place: no copy of the token buffer.
    ragged = fastpack.as_ragged(ds)
    assert ragged.values.dtype == np.int32 and not ragged.values.flags.owndata
    np.testing.assert_array_equal(
        fastpack.materialize(plan, ds, loss_mask="m")["labels"], want["labels"]
    )
    # A shuffled / selected dataset is read in its own row order.
    rev = ds.select(range(len(seqs))[::-1])
    plan_rev = fastpack.pack(fastpack.as_ragged(rev).lengths, 8, strategy="next_fit", shuffle=False)
    got = fastpack.materialize(plan_rev, rev)["input_ids"]
    assert got[got > 0].tolist() == [t for s in seqs[::-1] for t in s]


def _owner(array: np.ndarray) -> object:
    """What finally holds an array's memory: follows numpy views to the first non-array."""
    while isinstance(array, np.ndarray):
        assert not array.flags.owndata, "a numpy copy: the buffer did not come from Rust"
        array = array.base
    return array


@pytest.mark.parametrize(
    ("tokens", "kwargs", "message"),
    [
        ((np.array([1, 2, 3, 4, 5]), np.array([0, 3, 2, 5])), {}, "monotone"),
        ((np.array([1, 2, 3, 4, 5]), np.array([0, 3, 9])), {}, "past the end"),
        ((np.array([1, 2, 3]), np.array([0, 3])), {}, "token data has 1 sequences"),
        ((np.arange(1, 7), np.array([0, 4, 6])), {}, "whole sequence"),
        ([[1, 2, 3], [4, 5]], {"labels": [[1, 2, 3], [4]]}, "column .labels.: row 1 has 1 values"),
        ([[1, 2, 3], [4, 5]], {"pad_to": 3}, "more than the row width"),
        ([[1, 2, 3], [4, 5]], {"layout": "cols"}, "layout"),
        ([[1, 2, 3], [4, 5]], {"packs": [5]}, "out of range"),
        # More label or mask rows than sequences: refused, as gather refuses them.
        ([[1, 2, 3], [4, 5]], {"labels": [[1, 2, 3], [4, 5], [6]]},
         "column 'labels' has 3 rows, but the tokens have 2"),
        ([[1, 2, 3], [4, 5]], {"loss_mask": [[1, 1, 1], [1, 1], [1]]},
         "column 'loss_mask' has 3 rows, but the tokens have 2"),
    ],
)
def test_errors(tokens: object, kwargs: dict[str, object], message: str) -> None:
    plan = fastpack.pack([3, 2], 8)
    with pytest.raises(FastpackError, match=message):
        fastpack.materialize(plan, tokens, **kwargs)  # type: ignore[arg-type]


def test_a_batch_of_a_big_plan_holds_exactly_its_packs() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, 200_000)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    values = rng.integers(1, 30000, int(offsets[-1]), dtype=np.int32)
    plan = fastpack.pack(lengths, 1024, shuffle=True)
    out = fastpack.materialize(plan, (values, offsets), [0, 1, 2, 3], layout="rows")
    assert out["input_ids"].shape[0] == 4 and out["total_tokens"] == plan.pack_fills[:4].sum()


def _plan_with(plan: fastpack.Plan, **arrays: np.ndarray) -> fastpack.Plan:
    fields = {name: getattr(plan, name) for name in fastpack.Plan._FIELDS}
    fields.update(arrays)
    # Unchecked, as the core's own plans are (Plan() would refuse broken arrays): what
    # materialize reads, it checks itself.
    return fastpack.Plan._from_core(fields)


def test_a_call_checks_only_the_packs_it_reads() -> None:
    lengths = [3, 2, 4, 1, 5, 2]
    plan = fastpack.pack(lengths, 5, strategy="next_fit")
    offsets = plan.pack_offsets.copy()
    offsets[-2] = offsets[-1] + 7  # the last two packs are broken, the others are not
    broken = _plan_with(plan, pack_offsets=offsets)
    seqs = _seqs(lengths)
    good = fastpack.materialize(broken, seqs, [0, 1])
    np.testing.assert_array_equal(good["input_ids"], fastpack.materialize(plan, seqs, [0, 1])["input_ids"])
    with pytest.raises(FastpackError, match="pack_offsets of pack"):
        fastpack.materialize(broken, seqs, [plan.num_packs - 1])


def test_arrow_chunks_are_read_in_place() -> None:
    pa = pytest.importorskip("pyarrow")
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 200, 4000)
    seqs = [rng.integers(1, 30000, n).astype(np.int32) for n in lengths]
    whole = pa.array(seqs, pa.list_(pa.int32()))
    chunked = pa.chunked_array([whole.slice(a, 500) for a in range(0, len(seqs), 500)])
    table = pa.table({"input_ids": chunked, "labels": chunked})
    ds = datasets.Dataset(datasets.table.InMemoryTable(table)).shuffle(seed=0)
    order = ds._indices.column(0).to_numpy()
    for source, rows in ((chunked, np.arange(len(seqs))), (table, np.arange(len(seqs))),
                         (ds, order)):
        ragged = fastpack.as_ragged(source)
        assert ragged.num_chunks == 8
        np.testing.assert_array_equal(ragged.lengths, lengths[rows])
        plan = fastpack.pack(ragged.lengths, 512, shuffle=True)
        before = pa.total_allocated_bytes()
        out = fastpack.materialize(plan, source, [3, 1], layout="rows")
        # No concatenation, no take through the mapping: nothing near the data's size.
        assert pa.total_allocated_bytes() - before < 64 << 10
        want = []
        for p in (3, 1):
            ids, _, _ = plan.segments(p)
            want.append(np.concatenate([seqs[rows[i]] for i in ids]))
        for row, w in zip(out["input_ids"], want):
            np.testing.assert_array_equal(row[: len(w)], w)
        assert fastpack.as_ragged(source) is ragged  # per-chunk work done once per source
        np.testing.assert_array_equal(ragged[5], seqs[rows[5]])


def test_parquet_columns(tmp_path: object) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    seqs = _seqs([3, 0, 5, 2, 7, 4])
    table = pa.table({"input_ids": pa.array(seqs, pa.list_(pa.int64())),
                      "text": [str(s) for s in seqs]})
    path = f"{tmp_path}/part-0.parquet"
    pq.write_table(table, path, row_group_size=2)
    plan = fastpack.pack([len(s) for s in seqs], 8)
    want = fastpack.materialize(plan, seqs)
    for source in (path, [path], str(tmp_path)):
        ragged = fastpack.as_ragged(source)
        assert ragged.num_chunks == 3
        got = fastpack.materialize(plan, source)
        for key in ("input_ids", "labels", "position_ids"):
            np.testing.assert_array_equal(got[key], want[key])
    with pytest.raises(FastpackError, match="'tokens' not in the parquet data"):
        fastpack.as_ragged(path, column="tokens")


def test_any_integer_width_and_float_masks() -> None:
    seqs = _seqs([3, 2])
    plan = fastpack.pack([3, 2], 8, strategy="next_fit")
    want = fastpack.materialize(plan, seqs)
    for dtype in (np.int16, np.uint16, np.int32, np.uint32, np.int64):
        flat = np.concatenate([np.asarray(s, dtype=dtype) for s in seqs])
        got = fastpack.materialize(plan, (flat, np.array([0, 3, 5])))
        np.testing.assert_array_equal(got["input_ids"], want["input_ids"])
    mask = (np.array([0.0, 1.0, 0.5, -0.0, 2.0], dtype=np.float32), np.array([0, 3, 5]))
    got = fastpack.materialize(plan, seqs, loss_mask=mask)
    assert got["labels"].tolist() == [[-100, 2, 3, -100, 1002]]
    with pytest.raises(fastpack.FastpackTypeError, match="expected integers"):
        fastpack.materialize(plan, (np.zeros(5, dtype=np.float32), np.array([0, 3, 5])))


def test_ragged_indexing_is_python_s_on_every_source() -> None:
    pa = pytest.importorskip("pyarrow")
    sources = [fastpack.Ragged(np.arange(5), [0, 2, 5]),
               fastpack.as_ragged(pa.chunked_array([pa.array([[0, 1]]), pa.array([[2, 3, 4]])]))]
    for ragged in sources:
        assert ragged[-1].tolist() == ragged[1].tolist() == [2, 3, 4]
        assert ragged[-2].tolist() == ragged[np.int64(0)].tolist() == [0, 1]
        for i in (2, -3):
            with pytest.raises(FastpackError, match=f"index: row {i} out of range; the data "
                                                    f"has 2 rows"):
                ragged[i]
        with pytest.raises(fastpack.FastpackTypeError, match="index: expected an int"):
            ragged[0.5]  # type: ignore[index]


def test_target_count_refuses_the_segments_materialize_refuses() -> None:
    """One definition of what a segment holds: a segment that is not a truncation of its
    sequence, or a partial segment under the error policy, used to be counted by the
    target count's own copy of the rule while materialize refused it."""
    from fastpack._targets import segment_targets

    tokens = fastpack.Ragged(np.arange(10, dtype=np.int32), [0, 10])
    base = fastpack.pack([10], 16)
    for overlong, start, why in (("truncate", 3, "is not a truncation"),
                                 ("error", 0, "does not cover its whole sequence")):
        fields = {name: getattr(base, name) for name in fastpack.Plan._FIELDS}
        fields.update(starts=np.array([start]), seqlens=np.array([4], dtype=np.int32),
                      overlong=overlong)
        plan = fastpack.Plan(fields)
        with pytest.raises(FastpackError, match=why):
            fastpack.materialize(plan, tokens)
        with pytest.raises(FastpackError, match=why):
            segment_targets(plan, tokens)


def test_a_resized_array_under_a_ragged_is_refused() -> None:
    """Ragged reads the user's numpy arrays in place; ``resize(refcheck=False)`` frees the
    buffer under it, which every later read must refuse instead of reading freed memory."""
    values = np.arange(10, dtype=np.int64)
    tokens = fastpack.Ragged(values, [0, 4, 10])
    plan = fastpack.pack(tokens.lengths, 16)
    assert fastpack.materialize(plan, tokens)["total_tokens"] == 10
    values.resize(1 << 20, refcheck=False)
    with pytest.raises(FastpackError, match="tokens: an array this column reads was resized"):
        fastpack.materialize(plan, tokens)
