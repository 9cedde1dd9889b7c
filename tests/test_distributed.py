"""Two ranks x three accumulation micro-steps of packed batches make the same optimizer
step as one unpacked full batch: torch.distributed (gloo) on the CPU, fp32.

The ranks are spawned once for the module (a few seconds of imports); each trains one
optimizer step from the same initial weights in three ways (``packed_loss`` with token
weighting, with sequence weighting, and the Hugging Face model's own loss with the batch's
``num_items_in_batch``) and saves the weights; the tests compare them with a reference
step computed here, in one process, over the same samples as one padded batch.
"""

from __future__ import annotations

import os
import socket
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from fastpack.torch import (  # noqa: E402
    PackedCollator,
    PackedDataset,
    PackedSampler,
    packed_loss,
    register_hf_attention,
)

WORLD, ACCUMULATION, LR = 2, 3, 0.5
MODES = ("token", "sequence", "model")
VOCAB = 61


def samples(n: int = 48, seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Token ids and 0/1 loss masks (prompt masked, answer trained; some fully masked)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 40, n)
    ids = [rng.integers(1, VOCAB, int(k)) for k in lengths]
    masks = []
    for k in lengths:
        m = np.zeros(int(k), dtype=np.uint8)
        m[int(rng.integers(0, k)) :] = 1
        if rng.random() < 0.1:
            m[:] = 0
        masks.append(m)
    return ids, masks


def make_model() -> Any:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        attn_implementation=register_hf_attention(),
    ))


def make_dataset() -> PackedDataset:
    ids, masks = samples()
    return PackedDataset(ids, PackedCollator(max_len=64, backend="flash"), loss_mask=masks,
                         group_tokens=128, seed=1)


def _worker(rank: int, port: int, out: str) -> None:
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    try:
        ds = make_dataset()
        sampler = PackedSampler(ds, hidden_size=32, accumulation_steps=ACCUMULATION, seed=3)
        assert (sampler.num_replicas, sampler.rank) == (WORLD, rank)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, sampler=sampler)
        batches = [b for _, b in zip(range(ACCUMULATION), loader)]
        for mode in MODES:
            model = torch.nn.parallel.DistributedDataParallel(make_model())
            optimizer = torch.optim.SGD(model.parameters(), lr=LR)
            for i, batch in enumerate(batches):
                last = i == len(batches) - 1
                with model.no_sync() if not last else _nothing():
                    if mode == "model":  # the model's own loss, from num_items_in_batch
                        loss = model(**batch).loss
                    else:
                        inputs = {k: v for k, v in batch.items() if k != "labels"}
                        loss = packed_loss(model(**inputs).logits, batch, weighting=mode)
                    # DDP averages gradients over the ranks: undo it (module docs of loss.py).
                    (loss * WORLD).backward()
            optimizer.step()
            if rank == 0:
                torch.save(model.module.state_dict(), Path(out) / f"{mode}.pt")
    finally:
        dist.destroy_process_group()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ddp")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.multiprocessing.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD,
                                join=True)
    return out


def first_step_samples() -> list[int]:
    """The samples of optimizer step 0, over both ranks and all micro-steps, from the
    schedule every rank computed."""
    ds = make_dataset()
    schedule = PackedSampler(ds, num_replicas=WORLD, rank=0, hidden_size=32,
                             accumulation_steps=ACCUMULATION, seed=3).schedule(0)
    ids: list[int] = []
    for g in range(ACCUMULATION):
        for r in range(WORLD):
            ids += ds.plan.sample_ids[schedule.lo[g, r] : schedule.hi[g, r]].tolist()
    return ids


def reference_step(mode: str) -> dict[str, Any]:
    """One SGD step on one unpacked (padded) batch of the step's samples."""
    ids, masks = samples()
    chosen = first_step_samples()
    assert len(set(chosen)) == len(chosen)
    model = make_model()
    model.config._attn_implementation = "sdpa"  # plain padded batch, plain attention
    batch = PackedCollator(max_len=64, backend="padded")(
        [{"input_ids": ids[i], "loss_mask": masks[i]} for i in chosen])
    logits = model(input_ids=batch["input_ids"],
                   attention_mask=batch["attention_mask"]).logits[:, :-1]
    target = batch["labels"][:, 1:]
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=-100, reduction="none",
    ).view(target.shape)
    valid = target != -100
    if mode == "sequence":  # mean over each sample's targets, then over the samples
        per_sample = ce.sum(1)[valid.any(1)] / valid.sum(1)[valid.any(1)]
        loss = per_sample.mean()
    else:
        loss = ce.sum() / valid.sum()
    loss.backward()
    with torch.no_grad():
        return {k: p - LR * p.grad for k, p in model.named_parameters()}


@pytest.mark.parametrize("mode", MODES)
def test_one_step_equals_the_unpacked_full_batch(trained: Path, mode: str) -> None:
    got = torch.load(trained / f"{mode}.pt")
    want = reference_step("token" if mode == "model" else mode)
    start = make_model().state_dict()
    worst = max(
        float((got[k] - p).abs().max() / p.abs().max()) for k, p in want.items()
    )
    assert worst <= 1e-5, worst
    # The update itself, not only the weights, matches (a wrong normaliser would change
    # every update by the same factor).
    update = max(
        float((got[k] - p).abs().max() / (p - start[k]).abs().max()) for k, p in want.items()
    )
    assert update <= 1e-4, update


def test_the_two_weightings_differ(trained: Path) -> None:
    token = torch.load(trained / "token.pt")
    sequence = torch.load(trained / "sequence.pt")
    key = "model.embed_tokens.weight"
    assert not torch.allclose(token[key], sequence[key], rtol=1e-3, atol=0)
