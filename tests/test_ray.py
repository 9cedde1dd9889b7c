"""fastpack on Ray Data, on a local cluster started here: the same shards, byte for byte,
as the single-machine command, with one global plan and with a sharded one; and
``fastpack.ray.pack_dataset`` on a dataset whose row order Ray does not keep."""

from __future__ import annotations

import json

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from click.testing import CliRunner  # noqa: E402
from corpus import (  # noqa: E402
    assert_same_output,
    check_output,
    corpus,
    documents,
    output_files,
    shard_bytes,
)
from crashing import crash_after  # noqa: E402

from fastpack._offline.driver import pack_corpus  # noqa: E402
from fastpack._offline.settings import PackSettings  # noqa: E402
from fastpack.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    import logging

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    yield
    ray.shutdown()


def test_ray_writes_the_single_machine_shards_and_resumes_them(cluster, tmp_path):
    rng = np.random.default_rng(0)
    lengths = [rng.integers(0, 400, 120).tolist() for _ in range(3)]
    paths, docs = corpus(tmp_path, lengths, ["a.parquet", "b.jsonl.zst", "c.ds"], labels=True)
    settings = PackSettings(max_len=256, columns=("labels",), overlong="split", shuffle=True,
                            seed=2, shard_rows=12)
    local = pack_corpus(paths, tmp_path / "local", settings, quiet=True, plot=False)
    # A local run killed after two shards, finished on the cluster: the shards agree.
    args = [*paths, "--max-len", "256", "--columns", "labels", "--overlong", "split",
            "--shuffle", "--seed", "2", "--shard-rows", "12", "--no-plot", "-q"]
    crashed = crash_after(2, "pack", *args, "-o", str(tmp_path / "ray"))
    assert crashed.returncode == -9
    result = CliRunner().invoke(main, ["pack", *args, "-o", str(tmp_path / "ray"), "--resume",
                                       "--ray"])
    assert result.exit_code == 0, result.output
    assert "on Ray (1 node, 2 CPUs)" in result.output
    assert shard_bytes(tmp_path / "ray") == shard_bytes(tmp_path / "local")
    assert len(shard_bytes(tmp_path / "local")) == local["shards"] > 4
    assert_same_output(tmp_path / "ray", tmp_path / "local")
    assert json.loads((tmp_path / "ray" / "run.json").read_text())["ray"]["cpus"] == 2
    check_output(tmp_path / "ray", docs, max_len=256, overlong="split", labels=True)


def test_ray_sharded_plan_matches_the_single_machine_one(cluster, tmp_path):
    from fastpack.ray import pack_files

    rng = np.random.default_rng(1)
    lengths = [rng.integers(1, 200, 300).tolist() for _ in range(2)]
    paths, docs = corpus(tmp_path, lengths, ["a.parquet", "b.jsonl"])
    settings = PackSettings(max_len=256, plan_shards=3, shard_rows=20, group_tokens=1024)
    pack_corpus(paths, tmp_path / "local", settings, quiet=True, plot=False)
    on_ray = pack_files(paths, str(tmp_path / "ray"), settings, quiet=True, plot=False)
    assert_same_output(tmp_path / "ray", tmp_path / "local")
    assert on_ray["run"]["ray"]["nodes"] == 1 and "ray" not in on_ray
    check_output(tmp_path / "ray", docs, max_len=256)
    # Three plan shards cost a few packs over one global plan.
    one = pack_corpus(paths, tmp_path / "one", PackSettings(max_len=256), quiet=True,
                      plot=False)
    assert one["packs"] <= on_ray["packs"] <= one["packs"] + 3


def test_ray_bytes_do_not_depend_on_how_many_workers_run(cluster, tmp_path):
    """The cluster's tasks one at a time (Ray Data limited to one CPU) or two at once:
    every file the single machine writes, byte for byte (report.json too)."""
    from fastpack.ray import pack_files

    rng = np.random.default_rng(5)
    paths, docs = corpus(tmp_path, [rng.integers(1, 300, 80).tolist() for _ in range(2)],
                         ["a.parquet", "b.jsonl"])
    settings = PackSettings(max_len=256, overlong="split", seed=5, shard_rows=9,
                            group_tokens=1024)
    pack_corpus(paths, tmp_path / "local", settings, quiet=True, plot=False)
    context = ray.data.DataContext.get_current()
    limits = context.execution_options.resource_limits
    context.execution_options.resource_limits = ray.data.ExecutionResources(cpu=1)
    try:
        pack_files(paths, str(tmp_path / "one"), settings, quiet=True, plot=False)
    finally:
        context.execution_options.resource_limits = limits
    assert_same_output(tmp_path / "one", tmp_path / "local")
    check_output(tmp_path / "one", docs, max_len=256, overlong="split")


def test_pack_dataset_orders_documents_by_content(cluster):
    """No id column and a shuffled, many-block dataset: the plan follows the documents'
    content keys, identical documents are interchangeable, and the rows equal the
    single-machine gather over the same documents in that order."""
    import fastpack
    from fastpack.ray import content_keys, pack_dataset

    rng = np.random.default_rng(2)
    docs = documents(rng.integers(1, 150, 400).tolist())
    docs += [docs[5], docs[5], docs[17]]  # duplicates travel and pack like any document
    table = pa.table({"input_ids": pa.array([d.tolist() for d in docs], pa.list_(pa.int64()))})
    ds = ray.data.from_arrow(table).random_shuffle(seed=1).repartition(7)
    packed = pack_dataset(ds, 200, overlong="split", shuffle=True, seed=4, shard_rows=25)
    rows = sorted(packed.take_all(), key=lambda r: r["pack_index"])
    keys = content_keys(table.column("input_ids"))
    order = np.argsort(keys, kind="stable")
    plan = fastpack.pack(np.array([len(docs[i]) for i in order]), 200, overlong="split",
                         shuffle=True, seed=4)
    assert [r["pack_index"] for r in rows] == list(range(plan.num_packs))
    for p, row in enumerate(rows):
        ids, starts, seqlens = plan.segments(p)
        expected = [int(t) for i, s, n in zip(ids, starts, seqlens)
                    for t in docs[order[i]][s:s + n]]
        assert list(row["input_ids"]) == expected
        assert list(row["seq_lengths"]) == seqlens.tolist()
        assert list(row["position_ids"]) == [j for n in seqlens for j in range(n)]
    with pytest.raises(fastpack.FastpackError, match="columns: no column 'tokens'"):
        pack_dataset(ds, 200, column="tokens")


def test_the_docs_python_examples_run(cluster, tmp_path, monkeypatch, capsys):
    """docs/cli.md's Python blocks that need the shards on disk or a cluster (loading the
    shards; fastpack.ray), as written."""
    import docblocks

    blocks = docblocks.blocks("tests/test_ray.py")
    assert [page for page, _ in blocks] == ["docs/cli.md"] * 2
    paths, _ = corpus(tmp_path, [[40, 90, 7]], ["a.parquet"])
    monkeypatch.chdir(tmp_path)
    pack_corpus(paths, "packed", PackSettings(max_len=128), quiet=True, plot=False)
    monkeypatch.setattr(ray, "init", lambda *a, **k: None)  # the cluster is up already
    scopes = [docblocks.run(page, code) for page, code in blocks]
    assert scopes[0]["packed"].column_names == ["input_ids", "seq_lengths", "position_ids"]
    assert len(scopes[0]["packed"]) == 2
    printed = capsys.readouterr().out.split()
    assert int(printed[0]) <= 256


def test_each_copy_of_a_duplicated_document_is_routed_once():
    """1000 identical documents among 2000 others: every copy goes to one output shard
    (its own rank's), however the copies arrive and however often the data is read."""
    from fastpack.ray import _Planner

    settings = PackSettings(max_len=64, shard_rows=10)
    planner = _Planner(0, 1, settings.to_json(), unique=False)
    rng = np.random.default_rng(3)
    keys = np.concatenate([np.full(1000, 42), np.arange(1000, 3000)]).astype(np.int64)
    planner.add(keys, np.full(len(keys), 20, dtype=np.int32))
    result = planner.plan()
    assert result["outputs"] > 10
    copies = np.flatnonzero(planner.keys == 42)
    for _ in range(2):  # consumed twice: every copy routed again, once
        arriving = rng.permutation(keys)
        routed = []
        for part in np.array_split(arriving, 7):
            rows, outs = planner.route(part)
            routed.append((part[rows], outs))
        got_keys = np.concatenate([k for k, _ in routed])
        got_outs = np.concatenate([o for _, o in routed])
        assert len(got_keys) == len(keys)  # rows routed = documents
        # The copies' shards are exactly the shards of the key's ranks, each rank once.
        expected = np.sort(planner.out_of[copies])
        assert np.array_equal(np.sort(got_outs[got_keys == 42]), expected)


def test_pack_dataset_routes_documents_not_copies(cluster):
    import fastpack
    from fastpack.ray import content_keys, pack_dataset

    rng = np.random.default_rng(4)
    docs = documents(rng.integers(1, 60, 200).tolist())
    docs += [docs[3]] * 300 + [docs[8]] * 100
    table = pa.table({"input_ids": pa.array([d.tolist() for d in docs], pa.list_(pa.int64()))})
    ds = ray.data.from_arrow(table).random_shuffle(seed=2).repartition(5)
    packed = pack_dataset(ds, 128, overlong="split", shard_rows=5)
    assert packed._fastpack_plan.routed().count() == len(docs)
    rows = sorted(packed.take_all(), key=lambda r: r["pack_index"])
    order = np.argsort(content_keys(table.column("input_ids")), kind="stable")
    plan = fastpack.pack(np.array([len(docs[i]) for i in order]), 128, overlong="split")
    assert len(rows) == plan.num_packs
    for p, row in enumerate(rows):
        ids, starts, seqlens = plan.segments(p)
        assert list(row["input_ids"]) == [int(t) for i, s, n in zip(ids, starts, seqlens)
                                          for t in docs[order[i]][s:s + n]]
    # Over the cap with overlong="error": the planners find it with the command's rule
    # and say it in the command's words, naming the document by its key.
    with pytest.raises(fastpack.FastpackError, match=r"^key -?\d+, column 'input_ids': \d+ "
                       r"tokens, longer than the cap of 32 \(and \d+ more over the cap in its "
                       r"plan shard\); pass --overlong split, truncate or drop"):
        pack_dataset(ds, 32, plan_shards=2)


def test_pack_dataset_of_read_parquet_gives_the_commands_packs(cluster, tmp_path):
    """``pack_dataset(ray.data.read_parquet(files))``, no other argument: the packs of
    ``fastpack pack files`` (same order, same columns, same values and types)."""
    from fastpack.ray import pack_dataset

    rng = np.random.default_rng(5)
    lengths = [rng.integers(1, 300, 150).tolist() for _ in range(2)]
    paths, docs = corpus(tmp_path, lengths, ["a.parquet", "b.parquet"], labels=True,
                         row_group_size=40)
    out = CliRunner().invoke(main, ["pack", *paths, "-o", str(tmp_path / "cmd"), "--max-len",
                                    "256", "--overlong", "split", "--shard-rows", "9", "-q",
                                    "--no-plot"])
    assert out.exit_code == 0, out.output
    from corpus import read_rows

    expected = read_rows(tmp_path / "cmd")
    assert expected.column_names == ["input_ids", "labels", "seq_lengths", "position_ids"]
    packed = pack_dataset(ray.data.read_parquet(paths), 256, overlong="split", shard_rows=9)
    got = pa.Table.from_pylist(sorted(packed.take_all(), key=lambda r: r["pack_index"]))
    assert got.num_rows == expected.num_rows
    for name in expected.column_names:
        assert got.column(name).to_pylist() == expected.column(name).to_pylist(), name
    check_output(tmp_path / "cmd", docs, max_len=256, overlong="split", labels=True)


@pytest.mark.parametrize(("fmt", "docs"), [("mds", 90), ("megatron", 30)])
def test_ray_writes_another_format_byte_for_byte(cluster, tmp_path, fmt, docs):
    # A format's files (shards gathered by two Ray workers, their journal entries sent
    # back to the driver) are the single-machine run's, and so are MDS's index.json and
    # the manifest. megatron's: ids under 65,500, stored as uint16 from the ranges the
    # workers' lengths pass found (the writers are the same code; a Ray run costs seconds).
    from fastpack.ray import pack_files

    rng = np.random.default_rng(4)
    paths, _ = corpus(tmp_path, [rng.integers(1, 300, docs).tolist()] * 2,
                      ["a.parquet", "b.jsonl"], labels=True)
    settings = PackSettings(max_len=256, overlong="split", seed=1, shard_rows=9, format=fmt)
    pack_corpus(paths, tmp_path / "local", settings, quiet=True, plot=False)
    pack_files(paths, str(tmp_path / "ray"), settings, quiet=True, plot=False)
    local = output_files(tmp_path / "local")
    assert len(local) > 8
    assert_same_output(tmp_path / "ray", tmp_path / "local")
    if fmt == "megatron":
        assert {local[n][17] for n in local if n.endswith(".idx")} == {8}  # uint16
