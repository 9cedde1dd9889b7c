"""The speed traps of issue 24 (item 11): each fix keeps what the code computes and
removes a cost a user would not expect — a host read per call or per layer, an import on
the first call, a per-sample conversion — or says so where it cannot (flex on the CPU).

Timing never decides a test: each test checks the observable side of its fix (no read of
a device tensor's values: run on the ``meta`` device, which has none; a module not
imported; a warning) or that the fast path gives what the general one does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastpack

#: Where the fastpack under test lives (the source tree, or CI's installed wheel).
HOME = str(Path(fastpack.__file__).resolve().parent.parent)


def test_pack_does_not_import_numpy_ma() -> None:
    """The masked-array check of ``pack()`` must not import ``numpy.ma`` (~8 ms on the
    first call of a process): a masked array exists only once it is loaded."""
    code = ("import sys, fastpack; fastpack.pack([3, 4, 5], 8); "
            "print('numpy.ma' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [HOME, *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True)
    assert out.stdout.strip() == "False"
    # ... and a masked array is still refused once numpy.ma is loaded.
    with pytest.raises(fastpack.FastpackTypeError, match="masked array"):
        fastpack.pack(np.ma.array([3, 4], mask=[0, 1]), 8)


# ------------------------------------------------------------------ the collator


def _batches_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        other = b[key]
        if hasattr(value, "shape"):
            assert np.array_equal(np.asarray(value), np.asarray(other)), key
        else:
            assert value == other, key


ROWS = st.lists(st.lists(st.integers(0, 30_000), min_size=0, max_size=12), min_size=1,
                max_size=8).filter(lambda rows: any(rows))


@settings(max_examples=30, deadline=None)
@given(rows=ROWS, dtype=st.sampled_from(["int64", "int32", "uint16"]),
       mask=st.booleans(), backend=st.sampled_from(["flash", "sdpa"]))
def test_collator_numpy_and_tensor_rows_match_lists(rows: list[list[int]], dtype: str,
                                                    mask: bool, backend: str) -> None:
    """Rows as numpy arrays (one dtype: one concatenation) or CPU tensors give the batch
    that the same rows as lists give."""
    torch = pytest.importorskip("torch")
    from fastpack.torch import PackedCollator

    collate = PackedCollator(64, backend=backend, threads=1)

    def samples(convert: Any) -> list[dict[str, Any]]:
        out = []
        for i, r in enumerate(rows):
            s = {"input_ids": convert(r), "labels": convert([(t + 1) % 7 for t in r])}
            if mask:
                s["assistant_masks"] = convert([(i + j) % 2 for j in range(len(r))])
            out.append(s)
        return out

    expected = collate(samples(list))
    _batches_equal(expected, collate(samples(lambda r: np.asarray(r, dtype=dtype))))
    if dtype != "uint16":  # torch has no uint16 rows to read in place: the general path
        torch_dtype = getattr(torch, dtype)
        _batches_equal(expected, collate(samples(
            lambda r: torch.tensor(r, dtype=torch_dtype))))


def test_collator_rows_of_mixed_or_bad_arrays() -> None:
    """Rows the one-concatenation path does not take go the general way: mixed dtypes
    (empty rows included) pack; a nested row or a float row is the same error as before."""
    pytest.importorskip("torch")
    from fastpack.torch import PackedCollator

    collate = PackedCollator(64, backend="flash")
    mixed = [{"input_ids": np.array([5, 6], dtype=np.int32)},
             {"input_ids": np.array([], dtype=np.float64)},
             {"input_ids": np.array([7], dtype=np.int64)}]
    assert collate(mixed)["input_ids"].tolist() == [[5, 6, 7]]
    nested = [{"input_ids": np.array([[1, 2]])}, {"input_ids": np.array([[3, 4]])}]
    with pytest.raises(fastpack.FastpackTypeError, match=r"^input_ids: expected rows of "
                       r"integers \(a row has shape \(1, 2\)"):
        collate(nested)
    floats = [{"input_ids": np.array([1.0, 2.0])}, {"input_ids": np.array([3.0])}]
    with pytest.raises(fastpack.FastpackTypeError, match="^input_ids: .*float64"):
        collate(floats)


def test_collator_key_checks_still_run_per_sample() -> None:
    """The batch's keys are read once, but a sample's unknown per-token key, padded
    ``attention_mask`` or named loss mask is still found, naming the sample."""
    pytest.importorskip("torch")
    from fastpack.torch import PackedCollator

    collate = PackedCollator(64, backend="flash")
    plain = {"input_ids": [1, 2, 3]}
    with pytest.raises(fastpack.FastpackError, match="sample 1 has the per-token key 'mask'"):
        collate([plain, {"input_ids": [1, 2], "mask": [1, 0]}])
    with pytest.raises(fastpack.FastpackError, match="sample 2 has 'attention_mask' with zeros"):
        collate([plain, plain, {"input_ids": [1, 2], "attention_mask": [1, 0]}])
    masked = [{"input_ids": [1, 2, 3], "completion_mask": [1, 1, 0]},
              {"input_ids": [4, 5], "completion_mask": [0, 1]}]
    assert collate(masked)["labels"].tolist() == [[-100, 2, -100, -100, 5]]
    with pytest.raises(fastpack.FastpackError, match="sample 2 has no 'completion_mask'"):
        collate([*masked, {"input_ids": [4]}])
    with pytest.raises(fastpack.FastpackError, match="loss_mask_key: no sample has 'lm'"):
        PackedCollator(64, backend="flash", loss_mask_key="lm")(masked)


# ------------------------------------------------------------ host reads (meta device)


def _grpo_batch() -> dict[str, Any]:
    from fastpack.torch import PackedCollator

    prompt = [3, 1, 4, 1, 5]
    samples = [{"input_ids": prompt + [9, 2, 6][: k + 1], "group": 0} for k in range(3)]
    return PackedCollator(64, backend="flash", share_prefix=True)(samples)


def test_token_logprobs_reads_nothing_back_from_the_device() -> None:
    """``token_logprobs`` on an accelerator must not read values back (``int(...)``,
    ``torch.unique``): on the ``meta`` device, which has no values, it runs, and it gives
    what the CPU gives."""
    torch = pytest.importorskip("torch")
    from fastpack.torch import token_logprobs

    batch = _grpo_batch()
    logits = torch.randn(1, batch["input_ids"].shape[1], 11, dtype=torch.float64)
    on_cpu = token_logprobs(logits, batch)
    on_meta = token_logprobs(logits.to("meta"), batch)
    assert on_meta.device.type == "meta" and on_meta.shape == on_cpu.shape
    # The per-target normaliser equals log_softmax at every target.
    index, labels = batch["target_index"], batch["target_labels"]
    expected = torch.log_softmax(logits[0], dim=-1)[index, labels]
    torch.testing.assert_close(on_cpu, expected, rtol=0, atol=1e-12)
    with pytest.raises(fastpack.FastpackError, match="outside the vocabulary"):
        token_logprobs(logits[..., :5], batch)  # checked where it costs nothing: the CPU


def test_flex_backend_without_an_accelerator_warns_once() -> None:
    """Hugging Face's flex attention compiles on its first call (~50 s on a CPU): a flex
    collator on a machine with no accelerator says so, once per process."""
    torch = pytest.importorskip("torch")
    from fastpack.torch import PackedCollator, collator

    if torch.cuda.is_available():
        pytest.skip("the warning is for machines without an accelerator")
    collator._FLEX_WARNED = False
    with pytest.warns(UserWarning, match=r"compiles .* first call"):
        PackedCollator(64, backend="flex")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PackedCollator(64, backend="flex")  # once
        PackedCollator(64, backend="sdpa")
