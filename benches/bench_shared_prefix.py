"""Shared prefixes computed once (``share_prefix=True``) against packing every sample whole,
on GRPO-like data: a prompt of ``P`` tokens with ``G`` responses of ``R`` tokens each.

1. **Tokens computed**: every rollout packed whole computes ``G·(P+R)`` tokens per prompt,
   a tree ``P + G·R``; both counted from the plans (``Plan.sample_tokens`` and
   ``Plan.total_tokens``), with the packs each needs at ``max_len`` 16,384.
2. **CPU training step** (forward + backward of a Llama of 4 layers × 256, fp32, one
   thread, CPU time via ``time.process_time`` so a shared machine's load stays out),
   the same samples as:
   * ``plain`` — every rollout packed whole, one flat row (``backend="flash"``) through
     ``register_hf_attention()`` (an SDPA call per sequence on the CPU);
   * ``tree`` — ``share_prefix=True`` through ``register_hf_attention()`` (the prompt's
     causal attention once, an SDPA call per response over its gathered path);
   * ``dense tree`` — the same tree batch through Hugging Face's SDPA with a dense
     ``[T, T]`` ancestor mask, as AReaL builds it (peer method, O(T²) memory).
   The three losses (token mean over the responses) are checked equal before timing. The
   target of issue 17: ``tree ≤ 1.1 × plain × tokens(tree) / tokens(plain)``; beside it the
   same bound with the sampler's cost model, ``6·h·Σl + attention work`` (a sequence of
   ``l`` tokens: ``l²``; a tree: ``P² + Σ(Rᵢ² + 2·P·Rᵢ)``), since each response still
   attends to its whole prompt: attention does not shrink with the tokens.
3. **The tree build in Rust** for 10^6 samples (125,000 prompts × G = 8, prompts of
   100..500 tokens, responses of 20..200, uint16 ids): ``fastpack.pack_trees`` by groups and
   as a trie, beside a per-token Python trie (the approach of AReaL's ``tree.py``, a dict
   per node) on the first 20,000 samples.

    python benches/bench_shared_prefix.py           # ~6 min on 2 shared cores
    python benches/bench_shared_prefix.py --quick   # smaller, ~1 min

Results go to ``benches/results/shared_prefix.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

import fastpack
from fastpack.torch import PackedCollator, packed_loss, register_hf_attention
from fastpack.torch.tree import check_tree

RESULTS = Path(__file__).parent / "results"
VOCAB = 4096


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown CPU"


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def rollouts(prompts: int, g: int, p: tuple[int, int], r: tuple[int, int], seed: int,
             dtype: Any = np.int64) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """Token rows (prompt + response), completion masks and group ids."""
    rng = np.random.default_rng(seed)
    rows, masks, groups = [], [], []
    for k in range(prompts):
        prompt = rng.integers(1, VOCAB, int(rng.integers(*p)), dtype=dtype)
        for _ in range(g):
            response = rng.integers(1, VOCAB, int(rng.integers(*r)), dtype=dtype)
            rows.append(np.concatenate([prompt, response]))
            masks.append(np.r_[np.zeros(len(prompt), np.uint8), np.ones(len(response), np.uint8)])
            groups.append(k)
    return rows, masks, np.asarray(groups, dtype=np.int64)


# ------------------------------------------------------------------------ 1. tokens


def tokens_table(configs: list[tuple[int, int, tuple[int, int], tuple[int, int]]]
                 ) -> list[str]:
    lines = ["| G | prompt P | response R | samples | G·(P+R) (plain) | P+G·R (tree) | "
             "ratio | packs plain | packs tree |", "|---|---|---|---|---|---|---|---|---|"]
    for prompts, g, p, r in configs:
        rows, _, groups = rollouts(prompts, g, p, r, seed=1)
        lengths = [len(x) for x in rows]
        plain = fastpack.pack(lengths, 16384)
        tree = fastpack.pack_trees(rows, 16384, prompt_ids=groups)
        assert tree.sample_tokens == plain.total_tokens
        lines.append(
            f"| {g} | {p[0]}..{p[1] - 1} | {r[0]}..{r[1] - 1} | {len(rows):,} | "
            f"{plain.total_tokens:,} | {tree.total_tokens:,} | "
            f"{plain.total_tokens / tree.total_tokens:.2f}x | {plain.num_packs} | "
            f"{tree.num_packs} |"
        )
    return lines


# -------------------------------------------------------------------- 2. step time


def model() -> Any:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def dense_tree_mask(batch: dict[str, Any]) -> torch.Tensor:
    """AReaL's way: the ancestor relation as a dense ``[1, 1, T, T]`` bool mask."""
    total = batch["input_ids"].shape[1]
    layout = check_tree(batch["tree_cu_seqlens"], batch["tree_parents"], total)
    ends = layout.token_ends(torch.device("cpu"))
    q = torch.arange(total)[:, None]
    k = torch.arange(total)[None, :]
    return ((k <= q) & (q < ends[None, :]))[None, None]


def cost_ratio(plain: dict[str, Any], tree: dict[str, Any], hidden: int) -> float:
    """The sampler's cost model (``6·h·Σl + attention work``, per layer and 4h) of the
    tree batch over the plain one's."""
    lengths = np.diff(plain["cu_seq_lens_q"].numpy().astype(np.int64))
    plain_cost = 6 * hidden * lengths.sum() + (lengths * lengths).sum()
    total = tree["input_ids"].shape[1]
    layout = check_tree(tree["tree_cu_seqlens"], tree["tree_parents"], total)
    work = 0
    for s in range(len(layout.parents)):
        n = layout.bounds[s + 1] - layout.bounds[s]
        work += n * n + 2 * layout.path_tokens(s) * n
    return float((6 * hidden * total + work) / plain_cost)


def cpu_ms(fns: dict[str, Callable[[], Any]], reps: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.process_time()
            fn()
            times[name].append(time.process_time() - t0)
    return {name: 1e3 * statistics.median(t[1:]) for name, t in times.items()}


def step_table(configs: list[tuple[int, int, tuple[int, int], tuple[int, int]]], reps: int
               ) -> list[str]:
    attn = register_hf_attention()
    m = model()
    lines = ["| G | P | R | tokens plain | tokens tree | ratio | plain ms | tree ms | "
             "dense tree ms | tree ÷ plain | 1.1 × tokens tree ÷ plain | met | cost-model ratio | "
             "1.1 × cost ratio | met |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for prompts, g, p, r in configs:
        rows, masks, groups = rollouts(prompts, g, p, r, seed=2)
        features = [{"input_ids": x.tolist(), "completion_mask": k.tolist()}
                    for x, k in zip(rows, masks)]
        plain = PackedCollator(1 << 16, backend="flash")(features)
        tree = PackedCollator(1 << 16, backend="flash", share_prefix=True)(
            [{**f, "prompt_id": int(k)} for f, k in zip(features, groups)])
        dense = {k: v for k, v in tree.items() if k != "attention_mask"}
        dense["attention_mask"] = dense_tree_mask(tree)

        def run(batch: dict[str, Any], impl: str) -> torch.Tensor:
            m.set_attn_implementation(impl)
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            loss = packed_loss(m(**inputs).logits, batch)
            loss.backward()
            m.zero_grad(set_to_none=True)
            return loss.detach()

        losses = [run(plain, attn), run(tree, attn), run(dense, "sdpa")]
        assert all(abs(float(x) - float(losses[0])) < 1e-4 for x in losses), losses
        times = cpu_ms({
            name: (lambda b=batch, impl=impl: run(b, impl))
            for name, batch, impl in (("plain", plain, attn), ("tree", tree, attn),
                                      ("dense", dense, "sdpa"))
        }, reps)
        t_plain = plain["input_ids"].shape[1]
        t_tree = tree["input_ids"].shape[1]
        target = 1.1 * t_tree / t_plain
        ratio = times["tree"] / times["plain"]
        cost = cost_ratio(plain, tree, m.config.hidden_size)
        lines.append(
            f"| {g} | {p[0]}..{p[1] - 1} | {r[0]}..{r[1] - 1} | {t_plain:,} | {t_tree:,} | "
            f"{t_plain / t_tree:.2f}x | {times['plain']:.0f} | {times['tree']:.0f} | "
            f"{times['dense']:.0f} | {ratio:.2f} | {target:.2f} | "
            f"{'yes' if ratio <= target else 'no'} | {cost:.2f} | {1.1 * cost:.2f} | "
            f"{'yes' if ratio <= 1.1 * cost else 'no'} |"
        )
        print(lines[-1], flush=True)
    return lines


# ------------------------------------------------------------------------ 3. build


def python_trie(rows: list[np.ndarray]) -> int:
    """A per-token trie in Python, one dict per node (the approach of AReaL's tree.py):
    returns its node count."""
    root: dict[int, Any] = {}
    nodes = 0
    for row in rows:
        node = root
        for token in row.tolist():
            child = node.get(token)
            if child is None:
                child = node[token] = {}
                nodes += 1
            node = child
    return nodes


def build_table(samples: int, reps: int) -> list[str]:
    rows, _, groups = rollouts(samples // 8, 8, (100, 501), (20, 201), seed=3,
                               dtype=np.uint16)
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(x) for x in rows], out=offsets[1:])
    tokens = fastpack.Ragged(np.concatenate(rows), offsets)
    total = int(offsets[-1])
    del rows
    lines = [f"{samples:,} samples, {total:,} tokens (uint16), max_len 16,384; median of "
             f"{reps} after one warm-up call, wall clock, default threads (2):", "",
             "| build | seconds | per sample | segments | tokens after sharing |",
             "|---|---|---|---|---|"]
    for name, kwargs in (("groups (prompt ids)", {"groups": groups}), ("trie", {})):
        times = []
        plan = fastpack.pack_trees(tokens, 16384, **kwargs)
        for _ in range(reps):
            t0 = time.perf_counter()
            plan = fastpack.pack_trees(tokens, 16384, **kwargs)
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        lines.append(f"| fastpack.pack_trees, {name} | {t:.2f} | {1e9 * t / samples:.0f} ns | "
                     f"{plan.num_segments:,} | {plan.total_tokens:,} |")
        print(lines[-1], flush=True)
    subset = 20_000
    small = [tokens[i] for i in range(subset)]
    t0 = time.perf_counter()
    nodes = python_trie(small)
    t = time.perf_counter() - t0
    lines.append(f"| per-token Python trie (AReaL's approach), first {subset:,} samples | "
                 f"{t:.2f} | {1e9 * t / subset:.0f} ns | {nodes:,} nodes | – |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = load()
    token_configs = [(64, 4, (200, 401), (20, 201)), (32, 8, (500, 1001), (50, 501)),
                     (16, 16, (1000, 2001), (20, 1001))]
    step_configs = [(2, 4, (200, 401), (20, 201)), (1, 8, (500, 1001), (50, 501)),
                    (1, 16, (1000, 2001), (20, 1001))]
    if args.quick:
        step_configs = step_configs[:1]
    out = [
        "# Shared prefixes: tree batches against packing every rollout whole", "",
        f"`python benches/bench_shared_prefix.py{' --quick' if args.quick else ''}` on "
        f"{cpu_name()}, {os.cpu_count()} cores shared with other jobs; load average "
        f"{start} at start. torch {torch.__version__}, transformers "
        f"{transformers.__version__}.", "",
        "## Tokens computed", "",
        "GRPO-like rollouts: prompts and responses of uniformly drawn lengths (ranges below), "
        "counted from the plans.", "",
        *tokens_table(token_configs), "",
        "## CPU training step (forward + backward), one thread, CPU time", "",
        "Llama, 4 layers × 256 (4 heads, 2 KV heads), vocab 4,096, fp32; the losses of the "
        "three are equal (checked) before timing; median of 5 interleaved steps after one.",
        "",
    ]
    out += step_table(step_configs, reps=3 if args.quick else 6)
    out += ["", "## The tree build in Rust", ""]
    out += build_table(100_000 if args.quick else 1_000_000, reps=1 if args.quick else 3)
    out += ["", f"Load average at the end: {load()}."]
    RESULTS.mkdir(exist_ok=True)
    name = "shared_prefix_quick.md" if args.quick else "shared_prefix.md"
    (RESULTS / name).write_text("\n".join(out) + "\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
