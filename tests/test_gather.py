"""fastpack.gather: a plan's packs as packed Arrow record batches, read in place."""

from __future__ import annotations

import pytest

import fastpack

pa = pytest.importorskip("pyarrow")


def test_chunked_columns_and_separators() -> None:
    seqs = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    ids = pa.chunked_array([pa.array(seqs[:1], pa.list_(pa.int32())),
                            pa.array(seqs[1:], pa.list_(pa.int32()))])
    mask = pa.chunked_array([pa.array([[s > 4 for s in r] for r in seqs], pa.list_(pa.bool_()))])
    table = pa.table({"input_ids": ids, "mask": mask, "text": ["a", "b", "c", "d"]})
    plan = fastpack.pack([3, 2, 1, 4], 5, reserve=1, strategy="next_fit", shuffle=False)
    batches = list(fastpack.gather(plan, table, separator_id=0, batch_tokens=4))
    assert [b.num_rows for b in batches] == [1, 1, 1]
    out = pa.Table.from_batches(batches).to_pydict()
    assert out["input_ids"] == [[1, 2, 3, 0], [4, 5, 0, 6, 0], [7, 8, 9, 10, 0]]
    assert out["seq_lengths"] == [[4], [3, 2], [5]]
    assert out["mask"] == [[False] * 4, [False, True, False, True, False], [True] * 4 + [False]]
    assert out["position_ids"] == [[0, 1, 2, 3], [0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]
    assert "text" not in out


from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fastpack import FastpackError  # noqa: E402

VALUE_TYPES = [pa.int8(), pa.uint16(), pa.int32(), pa.uint64(), pa.float16(), pa.float32(),
               pa.float64(), pa.bool_()]


def _values(t: Any, row: int, n: int) -> list[Any]:
    if pa.types.is_boolean(t):
        return [(row + j) % 3 == 0 for j in range(n)]
    if pa.types.is_floating(t):
        return [float(np.float16((row * 7 + j) % 50 / 4)) for j in range(n)]
    return [(row * 7 + j) % 100 for j in range(n)]


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 30), min_size=1, max_size=25),
    value_type=st.sampled_from(VALUE_TYPES),
    list_kind=st.sampled_from(["list", "large_list", "fixed", "sliced"]),
    max_len=st.integers(32, 64),
    batch_tokens=st.integers(1, 100),
    threads=st.integers(1, 3),
)
def test_every_type_and_layout(lengths: list[int], value_type: Any, list_kind: str,
                               max_len: int, batch_tokens: int, threads: int) -> None:
    if list_kind == "fixed":
        lengths = [lengths[0] or 1] * len(lengths)
    ids = [[1000 * r + j + 1 for j in range(n)] for r, n in enumerate(lengths)]
    other = [_values(value_type, r, n) for r, n in enumerate(lengths)]
    if list_kind == "fixed":
        other_type = pa.list_(value_type, lengths[0])
    elif list_kind == "large_list":
        other_type = pa.large_list(value_type)
    else:
        other_type = pa.list_(value_type)
    other_array = pa.array(other, other_type)
    if list_kind == "sliced":  # a slice of a longer array, its child offset past 0 too
        padded = pa.array([[_values(value_type, 99, 3)[0]] * 3, *other], other_type)
        other_array = padded.slice(1)
    data = {"input_ids": pa.array(ids, pa.list_(pa.int64())), "other": other_array}
    plan = fastpack.pack(lengths, max_len, shuffle=True, seed=1)
    packs = np.arange(plan.num_packs)[::-1]
    gathered = fastpack.gather(plan, data, packs, batch_tokens=batch_tokens, threads=threads)
    schema = gathered.schema
    batches = list(gathered)
    assert all(b.schema.field("other").type.value_type == value_type for b in batches)
    for b in batches:  # whole packs, about batch_tokens each
        tokens = sum(len(r) for r in b.column("input_ids").to_pylist())
        assert b.num_rows == 1 or tokens - max_len < batch_tokens
    got = pa.Table.from_batches(batches, schema=schema).to_pydict()
    assert len(got["input_ids"]) == plan.num_packs
    for k, p in enumerate(packs):
        sample_ids, _, seqlens = plan.segments(int(p))
        assert got["seq_lengths"][k] == seqlens.tolist()
        assert got["input_ids"][k] == [t for i in sample_ids for t in ids[i]]
        assert got["other"][k] == [v for i in sample_ids for v in other[i]]
    one = list(fastpack.gather(plan, data, packs, batch_tokens=batch_tokens, threads=1))
    assert all(a.equals(b) for a, b in zip(one, batches))


def test_datasets_mapping_and_separator_values() -> None:
    datasets = pytest.importorskip("datasets")
    seqs = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    ds = datasets.Dataset.from_dict({
        "input_ids": seqs, "labels": seqs, "attention_mask": [[1] * len(s) for s in seqs],
        "w": [[0.5] * len(s) for s in seqs],
    }).select([3, 1])
    plan = fastpack.pack([4, 2], 8, reserve=1, strategy="next_fit", shuffle=False)
    out = pa.Table.from_batches(list(fastpack.gather(
        plan, ds, separator_id=0, separator_values={"w": 2.5}))).to_pydict()
    assert out["input_ids"] == [[7, 8, 9, 10, 0, 4, 5, 0]]
    assert out["labels"] == [[7, 8, 9, 10, -100, 4, 5, -100]]
    assert out["attention_mask"] == [[1] * 8]
    assert out["w"] == [[0.5] * 4 + [2.5] + [0.5] * 2 + [2.5]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "separator_id: the plan reserves 1 slot"),
        ({"separator_id": 0, "separator_values": {"nope": 1}},
         "separator_values: 'nope' is not a packed column"),
        ({"separator_id": 0, "separator_values": {"small": 300}},
         "separator_values: 300 for column 'small'"),
        ({"separator_id": 0, "batch_tokens": 0}, "batch_tokens: got 0"),
        ({"separator_id": 0, "packs": [9]}, "out of range"),
        ({"separator_id": 0, "columns": ["input_ids", "text"]}, "column 'text' is string"),
    ],
)
def test_errors(kwargs: dict[str, Any], message: str) -> None:
    table = pa.table({"input_ids": pa.array([[1, 2], [3]]),
                      "small": pa.array([[1, 2], [3]], pa.list_(pa.int8())), "text": ["a", "b"]})
    plan = fastpack.pack([2, 1], 8, reserve=1, shuffle=False)
    with pytest.raises(FastpackError, match=message):
        list(fastpack.gather(plan, table, **kwargs))


def test_written_columns_cannot_be_packed() -> None:
    table = pa.table({"input_ids": pa.array([[1, 2]]), "position_ids": pa.array([[0, 1]])})
    plan = fastpack.pack([2], 8, shuffle=False)
    with pytest.raises(FastpackError, match="'position_ids' is written by gather"):
        fastpack.gather(plan, table)
    out = next(fastpack.gather(plan, table, columns=["input_ids", "position_ids"],
                               position_ids=False))
    assert out.column("position_ids").to_pylist() == [[0, 1]]


def test_position_ids_are_int64_on_every_path() -> None:
    # One dtype from the plan to the model (docs/core.md#words): every path that writes
    # position ids writes int64, and the same values.
    from fastpack._offline.layout import output_schema
    from fastpack._offline.settings import PackSettings
    from fastpack._stream import StreamPacker

    seqs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    plan = fastpack.pack([len(s) for s in seqs], 6, strategy="next_fit", shuffle=False)
    want = [[0, 1, 2, 0, 1], [0, 1, 2, 3]]
    rows = fastpack.materialize(plan, seqs, layout="rows")
    assert rows["position_ids"].dtype == np.int64
    assert plan.position_ids(0).dtype == np.int64
    batch = next(fastpack.gather(plan, pa.table({"input_ids": seqs})))
    assert batch.schema.field("position_ids").type == pa.list_(pa.int64())
    assert batch.column("position_ids").to_pylist() == want
    packer = StreamPacker(6, strategy="next_fit", shuffle=False)
    flat = np.concatenate([np.asarray(s) for s in seqs])
    offsets = np.cumsum([0] + [len(s) for s in seqs])
    rnd = packer.push({"input_ids": (flat, offsets)}, final=True)
    gathered = rnd.gather(rnd.take(rnd.remaining))
    assert gathered.position_ids is not None and gathered.position_ids.dtype == np.int64
    schema = output_schema(PackSettings(6), {"input_ids": "int32"})  # fastpack pack's shards
    assert schema.field("position_ids").type == pa.list_(pa.int64())
    datasets = pytest.importorskip("datasets")
    from fastpack.hf import pack_dataset

    table = datasets.Dataset.from_dict({"input_ids": seqs})
    for packed in (pack_dataset(table, 6, strategy="next_fit", shuffle=False, position_ids=True),
                   pack_dataset(table.to_iterable_dataset(), 6, strategy="next_fit",
                                shuffle=False, position_ids=True)):
        assert packed.features.arrow_schema.field("position_ids").type == pa.list_(pa.int64())
        assert [r["position_ids"] for r in packed] == want
