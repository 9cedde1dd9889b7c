#!/usr/bin/env python
"""GPU check of fastpack.torch.attention.varlen_attention (one short run on a CUDA machine).

    python benches/gpu_check.py               # on a CUDA machine; < 5 min on an H200
    python benches/gpu_check.py --cpu-smoke   # tiny fp32 run on CPU: checks the script itself

Without CUDA (and without --cpu-smoke) it prints "skipped: no CUDA" and exits 0.

1. Correctness, bf16: every kernel that can run here (flash-attn if installed,
   torch.nn.attention.varlen.varlen_attn, flex attention, the per-sequence SDPA loop)
   against per-sequence attention computed in fp32 from the same bf16 inputs: output and
   dq/dk/dv, causal and not, MHA and GQA, with empty and 1-token sequences and sequences
   crossing flex's 128-token blocks; then a sliding window, soft-capping and both (a
   kernel that has no soft-capping must refuse it with a FastpackError).
   err = max|x - ref| / max|ref|; a case passes when
   err <= max(2 * eps_bf16, 2 * err of torch's own bf16 SDPA run per sequence).
2. Flex: compile time of the first call, and that later calls with new cu_seqlens (new
   mask_mod closures, other total lengths) do not recompile.
3. Attention alone, forward+backward: packed varlen_attention per kernel vs. padded
   SDPA (key-padding mask) over the same documents.
4. A random-init bf16 MistralForCausalLM (transformers; Llama with a sliding window
   shorter than the longest documents), forward+backward: padded batch
   (attn_implementation="sdpa", attention_mask) vs. one packed row through the shipped
   ``fastpack.torch.register_hf_attention(kernel=...)``, per kernel; the packed loss
   against the padded loss.
5. Context parallelism (``fastpack.cp_layout``, ``context_parallel_attention``):
   a. the layouts against the libraries' own, where installed: TransformerEngine's
      ``tex.thd_get_partitioned_indices`` (zigzag indices) and ring-flash-attn's
      ``llama3_flash_attn_prepare_cu_seqlens`` (contiguous local arrays), cp = 2, 4, 8;
   b. the zigzag and contiguous local attention on this GPU, every rank of cp = 2 and 4
      emulated in this process (K/V gathered by concatenation, their gradients summed
      over the ranks as the reduce-scatter does): flash-attn varlen (bottom-right causal
      over each run's keys) and the SDPA loop, bf16, against the fp32 reference, output
      and dq/dk/dv, with the same pass rule as section 1;
   c. on a long row, the time of all emulated ranks one after another (fwd+bwd) beside
      cp = 1, with the busiest rank's share of the attention work (zigzag: 1/cp);
   d. with 2 or more GPUs: a real NCCL world of min(4, GPUs) ranks running
      ``context_parallel_attention`` with every kernel that runs (ring-flash-attn,
      flash-attn, SDPA) in every mode, against the fp32 reference.
6. Tree batches (``share_prefix=True``, fastpack.torch.tree): GRPO-like rollouts (a long
   prompt, responses crossing flex's 128-token blocks) and a branching chat from the
   collator; ``tree_attention`` with flash-attn over the gathered paths (causal aligned
   bottom-right) and compiled flex with the tree's BlockMask, against the per-segment
   SDPA tree kernel computed in fp32 from the same bf16 inputs, out and dq/dk/dv, plain,
   with a sliding window and with soft-capping; same tolerance rule as 1. Then a bf16
   LlamaForCausalLM: every sample's logits from one tree batch through
   ``register_hf_attention(kernel=...)`` against the sample alone in fp32 (the bf16 SDPA
   run alone is the baseline), and the forward+backward time of the tree batch beside the
   same rollouts packed whole.
7. A random-init Qwen2-VL (vision-language, mRoPE), documents with 0-3 images and a
   video: ``PackedCollator(backend="flash", model_config=...)`` batches (``position_ids``
   ``[4, 1, T]``, media in placeholder order) through sdpa, fastpack's attention and
   ``flash_attention_2`` when flash-attn is installed: every document's logits against
   the document alone (relative error), and forward+backward time packed vs padded.
8. Hybrid models prepared with ``fastpack.torch.prepare_model`` (LFM2's short
   convolution, Bamba's Mamba2 mixer, Qwen3-Next's gated delta net + MoE), bf16: every
   document's logits from one packed row against the document alone in fp32; a model
   passes when its error <= 2 * (the document alone in bf16 against fp32) + 2 * eps_bf16
   (2^-7 in all); forward+backward tokens/s packed vs padded. Each family runs
   ``strategy="kernels"`` (the whole packed row through mamba_ssm / causal-conv1d /
   flash-linear-attention with their ``seq_idx`` / ``cu_seqlens``) when those kernels are
   installed and take the boundaries, and ``strategy="batched"``; each row reports the
   path every mixer ran (``mixer_paths``) and, where there is no kernel path, why.

The sections are functions of (torch, attention module, config, device, dtype), so
tests/test_attention.py runs this harness on the CPU with the CUDA kernels replaced by CPU
stand-ins of the same signatures.

Prints a compact report; writes everything to $OUT/gpu_check.json when OUT is set.
Exit status 1 when a correctness check fails.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

T_START = time.perf_counter()
TIME_BUDGET_S = 240.0  # heavy sections are skipped past this, to stay under 5 minutes


def elapsed() -> float:
    return time.perf_counter() - T_START


def load_attention_module() -> ModuleType:
    """fastpack.torch.attention (the package must be importable: PYTHONPATH=python with the
    built extension, as everywhere else)."""
    from fastpack.torch import attention

    return attention


def write_json(report: dict[str, Any]) -> None:
    out_dir = os.environ.get("OUT")
    if out_dir:
        path = Path(out_dir) / "gpu_check.json"
        path.write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {path}")


# ------------------------------------------------------------------------ helpers


def cumulative(lengths: Sequence[int]) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def reference_fp32(
    torch: Any,
    q: Any,
    k: Any,
    v: Any,
    lengths: Sequence[int],
    causal: bool,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> Any:
    """Per-sequence attention in fp32 on upcast copies (autograd flows to q, k, v), written
    out (scores, mask, softmax) so that it shares no code with the kernels: a window keeps
    keys with 0 <= q - k < sliding_window (Hugging Face's), softcap caps the scores."""
    groups = q.shape[1] // k.shape[1]
    outs = []
    start = 0
    for n in lengths:
        if n == 0:
            continue
        sl = slice(start, start + n)
        qi = q[sl].float().transpose(0, 1)
        ki = k[sl].float().transpose(0, 1).repeat_interleave(groups, 0)
        vi = v[sl].float().transpose(0, 1).repeat_interleave(groups, 0)
        scores = qi @ ki.transpose(1, 2) * (scale if scale is not None else qi.shape[-1] ** -0.5)
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        idx = torch.arange(n, device=q.device)
        distance = idx[:, None] - idx[None, :]
        keep = torch.ones(n, n, dtype=torch.bool, device=q.device)
        if causal:
            keep &= distance >= 0
        if sliding_window is not None:
            keep &= distance < sliding_window
        scores = scores.masked_fill(~keep, float("-inf"))
        outs.append((torch.softmax(scores, dim=-1) @ vi).transpose(0, 1))
        start += n
    return torch.cat(outs)


def rel_err(x: Any, ref: Any) -> float:
    x, ref = x.detach().float(), ref.detach().float()
    return float((x - ref).abs().max()) / max(float(ref.abs().max()), 1e-12)


def timed(torch: Any, fn: Callable[[], Any], device: Any, iters: int, warmup: int) -> float:
    """Median milliseconds of fn() over iters runs after warmup runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def peak_mem_gib(torch: Any, device: Any) -> float | None:
    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated() / 2**30, 2)


def reset_peak(torch: Any, device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# -------------------------------------------------------------------- 1. correctness


def run_case(am: ModuleType, kernel: str, case: dict[str, Any]) -> list[float]:
    """Relative errors of (out, dq, dk, dv) of one kernel against the fp32 reference."""
    xs = [t.detach().clone().requires_grad_(True) for t in case["qkv"]]
    out = am.varlen_attention(
        *xs, case["cu"], case["max_len"], causal=case["causal"], kernel=kernel,
        **case.get("options", {}),
    )
    out.backward(case["grad_out"])
    assert out.shape == xs[0].shape and out.dtype == xs[0].dtype
    grads = [rel_err(x.grad, g) for x, g in zip(xs, case["ref_grads"])]
    return [rel_err(out, case["ref"]), *grads]


def check_correctness(
    torch: Any, am: ModuleType, cfg: dict[str, Any], device: Any, dtype: Any
) -> list[dict[str, Any]]:
    lengths = cfg["check_lengths"]
    total, max_len = sum(lengths), max(lengths)
    cu = torch.tensor(cumulative(lengths), dtype=torch.int32, device=device)
    eps = torch.finfo(dtype).eps
    kernels = am.available_kernels(torch.empty(1, device=device, dtype=dtype))
    results: list[dict[str, Any]] = []
    variants: list[tuple[int, int, bool, dict[str, Any]]] = [
        (hq, hkv, causal, {}) for hq, hkv in cfg["check_heads"] for causal in (True, False)
    ]
    hq_last, hkv_last = cfg["check_heads"][-1]
    window, cap = cfg["check_window"], cfg["check_softcap"]
    for options in ({"sliding_window": window}, {"softcap": cap},
                    {"sliding_window": window, "softcap": cap}):
        variants.append((hq_last, hkv_last, True, options))
    for hq, hkv, causal, options in variants:
        gen = torch.Generator(device=device).manual_seed(hq * 10 + hkv + int(causal))
        d = cfg["head_dim"]
        q = torch.randn(total, hq, d, device=device, dtype=dtype, generator=gen)
        k = torch.randn(total, hkv, d, device=device, dtype=dtype, generator=gen)
        v = torch.randn(total, hkv, d, device=device, dtype=dtype, generator=gen)
        grad_out = torch.randn(total, hq, d, device=device, dtype=dtype, generator=gen)

        lq, lk, lv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        ref = reference_fp32(torch, lq, lk, lv, lengths, causal, **options)
        ref.backward(grad_out.float())
        case = {
            "qkv": (q, k, v),
            "grad_out": grad_out,
            "cu": cu,
            "max_len": max_len,
            "causal": causal,
            "ref": ref,
            "ref_grads": (lq.grad, lk.grad, lv.grad),
            "options": options,
        }
        # Baseline: torch's own SDPA kernels in bf16, one sequence at a time.
        baseline = run_case(am, "sdpa", case)
        for kernel in kernels:
            if kernel == "flex" and cfg.get("flex_cases") is not None:
                if (hq, hkv, causal) not in cfg["flex_cases"] and not options:
                    continue
            row: dict[str, Any] = {"kernel": kernel, "hq": hq, "hkv": hkv, "causal": causal,
                                   **options}
            refuses = kernel == "varlen" and "softcap" in options
            t0 = time.perf_counter()
            try:
                errs = run_case(am, kernel, case)
            except Exception as exc:  # report and keep going
                if refuses and type(exc).__name__ == "FastpackError":
                    row.update(ok=True, refused=str(exc)[:200])
                    results.append(row)
                    continue
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:500])
                results.append(row)
                continue
            tols = [max(2 * eps, 2 * b, cfg["tol_floor"]) for b in baseline]
            row.update(
                err_out=errs[0],
                err_dq=errs[1],
                err_dk=errs[2],
                err_dv=errs[3],
                baseline_out=baseline[0],
                baseline_dq=baseline[1],
                baseline_dk=baseline[2],
                baseline_dv=baseline[3],
                ok=not refuses and all(e <= t for e, t in zip(errs, tols)),
                seconds=round(time.perf_counter() - t0, 2),
            )
            results.append(row)
    # softmax_scale, forward only, GQA + causal
    hq, hkv = cfg["check_heads"][-1]
    q = torch.randn(total, hq, cfg["head_dim"], device=device, dtype=dtype)
    k = torch.randn(total, hkv, cfg["head_dim"], device=device, dtype=dtype)
    v = torch.randn_like(k)
    ref = reference_fp32(torch, q, k, v, lengths, True, scale=0.05)
    base = rel_err(
        am.varlen_attention(q, k, v, cu, max_len, softmax_scale=0.05, kernel="sdpa"), ref
    )
    for kernel in kernels:
        if kernel in ("sdpa", "flex"):  # flex: one more compile for a scale we pass through
            continue
        try:
            with torch.no_grad():
                out = am.varlen_attention(q, k, v, cu, max_len, softmax_scale=0.05, kernel=kernel)
            err = rel_err(out, ref)
            results.append(
                {
                    "kernel": kernel,
                    "hq": hq,
                    "hkv": hkv,
                    "causal": True,
                    "softmax_scale": 0.05,
                    "err_out": err,
                    "baseline_out": base,
                    "ok": err <= max(2 * eps, 2 * base, cfg["tol_floor"]),
                }
            )
        except Exception as exc:
            results.append(
                {
                    "kernel": kernel,
                    "softmax_scale": 0.05,
                    "ok": False,
                    "error": f"{type(exc).__name__}: {exc}"[:500],
                }
            )
    return results


# --------------------------------------------------------------- 2. flex recompiles


def check_flex_recompiles(
    torch: Any, am: ModuleType, cfg: dict[str, Any], device: Any, dtype: Any
) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    hq, hkv = cfg["check_heads"][-1]
    d = cfg["head_dim"]
    rows = []
    before = dict(counters["stats"])
    for lengths in cfg["flex_recompile_lengths"]:
        total = sum(lengths)
        cu = torch.tensor(cumulative(lengths), dtype=torch.int32, device=device)
        q = torch.randn(total, hq, d, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(total, hkv, d, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(total, hkv, d, device=device, dtype=dtype, requires_grad=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = am.varlen_attention(q, k, v, cu, max(lengths), kernel="flex")
        out.sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        rows.append(
            {"total": total, "n_seqs": len(lengths), "seconds": round(time.perf_counter() - t0, 3)}
        )
    after = dict(counters["stats"])
    graphs = after.get("unique_graphs", 0) - before.get("unique_graphs", 0)
    return {"calls": rows, "new_unique_graphs": graphs}


# ----------------------------------------------------------- 3. attention microbench


def bench_attention(
    torch: Any, am: ModuleType, cfg: dict[str, Any], device: Any, dtype: Any
) -> list[dict[str, Any]]:
    lengths = cfg["model_lengths"]
    total, max_len, b = sum(lengths), max(lengths), len(lengths)
    hq, hkv = cfg["check_heads"][-1]
    d = cfg["head_dim"]
    cu = torch.tensor(cumulative(lengths), dtype=torch.int32, device=device)
    q = torch.randn(total, hq, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(total, hkv, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(total, hkv, d, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(total, hq, d, device=device, dtype=dtype)
    rows = []
    kernels = am.available_kernels(q)
    for kernel in kernels:

        def step(kernel: str = kernel) -> None:
            out = am.varlen_attention(q, k, v, cu, max_len, kernel=kernel, validate=False)
            out.backward(g)

        reset_peak(torch, device)
        try:
            ms = timed(torch, step, device, cfg["iters"], cfg["warmup"])
            rows.append(
                {
                    "layout": "packed",
                    "kernel": kernel,
                    "tokens": total,
                    "ms": ms,
                    "peak_gib": peak_mem_gib(torch, device),
                }
            )
        except Exception as exc:
            rows.append(
                {
                    "layout": "packed",
                    "kernel": kernel,
                    "error": f"{type(exc).__name__}: {exc}"[:500],
                }
            )

    # padded: (B, H, Lmax, D) with a key-padding + causal bool mask, as a padded batch
    qp = torch.randn(b, hq, max_len, d, device=device, dtype=dtype, requires_grad=True)
    kp = torch.randn(b, hkv, max_len, d, device=device, dtype=dtype, requires_grad=True)
    vp = torch.randn(b, hkv, max_len, d, device=device, dtype=dtype, requires_grad=True)
    gp = torch.randn(b, hq, max_len, d, device=device, dtype=dtype)
    lens_t = torch.tensor(lengths, device=device)
    keep = torch.arange(max_len, device=device)[None, :] < lens_t[:, None]  # (B, L)
    causal_mask = torch.ones(max_len, max_len, dtype=torch.bool, device=device).tril()
    mask = (keep[:, None, None, :] & causal_mask[None, None]) | ~keep[:, None, :, None]

    def padded_step() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(
            qp,
            kp.repeat_interleave(hq // hkv, 1),
            vp.repeat_interleave(hq // hkv, 1),
            attn_mask=mask,
        )
        out.backward(gp)

    reset_peak(torch, device)
    try:
        ms = timed(torch, padded_step, device, cfg["iters"], cfg["warmup"])
        rows.append(
            {
                "layout": "padded",
                "kernel": "sdpa+mask",
                "tokens": b * max_len,
                "ms": ms,
                "peak_gib": peak_mem_gib(torch, device),
            }
        )
    except Exception as exc:
        rows.append(
            {
                "layout": "padded",
                "kernel": "sdpa+mask",
                "error": f"{type(exc).__name__}: {exc}"[:500],
            }
        )
    return rows


# ---------------------------------------------------------------- 4. model benchmark

def set_attn(model: Any, name: str) -> None:
    try:
        model.set_attn_implementation(name)
    except Exception:
        model.config._attn_implementation = name
    assert model.config._attn_implementation == name, model.config._attn_implementation


def bench_model(
    torch: Any, am: ModuleType, cfg: dict[str, Any], device: Any, dtype: Any
) -> dict[str, Any]:
    import transformers
    from transformers import MistralConfig, MistralForCausalLM

    from fastpack.torch import register_hf_attention

    hq, hkv = cfg["check_heads"][-1]
    mc = cfg["model"]
    config = MistralConfig(
        sliding_window=mc["sliding_window"],
        hidden_size=hq * cfg["head_dim"],
        intermediate_size=mc["intermediate"],
        num_hidden_layers=mc["layers"],
        num_attention_heads=hq,
        num_key_value_heads=hkv,
        head_dim=cfg["head_dim"],
        vocab_size=mc["vocab"],
        max_position_embeddings=8192,
        use_cache=False,
    )
    torch.manual_seed(0)
    model: Any = MistralForCausalLM(config)
    model = model.to(device=device, dtype=dtype)
    model.config.use_cache = False
    model.train()
    n_params = sum(p.numel() for p in model.parameters())

    lengths = cfg["model_lengths"]
    total, max_len, b = sum(lengths), max(lengths), len(lengths)
    gen = torch.Generator(device="cpu").manual_seed(0)
    docs = [torch.randint(3, mc["vocab"], (n,), generator=gen) for n in lengths]

    # padded batch: right padding, labels -100 on padding
    input_ids = torch.zeros(b, max_len, dtype=torch.long)
    attention_mask = torch.zeros(b, max_len, dtype=torch.long)
    labels = torch.full((b, max_len), -100, dtype=torch.long)
    for i, doc in enumerate(docs):
        input_ids[i, : len(doc)] = doc
        attention_mask[i, : len(doc)] = 1
        labels[i, : len(doc)] = doc
    padded = {
        "input_ids": input_ids.to(device),
        "attention_mask": attention_mask.to(device),
        "labels": labels.to(device),
        "use_cache": False,
    }

    # packed row: positions restart per document; each document's first token is no target
    packed_ids = torch.cat(docs)[None]
    packed_labels = packed_ids.clone()
    cu_list = cumulative(lengths)
    packed_labels[0, cu_list[:-1]] = -100
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor(cu_list, dtype=torch.int32, device=device)
    packed = {
        "input_ids": packed_ids.to(device),
        "labels": packed_labels.to(device),
        "position_ids": position_ids.to(device),
        "use_cache": False,
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max_len,
        "max_length_k": max_len,
    }

    def step(batch: dict[str, Any]) -> float:
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        return float(loss.detach())

    rows: list[dict[str, Any]] = []
    set_attn(model, "sdpa")
    reset_peak(torch, device)
    padded_loss = step(padded)
    ms = timed(torch, lambda: step(padded), device, cfg["iters"], cfg["warmup"])
    rows.append(
        {
            "layout": "padded",
            "attn": "sdpa",
            "tokens_computed": b * max_len,
            "real_tokens": total,
            "ms": ms,
            "loss": padded_loss,
            "real_tokens_per_s": round(total / ms * 1e3),
            "peak_gib": peak_mem_gib(torch, device),
        }
    )

    eps = torch.finfo(dtype).eps
    for kernel in am.available_kernels(torch.empty(1, device=device, dtype=dtype)):
        if elapsed() > TIME_BUDGET_S:
            rows.append({"layout": "packed", "attn": kernel, "skipped": "time budget"})
            continue
        set_attn(model, register_hf_attention(f"gpu_check_{kernel}", kernel=kernel))
        reset_peak(torch, device)
        try:
            loss = step(packed)
            ms = timed(torch, lambda: step(packed), device, cfg["iters"], cfg["warmup"])
        except Exception as exc:
            rows.append(
                {
                    "layout": "packed",
                    "attn": kernel,
                    "ok": False,
                    "error": f"{type(exc).__name__}: {exc}"[:500],
                }
            )
            continue
        rows.append(
            {
                "layout": "packed",
                "attn": kernel,
                "tokens_computed": total,
                "real_tokens": total,
                "ms": ms,
                "loss": loss,
                "loss_rel_diff_vs_padded": abs(loss - padded_loss) / abs(padded_loss),
                "ok": abs(loss - padded_loss) <= 8 * eps * abs(padded_loss),
                "real_tokens_per_s": round(total / ms * 1e3),
                "peak_gib": peak_mem_gib(torch, device),
            }
        )
    return {
        "transformers": transformers.__version__,
        "params_m": round(n_params / 1e6, 1),
        "sliding_window": mc["sliding_window"],
        "n_docs": b,
        "max_len": max_len,
        "total_tokens": total,
        "padding_fraction": round(1 - total / (b * max_len), 3),
        "rows": rows,
    }


# --------------------------------------------------------------------------- main


# ------------------------------------------------------- 5. context parallelism


def _cp_local(torch: Any, layout: Any, rank: int, full: Any, device: Any) -> tuple[Any, Any]:
    """A rank's rows of ``full`` (zeros on pads) and its pad mask."""
    source = torch.as_tensor(layout.sources(rank).copy(), device=device)
    pad = source < 0
    local = full.detach()[source.clamp(min=0)].clone()
    local[pad] = 0
    return local, pad


def _cp_case(torch: Any, cfg: dict[str, Any], lengths: Sequence[int], hq: int, hkv: int,
             device: Any, dtype: Any) -> dict[str, Any]:
    gen = torch.Generator(device="cpu").manual_seed(hq * 100 + hkv)
    total, dim = sum(lengths), cfg["head_dim"]
    qkv = [torch.randn(total, h, dim, generator=gen).to(device, dtype) for h in (hq, hkv, hkv)]
    grad_out = torch.randn(total, hq, dim, generator=gen).to(device, dtype)
    leaves = [t.detach().clone().requires_grad_(True) for t in qkv]
    ref = reference_fp32(torch, *leaves, lengths, True)
    ref.backward(grad_out.float())
    return {"qkv": qkv, "grad_out": grad_out, "ref": ref.detach(),
            "ref_grads": [x.grad for x in leaves]}


def emulate_cp(torch: Any, lengths: Sequence[int], case: dict[str, Any], cp: int, mode: str,
               kernel: str, device: Any) -> list[Any]:
    """Every rank of a CP group in this process: each rank's queries attend over K/V
    gathered from every rank (concatenated in rank order); gradients of a rank's K/V are
    what the reduce-scatter would return it. Returns the assembled (out, dq, dk, dv) of
    the real tokens."""
    import fastpack
    from fastpack.torch import shard_for_context_parallel
    from fastpack.torch.context_parallel import attend_gathered

    cu = cumulative(lengths)
    layout = fastpack.cp_layout(cu, cp, mode=mode)
    batch = {"input_ids": torch.zeros(1, cu[-1], dtype=torch.long),
             "cu_seq_lens_q": torch.tensor(cu, dtype=torch.int32)}
    locals_, pads = [], []
    for r in range(cp):
        parts = [_cp_local(torch, layout, r, t, device) for t in case["qkv"]]
        locals_.append([p[0].requires_grad_(True) for p in parts])
        pads.append(parts[0][1])
    keys = torch.cat([loc[1] for loc in locals_])
    values = torch.cat([loc[2] for loc in locals_])
    outs = []
    for r in range(cp):
        shard = shard_for_context_parallel(batch, cp, r, mode)
        shard = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in shard.items()}
        outs.append(attend_gathered(locals_[r][0], keys, values, shard, kernel, None, None,
                                    None))
    grads = []
    for r in range(cp):
        g, _ = _cp_local(torch, layout, r, case["grad_out"], device)
        grads.append(g)
    torch.autograd.backward(outs, grads)
    result = []
    for which in range(4):
        full = torch.zeros_like(case["qkv"][0 if which < 2 else 1], dtype=torch.float32)
        for r in range(cp):
            source = torch.as_tensor(layout.sources(r).copy(), device=device)
            real = source >= 0
            piece = outs[r] if which == 0 else locals_[r][which - 1].grad
            full[source[real]] = piece[real].float()
        result.append(full)
    return result


def _cp_world_rank(rank: int, size: int, port: int, lengths: list[int], heads: tuple[int, int],
                   dim: int, out: str) -> None:
    import torch

    import fastpack
    from fastpack.torch import context_parallel_attention, shard_for_context_parallel
    from fastpack.torch.context_parallel import _kernel_reason

    torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=rank, world_size=size)
    device, dtype = torch.device("cuda", rank), torch.bfloat16
    case = _cp_case(torch, {"head_dim": dim}, lengths, *heads, device, dtype)
    cu = cumulative(lengths)
    batch = {"input_ids": torch.zeros(1, cu[-1], dtype=torch.long),
             "cu_seq_lens_q": torch.tensor(cu, dtype=torch.int32)}
    rows = []
    for mode in fastpack.CP_MODES:
        layout = fastpack.cp_layout(cu, size, mode=mode)
        shard = {k: (v.to(device) if hasattr(v, "to") else v)
                 for k, v in shard_for_context_parallel(batch, size, rank, mode).items()}
        for kernel in ("ring", "flash", "sdpa"):
            if mode == "ulysses" and kernel == "ring":
                continue
            if _kernel_reason(kernel, case["qkv"][0]) is not None:
                continue
            parts = [_cp_local(torch, layout, rank, t, device) for t in case["qkv"]]
            leaves = [p[0].requires_grad_(True) for p in parts]
            try:
                o = context_parallel_attention(*leaves, shard, torch.distributed.group.WORLD,
                                               kernel=kernel)
                g, _ = _cp_local(torch, layout, rank, case["grad_out"], device)
                o.backward(g)
            except Exception as exc:  # reported, not raised: the other kernels still run
                rows.append({"mode": mode, "kernel": kernel, "error": repr(exc)[:300]})
                continue
            source = torch.as_tensor(layout.sources(rank).copy(), device=device)
            real = source >= 0
            errs = []
            for piece, ref in ((o, case["ref"]), *zip((x.grad for x in leaves),
                                                       case["ref_grads"])):
                full = torch.zeros_like(ref)
                full[source[real]] = piece[real].float()
                torch.distributed.all_reduce(full)
                errs.append(rel_err(full, ref))
            rows.append({"mode": mode, "kernel": kernel, "errs": errs})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    torch.distributed.destroy_process_group()


def check_context_parallel(
    torch: Any, am: ModuleType, cfg: dict[str, Any], device: Any, dtype: Any
) -> dict[str, Any]:
    import fastpack

    lengths = cfg["cp_lengths"]
    cu = cumulative(lengths)
    report: dict[str, Any] = {"contracts": [], "kernels": [], "timing": [], "world": None}
    # a. the libraries' own layouts
    try:
        import transformer_engine_torch as tex
    except Exception as exc:
        report["contracts"].append({"transformer_engine": f"not available ({exc!r:.80})"})
    else:
        for cp in (2, 4, 8):
            layout = fastpack.cp_layout(cu, cp)
            padded = torch.tensor(layout.cu_seqlens_padded, dtype=torch.int32, device=device)
            same = all(tex.thd_get_partitioned_indices(padded, layout.padded_total, cp, r)
                       .tolist() == layout.indices(r).tolist() for r in range(cp))
            report["contracts"].append({"te_thd_get_partitioned_indices": cp, "ok": same})
    try:
        from ring_flash_attn import llama3_flash_attn_prepare_cu_seqlens as prepare
    except Exception as exc:
        report["contracts"].append({"ring_flash_attn": f"not available ({exc!r:.80})"})
    else:
        for cp in (2, 4, 8):
            layout = fastpack.cp_layout(cu, cp, mode="contiguous")
            padded = torch.tensor(layout.cu_seqlens_padded, dtype=torch.int32, device=device)
            same = True
            for r in range(cp):
                q, k, mq, mk, k_slice = prepare(padded, True, r, cp)
                local = layout.local(r)
                same &= (q.tolist() == local.cu_seqlens_q.tolist()
                         and k.tolist() == local.cu_seqlens_k.tolist()
                         and (mq, mk) == (local.max_seqlen_q, local.max_seqlen_k)
                         and k_slice == local.local_k_slice)
            report["contracts"].append({"ring_llama3_prepare_cu_seqlens": cp, "ok": bool(same)})
    # b. the local attention of every rank, emulated
    from fastpack.torch.context_parallel import _kernel_reason

    eps = torch.finfo(dtype).eps
    for hq, hkv in cfg["check_heads"]:
        case = _cp_case(torch, cfg, lengths, hq, hkv, device, dtype)
        base = run_case(am, "sdpa", {**case, "cu": cu, "max_len": max(lengths),
                                     "causal": True})
        for mode in ("zigzag", "contiguous"):
            for cp in (2, 4):
                for kernel in ("flash", "sdpa"):
                    if _kernel_reason(kernel, case["qkv"][0]) is not None:
                        continue
                    got = emulate_cp(torch, lengths, case, cp, mode, kernel, device)
                    errs = [rel_err(g, r) for g, r in zip(got, [case["ref"],
                                                                *case["ref_grads"]])]
                    bound = [max(cfg["tol_floor"], 2 * eps, 2 * b) for b in base]
                    report["kernels"].append({
                        "mode": mode, "cp": cp, "kernel": kernel, "hq": hq, "hkv": hkv,
                        "errs": errs, "bound": bound,
                        "ok": all(e <= b for e, b in zip(errs, bound))})
    # c. time of the busiest emulated rank against one process
    long = cfg["cp_long"]
    case = _cp_case(torch, cfg, long, *cfg["check_heads"][-1], device, dtype)
    kernel = "flash" if _kernel_reason("flash", case["qkv"][0]) is None else "sdpa"
    single = "flash" if am._unavailable_reason("flash", case["qkv"][0]) is None else "sdpa"
    one = timed(torch, lambda: run_case(am, single, {
        **case, "cu": cumulative(long), "max_len": max(long), "causal": True}), device,
        cfg["iters"], cfg["warmup"])
    report["timing"].append({"cp": 1, "kernel": single, "ms": round(one, 2)})
    for mode in ("zigzag", "contiguous"):
        for cp in (2, 4):
            ms = timed(torch, functools.partial(emulate_cp, torch, long, case, cp, mode, kernel,
                                                 device), device, cfg["iters"], cfg["warmup"])
            work = fastpack.cp_layout(cumulative(long), cp, mode=mode).work
            report["timing"].append({
                "cp": cp, "mode": mode, "kernel": kernel, "all_ranks_ms": round(ms, 2),
                "work_share_max": round(float(work.max() / work.sum()), 4)})
    # d. a real NCCL world
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if gpus >= 2:
        import socket
        import tempfile

        size = min(4, gpus)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        out = tempfile.mktemp(suffix=".json")
        torch.multiprocessing.spawn(_cp_world_rank, args=(
            size, port, list(lengths), tuple(cfg["check_heads"][-1]), cfg["head_dim"], out),
            nprocs=size, join=True)
        rows = json.loads(Path(out).read_text())
        for row in rows:
            row["ok"] = "errs" in row and all(
                e <= max(2 * eps, 2 * b) for e, b in zip(row["errs"], base))
        report["world"] = {"size": size, "rows": rows}
    else:
        report["world"] = {"skipped": f"{gpus} GPU(s): a real CP world needs 2 or more"}
    checks = [r["ok"] for r in report["kernels"]] + [
        r["ok"] for r in report["contracts"] if "ok" in r]
    if isinstance(report["world"], dict) and "rows" in report["world"]:
        checks += [r["ok"] for r in report["world"]["rows"]]
    report["ok"] = all(checks)
    return report


# ------------------------------------------------------------------- 6. tree batches


def load_tree_module() -> ModuleType:
    from fastpack.torch import tree

    return tree


def tree_samples(cfg: dict[str, Any], seed: int = 0) -> list[list[dict[str, Any]]]:
    """Two batches of samples: rollouts (``group`` per prompt) and a branching chat (a
    trie), token ids from a fixed seed."""
    import random

    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, cfg["model"]["vocab"]) for _ in range(n)]

    rollouts = []
    for g, (prompt, responses) in enumerate(cfg["tree_groups"]):
        head = tokens(prompt)
        rollouts += [{"input_ids": head + tokens(r), "prompt_id": g} for r in responses]
    chat: list[dict[str, Any]] = []
    system = tokens(cfg["tree_chat"][0])
    for user in cfg["tree_chat"][1:]:
        turn = system + tokens(user)
        chat += [{"input_ids": turn + tokens(user // 2 + k)} for k in (1, 2)]
        system = turn + tokens(3)
    return [rollouts, chat]


def run_tree(tm: ModuleType, qkv: Sequence[Any], grad_out: Any, layout: Any, positions: Any,
             options: dict[str, Any], kernel: str, up: bool = False) -> list[Any]:
    """tree_attention's output and dq, dk, dv with ``kernel`` (in fp32 when ``up``)."""
    xs = [(t.float() if up else t).detach().clone().requires_grad_(True) for t in qkv]
    out = tm.tree_attention(*xs, layout, kernel=kernel, positions=positions, **options)
    out.backward(grad_out.float() if up else grad_out)
    return [out, *(x.grad for x in xs)]


def check_tree(
    torch: Any, tm: ModuleType, cfg: dict[str, Any], device: Any, dtype: Any
) -> list[dict[str, Any]]:
    """tree_attention's CUDA kernels against its per-segment SDPA kernel in fp32."""
    from fastpack.torch import PackedCollator

    eps = torch.finfo(dtype).eps
    kernels = tm.available_kernels(torch.empty(1, device=device, dtype=dtype))[:-1]
    rows: list[dict[str, Any]] = []
    for b, samples in enumerate(tree_samples(cfg)):
        batch = PackedCollator(1 << 22, backend="flash", share_prefix=True)(samples)
        total = int(batch["input_ids"].shape[1])
        layout = tm.check_tree(batch["tree_cu_seqlens"], batch["tree_parents"], total,
                               batch["position_ids"])
        positions = batch["position_ids"][0].to(device)
        hq, hkv = cfg["check_heads"][-1]
        for options in ({}, {"sliding_window": cfg["check_window"]},
                        {"softcap": cfg["check_softcap"]}):
            gen = torch.Generator(device=device).manual_seed(b)
            d = cfg["head_dim"]
            q = torch.randn(total, hq, d, device=device, dtype=dtype, generator=gen)
            k = torch.randn(total, hkv, d, device=device, dtype=dtype, generator=gen)
            v = torch.randn(total, hkv, d, device=device, dtype=dtype, generator=gen)
            grad_out = torch.randn(total, hq, d, device=device, dtype=dtype, generator=gen)

            case = (tm, (q, k, v), grad_out, layout, positions, options)
            ref = run_tree(*case, "sdpa", up=True)
            baseline = [rel_err(x, r) for x, r in zip(run_tree(*case, "sdpa"), ref)]
            for kernel in kernels:
                row: dict[str, Any] = {"tree": ("rollouts", "chat")[b], "kernel": kernel,
                                       "tokens": total, **options}
                t0 = time.perf_counter()
                try:
                    errs = [rel_err(x, r) for x, r in zip(run_tree(*case, kernel), ref)]
                except Exception as exc:
                    row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:500])
                    rows.append(row)
                    continue
                tols = [max(2 * eps, 2 * x, cfg["tol_floor"]) for x in baseline]
                row.update({f"err_{n}": e for n, e in zip(("out", "dq", "dk", "dv"), errs)})
                row.update(baseline_out=baseline[0], ok=all(e <= t for e, t in zip(errs, tols)),
                           seconds=round(time.perf_counter() - t0, 2))
                rows.append(row)
    return rows


def bench_tree_model(
    torch: Any, tm: ModuleType, cfg: dict[str, Any], device: Any, dtype: Any
) -> dict[str, Any]:
    """A bf16 Llama: each sample's logits from one tree batch against the sample alone in
    fp32 (the bf16 SDPA run alone is the baseline), and the tree step beside the plain
    packed step of the same rollouts."""
    import transformers

    from fastpack.torch import PackedCollator, packed_loss, per_sample, register_hf_attention

    m = cfg["model"]
    config = transformers.LlamaConfig(
        vocab_size=m["vocab"], hidden_size=cfg["head_dim"] * cfg["check_heads"][-1][0],
        intermediate_size=m["intermediate"], num_hidden_layers=m["layers"],
        num_attention_heads=cfg["check_heads"][-1][0],
        num_key_value_heads=cfg["check_heads"][-1][1], max_position_embeddings=1 << 16,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(device)
    rollouts = tree_samples(cfg)[0]
    tree = PackedCollator(1 << 22, backend="flash", share_prefix=True)(rollouts)
    plain = PackedCollator(1 << 22, backend="flash")(
        [{"input_ids": s["input_ids"]} for s in rollouts])
    # The tree's BlockMask stays behind: fastpack's attention reads the tree itself.
    on = {name: {k: (v.to(device) if isinstance(v, torch.Tensor) else v)
                 for k, v in b.items() if k != "attention_mask"}
          for name, b in (("tree", tree), ("plain", plain))}
    truth, alone = [], []
    with torch.no_grad():
        model.float()
        set_attn(model, "sdpa")
        for s in rollouts:
            truth.append(model(input_ids=torch.tensor([s["input_ids"]], device=device))
                         .logits[0].float())
        model.to(dtype)
        for s in rollouts:
            alone.append(model(input_ids=torch.tensor([s["input_ids"]], device=device))
                         .logits[0].float())
    baseline = max(rel_err(a, t) for a, t in zip(alone, truth))
    rows = []
    for kernel in tm.available_kernels(torch.empty(1, device=device, dtype=dtype)):
        set_attn(model, register_hf_attention(f"gpu_check_tree_{kernel}", kernel=kernel))
        row: dict[str, Any] = {"kernel": kernel}
        try:
            with torch.no_grad():
                logits = per_sample(model(**on["tree"]).logits.float(), on["tree"])
            err = max(rel_err(x, t) for x, t in zip(logits, truth))
            row.update(err_logits=err, baseline=baseline,
                       ok=err <= max(2 * baseline, cfg["tol_floor"]))

            def step(name: str) -> None:
                batch = on[name]
                inputs = {k: v for k, v in batch.items() if k != "labels"}
                packed_loss(model(**inputs).logits, batch).backward()
                model.zero_grad(set_to_none=True)

            for name in ("tree", "plain"):
                row[f"{name}_ms"] = round(timed(
                    torch, lambda n=name: step(n), device, cfg["iters"], cfg["warmup"]), 2)
            row["tokens"] = {"tree": int(tree["input_ids"].shape[1]),
                             "plain": int(plain["input_ids"].shape[1])}
        except Exception as exc:
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:500])
        rows.append(row)
    return {"rows": rows, "samples": len(rollouts)}


def doc_lengths(n: int, max_len: int, seed: int) -> list[int]:
    """Deterministic heavy-tailed document lengths in [1, max_len] (log-uniform)."""
    import random

    rng = random.Random(seed)
    return [
        min(max_len, max(1, int(math.exp(rng.uniform(math.log(8), math.log(max_len))))))
        for _ in range(n)
    ]


def check_vlm(torch: Any, cfg: dict[str, Any], device: Any, dtype: Any) -> dict[str, Any]:
    """Section 5: packed vision-language batches on the device (see the module docs)."""
    import transformers

    from fastpack.torch import PackedCollator, register_hf_attention

    v = cfg["vlm"]
    image, video, start, end = 60, 61, 62, 63
    config = transformers.Qwen2VLConfig(
        text_config=dict(vocab_size=v["vocab"], hidden_size=v["hidden"],
                         intermediate_size=4 * v["hidden"], num_hidden_layers=v["layers"],
                         num_attention_heads=v["heads"], num_key_value_heads=v["heads"] // 2,
                         rope_scaling={"type": "mrope", "mrope_section": v["mrope_section"]}),
        vision_config=dict(depth=v["vision_layers"], embed_dim=v["vision_hidden"],
                           hidden_size=v["hidden"], num_heads=v["vision_heads"]),
        image_token_id=image, video_token_id=video, vision_start_token_id=start,
        vision_end_token_id=end,
    )
    config.text_config.bos_token_id = config.text_config.eos_token_id = None
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(config).to(device, dtype).eval()
    patch_dim = 3 * 2 * 14 * 14
    gen = torch.Generator().manual_seed(1)
    docs = []
    for d, (text, images, frames) in enumerate(v["docs"]):
        ids = [100 + d] + list(range(200, 200 + text))
        sample: dict[str, Any] = {}
        grids = [[1, 2 * (4 + (d + k) % 8), 2 * (6 + (d * k) % 8)] for k in range(images)]
        for g in grids:
            ids += [start] + [image] * (g[1] * g[2] // 4) + [end]
        if grids:
            g = torch.tensor(grids)
            sample["image_grid_thw"] = g
            sample["pixel_values"] = torch.randn(int(g.prod(1).sum()), patch_dim, generator=gen)
        if frames:
            g = torch.tensor([[frames, 16, 16]])
            ids += [start] + [video] * (frames * 64) + [end]
            sample["video_grid_thw"] = g
            sample["pixel_values_videos"] = torch.randn(frames * 256, patch_dim, generator=gen)
        sample["input_ids"] = ids
        docs.append(sample)

    def to_device(batch: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for k, x in batch.items():
            if isinstance(x, torch.Tensor):
                x = x.to(device)
                if x.is_floating_point():
                    x = x.to(dtype)
            out[k] = x
        return out

    def alone(d: dict[str, Any]) -> Any:
        ids = torch.tensor([d["input_ids"]])
        types = (ids == image).int() + 2 * (ids == video).int()
        inputs = to_device({k: x for k, x in d.items() if k != "input_ids"})
        return model(input_ids=ids.to(device), mm_token_type_ids=types.to(device),
                     **inputs).logits[0].float()

    set_attn(model, "sdpa")
    with torch.no_grad():
        reference = [alone(d) for d in docs]
    fastpack_name = register_hf_attention()
    impls = ["sdpa", fastpack_name]
    try:
        import flash_attn  # noqa: F401

        if device.type == "cuda":
            impls.append("flash_attention_2")
    except ImportError:
        pass
    rows = []
    for impl in impls:
        row: dict[str, Any] = {"impl": impl}
        try:
            set_attn(model, impl)
            batch = PackedCollator(v["max_len"], backend="flash",
                                   model_config=model.config)(docs)
            inputs = to_device({k: x for k, x in batch.items() if k != "labels"})
            with torch.no_grad():
                logits = model(**inputs).logits.float()[0]
            flat = batch["input_ids"][0].tolist()
            worst = 0.0
            for d, ref in zip(docs, reference):
                at = flat.index(d["input_ids"][0])
                got = logits[at:at + len(d["input_ids"])]
                worst = max(worst, rel_err(got, ref))
            row["rel_err"] = worst
            row["ok"] = worst <= v["tol"]
            labels = batch["labels"].to(device)

            def packed_step(inputs: dict[str, Any] = inputs, labels: Any = labels) -> Any:
                out = model(**inputs, labels=labels)
                out.loss.backward()
                return out.loss

            row["packed_ms"] = timed(torch, packed_step, device, cfg["iters"], cfg["warmup"])
            padded = PackedCollator(v["max_len"], backend="padded", model_config=model.config)
            pinputs = to_device(padded(docs))

            def padded_step(pinputs: dict[str, Any] = pinputs) -> Any:
                out = model(**pinputs)
                out.loss.backward()
                return out.loss

            set_attn(model, "sdpa")
            row["padded_ms"] = timed(torch, padded_step, device, cfg["iters"], cfg["warmup"])
        except Exception as exc:  # reported, and a failed check
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        rows.append(row)
    set_attn(model, "sdpa")
    return {"tokens": sum(len(d["input_ids"]) for d in docs), "rows": rows}


# ------------------------------------------------------------- 8. hybrid models (mixers)


def _kernel_versions() -> dict[str, str | None]:
    """The mixer kernel packages installed (Hugging Face uses them on CUDA when present)."""
    import importlib

    out: dict[str, str | None] = {}
    for name in ("mamba_ssm", "causal_conv1d", "fla"):
        try:
            out[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception:
            out[name] = None
    return out


def hybrid_model(torch: Any, family: str, h: dict[str, Any]) -> Any:
    import transformers

    common = dict(vocab_size=h["vocab"], hidden_size=h["hidden"],
                  intermediate_size=2 * h["hidden"], num_hidden_layers=2,
                  num_attention_heads=h["heads"], num_key_value_heads=h["heads"] // 2)
    if family == "lfm2":
        config: Any = transformers.Lfm2Config(layer_types=["conv", "full_attention"], **common)
    elif family == "bamba":
        config = transformers.BambaConfig(mamba_n_heads=h["heads"],
                                          mamba_d_head=2 * h["hidden"] // h["heads"],
                                          mamba_d_state=64, mamba_chunk_size=64,
                                          attn_layer_indices=[1], **common)
    else:
        d = h["hidden"] // h["heads"]
        config = transformers.Qwen3NextConfig(
            head_dim=d, linear_num_value_heads=h["heads"], linear_num_key_heads=h["heads"] // 2,
            linear_key_head_dim=d, linear_value_head_dim=d, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=h["hidden"],
            shared_expert_intermediate_size=h["hidden"],
            layer_types=["linear_attention", "full_attention"], **common)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def check_hybrid(torch: Any, cfg: dict[str, Any], device: Any, dtype: Any) -> dict[str, Any]:
    """Section 8: hybrid models (LFM2's short convolution, Bamba's Mamba2 mixer, Qwen3-Next's
    gated delta net) prepared with ``fastpack.torch.prepare_model``: every document's
    logits from one packed row (``backend="flash"``, fastpack's attention) against the
    document alone in fp32; pass when rel_err <= 2 * (the document alone in ``dtype``
    against fp32) + 2 * eps(dtype), for ``strategy="kernels"`` (when the family's kernels
    are installed and take sequence boundaries) and ``"batched"``, with the path each
    mixer ran. Then forward+backward tokens/s packed (each strategy) vs padded
    (``backend="padded"``, sdpa)."""
    from fastpack import FastpackError
    from fastpack.torch import PackedCollator, mixer_paths, prepare_model, register_hf_attention

    h = cfg["hybrid"]
    eps = torch.finfo(dtype).eps
    gen = torch.Generator().manual_seed(2)
    docs = [{"input_ids": torch.randint(1, h["vocab"], (n,), generator=gen).tolist()}
            for n in h["lengths"]]
    tokens = sum(h["lengths"])
    fastpack_name = register_hf_attention()
    rows = []
    for family in h["families"]:
        row: dict[str, Any] = {"family": family}
        try:
            model = prepare_model(hybrid_model(torch, family, h).to(device, torch.float32),
                                  strategy="batched")
            try:  # the kernels' own boundaries where installed (and taking them), and batched
                prepare_model(model, strategy="kernels")
                strategies = ["kernels", "batched"]
            except FastpackError as exc:
                strategies, row["no_kernel_path"] = ["batched"], str(exc)
            set_attn(model, "sdpa")
            with torch.no_grad():
                ref = [model(input_ids=torch.tensor([d["input_ids"]], device=device)).logits[0]
                       for d in docs]
                model.to(dtype)
                base = max(rel_err(model(input_ids=torch.tensor([d["input_ids"]],
                                                                device=device)).logits[0]
                                   .float(), r) for d, r in zip(docs, ref))
            batch = PackedCollator(h["max_len"], backend="flash")(docs)
            inputs = {k: (x.to(device) if isinstance(x, torch.Tensor) else x)
                      for k, x in batch.items()
                      if k != "labels" and not k.startswith("sample_")}
            labels = batch["labels"].to(device)
            flat = batch["input_ids"][0].tolist()
            tol = max(2 * base + 2 * eps, h.get("tol_floor", 0.0))
            row.update(baseline=base, tol=tol, ok=True)
            for strategy in strategies:
                prepare_model(model, strategy=strategy)
                set_attn(model, fastpack_name)
                with torch.no_grad():
                    logits = model(**inputs).logits[0].float()
                worst = 0.0
                for d, r in zip(docs, ref):
                    at = flat.index(d["input_ids"][0])
                    worst = max(worst, rel_err(logits[at:at + len(d["input_ids"])], r))
                # which path each mixer ran (kernels with seq_idx / cu_seqlens, or batched)
                paths = sorted(set(mixer_paths(model).values()))

                def packed_step(inputs: dict[str, Any] = inputs, labels: Any = labels,
                                model: Any = model) -> None:
                    model(**inputs, labels=labels).loss.backward()

                ms = timed(torch, packed_step, device, cfg["iters"], cfg["warmup"])
                row[strategy] = {"rel_err": worst, "ok": worst <= tol, "paths": paths,
                                 "packed_ms": ms,
                                 "packed_tokens_per_s": round(tokens / ms * 1e3)}
                row["ok"] = row["ok"] and worst <= tol
            padded = PackedCollator(h["max_len"], backend="padded")(docs)
            pinputs = {k: x.to(device) for k, x in padded.items()
                       if isinstance(x, torch.Tensor) and not k.startswith("sample_")}

            def padded_step(pinputs: dict[str, Any] = pinputs, model: Any = model) -> None:
                model(**pinputs).loss.backward()

            set_attn(model, "sdpa")
            row["padded_ms"] = timed(torch, padded_step, device, cfg["iters"], cfg["warmup"])
            row["padded_tokens_per_s"] = round(tokens / row["padded_ms"] * 1e3)
        except Exception as exc:  # reported, and a failed check
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        rows.append(row)
    return {"tokens": tokens, "kernels": _kernel_versions(), "rows": rows}


def make_config(cpu_smoke: bool) -> dict[str, Any]:
    if cpu_smoke:
        return {
            "head_dim": 16,
            "check_heads": [(4, 4), (4, 2)],
            "check_lengths": [1, 0, 37, 130, 0, 5],
            "check_window": 8,
            "check_softcap": 2.0,
            # fp32 on the CPU: torch's SDPA can match the reference to the last bit, so
            # 2 * its error is no bound; the checks here are of plumbing (a window one
            # token off, a lost cap: errors of 1e-2 and up)
            "tol_floor": 1e-5,
            "flex_cases": None,
            "flex_recompile_lengths": [],
            "model_lengths": [9, 40, 3, 17],
            "cp_lengths": [7, 1, 13, 4, 9, 1, 2],
            "cp_long": [300, 41, 77, 5],
            "iters": 2,
            "warmup": 1,
            "model": {"layers": 2, "intermediate": 128, "vocab": 512, "sliding_window": 8},
            "vlm": {"vocab": 512, "hidden": 64, "layers": 2, "heads": 4,
                    "mrope_section": [2, 3, 3], "vision_layers": 1, "vision_hidden": 32,
                    "vision_heads": 2, "docs": [(5, 1, 0), (9, 0, 0), (3, 2, 2)],
                    "max_len": 512, "tol": 1e-4},
            # (prompt, responses) per group; a chat: system prompt, then user turns
            "tree_groups": [(30, [5, 1, 12]), (7, [3, 9])],
            "tree_chat": [12, 6, 4],
            "hybrid": {"families": ["lfm2", "bamba", "qwen3_next"], "vocab": 128,
                       "hidden": 64, "heads": 4, "lengths": [9, 30, 1, 17], "max_len": 64,
                       "tol_floor": 1e-5},  # fp32: the summation order's rounding
        }
    return {
        "head_dim": 128,
        "check_heads": [(16, 16), (16, 4)],
        # empty and 1-token sequences, and lengths on both sides of flex's 128 blocks
        "check_lengths": [1, 0, 37, 128, 129, 1000, 0, 2048, 513, 255, 1],
        # a window across flex blocks (and shorter than most sequences); Gemma 2's cap is 50
        "check_window": 200,
        "check_softcap": 5.0,
        "tol_floor": 0.0,
        # flex compiles per mask/GQA variant: keep to two cases (MHA non-causal, GQA causal)
        "flex_cases": [(16, 16, False), (16, 4, True)],
        "flex_recompile_lengths": [[300, 0, 700, 24], [64] * 20 + [5], [4000, 96], [1] * 50],
        "model_lengths": doc_lengths(32, 4096, seed=1),
        # odd lengths, length 1, tail pads; a 32k-token row for the timing
        "cp_lengths": [1, 37, 129, 1000, 2047, 513, 255, 1, 3],
        "cp_long": [24_576, 4_096, 2_048, 1_024, 511, 313, 1],
        "iters": 5,
        "warmup": 2,
        "model": {"layers": 8, "intermediate": 5632, "vocab": 16384, "sliding_window": 1024},
        "vlm": {"vocab": 16384, "hidden": 1536, "layers": 4, "heads": 12,
                "mrope_section": [16, 24, 24], "vision_layers": 4, "vision_hidden": 1280,
                "vision_heads": 16,
                "docs": [(40 + 37 * d % 300, d % 4, 4 if d % 5 == 0 else 0)
                         for d in range(16)],
                "max_len": 32768, "tol": 3e-2},
        # GRPO-like: a prompt of 1,500 tokens, 8 responses across flex's 128 blocks; a
        # prompt of 200 with 4; a chat of 5 turns
        "tree_groups": [(1500, [20, 127, 128, 129, 300, 640, 1000, 1]), (200, [50, 90, 7, 400])],
        "tree_chat": [600, 120, 80, 200, 40],
        "hybrid": {"families": ["lfm2", "bamba", "qwen3_next"], "vocab": 16384,
                   "hidden": 1024, "heads": 16, "lengths": doc_lengths(24, 2048, seed=3),
                   "max_len": 32768},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="tiny fp32 run on CPU (checks the script, not the GPU paths)",
    )
    parser.add_argument("--skip-model", action="store_true", help="skip the transformers model")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("skipped: no CUDA")
        write_json({"skipped": "no CUDA", "torch": torch.__version__})
        return 0

    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
    am = load_attention_module()
    cfg = make_config(args.cpu_smoke)
    probe = torch.empty(1, device=device, dtype=dtype)
    varlen_fn = am._torch_varlen_attn()
    flash_version = None
    if am._flash_varlen_func() is not None:
        import flash_attn

        flash_version = getattr(flash_attn, "__version__", "?")
    report: dict[str, Any] = {
        "env": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "dtype": str(dtype),
            "flash_attn": flash_version,
            "varlen_attn_params": sorted(am._signature_params(varlen_fn)) if varlen_fn else None,
            "flex_unavailable_reason": am._flex_unavailable_reason(),
            "available_kernels": am.available_kernels(probe),
            "attention_module": am.__name__,
        },
        "config": {k: v for k, v in cfg.items() if k != "model_lengths"},
    }
    print(
        f"torch {torch.__version__} on {report['env']['device']}; "
        f"kernels: {report['env']['available_kernels']}; flash-attn: {flash_version}"
    )

    sections: list[tuple[str, Callable[[], Any]]] = [
        ("correctness", lambda: check_correctness(torch, am, cfg, device, dtype)),
    ]
    if "flex" in report["env"]["available_kernels"] and cfg["flex_recompile_lengths"]:
        sections.append(
            ("flex_recompile", lambda: check_flex_recompiles(torch, am, cfg, device, dtype))
        )
    sections.append(("attention_bench", lambda: bench_attention(torch, am, cfg, device, dtype)))
    if not args.skip_model:
        sections.append(("model_bench", lambda: bench_model(torch, am, cfg, device, dtype)))
    sections.append(("context_parallel",
                     lambda: check_context_parallel(torch, am, cfg, device, dtype)))
    tm = load_tree_module()
    sections.append(("tree_correctness", lambda: check_tree(torch, tm, cfg, device, dtype)))
    if not args.skip_model:
        sections.append(("tree_model", lambda: bench_tree_model(torch, tm, cfg, device, dtype)))
    if not args.skip_model:
        sections.append(("vlm", lambda: check_vlm(torch, cfg, device, dtype)))
        sections.append(("hybrid", lambda: check_hybrid(torch, cfg, device, dtype)))

    for name, fn in sections:
        if name not in ("correctness", "tree_correctness") and elapsed() > TIME_BUDGET_S:
            report[name] = {"skipped": f"time budget ({TIME_BUDGET_S:.0f} s) spent"}
            continue
        t0 = time.perf_counter()
        try:
            report[name] = fn()
        except Exception as exc:
            report[name] = {
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-3000:],
            }
        print(f"[{name}: {time.perf_counter() - t0:.1f} s]")

    # ---- compact report
    corr = report.get("correctness")
    ok = isinstance(corr, list) and all(r.get("ok") for r in corr)
    if isinstance(corr, list):
        print("\ncorrectness (rel err vs fp32 per-sequence SDPA; baseline = bf16 SDPA per seq)")
        for r in corr:
            tag = f"{r['kernel']:>6} hq={r.get('hq')} hkv={r.get('hkv')} causal={r.get('causal')}"
            if "softmax_scale" in r:
                tag += " scale=0.05"
            for option in ("sliding_window", "softcap"):
                if option in r:
                    tag += f" {option}={r[option]}"
            if "refused" in r:
                print(f"  ok   {tag}: refused ({r['refused']})")
                continue
            if "error" in r:
                print(f"  FAIL {tag}: {r['error']}")
                continue
            errs = " ".join(f"{k[4:]}={r[k]:.2e}" for k in r if k.startswith("err_"))
            base = " ".join(f"{r[k]:.2e}" for k in r if k.startswith("baseline_"))
            print(f"  {'ok  ' if r['ok'] else 'FAIL'} {tag}: {errs} (baseline {base})")
    else:
        print("correctness:", corr)
    fr = report.get("flex_recompile")
    if fr is not None:
        print(
            "\nflex calls (s):",
            fr if "calls" not in fr else [c["seconds"] for c in fr["calls"]],
            "new graphs:",
            fr.get("new_unique_graphs"),
        )
    for key in ("attention_bench",):
        rows = report.get(key)
        print(f"\n{key} (fwd+bwd, median ms)")
        if isinstance(rows, list):
            for r in rows:
                print("  ", {k: v for k, v in r.items()})
        else:
            print("  ", rows)
    mb = report.get("model_bench")
    if mb is not None:
        print("\nmodel_bench (MistralForCausalLM fwd+bwd)")
        if "rows" in mb:
            print("  ", {k: v for k, v in mb.items() if k != "rows"})
            for r in mb["rows"]:
                print("  ", r)
                if r.get("ok") is False:
                    ok = False
        else:
            print("  ", mb)
    cpr = report.get("context_parallel")
    if cpr is not None:
        print("\ncontext_parallel")
        if isinstance(cpr, dict) and "kernels" in cpr:
            for key in ("contracts", "kernels", "timing"):
                for r in cpr[key]:
                    print("  ", key, r)
            print("   world", cpr["world"])
            ok = ok and bool(cpr["ok"])
        else:
            print("  ", cpr)
            ok = False
    vlm = report.get("vlm")
    if vlm is not None:
        print("\nvlm (Qwen2-VL, packed flash-format batch vs each document alone)")
        for r in vlm.get("rows", [vlm]):
            print("  ", r)
            if r.get("ok") is False:
                ok = False
    hybrid = report.get("hybrid")
    if hybrid is not None:
        print("\nhybrid (prepare_model: packed flash-format row vs each document alone)")
        print("   kernels", hybrid.get("kernels"))
        for r in hybrid.get("rows", [hybrid]):
            print("  ", r)
            if r.get("ok") is False:
                ok = False
    for key in ("tree_correctness", "tree_model"):
        section = report.get(key)
        rows = section if isinstance(section, list) else (section or {}).get("rows")
        print(f"\n{key}")
        if not isinstance(rows, list):
            print("  ", section)
            ok = ok and key == "tree_model" and "skipped" in (section or {})
            continue
        for r in rows:
            print(f"  {'ok  ' if r.get('ok') else 'FAIL'}", r)
            ok = ok and bool(r.get("ok"))
    report["all_ok"] = ok
    report["elapsed_s"] = round(elapsed(), 1)
    print(f"\n{'ALL OK' if ok else 'SOME CHECKS FAILED'} in {report['elapsed_s']} s")
    write_json(report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
