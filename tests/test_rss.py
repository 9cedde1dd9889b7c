"""Memory that does not grow with the corpus: a ``PackedSampler`` over a memory-mapped
``datasets.Dataset`` (shuffled, so read through an indices mapping) builds and iterates
its schedule reading the Arrow buffers in place. Measured in a fresh subprocess, where
nothing else has touched the heap: the anonymous memory (what a copy of a column would
cost; the mapped file's pages are the page cache's, shared and reclaimable) and, without
labels or mask, the whole resident set (the token values are not even read)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fastpack

pytest.importorskip("torch")
pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")

if not Path("/proc/self/status").exists():  # pragma: no cover - Linux only
    pytest.skip("reads /proc/self/status", allow_module_level=True)

ROWS = 40_000
TOKENS = 16_000_000  # int32: 64 MB of token ids, 16 MB of uint8 mask
BOUND = 12 << 20  # a fifth of the token bytes

CHILD = textwrap.dedent(
    """
    import json, sys
    import datasets
    from fastpack.torch import PackedCollator, PackedDataset, PackedSampler

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    collator = PackedCollator(max_len=4096, backend="flash")
    results, kept = {}, []
    for mask in (None, "assistant_masks"):
        # A dataset object of its own per case, and the first kept alive, so that what
        # one case reads (or copies) is neither reused nor freed for the other.
        ds = datasets.load_from_disk(sys.argv[1]).shuffle(seed=1)
        assert ds._indices is not None
        kept.append(ds)
        before = {k: status(k) for k in ("VmRSS", "RssAnon")}
        packed = PackedDataset(ds, collator, loss_mask=mask)
        sampler = PackedSampler(packed, accumulation_steps=2)
        steps = list(sampler)
        after = {k: status(k) for k in ("VmRSS", "RssAnon")}
        results[str(mask)] = {"growth": {k: after[k] - before[k] for k in after},
                              "steps": len(steps), "targets": int(packed.steps.targets.sum())}
        del packed, sampler, steps
    print(json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, int]:
    import datasets
    import numpy as np

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 2 * TOKENS // ROWS, ROWS)
    offsets = np.zeros(ROWS + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(
        rng.integers(0, 32_000, total, dtype=np.int32)))
    mask_values = rng.integers(0, 2, total, dtype=np.uint8)
    mask = pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask_values))
    path = tmp_path_factory.mktemp("rss") / "corpus"
    datasets.Dataset(pa.table({"input_ids": ids, "assistant_masks": mask})).save_to_disk(
        str(path))
    # The targets: every token but each sequence's first (when no mask); with the mask,
    # the mask's ones but the first position of each sequence (no sequence is over 4096).
    first = offsets[:-1]
    masked = int(mask_values.sum()) - int(mask_values[first].sum())
    return path, total - ROWS, masked


@pytest.fixture(scope="module")
def measured(corpus: tuple[Path, int, int]) -> dict[str, dict[str, object]]:
    # The child imports the fastpack this run imports (the installed wheel in CI, the
    # source tree through PYTHONPATH in a checkout).
    env = dict(os.environ)
    where = str(Path(fastpack.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [where, env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", CHILD, str(corpus[0])], capture_output=True,
                         text=True, env=env, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, dict[str, object]] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_sampler_reads_the_tokens_in_place(
    corpus: tuple[Path, int, int], measured: dict[str, dict[str, object]]
) -> None:
    result = measured["None"]
    assert result["targets"] == corpus[1]
    growth = result["growth"]
    assert isinstance(growth, dict)
    # Neither copied nor read: the token values never become resident.
    assert growth["VmRSS"] < BOUND, growth


def test_sampler_reads_the_mask_in_place(
    corpus: tuple[Path, int, int], measured: dict[str, dict[str, object]]
) -> None:
    result = measured["assistant_masks"]
    assert result["targets"] == corpus[2]
    growth = result["growth"]
    assert isinstance(growth, dict)
    # The mask is read where it is mapped: no anonymous copy of it (nor of the tokens).
    assert growth["RssAnon"] < BOUND, growth


def test_no_sampler_path_concatenates_the_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler, its step table and the batches read Arrow data in place: the one
    method that makes a contiguous copy is never called."""
    import datasets

    from fastpack import Ragged
    from fastpack.torch import PackedCollator, PackedDataset, PackedSampler

    def copy(self: Ragged) -> None:
        raise AssertionError("Ragged._materialize_arrays called on a sampler path")

    monkeypatch.setattr(Ragged, "_materialize_arrays", copy)
    rows = [[int(i % 7) + 1] * int(n) for i, n in enumerate(range(1, 60))]
    ds = datasets.Dataset.from_dict({
        "input_ids": rows, "labels": [[-100] + r[1:] for r in rows],
        "assistant_masks": [[k % 2 for k in range(len(r))] for r in rows],
    }).shuffle(seed=0)
    packed = PackedDataset(ds, PackedCollator(max_len=64, backend="flash"), labels="labels",
                           loss_mask="assistant_masks")
    steps = list(PackedSampler(packed, accumulation_steps=2))
    assert sum(int(packed[s]["num_items_in_batch"]) > 0 for s in steps) == len(steps)
