"""fastpack.hf.pack_dataset: Hugging Face datasets packed in Rust, TRL-compatible."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastpack
from fastpack import FastpackError

pa = pytest.importorskip("pyarrow")
datasets = pytest.importorskip("datasets")
from fastpack.hf import pack_dataset  # noqa: E402

SEP = -1


def _token(row: int, j: int) -> int:
    # Every token names its (physical) row and position, and is > 0.
    return 1000 * row + j + 1


def _table(lengths: list[int], token_type: Any, cuts: list[int], large: bool) -> Any:
    """Rows of the given lengths with four per-token columns of different types, cut into
    chunks at ``cuts`` (each chunk a slice of a bigger array, so offsets start past 0)."""
    rows = [[_token(r, j) for j in range(n)] for r, n in enumerate(lengths)]
    list_of = pa.large_list if large else pa.list_
    table = pa.table({
        "input_ids": pa.array(rows, list_of(token_type)),
        "labels": pa.array([[-t for t in row] for row in rows], pa.list_(pa.int64())),
        "mask": pa.array([[(t % 3) == 0 for t in row] for row in rows], pa.list_(pa.bool_())),
        "weight": pa.array([[np.float16((t % 7) / 4) for t in row] for row in rows],
                           pa.list_(pa.float16())),
        "text": [f"row {r}" for r in range(len(lengths))],
    })
    bounds = sorted({0, len(lengths), *[c for c in cuts if 0 < c < len(lengths)]})
    pieces = [table.slice(a, b - a) for a, b in zip(bounds, bounds[1:])]
    return pa.concat_tables(pieces) if pieces else table


def _dataset(table: Any, mapping: str, seed: int) -> Any:
    ds = datasets.Dataset(datasets.table.InMemoryTable(table))
    n = len(ds)
    if mapping == "shuffle":
        ds = ds.shuffle(seed=seed)
    elif mapping == "select" and n:
        rng = np.random.default_rng(seed)
        ds = ds.select(rng.permutation(n)[: max(1, n - 2)])
    return ds


def _check(packed: Any, ds: Any, max_len: int, reserve: int, strategy: str,
           overlong: str) -> None:
    """Every packed row holds exactly its segments' values, in order, in every column;
    every kept token of every dataset row appears once; separators only close rows."""
    out = packed.data.table.to_pydict() if hasattr(packed.data, "table") else packed.to_dict()
    logical = ds.to_dict()
    wrapped = strategy == "wrapped"
    lengths = {(row[0] - 1) // 1000: len(row) for row in logical["input_ids"] if row}
    pieces: dict[int, list[tuple[int, int]]] = {}
    separators = 0
    for k in range(len(out["input_ids"])):
        ids, seq_lengths = out["input_ids"][k], out["seq_lengths"][k]
        assert sum(seq_lengths) == len(ids) <= max_len
        assert all(n > 0 for n in seq_lengths)
        if "position_ids" in out:
            assert out["position_ids"][k] == [p for n in seq_lengths for p in range(n)]
        at = 0
        for n in seq_lengths:
            seg = slice(at, at + n)
            at += n
            seg_ids = ids[seg]
            data = [t for t in seg_ids if t != SEP]
            assert seg_ids == data + [SEP] * (n - len(data)), "separators close a segment"
            separators += n - len(data)
            labels = out["labels"][k][seg]
            assert labels == [-t for t in data] + [-100] * (n - len(data))
            assert out["mask"][k][seg] == [(t % 3) == 0 for t in data] + [False] * (n - len(data))
            assert out["weight"][k][seg] == [float(np.float16((t % 7) / 4)) for t in data] + [
                0.0] * (n - len(data))
            if not data:
                continue
            row, start = (data[0] - 1) // 1000, (data[0] - 1) % 1000
            assert data == [_token(row, start + j) for j in range(len(data))], "contiguous"
            assert row in lengths, "only rows of the dataset (through its mapping) are packed"
            pieces.setdefault(row, []).append((start, len(data)))
    kept_rows = 0
    for row, n in lengths.items():
        over = n + reserve > max_len and not wrapped
        got = sorted(pieces.get(row, []))
        covered = [j for start, m in got for j in range(start, start + m)]
        if over and overlong == "drop":
            assert not got
            continue
        kept_rows += 1
        want = n if not over or overlong == "split" else max_len - reserve
        assert covered == list(range(want)), f"row {row}: every kept token once"
    assert separators == reserve * kept_rows
    assert "text" not in out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(0, 40), max_size=30),
    cuts=st.lists(st.integers(0, 30), max_size=3),
    token_type=st.sampled_from([pa.int32(), pa.int64()]),
    large=st.booleans(),
    mapping=st.sampled_from(["none", "shuffle", "select"]),
    max_len=st.integers(8, 48),
    reserve=st.integers(0, 1),
    strategy=st.sampled_from(["bfd", "ffd", "next_fit", "wrapped", "bfd_split"]),
    overlong=st.sampled_from(["error", "truncate", "split", "drop"]),
    seed=st.integers(0, 3),
    positions=st.booleans(),
)
def test_rows_hold_exactly_their_segments(
    lengths: list[int], cuts: list[int], token_type: Any, large: bool, mapping: str,
    max_len: int, reserve: int, strategy: str, overlong: str, seed: int, positions: bool,
) -> None:
    ds = _dataset(_table(lengths, token_type, cuts, large), mapping, seed)
    if strategy == "bfd_split":
        overlong = "split" if overlong in ("error", "split") else overlong
        if overlong != "split":
            with pytest.raises(FastpackError, match="contradicts"):
                pack_dataset(ds, max_len, strategy=strategy, overlong=overlong)
            return
    rows = [len(r) for r in ds["input_ids"]]
    too_long = [i for i, n in enumerate(rows) if n + reserve > max_len]
    kwargs = dict(strategy=strategy, overlong=overlong, reserve=reserve,
                  separator_id=SEP if reserve else None, shuffle=seed % 2 == 1, seed=seed,
                  position_ids=positions,
                  # wrapped rows keep their documents' boundaries only when asked
                  seq_lengths=True if strategy == "wrapped" else None)
    if overlong == "error" and too_long and strategy != "wrapped":
        with pytest.raises(FastpackError, match=f"column 'input_ids'.*first at row {too_long[0]}"):
            pack_dataset(ds, max_len, **kwargs)
        return
    packed = pack_dataset(ds, max_len, **kwargs, threads=1)
    assert packed.features["input_ids"].feature.dtype == str(token_type)
    assert packed.data.table.schema.field("seq_lengths").type == pa.list_(pa.int32())
    assert ("position_ids" in packed.column_names) == positions
    _check(packed, ds, max_len, reserve, "wrapped" if strategy == "wrapped" else "bfd",
           "split" if strategy == "bfd_split" else overlong)
    again = pack_dataset(ds, max_len, **kwargs, threads=3)
    assert again.data.table.equals(packed.data.table), "the same on any thread count"


def _segments(packed: Any, columns: tuple[str, ...]) -> Counter[tuple[Any, ...]]:
    """The multiset of packed segments: each one's values in every column."""
    data = packed.with_format(None).to_dict()
    out: Counter[tuple[Any, ...]] = Counter()
    for k, seq_lengths in enumerate(data["seq_lengths"]):
        at = 0
        for n in seq_lengths:
            out[tuple(tuple(data[c][k][at:at + n]) for c in columns)] += 1
            at += n
    return out


@pytest.mark.parametrize(("trl_strategy", "overlong"), [("bfd", "truncate"),
                                                         ("bfd_split", "split")])
def test_same_segments_as_trl(trl_strategy: str, overlong: str) -> None:
    trl = pytest.importorskip("trl")
    rng = np.random.default_rng(0)
    lengths = [*rng.integers(1, 90, 2500).tolist(), 0, 300, 129]  # over max_len too
    table = _table(lengths, pa.int32(), [700, 1900], False).drop_columns(["text", "weight"])
    ds = _dataset(table, "shuffle", 1)
    theirs = trl.pack_dataset(ds, 128, strategy=trl_strategy)
    ours = pack_dataset(ds, 128, strategy="bfd", overlong=overlong)
    columns = ("input_ids", "labels", "mask")
    assert _segments(ours, columns) == _segments(theirs, columns)
    # TRL's columns by default: the same names, order and types (no position_ids).
    assert ours.features == theirs.features
    assert ours.data.table.schema.equals(theirs.data.table.schema, check_metadata=False)
    # One plan over every row: no more packs than TRL's 1,000-row windows.
    assert len(ours) <= len(theirs)


def test_trl_collator_reads_the_packed_rows() -> None:
    pytest.importorskip("torch")
    sft = pytest.importorskip("trl.trainer.sft_trainer")
    lengths = [5, 3, 7, 2, 6, 4]
    ds = _dataset(_table(lengths, pa.int64(), [], False), "none", 0)
    collate = sft.DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    packed = pack_dataset(ds, 12, columns=["input_ids", "labels"])
    assert packed.column_names == ["input_ids", "labels", "seq_lengths"]
    rows = [packed[i] for i in range(len(packed))]
    batch = collate(rows)
    # The collator builds the positions from seq_lengths: what position_ids=True writes.
    with_positions = pack_dataset(ds, 12, columns=["input_ids", "labels"], position_ids=True)
    assert with_positions.column_names == [*packed.column_names, "position_ids"]
    ours = [p for i in range(len(packed)) for p in with_positions[i]["position_ids"]]
    assert batch["position_ids"][0].tolist() == ours
    boundaries = np.cumsum([0] + [n for r in rows for n in r["seq_lengths"]])
    assert batch["cu_seq_lens_q"].tolist() == boundaries.tolist()


def test_dataset_dict_format_and_cache_file(tmp_path: Any) -> None:
    lengths = [5, 3, 7, 2, 6, 4, 9]
    table = _table(lengths, pa.int32(), [3], False)
    ds = datasets.Dataset(datasets.table.InMemoryTable(table))
    ds.save_to_disk(str(tmp_path / "ds"))
    on_disk = datasets.load_from_disk(str(tmp_path / "ds")).with_format("numpy")
    assert on_disk.cache_files
    dd = datasets.DatasetDict({"train": on_disk, "test": ds.select([0, 2])})
    packed = pack_dataset(dd, 10, columns=["input_ids", "labels"])
    assert set(packed) == {"train", "test"}
    train = packed["train"]
    assert train.cache_files and "fastpack-packed-" in train.cache_files[0]["filename"]
    assert train.format["type"] == "numpy"
    assert isinstance(train[0]["input_ids"], np.ndarray)
    assert sum(len(r) for r in packed["test"]["input_ids"]) == 5 + 7
    assert "Packed by fastpack" in train.info.description
    in_memory = pack_dataset(on_disk, 10, columns=["input_ids"], keep_in_memory=True)
    assert not in_memory.cache_files
    assert in_memory.with_format(None)["input_ids"] == train.with_format(None)["input_ids"]


def test_counts_are_logged_and_described(caplog: pytest.LogCaptureFixture) -> None:
    ds = _dataset(_table([3, 30, 4, 25], pa.int32(), [], False), "none", 0)
    with caplog.at_level("INFO", logger="fastpack"):
        packed = pack_dataset(ds, 10, overlong="truncate", columns=["input_ids"])
    record = caplog.records[-1]
    assert record.levelname == "WARNING"
    assert "truncated 35 tokens (2 sequences)" in record.getMessage()
    assert "truncated 35 tokens" in packed.info.description
    # Left out, and said so.
    assert ("columns not packed: labels (not in columns), mask (not in columns), weight (not in "
            "columns), text (not one number per token)") in packed.info.description


def test_separators_go_to_the_token_column_and_fit_their_types() -> None:
    ds = _bad(tokens=[[5, 6], [7]], labels=pa.array([[5, 6], [7]], pa.list_(pa.uint32())))
    packed = pack_dataset(ds, 8, reserve=1, separator_id=2, strategy="next_fit",
                          columns=["tokens"])
    assert packed["tokens"] == [[5, 6, 2, 7, 2]]
    # Without reserved slots, no separator is written, so -100 need not fit uint32 labels.
    assert pack_dataset(ds, 8, strategy="next_fit")["labels"] == [[5, 6, 7]]
    with pytest.raises(FastpackError, match="separator_values: -100 for column 'labels'"):
        pack_dataset(ds, 8, reserve=1, separator_id=2)
    with pytest.raises(FastpackError, match="reserve: got 1 reserved slots but no separator_id"):
        pack_dataset(ds, 8, reserve=1)


def test_a_separator_reserves_one_slot_and_reserve_0_refuses_it() -> None:
    ds = _bad(input_ids=[[5, 6], [7]])
    # The team rule, on both paths: separator_id alone means reserve=1.
    for source in (ds, ds.to_iterable_dataset()):
        packed = pack_dataset(source, 8, separator_id=2, strategy="next_fit", shuffle=False)
        assert [r["input_ids"] for r in packed] == [[5, 6, 2, 7, 2]]
        assert [r["seq_lengths"] for r in packed] == [[3, 2]]
        with pytest.raises(FastpackError, match="reserve: 0 with separator_id=2"):
            pack_dataset(source, 8, separator_id=2, reserve=0)
    assert pack_dataset(ds, 8, separator_id=2, reserve=2, strategy="next_fit",
                        shuffle=False)["input_ids"] == [[5, 6, 2, 2, 7, 2, 2]]


def test_groups_and_buckets() -> None:
    lengths = [5, 3, 7, 2, 6, 4, 9, 30, 25]
    ds = _dataset(_table(lengths, pa.int32(), [], False), "none", 0)
    packed = pack_dataset(ds, 10, long_max_len=32, group_tokens=40, columns=["input_ids"])
    groups = packed["group"]
    assert groups == sorted(groups) and groups[0] == 0
    per_group = Counter()
    for g, row in zip(groups, packed["input_ids"]):
        per_group[g] += len(row)
    assert max(per_group.values()) <= 40
    assert sorted(len(r) for r in packed["input_ids"])[-2:] == [25, 30]


def _bad(**columns: Any) -> Any:
    return datasets.Dataset.from_dict(columns)


@pytest.mark.parametrize(
    ("data", "kwargs", "message"),
    [
        ({"input_ids": [[1, 2], [3, 4, 5]], "labels": [[1, 2], [3, 4]]}, {},
         "column 'labels': row 1 has 2 values, but 'input_ids' has 3"),
        ({"input_ids": [[1, 2], [3]], "text": ["a", "b"]}, {"columns": ["input_ids", "text"]},
         "column 'text' is string, not a list per token \\(row 0 is 'a'\\)"),
        ({"input_ids": [[1, 2], [3]], "nested": [[[1], [2]], [[3]]]},
         {"columns": ["input_ids", "nested"]}, "column 'nested' holds nested lists"),
        ({"input_ids": [[1, 2], None, [3]]}, {}, "column 'input_ids': row 1 is null"),
        ({"input_ids": [[1, 2], [3, None]]}, {}, "column 'input_ids': row 1 holds a null"),
        ({"input_ids": [[1, 2], [3]]}, {"columns": ["input_ids", "nope"]}, "'nope' not in"),
        ({"input_ids": [[1, 2], [3]]}, {"columns": ["input_ids", "seq_lengths"]},
         "'seq_lengths' is written by pack_dataset"),
        ({"input_ids": [[1, 2], [3]]}, {"reserve": 1}, "separator_id"),
        ({"input_ids": [[1, 2], [3]]}, {"strategy": "best"}, "strategy: unknown value"),
        ({"text": ["a"]}, {}, "no column holds a list of numbers"),
    ],
)
def test_bad_input_names_the_column_and_row(data: dict[str, Any], kwargs: dict[str, Any],
                                            message: str) -> None:
    with pytest.raises(FastpackError, match=message):
        pack_dataset(_bad(**data), 8, **kwargs)


def test_nulls_in_rows_the_mapping_skips_are_fine() -> None:
    ds = _bad(input_ids=[[1, 2], None, [3]], labels=[[1, 2], [5], [3]])
    packed = pack_dataset(ds.select([2, 0]), 8)
    assert sorted(packed["input_ids"][0]) == [1, 2, 3]
    with pytest.raises(FastpackError, match="column 'input_ids': row 1 is null"):
        pack_dataset(ds.select([0, 1]), 8)  # row 1 of the selection is physical row 1
    # Rows are named as the dataset shows them: through the mapping.
    with pytest.raises(FastpackError, match="column 'input_ids': row 2 is null"):
        pack_dataset(ds.select([0, 2, 1]), 8)


def test_iterable_datasets_go_to_the_stream_packer() -> None:
    ds = _bad(input_ids=[[1, 2], [3], [4, 5, 6, 7], [8, 9, 10]])
    stream = ds.to_iterable_dataset(num_shards=2)
    packed = pack_dataset(stream, 4, strategy="bfd_split", buffer_size=8)
    assert isinstance(packed, datasets.IterableDataset)
    rows = list(packed)
    assert sorted(t for r in rows for t in r["input_ids"]) == list(range(1, 11))
    assert all(sum(r["seq_lengths"]) == len(r["input_ids"]) <= 4 for r in rows)
    assert all(set(r) == {"input_ids", "seq_lengths"} for r in rows)
    with_positions = list(pack_dataset(stream, 4, strategy="bfd_split", position_ids=True))
    assert all(r["position_ids"] == [p for n in r["seq_lengths"] for p in range(n)]
               for r in with_positions)
    # Options reach the stream packer: theirs, not a default.
    with pytest.raises(FastpackError, match=r"input_ids: sample \d of the stream has 4 tokens"):
        list(pack_dataset(stream, 3, strategy="ffd", buffer_size=8))
    assert len(list(pack_dataset(stream, 3, overlong="drop", buffer_size=8))) == 2
    both = pack_dataset(datasets.IterableDatasetDict({"a": stream, "b": stream}), 16)
    assert set(both) == {"a", "b"}
    assert sorted(t for r in both["b"] for t in r["input_ids"]) == list(range(1, 11))
    with pytest.raises(FastpackError, match="group_tokens: got 8"):
        pack_dataset(stream, 16, group_tokens=8)
    with pytest.raises(FastpackError, match="buffer_size: applies to a streamed"):
        pack_dataset(_bad(input_ids=[[1]]), 16, buffer_size=100)


def test_fastpack_hf_is_lazy() -> None:
    assert fastpack.hf.pack_dataset is pack_dataset


def test_trl_keywords_are_accepted() -> None:
    ds = _dataset(_table([5, 3, 7, 2, 6, 4, 9], pa.int32(), [], False), "none", 0)
    want = pack_dataset(ds, 10, "bfd_split").to_dict()
    # TRL's spelling: seq_length=, strategy positional or by name, map_kwargs=.
    assert pack_dataset(ds, seq_length=10, strategy="bfd_split").to_dict() == want
    got = pack_dataset(ds, seq_length=10, map_kwargs={"num_proc": 2, "desc": "packing",
                                                       "load_from_cache_file": False})
    assert got.to_dict() == pack_dataset(ds, 10).to_dict()
    with pytest.raises(FastpackError, match="seq_length: got max_len=10 and seq_length=8"):
        pack_dataset(ds, 10, seq_length=8)
    with pytest.raises(TypeError, match="max_len: missing"):
        pack_dataset(ds)
    with pytest.raises(FastpackError, match="map_kwargs: 'batch_size' has no meaning here"):
        pack_dataset(ds, 10, map_kwargs={"batch_size": 1000})
    with pytest.raises(TypeError, match="map_kwargs: expected a dict"):
        pack_dataset(ds, 10, map_kwargs=[("num_proc", 2)])


def test_packs_are_shuffled_by_default_with_seed_0() -> None:
    rng = np.random.default_rng(0)
    ds = _dataset(_table(rng.integers(1, 30, 200).tolist(), pa.int32(), [], False), "none", 0)
    default = pack_dataset(ds, 32, columns=["input_ids"])
    assert default.to_dict() == pack_dataset(ds, 32, columns=["input_ids"], shuffle=True,
                                             seed=0).to_dict()
    sorted_packs = pack_dataset(ds, 32, columns=["input_ids"], shuffle=False)
    assert default.to_dict() != sorted_packs.to_dict()
    assert sorted(map(tuple, default["input_ids"])) == sorted(
        map(tuple, sorted_packs["input_ids"]))


def test_cache_file_follows_the_umask_and_map_kwargs(tmp_path: Any) -> None:
    ds = datasets.Dataset(datasets.table.InMemoryTable(_table([5, 3, 7], pa.int32(), [],
                                                              False)))
    ds.save_to_disk(str(tmp_path / "ds"))
    on_disk = datasets.load_from_disk(str(tmp_path / "ds"))
    old = os.umask(0o022)
    try:
        packed = pack_dataset(on_disk, 10)
        named = pack_dataset(on_disk, 10, map_kwargs={"cache_file_name": str(tmp_path / "p")})
        in_memory = pack_dataset(on_disk, 10, map_kwargs={"keep_in_memory": True})
        os.umask(0o077)
        private = pack_dataset(on_disk, 10, seed=1)
    finally:
        os.umask(old)
    path = packed.cache_files[0]["filename"]
    assert os.stat(path).st_mode & 0o777 == 0o644  # 0666 less the umask, as datasets' files
    assert os.stat(private.cache_files[0]["filename"]).st_mode & 0o777 == 0o600
    assert named.cache_files[0]["filename"] == str(tmp_path / "p")
    assert not in_memory.cache_files
    assert named.to_dict() == packed.to_dict() == in_memory.to_dict()
    assert not [f for f in os.listdir(os.path.dirname(path)) if f.startswith(".fastpack-")]


def _rows_or_error(packed: Any) -> Any:
    """Every row of a packed Dataset or IterableDataset (a stream raises as it is read),
    or the FastpackError type it raised."""
    try:
        return [dict(r) for r in packed()]
    except FastpackError:
        return FastpackError


#: (overlong, separator_id) pairs; each is its own case, so one that fails on the stream
#: side can be marked alone.
POLICIES = [
    ("error", None), ("error", 0), ("truncate", None), ("truncate", 0), ("split", None),
    ("split", 7), ("drop", None), ("drop", 7),
]


@pytest.mark.parametrize(("overlong", "separator_id"), POLICIES)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    token_type=st.sampled_from([pa.int32(), pa.int64(), pa.uint16()]),
    labels_type=st.sampled_from([pa.int64(), pa.int32(), pa.uint32()]),
    assistant_masks=st.booleans(),
    strategy=st.sampled_from(["bfd", "ffd", "next_fit", "wrapped"]),
    max_len=st.integers(4, 24),
    extra_reserve=st.sampled_from([None, 1, 2]),
    long_bucket=st.booleans(),
    shuffle=st.booleans(),
    positions=st.booleans(),
)
def test_a_dataset_and_its_stream_give_the_same_rows(
    overlong: str, separator_id: int | None, data: Any, token_type: Any, labels_type: Any,
    assistant_masks: bool, strategy: str, max_len: int, extra_reserve: int | None,
    long_bucket: bool, shuffle: bool, positions: bool,
) -> None:
    """One call, one answer: the same rows for a Dataset and for its IterableDataset,
    when the stream's window holds the whole stream (buffer_size > rows). The packs'
    order is the same with shuffle=False; with shuffle=True the stream shuffles its
    window with its own seed, so only the multiset of rows is the same."""
    lengths = data.draw(st.lists(st.integers(0, 2 * max_len), min_size=1, max_size=25), label="lengths")
    rng = np.random.default_rng(len(lengths))
    ids = [rng.integers(1, 60000, n).tolist() for n in lengths]
    # -100 in signed labels (a prompt token), as SFT data has.
    labels = [[-100 if (labels_type != pa.uint32() and t % 3 == 0) else t for t in row]
              for row in ids]
    columns: dict[str, Any] = {
        "input_ids": pa.array(ids, pa.list_(token_type)),
        "labels": pa.array(labels, pa.list_(labels_type)),
    }
    if assistant_masks:
        columns["assistant_masks"] = pa.array([[t % 2 for t in r] for r in ids],
                                              pa.list_(pa.int8()))
    columns["text"] = pa.array([str(n) for n in lengths])
    ds = datasets.Dataset(datasets.table.InMemoryTable(pa.table(columns)))
    reserve = extra_reserve if separator_id is not None else None
    kwargs = dict(strategy=strategy, overlong=overlong, separator_id=separator_id,
                  reserve=reserve, shuffle=shuffle, seed=data.draw(st.integers(0, 5)),
                  long_max_len=2 * max_len if long_bucket else None,
                  position_ids=positions, threads=1,
                  seq_lengths=True if strategy == "wrapped" and positions else None)
    stream = ds.to_iterable_dataset(num_shards=1)
    offline = _rows_or_error(lambda: pack_dataset(ds, max_len, **kwargs))
    streamed = _rows_or_error(lambda: pack_dataset(stream, max_len, buffer_size=len(ds) + 1,
                                                   **kwargs))
    if offline is FastpackError or streamed is FastpackError:
        assert offline is streamed, (offline, streamed)
        return
    if shuffle:
        offline, streamed = (sorted(map(repr, rows)) for rows in (offline, streamed))
    assert streamed == offline
    assert pack_dataset(stream, max_len, **kwargs).features == pack_dataset(
        ds, max_len, **kwargs).features
