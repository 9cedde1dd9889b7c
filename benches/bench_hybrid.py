"""Packed training of hybrid models on the CPU: what keeping the token mixers exact costs.

Tiny random models (hidden 64, 2 layers: a mixer layer and an attention layer) — LFM2
(a short causal convolution) and Bamba (a Mamba2 mixer) — forward + backward over one
step of ~2,048 tokens of log-normal lengths (median 60), on one thread, CPU time
(``time.process_time``: a shared machine's load stays out), median of the repeats:

* ``packed, batched`` — ``PackedCollator(backend="flash")``, ``register_hf_attention()``
  and ``prepare_model(model)`` (the default: sequences gathered into right-padded groups of
  similar lengths, one mixer call per group; LFM2's convolution as a varlen convolution);
* ``packed, loop`` — the same with ``prepare_model(model, strategy="loop")``: the mixer
  run on every sequence alone (the reference);
* ``padded`` — ``PackedCollator(backend="padded")``: one sample per row, Hugging Face's
  SDPA with the padding mask (the unpacked baseline);
* ``per sample`` — every sample through the model alone, one after another.

Every exact variant computes the same logits (checked before timing, to 1e-4).

    python benches/bench_hybrid.py            # ~1-2 min; writes results/hybrid.md
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from fastpack.torch import PackedCollator, prepare_model, register_hf_attention

RESULTS = Path(__file__).parent / "results"
REPS = 5
VOCAB = 256
MAX_LEN = 512


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def lengths(tokens: int = 2048, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    out = np.clip(rng.lognormal(np.log(60), 0.9, 1000), 2, MAX_LEN).astype(int)
    return out[: int(np.searchsorted(np.cumsum(out), tokens))].tolist()


def model(family: str) -> Any:
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    if family == "lfm2":
        cfg: Any = transformers.Lfm2Config(layer_types=["conv", "full_attention"], **common)
    else:
        cfg = transformers.BambaConfig(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
                                       mamba_chunk_size=64, attn_layer_indices=[1], **common)
    return transformers.AutoModelForCausalLM.from_config(cfg).float()


def cpu_seconds(fns: dict[str, Callable[[], Any]]) -> dict[str, float]:
    """Median CPU seconds of each function, the calls interleaved round-robin."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(REPS):
        for name, fn in fns.items():
            t0 = time.process_time()
            fn()
            times[name].append(time.process_time() - t0)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def run(family: str) -> dict[str, float]:
    fastpack_attention = register_hf_attention()
    rng = np.random.default_rng(1)
    samples = [{"input_ids": rng.integers(1, VOCAB, n).tolist()} for n in lengths()]
    tokens = sum(len(s["input_ids"]) for s in samples)
    packed = PackedCollator(max_len=MAX_LEN, backend="flash")(samples)
    packed = {k: v for k, v in packed.items() if not k.startswith("sample_")}
    padded = PackedCollator(max_len=MAX_LEN, backend="padded")(samples)
    padded = {k: v for k, v in padded.items() if not k.startswith("sample_")}

    batched = prepare_model(model(family))
    batched.set_attn_implementation(fastpack_attention)
    loop = prepare_model(model(family), strategy="loop")
    loop.set_attn_implementation(fastpack_attention)
    plain = model(family)
    plain.set_attn_implementation("sdpa")

    with torch.no_grad():  # the same logits, before timing
        a, b = batched(**packed).logits, loop(**packed).logits
        assert (a - b).abs().max().item() < 1e-4

    def step(m: Any, batch: dict[str, Any]) -> None:
        m(**batch).loss.backward()

    def per_sample() -> None:
        for s in samples:
            ids = torch.tensor([s["input_ids"]])
            plain(input_ids=ids, labels=ids).loss.backward()

    seconds = cpu_seconds({
        "packed, batched": lambda: step(batched, packed),
        "packed, loop": lambda: step(loop, packed),
        "padded": lambda: step(plain, padded),
        "per sample": per_sample,
    })
    return {name: tokens / s for name, s in seconds.items()}


def main() -> None:
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    rows = []
    for family in ("lfm2", "bamba"):
        result = run(family)
        for name, rate in result.items():
            rows.append(f"| {family} | {name} | {rate:,.0f} |")
            print(f"{family:6s} {name:16s} {rate:10,.0f} tokens/s")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    text = (
        "# Hybrid models on the CPU: packed (exact) vs padded vs per sample\n\n"
        f"Forward + backward of one ~2,048-token step (log-normal lengths, median 60), "
        f"tiny random models (hidden 64, a mixer layer + an attention layer), one thread, "
        f"CPU time, median of {REPS - 1} (after one warm-up). {cpu_name()}, load "
        f"{load:.1f}; torch {torch.__version__}, transformers {transformers.__version__}; "
        f"`python benches/bench_hybrid.py`.\n\n"
        "| model | path | tokens/s |\n|---|---|---:|\n" + "\n".join(rows) + "\n"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "hybrid.md").write_text(text)


if __name__ == "__main__":
    main()
