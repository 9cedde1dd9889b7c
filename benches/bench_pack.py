#!/usr/bin/env python
"""Plan-vs-plan benchmark of sequence-packing tools: first call in a fresh process and warm calls.

    python benches/bench_pack.py                      # N = 1e6, 1e7, both distributions
    python benches/bench_pack.py --quick              # N = 1e4, 1e5 (smoke run)
    python benches/bench_pack.py --sizes 1e4,1e6 --tools fastpack-bfd,seqpacker-obfd
    python benches/bench_pack.py --previous OLD.json  # also summarise an earlier run beside this one

Every tool here returns a packing *plan* (which item goes in which pack), not packed rows:

  fastpack-bfd      fastpack.pack(lengths, max_len, strategy="bfd", shuffle=False)  numpy int64 in, CSR out
  fastpack-bfd-1t   the same with threads=1 (the peers are single-threaded)
  seqpacker-obfd    seqpacker.Packer(max_len, "obfd").pack_flat(arr)     its default (optimized) BFD
  seqpacker-bfd     seqpacker.Packer(max_len, "bfd").pack_flat(arr)      its plain BFD
  lightbinpack-obfd lightbinpack.obfd(list, max_len)                      counting sort + segment tree BFD
  lightbinpack-bfd  lightbinpack.bfd(list, max_len)                       std::map BFD
  lightbinpack-obfdp lightbinpack.obfdp(list, max_len)                    its parallel obfd (OpenMP: items dealt
                                                                          round-robin to threads, each packed alone,
                                                                          the last bins repacked)
  numpy.sort        np.sort(lengths)                                      the floor: one sort of the same array

TRL is not here: `trl.pack_dataset` builds the packed rows (it copies every token), so its
time is not comparable with a plan.  End to end it is compared with `fastpack.hf.pack_dataset`,
which also builds the rows, in benches/bench_hf.py.

Measurement: the lengths are generated once (numpy default_rng, fixed seed) and stored as
.npy.  Each (tool, distribution, N) runs in its own fresh subprocess, which loads the lengths
and imports the tool (both timed and reported, but outside the call's time), resets the
peak-RSS counter (echo 5 > /proc/self/clear_refs) and makes the **first call** — what a user
pays once per process, timed from just before the call to its return; that call also gives
the peak extra memory (VmHWM - VmRSS before the call: the output and any Rust/C++
allocations).  The plan is validated, then the call is repeated: the **warm** time is the
median of those repeats (at least --min-warm, at most --reps, stopping once --rep-budget
seconds are spent).  Conversions that a tool's API requires (lightbinpack takes a Python list:
ndarray.tolist()) are inside the timed region; the "core" figures exclude them.

Pretraining-like input has documents longer than max_len: fastpack gets the raw lengths with
overlong="split" (it splits inside the call); seqpacker and lightbinpack cannot split, so they
get the lengths pre-split in numpy (pieces of max_len, then the remainder) outside the timed
region.
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
    "lightbinpack-obfdp",
    "numpy.sort",
]
DISTS = ["sft", "pretrain"]
DIST_NAME = {"sft": "SFT-like", "pretrain": "pretraining-like"}
REF = "fastpack-bfd"  # the denominator of every ratio
MULTI_THREADED = {"fastpack-bfd", "lightbinpack-obfdp"}  # the others run on one thread


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



# --------------------------------------------------------------------------- worker
def worker(tool: str, dist: str, raw_path: str, pieces_path: str, max_len: int, reps: int, min_warm: int,
           rep_budget: float) -> dict:
    t0 = time.perf_counter()
    raw = np.load(raw_path)
    pieces = np.load(pieces_path)
    load_s = time.perf_counter() - t0
    has_long = bool(raw.max() > max_len)
    n = len(raw)
    total = int(raw.sum())
    info: dict = {}
    conv_t: list[float] = []

    t0 = time.perf_counter()
    if tool in ("fastpack-bfd", "fastpack-bfd-1t"):
        import fastpack

        import_s = time.perf_counter() - t0
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

        import_s = time.perf_counter() - t0
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

        import_s = time.perf_counter() - t0
        fn = getattr(lightbinpack, tool.split("-", 1)[1])
        x = pieces
        info["input"] = ("pre-split pieces, " if has_long else "") + "ndarray.tolist() (timed)"
        info["version"] = lightbinpack.__version__

        def run():
            t0 = time.perf_counter()
            lst = x.tolist()
            conv_t.append(time.perf_counter() - t0)
            return fn(lst, max_len)

        def check(r):
            return check_lists(x, r, max_len)

    elif tool == "numpy.sort":
        import_s = 0.0  # numpy is already imported to load the lengths
        info["input"] = "raw int64 ndarray"

        def run():
            return np.sort(raw)

        check = None
    else:
        raise ValueError(tool)

    gc.collect()
    base = reset_peak()
    t0 = time.perf_counter()
    r = run()
    first = time.perf_counter() - t0
    peak = peak_since_reset()
    extra = None if base is None else max(0, peak - base)
    packs = check(r) if check is not None else None
    del r
    warm: list[float] = []
    spent = 0.0
    while len(warm) < reps and (len(warm) < min_warm or spent < rep_budget):
        gc.collect()
        t0 = time.perf_counter()
        r = run()
        dt = time.perf_counter() - t0
        del r
        warm.append(dt)
        spent += dt
    res = dict(
        tool=tool,
        dist=dist,
        n=n,
        items=len(pieces),
        total_tokens=total,
        overlong=int((raw > max_len).sum()),
        max_len=max_len,
        load_s=load_s,
        import_s=import_s,
        first_s=first,
        warm_s=warm,
        warm_median_s=statistics.median(warm),
        warm_min_s=min(warm),
        packs=packs,
        peak_extra_bytes=extra,
        bytes_per_seq=None if extra is None else extra / n,
        **info,
    )
    if conv_t:
        res["conv_first_s"] = conv_t[0]
        res["core_first_s"] = first - conv_t[0]
        res["core_warm_median_s"] = statistics.median([t - c for t, c in zip(warm, conv_t[1:])])
    if packs is not None:
        lb = -(-total // max_len)
        res["lower_bound"] = lb
        res["efficiency"] = total / (packs * max_len)
        res["packs_over_lb"] = packs / lb
    return res


# --------------------------------------------------------------------------- driver
def fmt_n(n: int) -> str:
    e = int(round(math.log10(n))) if n > 0 else 0
    return f"10^{e}" if 10**e == n else f"{n:,}"


def fmt_t(t) -> str:
    if t is None:
        return "—"
    if t < 1e-3:
        return f"{t * 1e6:.0f} µs"
    if t < 1:
        return f"{t * 1e3:.1f} ms"
    return f"{t:.2f} s"


def fmt_r(x: float) -> str:
    return f"{x:.2f}×" if x < 10 else f"{x:.1f}×"


def run_one(tool, dist, n, paths, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", tool, dist, paths[0], paths[1], str(args.max_len),
           str(args.reps), str(args.min_warm), str(args.rep_budget)]
    env = dict(os.environ)
    if args.snapshot:
        env["PYTHONPATH"] = args.snapshot + os.pathsep + env.get("PYTHONPATH", "")
    load1 = os.getloadavg()[0]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return dict(tool=tool, dist=dist, n=n, error=f"timeout > {args.timeout:.0f} s", load1_before=load1)
    wall = time.perf_counter() - t0
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        err = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
        return dict(tool=tool, dist=dist, n=n, error=err[:160], load1_before=load1)
    res = json.loads(lines[-1])
    res["load1_before"] = load1
    res["process_wall_s"] = wall
    return res


def _best(rows: list[dict], prefix: str) -> dict | None:
    """The variant of one peer with the lower warm median (the same variant serves both rows)."""
    cand = [r for r in rows if r["tool"].startswith(prefix) and "error" not in r]
    return min(cand, key=lambda r: r["warm_median_s"]) if cand else None


def _group(results: list[dict]) -> dict:
    by_key: dict = {}
    for r in results:
        by_key.setdefault((r["dist"], r["n"]), []).append(r)
    return by_key


def render_summary(results: list[dict]) -> list[str]:
    out = [
        "| data, N | call | fastpack `bfd` | fastpack `threads=1` | seqpacker (best) | lightbinpack (best) "
        "| `numpy.sort` | packs / lower bound | fastpack extra memory |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    one_thread = []
    for (dist, n), rows in _group(results).items():
        by = {r["tool"]: r for r in rows if "error" not in r}
        fp = by.get(REF)
        peers = {"seqpacker": _best(rows, "seqpacker-"), "lightbinpack": _best(rows, "lightbinpack-")}
        for key, label in (("first_s", "first call"), ("warm_median_s", "warm median")):
            cells = []
            for tool in (REF, "fastpack-bfd-1t"):
                cells.append(fmt_t(by[tool][key]) if tool in by else "n/a")
            for r in peers.values():
                if r is None:
                    cells.append("n/a")
                    continue
                variant = r["tool"].split("-", 1)[1]
                ratio = f"{fmt_r(r[key] / fp[key])}, " if fp else ""
                cells.append(f"{fmt_t(r[key])} ({ratio}{variant})")
            cells.append(fmt_t(by["numpy.sort"][key]) if "numpy.sort" in by else "n/a")
            if key == "first_s" and fp:
                plb = f"{fp['packs_over_lb']:.5f} ({fp['packs']:,} / {fp['lower_bound']:,})"
                others = [p for t, p in by.items() if t.split("-")[0] in ("seqpacker", "lightbinpack")]
                differ = [p for p in others if p["packs"] != fp["packs"]]
                if others and not differ:
                    plb += ", every peer the same"
                elif differ:
                    plb += "; " + ", ".join(f"{p['tool']} {p['packs']:,}" for p in differ)
                mem = f"{fp['bytes_per_seq']:.1f} B/seq" if fp.get("bytes_per_seq") is not None else "n/a"
            else:
                plb, mem = "", ""
            out.append(f"| {DIST_NAME[dist]}, {fmt_n(n)} | {label} | " + " | ".join(cells) + f" | {plb} | {mem} |")
            one = by.get("fastpack-bfd-1t")
            ps = [p for p in rows if "error" not in p and p["tool"].split("-")[0] in ("seqpacker", "lightbinpack")
                  and p["tool"] not in MULTI_THREADED]
            if one and ps:
                fastest = min(ps, key=lambda p: p[key])
                one_thread.append(f"{DIST_NAME[dist]} {fmt_n(n)} {label} {fmt_r(fastest[key] / one[key])}")
    out.append("")
    out.append(
        "Ratios in brackets = peer ÷ fastpack `bfd` (default threads) for the same call; best = the peer's variant "
        "with the lowest warm median, used in both rows (lightbinpack's candidates include its multi-threaded `obfdp`). "
        "One thread against one thread (fastest single-threaded peer ÷ fastpack `threads=1`): " + ("; ".join(one_thread) if one_thread else "n/a") + ".\n"
    )
    return out


def render(results: list[dict], args, env: dict, previous: dict | None = None) -> str:
    out = []
    out.append(f"# Packing plans (max_len={args.max_len}): fastpack vs seqpacker, lightbinpack, numpy.sort\n")
    cores = env["cores"]
    out.append(
        f"Machine: **{env['cpu']}** (`lscpu` Model name), {cores['cpu_count']} logical CPUs "
        f"({cores['usable']} usable by this process), shared with other users. Load average (1/5/15 min): "
        f"{env['loadavg_start']} at the start ({env['started_utc']}), {env['loadavg_end']} at the end "
        f"({env['ended_utc']}); every row also gives the 1-minute load just before its process started. "
        f"Python {env['python']}, numpy {env['numpy']}; versions: "
        f"{', '.join(f'{k} {v}' for k, v in env['versions'].items())}. "
        f"fastpack build: {env.get('fastpack_snapshot_of') or env.get('fastpack_build')}"
        f"{' (workers import a copy taken at start)' if env.get('fastpack_snapshot_of') else ''}"
        f"{', git ' + env['git'] if env.get('git') else ''}. Command: `{env['command']}`.\n"
    )
    out.append(
        "Every tool returns a plan (which item goes in which pack). Each row is its own fresh process: "
        "**first call** = the first call in that process, timed from just before the call (the process's "
        "imports and the load of the lengths are excluded; the tables give both); **warm** = median of the "
        "repeated calls after it. Ratios = peer ÷ fastpack (`bfd`, default threads) for the same call: >1 means "
        "fastpack is faster. Memory = peak RSS growth during the first call (VmHWM after a `clear_refs` reset), "
        "bytes per input sequence, output included. TRL's `pack_dataset` builds the packed rows, not a plan: it is "
        "compared end to end with `fastpack.hf.pack_dataset` in `benches/bench_hf.py` "
        "(`benches/results/hf.md`), not here.\n"
    )
    if env.get("warning"):
        out.append(f"**WARNING: {env['warning']}.**\n")
    out.append("## Summary\n")
    out += render_summary(results)
    if previous is not None:
        penv = previous["env"]
        out.append(
            f"Earlier run, `{previous.get('command', '?')}` on {penv['cpu']}, started {penv['started_utc']}, "
            f"load average {penv['loadavg_start']} at the start, {penv['loadavg_end']} at the end "
            "(kept in this run's pack.json under `previous`):\n"
        )
        out += render_summary(previous["results"])
    for (dist, n), rows in _group(results).items():
        ok = [r for r in rows if "error" not in r]
        head = f"## {DIST_NAME[dist]}, N = {fmt_n(n)}"
        if ok:
            r0 = ok[0]
            head += (
                f" — {r0['total_tokens']:,} tokens, mean {r0['total_tokens'] / n:.0f}, "
                f"{r0['overlong']:,} ({100 * r0['overlong'] / n:.1f}%) longer than max_len, "
                f"{r0['items']:,} items after splitting, lower bound {-(-r0['total_tokens'] // args.max_len):,} packs"
            )
        out.append(head + "\n")
        out.append(
            "| tool | input | first call | ÷ fastpack | warm median (calls) | ÷ fastpack | warm min "
            "| core first / warm (no conversion) | packs | packs / LB | first-call mem (B/seq) "
            "| import · load (not timed) | load before |"
        )
        out.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        fp = next((r for r in ok if r["tool"] == REF), None)
        for r in rows:
            if "error" in r:
                out.append(f"| {r['tool']} | n/a ({r['error'].replace('|', '/')}) |" + " |" * 11)
                continue
            rf = fmt_r(r["first_s"] / fp["first_s"]) if fp else ""
            rw = fmt_r(r["warm_median_s"] / fp["warm_median_s"]) if fp else ""
            has = r.get("packs") is not None
            core = f"{fmt_t(r['core_first_s'])} / {fmt_t(r['core_warm_median_s'])}" if "core_first_s" in r else ""
            mem = f"{r['bytes_per_seq']:.1f}" if r.get("bytes_per_seq") is not None else "n/a"
            packs = f"{r['packs']:,} | {r['packs_over_lb']:.5f}" if has else "— | —"
            out.append(
                f"| {r['tool']} | {r.get('input', '')} | {fmt_t(r['first_s'])} | {rf} | "
                f"{fmt_t(r['warm_median_s'])} ({len(r['warm_s'])}) | {rw} | {fmt_t(r['warm_min_s'])} | {core} | "
                f"{packs} | {mem} | {fmt_t(r['import_s'])} · {fmt_t(r['load_s'])} | {r['load1_before']:.2f} |"
            )
        out.append("")
        notes = []
        srt = next((r for r in ok if r["tool"] == "numpy.sort"), None)
        if fp and srt:
            notes.append(
                f"fastpack = {fp['first_s'] / srt['first_s']:.2f}× numpy.sort (first call), "
                f"{fp['warm_median_s'] / srt['warm_median_s']:.2f}× (warm)"
            )
        if fp:
            for r in ok:
                if r.get("packs") is not None and r["packs"] < fp["packs"]:
                    notes.append(f"**{r['tool']} uses fewer packs than fastpack ({r['packs']:,} < {fp['packs']:,})**")
            if fp.get("overlong"):
                notes.append(
                    "fastpack splits the longer documents inside its call; the peers get pieces pre-split outside it"
                )
        if notes:
            out.append("Notes: " + "; ".join(notes) + ".\n")
    out.append(
        "Method: lengths from numpy `default_rng` with a fixed seed, generated once and stored as `.npy`; SFT-like = "
        "log-normal (mean ≈300, clipped to [1, max_len]); pretraining-like = 80% log-normal body (mean ≈600) + "
        "20% Pareto tail, clipped to [1, 131072]. fastpack runs with `shuffle=False` (placement order, as the peers "
        "return it). Every plan is verified: no pack over max_len, no empty pack, every item (fastpack: every "
        "token of every sample) placed exactly once. lightbinpack's time includes `ndarray.tolist()`, which its API "
        "needs; the core column leaves it out. seqpacker and lightbinpack `obfd`/`bfd` run on one thread; "
        "lightbinpack `obfdp` on up to all cores (OpenMP, from 5·10^5 items); fastpack `bfd` on the process's cores "
        "(`threads=None`), fastpack `threads=1` on one.\n"
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


def cpu_model() -> str:
    """`lscpu`'s "Model name" (what the results name the machine by); /proc/cpuinfo if lscpu is absent."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                             env={**os.environ, "LC_ALL": "C"}).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def git_describe() -> str | None:
    try:
        head = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(HERE), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + (" (uncommitted changes)" if dirty else "")) if head else None


def env_info() -> dict:
    versions = {}
    for mod in ["fastpack", "seqpacker", "lightbinpack"]:
        try:
            m = __import__(mod)
            versions[mod] = getattr(m, "__version__", "?")
        except Exception as e:  # noqa: BLE001
            versions[mod] = f"missing ({type(e).__name__})"
    return dict(
        cpu=cpu_model(),
        cores=dict(cpu_count=os.cpu_count(), usable=len(os.sched_getaffinity(0))),
        python=platform.python_version(),
        numpy=np.__version__,
        versions=versions,
        fastpack_build=fastpack_build(),
        git=git_describe(),
    )


def utc_now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1e6,1e7", help="comma-separated N (default 1e6,1e7)")
    ap.add_argument("--quick", action="store_true", help="N = 1e4,1e5 (smoke run)")
    ap.add_argument("--dists", default=",".join(DISTS))
    ap.add_argument("--tools", default=",".join(ALL_TOOLS))
    ap.add_argument("--max-len", type=int, default=MAX_LEN)
    ap.add_argument("--reps", type=int, default=7, help="most warm calls per row (default 7)")
    ap.add_argument("--min-warm", type=int, default=3, help="fewest warm calls per row (default 3)")
    ap.add_argument("--rep-budget", type=float, default=15.0,
                    help="stop repeating a row after this many seconds of warm calls, once --min-warm are done")
    ap.add_argument("--timeout", type=float, default=300.0, help="per-row subprocess timeout (s)")
    ap.add_argument("--out", default=str(HERE / "results" / "pack.md"))
    ap.add_argument("--previous", help="pack.json of an earlier run: its summary is shown beside this run's")
    ap.add_argument("--no-snapshot", action="store_true", help="import fastpack from the tree in every worker")
    ap.add_argument("--worker", nargs=8, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        tool, dist, rawp, piecep, max_len, reps, min_warm, budget = args.worker
        res = worker(tool, dist, rawp, piecep, int(max_len), int(reps), int(min_warm), float(budget))
        print(json.dumps(res))
        return

    if args.min_warm < 1 or args.reps < args.min_warm:
        ap.error("need 1 <= --min-warm <= --reps")
    sizes = [10**4, 10**5] if args.quick else [int(float(s)) for s in args.sizes.split(",")]
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    for t in tools:
        if t not in ALL_TOOLS:
            ap.error(f"unknown tool {t!r}; choose from {ALL_TOOLS}")
    dists = [d.strip() for d in args.dists.split(",")]
    for d in dists:
        if d not in DISTS:
            ap.error(f"unknown distribution {d!r}; choose from {DISTS}")
    previous = None
    if args.previous:
        previous = json.loads(Path(args.previous).read_text())
        previous["path"] = args.previous
    env = env_info()
    env["command"] = ("python benches/bench_pack.py " + " ".join(sys.argv[1:] if argv is None else argv)).strip()
    env["started_utc"] = utc_now()
    env["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
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
                        msg = f"first {fmt_t(r['first_s'])}, warm {fmt_t(r['warm_median_s'])}"
                        if r.get("packs") is not None:
                            msg += f", {r['packs']:,} packs ({r['packs_over_lb']:.5f}×LB)"
                        if r.get("bytes_per_seq") is not None:
                            msg += f", {r['bytes_per_seq']:.1f} B/seq"
                    print(
                        f"[{time.perf_counter() - t_start:6.1f}s] {dist:8s} N={fmt_n(n):>6s} {tool:18s} {msg}"
                        f"  (wall {time.perf_counter() - t0:.1f}s, load {r['load1_before']:.2f})",
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
    env["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    env["ended_utc"] = utc_now()
    md = render(results, args, env, previous)
    print(md)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md)
    blob = dict(command=env["command"], env=env, max_len=args.max_len, sizes=sizes, results=results)
    if previous is not None:
        blob["previous"] = {k: previous[k] for k in ("command", "env", "results", "path") if k in previous}
    out.with_suffix(".json").write_text(json.dumps(blob, indent=1))
    print(f"\nwrote {out} and {out.with_suffix('.json')}  ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
