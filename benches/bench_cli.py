"""Benchmarks of the offline command: sharded plans against one global plan, a plan over
10^9 lengths in shards, and ``fastpack pack`` on one machine vs on Ray Data (1 and 2
workers). Writes benches/results/cli.md.

    python benches/bench_cli.py sharded          # extra packs of sharded plans (10^7, 10^8)
    python benches/bench_cli.py billion          # 10^9 lengths, planned in 10 shards
    python benches/bench_cli.py ray              # files -> shards, local vs Ray, 10^5..10^7
    python benches/bench_cli.py all
    python benches/bench_cli.py compare BASELINE # `fastpack pack` of this tree vs another

``compare`` runs the command of this tree and of BASELINE (a ``python/`` folder of another
fastpack, e.g. ``git archive main python`` unpacked with this tree's built ``_core`` copied
in) on the same corpora, alternately, in one run: local and ``--ray``, 10^5 and 10^6
documents (``BENCH_SIZES=100000,1000000``, ``BENCH_PATHS=local,ray``), ``BENCH_REPEATS``
runs each (3).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _machine import cpu, load

RESULTS = Path(__file__).resolve().parent / "results"


def sft(n: int, seed: int) -> np.ndarray:
    """SFT-like: log-normal, mean about 300 tokens."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(5.2, 0.9, n), 1, 4096).astype(np.int32)


def pretrain(n: int, seed: int) -> np.ndarray:
    """Pre-training-like: heavy tail, mean about 1,500 tokens (split at the cap)."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.pareto(1.3, n) * 400 + 50, 1, 200_000).astype(np.int32)


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


# ---------------------------------------------------------------------------------------


def _sharded_packs(lengths: np.ndarray, k: int, config: object) -> int:
    """Packs of the sharded plan (``sharded_plan`` without laying the plans end to end,
    which only costs memory here)."""
    from fastpack._offline.plan import plan_shard, shard_of

    shards = shard_of(np.arange(len(lengths), dtype=np.int64), k)
    order = np.argsort(shards, kind="stable")
    bounds = np.searchsorted(shards[order], np.arange(k + 1))
    del shards
    packs = 0
    for s in range(k):
        packs += plan_shard(lengths[order[bounds[s]:bounds[s + 1]]], s, config).num_packs
    return packs


def bench_sharded() -> list[str]:
    import fastpack

    lines = ["## Sharded plans: extra packs over one global plan", "",
             "Each document goes to plan shard `hash(key) % K`; each shard is packed on its "
             "own (best-fit decreasing) and the plans are laid end to end "
             "(`fastpack._offline.plan.sharded_plan`, what `--plan-shards K` and "
             "`fastpack.ray.pack_dataset(plan_shards=K)` compute). Max len 4,096.", "",
             "| data | N | K | docs per shard | global packs | sharded packs | extra packs | "
             "extra / global | lower bound |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, make, overlong in (("SFT-like", sft, "error"),
                                 ("pretraining-like", pretrain, "split")):
        for n in (10**7, 10**8):
            lengths = make(n, 0)
            config = fastpack.PackOptions(4096, overlong=overlong, shuffle=False)
            one = fastpack.pack(lengths, options=config)
            global_packs, lb = one.num_packs, one.lower_bound
            del one
            for k in (2, 10, 100):
                if n // k < 10**5:
                    continue
                packs = _sharded_packs(lengths, k, config)
                extra = packs - global_packs
                lines.append(f"| {name} | {n:.0e} | {k} | {n // k:,} | {global_packs:,} | "
                             f"{packs:,} | {extra:,} | {extra / global_packs:.5%} | "
                             f"{lb:,} |")
                print(lines[-1], flush=True)
            del lengths
    return lines


def bench_billion() -> list[str]:
    """10^9 lengths planned in 10 shards of 10^8, one at a time (what 10 workers do in
    parallel); lengths are generated per shard, outside the timing."""
    import fastpack
    from fastpack._offline.plan import plan_shard

    lines = ["## A plan over 10^9 lengths, in shards", "",
             "10 plan shards of 10^8 lengths each, planned one after another in one process "
             "(on a cluster: one planner per shard, in parallel). Time = planning only "
             "(`plan_shard`, all cores); memory = peak RSS of the process over the run "
             "(one shard's lengths and plan at a time). One global plan of 10^9 segments "
             "would need about 20 GB (24 bytes per segment + its sort), more than this "
             "machine has free.", "",
             "| data | shards | lengths | total time | per shard (median) | packs | "
             "lower bound | packs / LB | peak RSS |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, make, overlong in (("SFT-like", sft, "error"),
                                 ("pretraining-like", pretrain, "split")):
        config = fastpack.PackOptions(4096, overlong=overlong, shuffle=False)
        reset_peak()
        times, packs, tokens = [], 0, 0
        for s in range(10):
            lengths = make(10**8, 100 + s)
            start = time.perf_counter()
            plan = plan_shard(lengths, s, config)
            times.append(time.perf_counter() - start)
            packs += plan.num_packs
            tokens += plan.total_tokens
            del plan, lengths
            print(f"  {name} shard {s}: {times[-1]:.2f} s", flush=True)
        lb = -(-tokens // 4096)
        lines.append(f"| {name} | 10 | 1e9 | {sum(times):.1f} s | {np.median(times):.2f} s | "
                     f"{packs:,} | {lb:,} | {packs / lb:.6f} | {peak_rss() / 2**30:.2f} GiB |")
        print(lines[-1], flush=True)
    return lines


# ---------------------------------------------------------------------------------------


def _corpus(directory: Path, n: int, files: int) -> int:
    """``n`` short documents (log-normal, mean about 32 tokens) in ``files`` parquet files;
    returns the tokens."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(n)
    total = 0
    per = -(-n // files)
    for f in range(files):
        lengths = np.clip(rng.lognormal(3.2, 0.7, min(per, n - f * per)), 1, 1024).astype(
            np.int32)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        values = rng.integers(0, 50_000, int(offsets[-1]), dtype=np.int32)
        pq.write_table(pa.table({"input_ids": pa.ListArray.from_arrays(
            pa.array(offsets), pa.array(values))}), directory / f"part-{f:03d}.parquet",
            row_group_size=50_000)
        total += int(offsets[-1])
    return total


_RAY_RUN = """
import json, sys, time, logging
import ray
workers = int(sys.argv[1])
ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False,
         logging_level=logging.WARNING)
ray.data.DataContext.get_current().enable_progress_bars = False
from fastpack._offline.settings import PackSettings
from fastpack.ray import pack_files
settings = PackSettings(max_len=1024, shuffle=True, seed=0)
start = time.perf_counter()
report = pack_files([sys.argv[2]], sys.argv[3], settings, quiet=True, plot=False)
print(json.dumps({"seconds": time.perf_counter() - start, "phases": report["run"]["seconds"],
                  "packs": report["packs"]}))
"""

_LOCAL_RUN = """
import json, sys, time
from fastpack._offline.driver import pack_corpus
from fastpack._offline.settings import PackSettings
settings = PackSettings(max_len=1024, shuffle=True, seed=0)
start = time.perf_counter()
report = pack_corpus([sys.argv[1]], sys.argv[2], settings, quiet=True, plot=False)
print(json.dumps({"seconds": time.perf_counter() - start, "phases": report["run"]["seconds"],
                  "packs": report["packs"]}))
"""


def _same_shards(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.glob("shard-*"))
    return names == sorted(p.name for p in b.glob("shard-*")) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names)


def _same_rows(a: Path, b: Path) -> str | None:
    """``"bytes"`` when the shards are byte-identical, ``"rows"`` when only their types
    differ (the same values in every column and row: a baseline that wrote another
    dtype), else None."""
    if _same_shards(a, b):
        return "bytes"
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = sorted(p.name for p in a.glob("shard-*"))
    if names != sorted(p.name for p in b.glob("shard-*")):
        return None
    for n in names:
        x, y = pq.read_table(a / n), pq.read_table(b / n)
        if x.column_names != y.column_names:
            return None
        for c in x.column_names:
            wide = pa.list_(pa.int64())
            u, v = x.column(c), y.column(c)
            if pa.types.is_integer(u.type.value_type) and pa.types.is_integer(v.type.value_type):
                u, v = u.cast(wide), v.cast(wide)
            if not u.equals(v):
                return None
    return "rows"


def bench_ray(sizes: tuple[int, ...] = (10**5, 10**6, 10**7)) -> list[str]:
    lines = ["## `fastpack pack` on one machine and on Ray Data", "",
             "Parquet files of short documents (log-normal, mean 31 tokens, random int32 "
             "ids), `--max-len 1024 --shuffle`, one fresh process per run. Ray: a local "
             "cluster of 1 or 2 CPUs (`ray.init(num_cpus=W)`) on the same 2-core machine; "
             "its time includes the lengths pass, the planners, the route + groupby shuffle "
             "and the gather + parquet write on the workers, not `ray.init`. Every Ray run's "
             "shards are checked byte-identical to the single-machine run's.", "",
             "| documents | tokens | files | single machine | Ray, 1 worker | Ray, 2 workers |"
             " Ray 2 vs 1 | packs |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in sizes:
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
            root = Path(tmp)
            (root / "in").mkdir()
            files = max(2, n // 250_000)
            tokens = _corpus(root / "in", n, files)
            runs = {}
            out = subprocess.run([sys.executable, "-c", _LOCAL_RUN, str(root / "in"),
                                  str(root / "local")], capture_output=True, text=True,
                                 check=True)
            runs["local"] = json.loads(out.stdout.splitlines()[-1])
            for w in (1, 2):
                out = subprocess.run([sys.executable, "-c", _RAY_RUN, str(w), str(root / "in"),
                                      str(root / f"ray{w}")], capture_output=True, text=True)
                if out.returncode:
                    print(out.stderr[-3000:])
                    raise SystemExit(1)
                runs[w] = json.loads(out.stdout.splitlines()[-1])
                assert _same_shards(root / "local", root / f"ray{w}"), f"ray {w} differs"
            print(n, runs, flush=True)

            def cell(r: dict) -> str:
                p = r["phases"]
                return (f"{r['seconds']:.1f} s ({p['lengths']:.1f} + {p['plan']:.1f} + "
                        f"{p['gather']:.1f})")

            lines.append(f"| {n:.0e} | {tokens:,} | {files} | {cell(runs['local'])} | "
                         f"{cell(runs[1])} | {cell(runs[2])} | "
                         f"{runs[1]['seconds'] / runs[2]['seconds']:.2f}× | "
                         f"{runs['local']['packs']:,} |")
            print(lines[-1], flush=True)
    lines += ["", "Cells: total (lengths + plan + gather seconds)."]
    return lines


def _command(pythonpath: str | None, args: list[str]) -> tuple[float, float, dict]:
    """Wall and CPU seconds (user + system, every thread) of ``fastpack pack ARGS`` in a
    fresh process (``pythonpath``: the fastpack it imports, None: this tree's), and its
    report. CPU time hardly moves with what else the shared machine runs."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fastpack", "pack", *args, "-q", "--no-plot"],
                   check=True, env=env, capture_output=True)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    out = Path(args[args.index("-o") + 1])
    report = json.loads((out / "report.json").read_text())
    if (out / "run.json").exists():  # a baseline tree before run.json kept it in the report
        report["run"] = json.loads((out / "run.json").read_text())
    return seconds, cpu, report


def bench_compare(baseline: str) -> list[str]:
    sizes = [int(v) for v in os.environ.get("BENCH_SIZES", "100000,1000000").split(",")]
    repeats = int(os.environ.get("BENCH_REPEATS", "3"))
    paths = os.environ.get("BENCH_PATHS", "local,ray").split(",")
    lines = ["## `fastpack pack`: this tree against a baseline", "",
             f"The same corpora as above (`--max-len 1024`, shuffled), packed by this tree and "
             f"by `{baseline}` in turn, {repeats} fresh processes each (medians); wall = the "
             "whole process (start, imports, `ray.init`), passes = lengths + plan + gather "
             "from run.json, CPU = user + system seconds of the command's process and its "
             "threads (for Ray, not its workers'). Ray: a local cluster of all cores "
             "(`--ray=local`). Every run's shards are checked across the two trees: "
             "byte-identical (same: bytes), or the same values in every row and column with "
             "other integer types (same: rows); bytes = the shards' size.", "",
             "| documents | path | wall: baseline | this tree | ratio | passes: baseline | "
             "this tree | ratio | CPU: baseline | this tree | ratio | bytes: baseline | "
             "this tree | same |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for n in sizes:
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
            root = Path(tmp)
            (root / "in").mkdir()
            _corpus(root / "in", n, max(2, n // 250_000))
            for path, extra in (("local", []), ("Ray", ["--ray=local"])):
                if path.lower() not in paths:
                    continue
                wall: dict[str, list[float]] = {"base": [], "this": []}
                passes: dict[str, list[float]] = {"base": [], "this": []}
                cpus: dict[str, list[float]] = {"base": [], "this": []}
                size: dict[str, int] = {}
                same = "bytes"
                for r in range(repeats):
                    for tree in ("base", "this") if r % 2 == 0 else ("this", "base"):
                        out = root / f"{tree}-{path}"
                        shutil.rmtree(out, ignore_errors=True)
                        seconds, cpu, report = _command(
                            baseline if tree == "base" else None,
                            [str(root / "in"), "-o", str(out), "--max-len", "1024", *extra])
                        wall[tree].append(seconds)
                        cpus[tree].append(cpu)
                        passes[tree].append(sum(report.get("run", report)["seconds"].values()))
                        size[tree] = report["bytes"]
                    kind = _same_rows(root / f"base-{path}", root / f"this-{path}")
                    assert kind is not None, "the two trees wrote other rows"
                    same = "rows" if kind == "rows" else same
                w = {k: float(np.median(v)) for k, v in wall.items()}
                p = {k: float(np.median(v)) for k, v in passes.items()}
                c = {k: float(np.median(v)) for k, v in cpus.items()}
                lines.append(f"| {n:.0e} | {path} | {w['base']:.2f} s | {w['this']:.2f} s | "
                             f"{w['this'] / w['base']:.3f} | {p['base']:.2f} s | "
                             f"{p['this']:.2f} s | {p['this'] / p['base']:.3f} | "
                             f"{c['base']:.2f} s | {c['this']:.2f} s | "
                             f"{c['this'] / c['base']:.3f} | {size['base']:,} | "
                             f"{size['this']:,} | {same} |")
                print(lines[-1], flush=True)
    return lines


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    sections = {"sharded": bench_sharded, "billion": bench_billion, "ray": bench_ray}
    if what == "compare":
        sections = {"compare": lambda: bench_compare(sys.argv[2])}
    chosen = list(sections) if what == "all" else [what]
    path = RESULTS / "cli.md"
    existing = path.read_text() if path.exists() else ""
    header = (f"# The offline command: sharded plans, 10^9 lengths, Ray Data\n\n"
              f"{cpu()}, Python {platform.python_version()}; `python benches/bench_cli.py`.\n")
    blocks = {}
    for block in existing.split("\n## ")[1:]:
        blocks[block.split("\n", 1)[0]] = "## " + block.rstrip() + "\n"
    for name in chosen:
        start_load = load()
        lines = sections[name]()
        lines += ["", f"Load average at start: {start_load}; at end: {load()}."]
        blocks[lines[0][3:]] = "\n".join(lines) + "\n"
    path.write_text(header + "\n" + "\n".join(blocks.values()))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
