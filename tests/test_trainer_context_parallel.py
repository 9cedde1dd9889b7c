"""PackedTrainerMixin with fastpack's context parallelism: examples/trainer_context_parallel.py
under torchrun on 4 CPU processes (gloo), dp = 2 replicas × cp = 2 ranks, 3 accumulation
micro-steps — a tiny Llama (zigzag), a tiny Qwen2 (contiguous) and a tiny Llama (Ulysses)
with the model's own loss, a tiny Qwen2 (zigzag) with ``packed_loss`` weighing sequences
the same, one launch — makes the same optimizer step as one process's SGD step on one
unpacked batch of the same samples: max relative weight difference ≤ 1e-6 (fp32)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

from test_trainer import reference_step  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "trainer_context_parallel.py"
DP, CP = 2, 2


def example() -> Any:
    sys.path.insert(0, str(EXAMPLE.parent))
    spec = importlib.util.spec_from_file_location("trainer_context_parallel", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cp-trainer")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={DP * CP}", str(EXAMPLE), "--cp", str(CP), "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=env, cwd=out,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for run in example().RUNS:
        assert f"{run}: dp={DP} x cp={CP}" in proc.stdout, proc.stdout[-2000:]
    return out


@pytest.mark.parametrize("run", ["llama-zigzag", "qwen2-contiguous", "llama-ulysses",
                                 "qwen2-zigzag-sequence"])
def test_dp_by_cp_equals_the_unpacked_step(trained: Path, run: str) -> None:
    ex = example()
    family, mode, weighting = ex.RUNS[run]
    got = torch.load(trained / run / "weights.pt")
    want = reference_step(ex, weighting, model=ex.tiny_model(family, "sdpa"), replicas=DP,
                          cp_size=CP, cp_mode=mode)
    start = ex.tiny_model(family, "sdpa").state_dict()
    worst = max(float((got[k] - p).abs().max() / p.abs().max()) for k, p in want.items())
    update = max(float((got[k] - p).abs().max() / (p - start[k]).abs().max())
                 for k, p in want.items())
    print(f"{run}: max relative weight difference {worst:.1e}, of the update {update:.1e}")
    assert worst <= 1e-6, worst
    # A wrong label shift, normaliser or dp·cp factor is off by 10-100% of the update.
    assert update <= 1e-3, update


def test_one_process_checks_the_collator_and_trains(tmp_path: Path) -> None:
    """In one process, over a CP group of one: a collator that does not pack for the
    model's group raises before any batch; one that does trains, each micro-batch sharded
    (cp = 1) through the CP attention."""
    from fastpack import FastpackError
    from fastpack.torch import PackedCollator, register_hf_attention

    ex = example()
    group = torch.distributed.ProcessGroup(torch.distributed.HashStore(), 0, 1)
    name = register_hf_attention("fastpack_cp_one", context_parallel_group=group, mode="zigzag")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), **{**ex.COMMON, "ddp_backend": None})

    def trainer(**collator: Any) -> Any:
        return ex.PackedTrainer(
            model=ex.tiny_model("llama", name), args=args, train_dataset=ex.sft_data(),
            data_collator=PackedCollator(max_len=ex.MAX_LEN, backend="flash", **collator),
            group_tokens=ex.GROUP_TOKENS)

    with pytest.raises(FastpackError, match=r"data_collator: packs for cp_size=None, "
                       r"cp_mode='zigzag', but the model's attention is context-parallel "
                       r"over 1 ranks, mode 'zigzag'; build it with PackedCollator"):
        _ = trainer().packed_dataset
    ok = trainer(cp_size=1)
    assert (ok.context_parallel_size, ok.data_parallel_size) == (1, 1)
    result = ok.train()
    assert np.isfinite(result.training_loss)
