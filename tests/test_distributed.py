"""Two ranks x three accumulation micro-steps of packed batches make the same optimizer
steps as unpacked full batches: torch.distributed (gloo) on the CPU, fp32.

The ranks are spawned once for the module (a few seconds of imports); each trains a whole
epoch from the same initial weights in three ways (``packed_loss`` with token weighting,
with sequence weighting, and the Hugging Face model's own loss with the batch's
``num_items_in_batch``) and saves the weights; the tests compare them with reference
steps computed here, in one process, each over the same sequences as one padded batch.
The epoch holds what exactness is hardest on: two samples longer than ``max_len`` split
into pieces (``overlong="split"``: each piece trains as a sequence of its own), a
remainder step the sampler cuts into smaller ones for the two ranks, and a last optimizer
step with fewer micro-steps.
"""

from __future__ import annotations

import multiprocessing
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gloo import free_port

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
    lengths[:2] = (100, 150)  # longer than max_len: split into pieces
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
    return PackedDataset(ids, PackedCollator(max_len=64, backend="flash", overlong="split"),
                         loss_mask=masks, group_tokens=128, seed=1)


def make_sampler(ds: PackedDataset, rank: int | None = None) -> PackedSampler:
    kwargs = {} if rank is None else {"num_replicas": WORLD, "rank": rank}
    return PackedSampler(ds, hidden_size=32, accumulation_steps=ACCUMULATION, seed=3,
                         **kwargs)


def _worker(rank: int, port: int, out: str) -> None:
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    try:
        ds = make_dataset()
        sampler = make_sampler(ds)
        assert (sampler.num_replicas, sampler.rank) == (WORLD, rank)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, sampler=sampler)
        batches = list(loader)  # the whole epoch
        for mode in MODES:
            model = torch.nn.parallel.DistributedDataParallel(make_model())
            optimizer = torch.optim.SGD(model.parameters(), lr=LR)
            for start in range(0, len(batches), ACCUMULATION):
                step = batches[start : start + ACCUMULATION]
                for i, batch in enumerate(step):
                    last = i == len(step) - 1
                    with model.no_sync() if not last else _nothing():
                        if mode == "model":  # the model's own loss, from num_items_in_batch
                            loss = model(**batch).loss
                        else:
                            inputs = {k: v for k, v in batch.items() if k != "labels"}
                            loss = packed_loss(model(**inputs).logits, batch, weighting=mode)
                        # DDP averages gradients over the ranks: undo it (loss.py's docs).
                        (loss * WORLD).backward()
                optimizer.step()
                optimizer.zero_grad()
            if rank == 0:
                torch.save(model.module.state_dict(), Path(out) / f"{mode}.pt")
        _resume(ds, rank, out)
    finally:
        dist.destroy_process_group()


def _resume(ds: PackedDataset, rank: int, out: str) -> None:
    """Stopped after 2 micro-steps of a worker loader (saving ``consumed=2``) and resumed,
    each rank (the world from torch.distributed) goes on where it stopped; the ranks'
    samples, gathered, are every piece once."""
    def loader(sampler: PackedSampler) -> Any:
        # fork: the rank itself was spawned, and so would its workers be (slow imports).
        fork = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
        return torch.utils.data.DataLoader(ds, batch_size=None, sampler=sampler,
                                           num_workers=1, multiprocessing_context=fork)

    full = [b["input_ids"].tolist() for b in loader(make_sampler(ds))]
    first = make_sampler(ds)
    head = []
    for k, batch in enumerate(loader(first), 1):
        head.append(batch["input_ids"].tolist())
        if k == 2:
            break
    state = first.state_dict(consumed=2)
    second = make_sampler(ds)
    second.load_state_dict(state)
    tail = [b["input_ids"].tolist() for b in loader(second)]
    pieces = [ds.samples(step).tolist() for step in make_sampler(ds)]
    gathered: list[Any] = [None] * WORLD
    torch.distributed.all_gather_object(gathered, pieces)
    torch.save({"full": full, "resumed": head + tail, "pieces": gathered},
               Path(out) / f"resume-{rank}.pt")


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ddp")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.multiprocessing.spawn(_worker, args=(free_port(), str(out)), nprocs=WORLD,
                                join=True)
    return out


def optimizer_steps() -> list[list[tuple[int, int, int]]]:
    """The sequences of every optimizer step of the epoch, over both ranks and all its
    micro-steps, as ``(sample, start, length)``: a split sample's pieces apart, a cut
    step's pieces where the schedule put them."""
    ds = make_dataset()
    plan = ds.plan
    schedule = make_sampler(ds, rank=0).schedule(0)
    steps = []
    for g0 in range(0, len(schedule), ACCUMULATION):
        segments = [
            (int(plan.sample_ids[j]), int(plan.starts[j]), int(plan.seqlens[j]))
            for g in range(g0, min(g0 + ACCUMULATION, len(schedule))) for r in range(WORLD)
            for j in range(int(schedule.lo[g, r]), int(schedule.hi[g, r]))
        ]
        steps.append(segments)
    return steps


def test_the_epoch_has_split_pieces_and_a_cut_step() -> None:
    ds = make_dataset()
    schedule = make_sampler(ds, rank=0).schedule(0)
    assert ds.plan.split_sequences == 2
    assert not schedule.whole.all()  # the remainder step, cut for the two ranks
    assert len(schedule) % ACCUMULATION  # a last optimizer step of fewer micro-steps
    pieces = [s for step in optimizer_steps() for s in step]
    assert len(pieces) == len(set(pieces)) == ds.plan.num_segments


def reference_steps(mode: str) -> dict[str, Any]:
    """The epoch as SGD steps, each on one unpacked (padded) batch of its sequences."""
    ids, masks = samples()
    model = make_model()
    model.config._attn_implementation = "sdpa"  # plain padded batch, plain attention
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in optimizer_steps():
        batch = PackedCollator(max_len=64, backend="padded")([
            {"input_ids": ids[i][a : a + n], "loss_mask": masks[i][a : a + n]}
            for i, a, n in step
        ])
        logits = model(input_ids=batch["input_ids"],
                       attention_mask=batch["attention_mask"]).logits[:, :-1]
        target = batch["labels"][:, 1:]
        ce = torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=-100,
            reduction="none",
        ).view(target.shape)
        valid = target != -100
        if mode == "sequence":  # mean over each sequence's targets, then over sequences
            rows = valid.any(1)
            loss = (ce.sum(1)[rows] / valid.sum(1)[rows]).mean()
        else:
            loss = ce.sum() / valid.sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: p.detach().clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("mode", MODES)
def test_every_step_equals_the_unpacked_full_batch(trained: Path, mode: str) -> None:
    got = torch.load(trained / f"{mode}.pt")
    want = reference_steps("token" if mode == "model" else mode)
    start = make_model().state_dict()
    worst = max(
        float((got[k] - p).abs().max() / p.abs().max()) for k, p in want.items()
    )
    assert worst <= 1e-5, worst
    # The updates themselves, not only the weights, match (a wrong normaliser would
    # change every update by the same factor).
    update = max(
        float((got[k] - p).abs().max() / (p - start[k]).abs().max()) for k, p in want.items()
    )
    assert update <= 1e-4, update


def test_the_two_weightings_differ(trained: Path) -> None:
    token = torch.load(trained / "token.pt")
    sequence = torch.load(trained / "sequence.pt")
    key = "model.embed_tokens.weight"
    assert not torch.allclose(token[key], sequence[key], rtol=1e-3, atol=0)


def test_a_worker_loader_resumes_on_each_rank(trained: Path) -> None:
    ds = make_dataset()
    for rank in range(WORLD):
        got = torch.load(trained / f"resume-{rank}.pt")
        assert got["resumed"] == got["full"]
        assert len(got["full"]) == len(make_sampler(ds, rank=rank))
    every = sorted(i for rank in got["pieces"] for step in rank for i in step)
    assert every == sorted(ds.plan.sample_ids.tolist())
