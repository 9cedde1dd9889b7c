"""The seeds' experiment: train a small GPT-2 on the CPU with padding, with length
bucketing and with fastpack packing, on the same data, and compare tokens/s and loss.

Data: real text at the byte level (vocab 256) — snippets of the CPython standard library
sources (``*.py`` under ``sysconfig.get_paths()["stdlib"]``), cut at a line start.
``--data sft`` (default): SFT-like lengths (log-normal, median 200 bytes, clipped to
[8, 1024]); ``--data pretrain``: a pretraining-like mix — 80% documents of log-normal
length (median ~360) and 20% long ones (Pareto tail from 1,850), clipped to
[8, max_len = 2048], 8,192 tokens per step. A fixed tenth of the files (by CRC32 of the
path) is held out for a final evaluation.

Every method starts from the same random init (same seed), the same AdamW and lr schedule,
and gets ``--tokens-per-step`` real tokens per optimizer step (on average; packed steps hold
whole packs):

* ``padded``: random batches (samples in shuffled order, cut where that leaves the batch
  nearest the budget), each padded to its longest sample, ``PackedCollator(backend="padded")``
  (0/1 ``attention_mask``);
* ``bucketed``: like Hugging Face ``group_by_length`` — shuffled samples cut into
  mega-batches of 50 batches' worth of tokens, sorted by length inside each, cut into
  budget batches, then the batches shuffled; padded to the longest;
* ``packed_rows``: the whole dataset packed once (``PackedDataset``, best-fit decreasing,
  ``max_len``), ``tokens_per_step / max_len`` packs per step as rows, ``backend="sdpa"``
  (``position_ids`` restarting per sequence, no ``attention_mask``, ``use_cache=False``):
  Hugging Face's SDPA then attends over every whole row with a block-diagonal mask;
* ``packed``: what fastpack recommends — the same global plan as groups of packs under a
  ``tokens_per_step`` budget (``group_tokens``), served by a ``PackedSampler``, one flat
  row per step (``backend="flash"``) and per-sequence attention from ``cu_seq_lens_q``
  (``register_hf_attention()``: ``varlen_attention``, an SDPA call per sequence on the
  CPU), so no score outside a sequence is computed.

The runs are interleaved step by step (the order rotating every step), so a noisy shared
machine slows them alike, and every step records how much CPU other processes took
meanwhile (``/proc/stat``): throughput is quoted as the median over "quiet" steps (a
method's steps during which other processes used < ``--quiet`` CPUs) and over all steps. A step's time covers collate, forward, backward, clipping and the optimizer
step. Tokens/s counts real (non-pad) input tokens. The experiment repeats for every seed of
``--seeds`` (init, samples, order); losses are reported as mean and spread over seeds.
Results go to ``benches/results/train.md``, ``train.json`` and ``train_loss.png``.

    python benches/bench_train.py              # 3 seeds x 4 methods x 200 steps: ~13 min
                                               # on 2 idle cores (~4.5 min per seed)
    python benches/bench_train.py --seeds 0    # one seed
    python benches/bench_train.py --data pretrain --steps 100 --seeds 0
                                               # -> train_pretrain.md (~8 min)
    python benches/bench_train.py --quick      # 10-step smoke run
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import shlex
import statistics
import sys
import sysconfig
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

import fastpack
from fastpack.torch import PackedCollator, PackedDataset, PackedSampler, register_hf_attention

RESULTS = Path(__file__).parent / "results"
METHODS = ("padded", "bucketed", "packed_rows", "packed")
COLORS = {"padded": "tab:red", "bucketed": "tab:orange", "packed_rows": "tab:gray",
          "packed": "tab:blue"}
LABELS = {
    "padded": "padded batches",
    "bucketed": "length-bucketed batches",
    "packed_rows": 'packed rows, HF sdpa (`backend="sdpa"`)',
    "packed": 'packed, per-sequence attention (`backend="flash"` + `register_hf_attention()`)',
}
VARLEN = register_hf_attention()  # the attention implementation of the "packed" model
Batch = dict[str, Any]


# ---------------------------------------------------------------------------- data
def load_corpus(heldout_every: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Train and held-out corpora: concatenated stdlib sources as uint8 bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        f for f in root.rglob("*.py") if "site-packages" not in f.parts and f.is_file()
    )
    train, held = [], []
    for f in files:
        data = f.read_bytes()
        if len(data) < 512:
            continue
        rel = str(f.relative_to(root)).encode()
        (held if zlib.crc32(rel) % heldout_every == 0 else train).append(data)
    as_array = lambda parts: np.frombuffer(b"\n".join(parts), dtype=np.uint8)  # noqa: E731
    return as_array(train), as_array(held)


def sample_length(rng: np.random.Generator, data: str, max_len: int) -> int:
    if data == "pretrain":  # 80% log-normal documents, 20% from a Pareto tail
        if rng.random() < 0.2:
            x = 1850.0 * (rng.pareto(1.5) + 1.0)
        else:
            x = rng.lognormal(math.log(600) - 0.5, 1.0)
    else:
        x = rng.lognormal(math.log(200.0), 0.9)
    return int(np.clip(x, 8, max_len))


def make_samples(corpus: np.ndarray, total_tokens: int, seed: int, max_len: int = 1024,
                 data: str = "sft") -> list[np.ndarray]:
    """Snippets starting at a line start, lengths of the ``data`` mix, until
    ``total_tokens``."""
    rng = np.random.default_rng(seed)
    line_starts = np.flatnonzero(corpus[:-max_len] == ord("\n")) + 1
    samples: list[np.ndarray] = []
    n = 0
    while n < total_tokens:
        length = sample_length(rng, data, max_len)
        start = int(line_starts[rng.integers(len(line_starts))])
        samples.append(corpus[start : start + length].astype(np.int64))
        n += length
    return samples


def budget_batches(order: list[int], lengths: np.ndarray, budget: int) -> list[list[int]]:
    """Cut ``order`` into batches of ~``budget`` tokens (order kept): a sample joins the
    batch while that leaves it nearer the budget than closing it would (size + len/2 <
    budget), so batches average the budget, like packed steps, instead of falling short."""
    batches: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i in order:
        if cur and 2 * size + lengths[i] >= 2 * budget:
            batches.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += int(lengths[i])
    if cur:
        batches.append(cur)
    return batches


def padded_batches(lengths: np.ndarray, budget: int, seed: int) -> Iterator[list[int]]:
    for epoch in range(1000):
        order = np.random.default_rng((seed, epoch)).permutation(len(lengths)).tolist()
        yield from budget_batches(order, lengths, budget)


def bucketed_batches(lengths: np.ndarray, budget: int, seed: int,
                     mega: int = 50) -> Iterator[list[int]]:
    for epoch in range(1000):
        rng = np.random.default_rng((seed, epoch))
        order = rng.permutation(len(lengths)).tolist()
        batches: list[list[int]] = []
        for chunk in budget_batches(order, lengths, budget * mega):  # mega-batches
            chunk.sort(key=lambda i: -lengths[i])
            batches.extend(budget_batches(chunk, lengths, budget))
        for j in rng.permutation(len(batches)):
            yield batches[j]


def loader(method: str, samples: list[np.ndarray], args: argparse.Namespace
           ) -> tuple[Iterator[Callable[[], tuple[Batch, int]]], dict[str, Any]]:
    """An endless stream of thunks; calling one builds (collates) the next batch and
    returns it with its number of real (non-pad) tokens."""
    lengths = np.array([len(s) for s in samples])
    info: dict[str, Any] = {}
    values = np.concatenate(samples)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    if method == "packed":
        # The recommended path: groups of packs under a token budget, a sampler over them,
        # one flat row per step with cu_seq_lens_q for per-sequence attention.
        ds = PackedDataset((values, offsets), PackedCollator(max_len=args.max_len,
                                                             backend="flash"),
                           group_tokens=args.tokens_per_step, seed=args.seed)
        sampler = PackedSampler(ds, num_replicas=1, rank=0, seed=args.seed,
                                hidden_size=args.hidden)
        step_tokens = ds.steps.tokens
        info["plan"] = ds.plan.summary()
        info["batches_per_epoch"] = len(ds)

        def varlen_stream() -> Iterator[Callable[[], tuple[Batch, int]]]:
            for epoch in range(1000):
                sampler.set_epoch(epoch)
                for step in sampler:
                    yield lambda step=step: (ds[step], int(step_tokens[step.index]))

        return varlen_stream(), info
    if method == "packed_rows":
        collator = PackedCollator(max_len=args.max_len, backend="sdpa")
        ds = PackedDataset((values, offsets), collator,
                           packs_per_batch=args.tokens_per_step // args.max_len, seed=args.seed)
        ppb = ds.packs_per_batch
        pack_fills = ds.plan.pack_fills  # real tokens per pack
        info["plan"] = ds.plan.summary()
        info["batches_per_epoch"] = len(ds)

        def packed_stream() -> Iterator[Callable[[], tuple[Batch, int]]]:
            for epoch in range(1000):
                for b in np.random.default_rng((args.seed, epoch)).permutation(len(ds)):
                    yield lambda b=int(b): (ds[b], int(pack_fills[b * ppb : (b + 1) * ppb].sum()))

        return packed_stream(), info
    collator = PackedCollator(max_len=args.max_len, backend="padded")
    make = padded_batches if method == "padded" else bucketed_batches
    info["batches_per_epoch"] = sum(1 for _ in budget_batches(
        list(range(len(lengths))), lengths, args.tokens_per_step))

    def stream() -> Iterator[Callable[[], tuple[Batch, int]]]:
        for ids in make(lengths, args.tokens_per_step, args.seed):
            yield lambda ids=ids: (collator([{"input_ids": samples[i]} for i in ids]),
                                   int(lengths[ids].sum()))

    return stream(), info


# ---------------------------------------------------------------------------- model
def attention_of(method: str) -> str:
    return VARLEN if method == "packed" else "sdpa"


def make_model(args: argparse.Namespace) -> GPT2LMHeadModel:
    cfg = GPT2Config(
        vocab_size=256, n_positions=args.max_len, n_embd=args.hidden, n_layer=args.layers,
        n_head=args.heads, activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(args.seed)
    return GPT2LMHeadModel(cfg)


def lr_at(step: int, args: argparse.Namespace) -> float:
    warmup = max(1, args.steps // 20)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    t = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def evaluate(model: GPT2LMHeadModel, samples: list[np.ndarray], max_len: int) -> float:
    """Loss per target token over held-out samples (padded batches of 16, same for all)."""
    model.eval()
    collator = PackedCollator(max_len=max_len, backend="padded")
    total, n = 0.0, 0
    order = sorted(range(len(samples)), key=lambda i: len(samples[i]))
    for lo in range(0, len(order), 16):
        batch = collator([{"input_ids": samples[i]} for i in order[lo : lo + 16]])
        logits = model(input_ids=batch["input_ids"],
                       attention_mask=batch["attention_mask"]).logits[:, :-1]
        target = batch["labels"][:, 1:]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
            ignore_index=-100, reduction="sum")
        total += float(loss)
        n += int((target != -100).sum())
    model.train()
    return total / n


# ---------------------------------------------------------------------------- run
def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_snapshot() -> tuple[int, int]:
    """(busy jiffies of the whole machine incl. steal, jiffies of this process)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return -1, 0
    busy = v[0] + v[1] + v[2] + v[5] + v[6] + v[7]  # user nice system irq softirq steal
    return busy, int(fields[11]) + int(fields[12])  # utime + stime (all threads)


def others_load(a: tuple[int, int], b: tuple[int, int], seconds: float) -> float:
    """Mean number of CPUs busy with something other than this process (or stolen by the
    hypervisor) between two snapshots; -1 where /proc is unavailable."""
    if a[0] < 0 or b[0] < 0:
        return -1.0
    tick = os.sysconf("SC_CLK_TCK")
    return max(0.0, ((b[0] - a[0]) - (b[1] - a[1])) / tick / max(seconds, 1e-3))


def check_equivalence(base: GPT2LMHeadModel, samples: list[np.ndarray],
                      args: argparse.Namespace) -> dict[str, float]:
    """Loss and gradients of one step's samples as a padded batch and as a packed one: the
    same up to fp32 rounding (so loss differences come from batch composition and order)."""
    model = copy.deepcopy(base).train()
    feats = [{"input_ids": x} for x in samples[:32]]
    feats = [f for i, f in enumerate(feats)
             if sum(len(x) for x in samples[: i + 1]) <= args.tokens_per_step]
    res = []
    for backend in ("padded", "flash"):
        model.set_attn_implementation(attention_of("packed" if backend == "flash" else ""))
        model.zero_grad(set_to_none=True)
        loss = model(**PackedCollator(max_len=args.max_len, backend=backend)(feats)).loss
        loss.backward()
        res.append((loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    return {"loss": abs(res[0][0] - res[1][0]),
            "grad": float((res[0][1] - res[1][1]).abs().max()),
            "grad_max": float(res[0][1].abs().max())}


def train(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    corpus, held_corpus = load_corpus()
    # Enough samples that every method finishes its steps within one epoch.
    samples = make_samples(corpus, int(args.steps * args.tokens_per_step * 1.12) + 20_000,
                           seed=args.seed, max_len=args.max_len, data=args.data)
    held = make_samples(held_corpus, args.eval_tokens, seed=12345, max_len=args.max_len,
                        data=args.data)
    lengths = np.array([len(s) for s in samples])
    print(f"{len(samples)} train samples, {lengths.sum():,} tokens, median length "
          f"{np.median(lengths):.0f}, mean {lengths.mean():.0f}; held-out {len(held)} samples")

    base = make_model(args)
    print(f"GPT-2: {sum(p.numel() for p in base.parameters()):,} parameters")
    runs: dict[str, dict[str, Any]] = {}
    for m in METHODS:
        model = copy.deepcopy(base).train()
        model.set_attn_implementation(attention_of(m))
        assert model.config._attn_implementation == attention_of(m)
        stream, info = loader(m, samples, args)
        runs[m] = {
            "model": model, "stream": stream, "info": info,
            "opt": torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                     weight_decay=0.1),
            "log": {k: [] for k in ("loss", "time", "cpu", "collate", "others", "tokens",
                                    "targets",
                                    "slots", "rows", "width")},
        }
    equivalence = check_equivalence(base, samples, args)
    print(f"packed vs padded on the same samples: |d loss| {equivalence['loss']:.1e}, "
          f"max |d grad| {equivalence['grad']:.1e}")
    # Warm-up (allocator, kernels): untimed forward/backward passes on a throwaway copy.
    for m in METHODS:
        scratch = copy.deepcopy(base).train()
        scratch.set_attn_implementation(attention_of(m))
        batch, _ = loader(m, samples, args)[0].__next__()()
        for _ in range(args.warmup):
            scratch(**batch).loss.backward()
    del scratch
    for step in range(args.steps):
        shift = step % len(METHODS)
        order = METHODS[shift:] + METHODS[:shift]
        for m in order:
            r = runs[m]
            for g in r["opt"].param_groups:
                g["lr"] = lr_at(step, args)
            c0 = cpu_snapshot()
            p0 = time.process_time()
            t0 = time.perf_counter()
            batch, real = next(r["stream"])()
            t1 = time.perf_counter()
            loss = r["model"](**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(r["model"].parameters(), 1.0)
            r["opt"].step()
            r["opt"].zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            p2 = time.process_time()
            others = others_load(c0, cpu_snapshot(), t2 - t0)
            ids, labels = batch["input_ids"], batch["labels"]
            log = r["log"]
            log["loss"].append(loss.item())
            log["time"].append(t2 - t0)
            log["cpu"].append(p2 - p0)
            log["collate"].append(t1 - t0)
            log["others"].append(others)
            log["tokens"].append(real)
            log["targets"].append(int((labels != -100).sum()))
            log["slots"].append(ids.numel())
            log["rows"].append(ids.shape[0])
            log["width"].append(ids.shape[1])
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d} " + "  ".join(
                f"{m} {runs[m]['log']['loss'][-1]:.3f} ({runs[m]['log']['time'][-1]:.2f}s)"
                for m in METHODS), flush=True)

    # Quiet steps of a method: those during which no other process (or the hypervisor)
    # took more than --quiet CPUs on average; their medians are what an idle machine gives.
    out: dict[str, Any] = {"seed": args.seed, "methods": {}, "equivalence": equivalence}
    for m in METHODS:
        r, log = runs[m], runs[m]["log"]
        quiet = [i for i in range(args.steps) if 0 <= log["others"][i] < args.quiet]
        tok_s = [t / s for t, s in zip(log["tokens"], log["time"])]
        q_time = [log["time"][i] for i in quiet] or [math.nan]
        q_tok_s = [tok_s[i] for i in quiet] or [math.nan]
        tail = min(20, args.steps)
        out["methods"][m] = {
            **log,
            "quiet_steps": quiet,
            "batches_per_epoch": r["info"]["batches_per_epoch"],
            "quiet_median_step_s": statistics.median(q_time),
            "quiet_median_tokens_per_s": statistics.median(q_tok_s),
            "median_others_cpus": statistics.median(log["others"]),
            "median_step_s": statistics.median(log["time"]),
            "median_collate_ms": 1e3 * statistics.median(log["collate"]),
            "median_tokens_per_s": statistics.median(tok_s),
            "mean_tokens_per_s": sum(log["tokens"]) / sum(log["time"]),
            "padding_fraction": 1 - sum(log["tokens"]) / sum(log["slots"]),
            "tokens_per_step": statistics.mean(log["tokens"]),
            "targets_per_step": statistics.mean(log["targets"]),
            "total_targets": sum(log["targets"]),
            "total_time_s": sum(log["time"]),
            "final_loss": statistics.mean(log["loss"][-tail:]),
            "eval_loss": evaluate(r["model"], held, args.max_len),
        }
    out["meta"] = {
        "fastpack": fastpack.__version__, "torch": torch.__version__,
        "transformers": transformers.__version__, "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(), "cpu_name": cpu_name(),
        "params": sum(p.numel() for p in base.parameters()),
        "train_samples": len(samples), "train_tokens": int(lengths.sum()),
        "median_len": float(np.median(lengths)), "mean_len": float(lengths.mean()),
        "heldout_samples": len(held), "heldout_tokens": int(sum(len(s) for s in held)),
    }
    return out


# ---------------------------------------------------------------------------- report
def smooth(x: Any, k: int) -> np.ndarray:
    """Trailing moving average (window k, shorter at the start)."""
    c = np.cumsum(np.concatenate([[0.0], np.asarray(x, dtype=float)]))
    i = np.arange(1, len(c))
    return (c[i] - c[np.maximum(i - k, 0)]) / np.minimum(i, k)


def pooled(runs: list[dict[str, Any]], m: str, key: str, quiet: bool) -> list[float]:
    """Per-step values of method ``m`` pooled over seeds (only quiet steps if asked)."""
    out = []
    for run in runs:
        log = run["methods"][m]
        steps = log["quiet_steps"] if quiet else range(len(log["time"]))
        if key == "tokens_per_s":
            out += [log["tokens"][i] / log["time"][i] for i in steps]
        elif key == "tokens_per_cpu_s":
            out += [log["tokens"][i] / max(log["cpu"][i], 1e-9) for i in steps]
        else:
            out += [log[key][i] for i in steps]
    return out or [math.nan]


def summarize(res: dict[str, Any]) -> dict[str, dict[str, float]]:
    runs = res["runs"]
    summary = {}
    for m in METHODS:
        logs = [run["methods"][m] for run in runs]
        held = [lg["eval_loss"] for lg in logs]
        final = [lg["final_loss"] for lg in logs]
        summary[m] = {
            "quiet_tokens_per_s": statistics.median(pooled(runs, m, "tokens_per_s", True)),
            "quiet_step_s": statistics.median(pooled(runs, m, "time", True)),
            "all_tokens_per_s": statistics.median(pooled(runs, m, "tokens_per_s", False)),
            "all_step_s": statistics.median(pooled(runs, m, "time", False)),
            "tokens_per_cpu_s": statistics.median(pooled(runs, m, "tokens_per_cpu_s", False)),
            "collate_ms": 1e3 * statistics.median(pooled(runs, m, "collate", False)),
            "padding": 1 - sum(sum(lg["tokens"]) for lg in logs)
            / sum(sum(lg["slots"]) for lg in logs),
            "tokens_per_step": statistics.mean(pooled(runs, m, "tokens", False)),
            "rows": statistics.median(pooled(runs, m, "rows", False)),
            "width": statistics.median(pooled(runs, m, "width", False)),
            "final_loss": statistics.mean(final),
            "final_loss_sd": statistics.stdev(final) if len(final) > 1 else 0.0,
            "eval_loss": statistics.mean(held),
            "eval_loss_sd": statistics.stdev(held) if len(held) > 1 else 0.0,
        }
    return summary


def mean_curves(res: dict[str, Any], m: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(cumulative targets, cumulative step time, loss), each averaged over seeds per step
    (every step of every method holds ~--tokens-per-step tokens, so steps line up)."""
    logs = [run["methods"][m] for run in res["runs"]]
    targets = np.mean([np.cumsum(lg["targets"]) for lg in logs], axis=0)
    times = np.mean([np.cumsum(lg["time"]) for lg in logs], axis=0)
    loss = np.mean([lg["loss"] for lg in logs], axis=0)
    return targets, times, loss


def loss_at_tokens(res: dict[str, Any], k: int) -> tuple[list[int], dict[str, list[float]]]:
    """Smoothed seed-mean loss of every method, interpolated at common numbers of trained
    target tokens."""
    total = min(mean_curves(res, m)[0][-1] for m in METHODS)
    points = [int(total * f) for f in (0.25, 0.5, 0.75, 1.0)]
    table = {}
    for m in METHODS:
        x, _, loss = mean_curves(res, m)
        table[m] = [float(np.interp(p, x, smooth(loss, k))) for p in points]
    return points, table


def plot(res: dict[str, Any], path: Path, k: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summarize(res)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    lows, highs = [], []
    for m in METHODS:
        x_tok, x_time, loss = mean_curves(res, m)
        s = summary[m]
        label = (f"{m}: {s['quiet_tokens_per_s']:,.0f} tok/s, "
                 f"{100 * s['padding']:.0f}% padding")
        for ax, x in ((axes[0], x_tok / 1e6), (axes[1], x_time)):
            ax.plot(x, loss, color=COLORS[m], alpha=0.2, lw=0.8)
            ax.plot(x, smooth(loss, k), color=COLORS[m], lw=2, label=label)
        lows.append(loss.min())
        highs.append(loss[min(len(loss) - 1, max(3, len(loss) // 20)):].max())
    axes[0].set_ylim(min(lows) - 0.05, min(max(highs), 6.0) + 0.05)
    axes[0].set_xlabel("trained target tokens (millions)")
    axes[1].set_xlabel("training time (s; own steps only, the runs are interleaved)")
    axes[0].set_ylabel(f"train loss per token, nats (bold: {k}-step moving average)")
    axes[0].set_title("Loss vs trained tokens")
    axes[1].set_title("Loss vs training time")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    a, meta = res["args"], res["meta"]
    seeds = ", ".join(str(r["seed"]) for r in res["runs"])
    fig.suptitle(
        f"GPT-2 {meta['params'] / 1e6:.2f}M params ({a['layers']} layers x {a['hidden']}), "
        f"byte-level CPython stdlib ({a['data']}), {a['steps']} steps x "
        f"~{a['tokens_per_step']:,} tokens, "
        f"CPU {a['threads']} threads; mean of seeds {seeds}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(res: dict[str, Any], command: str, k: int) -> str:
    a, meta, runs = res["args"], res["meta"], res["runs"]
    summary = summarize(res)
    pad = summary["padded"]
    n_quiet = {m: sum(len(r["methods"][m]["quiet_steps"]) for r in runs) for m in METHODS}
    n_steps = a["steps"] * len(runs)
    seeds = ", ".join(str(r["seed"]) for r in runs)
    mix = ("SFT-like: log-normal length" if a["data"] == "sft" else
           "pretraining-like: 80% log-normal documents, 20% from a Pareto tail; length")
    lines = [
        f"# Training a small GPT-2: padded vs length-bucketed vs packed ({a['data']} data)",
        "",
        f"`{command}` — {res['wall_s'] / 60:.1f} min; fastpack {meta['fastpack']}, torch "
        f"{meta['torch']}, transformers {meta['transformers']}, {meta['cpu_name']}, "
        f"`torch.set_num_threads({a['threads']})`.",
        "",
        f"GPT-2 (`GPT2LMHeadModel`, {a['layers']} layers, hidden {a['hidden']}, {a['heads']} "
        f"heads, {meta['params']:,} parameters, fp32), the same init for every method, AdamW "
        f"lr {a['lr']:g} (warm-up + cosine), {a['steps']} steps each, "
        f"~{a['tokens_per_step']:,} real tokens per step for every method; seeds {seeds} "
        f"(init, samples and order). Data: CPython stdlib sources at the byte level (vocab "
        f"256), {meta['train_samples']:,} snippets per seed, {mix} median "
        f"{meta['median_len']:.0f}, mean {meta['mean_len']:.0f}, clipped to "
        f"[8, {a['max_len']}]; held-out: {meta['heldout_samples']} snippets "
        f"({meta['heldout_tokens']:,} tokens) from a disjoint tenth of the files.",
        "",
        "Methods: **padded** — random batches, each padded to its longest sample (sdpa "
        "with a padding mask); **bucketed** — like `group_by_length`: samples sorted by "
        "length inside mega-batches of 50 batches, then padded; **packed_rows** — "
        f"`PackedDataset` over the whole set, {a['tokens_per_step'] // a['max_len']} packs of "
        f"{a['max_len']} per step as rows, `backend=\"sdpa\"` (HF builds a block-diagonal "
        "mask and attends over whole rows); **packed** — what fastpack recommends: the same "
        f"global plan as groups under a {a['tokens_per_step']:,}-token budget "
        "(`group_tokens`), served by `PackedSampler`, one flat row per step "
        "(`backend=\"flash\"`) and per-sequence attention from `cu_seq_lens_q` "
        "(`register_hf_attention()` + `model.set_attn_implementation(...)`; on the CPU an "
        "SDPA call per sequence), so no attention score outside a sequence is computed.",
        "",
        "Medians of per-step numbers pooled over the seeds; \"quiet\": a method's steps "
        f"during which other processes used < {a['quiet']:g} CPU, as seen from `/proc/stat` "
        f"(here {', '.join(f'{m} {n_quiet[m]}' for m in METHODS)} of {n_steps}; the machine "
        "is shared, and an oversubscribed 2-thread run slows down several-fold and unevenly "
        "across methods, which distorts the ratios). The methods run interleaved, step by "
        "step.",
        "",
        "| method | tokens/s (quiet) | vs padded | vs bucketed | time/step (quiet) "
        "| tokens/s (all) | vs padded | tokens per CPU-second | vs bucketed | collate/step "
        "| padding | real tokens/step | rows x width (median) | final train loss "
        "| held-out loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    pm = "\u00b1"

    def spread(mean: float, sd: float) -> str:
        return f"{mean:.3f} {pm} {sd:.3f}" if len(runs) > 1 else f"{mean:.3f}"

    bucket = summary["bucketed"]
    for m in METHODS:
        s = summary[m]
        lines.append(
            f"| {m} | {s['quiet_tokens_per_s']:,.0f} | "
            f"**{s['quiet_tokens_per_s'] / pad['quiet_tokens_per_s']:.2f}x** | "
            f"{s['quiet_tokens_per_s'] / bucket['quiet_tokens_per_s']:.2f}x | "
            f"{s['quiet_step_s']:.3f} s | {s['all_tokens_per_s']:,.0f} | "
            f"{s['all_tokens_per_s'] / pad['all_tokens_per_s']:.2f}x | "
            f"{s['tokens_per_cpu_s']:,.0f} | "
            f"{s['tokens_per_cpu_s'] / bucket['tokens_per_cpu_s']:.2f}x | "
            f"{s['collate_ms']:.2f} ms | {100 * s['padding']:.1f}% | "
            f"{s['tokens_per_step']:,.0f} | {s['rows']:.0f} x {s['width']:.0f} | "
            f"{spread(s['final_loss'], s['final_loss_sd'])} | "
            f"{spread(s['eval_loss'], s['eval_loss_sd'])} |"
        )
    lines += [
        "",
        "Final train loss: mean of the last 20 steps; held-out loss: each final model on the "
        "same held-out snippets (padded batches, loss per target token); both mean "
        f"{pm} standard deviation over the seeds. Per seed:",
        "",
        "| seed | tokens/s " + " / ".join(METHODS) + " (quiet) "
        "| packed / bucketed | held-out " + " / ".join(METHODS) + " | packed - bucketed |",
        "|---:|---|---:|---|---:|",
    ]
    for run in runs:
        q = {m: statistics.median(pooled([run], m, "tokens_per_s", True)) for m in METHODS}
        ev = {m: run["methods"][m]["eval_loss"] for m in METHODS}
        lines.append(
            f"| {run['seed']} | "
            + " / ".join(f"{q[m]:,.0f}" for m in METHODS)
            + f" | {q['packed'] / q['bucketed']:.2f}x | "
            + " / ".join(f"{ev[m]:.3f}" for m in METHODS)
            + f" | {ev['packed'] - ev['bucketed']:+.3f} |"
        )
    eq = [run["equivalence"] for run in runs]
    lines += [
        "",
        "Same samples, same weights: one step's samples as a padded batch (sdpa) and as a "
        "packed flat row (per-sequence attention) give the same loss (max |difference| "
        f"{max(e['loss'] for e in eq):.1e}) and "
        f"gradients (max |difference| {max(e['grad'] for e in eq):.1e}, largest gradient "
        f"entry {max(e['grad_max'] for e in eq):.2f}), checked at the start of every seed; "
        "so loss differences between the methods can only come from which samples share a "
        "step and in what order.",
    ]
    points, table = loss_at_tokens(res, k)
    lines += [
        "",
        f"Train loss per token at equal numbers of trained target tokens (seed mean, {k}-step "
        "trailing moving average, interpolated):",
        "",
        "| method | " + " | ".join(f"{p / 1e6:.2f}M" for p in points) + " |",
        "|---|" + "---:|" * len(points),
    ]
    for m, vals in table.items():
        lines.append(f"| {m} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    lines += [
        "",
        "Tokens/s = real (non-pad) input tokens / step time, where a step is collate + "
        "forward + backward + clip + AdamW; tokens per CPU-second divide by the CPU time "
        "this process used in the step instead (all its threads: less sensitive to other "
        "processes than wall time, but it counts OpenMP's spin-waiting). Padding = pad slots / all slots of the input "
        f"tensors. Curves: `{res['stem']}_loss.png`; per-step logs: `{res['stem']}.json` "
        "(git-ignored).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="10-step smoke run, one seed")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated; one run per seed")
    ap.add_argument("--data", choices=("sft", "pretrain"), default="sft",
                    help="length mix: SFT-like (default) or pretraining-like")
    ap.add_argument("--tokens-per-step", type=int, default=None,
                    help="default 4096 (sft), 8192 (pretrain)")
    ap.add_argument("--max-len", type=int, default=None,
                    help="default 1024 (sft), 2048 (pretrain)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3,
                    help="untimed forward/backward passes per method before training")
    ap.add_argument("--quiet", type=float, default=0.2,
                    help="a step is quiet when other processes used < this many CPUs")
    ap.add_argument("--eval-tokens", type=int, default=30_000)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    seeds = [int(x) for x in args.seeds.split(",")]
    pretrain = args.data == "pretrain"
    if args.tokens_per_step is None:
        args.tokens_per_step = 8192 if pretrain else 4096
    if args.max_len is None:
        args.max_len = 2048 if pretrain else 1024
    if args.quick:
        args.steps = min(args.steps, 10)
        args.eval_tokens = 5_000
        seeds = seeds[:1]
    if args.tokens_per_step % args.max_len:
        ap.error("--tokens-per-step must be a multiple of --max-len (whole packs per step)")

    t0 = time.perf_counter()
    runs = []
    for seed in seeds:
        print(f"--- seed {seed}")
        runs.append(train(argparse.Namespace(**{**vars(args), "seed": seed})))
    stem = "train" if args.data == "sft" else f"train_{args.data}"
    res = {"args": {**vars(args), "seeds": seeds}, "meta": runs[0].pop("meta"),
           "runs": runs, "wall_s": time.perf_counter() - t0, "stem": stem}
    for run in runs:
        run.pop("meta", None)
    command = shlex.join(["python", "benches/bench_train.py", *sys.argv[1:]])
    k = max(1, min(10, args.steps // 5))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    plot(res, out / f"{stem}_loss.png", k)
    text = markdown(res, command, k)
    (out / f"{stem}.md").write_text(text)
    print(text)
    print(f"total wall time {res['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
