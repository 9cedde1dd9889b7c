"""The formats ``fastpack pack --format`` writes, and its tokenize pass. Writes
benches/results/formats.md.

    python benches/bench_formats.py write      # each format's writer on the same packs
    python benches/bench_formats.py tokenize   # --text-column's pass vs encode_batch
    python benches/bench_formats.py megatron   # megatron's uint16 tokens against int32
    python benches/bench_formats.py all

``write``: one corpus (SFT-like lengths, int32 ids and labels) planned once; its packs
gathered once into record batches (as the command's gather pass hands them to a writer),
then written by each format's writer, best of ``BENCH_REPEATS`` (3): MB/s of output and
tokens/s. Also ``fastpack pack`` end to end per format (read, plan, gather, write).

``megatron``: the same documents with ids below 32,000 (a Llama-2-size vocabulary), which
``--token-dtype auto`` stores as uint16: the megatron writer with uint16 and with int32
tokens on the same batches, and ``fastpack pack --format megatron`` end to end with each.

``tokenize``: texts (CPython's standard library sources, one document per file piece) in
a parquet file; the tokenizer is a byte-level BPE trained here (tokenizers) and saved with
``save_pretrained``. The tokenizer's own ``encode_batch`` on the texts in memory against
the command's tokenize pass (``--text-column``: read the parquet file, tokenize through
the saved tokenizer, spill the ids to parquet) on the same texts.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cli import cpu, load, sft  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
REPEATS = int(os.environ.get("BENCH_REPEATS", "3"))


def _best(fn, repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _packed(docs: int, max_len: int, vocab: int) -> tuple[Any, ...]:
    """SFT-like documents with ids below ``vocab`` (labels: ids + 1), their plan and the
    record batches of the packs: (ids, labels, total tokens, settings, schema, plan,
    batches)."""
    import fastpack
    from fastpack._offline.gather import shard_batches
    from fastpack._offline.layout import output_schema
    from fastpack._offline.settings import PackSettings

    lengths = sft(docs, seed=0)
    total = int(lengths.sum())
    rng = np.random.default_rng(0)
    values = rng.integers(0, vocab - 1, total, dtype=np.int32)
    offsets = np.zeros(docs + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))
    labels = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values + 1))
    settings = PackSettings(max_len, columns=("labels",), seed=1)
    schema = output_schema(settings, {"input_ids": "int32", "labels": "int32"})
    plan = fastpack.pack(lengths, options=settings.options)
    batches = list(shard_batches({"input_ids": ids, "labels": labels}, plan, settings,
                                 schema))
    return ids, labels, total, settings, schema, plan, batches


def write_bench(docs: int = 100_000, max_len: int = 4096) -> list[str]:
    from fastpack._offline.driver import pack_corpus
    from fastpack._offline.formats import FORMATS, write_format_shard
    from fastpack._offline.settings import PackSettings

    ids, labels, total, settings, schema, plan, batches = _packed(docs, max_len, 128_000)
    lines = [
        "## Write throughput per format",
        "",
        f"{docs:,} SFT-like documents ({total:,} tokens, int32 `input_ids` and `labels`), "
        f"max len {max_len:,}: {plan.num_packs:,} packs, gathered once into "
        f"{len(batches)} record batches (as the gather pass hands them to a writer), then "
        "written as one shard by each format's writer to a local disk (page cache), "
        f"best of {REPEATS}. MB/s counts the bytes written (10^6 bytes/s); tokens/s the "
        "packed tokens.",
        "",
        "| format | files | bytes written | time | MB/s | tokens/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in FORMATS:
            out = Path(tmp) / fmt
            out.mkdir()
            entry: dict = {}

            def run(fmt: str = fmt, out: Path = out, entry: dict = entry) -> None:
                entry.clear()
                entry.update(write_format_shard(fmt, out, 0, 1, schema,
                                                settings.token_columns, plan.num_packs,
                                                iter(batches)))

            seconds = _best(run)
            size = sum(f["bytes"] for f in [entry, *entry.get("parts", [])])
            files = 1 + len(entry.get("parts", []))
            lines.append(f"| {fmt} | {files} | {size / 1e6:,.1f} MB | {seconds:.3f} s | "
                         f"{size / seconds / 1e6:,.0f} | {total / seconds / 1e6:,.1f} M |")
        lines += _mds_writer_row(Path(tmp), batches, Path(tmp) / "mds", total)
        lines += ["", "`fastpack pack` end to end (a parquet input of the same documents; "
                  "lengths, plan, gather and write; one run each):", "",
                  "| format | lengths | plan | gather + write | total | tokens/s |",
                  "|---|---:|---:|---:|---:|---:|"]
        source = Path(tmp) / "in.parquet"
        pq.write_table(pa.table({"input_ids": ids, "labels": labels}), source,
                       row_group_size=20_000)
        for fmt in FORMATS:
            report = pack_corpus([str(source)], Path(tmp) / f"cmd-{fmt}",
                                 PackSettings(max_len, columns=("labels",), seed=1,
                                              format=fmt), quiet=True, plot=False)
            s = report["run"]["seconds"]
            whole = sum(s.values())
            lines.append(f"| {fmt} | {s['lengths']:.2f} s | {s['plan']:.2f} s | "
                         f"{s['gather']:.2f} s | {whole:.2f} s | {total / whole / 1e6:.1f} M |")
    return lines


def megatron_bench(docs: int = 100_000, max_len: int = 4096) -> list[str]:
    from fastpack._offline.driver import pack_corpus
    from fastpack._offline.formats import write_format_shard
    from fastpack._offline.settings import PackSettings

    ids, labels, total, settings, schema, plan, batches = _packed(docs, max_len, 32_000)
    lines = [
        "## megatron: uint16 tokens (`--token-dtype auto`) against int32",
        "",
        f"The same {docs:,} documents ({total:,} tokens, {plan.num_packs:,} packs) with ids "
        "below 32,000 (a Llama-2-size vocabulary; labels = ids + 1), which `--token-dtype "
        "auto` stores as uint16, as Megatron's preprocessing does. The megatron writer on "
        f"the same {len(batches)} record batches, best of {REPEATS}, run in turn; then "
        f"`fastpack pack --format megatron` end to end (best of {REPEATS}, in turn).",
        "",
        "| tokens | bytes written | time | MB/s | tokens/s |",
        "|---|---:|---:|---:|---:|",
    ]
    times: dict[str, list[float]] = {"uint16": [], "int32": []}
    sizes: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(REPEATS):
            for dtype in times:
                out = Path(tmp) / dtype
                out.mkdir(exist_ok=True)
                stored = {"input_ids": dtype, "labels": dtype}
                start = time.perf_counter()
                entry = write_format_shard("megatron", out, 0, 1, schema,
                                           settings.token_columns, plan.num_packs,
                                           iter(batches), stored)
                times[dtype].append(time.perf_counter() - start)
                sizes[dtype] = sum(f["bytes"] for f in [entry, *entry["parts"]])
        for dtype, runs in times.items():
            seconds = min(runs)
            lines.append(f"| {dtype} | {sizes[dtype] / 1e6:,.1f} MB | {seconds:.3f} s | "
                         f"{sizes[dtype] / seconds / 1e6:,.0f} | {total / seconds / 1e6:,.1f} M |")
        lines += ["", "| `fastpack pack --format megatron` | lengths | plan | gather + write "
                  "| total | tokens/s | .bin + .idx bytes |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        source = Path(tmp) / "in.parquet"
        pq.write_table(pa.table({"input_ids": ids, "labels": labels}), source,
                       row_group_size=20_000)
        best: dict[str, dict[str, Any]] = {}
        for _ in range(REPEATS):  # in turn, the fastest run of each
            for dtype in ("auto", "int32"):
                report = pack_corpus(
                    [str(source)], Path(tmp) / f"cmd-{dtype}", PackSettings(
                        max_len, columns=("labels",), seed=1, format="megatron",
                        token_dtype=dtype), quiet=True, plot=False, overwrite=True)
                if dtype not in best or sum(report["run"]["seconds"].values()) < sum(
                        best[dtype]["run"]["seconds"].values()):
                    best[dtype] = report
        for dtype, report in best.items():
            s = report["run"]["seconds"]
            whole = sum(s.values())
            lines.append(f"| `--token-dtype {dtype}` | {s['lengths']:.2f} s | "
                         f"{s['plan']:.2f} s | {s['gather']:.2f} s | {whole:.2f} s | "
                         f"{total / whole / 1e6:.1f} M | {report['bytes'] / 1e6:,.1f} MB |")
    return lines


def _mds_writer_row(tmp: Path, batches: list, ours: Path, total: int) -> list[str]:
    """mosaicml-streaming's own MDSWriter on the same packs (where it is installed: the
    formats environment of requirements-formats.txt), its shard compared with ours."""
    try:
        from streaming import MDSWriter
    except ImportError:
        return ["", "(mosaicml-streaming not installed here: no `MDSWriter` row.)"]
    columns = {c: "ndarray:int32" for c in ("input_ids", "labels", "seq_lengths",
                                             "position_ids")}

    def run() -> None:
        with MDSWriter(columns=columns, out=str(tmp / "mdswriter"), size_limit=None,
                       exist_ok=True) as writer:
            for batch in batches:
                cols = {c: batch.column(c) for c in columns}
                for i in range(batch.num_rows):
                    writer.write({c: np.asarray(cols[c][i].values).astype(np.int32)
                                  for c in columns})

    seconds = _best(run)
    theirs = (tmp / "mdswriter" / "shard.00000.mds").read_bytes()
    same = theirs == (ours / "shard-00000-of-00001.mds").read_bytes()
    return [f"| mds by `streaming.MDSWriter` (a sample dict per pack) | 1 | "
            f"{len(theirs) / 1e6:,.1f} MB | {seconds:.3f} s | "
            f"{len(theirs) / seconds / 1e6:,.0f} | {total / seconds / 1e6:,.1f} M |",
            "", f"MDSWriter's shard is {'byte for byte' if same else 'NOT'} the same as "
            "fastpack's for these packs."]


def _texts(limit_bytes: int) -> list[str]:
    """CPython's standard library sources, cut into pieces of at most 8 KB (a document
    each), until ``limit_bytes``."""
    root = Path(os.__file__).parent
    texts: list[str] = []
    size = 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for k in range(0, len(text), 8192):
            texts.append(text[k:k + 8192])
            size += len(texts[-1])
        if size >= limit_bytes:
            break
    return texts


def tokenize_bench(megabytes: int = 8) -> list[str]:
    import tokenizers
    import transformers

    from fastpack._offline.scan import id_lists, load_tokenizer, tokenize_inputs
    from fastpack._offline.settings import PackSettings
    from fastpack._offline.sources import expand_inputs

    texts = _texts(megabytes << 20)
    nbytes = sum(len(t.encode()) for t in texts)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(texts[:2000], tokenizers.trainers.BpeTrainer(
        vocab_size=32_000, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        saved = Path(tmp) / "tokenizer"
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(saved)
        source = Path(tmp) / "texts.parquet"
        pq.write_table(pa.table({"text": texts}), source)
        tokens = sum(len(e.ids) for e in tok.encode_batch(texts))
        hf = load_tokenizer(str(saved)).encode
        settings = PackSettings(4096, text_column="text", tokenizer=str(saved))
        sources = expand_inputs([str(source)])

        def run_pass() -> None:
            spill = Path(tempfile.mkdtemp(dir=tmp))
            tokenize_inputs(sources, settings, spill, quiet=True)

        # Round robin, best of each: the load of a shared machine moves within seconds.
        times: dict[str, list[float]] = {"encode": [], "call": [], "pass": []}
        for _ in range(REPEATS):
            times["encode"].append(_best(lambda: tok.encode_batch(texts), 1))
            times["call"].append(_best(lambda: hf(texts), 1))
            times["pass"].append(_best(run_pass, 1))
        encode, call, whole = (min(times[k]) for k in ("encode", "call", "pass"))
        lists = [e.ids for e in tok.encode_batch(texts)]
        arrow = _best(lambda: pa.array(lists, type=pa.list_(pa.int32())))
        numpy_way = _best(lambda: id_lists(lists))
        loading = _best(lambda: load_tokenizer(str(saved)))
    rows = [("`Tokenizer.encode_batch` (tokenizers, in memory)", encode),
            ("the tokenizer as the pass calls it (`AutoTokenizer(texts)`, in memory)", call),
            ("`fastpack pack --text-column` tokenize pass (read parquet, tokenize, spill "
             "ids to parquet)", whole)]
    lines += [
        "## The tokenize pass against the tokenizer's own batch call",
        "",
        f"{len(texts):,} documents ({nbytes / 1e6:.1f} MB of CPython standard-library "
        f"source, {tokens:,} tokens), a byte-level BPE of 32,000 ids trained here; "
        f"best of {REPEATS}, run in turn. tokenizers' batch call runs on every core; "
        "the pass turns the id lists into Arrow through numpy (`scan.id_lists`).",
        "",
        "| what | time | MB/s of text | tokens/s | time / encode_batch |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, seconds in rows:
        lines.append(f"| {name} | {seconds:.2f} s | {nbytes / seconds / 1e6:.1f} | "
                     f"{tokens / seconds / 1e6:.2f} M | {seconds / encode:.2f} |")
    lines += [
        "",
        f"Of the pass's time, {loading:.2f} s is loading the tokenizer "
        "(`AutoTokenizer.from_pretrained`, once per run): without it the pass takes "
        f"{(whole - loading) / encode:.2f}x `encode_batch`'s time. Turning the id lists "
        f"into Arrow costs {numpy_way:.3f} s through numpy (`id_lists`, "
        f"{numpy_way / encode:.1%} of `encode_batch`); `pa.array` on the lists of Python "
        f"ints, as before, {arrow:.3f} s once warm (its first call in a process costs about "
        "0.5 s more).",
    ]
    return lines


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    started = load()
    lines = ["# Formats trainers read, and the tokenize pass", "",
             f"{cpu()}, Python {sys.version.split()[0]}; `python benches/bench_formats.py "
             f"{what}`.", ""]
    if what in ("write", "all"):
        lines += write_bench() + [""]
    if what in ("megatron", "all"):
        lines += megatron_bench() + [""]
    if what in ("tokenize", "all"):
        lines += tokenize_bench() + [""]
    lines.append(f"Load average at start: {started}; at end: {load()}.")
    text = "\n".join(lines) + "\n"
    print(text)
    if what == "all":
        (RESULTS / "formats.md").write_text(text)


if __name__ == "__main__":
    main()
