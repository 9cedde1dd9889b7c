"""packed_loss: the loss of packed micro-batches adds up to the loss of the unpacked batch."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from fastpack import FastpackError, FastpackTypeError  # noqa: E402
from fastpack.torch import PackedCollator, packed_loss  # noqa: E402
from fastpack.torch.loss import segment_ids  # noqa: E402

VOCAB = 23
warnings.filterwarnings("ignore", category=UserWarning)


def table(seed: int = 0) -> Any:
    """A 'model' whose logits depend on the token alone: the same in any packing."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, VOCAB, generator=g, dtype=torch.float64).requires_grad_()


def make_samples(lengths: list[int], seed: int, masked: bool) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        s: dict[str, Any] = {"input_ids": rng.integers(0, VOCAB, n).tolist()}
        if masked:
            s["loss_mask"] = (rng.random(n) < 0.6).astype(np.uint8).tolist()
        out.append(s)
    return out


def reference(
    weights: Any, samples: list[dict[str, Any]], weighting: str
) -> tuple[Any, int, int]:
    """Unpacked loss over all samples (each alone), and its two normalisers."""
    sums, counts = [], []
    for s in samples:
        ids = torch.tensor(s["input_ids"])
        mask = torch.tensor(s.get("loss_mask", [1] * len(ids)), dtype=torch.bool)
        target = mask[1:]
        ce = torch.nn.functional.cross_entropy(weights[ids[:-1]], ids[1:], reduction="none")
        sums.append((ce * target).sum())
        counts.append(int(target.sum()))
    items = sum(counts)
    seqs = sum(1 for c in counts if c)
    if weighting == "token":
        loss = torch.stack(sums).sum() / max(items, 1)
    else:
        loss = sum((sm / c for sm, c in zip(sums, counts) if c), torch.zeros((), dtype=torch.float64))
        loss = loss / max(seqs, 1)
    return loss + 0 * weights.sum(), items, seqs  # a graph even without targets


BACKENDS = ["flash", "sdpa", "padded"]


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=14),
    cuts=st.lists(st.integers(0, 14), max_size=3),
    backend=st.sampled_from(BACKENDS),
    weighting=st.sampled_from(["token", "sequence"]),
    masked=st.booleans(),
    seq_idx=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_micro_batches_add_up_to_the_unpacked_loss(
    lengths: list[int], cuts: list[int], backend: str, weighting: str, masked: bool,
    seq_idx: bool, seed: int,
) -> None:
    samples = make_samples(lengths, seed, masked)
    weights = table(seed)
    ref, items, seqs = reference(weights, samples, weighting)
    (ref_grad,) = torch.autograd.grad(ref, weights)
    # Any cut into micro-batches (accumulation steps / ranks): the losses, each with the
    # whole step's normaliser, add up to the full-batch loss.
    bounds = sorted({0, len(samples), *(c for c in cuts if c < len(samples))})
    collator = PackedCollator(max_len=48, backend=backend, return_seq_idx=seq_idx)
    total = torch.zeros((), dtype=torch.float64)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        batch = collator(samples[lo:hi])
        batch["num_items_in_batch"] = torch.tensor(items)
        batch["num_sequences_in_batch"] = torch.tensor(seqs)
        total = total + packed_loss(weights[batch["input_ids"]], batch, weighting=weighting)
    (grad,) = torch.autograd.grad(total, weights)
    assert torch.allclose(total, ref, rtol=1e-12, atol=1e-12)
    assert torch.allclose(grad, ref_grad, rtol=1e-10, atol=1e-12)


def test_defaults_are_the_batch_alone() -> None:
    samples = make_samples([5, 9, 2, 14], 3, masked=True)
    weights = table()
    batch = PackedCollator(max_len=32, backend="sdpa")(samples)
    for weighting in ("token", "sequence"):
        ref, _, _ = reference(weights, samples, weighting)
        got = packed_loss(weights[batch["input_ids"]], batch, weighting=weighting)
        assert torch.allclose(got, ref)
    # Explicit normalisers win over the batch's keys.
    batch["num_items_in_batch"] = torch.tensor(1_000)
    ref, items, _ = reference(weights, samples, "token")
    got = packed_loss(weights[batch["input_ids"]], batch, num_items_in_batch=items)
    assert torch.allclose(got, ref)
    assert torch.allclose(packed_loss(weights[batch["input_ids"]], batch), ref * items / 1_000)


def test_no_targets_gives_zero_not_nan() -> None:
    samples = [{"input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]}, {"input_ids": [4], "loss_mask": [1]}]
    weights = table()
    batch = PackedCollator(max_len=8, backend="flash")(samples)
    for weighting in ("token", "sequence"):
        loss = packed_loss(weights[batch["input_ids"]], batch, weighting=weighting)
        (grad,) = torch.autograd.grad(loss, weights)
        assert loss.item() == 0.0 and not grad.any()


def test_segment_ids_from_every_format() -> None:
    samples = [{"input_ids": list(range(1, n + 1))} for n in (3, 5, 2)]
    for backend, extra in (("flash", {}), ("sdpa", {}), ("sdpa", {"return_seq_idx": True})):
        batch = PackedCollator(max_len=10, backend=backend, **extra)(samples)
        seg = segment_ids(batch, batch["labels"].shape, torch.device("cpu")).flatten()
        ids, runs = torch.unique_consecutive(seg, return_counts=True)
        assert ids.tolist() == [0, 1, 2] and sorted(runs.tolist()) == [2, 3, 5]
    padded = PackedCollator(max_len=10, backend="padded")(samples)
    seg = segment_ids(padded, padded["labels"].shape, torch.device("cpu"))
    assert [set(r.tolist()) for r in seg] == [{0}, {1}, {2}]
    # A flat row padded past its sequences: the padding is a segment of its own.
    batch = PackedCollator(max_len=10, backend="flash", pad_to=14)(samples)
    assert segment_ids(batch, (1, 14), torch.device("cpu"))[0, 10:].tolist() == [3] * 4


@pytest.mark.parametrize("backend", ["flash", "sdpa", "padded"])
def test_hugging_face_loss_is_the_token_loss(backend: str) -> None:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    from fastpack.torch import register_hf_attention

    impl = register_hf_attention() if backend == "flash" else "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, attn_implementation=impl,
    ))
    samples = make_samples([7, 12, 3, 9], 5, masked=True)
    batch = PackedCollator(max_len=32, backend=backend)(samples)
    batch["num_items_in_batch"] = torch.tensor(57)
    batch["num_sequences_in_batch"] = torch.tensor(9)  # models take it and ignore it
    out = model(**batch)
    assert torch.allclose(out.loss, packed_loss(out.logits, batch), rtol=1e-6, atol=0)


def test_bad_input() -> None:
    batch = PackedCollator(max_len=8, backend="sdpa")([{"input_ids": [1, 2, 3]}])
    logits = torch.zeros(1, 3, VOCAB)
    with pytest.raises(FastpackError, match="weighting: unknown value 'mean'"):
        packed_loss(logits, batch, weighting="mean")  # type: ignore[arg-type]
    with pytest.raises(FastpackTypeError, match="logits: expected a floating-point"):
        packed_loss(batch["input_ids"], batch)
    with pytest.raises(FastpackTypeError, match="logits: expected a floating-point"):
        packed_loss([[0.0]], batch)  # type: ignore[arg-type]
    with pytest.raises(FastpackError, match="batch: no 'labels' key"):
        packed_loss(logits, {"input_ids": batch["input_ids"]})
    with pytest.raises(FastpackError, match=r"logits: shape \(1, 4, 23\) does not match"):
        packed_loss(torch.zeros(1, 4, VOCAB), batch)
    with pytest.raises(FastpackError, match="num_items_in_batch: must be >= 0, got -3"):
        packed_loss(logits, batch, num_items_in_batch=-3)
    with pytest.raises(FastpackTypeError, match="num_sequences_in_batch: expected an int"):
        packed_loss(logits, batch, weighting="sequence", num_sequences_in_batch="4")  # type: ignore[arg-type]
    with pytest.raises(FastpackError, match="num_items_in_batch: expected one number"):
        packed_loss(logits, batch, num_items_in_batch=torch.tensor([1, 2]))
    wide = PackedCollator(max_len=8, backend="flash")([{"input_ids": [1, 2, 3]}])
    two_rows = dict(wide, labels=torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(FastpackError, match="cu_seq_lens_q: describes one flat row"):
        packed_loss(torch.zeros(2, 3, VOCAB), two_rows, weighting="sequence")


def test_numpy_normalisers_are_exact_counts() -> None:
    samples = make_samples([5, 7, 4], seed=3, masked=False)
    batch = PackedCollator(max_len=32, backend="flash")(samples)
    logits = table(3)[batch["input_ids"]]
    expected = packed_loss(logits, batch, num_items_in_batch=9)
    for value in (np.int64(9), np.uint32(9), np.array(9), np.array([9], dtype=np.int32)):
        got = packed_loss(logits, batch, num_items_in_batch=value)
        assert torch.equal(got, expected), type(value)
        assert torch.equal(packed_loss(logits, {**batch, "num_items_in_batch": value}), expected)
    seq = packed_loss(logits, batch, weighting="sequence", num_sequences_in_batch=2)
    got = packed_loss(logits, batch, weighting="sequence", num_sequences_in_batch=np.int16(2))
    assert torch.equal(got, seq)
    for bad, shown in ((np.float64(9.0), "float64 9.0"), (np.array(9.0), "dtype float64"),
                       (np.array([9, 9]), r"shape \(2,\)"), (np.bool_(True), "bool")):
        with pytest.raises(FastpackTypeError, match=rf"^num_items_in_batch: expected an integer "
                           rf"count .*{shown}"):
            packed_loss(logits, batch, num_items_in_batch=bad)


def test_loss_of_a_numpy_dataset_step_is_the_torch_one() -> None:
    from fastpack.torch import PackedDataset, PackedSampler

    samples = make_samples([5, 7, 4, 9, 3, 6], seed=4, masked=False)
    tokens = [s["input_ids"] for s in samples]
    weights = table(4)
    steps = {}
    for kind in ("np", "pt"):
        ds = PackedDataset(tokens, collator=PackedCollator(max_len=16, return_tensors=kind))
        steps[kind] = []
        for step in PackedSampler(ds, num_replicas=1, rank=0, shuffle=False):
            batch = ds[step]
            logits = weights[torch.as_tensor(batch["input_ids"])]
            steps[kind].append((packed_loss(logits, batch), batch["num_items_in_batch"]))
    assert len(steps["np"]) == len(steps["pt"]) > 1
    for (loss_np, n_np), (loss_pt, n_pt) in zip(steps["np"], steps["pt"]):
        assert isinstance(n_np, np.ndarray) and isinstance(n_pt, torch.Tensor)
        assert int(n_np) == int(n_pt) and torch.equal(loss_np, loss_pt)
