"""Token data and packed datasets pickle, so DataLoader workers started with ``spawn``
(the default on macOS and Windows, and on Linux from Python 3.14) can take them."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fastpack import Ragged, as_ragged

pa = pytest.importorskip("pyarrow")


def _rows(ragged: Ragged) -> list[list[int]]:
    return [ragged[i].tolist() for i in range(len(ragged))]


def _mapped(tmp_path: Path) -> Any:
    """A memory-mapped dataset read through an indices mapping (after a shuffle)."""
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 100, int(n)).tolist() for n in rng.integers(1, 30, 60)]
    masks = [[int(k % 3 != 0) for k in range(len(r))] for r in rows]
    datasets.Dataset.from_dict({"input_ids": rows, "assistant_masks": masks}).save_to_disk(
        str(tmp_path / "ds"))
    return datasets.load_from_disk(str(tmp_path / "ds")).shuffle(seed=3)


def test_ragged_pickles_from_every_source(tmp_path: Path) -> None:
    ds = _mapped(tmp_path)
    sources = [
        Ragged(np.arange(7, dtype=np.int32), [0, 2, 2, 7]),
        as_ragged(pa.chunked_array([pa.array([[1, 2], [3]]), pa.array([[4, 5, 6]])])),
        as_ragged(pa.table({"input_ids": [[1], [2, 3]]})),
        as_ragged(ds),
        as_ragged(ds, column="assistant_masks", mask=True),
    ]
    for ragged in sources:
        back = pickle.loads(pickle.dumps(ragged))
        assert _rows(back) == _rows(ragged)
        assert back.lengths.tolist() == ragged.lengths.tolist()
        assert back._mask == ragged._mask and back._name == ragged._name


def test_a_memory_mapped_dataset_pickles_by_path(tmp_path: Path) -> None:
    ds = _mapped(tmp_path)
    ragged = as_ragged(ds)
    # The corpus is not in the pickle: datasets pickles a mapped table by its file path.
    assert len(pickle.dumps(ragged)) < ds.data.nbytes / 2


def _datasets(tmp_path: Path) -> list[Any]:
    from fastpack.torch import PackedCollator, PackedDataset

    collator = PackedCollator(max_len=64, backend="flash")
    ds = _mapped(tmp_path)
    table = pa.table({"input_ids": ds.data.table.column("input_ids")})
    return [
        PackedDataset(ds, collator, loss_mask="assistant_masks", packs_per_batch=2),
        PackedDataset(table, collator, packs_per_batch=2, seed=1),
    ]


def test_spawned_workers_give_the_same_batches(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data import ConcatDataset, DataLoader

    both = ConcatDataset(_datasets(tmp_path))
    expected = list(DataLoader(both, batch_size=None))
    loader = DataLoader(both, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    got = list(loader)
    assert len(got) == len(expected) > 0
    for a, b in zip(got, expected):
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], torch.Tensor):
                assert torch.equal(a[key], b[key]), key
            else:
                assert a[key] == b[key], key
