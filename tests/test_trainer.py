"""PackedTrainerMixin: the Hugging Face Trainer and TRL's SFTTrainer on 2 CPU processes
(examples/trainer_ddp.py under torchrun, gloo) make the same optimizer step as one
unpacked batch of the same samples; resuming replays the schedule; bad setups raise."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

import fastpack  # noqa: E402
from fastpack import FastpackError, FastpackTypeError  # noqa: E402
from fastpack.torch import (  # noqa: E402
    PackedCollator,
    PackedDataset,
    PackedSampler,
    PackedTrainerMixin,
)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "trainer_ddp.py"
WORLD = 2

warnings.filterwarnings("ignore")
transformers.logging.set_verbosity_error()


def example() -> Any:
    spec = importlib.util.spec_from_file_location("trainer_ddp", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference_step(ex: Any, weighting: str, *, model: Any = None, replicas: int = WORLD,
                   **packing: Any) -> dict[str, Any]:
    """The example's first optimizer step as one SGD step on one padded batch of the
    samples its schedule gives step 0 (all ``replicas`` data-parallel ranks, all
    accumulation micro-steps); ``packing``: the collator's context-parallel options."""
    data = ex.sft_data()
    ds = PackedDataset(data, PackedCollator(max_len=ex.MAX_LEN, backend="flash", **packing),
                       loss_mask="completion_mask", group_tokens=ex.GROUP_TOKENS,
                       seed=ex.COMMON["seed"])
    k = ex.COMMON["gradient_accumulation_steps"]
    model = ex.tiny_llama() if model is None else model
    # The trainer balances the cost model of its model's config.
    schedule = PackedSampler(ds, num_replicas=replicas, rank=0, seed=ex.COMMON["seed"],
                             cost=fastpack.CostModel.from_config(model.config),
                             accumulation_steps=k).schedule(0)
    chosen = [int(i) for g in range(k) for r in range(replicas)
              for i in ds.plan.sample_ids[schedule.lo[g, r] : schedule.hi[g, r]]]
    assert len(set(chosen)) == len(chosen)
    model.config._attn_implementation = "sdpa"
    batch = PackedCollator(max_len=ex.MAX_LEN, backend="padded")(
        [{"input_ids": data[i]["input_ids"], "loss_mask": data[i]["completion_mask"]}
         for i in chosen])
    logits = model(input_ids=batch["input_ids"],
                   attention_mask=batch["attention_mask"]).logits[:, :-1]
    target = batch["labels"][:, 1:]
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none",
    ).view(target.shape)
    valid = target != -100
    if weighting == "sequence":
        rows = valid.any(1)
        loss = (ce.sum(1)[rows] / valid.sum(1)[rows]).mean()
    else:
        loss = ce.sum() / valid.sum()
    loss.backward()
    lr = ex.COMMON["learning_rate"]
    with torch.no_grad():
        return {k: p - lr * p.grad for k, p in model.named_parameters()}


@pytest.mark.parametrize("trainer, weighting, model", [
    ("transformers", "token", "llama"), ("trl", "sequence", "llama"),
    # a hybrid (short convolution + attention), prepared by the mixin
    ("transformers", "token", "lfm2"),
])
def test_two_processes_equal_the_unpacked_step(tmp_path: Path, trainer: str, weighting: str,
                                               model: str) -> None:
    if trainer == "trl":
        pytest.importorskip("trl")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={WORLD}", str(EXAMPLE), "--trainer", trainer,
         "--weighting", weighting, "--model", model, "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"{trainer} ({weighting}): 2 ranks" in proc.stdout
    got = torch.load(tmp_path / "weights.pt")
    ex = example()
    want = reference_step(ex, weighting, model=ex.MODELS[model]())
    start = ex.MODELS[model]().state_dict()
    worst = max(float((got[k] - p).abs().max() / p.abs().max()) for k, p in want.items())
    print(f"{trainer} {weighting}: max relative weight difference {worst:.1e}")
    assert worst <= 1e-5, worst
    update = max(float((got[k] - p).abs().max() / (p - start[k]).abs().max())
                 for k, p in want.items())
    # Relative to the update itself (~lr * grad): fp32 sums in another order differ by
    # about 1e-4 of it; a wrong normaliser or world-size factor is off by 10-100%.
    assert update <= 5e-4, update


# ------------------------------------------------------------------ one process


class RecordingTrainer(PackedTrainerMixin, transformers.Trainer):
    """Records the input ids of every micro-batch it trains on."""

    seen: list[list[int]]

    def compute_loss(self, model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        self.seen.append(inputs["input_ids"].flatten().tolist())
        return super().compute_loss(model, inputs, *args, **kwargs)


def make_trainer(tmp_path: Path, **kwargs: Any) -> RecordingTrainer:
    ex = example()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), **{**ex.COMMON, "max_steps": 4, "save_strategy": "steps",
                                     "save_steps": 2, "gradient_accumulation_steps": 2,
                                     "ddp_backend": None, **kwargs.pop("args", {})})
    trainer = RecordingTrainer(
        model=ex.tiny_llama(), args=args, train_dataset=ex.sft_data(),
        data_collator=PackedCollator(max_len=ex.MAX_LEN, backend="flash"),
        group_tokens=ex.GROUP_TOKENS, **kwargs,
    )
    trainer.seen = []
    return trainer


def test_resume_replays_the_schedule(tmp_path: Path) -> None:
    full = make_trainer(tmp_path / "full")
    full.train()
    assert len(full.seen) == 8
    # Every micro-batch of an optimizer step carries that step's count.
    sampler = full.packed_sampler
    assert (sampler.num_replicas, sampler.accumulation_steps) == (1, 2)
    resumed = make_trainer(tmp_path / "full", args={"max_steps": 4})
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    assert resumed.seen == full.seen[4:]


def test_a_resume_on_another_schedule_is_refused_before_any_step(tmp_path: Path) -> None:
    full = make_trainer(tmp_path / "full")
    full.train()
    checkpoint = tmp_path / "full" / "checkpoint-2"
    saved = json.loads((checkpoint / PackedTrainerMixin.SAMPLER_STATE_NAME).read_text())
    assert (saved["num_replicas"], saved["accumulation_steps"]) == (1, 2)
    # Other accumulation steps: the Trainer would skip 2 steps of another schedule.
    other = make_trainer(tmp_path / "full", args={"gradient_accumulation_steps": 1})
    with pytest.raises(FastpackError, match=r"another accumulation_steps \(2 there, 1 here\)"):
        other.train(resume_from_checkpoint=str(checkpoint))
    assert other.seen == []
    other = make_trainer(tmp_path / "full", args={"seed": 7})
    with pytest.raises(FastpackError, match=r"another seed \(0 there, 7 here\)"):
        other.train(resume_from_checkpoint=True)  # the last checkpoint: checkpoint-4
    # Another packed dataset: its plan's fingerprint differs.
    other = make_trainer(tmp_path / "full")
    other.train_dataset = other.train_dataset.select(range(len(other.train_dataset) - 1))
    with pytest.raises(FastpackError, match=r"another packed dataset"):
        other.train(resume_from_checkpoint=str(checkpoint))
    # A checkpoint without fastpack's file: its RNG files say 4 processes saved it.
    (checkpoint / PackedTrainerMixin.SAMPLER_STATE_NAME).unlink()
    rng = checkpoint / "rng_state.pth"
    for rank in range(4):
        (checkpoint / f"rng_state_{rank}.pth").write_bytes(rng.read_bytes())
    rng.unlink()
    other = make_trainer(tmp_path / "full")
    with pytest.raises(FastpackError, match=r"saved by 4 process\(es\) and this run has 1"):
        other.train(resume_from_checkpoint=str(checkpoint))


def test_a_config_the_cost_model_cannot_read_falls_back_with_one_warning(
    tmp_path: Path,
) -> None:
    import warnings

    trainers = [make_trainer(tmp_path / str(i)) for i in range(2)]
    for t in trainers:
        config = t.model.config
        config.layer_types = ["full_attention", "retention"] * (config.num_hidden_layers // 2)
    with pytest.warns(UserWarning, match="'retention'"):
        sampler = trainers[0].packed_sampler
    assert sampler.cost.name == f"hidden_size={trainers[0].model.config.hidden_size}"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert trainers[1].packed_sampler.cost.key == sampler.cost.key  # warned once


def test_batch_counts_are_the_step_normaliser(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path)
    loader = trainer.get_train_dataloader()
    batches, n = trainer.get_batch_samples(iter(loader), 2, torch.device("cpu"))
    targets = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    assert n is not None and int(n) == targets
    assert all(int(b["num_items_in_batch"]) == targets for b in batches)
    with pytest.raises(FastpackError, match="micro-batches of one optimizer step disagree"):
        trainer.get_batch_samples(iter(batches + [dict(batches[0], num_items_in_batch=1)]), 3,
                                  torch.device("cpu"))


def test_bad_setups_raise(tmp_path: Path) -> None:
    with pytest.raises(FastpackError, match="weighting: unknown value 'mean'"):
        make_trainer(tmp_path, weighting="mean")
    with pytest.raises(FastpackError, match="balance: unknown value 'work'"):
        make_trainer(tmp_path, balance="work")
    with pytest.raises(FastpackError, match="average_tokens_across_devices: must be True"):
        make_trainer(tmp_path, args={"average_tokens_across_devices": False})
    trainer = make_trainer(tmp_path)
    trainer.data_collator = transformers.default_data_collator
    with pytest.raises(FastpackTypeError, match="data_collator: expected a fastpack PackedCollator"):
        trainer.get_train_dataloader()
    trainer = make_trainer(tmp_path)
    trainer.train_dataset = trainer.train_dataset.rename_column("input_ids", "ids")
    with pytest.raises(FastpackError, match="'input_ids' column"):
        trainer.get_train_dataloader()


def test_a_ready_packed_dataset_is_used_as_is(tmp_path: Path) -> None:
    ex = example()
    ds = PackedDataset(list(np.arange(1, 2001).reshape(100, 20) % ex.VOCAB),
                       PackedCollator(max_len=ex.MAX_LEN, backend="flash"), packs_per_batch=2)
    trainer = make_trainer(tmp_path)
    trainer.train_dataset = ds
    assert trainer.packed_dataset is ds
    assert len(trainer.get_train_dataloader()) == len(ds)


# ------------------------------------------------------- tensor / context parallelism


def _as_rank(monkeypatch: pytest.MonkeyPatch, world: int, index: int, tp: int) -> None:
    args = transformers.TrainingArguments
    monkeypatch.setattr(args, "world_size", property(lambda self: world))
    monkeypatch.setattr(args, "process_index", property(lambda self: index))
    monkeypatch.setattr(RecordingTrainer, "get_tp_size", lambda self: tp)


def test_tensor_parallel_ranks_share_a_replica(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """World 4 with tp_size 2: two data-parallel replicas; processes 0, 1 are replica 0
    and see the same steps, processes 2, 3 replica 1; every sample once per replica set."""
    steps = {}
    for index in range(4):
        _as_rank(monkeypatch, 4, index, 2)
        trainer = make_trainer(tmp_path / str(index))
        assert (trainer.data_parallel_size, trainer.data_parallel_rank) == (2, index // 2)
        sampler = trainer.packed_sampler
        assert (sampler.num_replicas, sampler.rank) == (2, index // 2)
        steps[index] = list(sampler)
    assert steps[0] == steps[1] and steps[2] == steps[3] and steps[0] != steps[2]


def test_tensor_parallel_loss_scale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sequence-weighted loss is scaled by the data-parallel size (world // tp), as
    the Trainer's own loss is (num_processes // tp_size), not by the world size."""
    from fastpack.torch import packed_loss

    _as_rank(monkeypatch, 4, 1, 2)
    trainer = make_trainer(tmp_path, weighting="sequence")
    batch = next(iter(trainer.get_train_dataloader()))
    model = trainer.model
    with torch.no_grad():
        loss = trainer.compute_loss(model, dict(batch))
        logits = model(**{k: v for k, v in batch.items()
                          if k not in ("labels", "num_items_in_batch",
                                       "num_sequences_in_batch")}).logits
        plain = packed_loss(logits, batch, weighting="sequence")
    assert torch.allclose(loss, plain * 2, rtol=1e-6)


@pytest.mark.parametrize("method", ["get_cp_size", "get_sp_size"])
def test_context_parallelism_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    monkeypatch.setattr(RecordingTrainer, method, lambda self: 2)
    with pytest.raises(FastpackError, match=f"{method[4:]}: 2; PackedTrainerMixin does not"):
        make_trainer(tmp_path)


def test_tp_size_must_divide_the_world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _as_rank(monkeypatch, 4, 0, 3)
    with pytest.raises(FastpackError, match="tp_size: 3 does not divide the world size 4"):
        make_trainer(tmp_path)


def test_trainer_checks_the_batch_format(tmp_path: Path) -> None:
    """An explicit bool mask for an eager model raises before the forward."""
    trainer = make_trainer(tmp_path)
    trainer.model.config._attn_implementation = "eager"
    batch = PackedCollator(max_len=16, backend="sdpa", mask="explicit")(
        [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    with pytest.raises(FastpackError, match="explicit bool 4-D mask"):
        trainer.compute_loss(trainer.model, batch)


class _Cumsum(torch.nn.Module):
    """A token mixer without sequence boundaries (a running sum over the row)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, hidden: Any) -> Any:
        return self.inner(hidden) + hidden.cumsum(1)


def test_trainer_verifies_the_first_micro_batch(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    trainer = make_trainer(tmp_path)
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    for _ in range(2):
        trainer.compute_loss(trainer.model, dict(batch))
    out = capsys.readouterr().out
    assert out.count("fastpack: verify_packing: 4 sample(s) equal alone and packed") == 1
    assert "off with verify_packing=False" in out
    assert trainer.model.training
    # A model that mixes tokens across sequences stops before the first backward...
    leaky = make_trainer(tmp_path)
    leaky.model.model.layers[1].mlp = _Cumsum(leaky.model.model.layers[1].mlp)
    leaky.model.train()
    with pytest.raises(FastpackError, match=r"model\.layers\.1\.mlp \(_Cumsum\) mixes tokens"):
        leaky.compute_loss(leaky.model, dict(batch))
    # ... unless the check is off.
    off = make_trainer(tmp_path, verify_packing=False)
    off.model.model.layers[1].mlp = _Cumsum(off.model.model.layers[1].mlp)
    off.model.train()
    off.compute_loss(off.model, dict(batch))
    assert "verify_packing" not in capsys.readouterr().out
    with pytest.raises(FastpackError, match="verify_packing: expected True, False or a number"):
        make_trainer(tmp_path, verify_packing=0)
