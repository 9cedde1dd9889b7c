"""Gloo worlds for the context-parallel tests: ``size`` CPU processes, started at most once
per size in a pytest session (each start costs a few seconds of imports), every rank
running every case of its world and saving its local results; the tests assemble the
ranks' pieces and compare them with one process computing the whole row.

A world of 2 runs every attention case, every Hugging Face model cell of the conformance
matrix's CP rows and the model-gradient cases; a world of 4 runs the attention cases.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gloo import free_port

import fastpack
from fastpack.torch import (
    PackedCollator,
    context_parallel_attention,
    packed_loss,
    register_hf_attention,
    shard_for_context_parallel,
    varlen_attention,
)

MODES = fastpack.CP_MODES
DTYPES = {"fp64": torch.float64, "fp32": torch.float32}
#: |cp - cp=1| allowed, outputs and gradients.
TOLERANCE = {"fp64": 1e-10, "fp32": 1e-5}


@dataclass(frozen=True)
class Case:
    """One attention comparison: a row of ``lengths`` (odd ones, length 1, tail pads),
    GQA heads, a dtype, a mode, and optionally a padding multiple, a window or a cap."""

    name: str
    lengths: tuple[int, ...]
    mode: str
    dtype: str
    heads: int = 4
    kv_heads: int = 2
    pad_multiple: int = 1
    window: int | None = None
    softcap: float | None = None
    dim: int = 8
    #: "flash": the flash-attn path, its kernel replaced by :func:`flash_on_cpu`.
    kernel: str = "auto"

    @property
    def cu_seqlens(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int32)


ROWS = {"mixed": (7, 1, 13, 4, 9, 1, 2), "one": (37,)}
CASES = [
    Case(f"{mode}-{row}-{kv}kv-{dtype}", ROWS[row], mode, dtype, kv_heads=kv)
    for mode in MODES for row in ROWS for kv in (2, 1) for dtype in DTYPES
] + [
    Case(f"{mode}-pad3-{dtype}", ROWS["mixed"], mode, dtype, pad_multiple=3)
    for mode in MODES for dtype in DTYPES
] + [
    Case(f"{mode}-window-softcap", ROWS["mixed"], mode, "fp64", window=4, softcap=0.5)
    for mode in MODES
] + [Case(f"{mode}-window", ROWS["one"], mode, "fp64", window=5) for mode in MODES] + [
    Case(f"flash-{mode}-{row}", ROWS[row], mode, "fp64", kernel="flash")
    for mode in ("zigzag", "contiguous") for row in ROWS
] + [Case(f"flash-{mode}-window-softcap", ROWS["mixed"], mode, "fp64", window=4, softcap=0.5,
          kernel="flash") for mode in ("zigzag", "contiguous")]


def flash_on_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                 dropout_p: float = 0.0, softmax_scale: float | None = None,
                 causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                 softcap: float = 0.0) -> torch.Tensor:
    """flash_attn_varlen_func's contract (flash-attn >= 2.1), written out in float64: a
    sequence with more keys than queries has its causal mask and window aligned to the
    bottom-right corner (query i sits at key position i + sk - sq)."""
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32 and dropout_p == 0.0
    qs, ks = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert max_seqlen_q >= max(np.diff(qs), default=0)
    assert max_seqlen_k >= max(np.diff(ks), default=0)
    groups = q.shape[1] // k.shape[1]
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    outs = []
    for a, b, c, d in zip(qs[:-1], qs[1:], ks[:-1], ks[1:]):
        sq, sk = b - a, d - c
        if not sq:
            continue
        qi = q[a:b].double().transpose(0, 1)
        ki = k[c:d].double().transpose(0, 1).repeat_interleave(groups, 0)
        vi = v[c:d].double().transpose(0, 1).repeat_interleave(groups, 0)
        scores = qi @ ki.transpose(-1, -2) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        i = torch.arange(sq)[:, None] + (sk - sq)
        j = torch.arange(sk)[None, :]
        keep = torch.ones(sq, sk, dtype=torch.bool)
        if causal:
            keep &= j <= i
        if window_size[0] >= 0:
            keep &= j >= i - window_size[0]
        outs.append((scores.masked_fill(~keep, float("-inf")).softmax(-1) @ vi).transpose(0, 1))
    return torch.cat(outs).to(q.dtype)


def inputs(case: Case) -> tuple[torch.Tensor, ...]:
    """q, k, v and the output's gradient over the whole row (the same on every rank)."""
    g = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    total, dtype = int(sum(case.lengths)), DTYPES[case.dtype]
    q = torch.randn(total, case.heads, case.dim, generator=g, dtype=torch.float64)
    k, v = (torch.randn(total, case.kv_heads, case.dim, generator=g, dtype=torch.float64)
            for _ in range(2))
    dout = torch.randn(total, case.heads, case.dim, generator=g, dtype=torch.float64)
    return tuple(t.to(dtype) for t in (q, k, v, dout))


def reference(case: Case) -> dict[str, torch.Tensor]:
    """cp = 1: the whole row's attention and its gradients, in one process."""
    q, k, v, dout = inputs(case)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = varlen_attention(q, k, v, case.cu_seqlens, max(case.lengths), kernel="sdpa",
                           sliding_window=case.window, softcap=case.softcap)
    out.backward(dout)
    assert q.grad is not None and k.grad is not None and v.grad is not None
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def attention_rank(case: Case, rank: int, size: int, group: Any) -> dict[str, torch.Tensor]:
    """One rank's outputs and gradients. Pads get random q/k/v (they must not leak into
    a real token) and a zero output gradient (a model's loss never reaches a pad)."""
    q, k, v, dout = inputs(case)
    ids = torch.arange(q.shape[0])[None]
    batch = {"input_ids": ids, "cu_seq_lens_q": torch.from_numpy(case.cu_seqlens)}
    local = shard_for_context_parallel(batch, size, rank, case.mode,
                                       pad_multiple=case.pad_multiple)
    layout = fastpack.cp_layout(case.cu_seqlens, size, mode=case.mode,
                                pad_multiple=case.pad_multiple)
    source = torch.from_numpy(layout.sources(rank).copy())
    pad = source < 0
    take = source.clamp(min=0)
    noise = torch.Generator().manual_seed(1000 + rank)

    def local_of(t: torch.Tensor) -> torch.Tensor:
        x = t[take].clone()
        x[pad] = torch.randn(x[pad].shape, generator=noise, dtype=torch.float64).to(t.dtype)
        return x.requires_grad_()

    ql, kl, vl = local_of(q), local_of(k), local_of(v)
    with flash_stand_in(case.kernel == "flash"):
        out = context_parallel_attention(ql, kl, vl, local, group, kernel=case.kernel,
                                         sliding_window=case.window, softcap=case.softcap)
    grad = dout[take].clone()
    grad[pad] = 0
    out.backward(grad)
    return {"source": source, "out": out.detach(), "dq": ql.grad, "dk": kl.grad,
            "dv": vl.grad}


@contextlib.contextmanager
def flash_stand_in(active: bool) -> Iterator[None]:
    """The flash-attn path on the CPU: its kernel is :func:`flash_on_cpu`."""
    import fastpack.torch.context_parallel as module

    saved = module._flash, module._kernel_reason
    if active:
        module._flash = lambda: flash_on_cpu  # type: ignore[assignment]
        module._kernel_reason = lambda kernel, q: None
    try:
        yield
    finally:
        module._flash, module._kernel_reason = saved  # type: ignore[assignment]


def assemble(pieces: list[dict[str, torch.Tensor]], key: str,
             like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ranks' real tokens put back in the row (each is on exactly one rank, checked),
    and every pad's values, concatenated."""
    full = torch.zeros_like(like)
    seen = torch.zeros(like.shape[0], dtype=torch.int64)
    pads = []
    for piece in pieces:
        real = piece["source"] >= 0
        full[piece["source"][real]] = piece[key][real]
        seen.index_add_(0, piece["source"][real], torch.ones(int(real.sum()), dtype=torch.int64))
        pads.append(piece[key][~real])
    assert bool((seen == 1).all()), "every real token on exactly one rank"
    return full, torch.cat(pads)


# -------------------------------------------------------------- Hugging Face models


def cp_name(mode: str) -> str:
    return f"fastpack_cp_{mode}"


def model_batch() -> dict[str, Any]:
    """The conformance matrix's sequences as one flat packed row, with a loss mask (each
    sequence's first third is a prompt) and the row's target count."""
    from test_conformance import MAX_LEN, samples

    features = []
    for s in samples():
        mask = [0] * (len(s) // 3) + [1] * (len(s) - len(s) // 3)
        features.append({"input_ids": s, "loss_mask": mask})
    return PackedCollator(max_len=MAX_LEN, backend="flash", return_num_items=True)(features)


def make_model(family: str, dtype: str) -> Any:
    import transformers
    from test_conformance import config

    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(config(family))
    return m.to(DTYPES[dtype])


#: (mode, family, dtype): logits of the local batch (the conformance matrix's CP rows).
MODEL_CELLS = [(mode, family, dtype) for mode in MODES
               for family in ("llama", "mistral", "qwen2", "gemma2") for dtype in DTYPES]
#: packed_loss's weightings (fp64 throughout), and "model": Hugging Face's own loss, which
#: takes its cross-entropy in fp32 whatever the model's dtype.
WEIGHTINGS = ("token", "sequence", "model")
#: (mode, family): fp64 loss and gradients of the local batch, every weighting.
GRAD_CELLS = [(mode, "llama") for mode in MODES]


def num_sequences(batch: dict[str, Any]) -> int:
    labels = batch["labels"][0]
    cu = batch["cu_seq_lens_q"].long()
    return sum(int((labels[a + 1 : b] != -100).any()) for a, b in zip(cu[:-1], cu[1:]))


def model_rank(rank: int, size: int, group: Any) -> dict[str, Any]:
    full = model_batch()
    results: dict[str, Any] = {}
    for mode in MODES:
        register_hf_attention(cp_name(mode), context_parallel_group=group, mode=mode)
    for mode, family, dtype in MODEL_CELLS:
        local = shard_for_context_parallel(full, size, rank, mode)
        m = make_model(family, dtype).eval()
        m.set_attn_implementation(cp_name(mode))
        with torch.no_grad():
            logits = m(**{k: v for k, v in local.items() if k != "labels"}).logits[0]
        layout = fastpack.cp_layout(full["cu_seq_lens_q"], size, mode=mode)
        results[f"logits-{mode}-{family}-{dtype}"] = {
            "source": torch.from_numpy(layout.sources(rank).copy()), "logits": logits}
    sequences = num_sequences(full)
    for mode, family in GRAD_CELLS:
        local = shard_for_context_parallel(full, size, rank, mode)
        for weighting in WEIGHTINGS:
            m = make_model(family, "fp64").train()
            m.set_attn_implementation(cp_name(mode))
            if weighting == "model":  # Hugging Face's loss, from shift_labels
                loss = m(**local).loss
            else:
                logits = m(**{k: v for k, v in local.items() if k != "labels"}).logits
                loss = packed_loss(logits, local, weighting=weighting,  # type: ignore[arg-type]
                                   num_sequences_in_batch=sequences)
            loss.backward()
            results[f"grads-{mode}-{family}-{weighting}"] = {
                "loss": loss.detach(),
                "grads": {n: p.grad for n, p in m.named_parameters() if p.grad is not None},
            }
    return results


def model_reference(family: str, weighting: str) -> dict[str, Any]:
    """The whole row on one process (fastpack's per-sequence attention, no CP)."""
    full = model_batch()
    m = make_model(family, "fp64").train()
    m.set_attn_implementation(register_hf_attention())
    if weighting == "model":
        loss = m(**full).loss
    else:
        logits = m(**{k: v for k, v in full.items() if k != "labels"}).logits
        loss = packed_loss(logits, full, weighting=weighting,  # type: ignore[arg-type]
                           num_sequences_in_batch=num_sequences(full))
    loss.backward()
    return {"loss": loss.detach(),
            "grads": {n: p.grad for n, p in m.named_parameters() if p.grad is not None}}


# ---------------------------------------------------------------------- the worlds


def _worker(rank: int, size: int, port: int, out: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    try:
        group = dist.group.WORLD
        results: dict[str, Any] = {
            "attention": {c.name: attention_rank(c, rank, size, group) for c in CASES},
        }
        if size == 2:
            import transformers

            transformers.logging.set_verbosity_error()
            results["models"] = model_rank(rank, size, group)
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


_WORLDS: dict[int, list[dict[str, Any]]] = {}


def world(size: int) -> list[dict[str, Any]]:
    """Every rank's results of the world of ``size`` processes (started once)."""
    if size not in _WORLDS:
        out = tempfile.mkdtemp(prefix=f"fastpack-cp{size}-")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.multiprocessing.spawn(_worker, args=(size, free_port(), out), nprocs=size,
                                    join=True)
        _WORLDS[size] = [torch.load(Path(out) / f"rank{r}.pt") for r in range(size)]
    return _WORLDS[size]
