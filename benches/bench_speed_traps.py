"""The speed traps of issue 24 (item 11), this build against another in the same run.

Each measurement runs in its own process per build (``--baseline DIR``: a folder holding
the other build's ``fastpack`` package, say main's ``python/``), the builds alternating
round by round, so both see the same load; medians over rounds.

1. **CP "sdpa" kernel, one layer** (``attend_gathered``: the local step of zigzag and
   contiguous context parallelism once K/V are gathered; forward + backward, fp32, 8 query
   heads, 2 key/value heads, dim 64, one thread): rank 1 of cp = 4 on a 16,384-token row of
   many short sequences (512 of 32 tokens) and on the row of the CP benchmark (one 12,288-
   token document and shorter ones). Keys are built in the layout, no process group.
2. **Tree batches**: G rollouts of a P-token prompt; the rows of K/V the "flash" kernel
   gathers (``TreeLayout.gathered``: every segment's path, ≈ G·P) against the row's, and
   the time to build that index (once per batch).
3. **Collate** (``PackedCollator(backend="flash")`` on 64 SFT-like samples, lists and
   numpy), against the list -> array floor (``np.asarray`` of every row and one
   ``np.concatenate``, for ``input_ids`` and ``labels``) and transformers'
   ``DataCollatorWithFlattening``.
4. **First ``pack()`` of a process** (a fresh interpreter, ``import fastpack`` excluded).

    python benches/bench_speed_traps.py --baseline /path/to/main/python [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parent / "python"


# ------------------------------------------------------------------ measurements


def _median_time(fn: Any, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_cp(reps: int) -> dict[str, float]:
    import numpy as np
    import torch

    from fastpack.torch import shard_for_context_parallel
    from fastpack.torch.context_parallel import attend_gathered

    torch.set_num_threads(1)
    rows = {"512 x 32 tokens": (32,) * 512,
            "2,048 + 96 of 16..512": (2_048, *np.random.default_rng(0).integers(16, 513, 96))}
    out = {}
    for name, lengths in rows.items():
        cu = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
        batch = {"input_ids": torch.zeros(1, int(cu[-1]), dtype=torch.long),
                 "cu_seq_lens_q": torch.from_numpy(cu)}
        for mode in ("zigzag", "contiguous"):
            shards = [shard_for_context_parallel(batch, 4, r, mode) for r in range(4)]
            g = torch.Generator().manual_seed(0)
            kv = [(torch.randn(s["input_ids"].shape[1], 2, 64, generator=g),
                   torch.randn(s["input_ids"].shape[1], 2, 64, generator=g)) for s in shards]
            keys = torch.cat([k for k, _ in kv]).requires_grad_()
            values = torch.cat([v for _, v in kv]).requires_grad_()
            local = shards[1]
            q = torch.randn(local["input_ids"].shape[1], 8, 64, generator=g,
                            requires_grad=True)

            def step(local: Any = local, q: Any = q, keys: Any = keys,
                     values: Any = values) -> None:
                attend_gathered(q, keys, values, local, "sdpa", None, None, None).sum().backward()

            out[f"cp {mode}, {name}"] = _median_time(step, reps)
    return out


def measure_tree() -> dict[str, float]:
    import torch

    from fastpack.torch import PackedCollator
    from fastpack.torch.tree import check_tree

    out = {}
    for group, prompt, response in ((16, 1024, 64), (64, 2048, 256)):
        samples = [{"input_ids": list(range(1, prompt + 1)) + [prompt + 1 + g] * response,
                    "prompt_id": 0} for g in range(group)]
        batch = PackedCollator(prompt + group * response, backend="flash",
                               share_prefix=True)(samples)
        total = batch["input_ids"].shape[1]
        times = []
        for _ in range(7):  # a fresh layout each time: the index is cached on it
            layout = check_tree(batch["tree_cu_seqlens"], batch["tree_parents"], total)
            t0 = time.perf_counter()
            index = layout.gathered(torch.device("cpu"))[0]
            times.append(time.perf_counter() - t0)
        name = f"tree G={group} P={prompt} R={response}"
        out[f"{name}: gather index (once per batch)"] = statistics.median(times)
        out[f"{name}: row tokens"] = float(total)
        out[f"{name}: flash K/V rows"] = float(len(index))
    return out


def measure_collate(reps: int) -> dict[str, float]:
    import numpy as np
    from transformers import DataCollatorWithFlattening

    from fastpack.torch import PackedCollator

    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.4, 0.8, 64).astype(int), 1, 4096)
    ids = [rng.integers(0, 32000, n) for n in lengths]
    ours = PackedCollator(max_len=4096, backend="flash", threads=1)
    hf = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)
    out = {"collate tokens": float(lengths.sum())}
    for kind in ("list", "numpy"):
        batch = [({"input_ids": a.tolist(), "labels": a.tolist()} if kind == "list"
                  else {"input_ids": a, "labels": a.copy()}) for a in ids]
        out[f"collate {kind}: fastpack"] = _median_time(lambda b=batch: ours(b), reps * 20)
        out[f"collate {kind}: transformers"] = _median_time(lambda b=batch: hf(b), reps * 4)
        if kind == "list":
            out["collate list: floor"] = _median_time(lambda b=batch: [np.concatenate(
                [np.asarray(f[k]) for f in b]) for k in ("input_ids", "labels")], reps * 20)
    return out


def measure_first_pack() -> dict[str, float]:
    code = ("import time, fastpack; t = time.perf_counter(); fastpack.pack([3, 4, 5], 8); "
            "print(time.perf_counter() - t)")
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    times = [float(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                  text=True, check=True).stdout) for _ in range(3)]
    return {"first pack()": statistics.median(times)}


def measure(reps: int) -> dict[str, float]:
    out: dict[str, float] = {}
    out.update(measure_first_pack())
    out.update(measure_collate(reps))
    out.update(measure_cp(reps))
    out.update(measure_tree())
    return out


# ---------------------------------------------------------------------- driver


def run(folder: Path, reps: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(folder)}
    done = subprocess.run([sys.executable, __file__, "--child", str(reps)], env=env,
                          capture_output=True, text=True, check=True)
    result: dict[str, float] = json.loads(done.stdout.splitlines()[-1])
    return result


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="folder holding the other build's "
                    "fastpack package (e.g. main's python/)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(HERE / "results" / "speed_traps.md"))
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    load_start = os.getloadavg()
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for _ in range(a.rounds):
        runs["before"].append(run(Path(a.baseline), a.reps))
        runs["after"].append(run(SOURCE, a.reps))
    load_end = os.getloadavg()
    med = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
           for side, rs in runs.items()}
    before, after = med["before"], med["after"]

    def ms(x: float) -> str:
        return f"{x * 1e3:.3f} ms"

    lines = [
        "# Speed traps (issue 24, item 11): before and after, same run",
        "",
        f"`python benches/bench_speed_traps.py --baseline <main>/python` on {cpu_name()}, "
        f"{os.cpu_count()} cores (shared), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"load average at start {load_start[0]:.1f}, at end {load_end[0]:.1f}. Medians of "
        f"{a.rounds} rounds, the builds alternating (each round a fresh process per build, "
        f"each figure inside it a median of its repetitions).",
        "",
        "| measurement | before | after | speed-up |",
        "|---|---:|---:|---:|",
    ]
    for key in before:
        if key.endswith(("row tokens", "K/V rows")) or key == "collate tokens":
            continue
        lines.append(f"| {key} | {ms(before[key])} | {ms(after[key])} | "
                     f"{before[key] / after[key]:.2f}x |")
    lines += [
        "",
        "Collate, after: fastpack "
        f"{after['collate list: fastpack'] / after['collate list: floor']:.2f}x the list -> "
        f"array floor ({ms(after['collate list: floor'])} for input_ids and labels of "
        f"{after['collate tokens']:,.0f} tokens); transformers' DataCollatorWithFlattening "
        f"takes {after['collate list: transformers'] / after['collate list: fastpack']:.1f}x "
        f"fastpack's time on lists, "
        f"{after['collate numpy: transformers'] / after['collate numpy: fastpack']:.1f}x on "
        f"numpy samples (before: "
        f"{before['collate list: transformers'] / before['collate list: fastpack']:.1f}x / "
        f"{before['collate numpy: transformers'] / before['collate numpy: fastpack']:.1f}x).",
        "",
        "Tree batches: the rows of K/V the \"flash\" kernel gathers (every segment's path) "
        "against the row's tokens:",
        "",
        "| tree | row tokens | gathered K/V rows | ratio |",
        "|---|---:|---:|---:|",
    ]
    for key in after:
        if key.endswith("row tokens"):
            name = key[: -len(": row tokens")]
            rows = after[f"{name}: flash K/V rows"]
            lines.append(f"| {name} | {after[key]:,.0f} | {rows:,.0f} | "
                         f"{rows / after[key]:.1f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(a.out).write_text(text)


if __name__ == "__main__":
    if "--child" in sys.argv:
        reps = int(sys.argv[sys.argv.index("--child") + 1])
        print(json.dumps(measure(reps)))
    else:
        main()
