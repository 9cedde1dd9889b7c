#!/usr/bin/env python
"""Vision-language packing: mRoPE positions, planning under several budgets, and what
packing saves over padding on a realistic mix.

    python benches/bench_vlm.py                         # writes benches/results/vlm.md
    python benches/bench_vlm.py --quick                 # small sizes (a smoke run)
    python benches/bench_vlm.py --main-site DIR         # adds main's build of fastpack
                                                        # (installed in DIR) to section 2

1. **Positions** of a batch of 64 documents with images (and a few videos), Qwen2-VL:
   ``fastpack.vlm.position_ids`` (one Rust call, documents in parallel) against calling
   the model's ``get_rope_index`` once per document, as ms-swift, LLaMA-Factory and
   NeMo-Automodel do (a tiny model: ``get_rope_index`` reads only the config's merge
   size, so its cost is the real one). Also the media sizes of 10^6 images from their
   heights and widths: ``fastpack.vlm.media_tokens`` against the image processor's
   ``get_number_of_image_patches`` per image.
2. **Planning 10^6 multimodal items** (the mix below) with tokens only, and with tokens
   plus patches and images: each variant in fresh processes, the first call and the warm
   median; packs against each budget's lower bound. With ``--main-site``, main's build
   plans the same lengths with tokens only (the one-budget path before and after).
3. **Padding vs packing** on the mix: padded batches of 8 (each row as long as its
   longest sample) against packs of ``max_len`` within the budgets.

The mix (fixed seed): 50% captions (20-120 text tokens, one image), 20% documents with 2-4
images (100-800 text tokens), 10% videos (16-32 frames of 336x448, 50-300 text tokens),
20% text only (100-3000 tokens); image sizes drawn from common photo and screen shapes
(224-2048 px a side), each image's tokens and patches from ``media_tokens`` with the
Qwen2-VL processor's defaults (patch 14, merge 2, 56*56 to 28*28*1280 pixels). Packs:
8192 tokens, 32768 patches (the vision encoder's varlen batch), 16 images.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
MAX_LEN, MAX_PATCHES, MAX_IMAGES = 8192, 32768, 16


def cpu() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def processor():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.Qwen2VLImageProcessor()


# ------------------------------------------------------------------ the mix
KINDS = (0.5, 0.2, 0.1, 0.2)  # captions, multi-image documents, videos, text only


def mix(n: int, seed: int = 0, kinds: tuple[float, ...] = KINDS) -> dict[str, np.ndarray]:
    """``n`` items: their token lengths (text + placeholders), vision patches, images;
    ``kinds`` the share of each kind of item (the module docs' mix by default)."""
    import fastpack.vlm as vlm

    rng = np.random.default_rng(seed)
    kind = rng.choice(4, size=n, p=list(kinds))  # caption, multi-image, video, text
    images = np.where(kind == 0, 1, np.where(kind == 1, rng.integers(2, 5, n), 0))
    shapes = np.array([(480, 640), (640, 480), (375, 500), (1080, 1920), (768, 1024),
                       (224, 224), (1024, 1024), (2048, 1536), (720, 1280), (600, 800)])
    which = rng.integers(0, len(shapes), int(images.sum()))
    jitter = rng.integers(-32, 33, (int(images.sum()), 2))
    sizes = np.clip(shapes[which] + jitter, 32, None)
    media = vlm.media_tokens(sizes[:, 0], sizes[:, 1], processor())
    owner = np.repeat(np.arange(n), images)
    image_tokens = np.bincount(owner, weights=media.tokens, minlength=n).astype(np.int64)
    image_patches = np.bincount(owner, weights=media.patches, minlength=n).astype(np.int64)
    # Videos: 16-32 frames of 336x448, two frames a temporal patch: 12x16 tokens each.
    frames = np.where(kind == 2, rng.integers(16, 33, n), 0)
    video_patches = np.where(kind == 2, -(-frames // 2) * 24 * 32, 0)
    text = np.select([kind == 0, kind == 1, kind == 2],
                     [rng.integers(20, 121, n), rng.integers(100, 801, n),
                      rng.integers(50, 301, n)], rng.integers(100, 3001, n))
    lengths = text + image_tokens + video_patches // 4 + 2 * (images + (kind == 2))
    return {"lengths": lengths.astype(np.int64), "patches": image_patches + video_patches,
            "images": images.astype(np.int64)}


# ------------------------------------------------------------------ 1. positions
def positions(quick: bool) -> dict:
    import torch
    import transformers

    import fastpack.vlm as vlm

    config = transformers.Qwen2VLConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2),
        image_token_id=60, video_token_id=61)
    config.text_config.bos_token_id = config.text_config.eos_token_id = None
    model = transformers.Qwen2VLForConditionalGeneration(config)
    rng = np.random.default_rng(1)
    docs, images, videos = [], [], []
    for d in range(64):
        ids = list(rng.integers(1, 50, int(rng.integers(50, 400))))
        grids = []
        for _ in range(int(rng.integers(1, 4))):
            g = [1, 2 * int(rng.integers(8, 40)), 2 * int(rng.integers(8, 40))]
            grids.append(g)
            ids += [62] + [60] * (g[1] * g[2] // 4) + [63] + list(rng.integers(1, 50, 20))
        video = None
        if d % 8 == 0:
            video = [int(rng.integers(4, 16)), 24, 32]
            ids += [62] + [61] * (video[0] * 24 * 32 // 4) + [63]
        docs.append((np.array(ids), np.array(grids), None if video is None else np.array([video])))
        images += grids
        if video is not None:
            videos.append(video)
    ids = np.concatenate([d[0] for d in docs])
    cu = np.concatenate(([0], np.cumsum([len(d[0]) for d in docs])))
    image_grid, video_grid = np.array(images), np.array(videos)

    def ours(threads):
        return vlm.position_ids(config, ids, cu, image_grid_thw=image_grid,
                                video_grid_thw=video_grid, threads=threads)

    def theirs():
        out = []
        for doc_ids, grids, video in docs:
            t = torch.as_tensor(doc_ids)[None]
            types = (t == 60).int() + 2 * (t == 61).int()
            pos, _ = model.model.get_rope_index(
                t, types, image_grid_thw=torch.as_tensor(grids),
                video_grid_thw=None if video is None else torch.as_tensor(video))
            out.append(pos[:, 0])
        return out

    want = torch.cat(theirs(), dim=1).numpy()
    assert np.array_equal(ours(None)[1:], want)  # the same positions
    reps = 5 if quick else 21
    times = {}
    for name, call in (("fastpack", lambda: ours(None)), ("fastpack-2t", lambda: ours(2)),
                       ("get_rope_index", theirs)):
        call()
        samples = []
        for _ in range(reps if name != "get_rope_index" else max(3, reps // 3)):
            t0 = time.perf_counter()
            call()
            samples.append(time.perf_counter() - t0)
        times[name] = statistics.median(samples)
    # Media sizes from heights and widths.
    n = 10**5 if quick else 10**6
    rng = np.random.default_rng(2)
    h, w = rng.integers(64, 2048, n), rng.integers(64, 2048, n)
    proc = processor()
    t0 = time.perf_counter()
    got = vlm.media_tokens(h, w, proc)
    ours_sizes = time.perf_counter() - t0
    k = 20000
    t0 = time.perf_counter()
    ref = [proc.get_number_of_image_patches(int(a), int(b)) for a, b in zip(h[:k], w[:k])]
    theirs_sizes = (time.perf_counter() - t0) * n / k
    assert got.patches[:k].tolist() == ref
    return {"tokens": int(len(ids)), "images": len(images), "videos": len(videos),
            "times": times, "media_n": n, "media_ours": ours_sizes,
            "media_theirs": theirs_sizes, "load": load()}


# ------------------------------------------------------------------ 2. planning
def worker(variant: str, path: str, reps: int, max_len: int, overlong: str) -> None:
    data = np.load(path)
    import fastpack

    lengths = data["lengths"]
    limits = None
    if variant == "three budgets":
        limits = {"patches": (data["patches"], MAX_PATCHES), "images": (data["images"],
                                                                       MAX_IMAGES)}
    kwargs: dict = {"shuffle": False, "overlong": overlong}
    if limits is not None:
        kwargs["limits"] = limits
    t0 = time.perf_counter()
    plan = fastpack.pack(lengths, max_len, **kwargs)
    first = time.perf_counter() - t0
    warm = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fastpack.pack(lengths, max_len, **kwargs)
        warm.append(time.perf_counter() - t0)
    out = {"first": first, "warm": statistics.median(warm), "packs": plan.num_packs,
           "token_bound": plan.lower_bound, "efficiency": plan.efficiency,
           "dropped": plan.dropped_sequences,
           "limits": {k: [v.lower_bound, v.total, v.max_used]
                      for k, v in getattr(plan, "limits", {}).items()},
           "fastpack": os.path.dirname(fastpack.__file__)}
    print(json.dumps(out))


def run_variants(variants: list[tuple[str, str, str | None, int, str]], reps: int,
                 rounds: int) -> dict[str, list[dict]]:
    """``(name, data path, fastpack site or None, max_len, overlong)`` each in ``rounds``
    fresh processes, interleaved so the shared machine's load hits all alike."""
    runs: dict[str, list[dict]] = {v[0]: [] for v in variants}
    for _ in range(rounds):
        for name, path, site, max_len, overlong in variants:
            env = dict(os.environ)
            if site:
                env["PYTHONPATH"] = site
            variant = "three budgets" if name.startswith("three") else "one budget"
            cmd = [sys.executable, __file__, "--worker", variant, path, str(reps),
                   str(max_len), overlong]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    return runs


def before_after(n: int, reps: int, rounds: int, main_site: str) -> dict:
    """The one-budget path on bench_pack.py's distributions: this build against main's."""
    sys.path.insert(0, str(HERE))
    from bench_pack import gen_lengths

    out = {}
    tmp = tempfile.mkdtemp()
    for dist, overlong in (("sft", "error"), ("pretrain", "split")):
        path = os.path.join(tmp, f"{dist}.npz")
        np.savez(path, lengths=gen_lengths(dist, n, 4096).astype(np.int64))
        runs = run_variants([(f"{dist} (this branch)", path, None, 4096, overlong),
                             (f"{dist} (main)", path, main_site, 4096, overlong)], reps, rounds)
        for name, rs in runs.items():
            out[name] = {"first": statistics.median(r["first"] for r in rs),
                         "warm": statistics.median(r["warm"] for r in rs),
                         "packs": rs[0]["packs"], "fastpack": rs[0]["fastpack"]}
    out["load"] = load()
    return out


def planning(n: int, reps: int, rounds: int, main_site: str | None) -> dict:
    data = mix(n)
    path = os.path.join(tempfile.mkdtemp(), "mix.npz")
    np.savez(path, **data)
    variants: list[tuple[str, str, str | None, int, str]] = [
        ("one budget", path, None, MAX_LEN, "drop"), ("three budgets", path, None, MAX_LEN, "drop")]
    if main_site:
        variants.append(("one budget (main)", path, main_site, MAX_LEN, "drop"))
    runs = run_variants(variants, reps, rounds)
    result = {}
    for name, rs in runs.items():
        result[name] = {
            "first": statistics.median(r["first"] for r in rs),
            "warm": statistics.median(r["warm"] for r in rs),
            **{k: rs[0][k] for k in ("packs", "token_bound", "efficiency", "dropped", "limits",
                                     "fastpack")},
        }
    result["n"] = n
    result["totals"] = {k: int(v.sum()) for k, v in data.items()}
    result["load"] = load()
    return result


# ------------------------------------------------------------------ 3. padding vs packing
def padding(n: int) -> dict:
    import fastpack

    data = mix(n, seed=3)
    lengths = np.minimum(data["lengths"], MAX_LEN)
    keep = (data["patches"] <= MAX_PATCHES) & (data["images"] <= MAX_IMAGES)
    lengths, patches, images = lengths[keep], data["patches"][keep], data["images"][keep]
    rng = np.random.default_rng(4)
    order = rng.permutation(len(lengths))
    batches = lengths[order][: len(lengths) // 8 * 8].reshape(-1, 8)
    padded = batches.sum() / (batches.max(axis=1) * 8).sum()
    plan = fastpack.pack(lengths, MAX_LEN, limits={"patches": (patches, MAX_PATCHES),
                                                   "images": (images, MAX_IMAGES)})
    text_only = fastpack.pack(lengths, MAX_LEN)
    return {"n": int(len(lengths)), "padded": float(padded), "packed": plan.efficiency,
            "packs": plan.num_packs, "rows_padded": int(len(batches) * 8),
            "bounds": {k: v.lower_bound for k, v in plan.limits.items()},
            "token_bound": plan.lower_bound, "tokens_only_packs": text_only.num_packs,
            "patch_use": plan.limits["patches"].total / (plan.num_packs * MAX_PATCHES)}


def ms(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 10 else f"{x:.2f} s"


def before_after_lines(ba: dict | None) -> list[str]:
    if not ba:
        return []
    lines = [
        "The one-budget path before and after this change, on bench_pack.py's "
        "distributions (max_len 4096; fresh processes, interleaved; load "
        f"{ba['load']} at the end):",
        "",
        "| lengths | main: first / warm | this branch: first / warm | warm ratio | packs |",
        "|---|---:|---:|---:|---:|",
    ]
    for dist in ("sft", "pretrain"):
        old, new = ba[f"{dist} (main)"], ba[f"{dist} (this branch)"]
        assert old["packs"] == new["packs"]
        lines.append(f"| {dist}-like | {ms(old['first'])} / {ms(old['warm'])} | "
                     f"{ms(new['first'])} / {ms(new['warm'])} | "
                     f"{new['warm'] / old['warm']:.2f}× | {new['packs']:,} |")
    return [*lines, ""]


def report(pos: dict, plan: dict, pad: dict, started: str, args: argparse.Namespace) -> str:
    t = pos["times"]
    lines = [
        "# Vision-language packing: positions, several budgets, padding vs packing",
        "",
        f"Machine: **{cpu()}**, {os.cpu_count()} logical CPUs, shared with other users; load "
        f"average (1/5/15 min) {started} at the start, {load()} at the end. Python "
        f"{platform.python_version()}, numpy {np.__version__}. Command: `python "
        f"benches/bench_vlm.py{' --quick' if args.quick else ''}"
        f"{' --main-site ...' if args.main_site else ''}`.",
        "",
        "## 1. Positions of 64 documents (Qwen2-VL)",
        "",
        f"{pos['tokens']:,} tokens, {pos['images']} images, {pos['videos']} videos; the same "
        f"positions (checked). Median of repeated calls in one process (load {pos['load']}).",
        "",
        "| | time | ÷ fastpack |",
        "|---|---:|---:|",
        f"| `fastpack.vlm.position_ids` (one call; default: one thread below 2^18 tokens) | "
        f"{ms(t['fastpack'])} | 1.00× |",
        f"| `fastpack.vlm.position_ids`, `threads=2` | {ms(t['fastpack-2t'])} | "
        f"{t['fastpack-2t'] / t['fastpack']:.2f}× |",
        f"| `model.get_rope_index` per document (the peers) | {ms(t['get_rope_index'])} | "
        f"{t['get_rope_index'] / t['fastpack']:.0f}× |",
        "",
        f"Media sizes of {pos['media_n']:,} images from their heights and widths: "
        f"`fastpack.vlm.media_tokens` {ms(pos['media_ours'])}; the processor's "
        f"`get_number_of_image_patches` per image {ms(pos['media_theirs'])} (20,000 timed, "
        f"scaled), {pos['media_theirs'] / pos['media_ours']:.0f}× longer; the same counts.",
        "",
        f"## 2. Planning {plan['n']:,} multimodal items",
        "",
        f"{plan['totals']['lengths']:,} tokens, {plan['totals']['patches']:,} patches, "
        f"{plan['totals']['images']:,} images; packs of {MAX_LEN} tokens, {MAX_PATCHES} "
        f"patches, {MAX_IMAGES} images. Each variant runs in {args.rounds} fresh processes "
        f"(interleaved): first call (median over processes) and warm median of "
        f"{args.reps} calls each; load {plan['load']} at the end of the section.",
        "",
        "| plan | first call | warm | ÷ one budget (warm) | packs | tokens bound | "
        "patches bound | images bound | efficiency | dropped |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = plan["one budget"]["warm"]
    for name in ("one budget", "one budget (main)", "three budgets"):
        if name not in plan:
            continue
        r = plan[name]
        lim = r["limits"]
        patches = f"{lim['patches'][0]:,}" if lim else "—"
        images = f"{lim['images'][0]:,}" if lim else "—"
        lines.append(
            f"| {name} | {ms(r['first'])} | {ms(r['warm'])} | {r['warm'] / base:.2f}× | "
            f"{r['packs']:,} | {r['token_bound']:,} | {patches} | {images} | "
            f"{r['efficiency']:.4f} | {r['dropped']:,} |")
    lines += [
        "",
        "Packs / the largest bound: one budget "
        f"{plan['one budget']['packs'] / plan['one budget']['token_bound']:.5f} (tokens only, "
        f"its packs then break the patch and image caps); three budgets "
        f"{plan['three budgets']['packs'] / max(plan['three budgets']['token_bound'], *[v[0] for v in plan['three budgets']['limits'].values()]):.5f}.",
        "",
        *before_after_lines(plan.get("before_after")),
        f"## 3. Padding vs packing ({pad['n']:,} items of the mix)",
        "",
        "| | rows | token efficiency |",
        "|---|---:|---:|",
        f"| padded batches of 8 (each row as long as its batch's longest) | "
        f"{pad['rows_padded']:,} | {pad['padded']:.4f} |",
        f"| packed, three budgets | {pad['packs']:,} | {pad['packed']:.4f} |",
        "",
        f"Packed rows: {pad['packs']:,} against bounds of {pad['token_bound']:,} (tokens), "
        f"{pad['bounds']['patches']:,} (patches), {pad['bounds']['images']:,} (images); "
        f"tokens only would take {pad['tokens_only_packs']:,} packs but overflow the vision "
        f"encoder's budget. The packs use {pad['patch_use']:.1%} of their patch budget.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--n", type=float, default=1e6)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--main-site", help="a directory with main's build of fastpack")
    ap.add_argument("--out", default=str(HERE / "results" / "vlm.md"))
    ap.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        w = args.worker
        worker(w[0], w[1], int(w[2]), int(w[3]), w[4])
        return
    started = load()
    n = 10**5 if args.quick else int(args.n)
    pos = positions(args.quick)
    plan = planning(n, args.reps, args.rounds, args.main_site)
    if args.main_site:
        plan["before_after"] = before_after(n, args.reps, args.rounds, args.main_site)
    pad = padding(10**5 if args.quick else 2 * 10**5)
    text = report(pos, plan, pad, started, args)
    Path(args.out).write_text(text)
    Path(args.out).with_suffix(".json").write_text(json.dumps(
        {"positions": pos, "planning": plan, "padding": pad}, indent=1, default=str))
    print(text)


if __name__ == "__main__":
    main()
