"""Hugging Face datasets packed: fastpack.hf.pack_dataset vs TRL's pack_dataset, and what
one training step costs out of a big plan.

    python benches/bench_hf.py                       # 3x10^5 and 10^6 rows, then the step costs
    python benches/bench_hf.py --sizes 1e5 --procs 1 --skip-steps
    python benches/bench_hf.py --before-python /tmp/fp-main/.venv/bin/python   # step costs of
                                                     # an older build, side by side

Part 1, packing a dataset end to end. SFT-like row lengths (log-normal, mean ~300, clipped
to [1, 4096]; seed 0), max_len 4096, a ``datasets.Dataset`` in memory with two int32
per-token columns, ``input_ids`` and ``labels`` (what SFTTrainer packs), in chunks of 1,000
rows (as ``datasets`` writes them). Each tool runs in its own fresh process (``--procs``
of them per tool and size, the tools interleaved so that other load on the machine falls
on all of them alike), which builds the dataset outside the timed region, imports the tool
(timed apart: ``import``), resets the peak-RSS counter (``echo 5 > /proc/self/clear_refs``)
and then calls it:

- ``fastpack.hf.pack_dataset(ds, 4096)`` (its defaults: strategy ``bfd``, shuffled packs,
  TRL's columns ``input_ids, labels, seq_lengths``; default threads);
- ``trl.pack_dataset(ds, 4096, strategy="bfd")`` (TRL's default: ``Dataset.map`` over
  1,000-row windows; no row here is over-long, so TRL's truncation drops nothing and both
  hold the same tokens);
- the floor: one copy of the token bytes (``numpy.copy`` of both columns' value buffers
  into fresh memory): what writing the output's bytes once costs, faults of fresh pages
  included.

Per process: the **first call** (what a user pays: fresh output pages, lazy imports, first
use of every code path) and then ``--warm`` more calls in the same process (their median
is the **warm** time; TRL at 10^6 gets one, as each takes minutes). Reported per tool and
size: the median over the processes of the first call's wall-clock and CPU time (user +
system, all threads: steadier than wall clock when other jobs share the cores), of the
warm median, of the peak RSS of the process during the first call (the input included)
and of its growth during the call; the output table's bytes and its packs; and TRL's time
over fastpack's, first call and warm. Every output is checked: the same multiset of
tokens as the input, no row over max_len.

Part 2, one step out of a big plan (issue: "batches cost the batch"). ``materialize`` of
8 packs (``layout="rows"``) out of a plan over 10^4 and 10^7 sequences (int32 token data
read in place; the 10^7 tokens array is lazily zeroed, so only the rows read are ever
touched), and out of a shuffled 10^6-row ``datasets.Dataset`` passed on every call.
Median of repeated calls, per interpreter: this build, and with ``--before-python`` an
older one.

Results go to benches/results/hf.md (and hf.json), with the README's table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MAX_LEN = 4096
CHUNK_ROWS = 1000


# --------------------------------------------------------------------------- measuring
def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM:", "VmRSS:")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * 1024
    return out


def reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status()["VmRSS"]


def peak() -> int:
    return _status()["VmHWM"]


def sft_lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.lognormal(math.log(300) - 0.5, 1.0, n)
    return np.clip(np.rint(x), 1, MAX_LEN).astype(np.int64)


def sft_dataset(n: int) -> Any:
    """A datasets.Dataset with int32 input_ids and labels, in 1,000-row chunks."""
    import datasets
    import pyarrow as pa

    lengths = sft_lengths(n)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, 32000, int(offsets[-1]), dtype=np.int32)
    labels = tokens.copy()
    labels[offsets[:-1]] = -100  # something that differs from the ids
    columns = {}
    for name, values in (("input_ids", tokens), ("labels", labels)):
        whole = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
        columns[name] = pa.chunked_array(
            [whole.slice(a, CHUNK_ROWS) for a in range(0, n, CHUNK_ROWS)]
        )
    table = pa.table(columns)
    # A fingerprint given: datasets would otherwise hash every byte of the table (10 s at
    # 3x10^5 rows), outside the timed region but in every process.
    ds = datasets.Dataset(datasets.table.InMemoryTable(table), fingerprint=f"bench-sft-{n}")
    return ds, lengths


def _token_bytes(ds: Any) -> list[np.ndarray]:
    """The value buffers of both columns (numpy views)."""
    table = ds.data.table
    out = []
    for name in ("input_ids", "labels"):
        chunk = table.column(name).chunk(0)
        out.append(np.frombuffer(chunk.values.buffers()[1], dtype=np.int32))
    return out


def _check(packed: Any, lengths: np.ndarray, ds: Any) -> int:
    table = packed.data.table if hasattr(packed.data, "table") else packed.data
    ids = table.column("input_ids")
    rows = ids.chunks
    per_row = np.concatenate([np.diff(c.offsets.to_numpy()) for c in rows] or [np.zeros(0)])
    assert len(per_row) == 0 or per_row.max() <= MAX_LEN, "a pack over max_len"
    values = np.concatenate([c.flatten().to_numpy() for c in rows])
    assert values.size == lengths.sum(), "tokens lost or duplicated"
    original = _token_bytes(ds)[0][: values.size]
    assert np.array_equal(np.bincount(values, minlength=32000),
                          np.bincount(original, minlength=32000)), "token multiset differs"
    return int(table.num_rows)


def _call(tool: str, ds: Any) -> Any:
    if tool == "fastpack":
        import fastpack.hf

        return fastpack.hf.pack_dataset(ds, MAX_LEN)
    if tool == "trl":
        import trl

        return trl.pack_dataset(ds, MAX_LEN, strategy="bfd")
    return [np.copy(v) for v in _token_bytes(ds)]  # one copy of the token bytes


def run_pack(tool: str, n: int, warm: int) -> dict[str, Any]:
    ds, lengths = sft_dataset(n)
    result: dict[str, Any] = {"tool": tool, "rows": n, "tokens": int(lengths.sum())}
    t0 = time.perf_counter()
    # `from ... import pack_dataset` resolves TRL's lazy module (transformers and torch
    # come with it), so the first call does not pay for imports a training script has
    # already paid; the import time is reported apart.
    if tool == "fastpack":
        from fastpack.hf import pack_dataset  # noqa: F401
    elif tool == "trl":
        import datasets
        from trl import pack_dataset  # noqa: F401, F811

        datasets.disable_progress_bars()
    result["import"] = time.perf_counter() - t0
    times, cpu_times = [], []
    for rep in range(1 + warm):
        before = reset_peak()
        t0, c0 = time.perf_counter(), time.process_time()
        out = _call(tool, ds)
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        if rep == 0:
            result["peak_rss"] = peak()
            result["peak_extra"] = peak() - before
            if tool == "copy":
                result["output_bytes"] = sum(v.nbytes for v in out)
            else:
                table = out.data.table if hasattr(out.data, "table") else out.data
                result["output_bytes"] = int(table.nbytes)
                result["packs"] = _check(out, lengths, ds)
                result["columns"] = list(table.column_names)
        del out
    result["first"], result["first_cpu"] = times[0], cpu_times[0]
    if warm:
        result["warm"] = statistics.median(times[1:])
        result["warm_cpu"] = statistics.median(cpu_times[1:])
    return result


# --------------------------------------------------------------------------- step costs
def run_steps(n: int, source: str, reps: int) -> dict[str, Any]:
    import fastpack

    steps = 8
    if source == "dataset":
        ds, lengths = sft_dataset(n)
        ds = ds.shuffle(seed=0)
        lengths = lengths[ds._indices.column(0).to_numpy()]
        data: Any = ds
    else:
        lengths = sft_lengths(n)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.zeros(int(offsets[-1]), dtype=np.int32)  # lazily zeroed: untouched
        data = (values, offsets)
    plan = fastpack.pack(lengths, MAX_LEN, shuffle=True)
    rng = np.random.default_rng(0)
    times = []
    for _ in range(reps):
        start = int(rng.integers(0, plan.num_packs - steps))
        packs = np.arange(start, start + steps)
        t0 = time.perf_counter()
        out = fastpack.materialize(plan, data, packs, layout="rows")
        times.append(time.perf_counter() - t0)
        assert out["input_ids"].shape[0] == steps
    return {"sequences": n, "source": source, "packs": plan.num_packs,
            "time": statistics.median(times), "reps": reps}


# --------------------------------------------------------------------------- driver
def worker(argv: list[str]) -> None:
    kind, rest = argv[0], argv[1:]
    if kind == "pack":
        out = run_pack(rest[0], int(float(rest[1])), int(rest[2]))
    else:
        out = run_steps(int(float(rest[0])), rest[1], int(rest[2]))
    print("RESULT " + json.dumps(out), flush=True)


def spawn(python: str, args: list[str], timeout: float) -> dict[str, Any]:
    env = dict(os.environ)
    proc = subprocess.run([python, __file__, "--worker", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[7:]))
    return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]}


def env_info() -> dict[str, Any]:
    cpu = "?"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        cpu = next((ln.split(":", 1)[1].strip() for ln in out.splitlines()
                    if ln.startswith("Model name")), "?")
    except OSError:
        pass
    import datasets
    import pyarrow

    try:
        import trl

        trl_version = trl.__version__
    except ImportError:
        trl_version = "n/a"
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "?"
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "python",
                            "rust"], capture_output=True, text=True).stdout.strip()
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "commit": commit + (" + uncommitted changes" if dirty else ""),
            "datasets": datasets.__version__, "pyarrow": pyarrow.__version__,
            "trl": trl_version, "load": os.getloadavg()[0]}


def fmt_bytes(b: float) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.0f} MiB"


TOOLS = ("fastpack", "trl", "copy")
NAMES = {"fastpack": "fastpack.hf.pack_dataset", "trl": "trl.pack_dataset (bfd)",
         "copy": "one copy of the token bytes"}


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per tool and size, the median over its processes of every measured number."""
    out = []
    for n in sorted({r["rows"] for r in runs}):
        for tool in TOOLS:
            mine = [r for r in runs if r["rows"] == n and r["tool"] == tool]
            good = [r for r in mine if "error" not in r]
            if not mine:
                continue
            row: dict[str, Any] = {"tool": tool, "rows": n, "procs": len(good)}
            if not good:
                row["error"] = mine[0]["error"]
            for key in ("import", "first", "first_cpu", "warm", "warm_cpu", "peak_rss",
                        "peak_extra", "output_bytes", "packs"):
                values = [r[key] for r in good if key in r]
                if values:
                    row[key] = statistics.median(values)
            if good:
                row["firsts"] = [r["first"] for r in good]
                row["columns"] = good[0].get("columns")
            out.append(row)
    return out


def _ratio(by: dict[Any, dict[str, Any]], n: int, key: str) -> float | None:
    fast, trl = by.get(("fastpack", n), {}), by.get(("trl", n), {})
    if fast.get(key) and trl.get(key):
        return float(trl[key]) / float(fast[key])
    return None


def _x(value: float | None) -> str:
    return f"{value:.1f}×" if value is not None else "n/a"


def readme_table(rows: list[dict[str, Any]]) -> list[str]:
    by = {(r["tool"], r["rows"]): r for r in rows}
    lines = [
        "| rows | fastpack first call | fastpack warm | TRL first call | TRL warm | "
        "TRL ÷ fastpack, first call | TRL ÷ fastpack, warm |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in sorted({r["rows"] for r in rows}):
        f, t = by.get(("fastpack", n), {}), by.get(("trl", n), {})

        def sec(r: dict[str, Any], key: str) -> str:
            return f"{r[key]:.2f} s" if key in r else "n/a"

        lines.append(f"| {n:,} | {sec(f, 'first')} | {sec(f, 'warm')} | {sec(t, 'first')} | "
                     f"{sec(t, 'warm')} | {_x(_ratio(by, n, 'first'))} | "
                     f"{_x(_ratio(by, n, 'warm'))} |")
    return lines


def report(env: dict[str, Any], rows: list[dict[str, Any]], steps: list[dict[str, Any]],
           before_label: str | None, procs: int) -> str:
    lines = [
        "# Hugging Face datasets: fastpack.hf.pack_dataset vs TRL pack_dataset",
        "",
        f"`python benches/bench_hf.py` — {env['cpu']}, {env['cores']} cores (shared with "
        f"other jobs), Python {env['python']}, datasets {env['datasets']}, pyarrow "
        f"{env['pyarrow']}, TRL {env['trl']}, fastpack at {env['commit']}; load average "
        f"{env['load']:.1f} at the start, {env.get('load_end', float('nan')):.1f} at the end. "
        "Method: see the script's docstring.",
        "",
        "SFT-like rows (log-normal lengths, mean ≈300, max_len 4096), int32 `input_ids` and "
        f"`labels` in 1,000-row chunks, in memory. Each tool in {procs} fresh processes per "
        "size; every number is the median over them. **First call**: the first call in a "
        "fresh process (the tool imported before, `import` apart); **warm**: the median of "
        "the next calls in the same process. CPU: user + system time of all threads. Peak "
        "RSS: the process's high-water mark during the first call (the input included); "
        "growth: its rise during that call.",
        "",
        "| rows | tool | first call | CPU | warm | CPU | TRL ÷ it (first / warm) | "
        "vs one copy (first) | import | peak RSS | growth | output | packs |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by = {(r["tool"], r["rows"]): r for r in rows}
    for r in rows:
        n, tool = r["rows"], r["tool"]
        if "error" in r:
            lines.append(f"| {n:,} | {NAMES[tool]} | n/a ({r['error']}) |" + " |" * 11)
            continue
        copy = by.get(("copy", n), {})

        def sec(key: str, r: dict[str, Any] = r) -> str:
            return f"{r[key]:.2f} s" if key in r else ""

        vs_trl = (f"{_x(_ratio(by, n, 'first'))} / {_x(_ratio(by, n, 'warm'))}"
                  if tool == "fastpack" else "")
        vs_copy = f"{r['first'] / copy['first']:.1f}×" if copy.get("first") else ""
        packs = f"{int(r['packs']):,}" if r.get("packs") else ""
        lines.append(
            f"| {n:,} | {NAMES[tool]} | {sec('first')} | {sec('first_cpu')} | {sec('warm')} | "
            f"{sec('warm_cpu')} | {vs_trl} | {vs_copy} | "
            f"{sec('import') if tool != 'copy' else ''} | {fmt_bytes(r['peak_rss'])} | "
            f"{fmt_bytes(r['peak_extra'])} | {fmt_bytes(r['output_bytes'])} | {packs} |"
        )
    lines.append("")
    for n in sorted({r["rows"] for r in rows}):
        f = by.get(("fastpack", n), {})
        if "firsts" in f:
            lines.append(f"- {n:,} rows: fastpack's first calls "
                         + ", ".join(f"{t:.2f}" for t in f["firsts"])
                         + f" s; output columns {', '.join(f.get('columns') or [])}.")
    for n in sorted({r["rows"] for r in rows}):
        t = by.get(("trl", n), {})
        if "firsts" in t:
            lines.append(f"- {n:,} rows: TRL's first calls "
                         + ", ".join(f"{x:.2f}" for x in t["firsts"])
                         + f" s; output columns {', '.join(t.get('columns') or [])}.")
    lines += ["", "## README table", "", "`pack_dataset` end to end, fastpack vs TRL "
              "(`benches/results/hf.md`):", "", *readme_table(rows)]
    if steps:
        lines += [
            "",
            "## One step out of a big plan",
            "",
            "`materialize` of 8 packs (`layout=\"rows\"`) out of a shuffled bfd plan; median "
            "time per call.",
            "",
            "| source | sequences | packs in plan | build | time per step |",
            "|---|---:|---:|---|---:|",
        ]
        for r in steps:
            if "error" in r:
                lines.append(f"| {r.get('source', '?')} | | | {r['build']} | n/a "
                             f"({r['error']}) |")
                continue
            src = {"numpy": "numpy (values, offsets)",
                   "dataset": "shuffled datasets.Dataset, passed each call"}[r["source"]]
            lines.append(f"| {src} | {r['sequences']:,} | {r['packs']:,} | {r['build']} | "
                         f"{r['time'] * 1e3:.3f} ms |")
        if before_label:
            lines.append("")
            lines.append(f"`before`: {before_label}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", nargs=argparse.REMAINDER)
    ap.add_argument("--sizes", default="3e5,1e6")
    ap.add_argument("--procs", type=int, default=3, help="fresh processes per tool and size")
    ap.add_argument("--warm", type=int, default=3, help="warm calls per process")
    ap.add_argument("--skip-steps", action="store_true")
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--before-python", default=None,
                    help="interpreter with an older fastpack, for the step costs")
    ap.add_argument("--before-label", default="the build before this change")
    ap.add_argument("--out", default=str(ROOT / "benches" / "results" / "hf.md"))
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return
    env = env_info()
    runs = []
    for size in args.sizes.split(","):
        n = int(float(size))
        for _ in range(args.procs):
            for tool in TOOLS:
                if tool == "trl" and args.skip_trl:
                    continue
                # TRL takes minutes a call at 10^6 rows: one warm call there.
                warm = 1 if (tool == "trl" and n >= 10**6) else args.warm
                if tool == "trl":
                    warm = min(warm, 2)
                r = spawn(sys.executable, ["pack", tool, str(n), str(warm)], timeout=3600)
                r.setdefault("tool", tool)
                r.setdefault("rows", n)
                print(json.dumps(r), flush=True)
                runs.append(r)
    rows = summarize(runs)
    steps = []
    if not args.skip_steps:
        builds = [("this", sys.executable)]
        if args.before_python:
            builds.insert(0, ("before", args.before_python))
        for label, python in builds:
            for n, source, reps in ((10**4, "numpy", 400), (10**7, "numpy", 400),
                                    (10**6, "dataset", 5 if label == "before" else 100)):
                r = spawn(python, ["steps", str(n), source, str(reps)], timeout=1800)
                r["build"] = label
                r.setdefault("source", source)
                print(json.dumps(r), flush=True)
                steps.append(r)
    env["load_end"] = os.getloadavg()[0]
    text = report(env, rows, steps, args.before_label if args.before_python else None,
                  args.procs)
    Path(args.out).write_text(text)
    Path(args.out).with_suffix(".json").write_text(
        json.dumps({"env": env, "runs": runs, "pack": rows, "steps": steps}, indent=1))
    print(text)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as _:
        main()
