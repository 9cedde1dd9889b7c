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


@settings(max_examples=8, deadline=None)
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
    samples = [{"input_ids": prompt + [9, 2, 6][: k + 1], "prompt_id": 0} for k in range(3)]
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


# ------------------------------------------------------------------ tree kernels


def _rollouts(group: int, prompt: int, response: int) -> Any:
    from fastpack.torch import PackedCollator
    from fastpack.torch.tree import check_tree

    samples = [{"input_ids": list(range(1, prompt + 1)) + [prompt + 1 + g] * response,
                "prompt_id": 0} for g in range(group)]
    batch = PackedCollator(prompt + group * response, backend="flash",
                           share_prefix=True)(samples)
    return check_tree(batch["tree_cu_seqlens"], batch["tree_parents"],
                      batch["input_ids"].shape[1])


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(-1, 6), min_size=1, max_size=12), st.data())
def test_tree_gathered_keys_are_each_segments_path(raw: list[int], data: Any) -> None:
    """The flash kernel's key rows (built with one arange, not per segment): segment
    after segment, its ancestors' rows from the root, then its own; ``cu_seqlens_k`` and
    ``gathered_rows`` count them."""
    torch = pytest.importorskip("torch")
    from fastpack.torch.tree import TreeLayout

    # A preorder tree: each segment's parent is -1 or a segment on the current path.
    parents: list[int] = []
    path: list[int] = []
    for s, wish in enumerate(raw):
        while path and wish >= 0 and path[-1] > wish:
            path.pop()
        parent = path[-1] if path and wish >= 0 else -1
        if parent < 0:
            path = []
        parents.append(parent)
        path.append(s)
    lengths = data.draw(st.lists(st.integers(0, 5), min_size=len(parents),
                                 max_size=len(parents)))
    bounds = np.concatenate(([0], np.cumsum(lengths))).tolist()
    layout = TreeLayout(bounds, parents)
    index, cu_k, longest_q, longest_k = layout.gathered(torch.device("cpu"))
    runs = []
    for s in range(len(parents)):
        rows = [r for a in (*layout.ancestors[s], s) for r in range(bounds[a], bounds[a + 1])]
        runs.append(rows)
    assert index.tolist() == [r for run in runs for r in run]
    assert cu_k.tolist() == np.concatenate(([0], np.cumsum([len(r) for r in runs]))).tolist()
    assert longest_q == max(lengths) and longest_k == max(len(r) for r in runs)
    assert layout.gathered_rows == len(index)


def test_auto_takes_flex_for_high_fan_out_trees() -> None:
    """flash gathers every rollout's path (≈ G·P rows of K/V per layer): "auto" takes
    flex, where it runs, once that exceeds FLASH_GATHER_LIMIT times the row."""
    pytest.importorskip("torch")
    from fastpack.torch import tree

    wide = _rollouts(16, 64, 4)  # 128 rows; the prompt, then 16 runs of 64 + 4
    assert wide.total == 128 and wide.gathered_rows == 64 + 16 * 68
    narrow = _rollouts(2, 16, 12)  # 40 rows, 56 gathered
    assert narrow.gathered_rows <= tree.FLASH_GATHER_LIMIT * narrow.total
    both = ["flash", "flex", "sdpa"]
    assert tree._auto_kernel(both, wide) == "flex"
    assert tree._auto_kernel(both, narrow) == "flash"
    assert tree._auto_kernel(["flash", "sdpa"], wide) == "flash"  # no flex: flash still
    assert tree._auto_kernel(["sdpa"], wide) == "sdpa"


# ------------------------------------------------------------ context parallelism


def _cp_inputs(lengths: tuple[int, ...], cp: int, mode: str, rank: int, seed: int) -> Any:
    torch = pytest.importorskip("torch")
    from fastpack.torch import shard_for_context_parallel

    cu = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    batch = {"input_ids": torch.zeros(1, int(cu[-1]), dtype=torch.long),
             "cu_seq_lens_q": torch.from_numpy(cu)}
    shards = [shard_for_context_parallel(batch, cp, r, mode) for r in range(cp)]
    g = torch.Generator().manual_seed(seed)
    sizes = [s["input_ids"].shape[1] for s in shards]
    keys = torch.randn(sum(sizes), 2, 4, generator=g, dtype=torch.float64)
    values = torch.randn(sum(sizes), 2, 4, generator=g, dtype=torch.float64)
    q = torch.randn(sizes[rank], 4, 4, generator=g, dtype=torch.float64)
    return shards[rank], q, keys, values


@pytest.mark.parametrize("mode, window, softcap", [("zigzag", None, None),
                                                   ("zigzag", 3, 0.7), ("contiguous", 5, None)])
def test_cp_runs_in_groups_equal_runs_alone(mode: str, window: Any, softcap: Any,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU kernel's short runs in padded groups (one SDPA call each) give what each
    run alone gives, outputs and gradients, padding rows included (they see a real key,
    their outputs are dropped: no NaN reaches a gradient)."""
    torch = pytest.importorskip("torch")
    from fastpack.torch import context_parallel as cp

    results = []
    for short in (cp._SHORT_RUN, 0):  # all batched, then every run alone
        monkeypatch.setattr(cp, "_SHORT_RUN", short)
        local, q, keys, values = _cp_inputs((9, 1, 30, 4, 17, 2, 8), 2, mode, 1, seed=3)
        q, keys, values = (t.requires_grad_() for t in (q, keys, values))
        out = cp.attend_gathered(q, keys, values, local, "sdpa", None, window, softcap)
        plan = cp._RUNS.get(local, q.device).plan()
        assert bool(plan.groups) == bool(short)  # the groups are exercised
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum() \
            .backward()
        results.append((out.detach(), q.grad, keys.grad, values.grad))
    for a, b in zip(*results):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_cp_attention_reads_the_boundaries_once_per_batch() -> None:
    """The layers of one forward share a batch: its run boundaries are read on the host
    (a device sync on an accelerator) by the first layer only."""
    torch = pytest.importorskip("torch")
    from torch.overrides import TorchFunctionMode

    from fastpack.torch import context_parallel_attention, shard_for_context_parallel

    reads = {"n": 0}
    host = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__int__,
            torch.Tensor.__index__, torch.Tensor.__bool__, torch.Tensor.__float__}

    class CountReads(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            if func in host:
                reads["n"] += 1
            return func(*args, **(kwargs or {}))

    batch = {"input_ids": torch.zeros(1, 24, dtype=torch.long),
             "cu_seq_lens_q": torch.tensor([0, 5, 17, 24], dtype=torch.int32)}
    local = shard_for_context_parallel(batch, 1, 0, "contiguous")
    q, k, v = (torch.randn(24, 2, 4) for _ in range(3))
    counts = []
    for _ in range(3):  # three layers
        reads["n"] = 0
        with CountReads():
            context_parallel_attention(q, k, v, local, None, kernel="sdpa")
        counts.append(reads["n"])
    assert counts[0] > 0 and counts[1:] == [0, 0], counts
