"""Mixtures by tokens (``fastpack.mix``, ``fastpack pack --mix``) against plain best fit:
planning time, efficiency, and how well each step keeps the sources' proportions.
Writes benches/results/mix.md.

    python benches/bench_mix.py plan      # 10^7 documents from 4 sources, lengths only
    python benches/bench_mix.py command   # files on disk: --mix vs plain, and 3 --shard jobs
    python benches/bench_mix.py all

Two ways to keep every step in proportion are compared on the same selection of documents:

- **interleave, then pack each step** (what fastpack does): copies ordered by the share of
  their source's tokens before them, cut into steps of equal tokens, each step packed
  with best fit. A source's tokens per step are off its share by less than one of its
  documents; each step loses at most part of a pack.
- **pack each source, then interleave packs**: one best-fit plan per source, packs
  ordered by the same rule and cut into the same number of steps. Packing is as good
  as plain best fit, but a source's tokens per step are off by up to a whole pack.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import best_of, cpu, load  # noqa: E402

import fastpack  # noqa: E402
from fastpack import Mixture  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MAX_LEN = 4096


def sources(scale: float = 1.0, seed: int = 0) -> dict[str, np.ndarray]:
    """Four sources, 10^7 documents at scale 1: web (short, most documents), code,
    books (long, heavy tail, split at the cap) and math."""
    rng = np.random.default_rng(seed)
    n = {k: int(v * scale) for k, v in
         {"web": 5_000_000, "code": 2_500_000, "books": 500_000, "math": 2_000_000}.items()}
    return {
        "web": np.clip(rng.lognormal(6.0, 0.9, n["web"]), 1, None).astype(np.int32),
        "code": np.clip(rng.lognormal(6.6, 1.1, n["code"]), 1, None).astype(np.int32),
        "books": np.clip(rng.pareto(1.3, n["books"]) * 3000 + 500, 1, 100_000
                         ).astype(np.int32),
        "math": np.clip(rng.lognormal(5.5, 0.8, n["math"]), 1, None).astype(np.int32),
    }


MIX = {"web": {"weight": 5}, "code": {"weight": 2}, "books": {"epochs": 2.5},
       "math": {"epochs": 0.5}}


def per_step(source_of: np.ndarray, step_of: np.ndarray, tokens: np.ndarray, k: int,
             steps: int) -> np.ndarray:
    return np.bincount(source_of.astype(np.int64) * steps + step_of, weights=tokens,
                       minlength=k * steps).reshape(k, steps)


def deviations(table: np.ndarray, lengths: list[np.ndarray]) -> list[tuple[float, float, float]]:
    """Per source: max and mean |tokens - share| per step, and the max in units of the
    source's mean document (after splitting at the cap)."""
    steps = table.shape[1]
    out = []
    for i, row in enumerate(table):
        dev = np.abs(row - row.sum() / steps)
        mean_doc = float(np.minimum(lengths[i], MAX_LEN).mean())
        out.append((float(dev.max()), float(dev.mean()), float(dev.max()) / mean_doc))
    return out


def packs_then_interleave(planned: fastpack.MixedPlan, bases: np.ndarray, k: int):
    """The alternative: each source's copies packed on its own (the mixed plan's segments
    of that source: the same pieces), packs interleaved."""
    seg_src = np.searchsorted(bases, planned.plan.sample_ids, side="right") - 1
    fills, srcs = [], []
    clock = time.perf_counter()
    for s in range(k):
        mine = planned.plan.seqlens[seg_src == s]
        plan = fastpack.pack(mine, MAX_LEN, overlong="split", shuffle=True, seed=s)
        fills.append(plan.pack_fills.astype(np.int64))
        srcs.append(np.full(plan.num_packs, s))
    seconds = time.perf_counter() - clock
    steps = planned.num_steps
    step_of = []
    for s in range(k):
        before = np.cumsum(fills[s]) - fills[s]
        total = max(int(fills[s].sum()), 1)
        step_of.append(np.minimum(before * steps // total, steps - 1))
    table = per_step(np.concatenate(srcs), np.concatenate(step_of),
                     np.concatenate(fills), k, steps)
    packs = sum(len(f) for f in fills)
    return seconds, packs, table


def bench_plan(lines: list[str], scale: float = 1.0) -> None:
    src = sources(scale)
    names = list(src)
    lengths = [src[n] for n in names]
    everything = np.concatenate(lengths)
    n = len(everything)
    lines += [f"## Planning {n:,} documents from {len(names)} sources (lengths only)", ""]
    lines += ["Sources: " + ", ".join(
        f"{k} {len(v):,} documents, mean {v.mean():.0f} tokens, {int(v.sum(dtype=np.int64)):,} tokens"
        for k, v in src.items()) + f". Max len {MAX_LEN:,}, `overlong='split'`, `bfd`.", ""]
    weighted = [k for k, v in MIX.items() if "weight" in v]
    largest = max(weighted, key=lambda k: int(src[k].sum(dtype=np.int64)))
    lines += ["Mixture: " + ", ".join(f"{k} {next(iter(v))} {next(iter(v.values()))}"
                                      for k, v in MIX.items()) + f" ({largest} read once: "
              "the weighted source with the most tokens; the others scaled to their "
              "weights).", ""]
    load_before = load()
    t_bfd, plain = best_of(3, lambda: fastpack.pack(everything, MAX_LEN, overlong="split"))
    lines += ["| plan | time (s) | documents packed | packs | lower bound | packs over LB | efficiency |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    lines.append(f"| plain `bfd`, every document once | {t_bfd:.2f} | {n:,} | "
                 f"{plain.num_packs:,} | {plain.lower_bound:,} | "
                 f"{plain.num_packs - plain.lower_bound:,} | {plain.efficiency:.4%} |")
    bases = np.concatenate([[0], np.cumsum([len(a) for a in lengths])])
    results = {}
    for step in (1 << 19, 1 << 21, 1 << 23):
        mixture = Mixture(MIX, step_tokens=step)
        t_mix, planned = best_of(3, lambda m=mixture: fastpack.mix(lengths, m, MAX_LEN,
                                                                   overlong="split"))
        results[step] = planned
        p = planned.plan
        lines.append(f"| mix, steps of 2^{step.bit_length() - 1} tokens ({planned.num_steps:,} "
                     f"steps) | {t_mix:.2f} | {len(planned.lengths):,} copies | "
                     f"{p.num_packs:,} | {p.lower_bound:,} | {p.num_packs - p.lower_bound:,} | "
                     f"{p.efficiency:.4%} |")
    planned = results[1 << 21]
    t_one, one = best_of(3, lambda: fastpack.pack(planned.lengths, MAX_LEN, overlong="split"))
    lines.append(f"| plain `bfd` of the mix's copies, no steps | {t_one:.2f} | "
                 f"{len(planned.lengths):,} copies | {one.num_packs:,} | {one.lower_bound:,} | "
                 f"{one.num_packs - one.lower_bound:,} | {one.efficiency:.4%} |")
    lines += ["", "The realised mix (steps of 2^21 tokens):", "",
              "| source | asked | documents | output copies | repeated | left out | "
              "target share | realised share |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for s in planned.sources:
        asked = f"weight {s['weight']:g}" if "weight" in s else f"epochs {s['epochs']:g}"
        lines.append(f"| {s['name']} | {asked} | {s['documents']:,} | "
                     f"{s['output_documents']:,} | {s['repeated']:,} | {s['left_out']:,} | "
                     f"{s['target_share']:.4%} | {s['realised_share']:.4%} |")
    # Proportions per step: fastpack's (interleave, then pack) vs packs interleaved.
    seg_src = np.searchsorted(bases, planned.plan.sample_ids, side="right") - 1
    pack_step = np.repeat(np.arange(planned.num_steps), np.diff(planned.step_offsets))
    seg_step = np.repeat(pack_step, np.diff(planned.plan.pack_offsets))
    ours = per_step(seg_src, seg_step, planned.plan.seqlens.astype(np.int64), len(names),
                    planned.num_steps)
    t_alt, alt_packs, theirs = packs_then_interleave(planned, bases, len(names))
    lines += ["", f"Tokens of each source per step against its share ({planned.num_steps:,} "
              "steps of 2^21 tokens); `max / mean doc`: the worst step's gap in the source's "
              "mean documents (after splitting at the cap):", "",
              "| source | interleave, then pack: max gap | mean gap | max / mean doc | "
              "pack, then interleave packs: max gap | mean gap | max / mean doc |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for name, a, b in zip(names, deviations(ours, lengths), deviations(theirs, lengths)):
        lines.append(f"| {name} | {a[0]:,.0f} | {a[1]:,.0f} | {a[2]:.2f} | {b[0]:,.0f} | "
                     f"{b[1]:,.0f} | {b[2]:.2f} |")
    lb = planned.plan.lower_bound
    lines += ["", f"Packs: interleave-then-pack {planned.plan.num_packs:,}, pack-then-"
              f"interleave {alt_packs:,} ({t_alt:.2f} s), lower bound {lb:,}.", "",
              f"Load average before: {load_before}; after: {load()}.", ""]


def write_corpus(directory: Path, scale: float) -> dict[str, list[str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = sources(scale, seed=1)
    rng = np.random.default_rng(2)
    files: dict[str, list[str]] = {}
    for name, lengths in src.items():
        lengths = np.minimum(lengths, 3 * MAX_LEN)
        files[name] = []
        for part, chunk in enumerate(np.array_split(lengths, 2)):
            offsets = np.concatenate([[0], np.cumsum(chunk, dtype=np.int64)])
            values = rng.integers(0, 50_000, int(offsets[-1]), dtype=np.int32)
            column = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))
            path = directory / name / f"{part}.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.table({"input_ids": column}), path)
            files[name].append(str(path))
    return files


def run(*args: str) -> float:
    clock = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fastpack", *args, "-q", "--no-plot"], check=True,
                   capture_output=True, text=True)
    return time.perf_counter() - clock


def bench_command(lines: list[str], scale: float = 0.01) -> None:
    import json

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        root = Path(tmp)
        files = write_corpus(root / "data", scale)
        mix_file = root / "mix.yaml"
        mix_file.write_text("sources:\n" + "".join(
            f"  - {{name: {k}, paths: {json.dumps(files[k])}, {next(iter(v))}: "
            f"{next(iter(v.values()))}}}\n" for k, v in MIX.items()))
        common = ["--max-len", str(MAX_LEN), "--overlong", "split"]
        load_before = load()
        t_plain = run("pack", *[f for v in files.values() for f in v], "-o",
                      str(root / "plain"), *common)
        t_mix = run("pack", "--mix", str(mix_file), "-o", str(root / "mix"), *common)
        t_jobs = [run("pack", "--mix", str(mix_file), "-o", str(root / "jobs"), *common,
                      "--shard", f"{i}/3") for i in range(3)]
        clock = time.perf_counter()
        subprocess.run([sys.executable, "-m", "fastpack", "pack", "-o", str(root / "jobs"),
                        "--finalize", "-q", "--no-plot"], check=True, capture_output=True)
        t_final = time.perf_counter() - clock
        same = all((root / "mix" / p.name).read_bytes() == p.read_bytes()
                   for p in (root / "jobs").glob("shard-*"))
        plain = json.loads((root / "plain" / "report.json").read_text())
        mixed = json.loads((root / "mix" / "report.json").read_text())
    lines += [f"## The command end to end ({plain['documents']:,} documents in 8 parquet "
              f"files, {plain['input_tokens']:,} tokens)", "",
              "`fastpack pack` of every file once vs `fastpack pack --mix` (the mixture "
              "above, default steps of 2^21 tokens), and the mix written by 3 `--shard` jobs "
              "run one after another, then `--finalize`. Wall time of each process (start-up "
              "included).", "",
              "| run | wall (s) | documents | tokens | packs | efficiency |",
              "|---|---:|---:|---:|---:|---:|",
              f"| plain | {t_plain:.1f} | {plain['documents']:,} | {plain['packed_tokens']:,} "
              f"| {plain['packs']:,} | {plain['efficiency']:.4%} |",
              f"| `--mix` | {t_mix:.1f} | {mixed['documents']:,} | {mixed['packed_tokens']:,} "
              f"| {mixed['packs']:,} | {mixed['efficiency']:.4%} |",
              f"| `--mix`, 3 `--shard` jobs + `--finalize` | "
              f"{' + '.join(f'{t:.1f}' for t in t_jobs)} + {t_final:.1f} | | | | |", "",
              f"The 3 jobs' shards equal the single run's byte for byte: {same}. Each job "
              "reads every input's lengths and plans everything, then writes a third of the "
              "shards.", "", f"Load average before: {load_before}; after: {load()}.", ""]


def per_step_calls(lengths: np.ndarray, bounds: np.ndarray, opts, doc_order: np.ndarray,
                   start_order: np.ndarray, threads: int | None):
    """The planner before one core call packed every step: one ``_core.pack`` per step on
    a pool of threads, joined by ``combine_plans`` (the reference the speed table beats;
    its plans must be byte-identical)."""
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from fastpack import _core
    from fastpack._mix import _step_seeds
    from fastpack._offline.plan import combine_plans

    steps = len(bounds) - 1
    seeds = _step_seeds(opts.seed, steps).tolist()

    def one(k: int):
        fields = _core.pack(
            lengths[int(bounds[k]):int(bounds[k + 1])], opts.max_len, opts.strategy,
            opts.overlong, opts.reserve, seeds[k] if opts.shuffle else None, 1, None,
            opts.long_max_len, None, [])
        buckets = [SimpleNamespace(**b) for b in fields.pop("buckets", None) or ()]
        return SimpleNamespace(**{**fields, "buckets": buckets, "group_offsets": None,
                                  "long_max_len": opts.long_max_len,
                                  "num_segments": len(fields["seqlens"]),
                                  "num_packs": len(fields["pack_offsets"]) - 1})

    with ThreadPoolExecutor(min(threads or _core.default_threads(), steps)) as pool:
        plans = list(pool.map(one, range(steps), chunksize=64))
    maps = [doc_order[bounds[k]:bounds[k + 1]] for k in range(steps)]
    starts = [start_order[bounds[k]:bounds[k + 1]] for k in range(steps)]
    plan = combine_plans(plans, maps, opts, starts)
    return plan, np.concatenate([[0], np.cumsum([p.num_packs for p in plans])]).astype(np.int64)


def bench_speed(lines: list[str], scale: float = 1.0) -> None:
    """Planning time of one core call for every step against one call per step, in the
    same run, on the same documents; the two plans are checked byte for byte."""
    import fastpack._mix as mix_module

    src = sources(scale)
    lengths = list(src.values())
    n = sum(len(a) for a in lengths)
    lines += [f"## One core call for every step against one per step ({n:,} documents)", "",
              "The mixture and sources of the planning table, `overlong='split'`, `bfd`; best of 2 runs "
              "each; both plans compared array by array (identical).", "",
              "| max len | steps | one call per step (s) | one call (s) | speed-up |",
              "|---:|---|---:|---:|---:|"]
    load_before = load()
    new = mix_module._pack_steps
    for max_len, step in ((MAX_LEN, 1 << 19), (MAX_LEN, 1 << 21), (65536, 1 << 21),
                          (65536, 1 << 23)):
        mixture = Mixture(MIX, step_tokens=step)
        def run(m: Mixture = mixture, cap: int = max_len):
            return fastpack.mix(lengths, m, cap, overlong="split")

        t_new, a = best_of(2, run)
        mix_module._pack_steps = per_step_calls
        try:
            t_old, b = best_of(2, run)
        finally:
            mix_module._pack_steps = new
        for name in ("sample_ids", "starts", "seqlens", "pack_offsets"):
            assert np.array_equal(getattr(a.plan, name), getattr(b.plan, name)), name
        assert np.array_equal(a.step_offsets, b.step_offsets)
        lines.append(f"| {max_len:,} | 2^{step.bit_length() - 1} tokens ({a.num_steps:,}) | "
                     f"{t_old:.2f} | {t_new:.2f} | {t_old / t_new:.1f}x |")
    lines += ["", f"Load average before: {load_before}; after: {load()}.", ""]


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    lines = ["# Mixtures by tokens: planning time, efficiency and proportions per step", "",
             f"{cpu()}, Python {sys.version.split()[0]}, numpy {np.__version__}; "
             f"`python benches/bench_mix.py {what}`. Planning times are the best of 3 runs "
             "(all cores: 2, shared with other jobs; see the load).", ""]
    if what in ("plan", "all"):
        bench_plan(lines, float(os.environ.get("BENCH_SCALE", "1")))
    if what in ("speed", "all"):
        bench_speed(lines, float(os.environ.get("BENCH_SCALE", "1")))
    if what in ("command", "all"):
        bench_command(lines, float(os.environ.get("BENCH_COMMAND_SCALE", "0.01")))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "mix.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
