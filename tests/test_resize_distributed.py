"""Resuming an epoch on another world size with torch.distributed (gloo, CPU): 4 ranks
train part of an epoch in micro-batches under a cap, save at an optimizer step, train on
and are killed (SIGKILL mid-step: a preemption; the work after the save is lost), 2 ranks
load rank 0's saved state and train some more and are killed the same way, 3 ranks
finish the epoch. Every rank takes its world size and rank from torch.distributed, and records the
samples of the batches it was served; together they are the epoch's samples, each once.

Processes are forked from the test process (torch is already imported there: the three
phases start in about a second instead of a fresh interpreter each).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gloo import free_port

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import fastpack  # noqa: E402
from fastpack.torch import PackedCollator, PackedDataset, PackedSampler  # noqa: E402

#: (world size, optimizer steps each rank trains before the stop; None: to the end).
PHASES = ((4, 2), (2, 3), (3, None))


def make_dataset() -> PackedDataset:
    lengths = np.random.default_rng(5).integers(1, 120, 240)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    tokens = fastpack.Ragged(np.arange(int(offsets[-1]), dtype=np.int32) % 50 + 1, offsets)
    return PackedDataset(tokens, PackedCollator(max_len=128, backend="flash"),
                         group_tokens=512, seed=2)


def _worker(rank: int, world: int, stop: int | None, port: int, phase: int, out: str) -> None:
    torch.set_num_threads(1)
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        ds = make_dataset()
        sampler = PackedSampler(ds, hidden_size=64, micro_batch_tokens=256, seed=7,
                                pipeline_order=True)
        assert (sampler.num_replicas, sampler.rank) == (world, rank)
        if phase:
            sampler.load_state_dict(torch.load(Path(out) / f"state-{phase - 1}.pt",
                                               weights_only=True))
        batches = iter(torch.utils.data.DataLoader(ds, batch_size=None, sampler=sampler))
        seen, steps, tokens = [], 0, []
        for batch in batches:
            seen.append(batch["sample_ids"].numpy().copy())
            tokens.append(int(batch["input_ids"].shape[1]))
            steps += bool(batch.pop("ends_optimizer_step"))
            if stop is not None and steps == stop:
                break
        counts = [0] * world
        dist.all_gather_object(counts, len(seen))
        assert len(set(counts)) == 1  # every rank ran the same number of micro-batches
        if rank == 0:
            torch.save(sampler.state_dict(), Path(out) / f"state-{phase}.pt")
        torch.save({"samples": seen, "tokens": tokens}, Path(out) / f"seen-{phase}-{rank}.pt")
        if stop is not None:
            dist.barrier()  # every rank's files are written
            next(batches)  # the next step begins; it will not be in any checkpoint
            os.kill(os.getpid(), signal.SIGKILL)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("resize")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    for phase, (world, stop) in enumerate(PHASES):
        args = (world, stop, free_port(), phase, str(out))
        if stop is None:
            torch.multiprocessing.start_processes(_worker, args=args, nprocs=world,
                                                  join=True, start_method=method)
            continue
        with pytest.raises(torch.multiprocessing.ProcessExitedException) as killed:
            torch.multiprocessing.start_processes(_worker, args=args, nprocs=world,
                                                  join=True, start_method=method)
        assert killed.value.signal_name == "SIGKILL"
    return out


def _seen(out: Path) -> list[list[Any]]:
    return [[torch.load(out / f"seen-{p}-{r}.pt", weights_only=False)
             for r in range(world)] for p, (world, _) in enumerate(PHASES)]


def test_four_to_two_to_three_ranks_train_every_sample_once(trained: Path) -> None:
    seen = _seen(trained)
    samples = np.concatenate([a for phase in seen for rank in phase for a in rank["samples"]])
    assert len(samples) == len(np.unique(samples)) == make_dataset().plan.num_sequences
    for phase in seen[:2]:  # the stopped phases ran part of the epoch, not all of it
        assert 0 < sum(len(rank["samples"]) for rank in phase) < len(samples)
    assert max(t for phase in seen for rank in phase for t in rank["tokens"]) <= 256


def test_the_saved_states_record_the_world_sizes(trained: Path) -> None:
    last = torch.load(trained / "state-2.pt", weights_only=True)
    assert [h[0] for h in last["history"]] == [4, 2] and last["num_replicas"] == 3
