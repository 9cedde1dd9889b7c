"""``fastpack pack --format``: every format holds the parquet output's packs, in its order,
read back by the consumer's own library (megatron-core's ``IndexedDataset``,
mosaicml-streaming's ``StreamingDataset``, a datatrove pipeline), and the same bytes
however the gather is split. The consumers are not in the main test environment (one of
them pins transformers < 5): CI installs them in a virtual environment of their own
(requirements-formats.txt) and runs this file there; elsewhere their tests skip."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from types import ModuleType

import docblocks
import numpy as np
import pyarrow as pa
import pytest
from corpus import LABEL_OFFSET, STRIDE, assert_same_output, check_output, corpus, read_rows
from hypothesis import given, settings
from hypothesis import strategies as st

from fastpack import FastpackError
from fastpack._offline.driver import pack_corpus
from fastpack._offline.settings import PackSettings


def consumer(module: str) -> ModuleType:
    """The consumer's module; the test skips where it is not installed, except in CI's
    formats phase (FASTPACK_FORMATS=1), where a missing consumer is a failure."""
    if os.environ.get("FASTPACK_FORMATS") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module)


OPTIONS = {"max_len": 64, "overlong": "split", "shard_rows": 7, "seed": 5}


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One corpus (tokens and labels, a document over the cap) packed in every format."""
    tmp = tmp_path_factory.mktemp("formats")
    rng = np.random.default_rng(3)
    lengths = [rng.integers(1, 50, 40).tolist() + [150], rng.integers(1, 60, 35).tolist()]
    paths, docs = corpus(tmp, lengths, ["a.parquet", "b.jsonl"], labels=True)
    out = {}
    for fmt in ("parquet", "megatron", "mds"):
        out[fmt] = tmp / fmt
        pack_corpus(paths, out[fmt], PackSettings(format=fmt, **OPTIONS), quiet=True,
                    plot=False)
    check_output(out["parquet"], docs, max_len=64, overlong="split", labels=True)
    return out


def parquet_packs(outdir: Path) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    rows = read_rows(outdir)
    return [(np.asarray(t), np.asarray(lab), np.asarray(n)) for t, lab, n in zip(
        rows.column("input_ids").to_pylist(), rows.column("labels").to_pylist(),
        rows.column("seq_lengths").to_pylist())]


def test_the_shards_are_the_parquet_shards_in_another_layout(packed):
    # Without the consumers: the manifest lists each format's files with their checksums,
    # shard for shard the parquet output's rows and tokens.
    import hashlib

    base = json.loads((packed["parquet"] / "manifest.json").read_text())
    for fmt in ("megatron", "mds"):
        manifest = json.loads((packed[fmt] / "manifest.json").read_text())
        assert manifest["settings"]["format"] == fmt
        assert [(s["rows"], s["tokens"]) for s in manifest["shards"]] == \
            [(s["rows"], s["tokens"]) for s in base["shards"]]
        for shard in manifest["shards"]:
            for f in [shard, *shard.get("parts", [])]:
                data = (packed[fmt] / f["file"]).read_bytes()
                assert (len(data), hashlib.sha256(data).hexdigest()) == (f["bytes"], f["sha256"])
        written = sum(p.stat().st_size for p in packed[fmt].iterdir()
                      if p.name.startswith("shard-"))
        assert json.loads((packed[fmt] / "report.json").read_text())["bytes"] == written
    assert "format" not in base["settings"]  # a parquet run's settings keep their bytes
    names = sorted(p.name for p in packed["megatron"].iterdir())
    assert "shard-00000-of-00005.bin" in names and "shard-00000-of-00005.labels.idx" in names
    assert (packed["mds"] / "index.json").exists()


# megatron-core's .idx dtype codes (DType in megatron/core/datasets/indexed_dataset.py).
IDX_CODES = {4: "<i4", 5: "<i8", 8: "<u2"}


def read_megatron(outdir: Path, suffix: str = "") -> tuple[list[tuple[np.ndarray, np.ndarray]],
                                                             set[str]]:
    """Without megatron-core (the main suite, the base installs): its .idx layout read
    with numpy -- header, sequence lengths, byte pointers, document indices; every pack's
    tokens and sequence lengths, and the token dtypes the files hold."""
    manifest = json.loads((outdir / "manifest.json").read_text())
    got, dtypes = [], set()
    for shard in manifest["shards"]:
        prefix = outdir / (shard["file"].removesuffix(".bin") + suffix)
        idx = Path(f"{prefix}.idx").read_bytes()
        assert idx[:9] == b"MMIDIDX\x00\x00" and idx[9:17] == (1).to_bytes(8, "little")
        dtype = np.dtype(IDX_CODES[idx[17]])
        dtypes.add(dtype.name)
        count, docs = np.frombuffer(idx, "<u8", 2, 18)
        lengths = np.frombuffer(idx, "<i4", count, 34)
        pointers = np.frombuffer(idx, "<i8", count, 34 + 4 * count)
        bounds = np.frombuffer(idx, "<i8", docs, 34 + 12 * count)
        assert len(idx) == 34 + 12 * count + 8 * docs
        tokens = np.fromfile(f"{prefix}.bin", dtype)
        size = dtype.itemsize
        assert np.array_equal(pointers, size * np.concatenate([[0], np.cumsum(lengths)[:-1]]))
        for p in range(docs - 1):
            a, b = pointers[bounds[p]] // size, (pointers[bounds[p + 1] - 1] // size
                                                 + lengths[bounds[p + 1] - 1])
            got.append((tokens[a:b], lengths[bounds[p]:bounds[p + 1]]))
    return got, dtypes


def test_the_megatron_files_hold_the_parquet_packs(packed):
    got, dtypes = read_megatron(packed["megatron"])
    assert dtypes == {"int32"}  # ids up to 75,000: over Megatron's uint16 cardinality
    expected = parquet_packs(packed["parquet"])
    assert len(got) == len(expected)
    for (t, n), (et, _, en) in zip(got, expected):
        assert np.array_equal(t, et) and np.array_equal(n, en)


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], dict[str, Path]]:
    """Ids (and labels) under 65,500, packed with --token-dtype auto and
    int32, and auto again in several gather passes."""
    tmp = tmp_path_factory.mktemp("vocab")
    rng = np.random.default_rng(4)
    paths, _ = corpus(tmp, [rng.integers(1, 40, 30).tolist(), rng.integers(1, 40, 20).tolist()],
                      ["a.parquet", "b.jsonl"], labels=True)
    out = {}
    for name, dtype, memory in (("auto", "auto", None), ("int32", "int32", None),
                                ("passes", "auto", 800)):
        out[name] = tmp / name
        report = pack_corpus(paths, out[name], PackSettings(
            format="megatron", token_dtype=dtype, **OPTIONS), memory=memory, quiet=True,
            plot=False)
        assert (report["run"]["passes"] > 1) == (memory is not None)
    return paths, out


def test_megatron_stores_uint16_ids_in_half_the_bytes(small_vocab):
    # As Megatron's preprocessing: ids below 65,500 are uint16, the .bin half the int32
    # one; the same packs, and the same bytes in one gather pass or several.
    _, out = small_vocab
    for suffix in ("", ".labels"):
        auto, dtypes = read_megatron(out["auto"], suffix)
        wide, wide_dtypes = read_megatron(out["int32"], suffix)
        assert (dtypes, wide_dtypes) == ({"uint16"}, {"int32"})
        assert len(auto) == len(wide) > 0
        for (t, n), (wt, wn) in zip(auto, wide):
            assert np.array_equal(t, wt) and np.array_equal(n, wn)
    for name in (p.name for p in out["auto"].iterdir()):
        if name.endswith(".bin"):
            half = (out["auto"] / name).stat().st_size
            assert 2 * half == (out["int32"] / name).stat().st_size > 0
    assert_same_output(out["passes"], out["auto"])
    manifest = json.loads((out["auto"] / "manifest.json").read_text())
    assert manifest["settings"]["token_dtype"] == "auto"


def test_an_id_an_explicit_token_dtype_cannot_hold_is_refused(packed, tmp_path):
    # The corpus's largest id is over 65,535: refused after the lengths pass, before any
    # shard is written.
    paths = sorted(str(p) for p in packed["parquet"].parent.iterdir()
                   if p.suffix in (".parquet", ".jsonl"))
    largest = max(max(d) for d in read_rows(packed["parquet"]).column(
        "input_ids").to_pylist())
    settings = PackSettings(format="megatron", token_dtype="uint16", **OPTIONS)
    with pytest.raises(FastpackError, match=f"token_dtype: column 'input_ids' holds the "
                       f"value {largest:,}, which uint16 cannot hold"):
        pack_corpus(paths, tmp_path / "o", settings, quiet=True, plot=False)
    assert not list((tmp_path / "o").glob("shard-*"))
    with pytest.raises(FastpackError, match="token_dtype: got 'uint16' with format 'mds'"):
        PackSettings(64, format="mds", token_dtype="uint16")
    with pytest.raises(FastpackError, match="token_dtype: got 'int8'; expected one of auto"):
        PackSettings(64, format="megatron", token_dtype="int8")


def test_the_tokenizers_vocabulary_decides_the_megatron_dtype(tmp_path):
    # As Megatron's preprocessing: the vocabulary's size, not the ids the text happens to
    # use, sizes the token column; 65,500 words is the first size that is int32 (below it,
    # uint16), whatever ids the text uses.
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = {"[UNK]": 0, "the": 1, "cat": 2, "sat": 3, **{f"w{i}": i for i in range(4, 65_500)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]") \
        .save_pretrained(str(tmp_path / "tok"))
    pa.parquet.write_table(pa.table({"text": ["the cat sat", "cat sat", "the the cat"] * 5}),
                           tmp_path / "t.parquet")
    for dtype, code in (("auto", 4), ("uint16", 8)):  # int32 / uint16 in the .idx
        out = tmp_path / dtype
        pack_corpus([str(tmp_path / "t.parquet")], out, PackSettings(
            8, text_column="text", tokenizer=str(tmp_path / "tok"), format="megatron",
            token_dtype=dtype), quiet=True, plot=False)
        assert (out / "shard-00000-of-00001.idx").read_bytes()[17] == code
        ids = np.fromfile(out / "shard-00000-of-00001.bin", "<i4" if code == 4 else "<u2")
        assert sorted(ids.tolist()) == [1] * 15 + [2] * 15 + [3] * 10


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.none(), st.tuples(st.integers(-2**40, 2**40),
                                               st.integers(0, 2**40))), min_size=1,
                max_size=3), st.one_of(st.none(), st.integers(1, 2**20)))
def test_auto_picks_megatrons_dtype_per_column(bounds, vocab):
    # auto: the narrowest of uint16 (ids below Megatron's 65,500), int32, int64 holding
    # the column; the tokenizer's vocabulary sizes the first column as Megatron does.
    from fastpack._offline.formats import megatron_dtypes

    ranges = {f"c{k}": None if b is None else (min(b), max(b)) for k, b in enumerate(bounds)}
    chosen = megatron_dtypes("auto", ranges, vocab)
    assert list(chosen) == list(ranges)
    for k, (c, r) in enumerate(ranges.items()):
        lo, hi = r or (0, 0)
        cardinality = max(hi + 1, vocab) if k == 0 and vocab else hi + 1
        if lo >= 0 and cardinality < 65_500:
            assert chosen[c] == "uint16"
        else:
            assert chosen[c] == ("int32" if -2**31 <= lo and hi < 2**31 else "int64")
        info = np.iinfo(chosen[c])
        assert info.min <= lo and hi <= info.max


def test_megatron_indexed_dataset_reads_every_pack(packed):
    indexed = consumer("megatron.core.datasets.indexed_dataset")
    manifest = json.loads((packed["megatron"] / "manifest.json").read_text())
    expected = parquet_packs(packed["parquet"])
    got = []
    for shard in manifest["shards"]:
        prefix = str(packed["megatron"] / shard["file"].removesuffix(".bin"))
        tokens = indexed.IndexedDataset(prefix)
        labels = indexed.IndexedDataset(prefix + ".labels")
        docs = tokens.document_indices
        assert len(docs) == shard["rows"] + 1 and np.array_equal(docs, labels.document_indices)
        for p in range(len(docs) - 1):
            sequences = tokens[int(docs[p]):int(docs[p + 1])]
            got.append((np.concatenate(sequences),
                        np.concatenate(labels[int(docs[p]):int(docs[p + 1])]),
                        np.array(tokens.sequence_lengths[docs[p]:docs[p + 1]])))  # a copy: the
            # index is unmapped when the dataset goes
            for s in sequences:  # each sequence is one document (or piece), in order
                assert np.array_equal(s, s[0] + np.arange(len(s))) and s[0] // STRIDE >= 0
    assert len(got) == len(expected)
    for (t, lab, n), (et, elab, en) in zip(got, expected):
        assert np.array_equal(t, et) and np.array_equal(lab, elab) and np.array_equal(n, en)
        assert np.array_equal(lab, t + LABEL_OFFSET)


def test_megatron_indexed_dataset_reads_uint16_ids(small_vocab):
    indexed = consumer("megatron.core.datasets.indexed_dataset")
    _, out = small_vocab
    manifest = json.loads((out["auto"] / "manifest.json").read_text())
    for shard in manifest["shards"]:
        name = shard["file"].removesuffix(".bin")
        for suffix in ("", ".labels"):
            narrow = indexed.IndexedDataset(str(out["auto"] / name) + suffix)
            wide = indexed.IndexedDataset(str(out["int32"] / name) + suffix)
            assert narrow.index.dtype == np.uint16 and wide.index.dtype == np.int32
            assert len(narrow) == len(wide) > 0
            assert np.array_equal(narrow.document_indices, wide.document_indices)
            for s in range(len(narrow)):
                assert np.array_equal(narrow[s], wide[s])


def test_mds_streaming_dataset_reads_every_pack(packed, tmp_path, monkeypatch):
    streaming = consumer("streaming")
    monkeypatch.chdir(tmp_path)
    dataset = streaming.StreamingDataset(local=str(packed["mds"]), shuffle=False,
                                         batch_size=1, replication=None)
    expected = parquet_packs(packed["parquet"])
    assert len(dataset) == len(expected)
    for p, (t, lab, n) in enumerate(expected):
        sample = dataset[p]
        assert np.array_equal(sample["input_ids"], t)
        assert np.array_equal(sample["labels"], lab)
        assert np.array_equal(sample["seq_lengths"], n)
        assert sample["position_ids"].dtype == np.int32
        assert np.array_equal(sample["position_ids"],
                              np.concatenate([np.arange(k) for k in n]))
    assert [s["input_ids"].tolist() for s in dataset][:3] == [t.tolist() for t, _, _ in
                                                              expected[:3]]


def test_an_mds_shard_is_what_mdswriter_writes(packed, tmp_path):
    # mosaicml-streaming's own writer, given each shard's packs as samples, writes the
    # same bytes (fastpack writes them without it).
    consumer("streaming")
    from streaming import MDSWriter

    manifest = json.loads((packed["mds"] / "manifest.json").read_text())
    expected = parquet_packs(packed["parquet"])
    first = 0
    for k, shard in enumerate(manifest["shards"]):
        columns = {c: "ndarray:int32" for c in ("input_ids", "labels", "position_ids",
                                                "seq_lengths")}
        with MDSWriter(columns=columns, out=str(tmp_path / str(k)), size_limit=None) as w:
            for t, lab, n in expected[first:first + shard["rows"]]:
                w.write({"input_ids": t.astype(np.int32), "labels": lab.astype(np.int32),
                         "seq_lengths": n.astype(np.int32), "position_ids": np.concatenate(
                             [np.arange(m, dtype=np.int32) for m in n])})
        first += shard["rows"]
        assert (tmp_path / str(k) / "shard.00000.mds").read_bytes() == \
            (packed["mds"] / shard["file"]).read_bytes()
    assert first == len(expected)


@pytest.mark.parametrize("fmt", ["megatron", "mds"])
def test_the_bytes_do_not_depend_on_the_gather_passes(packed, tmp_path, fmt):
    # A tight memory budget gathers in several passes (spilled, or read again per pass):
    # every file the same bytes as one pass.
    paths = sorted(str(p) for p in packed["parquet"].parent.iterdir()
                   if p.suffix in (".parquet", ".jsonl"))
    for spill in (True, False):
        out = tmp_path / f"{fmt}-{spill}"
        report = pack_corpus(paths, out, PackSettings(format=fmt, **OPTIONS), memory=1500,
                             spill=spill, quiet=True, plot=False)
        assert report["run"]["passes"] > 1
        assert_same_output(out, packed[fmt])


def test_an_interrupted_run_resumes_in_its_format(packed, tmp_path):
    # A shard whose .idx is gone is written again; the others are kept.
    paths = sorted(str(p) for p in packed["parquet"].parent.iterdir()
                   if p.suffix in (".parquet", ".jsonl"))
    out = tmp_path / "resumed"
    settings = PackSettings(format="megatron", **OPTIONS)
    pack_corpus(paths, out, settings, quiet=True, plot=False)
    manifest = json.loads((out / "manifest.json").read_text())
    # Make it an interrupted run: state, journal, no manifest, one shard's part missing.
    (out / ".fastpack").mkdir()
    (out / ".fastpack" / "state.json").write_text(json.dumps({
        "format": "fastpack-packed/1", "settings": settings.to_json(),
        "inputs": manifest["inputs"]}))
    (out / ".fastpack" / "journal.jsonl").write_text("".join(
        json.dumps({"shard": i, **s}) + "\n" for i, s in enumerate(manifest["shards"])))
    (out / "manifest.json").unlink()
    (out / "shard-00001-of-00005.labels.idx").unlink()
    pack_corpus(paths, out, settings, resume=True, quiet=True, plot=False)
    assert_same_output(out, packed["megatron"])


def test_a_format_name_is_checked(tmp_path):
    with pytest.raises(FastpackError, match="format: got 'csv'; expected one of parquet"):
        PackSettings(64, format="csv")
    from click.testing import CliRunner

    from fastpack.cli import main

    result = CliRunner().invoke(main, ["pack", "x.parquet", "-o", str(tmp_path / "o"),
                                       "--max-len", "8", "--format", "csv"])
    assert result.exit_code == 2 and "--format" in result.output
    paths, _ = corpus(tmp_path, [[5, 9, 3]], ["a.parquet"])
    result = CliRunner().invoke(main, ["pack", *paths, "-o", str(tmp_path / "m"), "--max-len",
                                       "16", "--format", "megatron", "-q", "--no-plot"])
    assert result.exit_code == 0, result.output
    assert "in 1 megatron shard" in result.output
    assert (tmp_path / "m" / "shard-00000-of-00001.idx").exists()


def test_datatrove_pipeline_packs_its_tokenizer_output(tmp_path):
    consumer("datatrove")
    tokenizers = pytest.importorskip("tokenizers")
    from datatrove.data import Document
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.tokens import DocumentTokenizer

    from fastpack.datatrove import PackTokenized

    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(50)]
    texts = [" ".join(rng.choice(words, rng.integers(1, 40))) for _ in range(120)]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, tokenizers.trainers.WordLevelTrainer(
        special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))

    def reader(data, rank=0, world_size=1):
        for i in range(rank, len(texts), world_size):
            yield Document(text=texts[i], id=str(i))

    tokenize = LocalPipelineExecutor(
        [reader, DocumentTokenizer(str(tmp_path / "tok"), str(tmp_path / "tokenizer.json"),
                                   shuffle_documents=False)],
        tasks=2, workers=1, logging_dir=str(tmp_path / "logs-tok"))
    pack = LocalPipelineExecutor(
        [PackTokenized(tmp_path / "tok", tmp_path / "packed", max_len=48, format="megatron",
                       overlong="split")],
        tasks=1, workers=1, logging_dir=str(tmp_path / "logs-pack"), depends=tokenize)
    pack.run()

    indexed = consumer("megatron.core.datasets.indexed_dataset")
    # Every tokenized document is in the packs once: the sequences of the indexed
    # datasets, joined per document, are the .ds files' documents.
    documents = []
    for ds in sorted((tmp_path / "tok").glob("*.ds")):
        values = np.fromfile(ds, dtype="<u2")
        ends = np.fromfile(str(ds) + ".index", dtype="<u8").astype(np.int64)
        documents += [tuple(d) for d in np.split(values, ends[:-1])]
    assert len(documents) == len(texts)
    expected = sorted(tuple(int(t) for t in tok.encode(s).ids) for s in texts)
    assert sorted(documents) == expected
    manifest = json.loads((tmp_path / "packed" / "manifest.json").read_text())
    sequences = []
    for shard in manifest["shards"]:
        data = indexed.IndexedDataset(str(tmp_path / "packed" / shard["file"][:-4]))
        assert data.index.dtype == np.uint16  # a vocabulary of 51, as Megatron stores it
        sequences += [tuple(int(t) for t in data[s]) for s in range(len(data))]
        assert (np.add.reduceat(data.sequence_lengths, data.document_indices[:-1]) <= 48).all()
    # pieces of documents over the cap are joined back in order of their tokens
    assert sum(map(len, sequences)) == sum(map(len, documents))
    assert sorted(s for s in sequences if len(s) < 48) == sorted(
        d for d in documents if len(d) < 48)
    report = json.loads((tmp_path / "packed" / "report.json").read_text())
    assert report["documents"] == len(texts)


def test_the_datatrove_step_refuses_a_folder_without_tokens(tmp_path):
    consumer("datatrove")
    from fastpack.datatrove import PackTokenized

    with pytest.raises(FastpackError, match="holds no .ds file"):
        list(PackTokenized(tmp_path, tmp_path / "o", max_len=8).run())
    with pytest.raises(FastpackError, match="format: got 'csv'"):
        PackTokenized(tmp_path, tmp_path / "o", max_len=8, format="csv")


def test_megatron_refuses_what_its_index_cannot_hold():
    from fastpack._offline.formats import _megatron_dtype

    with pytest.raises(FastpackError, match="column 'x' holds uint32"):
        _megatron_dtype(np.dtype(np.uint32), "x")


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=20), max_size=30))
def test_the_tokenize_pass_makes_the_arrow_array_of_its_ids(lists):
    # --text-column's ids go to Arrow through numpy (pa.array on Python ints is the slow
    # part of the pass): the same array, empty documents and batches included.
    from fastpack._offline.scan import id_lists

    assert id_lists(lists).equals(pa.array(lists, type=pa.list_(pa.int32())))


# ---------------------------------------------------------------------------------------
# docs/cli.md's readers, run as a user runs them: each block of the page that names this
# file, unchanged, in a directory holding the files it reads.

DOC_EXAMPLES = docblocks.blocks("tests/test_formats.py")


def doc_example(reader: str) -> tuple[str, str]:
    """``(page, code)`` of the block that reads with ``reader``'s package."""
    (found,) = [(page, code) for page, code in DOC_EXAMPLES if code.startswith(f"from {reader}")]
    return found


def test_the_docs_reader_examples_are_run_here():
    assert [code.split()[1].split(".")[0] for _, code in DOC_EXAMPLES] == [
        "megatron", "streaming", "datatrove"]


DOC_LENGTHS = [[30, 50, 20, 60, 10, 40, 25]]  # 4 packs of 64 tokens: 2 shards of 2 rows


def test_the_docs_megatron_example_reads_a_pack(tmp_path, monkeypatch):
    consumer("megatron.core.datasets.indexed_dataset")
    monkeypatch.chdir(tmp_path)
    paths, _ = corpus(tmp_path, DOC_LENGTHS, ["a.parquet"], labels=True)
    pack_corpus(paths, "packed", PackSettings(64, format="megatron", shard_rows=2),
                quiet=True, plot=False)
    assert len(json.loads((tmp_path / "packed" / "manifest.json").read_text())["shards"]) == 2
    scope = docblocks.run(*doc_example("megatron"))
    packs, _ = read_megatron(tmp_path / "packed")
    tokens, lengths = packs[0]
    assert [len(s) for s in scope["pack"]] == scope["seq_lengths"].tolist() == lengths.tolist()
    assert np.array_equal(np.concatenate(scope["pack"]), tokens)


def test_the_docs_streaming_example_reads_a_pack(tmp_path, monkeypatch):
    consumer("streaming")
    monkeypatch.chdir(tmp_path)
    paths, _ = corpus(tmp_path, DOC_LENGTHS, ["a.parquet"], labels=True)
    for fmt, out in (("mds", "packed"), ("parquet", "rows")):
        pack_corpus(paths, out, PackSettings(64, format=fmt, shard_rows=2), quiet=True,
                    plot=False)
    scope = docblocks.run(*doc_example("streaming"))
    expected = parquet_packs(tmp_path / "rows")
    sample = scope["sample"]
    assert sorted(sample) == ["input_ids", "labels", "position_ids", "seq_lengths"]
    assert all(isinstance(a, np.ndarray) for a in sample.values())
    tokens, labels, lengths = expected[0]
    assert np.array_equal(sample["input_ids"], tokens)
    assert np.array_equal(sample["labels"], labels)
    assert np.array_equal(sample["seq_lengths"], lengths)
    assert len(scope["packs"]) == len(expected) == 4


def test_the_docs_datatrove_example_packs_its_tokenizer_output(tmp_path, monkeypatch):
    consumer("datatrove")
    tokenizers = pytest.importorskip("tokenizers")
    monkeypatch.chdir(tmp_path)
    # What the block reads: raw/ (JSON lines with a "text") and tokenizer.json.
    rng = np.random.default_rng(1)
    words = [f"w{i}" for i in range(30)]
    texts = [" ".join(rng.choice(words, rng.integers(1, 30))) for _ in range(40)]
    (tmp_path / "raw").mkdir()
    for k in range(8):  # a file per task
        (tmp_path / "raw" / f"{k}.jsonl").write_text("".join(
            json.dumps({"text": t, "id": str(i)}) + "\n" for i, t in enumerate(texts)
            if i % 8 == k))
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, tokenizers.trainers.WordLevelTrainer(
        special_tokens=["[UNK]"]))
    tok.save("tokenizer.json")
    docblocks.run(*doc_example("datatrove"))
    # Every document the tokenizer wrote is a sequence of the packs, once.
    written = []
    for ds in sorted((tmp_path / "tokens").glob("*.ds")):
        values = np.fromfile(ds, dtype="<u2")
        ends = np.fromfile(f"{ds}.index", dtype="<u8").astype(np.int64)
        written += [tuple(d) for d in np.split(values, ends[:-1])]
    assert sorted(written) == sorted(tuple(tok.encode(t).ids) for t in texts)
    packed = [tuple(s) for tokens, lengths in read_megatron(tmp_path / "packed")[0]
              for s in np.split(tokens, np.cumsum(lengths)[:-1])]
    assert sorted(packed) == sorted(written)
    assert json.loads((tmp_path / "packed" / "report.json").read_text())["documents"] == 40
