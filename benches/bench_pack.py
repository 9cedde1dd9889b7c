#!/usr/bin/env python
"""Side-by-side benchmark of sequence-packing tools.

    python benches/bench_pack.py                      # N = 1e4, 1e6, 1e7
    python benches/bench_pack.py --quick              # N = 1e4, 1e5 (smoke run)
    python benches/bench_pack.py --sizes 1e4,1e6 --tools fastpack,seqpacker-obfd

Tools (each measured in its own fresh subprocess per (distribution, N)):

  fastpack-bfd      fastpack.pack(lengths, max_len, strategy="bfd", shuffle=False)  numpy int64 in, CSR out
  fastpack-bfd-1t   the same with threads=1 (the peers are single-threaded)
  seqpacker-obfd    seqpacker.Packer(max_len, "obfd").pack_flat(arr)     its default (optimized) BFD
  seqpacker-bfd     seqpacker.Packer(max_len, "bfd").pack_flat(arr)      its plain BFD
  lightbinpack-obfd lightbinpack.obfd(list, max_len)                      counting sort + segment tree BFD
  lightbinpack-bfd  lightbinpack.bfd(list, max_len)                       std::map BFD
  trl-bfd           trl.pack_dataset(ds, max_len, strategy="bfd")         ("bfd_split" on the pretraining set)
  numpy.sort        np.sort(lengths)                                      the floor

Measurement: the lengths are generated once (numpy default_rng, fixed seed) and stored
as .npy; each worker loads them, builds whatever the tool needs outside the timed region
(TRL: the datasets.Dataset), resets the peak-RSS counter (echo 5 > /proc/self/clear_refs),
runs the tool once (that call gives the peak extra memory = VmHWM - VmRSS before the call,
so it includes the tool's output and any Rust/C++ allocations), validates the packing,
then repeats the call; the reported time is the median of all calls.  Conversions that a
tool's API requires (lightbinpack takes a Python list: ndarray.tolist()) are inside the
timed region; the "core" column excludes them.

Pretraining-like input has documents longer than max_len: fastpack gets the raw lengths
with overlong="split"; TRL gets the raw lengths with its own "bfd_split"; seqpacker and
lightbinpack cannot split, so they get the lengths pre-split in numpy (pieces of max_len,
then the remainder) outside the timed region.
"""
from __future__ import annotations

import argparse
import gc
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

import numpy as np

MAX_LEN = 4096
SEED = 1234
HERE = Path(__file__).resolve().parent

ALL_TOOLS = [
    "fastpack-bfd",
    "fastpack-bfd-1t",
    "seqpacker-obfd",
    "seqpacker-bfd",
    "lightbinpack-obfd",
    "lightbinpack-bfd",
    "trl-bfd",
    "numpy.sort",
]
DISTS = ["sft", "pretrain"]


# --------------------------------------------------------------------------- inputs
def gen_lengths(dist: str, n: int, max_len: int = MAX_LEN, seed: int = SEED) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dist == "sft":
        # log-normal, sigma 1, mean 300 before clipping to [1, max_len]
        x = rng.lognormal(math.log(300) - 0.5, 1.0, n)
        return np.clip(np.rint(x), 1, max_len).astype(np.int64)
    if dist == "pretrain":
        # 80% log-normal body (mean 600) + 20% Pareto(alpha=1.5, x_m=1850) tail,
        # clipped to [1, 131072]: mean ~1,500 tokens, ~6.5% of documents > 4096.
        body = rng.lognormal(math.log(600) - 0.5, 1.0, n)
        tail = 1850.0 * (rng.pareto(1.5, n) + 1.0)
        pick = rng.random(n) < 0.2
        x = np.where(pick, tail, body)
        return np.clip(np.rint(x), 1, 131072).astype(np.int64)
    raise ValueError(dist)


def split_pieces(lengths: np.ndarray, max_len: int) -> np.ndarray:
    """Split every length into pieces of max_len followed by the remainder (numpy)."""
    nfrag = -(-lengths // max_len)
    total = int(nfrag.sum())
    pieces = np.full(total, max_len, dtype=np.int64)
    last = np.cumsum(nfrag) - 1
    rem = lengths - (nfrag - 1) * max_len
    pieces[last] = rem
    return pieces


# --------------------------------------------------------------------------- memory
def _status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM:", "VmRSS:")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * 1024
    return out


def reset_peak() -> int | None:
    """Reset VmHWM to the current RSS; return the RSS (bytes), or None if unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        st = _status()
        return st["VmRSS"] if st["VmHWM"] - st["VmRSS"] < (1 << 20) else None
    except OSError:
        return None


def peak_since_reset() -> int:
    return _status()["VmHWM"]


# --------------------------------------------------------------------------- validation
def check_bins(item_lengths: np.ndarray, items: np.ndarray, offsets: np.ndarray, max_len: int) -> int:
    """items: concatenated item indices of all bins; offsets: CSR (len packs+1). Returns packs."""
    n = len(item_lengths)
    assert len(items) == n, f"{len(items)} items placed, {n} given"
    cnt = np.bincount(items, minlength=n)
    assert len(cnt) == n and (cnt == 1).all(), "items missing or used twice"
    packs = len(offsets) - 1
    sizes = np.diff(offsets)
    assert (sizes > 0).all(), "empty pack"
    loads = np.add.reduceat(item_lengths[items], offsets[:-1])
    assert loads.max() <= max_len, f"pack over max_len: {loads.max()}"
    return packs


def check_fastpack(plan, raw: np.ndarray, max_len: int) -> int:
    sid = np.asarray(plan.sample_ids)
    st = np.asarray(plan.starts)
    sl = np.asarray(plan.seqlens).astype(np.int64)
    off = np.asarray(plan.pack_offsets)
    packs = int(plan.num_packs)
    assert len(off) == packs + 1 and off[0] == 0 and off[-1] == len(sid)
    assert (np.diff(off) > 0).all(), "empty pack"
    loads = np.add.reduceat(sl, off[:-1])
    assert loads.max() <= max_len, f"pack over max_len: {loads.max()}"
    assert (sl > 0).all()
    # every sample fully covered by contiguous, non-overlapping pieces
    order = np.lexsort((st, sid))
    sid_o, st_o, sl_o = sid[order], st[order], sl[order]
    first = np.r_[True, sid_o[1:] != sid_o[:-1]]
    assert (st_o[first] == 0).all(), "a sample does not start at 0"
    assert (st_o[~first] == (st_o + sl_o)[np.flatnonzero(~first) - 1]).all(), "gap/overlap inside a sample"
    cover = np.bincount(sid_o, weights=sl_o, minlength=len(raw)).astype(np.int64)
    assert len(cover) == len(raw) and (cover == raw).all(), "tokens lost or duplicated"
    return packs


def check_lists(item_lengths: np.ndarray, bins, max_len: int) -> int:
    sizes = np.fromiter((len(b) for b in bins), dtype=np.int64, count=len(bins))
    items = np.fromiter((i for b in bins for i in b), dtype=np.int64, count=int(sizes.sum()))
    off = np.r_[0, np.cumsum(sizes)]
    return check_bins(item_lengths, items, off, max_len)


def check_trl(out, raw: np.ndarray, pieces: np.ndarray, max_len: int) -> int:
    import pyarrow.compute as pc

    tbl = out.with_format("arrow")[:]
    ids_col = tbl.column("input_ids").combine_chunks()
    sl_col = tbl.column("seq_lengths").combine_chunks()
    packs = len(tbl)
    seg = np.asarray(pc.list_flatten(sl_col)).astype(np.int64)
    per_row = np.asarray(pc.list_value_length(sl_col)).astype(np.int64)
    row_tokens = np.asarray(pc.list_value_length(ids_col)).astype(np.int64)
    loads = np.add.reduceat(seg, np.r_[0, np.cumsum(per_row)[:-1]])
    assert (loads == row_tokens).all()
    assert row_tokens.max() <= max_len, f"pack over max_len: {row_tokens.max()}"
    assert (np.sort(seg) == np.sort(pieces)).all(), "piece multiset differs"
    # tokens carry their sample id: every segment must be one sample, all tokens present
    vals = np.asarray(pc.list_flatten(ids_col))
    starts = np.r_[0, np.cumsum(seg)[:-1]]
    sid = vals[starts].astype(np.int64)
    assert (vals == np.repeat(sid, seg)).all(), "segment mixes samples"
    cover = np.bincount(sid, weights=seg, minlength=len(raw)).astype(np.int64)
    assert (cover == raw).all(), "tokens lost or duplicated"
    return packs


# --------------------------------------------------------------------------- worker
def worker(tool: str, dist: str, raw_path: str, pieces_path: str, max_len: int, reps: int, rep_budget: float) -> dict:
    raw = np.load(raw_path)
    pieces = np.load(pieces_path)
    has_long = bool(raw.max() > max_len)
    n = len(raw)
    total = int(raw.sum())
    info: dict = {}
    conv_t: list[float] = []

    if tool in ("fastpack-bfd", "fastpack-bfd-1t"):
        import fastpack

        overlong = "split" if has_long else "error"
        threads = 1 if tool.endswith("-1t") else None
        info["input"] = f"raw, overlong={overlong!r}" + (", threads=1" if threads else ", threads=None (all cores)")
        info["version"] = fastpack.__version__
        info["module"] = os.path.dirname(fastpack.__file__)

        def run():
            # Placement order, as the peers return it (no shuffle): the same work.
            return fastpack.pack(raw, max_len, strategy="bfd", overlong=overlong, threads=threads,
                                 shuffle=False)

        def check(r):
            return check_fastpack(r, raw, max_len)

    elif tool.startswith("seqpacker-"):
        import seqpacker

        algo = tool.split("-", 1)[1]
        x = pieces
        info["input"] = "pre-split pieces (int64 ndarray)" if has_long else "int64 ndarray"
        info["version"] = seqpacker.__version__

        def run():
            return seqpacker.Packer(max_len, algo).pack_flat(x)

        def check(r):
            items, splits = r  # splits are np.split points (no leading 0 / trailing n)
            off = np.r_[0, np.asarray(splits, dtype=np.int64), len(items)]
            return check_bins(x, np.asarray(items, dtype=np.int64), off, max_len)

    elif tool.startswith("lightbinpack-"):
        import lightbinpack

        fn = getattr(lightbinpack, tool.split("-", 1)[1])
        x = pieces
        info["input"] = ("pre-split pieces, " if has_long else "") + "ndarray.tolist() (timed)"
        info["version"] = lightbinpack.__version__

        def run():
            t0 = time.perf_counter()
            lst = x.tolist()
            t1 = time.perf_counter()
            conv_t.append(t1 - t0)
            return fn(lst, max_len)

        def check(r):
            return check_lists(x, r, max_len)

    elif tool == "trl-bfd":
        import datasets
        import pyarrow as pa
        import trl
        from trl import pack_dataset

        datasets.disable_progress_bars()
        info["version"] = trl.__version__
        strategy = "bfd_split" if has_long else "bfd"
        info["input"] = f"Dataset(input_ids int32), strategy={strategy!r}"
        # token values = sample id, so the output can be verified sample by sample
        offs = np.r_[0, np.cumsum(raw)]
        vals = pa.array(np.repeat(np.arange(n, dtype=np.int32), raw))
        if offs[-1] < 2**31:
            col = pa.ListArray.from_arrays(pa.array(offs.astype(np.int32)), vals)
        else:
            col = pa.LargeListArray.from_arrays(pa.array(offs), vals)
        del offs
        ds = datasets.Dataset(datasets.table.InMemoryTable(pa.table({"input_ids": col})))
        del col, vals

        def run():
            return pack_dataset(ds, max_len, strategy=strategy)

        def check(r):
            return check_trl(r, raw, pieces, max_len)

    elif tool == "numpy.sort":
        info["input"] = "raw int64 ndarray"

        def run():
            return np.sort(raw)

        check = None
    else:
        raise ValueError(tool)

    times: list[float] = []
    gc.collect()
    base = reset_peak()
    t0 = time.perf_counter()
    r = run()
    times.append(time.perf_counter() - t0)
    peak = peak_since_reset()
    extra = None if base is None else max(0, peak - base)
    packs = check(r) if check is not None else None
    del r
    spent = times[0]
    while len(times) < reps and spent < rep_budget:
        gc.collect()
        t0 = time.perf_counter()
        r = run()
        dt = time.perf_counter() - t0
        del r
        times.append(dt)
        spent += dt
    med = statistics.median(times)
    res = dict(
        tool=tool,
        dist=dist,
        n=n,
        items=len(pieces),
        total_tokens=total,
        max_len=max_len,
        time_s=med,
        times=times,
        packs=packs,
        peak_extra_bytes=extra,
        bytes_per_seq=None if extra is None else extra / n,
        **info,
    )
    if conv_t:
        res["conv_s"] = statistics.median(conv_t)
        res["core_time_s"] = statistics.median([t - c for t, c in zip(times, conv_t)])
    if packs is not None:
        lb = -(-total // max_len)
        res["lower_bound"] = lb
        res["efficiency"] = total / (packs * max_len)
        res["packs_over_lb"] = packs / lb
    return res


# --------------------------------------------------------------------------- driver
def fmt_n(n: int) -> str:
    e = int(round(math.log10(n))) if n > 0 else 0
    return f"1e{e}" if 10**e == n else f"{n:,}"


def fmt_t(t) -> str:
    if t is None:
        return "—"
    if t < 1e-3:
        return f"{t * 1e6:.0f} µs"
    if t < 1:
        return f"{t * 1e3:.1f} ms"
    return f"{t:.2f} s"


def reps_for(tool: str, n: int) -> int:
    if tool == "trl-bfd":
        return 1 if n >= 10**6 else 3
    # Seven calls everywhere: on a shared machine one slow call in three can become the
    # median. Slow tools stop earlier, at --rep-budget seconds.
    return 7


_TRL_CACHE: dict = {}


def run_one(tool, dist, n, paths, args) -> dict:
    note = None
    n_run = n
    if tool == "trl-bfd":
        raw = np.load(paths[0])
        n_red = n
        while n_red > 1 and (n_red > args.trl_max_n or int(raw[:n_red].sum()) > args.trl_max_tokens):
            n_red //= 10
        if n_red < n:
            cap = f"N ≤ {fmt_n(int(args.trl_max_n))} and ≤ {args.trl_max_tokens:.0e} tokens"
            if n_red < 1000:
                return dict(tool=tool, dist=dist, n=n, error=f"skipped: TRL capped at {cap}")
            # run TRL on the first n_red lengths of the same array instead
            sub = raw[:n_red]
            paths = (paths[0][:-4] + f"_trl{n_red}.npy", paths[1][:-4] + f"_trl{n_red}.npy")
            np.save(paths[0], sub)
            np.save(paths[1], split_pieces(sub, args.max_len))
            note = f"run at N={fmt_n(n_red)} (first {n_red:,} lengths; TRL capped at {cap})"
            n_run = n_red
        del raw
    cmd = [
        sys.executable, os.path.abspath(__file__), "--worker", tool, dist, paths[0], paths[1],
        str(args.max_len), str(reps_for(tool, n_run)), str(args.rep_budget),
    ]
    env = dict(os.environ)
    if getattr(args, "snapshot", None):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.snapshot, env.get("PYTHONPATH")]))
    cache_key = None
    if tool == "trl-bfd":
        import hashlib

        cache_key = (dist, hashlib.sha1(np.load(paths[0]).tobytes()).hexdigest())
        if cache_key in _TRL_CACHE:
            res = dict(_TRL_CACHE[cache_key])
            res["input"] = res.get("input", "") + " (same input as a row above: result reused)"
            if note:
                res["reduced_n"], res["n"] = res["n"], n
                res["input"] = f"{res['input']}; **{note}**"
                for q in paths:
                    os.remove(q)
            return res
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return dict(tool=tool, dist=dist, n=n, error=f"timeout > {args.timeout:.0f} s")
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        err = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
        return dict(tool=tool, dist=dist, n=n, error=err[:160])
    res = json.loads(lines[-1])
    if cache_key is not None:
        _TRL_CACHE[cache_key] = dict(res)
    if note:
        res["reduced_n"] = res["n"]
        res["n"] = n
        res["input"] = f"{res.get('input', '')}; **{note}**"
        for q in paths:
            os.remove(q)
    return res


def render(results: list[dict], args, env: dict) -> str:
    out = []
    out.append(f"# Packing benchmark (max_len={args.max_len})\n")
    out.append(
        f"{env['cpu']}, {env['cores']} cores (shared), Python {env['python']}, numpy {env['numpy']}; "
        f"versions: {', '.join(f'{k} {v}' for k, v in env['versions'].items())}. "
        "Time = median of repeated calls in one fresh process per row; "
        "mem = peak RSS growth during the first call (VmHWM after `clear_refs` reset), bytes per input sequence, output included. "
        f"Load average (1/5/15 min) at start {env.get('loadavg_start')}, at end {env.get('loadavg_end')}. "
        f"fastpack build: {env.get('fastpack_snapshot_of') or env.get('fastpack_build')}"
        f"{' (workers import a copy taken at start)' if env.get('fastpack_snapshot_of') else ''}.\n"
    )
    if env.get("warning"):
        out.append(f"**WARNING: {env['warning']}.**\n")
    by_key: dict = {}
    for r in results:
        by_key.setdefault((r["dist"], r["n"]), []).append(r)
    for (dist, n), rows in by_key.items():
        ok = [r for r in rows if "error" not in r]
        full = [r for r in ok if not r.get("reduced_n")]
        any_r = full[0] if full else None
        head = f"## {dist}, N = {fmt_n(n)}"
        if any_r:
            head += (
                f" — {any_r['total_tokens']:,} tokens, mean {any_r['total_tokens'] / n:.0f}, "
                f"{any_r['items']:,} items after splitting, lower bound {-(-any_r['total_tokens'] // args.max_len):,} packs"
            )
        out.append(head + "\n")
        out.append("| tool | input | time (median) | min | core time (no conversion) | packs | packs / LB | efficiency | mem (B/seq) | time vs fastpack |")
        out.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        fp = next((r for r in ok if r["tool"] == "fastpack-bfd"), None)
        for r in rows:
            if "error" in r:
                out.append(f"| {r['tool']} | n/a ({r['error'].replace('|', '/')}) | | | | | | | | |")
                continue
            ratio = ""
            if fp and r is not fp and r.get("reduced_n"):
                ratio = f"{(r['time_s'] / r['reduced_n']) / (fp['time_s'] / fp['n']):.1f}× per seq"
            elif fp and r is not fp:
                ratio = f"{r['time_s'] / fp['time_s']:.2f}×"
            elif r is fp:
                ratio = "1×"
            packs = f"{r['packs']:,}" if r.get("packs") is not None else "—"
            plb = f"{r['packs_over_lb']:.5f}" if r.get("packs") is not None else "—"
            eff = f"{r['efficiency'] * 100:.3f}%" if r.get("packs") is not None else "—"
            mem = f"{r['bytes_per_seq']:.1f}" if r.get("bytes_per_seq") is not None else "n/a"
            core = fmt_t(r.get("core_time_s")) if "core_time_s" in r else ""
            out.append(
                f"| {r['tool']} | {r.get('input', '')} | {fmt_t(r['time_s'])} ({len(r['times'])}×) | {fmt_t(min(r['times']))} | {core} | "
                f"{packs} | {plb} | {eff} | {mem} | {ratio} |"
            )
        out.append("")
        if fp:
            notes = []
            for r in ok:
                if r is fp:
                    continue
                if r["tool"] == "numpy.sort":
                    notes.append(f"fastpack = {fp['time_s'] / r['time_s']:.2f}× numpy.sort")
                elif r.get("reduced_n"):
                    notes.append(
                        f"{r['tool']} (at N={fmt_n(r['reduced_n'])}) {(r['time_s'] / r['reduced_n']) / (fp['time_s'] / fp['n']):.1f}× "
                        "fastpack's time per sequence"
                    )
                    continue
                else:
                    notes.append(f"{r['tool']} {r['time_s'] / fp['time_s']:.2f}× fastpack's time")
                if r.get("packs") is not None and r["packs"] < fp["packs"]:
                    notes.append(f"**{r['tool']} uses fewer packs than fastpack ({r['packs']:,} < {fp['packs']:,})**")
            if notes:
                out.append("Ratios: " + "; ".join(notes) + ".\n")
    out.append(
        "Notes: `time vs fastpack` = tool time / fastpack time (>1 means fastpack is faster). "
        "Pretraining input: seqpacker and lightbinpack get the lengths pre-split in numpy outside the timed region "
        "(pieces of max_len then the remainder); fastpack splits inside its call (overlong=\"split\"); TRL uses its "
        "own \"bfd_split\". TRL's `bfd` runs inside `Dataset.map` with 1000-row batches, so it packs 1000-row windows; "
        "its time and memory include copying the token data (int32) into the packed rows; the Dataset is built "
        "outside the timed region.\n"
    )
    return "\n".join(out)


def fastpack_build() -> str | None:
    """Path + mtime of the compiled fastpack extension that this process would import."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("fastpack._core")
        if spec is None or not spec.origin:
            return None
        st = os.stat(spec.origin)
        return f"{spec.origin} @ {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(st.st_mtime))}"
    except Exception:  # noqa: BLE001
        return None


def snapshot_fastpack(tmp: str) -> str | None:
    """Copy the importable fastpack package (Python files + compiled extension) into tmp.

    Workers import the copy (via PYTHONPATH), so a rebuild of the tree during a long run
    cannot mix two builds in one table. Returns the directory to put on PYTHONPATH."""
    import importlib.util
    import shutil

    try:
        spec = importlib.util.find_spec("fastpack")
    except Exception:  # noqa: BLE001
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    src = list(spec.submodule_search_locations)[0]
    dst = os.path.join(tmp, "fastpack_snapshot")
    shutil.copytree(src, os.path.join(dst, "fastpack"), ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def env_info() -> dict:
    versions = {}
    for mod in ["fastpack", "seqpacker", "lightbinpack", "trl", "datasets", "pyarrow"]:
        try:
            m = __import__(mod)
            versions[mod] = getattr(m, "__version__", "?")
        except Exception as e:  # noqa: BLE001
            versions[mod] = f"missing ({type(e).__name__})"
    cpu = platform.processor() or "?"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return dict(
        cpu=cpu,
        cores=len(os.sched_getaffinity(0)),
        python=platform.python_version(),
        numpy=np.__version__,
        versions=versions,
        fastpack_build=fastpack_build(),
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1e4,1e6,1e7", help="comma-separated N (default 1e4,1e6,1e7)")
    ap.add_argument("--quick", action="store_true", help="N = 1e4,1e5 (smoke run)")
    ap.add_argument("--dists", default=",".join(DISTS))
    ap.add_argument("--tools", default=",".join(ALL_TOOLS))
    ap.add_argument("--max-len", type=int, default=MAX_LEN)
    ap.add_argument("--trl-max-n", type=float, default=1e6, help="largest N given to TRL (default 1e6)")
    ap.add_argument("--trl-max-tokens", type=float, default=4e8, help="largest token count given to TRL")
    ap.add_argument("--rep-budget", type=float, default=15.0, help="stop repeating a row after this many seconds")
    ap.add_argument("--timeout", type=float, default=300.0, help="per-row subprocess timeout (s)")
    ap.add_argument("--out", default=str(HERE / "results" / "pack.md"))
    ap.add_argument("--no-snapshot", action="store_true", help="import fastpack from the tree in every worker")
    ap.add_argument("--worker", nargs=7, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        tool, dist, rawp, piecep, max_len, reps, budget = args.worker
        res = worker(tool, dist, rawp, piecep, int(max_len), int(reps), float(budget))
        print(json.dumps(res))
        return

    sizes = [10**4, 10**5] if args.quick else [int(float(s)) for s in args.sizes.split(",")]
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    for t in tools:
        if t not in ALL_TOOLS:
            ap.error(f"unknown tool {t!r}; choose from {ALL_TOOLS}")
    dists = [d.strip() for d in args.dists.split(",")]
    env = env_info()
    load0 = [round(x, 2) for x in os.getloadavg()]
    results = []
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_pack_") as tmp:
        args.snapshot = None if args.no_snapshot else snapshot_fastpack(tmp)
        if args.snapshot:
            env["fastpack_snapshot_of"] = fastpack_build()
        for dist in dists:
            for n in sizes:
                raw = gen_lengths(dist, n, args.max_len)
                pieces = split_pieces(raw, args.max_len)
                paths = (os.path.join(tmp, f"{dist}_{n}_raw.npy"), os.path.join(tmp, f"{dist}_{n}_pieces.npy"))
                np.save(paths[0], raw)
                np.save(paths[1], pieces)
                del raw, pieces
                for tool in tools:
                    t0 = time.perf_counter()
                    r = run_one(tool, dist, n, paths, args)
                    results.append(r)
                    if "error" in r:
                        msg = f"n/a ({r['error']})"
                    else:
                        msg = f"{fmt_t(r['time_s'])}"
                        if r.get("packs") is not None:
                            msg += f", {r['packs']:,} packs ({r['packs_over_lb']:.5f}×LB)"
                        if r.get("bytes_per_seq") is not None:
                            msg += f", {r['bytes_per_seq']:.1f} B/seq"
                    print(
                        f"[{time.perf_counter() - t_start:6.1f}s] {dist:8s} N={fmt_n(n):>6s} {tool:18s} {msg}"
                        f"  (wall {time.perf_counter() - t0:.1f}s)",
                        file=sys.stderr,
                        flush=True,
                    )
                os.remove(paths[0])
                os.remove(paths[1])
    if not env.get("fastpack_snapshot_of"):
        env["fastpack_build_end"] = fastpack_build()
        if env["fastpack_build_end"] != env["fastpack_build"]:
            print("WARNING: the fastpack extension changed during the run; rerun", file=sys.stderr)
            env["warning"] = "fastpack extension was rebuilt during the run: rows may mix builds"
    env["loadavg_start"] = load0
    env["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    md = render(results, args, env)
    print(md)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md)
    cmd = "python benches/bench_pack.py " + " ".join(sys.argv[1:] if argv is None else argv)
    out.with_suffix(".json").write_text(
        json.dumps(dict(command=cmd.strip(), env=env, max_len=args.max_len, sizes=sizes, results=results), indent=1)
    )
    print(f"\nwrote {out} and {out.with_suffix('.json')}  ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
