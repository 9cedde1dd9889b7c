"""The cost of `fastpack.torch.verify_packing` on the first step, relative to one training
step (forward + backward + SGD update of the packed batch), on the CPU; and the size of
the packed-vs-alone differences per dtype that set its default tolerances.

Models: tiny Llama (2 layers x 64) and small Llama (4 layers x 256), fastpack's attention,
one flat row (``backend="flash"``). Batches of 1k and 4k tokens of lognormal lengths.
Verify as the Trainer runs it (4 samples, forward only) and over every sample.

    python benches/bench_verify.py [--repeats 5] [--out benches/results/verify.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import transformers

from fastpack.torch import PackedCollator, register_hf_attention, verify_packing

MODELS = {
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "small": dict(vocab_size=1024, hidden_size=256, intermediate_size=512,
                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  head_dim=32),
}
BUDGETS = (1024, 4096)


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def samples(budget: int, vocab: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < budget:
        n = int(np.clip(rng.lognormal(np.log(120), 0.7), 8, 512))
        n = min(n, budget - total)
        out.append({"input_ids": rng.integers(1, vocab, n).tolist()})
        total += n
    return out


def median(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def model(size: str, impl: str, dtype: torch.dtype = torch.float32) -> Any:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**MODELS[size])
    m = transformers.LlamaForCausalLM(cfg).to(dtype)
    m.set_attn_implementation(impl)
    return m


def measure(m: Any, opt: Any, batch: dict[str, Any], repeats: int
            ) -> tuple[float, float, float]:
    """Seconds of one training step, of the Trainer's check and of a check of all."""

    def step() -> None:
        m.train()
        loss = m(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    t_step = median(step, repeats)
    t_four = median(lambda: verify_packing(m, batch, samples=4), repeats)
    t_all = median(lambda: verify_packing(m, batch), max(1, repeats // 2))
    return t_step, t_four, t_all


def cost(repeats: int, name: str) -> list[str]:
    rows = ["| model | tokens | samples | train step | verify 4 samples | ratio | "
            "verify all | ratio |", "|---|---|---|---|---|---|---|---|"]
    for size in MODELS:
        m = model(size, name)
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        for budget in BUDGETS:
            feats = samples(budget, MODELS[size]["vocab_size"])
            batch = PackedCollator(max_len=budget, backend="flash")(feats)

            t_step, t_four, t_all = measure(m, opt, batch, repeats)
            rows.append(f"| {size} | {budget} | {len(feats)} | {t_step * 1e3:.0f} ms | "
                        f"{t_four * 1e3:.0f} ms | {t_four / t_step:.2f}x | "
                        f"{t_all * 1e3:.0f} ms | {t_all / t_step:.2f}x |")
            print(rows[-1], flush=True)
    return rows


def tolerances(name: str) -> list[str]:
    rows = ["| model | dtype | fastpack attention, flat row | sdpa, packed rows |",
            "|---|---|---|---|"]
    feats = samples(1024, 256, seed=1)
    for size in ("tiny",):
        for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
            cells = []
            for impl, backend in ((name, "flash"), ("sdpa", "sdpa")):
                m = model(size, impl, dtype)
                batch = PackedCollator(max_len=512, backend=backend)(feats)
                cells.append(f"{verify_packing(m, batch, atol=1e9).worst:.2g}")
            rows.append(f"| {size} | {str(dtype).removeprefix('torch.')} | {cells[0]} | "
                        f"{cells[1]} |")
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the tables as markdown here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    name = register_hf_attention()
    load = os.getloadavg()[0]
    head = (f"`python benches/bench_verify.py`: {cpu_name()}, torch {torch.__version__}, "
            f"{args.threads} threads, load average {load:.1f} at the start; medians of "
            f"{args.repeats}.")
    print(head, flush=True)
    rows = cost(args.repeats, name)
    tol = tolerances(name)
    if args.out:
        with open(args.out, "w") as f:
            f.write("# verify_packing: cost on the first step, and tolerances\n\n" + head +
                    "\n\nThe cost of the check relative to one training step (forward, "
                    "backward, SGD update of the packed batch; Llama with fastpack's "
                    "attention on one flat row):\n\n" + "\n".join(rows) +
                    "\n\nThe largest |packed - alone| of the logits over every sample of a "
                    "1k-token batch (tiny Llama; alone with Hugging Face's sdpa), which "
                    "sets the default tolerances (fastpack.torch.verify.TOLERANCES):\n\n" +
                    "\n".join(tol) + "\n")


if __name__ == "__main__":
    main()
