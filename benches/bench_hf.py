"""Hugging Face datasets packed: fastpack.hf.pack_dataset vs TRL's pack_dataset, and what
one training step costs out of a big plan.

    python benches/bench_hf.py                       # 10^5 and 10^6 rows, then the step costs
    python benches/bench_hf.py --sizes 1e5 --skip-steps
    python benches/bench_hf.py --before-python /tmp/fp-main/.venv/bin/python   # step costs of
                                                     # an older build, side by side

Part 1, packing a dataset. SFT-like row lengths (log-normal, mean ~300, clipped to
[1, 4096]; seed 0), max_len 4096, a ``datasets.Dataset`` in memory with two int32
per-token columns, ``input_ids`` and ``labels`` (what SFTTrainer packs), in chunks of 1,000
rows (as ``datasets`` writes them). Side by side in one run, each tool in a fresh
subprocess that builds the dataset outside the timed region, resets the peak-RSS counter
(``echo 5 > /proc/self/clear_refs``) and then packs:

- ``fastpack.hf.pack_dataset(ds, 4096)`` (strategy ``bfd``; default threads), whose output
  also carries ``position_ids``;
- ``trl.pack_dataset(ds, 4096, strategy="bfd")`` (TRL's default: ``Dataset.map`` over
  1,000-row windows; no row here is over-long, so TRL's truncation drops nothing and both
  hold the same tokens);
- the floor: one copy of the token bytes (``numpy.copy`` of both columns' value buffers
  into fresh memory), measured in the same run.

Time: median of the calls (fastpack and the copy: 3; TRL: 3 at 10^5, once at 10^6, where
it takes minutes). Peak extra memory: VmHWM during the first call minus VmRSS before it
(the input is already resident), against the bytes of the output table (Arrow buffers).
Every output is checked: the same multiset of tokens as the input, no row over max_len.

Part 2, one step out of a big plan (issue: "batches cost the batch"). ``materialize`` of
8 packs (``layout="rows"``) out of a plan over 10^4 and 10^7 sequences (int32 token data
read in place; the 10^7 tokens array is lazily zeroed, so only the rows read are ever
touched), and out of a shuffled 10^6-row ``datasets.Dataset`` passed on every call.
Median of repeated calls, per interpreter: this build, and with ``--before-python`` an
older one.

Results go to benches/results/hf.md (and hf.json).
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
    return datasets.Dataset(datasets.table.InMemoryTable(table)), lengths


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
    per_row = np.concatenate([np.diff(c.offsets.to_numpy()) for c in rows]) if rows else []
    assert len(per_row) == 0 or per_row.max() <= MAX_LEN, "a pack over max_len"
    values = np.concatenate([c.flatten().to_numpy() for c in rows])
    assert values.size == lengths.sum(), "tokens lost or duplicated"
    original = _token_bytes(ds)[0][: values.size]
    assert np.array_equal(np.bincount(values, minlength=32000),
                          np.bincount(original, minlength=32000)), "token multiset differs"
    return int(table.num_rows)


def run_pack(tool: str, n: int, reps: int) -> dict[str, Any]:
    ds, lengths = sft_dataset(n)
    times, cpu_times = [], []
    result: dict[str, Any] = {"tool": tool, "rows": n, "tokens": int(lengths.sum())}
    for rep in range(reps):
        before = reset_peak()
        t0, c0 = time.perf_counter(), time.process_time()
        if tool == "fastpack":
            import fastpack.hf

            out: Any = fastpack.hf.pack_dataset(ds, MAX_LEN)
        elif tool == "trl":
            import datasets
            import trl

            datasets.disable_progress_bars()
            out = trl.pack_dataset(ds, MAX_LEN, strategy="bfd")
        else:  # one copy of the token bytes
            out = [np.copy(v) for v in _token_bytes(ds)]
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        if rep == 0:
            result["peak_extra"] = peak() - before
            if tool == "copy":
                result["output_bytes"] = sum(v.nbytes for v in out)
            else:
                table = out.data.table if hasattr(out.data, "table") else out.data
                result["output_bytes"] = int(table.nbytes)
                result["packs"] = _check(out, lengths, ds)
                result["columns"] = list(table.column_names)
        del out
    result["times"] = times
    result["time"] = statistics.median(times)
    result["cpu"] = statistics.median(cpu_times)
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
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "datasets": datasets.__version__, "pyarrow": pyarrow.__version__,
            "trl": trl_version, "load": os.getloadavg()[0]}


def fmt_bytes(b: float) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.0f} MiB"


def report(env: dict[str, Any], packs: list[dict[str, Any]], steps: list[dict[str, Any]],
           before_label: str | None) -> str:
    lines = [
        "# Hugging Face datasets: fastpack.hf.pack_dataset vs TRL pack_dataset",
        "",
        f"`python benches/bench_hf.py` — {env['cpu']}, {env['cores']} cores (shared), Python "
        f"{env['python']}, datasets {env['datasets']}, pyarrow {env['pyarrow']}, TRL "
        f"{env['trl']}; load average {env['load']:.1f} at the start, "
        f"{env.get('load_end', float('nan')):.1f} at the end (other jobs shared the 2 cores). "
        "Method: see the script's docstring.",
        "",
        "SFT-like rows (log-normal lengths, mean ≈300, max_len 4096), int32 `input_ids` and "
        "`labels` in 1,000-row chunks, in memory. Time: median wall clock; CPU time: the "
        "process's user + system time over all threads (steadier than wall clock when other "
        "jobs share the cores); peak extra: peak RSS growth during the call (output included) "
        "and its ratio to the output table's bytes.",
        "",
        "| rows | tool | time | vs TRL | vs one copy | CPU time | CPU vs TRL | CPU vs copy | "
        "peak extra | extra / output | packs |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by = {(r.get("tool"), r.get("rows")): r for r in packs}
    for n in sorted({r["rows"] for r in packs if "rows" in r}):
        trl_r, copy_r = by.get(("trl", n), {}), by.get(("copy", n), {})
        for tool in ("fastpack", "trl", "copy"):
            r = by.get((tool, n))
            if r is None:
                continue
            name = {"fastpack": "fastpack.hf.pack_dataset", "trl": "trl.pack_dataset (bfd)",
                    "copy": "one copy of the token bytes"}[tool]
            if "error" in r:
                lines.append(f"| {n:,} | {name} | n/a ({r['error']}) | | | | | | | | |")
                continue

            def ratio(key: str, base: dict[str, Any], r: dict[str, Any] = r) -> str:
                return f"{base[key] / r[key]:.1f}×" if key in base and r.get(key) else ""

            def over(key: str, base: dict[str, Any], r: dict[str, Any] = r) -> str:
                return f"{r[key] / base[key]:.2f}×" if base.get(key) and key in r else ""

            def best(r: dict[str, Any]) -> str:
                times = r.get("times", [])
                return f" (best {min(times):.2f})" if len(times) > 1 else ""

            fast = tool == "fastpack"
            extra = f"{r['peak_extra'] / r['output_bytes']:.2f}" if r.get("output_bytes") else ""
            packs_cell = f"{r['packs']:,}" if r.get("packs") else ""
            lines.append(
                f"| {n:,} | {name} | {r['time']:.2f} s{best(r)} | "
                f"{ratio('time', trl_r) if fast else ''} | "
                f"{over('time', copy_r)} | {r.get('cpu', float('nan')):.2f} s | "
                f"{ratio('cpu', trl_r) if fast else ''} | {over('cpu', copy_r)} | "
                f"{fmt_bytes(r['peak_extra'])} | {extra} | {packs_cell} |"
            )
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
    ap.add_argument("--sizes", default="1e5,1e6")
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
    packs = []
    for size in args.sizes.split(","):
        n = int(float(size))
        big = n >= 10**6
        for tool in ("copy", "fastpack", "trl"):
            if tool == "trl" and args.skip_trl:
                continue
            reps = 1 if (tool == "trl" and big) else 3
            r = spawn(sys.executable, ["pack", tool, str(n), str(reps)], timeout=3600)
            r.setdefault("tool", tool)
            r.setdefault("rows", n)
            print(json.dumps({k: v for k, v in r.items() if k != "times"}), flush=True)
            packs.append(r)
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
    text = report(env, packs, steps, args.before_label if args.before_python else None)
    Path(args.out).write_text(text)
    Path(args.out).with_suffix(".json").write_text(
        json.dumps({"env": env, "pack": packs, "steps": steps}, indent=1))
    print(text)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as _:
        main()
