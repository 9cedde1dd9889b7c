"""The ``fastpack`` command end to end: demo, stats and pack on files made here (parquet,
JSON lines plain/gz/zst, a saved dataset), interruption and resume, every bad input, and
packing a corpus larger than the process may address."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa  # a dependency: the command reads every input with it
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from corpus import (
    assert_same_output,
    check_output,
    cli,
    corpus,
    documents,
    read_rows,
    shard_bytes,
    write,
)
from crashing import crash_after
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastpack
from fastpack import PackOptions
from fastpack._offline.driver import pack_corpus
from fastpack._offline.plan import file_keys, sharded_plan
from fastpack._offline.settings import PackSettings
from fastpack.cli import main

# The base install (CI runs these tests in a venv of the wheel alone) has neither datasets
# (directories written by save_to_disk) nor matplotlib (pictures).
HAS_DATASETS = importlib.util.find_spec("datasets") is not None
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
needs_matplotlib = pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib not installed")
SAVED = "e.ds" if HAS_DATASETS else "e.jsonl"  # a saved dataset where datasets is there
FORMATS = ["a.parquet", "b.jsonl", "c.jsonl.gz", "d.jsonl.zst", SAVED]


def lengths_for(seed: int, files: int, n: int, top: int = 300) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, top, n).tolist() for _ in range(files)]


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


# ---------------------------------------------------------------------------------------
# the command itself


def test_help_explains_every_subcommand():
    out = cli("--help")
    assert out.returncode == 0
    for name in ("demo", "stats", "pack"):
        assert name in out.stdout
    script = Path(sys.executable).with_name("fastpack")
    if script.exists():  # the console script [project.scripts] installs
        pack_help = subprocess.run([str(script), "pack", "--help"], capture_output=True,
                                   text=True, check=True).stdout
        for option in ("--max-len", "--overlong", "--shard-rows", "--resume", "--ray",
                       "--memory", "--text-column", "--tokenizer", "--shuffle"):
            assert option in pack_help


def test_import_fastpack_stays_light():
    code = ("import sys, fastpack; heavy = [m for m in ('click', 'tqdm', 'pyarrow', 'ray', "
            "'matplotlib', 'fastpack.cli', 'torch') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


@needs_matplotlib
def test_demo_runs_and_plots(tmp_path):
    out = cli("demo", "--max-len", "2048", "--plot", str(tmp_path / "demo.png"))
    assert out.returncode == 0, out.stderr
    assert "fastpack.pack(strategy='bfd')" in out.stdout
    assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------
# stats


def test_stats_compares_every_method(tmp_path):
    lengths = lengths_for(1, 3, 200, top=700)
    paths, docs = corpus(tmp_path, lengths, ["a.parquet", "b.jsonl.zst", SAVED])
    all_lengths = np.array([len(d) for d in docs])
    plot = ["--plot", str(tmp_path / "s.png")] if HAS_MATPLOTLIB else []
    out = cli("stats", *paths, "--max-len", "256,512", "--json", *plot)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["lengths"]["documents"] == len(docs)
    assert report["lengths"]["tokens"] == all_lengths.sum()
    assert report["lengths"]["p50"] == np.percentile(all_lengths, 50, method="higher")
    assert report["lengths"]["max"] == all_lengths.max()
    for row in report["caps"]:
        cap = row["cap"]
        pieces = sum(-(-n // cap) for n in all_lengths)
        tokens = int(all_lengths.sum())
        assert row["pad_to_cap"] == {"rows": pieces, "efficiency": tokens / (pieces * cap)}
        for strategy in ("bfd", "next_fit"):
            plan = fastpack.pack(all_lengths, cap, strategy=strategy, overlong="split")
            assert row[strategy]["rows"] == plan.num_packs
            assert row[strategy]["efficiency"] == pytest.approx(plan.efficiency)
        assert row["lower_bound"]["rows"] == -(-tokens // cap)
        # Bucketing pads sorted batches: never worse than random batches, which are never
        # worse than padding to the cap; best fit is at most a few rows over the bound.
        eff = {k: row[k]["efficiency"] for k in ("pad_to_cap", "pad_per_batch", "bucketing")}
        assert eff["pad_to_cap"] <= eff["pad_per_batch"] <= eff["bucketing"] <= 1
        assert row["lower_bound"]["rows"] <= row["bfd"]["rows"] <= row["next_fit"]["rows"]
    if HAS_MATPLOTLIB:
        assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
    code, table = invoke("stats", *paths, "--max-len", "256", "--quiet")
    assert code == 0
    assert "pack best-fit decreasing" in table and "length bucketing" in table
    assert f"{len(docs):,} documents" in table


# ---------------------------------------------------------------------------------------
# pack


def test_pack_every_format_end_to_end(tmp_path):
    lengths = lengths_for(2, len(FORMATS), 60, top=400)
    paths, docs = corpus(tmp_path, lengths, FORMATS, labels=True)
    out_dir = tmp_path / "out"
    out = cli("pack", *paths, "-o", str(out_dir), "--max-len", "256", "--overlong", "split",
              "--shuffle", "--seed", "3", "--shard-rows", "16", "--columns", "labels")
    assert out.returncode == 0, out.stderr
    rows = check_output(out_dir, docs, max_len=256, overlong="split", labels=True)
    # Exactly the plan fastpack.pack makes over the lengths in fastpack's order.
    lengths_all = np.array([len(d) for d in docs])
    plan = fastpack.pack(lengths_all, 256, overlong="split", shuffle=True, seed=3)
    assert rows.num_rows == plan.num_packs
    for p in range(0, plan.num_packs, 7):
        ids, starts, seqlens = plan.segments(p)
        expected = np.concatenate([docs[i][s:s + n] for i, s, n in zip(ids, starts, seqlens)])
        assert rows.column("input_ids")[p].as_py() == expected.tolist()
        assert rows.column("seq_lengths")[p].as_py() == seqlens.tolist()
    # int32 when every id fits, whatever the format (JSON has no widths).
    assert rows.schema.field("input_ids").type.value_type == pa.int32()
    report = json.loads((out_dir / "report.json").read_text())
    assert report["packs"] == plan.num_packs and report["lower_bound"] == plan.lower_bound
    assert report["split"]["documents"] == int((lengths_all > 256).sum()) > 0
    assert report["input_tokens"] == report["packed_tokens"] == lengths_all.sum()
    assert (out_dir / "report.png").exists() == HAS_MATPLOTLIB
    assert not (out_dir / ".fastpack").exists()
    assert sorted(p.name for p in out_dir.glob("shard-*")) == [
        f"shard-{i:05d}-of-{report['shards']:05d}.parquet" for i in range(report["shards"])]
    # Progress went to stderr, the honest summary to stdout.
    assert "fastpack: lengths:" in out.stderr and "fastpack: gather" in out.stderr
    assert f"packs over the lower bound: {plan.num_packs - plan.lower_bound}" in out.stdout
    assert f"split: {report['split']['tokens']:,}" in out.stdout
    # The shards load as a Hugging Face dataset with TRL's columns.
    if not HAS_DATASETS:
        return
    import datasets

    ds = datasets.load_dataset("parquet", data_files=str(out_dir / "shard-*.parquet"),
                               split="train")
    assert ds.column_names == ["input_ids", "labels", "seq_lengths", "position_ids"]
    assert len(ds) == plan.num_packs


def test_quiet_prints_the_summary_only(tmp_path):
    paths, _ = corpus(tmp_path, [[5, 9, 3]], ["a.parquet"])
    out = cli("pack", *paths, "-o", str(tmp_path / "out"), "--max-len", "16", "-q",
              "--no-plot")
    assert out.returncode == 0 and out.stderr == ""
    assert "packed 3 documents, 17 tokens -> 2 packs of 16" in out.stdout


@pytest.mark.parametrize("options", [
    {"overlong": "truncate"},
    {"overlong": "drop", "strategy": "ffd"},
    {"overlong": "split", "long_max_len": 512, "group_tokens": 1024},
    {"strategy": "next_fit", "overlong": "split"},
    {"strategy": "wrapped"},
])
def test_pack_policies_account_for_every_token(tmp_path, options):
    paths, docs = corpus(tmp_path, lengths_for(3, 2, 80, top=900), ["a.parquet", "b.jsonl"])
    s = PackSettings(max_len=256, shard_rows=20, **options)
    report = pack_corpus(paths, tmp_path / "out", s, quiet=True, plot=False)
    lengths = np.array([len(d) for d in docs])
    if options.get("strategy") == "wrapped":  # cut anywhere: check tokens only
        rows = pa.concat_tables(pq.read_table(p) for p in sorted((tmp_path / "out").glob(
            "shard-*")))
        flat = np.concatenate([np.asarray(r, dtype=np.int64) for r in
                               rows.column("input_ids").to_pylist()])
        assert np.array_equal(np.sort(flat), np.sort(np.concatenate(docs)))
        return
    check_output(tmp_path / "out", docs, max_len=256, overlong=options.get("overlong", "error"),
                 long_max_len=options.get("long_max_len"))
    cap = options.get("long_max_len", 256)
    long = lengths > cap
    assert report["truncated"]["tokens"] == (
        int((lengths[long] - cap).sum()) if options.get("overlong") == "truncate" else 0)
    assert report["dropped"]["tokens"] == (
        int(lengths[long].sum()) if options.get("overlong") == "drop" else 0)
    assert report["packed_tokens"] + report["dropped"]["tokens"] + \
        report["truncated"]["tokens"] == lengths.sum()
    if "group_tokens" in options:
        offsets = np.load(tmp_path / "out" / "group_offsets.npy")
        assert offsets[-1] == report["packs"] and report["groups"]["groups"] == len(offsets) - 1


def test_same_input_same_bytes_whatever_the_memory_budget(tmp_path):
    paths, docs = corpus(tmp_path, lengths_for(4, 3, 150), ["a.parquet", "b.jsonl.gz", SAVED],
                         labels=True)
    s = PackSettings(max_len=512, shard_rows=10, columns=("labels",), shuffle=True, seed=9)
    one = pack_corpus(paths, tmp_path / "one", s, quiet=True, plot=False)
    again = pack_corpus(paths, tmp_path / "again", s, quiet=True, plot=False)
    tight = pack_corpus(paths, tmp_path / "tight", s, memory=20_000, quiet=True, plot=False)
    reread = pack_corpus(paths, tmp_path / "reread", s, memory=20_000, spill=False,
                         quiet=True, plot=False)
    assert len(shard_bytes(tmp_path / "one")) == one["shards"] > 3
    # The whole directory, report.json included: only run.json says how it was written.
    for name in ("again", "tight", "reread"):
        assert_same_output(tmp_path / name, tmp_path / "one")
    runs = [r["run"] for r in (one, again, tight, reread)]
    assert runs[0]["passes"] == runs[1]["passes"] == 1 and runs[2]["passes"] >= 5
    assert runs[2]["spilled"] and not runs[3]["spilled"] and runs[3]["passes"] == runs[2]["passes"]
    assert json.loads((tmp_path / "tight" / "run.json").read_text()) == runs[2]
    assert "passes" not in json.loads((tmp_path / "tight" / "report.json").read_text())
    check_output(tmp_path / "tight", docs, max_len=512, labels=True)


def test_interrupted_run_is_detected_and_resumed(tmp_path):
    paths, docs = corpus(tmp_path, lengths_for(5, 2, 200, top=250), ["a.parquet", "b.jsonl.zst"])
    args = [*paths, "--max-len", "256", "--shard-rows", "20", "--no-plot"]
    clean = tmp_path / "clean"
    assert cli("pack", *args, "-o", str(clean), "-q").returncode == 0
    out_dir = tmp_path / "out"
    crashed = crash_after(3, "pack", *args, "-o", str(out_dir), "-q")
    assert crashed.returncode == -9  # killed halfway through the fourth shard
    assert not (out_dir / "manifest.json").exists()
    assert len(list(out_dir.glob("shard-*.parquet"))) == 3
    assert list(out_dir.glob(".shard-*.tmp"))  # the half-written one, under a hidden name
    kept = {p.name: p.stat().st_mtime_ns for p in out_dir.glob("shard-*.parquet")}
    again = cli("pack", *args, "-o", str(out_dir))
    assert again.returncode == 2 and "interrupted run (3 shards complete)" in again.stderr
    assert "--resume" in again.stderr
    other = cli("pack", *paths, "--max-len", "512", "-o", str(out_dir), "--resume")
    assert other.returncode == 2 and "used other settings" in other.stderr
    resumed = cli("pack", *args, "-o", str(out_dir), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "resume: 3 of" in resumed.stderr
    assert {n: (out_dir / n).stat().st_mtime_ns for n in kept} == kept  # not redone
    assert_same_output(out_dir, clean)
    assert not list(out_dir.glob(".shard-*"))
    check_output(out_dir, docs, max_len=256)
    done = cli("pack", *args, "-o", str(out_dir))
    assert done.returncode == 2 and "already holds a complete packed dataset" in done.stderr
    assert cli("pack", *args, "-o", str(out_dir), "--overwrite", "-q").returncode == 0


def test_resume_rewrites_a_shard_that_no_longer_matches_its_checksum(tmp_path):
    paths, docs = corpus(tmp_path, lengths_for(6, 1, 300, top=250), ["a.parquet"])
    s = PackSettings(max_len=256, shard_rows=25)
    out_dir = tmp_path / "out"
    pack_corpus(paths, out_dir, s, quiet=True, plot=False)
    reference = shard_bytes(out_dir)
    # Make it look interrupted after two shards, one of them since damaged.
    manifest = json.loads((out_dir / "manifest.json").read_text())
    (out_dir / "manifest.json").unlink()
    state = out_dir / ".fastpack"
    state.mkdir()
    from fastpack._offline.outdir import OutputDir
    from fastpack._offline.sources import expand_inputs

    run = OutputDir(out_dir, s, expand_inputs(paths), True)
    run.write_json(state / "state.json", run.state())
    for i, entry in enumerate(manifest["shards"][:2]):
        run.record(i, entry)
    first = out_dir / manifest["shards"][0]["file"]
    damaged = bytearray(first.read_bytes())
    damaged[100] ^= 0xFF
    first.write_bytes(bytes(damaged))
    for extra in manifest["shards"][2:]:
        (out_dir / extra["file"]).unlink()
    pack_corpus(paths, out_dir, s, quiet=True, plot=False, resume=True)
    assert shard_bytes(out_dir) == reference


def test_tokenizer_path(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    sentences = ["the cat sat on the mat", "a dog ran", "the dog sat", "cats and dogs ran on"]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(sentences, tokenizers.trainers.WordLevelTrainer(
        special_tokens=["[UNK]"]))
    tok_dir = tmp_path / "tok"
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]") \
        .save_pretrained(str(tok_dir))
    texts = [" ".join(sentences[i % 4].split()[: 1 + i % 5]) * (1 + i % 3) for i in range(40)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    code, output = invoke("pack", str(tmp_path / "t.jsonl"), "-o", str(tmp_path / "out"),
                          "--max-len", "16", "--text-column", "text", "--tokenizer",
                          str(tok_dir), "--overlong", "split", "-q", "--no-plot")
    assert code == 0, output
    loaded = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    ids = loaded(texts)["input_ids"]
    plan = fastpack.pack([len(x) for x in ids], 16, overlong="split")
    rows = pq.read_table(next((tmp_path / "out").glob("shard-*"))).column("input_ids")
    for p in range(plan.num_packs):
        segs = zip(*plan.segments(p))
        assert rows[p].as_py() == [t for i, s, n in segs for t in ids[i][s:s + n]]
    assert not (tmp_path / "out" / ".fastpack").exists()  # the spilled ids are gone


# ---------------------------------------------------------------------------------------
# bad input: status 2, the file, the row and the column named, nothing that looks complete


def _bad_cases(tmp: Path) -> list[tuple[str, list[str], list[str]]]:
    """(name, arguments, what the message must name)."""
    good = write(tmp / "good.parquet", documents([3, 4, 5]))
    cases = []
    pq.write_table(pa.table({"tokens": [[1, 2]]}), tmp / "nocol.parquet")
    cases.append(("missing column", [str(tmp / "nocol.parquet")],
                  ["nocol.parquet", "column 'input_ids'", "no such column", "'tokens'"]))
    pq.write_table(pa.table({"input_ids": pa.array([[1.0, 2.0], [1.5]])}),
                   tmp / "float.parquet")
    cases.append(("float tokens", [str(tmp / "float.parquet")],
                  ["float.parquet", "row 0", "column 'input_ids'", "holds lists of double"]))
    (tmp / "float.jsonl").write_text('{"input_ids": [1, 2]}\n\n{"input_ids": [3]}\n'
                                     '{"input_ids": [4, 2.5]}\n')
    cases.append(("float in jsonl", [str(tmp / "float.jsonl")],
                  ["float.jsonl", "row 2 (line 4)", "column 'input_ids'", "element 1 is float"]))
    (tmp / "str.jsonl").write_text('{"input_ids": [1]}\n{"input_ids": "hello"}\n')
    cases.append(("string in jsonl", [str(tmp / "str.jsonl")],
                  ["str.jsonl", "row 1 (line 2)", "column 'input_ids'", "str \"hello\""]))
    (tmp / "missing.jsonl").write_text('{"input_ids": [1]}\n{"ids": [1]}\n')
    cases.append(("key missing on a row", [str(tmp / "missing.jsonl")],
                  ["missing.jsonl", "row 1 (line 2)", "column 'input_ids'", "null"]))
    (tmp / "broken.jsonl").write_text('{"input_ids": [1]}\n{"input_ids": [1,\n')
    cases.append(("invalid JSON", [str(tmp / "broken.jsonl")],
                  ["broken.jsonl", "row 1 (line 2)", "not valid JSON"]))
    pq.write_table(pa.table({"input_ids": pa.array([[1], None, [2]], pa.list_(pa.int32()))}),
                   tmp / "null.parquet")
    cases.append(("null row", [str(tmp / "null.parquet")],
                  ["null.parquet", "row 1", "column 'input_ids'", "is null"]))
    pq.write_table(pa.table({"input_ids": pa.array([[1], [2, None]], pa.list_(pa.int32()))}),
                   tmp / "nulltok.parquet")
    cases.append(("null token", [str(tmp / "nulltok.parquet")],
                  ["nulltok.parquet", "row 1", "column 'input_ids'", "null token id"]))
    (tmp / "corrupt.parquet").write_bytes(b"PAR1" + os.urandom(200))
    cases.append(("corrupt parquet", [str(tmp / "corrupt.parquet")],
                  ["corrupt.parquet", "not a readable parquet file"]))
    data = (tmp / "good.jsonl.gz")
    write(data, documents([50] * 200))
    (tmp / "cut.jsonl.gz").write_bytes(data.read_bytes()[:300])
    cases.append(("truncated gzip", [str(tmp / "cut.jsonl.gz")],
                  ["cut.jsonl.gz", "cannot be decompressed"]))
    (tmp / "empty.jsonl").write_bytes(b"")
    cases.append(("empty file", [str(good), str(tmp / "empty.jsonl")],
                  ["empty.jsonl", "holds no rows"]))
    pq.write_table(pa.table({"input_ids": pa.array([], pa.list_(pa.int32()))}),
                   tmp / "empty.parquet")
    cases.append(("empty parquet", [str(tmp / "empty.parquet")],
                  ["empty.parquet", "holds no rows"]))
    cases.append(("missing path", [str(tmp / "nowhere.parquet")],
                  ["nowhere.parquet", "no such file or directory"]))
    (tmp / "data.csv").write_text("a,b\n")
    cases.append(("unknown format", [str(tmp / "data.csv")], ["data.csv", "unknown file type"]))
    cases.append(("tokenizer not there", [str(good), "--text-column", "text", "--tokenizer",
                                          str(tmp / "no-tokenizer")],
                  ["no-tokenizer", "no such tokenizer directory"]))
    write(tmp / "long.parquet", documents([10, 700, 20, 900]))
    cases.append(("over the cap", [str(tmp / "long.parquet")],
                  ["long.parquet", "row 1", "column 'input_ids'", "700 tokens",
                   "(and 1 more over the cap)", "--overlong split"]))
    pq.write_table(pa.table({"input_ids": pa.array([[1, 2], [3]], pa.list_(pa.int32())),
                             "labels": pa.array([[1, 2], [3, 4]], pa.list_(pa.int32()))}),
                   tmp / "labels.parquet")
    cases.append(("labels of another length", [str(tmp / "labels.parquet"), "--columns",
                                               "labels"],
                  ["labels.parquet", "row 1", "column 'labels'", "2 values where 'input_ids' "
                   "has 1 tokens"]))
    return cases


def test_every_bad_input_exits_2_naming_file_row_and_column(tmp_path):
    for name, args, expected in _bad_cases(tmp_path):
        out_dir = tmp_path / f"out-{name.replace(' ', '-')}"
        code, output = invoke("pack", *args, "-o", str(out_dir), "--max-len", "512", "-q")
        assert code == 2, (name, output)
        assert output.startswith("fastpack: error: "), (name, output)
        for text in expected:
            assert text in output, (name, text, output)
        assert not out_dir.exists(), name  # nothing left that looks like output
    # The real process exits with status 2 too (not just click's test runner).
    out = cli("pack", str(tmp_path / "nocol.parquet"), "-o", str(tmp_path / "x"),
              "--max-len", "8")
    assert out.returncode == 2 and "column 'input_ids'" in out.stderr
    out = cli("stats", str(tmp_path / "float.jsonl"))
    assert out.returncode == 2 and "row 2 (line 4)" in out.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file(tmp_path):
    path = write(tmp_path / "secret.parquet", documents([3]))
    path.chmod(0)
    code, output = invoke("pack", str(path), "-o", str(tmp_path / "out"), "--max-len", "8")
    assert code == 2 and "secret.parquet" in output and "permission denied" in output


def test_output_directory_is_guarded(tmp_path):
    paths, _ = corpus(tmp_path, [[3, 4]], ["a.parquet"])
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    for extra in ([], ["--overwrite"]):
        code, output = invoke("pack", *paths, "-o", str(foreign), "--max-len", "8", *extra)
        assert code == 2 and "not empty and holds no fastpack output" in output
    assert (foreign / "notes.txt").read_text() == "keep me"
    code, output = invoke("pack", *paths, "-o", str(tmp_path / "o"), "--max-len", "8",
                          "--resume", "--overwrite")
    assert code == 2 and "exclude each other" in output


# ---------------------------------------------------------------------------------------
# properties and bounds


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(
    files=st.lists(st.lists(st.integers(0, 120), min_size=1, max_size=25), min_size=1,
                   max_size=3),
    max_len=st.integers(16, 96),
    strategy=st.sampled_from(["bfd", "ffd", "next_fit"]),
    overlong=st.sampled_from(["split", "truncate", "drop"]),
    shuffle=st.booleans(),
    shard_rows=st.integers(1, 9),
    plan_shards=st.integers(1, 3),
    memory=st.sampled_from([None, 500, 4000]),
)
def test_packed_rows_are_the_plan_tokens_and_every_token_is_accounted(
        tmp_path_factory, files, max_len, strategy, overlong, shuffle, shard_rows, plan_shards,
        memory):
    tmp = tmp_path_factory.mktemp("prop")
    names = [f"f{i}.{'parquet' if i % 2 == 0 else 'jsonl'}" for i in range(len(files))]
    paths, docs = corpus(tmp, files, names, row_group_size=7)
    s = PackSettings(max_len=max_len, strategy=strategy, overlong=overlong, shuffle=shuffle,
                     seed=5, shard_rows=shard_rows, plan_shards=plan_shards)
    report = pack_corpus(paths, tmp / "out", s, memory=memory, quiet=True, plot=False)
    rows = check_output(tmp / "out", docs, max_len=max_len, overlong=overlong)
    lengths = np.array([len(d) for d in docs])
    if plan_shards == 1:
        plan = fastpack.pack(lengths, options=s.options)
    else:
        plan, _ = sharded_plan(lengths, plan_shards, s.options,
                               keys=file_keys([len(f) for f in files]))
    assert report["packs"] == plan.num_packs == (rows.num_rows if plan.num_packs else 0)
    for p in range(plan.num_packs):
        ids, starts, seqlens = plan.segments(p)
        expected = [int(t) for i, a, n in zip(ids, starts, seqlens) for t in docs[i][a:a + n]]
        assert rows.column("input_ids")[p].as_py() == expected
    shutil.rmtree(tmp)


def test_sharded_plan_is_the_shards_plans_laid_end_to_end():
    lengths = np.random.default_rng(0).integers(1, 500, 5000)
    config = PackOptions(512, overlong="split", shuffle=True)
    keys = np.arange(len(lengths), dtype=np.int64) * 3 + 11
    plan, counts = sharded_plan(lengths, 4, config, keys=keys)
    from fastpack._offline.plan import plan_shard, shard_of

    shard = shard_of(keys, 4)
    assert sorted(np.bincount(shard)) == sorted(np.bincount(shard, minlength=4))
    assert min(np.bincount(shard)) > 1000  # spread evenly by the hash
    at = 0
    for s in range(4):
        members = np.flatnonzero(shard == s)
        own = plan_shard(lengths[members], s, config)
        assert own.num_packs == counts[s]
        lo, hi = plan.pack_offsets[at], plan.pack_offsets[at + own.num_packs]
        assert np.array_equal(plan.sample_ids[lo:hi], members[own.sample_ids])
        at += own.num_packs
    global_plan = fastpack.pack(lengths, options=config)
    assert plan.options == config  # what it was made with (each shard its own seed of it)
    assert plan.total_tokens == global_plan.total_tokens
    # Shards of 1,250 uniform lengths each leave more packs half full than one plan does;
    # at corpus scale the cost is far smaller (benches/results/cli.md).
    assert global_plan.num_packs <= plan.num_packs <= global_plan.num_packs * 1.02


def test_pack_a_corpus_larger_than_the_address_space(tmp_path):
    """The process may map 576 MiB in all (its libraries and runtime take about 300); the
    corpus holds 1.7 GiB of token ids that need int64, packed in passes within a 48 MiB
    budget."""
    import resource

    rng = np.random.default_rng(7)
    path = tmp_path / "big.parquet"
    schema = pa.schema([("input_ids", pa.list_(pa.int64()))])
    total = docs = 0
    with pq.ParquetWriter(path, schema, compression="zstd") as writer:
        while total * 8 < 3 * (576 << 20):
            lengths = rng.integers(1_000, 7_000, 500)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            # A document's tokens: its id (above int32) repeated, so the file stays small.
            values = np.repeat(np.arange(docs, docs + 500, dtype=np.int64) + 2**40, lengths)
            writer.write_table(pa.table({"input_ids": pa.ListArray.from_arrays(
                pa.array(offsets), pa.array(values))}, schema=schema))
            total += int(lengths.sum())
            docs += 500
    limit = 576 << 20
    assert total * 8 >= 3 * limit
    env = {**os.environ, "FASTPACK_PROGRESS_INTERVAL": "0", "RAYON_NUM_THREADS": "1",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "1",
           # Arrow's default pool (mimalloc) reserves a gigabyte of address space up front.
           "ARROW_DEFAULT_MEMORY_POOL": "system"}

    def limit_address_space() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    out = subprocess.run(
        [sys.executable, "-m", "fastpack", "pack", str(path), "-o", str(tmp_path / "out"),
         "--max-len", "8192", "--memory", "48M", "--no-plot"],
        capture_output=True, text=True, env=env, preexec_fn=limit_address_space, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["documents"] == docs
    assert report["input_tokens"] == report["packed_tokens"] == total
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert run["passes"] >= total * 8 // (48 << 20) and run["spilled"]
    # Every row's segments are whole documents: one id repeated, each id once overall.
    seen = set()
    for shard in sorted((tmp_path / "out").glob("shard-*.parquet")):
        for batch in pq.ParquetFile(shard).iter_batches(batch_size=4096):
            values = batch.column("input_ids").values.to_numpy()
            starts = np.concatenate([[0], np.cumsum(batch.column("seq_lengths").values)])
            firsts = values[starts[:-1]]
            assert np.array_equal(np.repeat(firsts, np.diff(starts)), values)
            seen.update(firsts.tolist())
    assert seen == set(range(2**40, 2**40 + docs))
    assert "fastpack: spill: done" in out.stderr


def test_progress_lines_name_the_stage(tmp_path):
    paths, _ = corpus(tmp_path, [[30] * 50], ["a.jsonl"])
    code, output = invoke("stats", *paths, "--max-len", "64")
    assert code == 0 and "fastpack: lengths: done" in output


def test_the_settings_keep_their_keys_and_order():
    # report.json, the manifest and a run's state hold them: the same settings, the same
    # bytes, and a run started by an earlier fastpack still resumes.
    settings = PackSettings(max_len=64, columns=["labels"], overlong="split", seed=3)
    assert list(settings.to_json()) == [
        "max_len", "column", "columns", "text_column", "tokenizer", "strategy", "overlong",
        "long_max_len", "group_tokens", "shuffle", "seed", "shard_rows", "plan_shards"]
    assert settings.to_json()["columns"] == ["labels"]
    assert PackSettings.from_json(json.loads(json.dumps(settings.to_json()))) == settings


def test_sharded_plan_metrics_are_the_whole_inputs():
    # A plan joined from shards in Python reports the bounds of all its tokens: the same
    # lower bound as one global plan, its efficiency over its own packs, and per-bucket and
    # group metrics by the core's definitions.
    lengths = np.random.default_rng(1).integers(1, 3000, 4000)
    config = PackOptions(1024, overlong="split", long_max_len=4096, group_tokens=8192)
    keys = np.arange(len(lengths), dtype=np.int64)
    joined, _ = sharded_plan(lengths, 3, config, keys=keys)
    whole = fastpack.pack(lengths, options=config)
    assert joined.total_tokens == whole.total_tokens
    assert joined.lower_bound == whole.lower_bound
    assert joined.efficiency == joined.total_tokens / int(joined.pack_caps.sum())
    for mine, theirs in zip(joined.buckets, whole.buckets):
        assert (mine.total_tokens, mine.lower_bound) == (theirs.total_tokens, theirs.lower_bound)
        assert mine.efficiency == mine.total_tokens / (mine.num_packs * mine.max_len)
    assert joined.group_lower_bound == whole.group_lower_bound
    assert joined.group_efficiency == joined.total_tokens / (joined.num_groups * 8192)


def test_merged_report_of_plan_shards_is_the_joined_plans():
    # Ray's planners each report their shard's numbers; merged, the report's metrics are
    # the core's of the joined plan (never one place to compute them from arrays).
    from fastpack._offline.plan import plan_shard, shard_of
    from fastpack._offline.report import PlanStats

    lengths = np.random.default_rng(2).integers(1, 3000, 3000)
    settings = PackSettings(1024, overlong="split", long_max_len=4096, group_tokens=8192)
    keys = np.arange(len(lengths), dtype=np.int64)
    joined, _ = sharded_plan(lengths, 3, settings.options, keys=keys)
    shard = shard_of(keys, 3)
    parts = [PlanStats.of(plan_shard(lengths[shard == s], s, settings.options),
                          lengths[shard == s], settings) for s in range(3)]
    merged = PlanStats.merge(parts).report()
    assert merged["lower_bound"] == joined.lower_bound
    assert merged["efficiency"] == joined.efficiency
    assert merged["groups"]["lower_bound"] == joined.group_lower_bound
    assert merged["groups"]["efficiency"] == joined.group_efficiency
    assert merged["packs_over_lower_bound"] == joined.num_packs - joined.lower_bound
    assert PlanStats.of(joined, lengths, settings).report() == merged


# ---------------------------------------------------------------------------------------
# defaults: every per-token column, shuffled packs; optional pictures; raw errors


def _mixed_columns(tmp: Path, name: str, n: int = 30) -> tuple[Path, list[np.ndarray]]:
    """A file whose columns are of every kind: per-token (labels, attention_mask), a list
    of integers of another length (spans), a string, one number per document, floats."""
    docs = documents([3 + (7 * d) % 40 for d in range(n)])
    table = {
        "input_ids": [d.tolist() for d in docs],
        "labels": [(d + 7).tolist() for d in docs],
        "attention_mask": [[1] * len(d) for d in docs],
        "spans": [[0, len(d)] for d in docs],
        "text": [f"doc {i}" for i in range(n)],
        "score": list(range(n)),
        "weights": [[0.5] * len(d) for d in docs],
    }
    path = tmp / name
    if name.endswith(".parquet"):
        pq.write_table(pa.table(table), path)
    else:
        path.write_text("".join(json.dumps({k: v[i] for k, v in table.items()}) + "\n"
                                for i in range(n)))
    return path, docs


@pytest.mark.parametrize("name", ["m.parquet", "m.jsonl"])
def test_pack_keeps_every_per_token_column_and_names_what_it_leaves_out(tmp_path, name):
    path, docs = _mixed_columns(tmp_path, name)
    out = cli("pack", str(path), "-o", str(tmp_path / "out"), "--max-len", "64", "-q",
              "--no-plot")
    assert out.returncode == 0, out.stderr
    rows = check_output(tmp_path / "out", docs, max_len=64)
    assert rows.column_names == ["input_ids", "labels", "attention_mask", "seq_lengths",
                                 "position_ids"]
    for tokens, labels, mask in zip(*(rows.column(c).to_pylist()
                                      for c in ("input_ids", "labels", "attention_mask"))):
        assert labels == [t + 7 for t in tokens] and mask == [1] * len(tokens)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["columns"] == rows.column_names
    left_out = report["left_out"]
    assert set(left_out) == {"spans", "text", "score", "weights"}
    assert left_out["spans"] == "not one value per token of 'input_ids'"
    assert left_out["text"] == "a string column"
    assert left_out["score"] == "one value per document, not per token"
    assert "not integer token ids" in left_out["weights"]
    assert "columns: input_ids, labels, attention_mask, seq_lengths, position_ids" in out.stdout
    for column, reason in left_out.items():
        assert f"{column!r} ({reason})" in out.stdout
    # --columns still chooses (and '' packs the token column alone).
    code, output = invoke("pack", str(path), "-o", str(tmp_path / "one"), "--max-len", "64",
                          "-q", "--no-plot", "--columns", "")
    assert code == 0, output
    assert read_rows(tmp_path / "one").column_names == ["input_ids", "seq_lengths",
                                                        "position_ids"]


def test_a_column_in_some_files_only_is_left_out_with_the_reason(tmp_path):
    a = write(tmp_path / "a.parquet", documents([5, 9]), labels=True)
    b = write(tmp_path / "b.parquet", documents([4, 6], first=2))
    code, output = invoke("pack", str(a), str(b), "-o", str(tmp_path / "out"),
                          "--max-len", "16", "-q", "--no-plot")
    assert code == 0, output
    assert f"'labels' (not in every input (not in {b}))" in output
    assert read_rows(tmp_path / "out").column_names == ["input_ids", "seq_lengths",
                                                        "position_ids"]


def test_the_command_shuffles_by_default_with_seed_0(tmp_path):
    paths, docs = corpus(tmp_path, lengths_for(8, 1, 120, top=200), ["a.parquet"])
    lengths = np.array([len(d) for d in docs])
    for extra, plan in (([], fastpack.pack(lengths, 256)),
                        (["--no-shuffle"], fastpack.pack(lengths, 256, shuffle=False))):
        out_dir = tmp_path / f"out{len(extra)}"
        code, output = invoke("pack", *paths, "-o", str(out_dir), "--max-len", "256", "-q",
                              "--no-plot", *extra)
        assert code == 0, output
        rows = read_rows(out_dir)
        assert rows.num_rows == plan.num_packs
        for p in range(plan.num_packs):
            assert rows.column("seq_lengths")[p].as_py() == plan.segments(p)[2].tolist()
    assert fastpack.pack(lengths, 256).pack_fills.tolist() != \
        fastpack.pack(lengths, 256, shuffle=False).pack_fills.tolist()


_NO_MATPLOTLIB = ("import sys; sys.modules['matplotlib'] = None; "
                  "from fastpack.cli import main; main(sys.argv[1:])")


def _without_matplotlib(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FASTPACK_PROGRESS_INTERVAL": "0"}
    return subprocess.run([sys.executable, "-c", _NO_MATPLOTLIB, *args], capture_output=True,
                          text=True, timeout=300, env=env)


def test_without_matplotlib_the_picture_is_skipped_or_refused_before_work(tmp_path):
    paths, docs = corpus(tmp_path, [[5, 9, 30, 12]], ["a.parquet"])
    out = _without_matplotlib("pack", *paths, "-o", str(tmp_path / "out"), "--max-len", "32",
                              "-q")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "out" / "manifest.json").exists()
    assert not (tmp_path / "out" / "report.png").exists()
    check_output(tmp_path / "out", docs, max_len=32)
    assert "picture: report.png skipped: matplotlib is not installed (pip install " \
        "matplotlib: the cli extra)" in out.stdout
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["picture"].startswith("report.png skipped")
    asked = [("pack", *paths, "-o", str(tmp_path / "asked"), "--max-len", "32", "--plot"),
             ("stats", *paths, "--plot", str(tmp_path / "s.png")),
             ("demo", "--plot", str(tmp_path / "d.png"))]
    for args in asked:
        out = _without_matplotlib(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
        assert out.stderr.startswith("fastpack: error: --plot: the picture needs matplotlib")
        assert out.stdout == ""  # before any work
    assert not (tmp_path / "asked").exists()


@needs_matplotlib
def test_a_picture_that_fails_never_costs_the_manifest(tmp_path, monkeypatch):
    import fastpack._offline.stats

    def broken(*_args, **_kwargs):
        raise RuntimeError("no fonts")

    monkeypatch.setattr(fastpack._offline.stats, "plot_report", broken)
    paths, docs = corpus(tmp_path, [[5, 9, 30]], ["a.parquet"])
    report = pack_corpus(paths, tmp_path / "out", PackSettings(max_len=32), quiet=True)
    assert report["picture"] == "report.png not written: RuntimeError: no fonts"
    assert (tmp_path / "out" / "manifest.json").exists()
    check_output(tmp_path / "out", docs, max_len=32)


def test_caps_and_seeds_out_of_range_exit_2_in_one_line_before_work(tmp_path):
    paths, _ = corpus(tmp_path, [[5, 9, 3]], ["a.parquet"])
    runs = [
        (("stats", *paths, "--max-len", "20000000"),
         "fastpack: error: --max-len: max_len: got 20000000; expected an integer in "
         "1..=16777216"),
        (("pack", *paths, "-o", str(tmp_path / "o1"), "--max-len", "20000000"),
         "max_len: got 20000000"),
        (("pack", *paths, "-o", str(tmp_path / "o2"), "--max-len", "8", "--seed",
          str(2**64)), "--seed"),
    ]
    for args, message in runs:
        out = cli(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert "Traceback" not in out.stderr and message in out.stderr, out.stderr
        if args[0] == "stats" or "max_len" in message:
            assert out.stderr.count("\n") == 1 and out.stdout == ""
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


@pytest.mark.parametrize("seed", [20_000_000_000_000, 2**64 - 1])
def test_plan_shards_take_any_seed(tmp_path, seed):
    lengths = lengths_for(9, 1, 200, top=120)
    paths, docs = corpus(tmp_path, lengths, ["a.parquet"])
    code, output = invoke("pack", *paths, "-o", str(tmp_path / "out"), "--max-len", "128",
                          "--plan-shards", "2", "--seed", str(seed), "-q", "--no-plot")
    assert code == 0, output
    rows = check_output(tmp_path / "out", docs, max_len=128)
    config = PackSettings(max_len=128, seed=seed).options
    plan, _ = sharded_plan(np.array(lengths[0]), 2, config, keys=file_keys([len(docs)]))
    assert [r.as_py() for r in rows.column("seq_lengths")] == [
        plan.segments(p)[2].tolist() for p in range(plan.num_packs)]


def test_shard_seeds_are_unchanged_where_the_old_mixing_did_not_overflow():
    from fastpack._offline.plan import mix64, shard_seed

    for seed, shard in [(0, 0), (9, 3), (2**40, 7)]:
        old = int(mix64(np.array([seed * 1_000_003 + shard], dtype=np.uint64))[0]
                  >> np.uint64(1))
        assert shard_seed(seed, shard) == old
    assert shard_seed(2**64 - 1, 1) != shard_seed(2**64 - 1, 0)


def test_a_truncated_gzip_is_reported_where_its_data_ends(tmp_path):
    import gzip
    import zlib

    lines = "".join(json.dumps({"input_ids": list(range(i % 40 + 1))}) + "\n"
                    for i in range(30_000)).encode()
    packed = gzip.compress(lines)
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(packed[:len(packed) // 2])
    readable = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(packed[:len(packed) // 2])
    last_line = readable.count(b"\n") + 1  # the line the data stops in
    out = cli("stats", str(path), "-q")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "cannot be decompressed from this line on" in out.stderr
    line = int(out.stderr.split(", line ")[1].split(":")[0].replace(",", ""))
    # Decoded in 64 KiB pieces: the line reported is at most a piece before the end.
    shortest = min(len(x) for x in lines.split(b"\n") if x) + 1
    assert last_line - (1 << 16) // shortest - 1 <= line <= last_line
    assert line > 1000


def test_shipped_code_holds_no_test_hook():
    """Failures are injected by the tests (tests/crashing.py), never by fastpack itself:
    no module reads a test's environment variable or kills its own process."""
    package = Path(fastpack.__file__).parent
    for path in package.rglob("*.py"):
        text = path.read_text()
        assert "FASTPACK_TEST" not in text and "os.kill(" not in text, path
