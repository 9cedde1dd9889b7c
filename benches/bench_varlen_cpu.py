"""Where packed training spends its CPU time: per-sequence attention (``varlen_attention``
with ``kernel="sdpa"``, the CPU path of ``register_hf_attention()``) against the ways around
it, on one thread, in CPU time (``time.process_time``), so a shared machine's load does not
enter the numbers.

1. Attention alone, forward + backward over one ~4,096-token step of log-normal lengths
   (median 20, 60, 200), H=2, D=64, causal:
   * ``previous`` — fastpack's loop before: split the tokens, then transpose and unsqueeze
     every sequence's q, k, v and transpose its output;
   * ``varlen_attention`` — today's loop: one split of ``(1, H, T, D)`` views;
   * ``padded buckets`` — lengths grouped into buckets (geometric, ratio 1.3), each bucket
     gathered into a padded ``(n, H, L, D)`` batch for one SDPA call and scattered back
     (exact with causal attention: padding sits after every real key).
2. A GPT-2 (2 layers x 128) forward + backward on the same kind of step: packed rows with
   Hugging Face's SDPA (``backend="sdpa"``), one flat row with ``register_hf_attention()``
   (``backend="flash"``), and a length-bucketed padded batch of the same token budget.

    python benches/bench_varlen_cpu.py          # ~1 min; writes results/varlen_cpu.md
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

import fastpack
from fastpack.torch import PackedCollator, register_hf_attention, varlen_attention

RESULTS = Path(__file__).parent / "results"
SDPA = torch.nn.functional.scaled_dot_product_attention
REPS = 11


def cpu_ms(fns: dict[str, Callable[[], Any]]) -> dict[str, float]:
    """Median CPU time of each function, the calls interleaved round-robin (so a busy
    spell of the machine hits every variant alike)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(REPS):
        for name, fn in fns.items():
            t0 = time.process_time()
            fn()
            times[name].append(time.process_time() - t0)
    return {name: 1e3 * statistics.median(t[2:]) for name, t in times.items()}


def step_lengths(median: float, tokens: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median), 0.9, 20_000), 2, 1024).astype(np.int64)
    return lengths[: int(np.searchsorted(np.cumsum(lengths), tokens))]


def previous(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sizes: list[int]
             ) -> torch.Tensor:
    """fastpack's loop before: one split along the tokens, then a transpose and an
    unsqueeze of every piece of q, k and v, and a transpose of every output."""
    outs = [
        SDPA(qs.transpose(0, 1).unsqueeze(0), ks.transpose(0, 1).unsqueeze(0),
             vs.transpose(0, 1).unsqueeze(0), is_causal=True)[0].transpose(0, 1)
        for qs, ks, vs in zip(*(t.split(sizes, dim=0) for t in (q, k, v)))
    ]
    return torch.cat(outs)


def bucket_plan(lengths: np.ndarray, ratio: float = 1.3) -> tuple[list[Any], torch.Tensor]:
    cu = np.concatenate([[0], np.cumsum(lengths)])
    key = np.floor(np.log(lengths) / np.log(ratio)).astype(np.int64)
    where = np.empty(int(cu[-1]), dtype=np.int64)
    plan, offset = [], 0
    for b in np.unique(key):
        members = np.flatnonzero(key == b)
        n, width = len(members), int(lengths[members].max())
        j = np.arange(width)
        real = j[None, :] < lengths[members][:, None]
        index = cu[members][:, None] + np.minimum(j[None, :], lengths[members][:, None] - 1)
        where[(cu[members][:, None] + j[None, :])[real]] = offset + np.flatnonzero(real.ravel())
        offset += n * width
        plan.append((torch.from_numpy(index.ravel()), n, width))
    return plan, torch.from_numpy(where)


def buckets(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: list[Any],
            where: torch.Tensor) -> torch.Tensor:
    heads, dim = q.shape[1], q.shape[2]
    outs = []
    for index, n, width in plan:
        qb, kb, vb = (t.index_select(0, index).view(n, width, heads, dim).transpose(1, 2)
                      for t in (q, k, v))
        outs.append(SDPA(qb, kb, vb, is_causal=True).transpose(1, 2).reshape(-1, heads, dim))
    return torch.cat(outs).index_select(0, where)


def attention_row(median: int) -> str:
    lengths = step_lengths(median, 4096)
    cu = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    total = cu[-1]
    q, k, v = (torch.randn(total, 2, 64, requires_grad=True) for _ in range(3))
    grad = torch.randn(total, 2, 64)
    plan, where = bucket_plan(lengths)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    variants = {
        "previous": lambda: previous(q, k, v, lengths.tolist()),
        "varlen": lambda: varlen_attention(q, k, v, cu_t, int(lengths.max()), kernel="sdpa",
                                           validate=False),
        "buckets": lambda: buckets(q, k, v, plan, where),
    }
    ref = variants["previous"]()
    diffs = {m: float((f() - ref).abs().max()) for m, f in variants.items()}
    times = cpu_ms({m: (lambda f=f: f().backward(grad)) for m, f in variants.items()})
    return (
        f"| {median} | {len(lengths)} | {total:,} | {int((lengths ** 2).sum()):,} | "
        f"{times['previous']:.1f} ms | {times['varlen']:.1f} ms "
        f"({times['varlen'] / times['previous']:.2f}x) | {times['buckets']:.1f} ms "
        f"({times['buckets'] / times['previous']:.2f}x, {len(plan)} calls) | "
        f"{diffs['varlen']:.0e} / {diffs['buckets']:.0e} |"
    )


def attention_rows() -> list[str]:
    rows = []
    for median in (20, 60, 200):
        rows.append(attention_row(median))
        print(rows[-1], flush=True)
    return rows


def model_rows() -> list[str]:
    transformers.logging.set_verbosity_error()
    name = register_hf_attention()
    rng = np.random.default_rng(0)
    lengths = step_lengths(200, 4096, seed=1)
    feats = [{"input_ids": rng.integers(1, 256, int(n)).tolist()} for n in lengths]
    # A bucketed step of the same budget: a run of similar lengths from a sorted pool.
    pool = np.sort(step_lengths(200, 50 * 4096, seed=2))[::-1]
    cut = np.cumsum(pool) // 4096
    middle = pool[cut == cut[len(cut) // 2]]
    bucket = [{"input_ids": rng.integers(1, 256, int(n)).tolist()} for n in middle]
    cases = [
        ("packed rows, HF sdpa", "sdpa", PackedCollator(max_len=1024, backend="sdpa")(feats)),
        ("packed flat row, register_hf_attention()", name,
         PackedCollator(max_len=1024, backend="flash")(feats)),
        ("bucketed (sorted lengths), padded", "sdpa",
         PackedCollator(max_len=1024, backend="padded")(bucket)),
    ]
    models, fns = {}, {}
    for label, impl, batch in cases:
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=256, n_embd=128, n_layer=2, n_head=2, n_positions=1024,
            attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0))
        model.set_attn_implementation(impl)
        models[label] = model
        fns[label] = lambda m=model, b=batch: m(**b).loss.backward()
    times = cpu_ms(fns)
    rows = []
    for label, _, batch in cases:
        tokens = int(batch["attention_mask"].sum()) if "attention_mask" in batch else int(
            lengths.sum())
        shape = "x".join(str(d) for d in batch["input_ids"].shape)
        ms = times[label]
        rows.append(f"| {label} | {shape} | {tokens:,} | {ms:.0f} ms | "
                    f"{tokens / ms * 1e3:,.0f} |")
        print(rows[-1], flush=True)
    return rows


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    attention = attention_rows()
    models = model_rows()
    text = "\n".join([
        "# Per-sequence attention on the CPU",
        "",
        f"`python benches/bench_varlen_cpu.py` — {time.perf_counter() - t0:.0f} s; fastpack "
        f"{fastpack.__version__}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, {cpu_name()}, one thread, CPU time "
        f"(`time.process_time`, median of {REPS - 2} after 2 warm-up calls).",
        "",
        "Attention alone, forward + backward, H=2, D=64, causal, one ~4,096-token step of "
        "log-normal lengths. `previous`: fastpack's loop before (split, then transpose + "
        "unsqueeze every sequence's q, k, v); "
        "`varlen_attention`: one split of `(1, H, T, D)` views; `padded buckets`: lengths "
        "bucketed (ratio 1.3) and gathered into one padded SDPA call per bucket.",
        "",
        "| median length | sequences | tokens | Σl² | previous | varlen_attention "
        "| padded buckets | max diff vs previous (varlen / buckets) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        *attention,
        "",
        "GPT-2 2×128 (fp32), forward + backward of one step (SFT-like lengths, median 200):",
        "",
        "| layout | input | real tokens | CPU time | tokens per CPU-second |",
        "|---|---|---:|---:|---:|",
        *models,
        "",
    ])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "varlen_cpu.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
