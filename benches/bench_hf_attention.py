"""Packed GPT-2 forward + backward on the CPU: Hugging Face's SDPA on packed rows (block
mask built from `position_ids`) vs `fastpack.torch.register_hf_attention()` on one flat
row (per-sequence attention from `cu_seq_lens_q`, no mask). Same batch, same weights.

    python benches/bench_hf_attention.py
"""

from __future__ import annotations

import time

import numpy as np
import torch
import transformers

from fastpack.torch import PackedCollator, register_hf_attention


def main() -> None:
    torch.set_num_threads(2)
    transformers.logging.set_verbosity_error()
    name = register_hf_attention()
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(200), 0.8, 20), 8, 1024).astype(int)
    feats = [{"input_ids": rng.integers(1, 256, n).tolist()} for n in lengths]
    print(f"{len(feats)} sequences, {int(lengths.sum()):,} tokens, max_len 1024; "
          f"GPT-2 2 layers x 128, fp32, median of 10 forward+backward")
    for label, impl, backend in (("sdpa, packed rows", "sdpa", "sdpa"),
                                 ("fastpack_varlen, one flat row", name, "flash")):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=256, n_embd=128, n_layer=2, n_head=2, n_positions=1024,
            attn_implementation=impl, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0))
        batch = PackedCollator(max_len=1024, backend=backend)(feats)
        times = []
        for _ in range(12):
            start = time.perf_counter()
            loss = model(**batch).loss
            loss.backward()
            times.append(time.perf_counter() - start)
        print(f"  {label:30} {np.median(times[2:]) * 1e3:7.0f} ms   loss {loss.item():.6f}   "
              f"input {tuple(batch['input_ids'].shape)}")


if __name__ == "__main__":
    main()
