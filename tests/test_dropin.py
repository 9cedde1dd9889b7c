"""The drop-ins: fastpack.trl (pack_dataset, truncate_dataset) and fastpack.transformers
(DataCollatorWithFlattening) give what TRL and transformers give, and the native
fastpack.hf.pack_dataset keeps TRL's schema where it claims it (issue 24, items 7, 8, 10).

Differential property tests compare with the real TRL / transformers functions when they
are installed; the fixed cases state the expected rows by hand."""

from __future__ import annotations

import numpy as np
import pytest

from fastpack import FastpackError, FastpackTypeError

datasets = pytest.importorskip("datasets")
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fastpack import hf  # noqa: E402
from fastpack import trl as fp_trl  # noqa: E402

Dataset = datasets.Dataset


def rows(ds, batch=1000):
    """A dataset's (or stream's) rows as plain Python lists, whatever its format."""
    if isinstance(ds, datasets.IterableDataset):
        out: dict = {}
        for part in ds.with_format(None).iter(batch_size=batch):
            for k, v in part.items():
                out.setdefault(k, []).extend(v)
        return out
    return ds.with_format(None).to_dict()


# ---------------------------------------------------------------- fastpack.trl.pack_dataset


def test_bfd_packs_longest_first_and_truncates():
    ds = Dataset.from_dict({"input_ids": [[1, 2], [3, 4, 5, 6, 7, 8], [9], [10, 11, 12]],
                            "labels": [[-1, -2], [-3, -4, -5, -6, -7, -8], [-9],
                                       [-10, -11, -12]]})
    out = rows(fp_trl.pack_dataset(ds, 4))
    # Sorted 4 (row 1, cut), 3, 2, 1; the 2 cannot join the 3, the 1 does.
    assert out == {
        "input_ids": [[3, 4, 5, 6], [10, 11, 12, 9], [1, 2]],
        "labels": [[-3, -4, -5, -6], [-10, -11, -12, -9], [-1, -2]],
        "seq_lengths": [[4], [3, 1], [2]],
    }


def test_bfd_ties_go_to_the_oldest_pack():
    # Lengths 1, 3, 3 at 4 tokens: both 3s leave room 1; TRL gives the 1 to the first.
    ds = Dataset.from_dict({"input_ids": [[1], [2, 2, 2], [3, 3, 3]]})
    assert rows(fp_trl.pack_dataset(ds, 4))["input_ids"] == [[2, 2, 2, 1], [3, 3, 3]]


def test_bfd_split_cuts_pieces_that_pack_like_rows():
    ds = Dataset.from_dict({"input_ids": [[1, 2, 3, 4, 5, 6, 7], [8, 9]]})
    out = rows(fp_trl.pack_dataset(ds, 3, strategy="bfd_split"))
    # Pieces 3, 3, 1 of row 0 and the 2 of row 1: [1,2,3], [4,5,6], [8,9,7].
    assert out == {"input_ids": [[1, 2, 3], [4, 5, 6], [8, 9, 7]],
                   "seq_lengths": [[3], [3], [2, 1]]}


def test_empty_rows_are_left_out():
    ds = Dataset.from_dict({"input_ids": [[], [1, 2], [], [3]]})
    for strategy in ("bfd", "bfd_split"):
        assert rows(fp_trl.pack_dataset(ds, 5, strategy))["seq_lengths"] == [[2, 1]]
    # A window of empty rows only gives no packs (TRL's own raises an Arrow error there).
    none = rows(fp_trl.pack_dataset(Dataset.from_dict({"input_ids": [[], []]}), 3))
    assert none == {"input_ids": [], "seq_lengths": []}


def test_wrapped_cuts_across_rows_and_writes_no_boundaries():
    ds = Dataset.from_dict({"input_ids": [[1, 2], [3, 4, 5], [6]],
                            "attention_mask": [[1, 1], [1, 1, 1], [1]]})
    out = rows(fp_trl.pack_dataset(ds, 4, strategy="wrapped"))
    assert out == {"input_ids": [[1, 2, 3, 4], [5, 6]], "attention_mask": [[1] * 4, [1, 1]]}


def test_format_kept_with_columns_listed():
    ds = Dataset.from_dict({"input_ids": [[1, 2], [3]]}).with_format("numpy", dtype="int32")
    bfd = fp_trl.pack_dataset(ds, 4)
    assert bfd.format["type"] == "numpy" and bfd.format["format_kwargs"] == {"dtype": "int32"}
    assert bfd.format["columns"] == ["input_ids", "seq_lengths"]
    assert bfd._format_columns == ["input_ids", "seq_lengths"]  # listed, not None
    assert bfd[0]["input_ids"].dtype == np.int32
    wrapped = fp_trl.pack_dataset(ds, 4, "wrapped")
    assert wrapped.format == ds.format


def test_stream_keeps_its_format():
    it = Dataset.from_dict({"input_ids": [[1, 2], [3]]}).to_iterable_dataset()
    for strategy in fp_trl.STRATEGIES:
        packed = fp_trl.pack_dataset(it.with_format("numpy"), 4, strategy)
        assert packed._formatting.format_type == "numpy"
        assert isinstance(next(iter(packed))["input_ids"], np.ndarray)
    assert rows(fp_trl.pack_dataset(it, 4)) == {"input_ids": [[1, 2, 3]],
                                                "seq_lengths": [[2, 1]]}


def test_no_rows_give_no_rows():
    # TRL's own raises (it lists a seq_lengths column that a map of nothing never wrote).
    assert fp_trl.pack_dataset(Dataset.from_dict({"input_ids": []}), 3).num_rows == 0


def test_dataset_dict_packs_every_split():
    dd = datasets.DatasetDict({"a": Dataset.from_dict({"input_ids": [[1], [2, 3]]}),
                               "b": Dataset.from_dict({"input_ids": [[4, 5, 6]]})})
    out = fp_trl.pack_dataset(dd, 3)
    assert rows(out["a"])["input_ids"] == [[2, 3, 1]]
    assert rows(out["b"])["input_ids"] == [[4, 5, 6]]


def test_map_kwargs_reach_map():
    ds = Dataset.from_dict({"input_ids": [[1, 2], [3], [4, 5], [6]]})
    # batch_size is the window: two windows of two rows, each packed on its own.
    out = rows(fp_trl.pack_dataset(ds, 3, map_kwargs={"batch_size": 2}))
    assert out["input_ids"] == [[1, 2, 3], [4, 5, 6]]
    assert rows(fp_trl.pack_dataset(ds, 3))["input_ids"] == [[1, 2, 3], [4, 5, 6]]
    out = rows(fp_trl.pack_dataset(ds, 6, map_kwargs={"batch_size": 1}))
    assert out["input_ids"] == [[1, 2], [3], [4, 5], [6]]
    with pytest.raises(TypeError):
        fp_trl.pack_dataset(ds, 3, map_kwargs={"no_such_argument": 1})


def test_bad_arguments_name_themselves():
    ds = Dataset.from_dict({"input_ids": [[1, 2]], "text": ["ab"]})
    with pytest.raises(FastpackTypeError, match="column 'text'"):
        fp_trl.pack_dataset(ds, 3)
    odd = Dataset.from_dict({"input_ids": [[1, 2]], "labels": [[1]]})
    with pytest.raises(FastpackError, match="column 'labels' has 1 values in row 0"):
        fp_trl.pack_dataset(odd, 3)
    with pytest.raises(FastpackError, match="strategy"):
        fp_trl.pack_dataset(ds, 3, strategy="ffd")
    with pytest.raises(FastpackError, match="seq_length: expected at least 1"):
        fp_trl.pack_dataset(ds, 0)
    with pytest.raises(FastpackTypeError, match="map_kwargs"):
        fp_trl.pack_dataset(ds, 3, map_kwargs=[("batch_size", 2)])
    with pytest.raises(FastpackTypeError, match="dataset"):
        fp_trl.pack_dataset({"input_ids": [[1]]}, 3)


# ------------------------------------------------------------ fastpack.trl.truncate_dataset


def test_truncate_cuts_list_columns_only():
    ds = Dataset.from_dict({"input_ids": [[1, 2, 3], [4]], "tags": [["a", "b", "c"], ["d"]],
                            "name": ["x", "y"]})
    out = rows(fp_trl.truncate_dataset(ds, 2))
    assert out == {"input_ids": [[1, 2], [4]], "tags": [["a", "b"], ["d"]], "name": ["x", "y"]}


def test_truncate_keeps_formats():
    ds = Dataset.from_dict({"input_ids": [[1, 2, 3]]}).with_format("numpy", dtype="float32")
    assert fp_trl.truncate_dataset(ds, 2).format == ds.format
    it = Dataset.from_dict({"input_ids": [[1, 2, 3]]}).to_iterable_dataset().with_format("numpy")
    cut = fp_trl.truncate_dataset(it, 1)
    assert cut._formatting.format_type == "numpy"
    assert rows(cut) == {"input_ids": [[1]]}
    with pytest.raises(FastpackError, match="max_length"):
        fp_trl.truncate_dataset(ds, -1)


# ------------------------------------------------------- against the real TRL (differential)

token_rows = st.lists(st.lists(st.integers(0, 50), max_size=14), max_size=40)


def _dataset(data, two_columns, large=False):
    columns = {"input_ids": data}
    if two_columns:
        columns["labels"] = [[-t for t in r] for r in data]
    kind = datasets.LargeList if large else datasets.List
    return Dataset.from_dict(columns, features=datasets.Features(
        {k: kind(datasets.Value("int64")) for k in columns}))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=token_rows, seq_length=st.integers(1, 12),
       strategy=st.sampled_from(fp_trl.STRATEGIES), two=st.booleans(),
       batch_size=st.sampled_from([1000, 7]), large=st.booleans())
def test_pack_dataset_equals_trl(data, seq_length, strategy, two, batch_size, large):
    data_utils = pytest.importorskip("trl.data_utils")
    # TRL raises on a window of empty rows only (an Arrow take of nothing); fastpack gives
    # no packs for it, tested above.
    windows = [data[i:i + batch_size] for i in range(0, len(data), batch_size)]
    assume(strategy == "wrapped" or (windows and all(any(w) for w in windows)))
    ds = _dataset(data, two, large)
    kwargs = {"batch_size": batch_size}
    ours = fp_trl.pack_dataset(ds, seq_length, strategy, map_kwargs=kwargs)
    theirs = data_utils.pack_dataset(ds, seq_length, strategy, map_kwargs=kwargs)
    assert ours.column_names == theirs.column_names
    assert ours.features == theirs.features
    assert rows(ours) == rows(theirs)  # row for row, ties included


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=token_rows, max_length=st.integers(1, 9))
def test_truncate_dataset_equals_trl(data, max_length):
    utils = pytest.importorskip("trl.experimental.utils")
    ds = _dataset(data, True)
    assert rows(fp_trl.truncate_dataset(ds, max_length)) == rows(
        utils.truncate_dataset(ds, max_length))


# ------------------------------------------------------- native hf.pack_dataset (items 7, 8)


def test_native_wrapped_writes_no_seq_lengths_unless_asked():
    ds = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5, 6, 7], [8]]})
    plain = hf.pack_dataset(ds, 3, "wrapped", shuffle=False)
    assert plain.column_names == ["input_ids"]  # TRL's columns: TRL's collator attends across
    assert rows(plain)["input_ids"] == [[1, 2, 3], [4, 5, 6], [7, 8]]
    per_document = hf.pack_dataset(ds, 3, "wrapped", shuffle=False, seq_lengths=True)
    assert rows(per_document)["seq_lengths"] == [[3], [3], [1, 1]]
    assert "seq_lengths" in hf.pack_dataset(ds, 4, "bfd", shuffle=False,
                                            overlong="truncate").column_names
    assert "seq_lengths" not in hf.pack_dataset(ds, 4, "bfd", shuffle=False, overlong="truncate",
                                                seq_lengths=False).column_names
    with pytest.raises(FastpackError, match="position_ids"):
        hf.pack_dataset(ds, 3, "wrapped", position_ids=True)
    with pytest.raises(FastpackTypeError, match="seq_lengths"):
        hf.pack_dataset(ds, 3, "wrapped", seq_lengths="no")


def test_native_stream_wrapped_writes_no_seq_lengths():
    it = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5, 6, 7], [8]]}).to_iterable_dataset()
    assert rows(hf.pack_dataset(it, 3, "wrapped", shuffle=False)) == {
        "input_ids": [[1, 2, 3], [4, 5, 6], [7, 8]]}


def test_native_stream_keeps_its_format():
    it = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5, 6, 7], [8]]}).to_iterable_dataset()
    packed = hf.pack_dataset(it.with_format("numpy"), 4, shuffle=False)
    assert packed._formatting is not None and packed._formatting.format_type == "numpy"
    assert isinstance(next(iter(packed))["input_ids"], np.ndarray)
    assert hf.pack_dataset(it, 4, shuffle=False)._formatting is None


def test_native_format_lists_its_columns():
    ds = Dataset.from_dict({"input_ids": [[1, 2, 3], [4]]}).with_format("numpy", dtype="float32")
    packed = hf.pack_dataset(ds, 4, shuffle=False)
    assert packed._format_columns == ["input_ids", "seq_lengths"]
    assert packed.format["format_kwargs"] == {"dtype": "float32"}


# ------------------------------------------------ fastpack.transformers.DataCollatorWithFlattening


@pytest.fixture(scope="module")
def collators():
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from transformers import DataCollatorWithFlattening as HF

    from fastpack.transformers import DataCollatorWithFlattening as FP

    return FP, HF, torch


def test_collator_is_transformers_class(collators):
    FP, HF, _ = collators
    assert issubclass(FP, HF)
    c = FP()
    assert (c.return_tensors, c.return_position_ids, c.separator_id, c.return_flash_attn_kwargs,
            c.return_seq_idx, c.position_ids_start) == ("pt", True, -100, False, False, 0)


def test_collator_flattens_in_input_order(collators):
    FP, _, torch = collators
    batch = FP()([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}, {"input_ids": [9, 10]}])
    assert list(batch) == ["input_ids", "labels", "position_ids"]
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, -100, 10]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1]]
    assert all(v.dtype == torch.int64 for v in batch.values())


def test_collator_options(collators):
    FP, _, torch = collators
    feats = [{"input_ids": [1, 2], "labels": [7, 8]}, {"input_ids": []},
             {"input_ids": [3, 4, 5], "labels": [9, 10, 11]}]
    feats[1]["labels"] = []
    c = FP(return_flash_attn_kwargs=True, return_seq_idx=True, position_ids_start=2,
           separator_id=0)
    batch = c(feats)
    assert list(batch) == ["input_ids", "labels", "position_ids", "seq_idx", "cu_seq_lens_q",
                           "cu_seq_lens_k", "max_length_q", "max_length_k"]
    assert batch["labels"].tolist() == [[0, 8, 0, 10, 11]]  # the separator, HF's meaning
    assert batch["position_ids"].tolist() == [[2, 3, 2, 3, 4]]
    assert batch["seq_idx"].tolist() == [[0, 0, 1, 1, 1]]  # the empty sample is left out
    assert batch["seq_idx"].dtype == torch.int32
    assert batch["cu_seq_lens_q"].tolist() == [0, 2, 5]
    assert batch["cu_seq_lens_k"].dtype == torch.int32
    assert batch["max_length_q"] == batch["max_length_k"] == 3
    assert type(batch["max_length_k"]) is int
    once = c(feats, return_tensors="np", separator_id=-1)
    assert isinstance(once["input_ids"], np.ndarray) and once["input_ids"].shape == (1, 5)
    assert once["labels"].tolist() == [[-1, 8, -1, 10, 11]]
    assert FP(return_position_ids=False)(feats).keys() == {"input_ids", "labels"}


def test_collator_reads_lists_arrays_and_tensors(collators):
    FP, _, torch = collators
    feats = [{"input_ids": np.array([1, 2], dtype=np.int32), "labels": torch.tensor([7, 8])},
             {"input_ids": torch.tensor([3]), "labels": [9]},
             {"input_ids": (4, 5), "labels": np.array([10, 11])}]
    before = [{k: list(map(int, v)) for k, v in f.items()} for f in feats]
    for tensors in ("np", "pt"):
        batch = FP(return_tensors=tensors)(feats)
        assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5]]
        assert batch["labels"].tolist() == [[-100, 8, -100, -100, 11]]
        assert batch["input_ids"].dtype == (np.int64 if tensors == "np" else torch.int64)
        # The inputs are not changed, and the batch does not share their memory.
        assert [{k: list(map(int, v)) for k, v in f.items()} for f in feats] == before
        batch["labels"][0, 1] = 0
        assert int(feats[0]["labels"][1]) == 8


def test_collator_refuses_what_it_cannot_collate(collators):
    FP, _, _ = collators
    with pytest.raises(ValueError, match="every example"):
        FP()([{"input_ids": []}])
    with pytest.raises(FastpackError, match="return_tensors"):
        FP(return_tensors="tf")([{"input_ids": [1]}])
    with pytest.raises(FastpackError, match="labels: sample 0 has 1 labels for 2"):
        FP()([{"input_ids": [1, 2], "labels": [1]}])


sample = st.fixed_dictionaries({"input_ids": st.lists(st.integers(0, 1000), max_size=9)})


@settings(max_examples=60, deadline=None)
@given(feats=st.lists(sample, min_size=1, max_size=8), labels=st.booleans(),
       flash=st.booleans(), seq_idx=st.booleans(), positions=st.booleans(),
       start=st.sampled_from([0, 2]), sep=st.sampled_from([-100, 0]),
       tensors=st.sampled_from(["pt", "np"]))
def test_collator_equals_transformers(collators, feats, labels, flash, seq_idx, positions,
                                      start, sep, tensors):
    FP, HF, torch = collators
    if labels:
        feats = [{**f, "labels": [t + 1 for t in f["input_ids"]]} for f in feats]
    kwargs = dict(return_flash_attn_kwargs=flash, return_seq_idx=seq_idx, separator_id=sep,
                  return_position_ids=positions, position_ids_start=start,
                  return_tensors=tensors)
    if not any(f["input_ids"] for f in feats):
        with pytest.raises(ValueError):
            FP(**kwargs)(feats)
        return
    ours, theirs = FP(**kwargs)(feats), HF(**kwargs)(feats)
    assert list(ours) == list(theirs)
    for key, value in theirs.items():
        if isinstance(value, int):
            assert type(ours[key]) is int and ours[key] == value
        else:
            assert type(ours[key]) is type(value)
            assert ours[key].dtype == value.dtype and ours[key].shape == value.shape
            assert ours[key].tolist() == value.tolist()
