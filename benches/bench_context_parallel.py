"""Context parallelism: the layout's cost against the floor of writing its arrays, and the
CP attention's per-rank work and CPU time against one process.

What runs (``python benches/bench_context_parallel.py``; results in
``benches/results/context_parallel.md``):

1. **One 131,072-token pack of 10^3 sequences** (SFT-like lengths scaled to fill it): the
   whole layout for every rank — ``fastpack.cp_layout`` plus each rank's indices,
   positions and sources and its runs and keys — at cp = 2, 4, 8 in every mode. Beside it,
   in the same run: the floor, one ``np.copyto`` of an int64 array as large as the bytes
   the layout writes; zigzag indices computed the way a user would without fastpack (a
   vectorised numpy version of TransformerEngine's ``thd_get_partitioned_indices``
   contract, and a per-sequence torch loop like ``get_batch_on_this_cp_rank``'s, both
   written here from the contract: TE's own needs CUDA).
2. **A plan of 10^7 sequences** (SFT-like, ``max_len`` 4096): every pack's padded length
   and every CP rank's attention work (``_core.cp_streams``, what ``Plan.pad_tokens`` and
   the sampler's CP cost read), against the floor of copying the arrays it writes (one
   ``np.copy`` of each: the layout's outputs are new arrays) and that of copying the
   arrays it reads and writes (it reads far more than it writes); and
   ``fastpack.pack(..., cp_size=...)`` against the plain plan. Beside the medians, the best
   run of each and their ratio: on shared cores a few-millisecond call is often preempted.
   ``--baseline DIR`` times another build's ``cp_streams`` and ``pack(cp_size)`` in the same
   run (``DIR`` holds its ``fastpack`` package).
3. **The CP attention** (``context_parallel_attention``, forward + backward, fp32, 8 query
   heads, 2 key/value heads, head dim 64) over one 16,384-token row (a 12,288-token
   document and shorter ones) on a gloo world of cp = 1, 2, 4 CPU processes: each rank's
   share of the attention work (from the layout) and its CPU time (``time.process_time``:
   with more processes than cores, wall time would measure the sharing, not the split).
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

import fastpack
from fastpack import _core

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _machine import load  # noqa: E402
from bench_scale import gen_lengths  # noqa: E402

MODES = fastpack.CP_MODES


#: The fastest run of the last timing (beside its median): on 2 shared cores a run of a
#: few milliseconds is often preempted for a scheduler slice (~5 ms) mid-call.
BEST: list[float] = [0.0]


def median_time(fn: Callable[[], Any], reps: int, budget: float = 10.0) -> float:
    fn()  # warm
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < reps and (len(times) < 3 or time.perf_counter() - start < budget):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    BEST[0] = min(times)
    return float(np.median(times))


def one_pack_lengths(seed: int = 0) -> np.ndarray:
    """10^3 SFT-like lengths scaled so they hold 131,072 tokens."""
    raw = gen_lengths("sft", 1000, seed).astype(np.float64)
    lengths = np.maximum(1, np.floor(raw * 131_072 / raw.sum())).astype(np.int64)
    lengths[-1] += 131_072 - lengths.sum()
    return lengths


def core_all_ranks(cu: np.ndarray, cp: int, mode: str) -> list[int]:
    """The core's layout for every rank (one thread, as ``CPLayout`` runs rows this small);
    returns the size of every array it wrote, in order."""
    sizes = [_core.cp_stream(cu, cp, mode, 1)[0].nbytes]
    for r in range(cp):
        sizes += [a.nbytes for a in _core.cp_rank_tokens(cu, cp, mode, 1, r, 1)]
        d = _core.cp_rank_attention(cu, cp, mode, 1, r, 1)
        sizes += [d[k].nbytes for k in ("cu_seqlens_q", "cu_seqlens_k", "k_index")
                  if d[k] is not None]
    return sizes


def copy_like(sources: list[np.ndarray]) -> None:
    """The floor of writing arrays of these sizes: one copy of each into a new array, made
    and freed in the layout's order (the same allocator traffic as the layout's)."""
    for a in sources:
        np.copy(a)


def python_all_ranks(cu: np.ndarray, cp: int, mode: str) -> None:
    """The same through the Python API, a fresh ``cp_layout`` and each rank's arrays."""
    layout = fastpack.cp_layout(cu, cp, mode=mode)
    for r in range(cp):
        layout.indices(r)
        layout.local(r)


def numpy_zigzag(padded: np.ndarray, cp: int) -> list[np.ndarray]:
    """TE's partition (ranks r and 2cp-1-r of every padded sequence), vectorised in numpy."""
    lengths = np.diff(padded)
    chunk = lengths // (2 * cp)
    out = []
    for r in range(cp):
        starts = np.stack([padded[:-1] + r * chunk, padded[:-1] + (2 * cp - 1 - r) * chunk], 1)
        sizes = np.repeat(chunk, 2)
        offsets = np.repeat(starts.reshape(-1) - np.concatenate(([0], np.cumsum(sizes)[:-1])),
                            sizes)
        out.append(np.arange(int(sizes.sum())) + offsets)
    return out


def torch_zigzag(padded: torch.Tensor, cp: int) -> list[torch.Tensor]:
    """The same, one ``arange`` per chunk as a per-sequence Python loop does."""
    chunk = (padded[1:] - padded[:-1]) // (2 * cp)
    out = []
    for r in range(cp):
        pieces = []
        for c, s in zip(chunk.tolist(), padded[:-1].tolist()):
            pieces.append(torch.arange(s + r * c, s + (r + 1) * c))
            pieces.append(torch.arange(s + (2 * cp - 1 - r) * c, s + (2 * cp - r) * c))
        out.append(torch.cat(pieces))
    return out


def bench_one_pack(reps: int) -> list[str]:
    lengths = one_pack_lengths()
    cu = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    for _ in range(20):  # caches settle before the first row is timed
        core_all_ranks(cu, 2, "zigzag")
        python_all_ranks(cu, 2, "zigzag")
    rows = ["| cp | mode | pad tokens | bytes written | fastpack core | floor (copy) | ratio | "
            "best of each: ratio | fastpack Python API | numpy (vectorised) | "
            "torch (per-sequence loop) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for cp in (2, 4, 8):
        for mode in MODES:
            layout = fastpack.cp_layout(cu, cp, mode=mode)
            sizes = core_all_ranks(cu, cp, mode)
            nbytes = sum(sizes)
            t = median_time(partial(core_all_ranks, cu, cp, mode), reps)
            t_best = BEST[0]
            api = median_time(partial(python_all_ranks, cu, cp, mode), reps)
            sources = [np.ones(max(n // 8, 1), dtype=np.int64) for n in sizes]
            floor = median_time(partial(copy_like, sources), reps)
            floor_best = BEST[0]
            peers = ["", ""]
            if mode == "zigzag":
                padded = layout.cu_seqlens_padded.astype(np.int64)
                want = [layout.indices(r) for r in range(cp)]
                got = numpy_zigzag(padded, cp)
                assert all(np.array_equal(a, b) for a, b in zip(want, got))
                peers[0] = f"{median_time(partial(numpy_zigzag, padded, cp), reps) * 1e3:.2f} ms"
                pt = torch.from_numpy(padded)
                peers[1] = f"{median_time(partial(torch_zigzag, pt, cp), reps) * 1e3:.2f} ms"
            rows.append(f"| {cp} | {mode} | {layout.pad_tokens:,} | {nbytes / 2**20:.2f} MiB | "
                        f"{t * 1e3:.3f} ms | {floor * 1e3:.3f} ms | {t / floor:.2f}x | "
                        f"{t_best * 1e3:.3f} / {floor_best * 1e3:.3f} ms: "
                        f"{t_best / floor_best:.2f}x | "
                        f"{api * 1e3:.3f} ms | {peers[0]} | {peers[1]} |")
    return rows


def baseline_core(folder: str) -> Any:
    """The ``_core`` of another fastpack build (``folder`` holds its ``fastpack`` package),
    loaded beside this one: the same calls timed in the same run."""
    import importlib.util

    path = next(Path(folder, "fastpack").glob("_core*.so"))
    spec = importlib.util.spec_from_file_location("baseline._core", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def baseline_pack(folder: str, n: int, cp: int, mode: str, reps: int) -> float:
    """Median seconds of ``pack(..., cp_size=cp)`` by the build in ``folder`` (its own
    process: the Python side differs too)."""
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); "
            "from bench_context_parallel import median_time; import fastpack; "
            f"from bench_scale import gen_lengths; x = gen_lengths('sft', {n}, 0); "
            f"print(median_time(lambda: fastpack.pack(x, 4096, cp_size={cp}, "
            f"cp_mode={mode!r}), {reps}))")
    env = dict(os.environ, PYTHONPATH=folder)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True)
    return float(out.stdout.split()[-1])


def bench_plan(n: int, reps: int, baseline: str | None = None) -> list[str]:
    lengths = gen_lengths("sft", n, 0)
    plan = fastpack.pack(lengths, 4096)
    old = baseline_core(baseline) if baseline else None
    rows = ["| cp | mode | segments | packs | pad tokens | bytes read / written | fastpack | "
            "floor: copy of the bytes written | ratio | best of each: ratio | "
            "copy of the bytes read and written | ratio | pack(cp_size) | pack() |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    if old is not None:
        rows[0] += " baseline cp_streams | baseline pack(cp_size) |"
        rows[1] += "---|---|"
    plain = median_time(lambda: fastpack.pack(lengths, 4096), max(3, reps // 2))
    inputs = [plan.seqlens, plan.pack_offsets]
    for cp in (2, 8):
        for mode in ("zigzag", "contiguous"):
            run = partial(_core.cp_streams, plan.seqlens, plan.pack_offsets, cp, mode, 1)
            out = [a for a in run() if a is not None]
            nbytes = sum(a.nbytes for a in out)
            nread = sum(a.nbytes for a in inputs)
            t = median_time(run, reps)
            t_best = BEST[0]
            floor = median_time(partial(copy_like, [np.ones(a.size, a.dtype) for a in out]),
                                reps)
            floor_best = BEST[0]
            floor_rw = median_time(partial(copy_like, inputs + out), reps)
            cp_plan = fastpack.pack(lengths, 4096, cp_size=cp, cp_mode=mode)
            t_pack = median_time(partial(fastpack.pack, lengths, 4096, cp_size=cp, cp_mode=mode),
                                 max(3, reps // 2))
            row = (f"| {cp} | {mode} | {plan.num_segments:,} | {plan.num_packs:,} | "
                   f"{cp_plan.pad_tokens:,} | {nread / 2**20:.1f} / {nbytes / 2**20:.1f} MiB | "
                   f"{t * 1e3:.1f} ms | {floor * 1e3:.1f} ms | {t / floor:.2f}x | "
                   f"{t_best / floor_best:.2f}x | {floor_rw * 1e3:.1f} ms | "
                   f"{t / floor_rw:.2f}x | {t_pack:.2f} s ({cp_plan.num_packs:,} packs) | "
                   f"{plain:.2f} s |")
            if old is not None and baseline is not None:
                t_old = median_time(partial(old.cp_streams, plan.seqlens, plan.pack_offsets,
                                            cp, mode, 1), reps)
                t_old_pack = baseline_pack(baseline, n, cp, mode, max(3, reps // 2))
                row += f" {t_old * 1e3:.1f} ms | {t_old_pack:.2f} s |"
            rows.append(row)
    return rows


# ------------------------------------------------------------------ attention world

ROW = (12_288, 2_048, 1_024, 517, 311, 117, 77, 7, 1, 2)  # 16,384 tokens


def _rank(rank: int, size: int, port: int, folder: str, mode: str) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    from fastpack.torch import context_parallel_attention, shard_for_context_parallel

    if size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=size)
    group = dist.group.WORLD if size > 1 else None
    cu = np.concatenate(([0], np.cumsum(ROW))).astype(np.int32)
    batch = {"input_ids": torch.zeros(1, int(cu[-1]), dtype=torch.long),
             "cu_seq_lens_q": torch.from_numpy(cu)}
    local = shard_for_context_parallel(batch, size, rank, mode)
    n = local["input_ids"].shape[1]
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(n, 8, 64, generator=g, requires_grad=True)
    k = torch.randn(n, 2, 64, generator=g, requires_grad=True)
    v = torch.randn(n, 2, 64, generator=g, requires_grad=True)
    times = []
    for _ in range(3):
        if size > 1:
            dist.barrier()
        c0, w0 = time.process_time(), time.perf_counter()
        result = context_parallel_attention(q, k, v, local, group)
        result.sum().backward()
        times.append((time.process_time() - c0, time.perf_counter() - w0))
    cpu, wall = (float(np.median([t[i] for t in times])) for i in (0, 1))
    Path(folder, f"{rank}.txt").write_text(f"{cpu} {wall}")
    if size > 1:
        dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bench_attention() -> list[str]:
    cu = np.concatenate(([0], np.cumsum(ROW))).astype(np.int32)
    rows = ["| cp | mode | work per rank (share of the row's) | max / mean | CPU s per rank "
            "(fwd+bwd, median of 3) | busiest rank vs cp=1 |", "|---|---|---|---|---|---|"]
    base = None
    for cp in (1, 2, 4):
        for mode in (MODES if cp > 1 else ("zigzag",)):
            layout = fastpack.cp_layout(cu, cp, mode=mode)
            share = layout.work / layout.work.sum()
            out = tempfile.mkdtemp()
            torch.multiprocessing.spawn(_rank, args=(cp, _port(), out, mode), nprocs=cp,
                                        join=True)
            cpu = [float(Path(out, f"{r}.txt").read_text().split()[0]) for r in range(cp)]
            if base is None:
                base = max(cpu)
            rows.append(f"| {cp} | {mode if cp > 1 else '(one process)'} | "
                        f"{' / '.join(f'{s:.3f}' for s in share)} | {layout.imbalance():.3f} | "
                        f"{' / '.join(f'{c:.2f}' for c in cpu)} | {max(cpu) / base:.2f}x |")
    return rows


def environment() -> str:
    model = "unknown CPU"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return (f"{model}, {os.cpu_count()} cores, {platform.system()}, fastpack "
            f"{fastpack.__version__}, torch {torch.__version__}, numpy {np.__version__}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan-size", type=float, default=1e7)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=str(HERE / "results" / "context_parallel.md"))
    ap.add_argument("--skip-attention", action="store_true")
    ap.add_argument("--baseline", help="a folder holding another fastpack build (its "
                    "``fastpack`` package), timed beside this one on the plan")
    a = ap.parse_args()
    head = (f"`python benches/bench_context_parallel.py` on {environment()}, "
            f"{time.strftime('%Y-%m-%d')}; load average (1, 5, 15 min) at start {load()}")
    one = bench_one_pack(a.reps)
    plan = bench_plan(int(a.plan_size), a.reps, a.baseline)
    attention = [] if a.skip_attention else bench_attention()
    text = [
        "# Context parallelism", "", head + f", at end {load()} (the machine is shared: "
        "times are medians of wall clock, ratios are from one run).", "",
        "## The layout of one 131,072-token pack of 10^3 sequences, every rank", "",
        "fastpack core: every rank's indices, positions, sources, runs and keys (what "
        "`shard_for_context_parallel` and the attention read), one `_core` call per array "
        "set and rank, one thread. Floor: one copy of each array it writes into a new array "
        "(`np.copy`, in the same order: the same allocator traffic). Python API: `cp_layout` and each rank's `indices` and `local` (the "
        "same arrays, through the wrappers). Peers compute zigzag indices only (one of the "
        "arrays).", "",
        *one, "",
        f"## A plan of {int(a.plan_size):,} sequences (SFT-like, max_len 4096)", "",
        "`_core.cp_streams`: every pack's padded tokens and every CP rank's attention work "
        "(one pass, rayon). Floors: one copy of each array it writes into a new array, and "
        "one copy of each array it reads (the plan's `seqlens` and `pack_offsets`) and "
        "writes. `pack(cp_size)`: the whole CP-aware plan (padded lengths planned, real "
        "ones mapped back), beside the plain plan."
        + (f" Baseline: the same calls by the build in `{a.baseline}`, same run."
           if a.baseline else ""), "",
        *plan, "",
    ]
    if attention:
        text += [
            "## The CP attention: work and CPU time per rank", "",
            f"One 16,384-token row ({', '.join(map(str, ROW))} tokens), "
            "`context_parallel_attention` forward + backward on the CPU (per-run SDPA), "
            "fp32, 8 query heads, 2 key/value heads, dim 64. Work = the (query, key) pairs "
            "a rank's real queries attend to (`CPLayout.work`); zigzag's every rank gets "
            "1/cp of it, contiguous's last ranks the long document's end, Ulysses 1/cp of "
            "the heads of every pair. CPU time per rank is the process's own "
            "(`time.process_time`, waiting excluded); cp > cores here, so wall time is not "
            "shown.", "", *attention, "",
        ]
    Path(a.out).write_text("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
