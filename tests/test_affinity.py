"""Related documents packed together: ``pack(..., affinity=keys)``."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa  # a dependency of fastpack's command
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from invariants import check_plan

import fastpack
from fastpack import FastpackError, FastpackTypeError


@st.composite
def cases(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int, str, int]:
    max_len = draw(st.integers(1, 300))
    n = draw(st.integers(0, 300))
    overlong = draw(st.sampled_from(["split", "truncate", "drop", "error"]))
    reserve = draw(st.integers(0, min(2, max_len - 1)))
    top = max_len - reserve if overlong == "error" else 2 * max_len + 1
    lengths = np.array(draw(st.lists(st.integers(0, top), min_size=n, max_size=n)),
                       dtype=np.int64)
    num_keys = draw(st.integers(1, 20))
    keys = np.array(draw(st.lists(st.integers(0, num_keys - 1), min_size=n, max_size=n)),
                    dtype=np.int64)
    return lengths, keys, max_len, overlong, reserve


@settings(max_examples=150, deadline=None)
@given(cases(), st.integers(0, 2**64 - 1), st.booleans())
def test_affinity_keeps_every_guarantee(case: tuple[np.ndarray, np.ndarray, int, str, int],
                                        seed: int, shuffle: bool) -> None:
    lengths, keys, max_len, overlong, reserve = case
    kw = dict(overlong=overlong, reserve=reserve, seed=seed, shuffle=shuffle)
    plan = fastpack.pack(lengths, max_len, affinity=keys, threads=1, **kw)
    # Each token once, no pack over max_len, the over-long policy's counts.
    check_plan(plan, lengths, strategy="bfd", overlong=overlong, reserve=reserve)
    # The same plan on another thread count and on a second call.
    again = fastpack.pack(lengths, max_len, affinity=keys, threads=3, **kw)
    for name in ("sample_ids", "starts", "seqlens", "pack_offsets"):
        np.testing.assert_array_equal(getattr(plan, name), getattr(again, name))
    assert plan.affinity == again.affinity
    # Efficiency within 0.1% of plain best fit: packs <= bfd + bfd // 1000.
    bfd = fastpack.pack(lengths, max_len, **kw)
    assert plan.affinity is not None and plan.affinity.bfd_packs == bfd.num_packs
    assert plan.num_packs <= bfd.num_packs + bfd.num_packs // 1000
    assert plan.total_tokens == bfd.total_tokens
    # The plan's shares are the measure's.
    measured = fastpack.measure_affinity(plan, keys)
    assert measured.same_key_share == pytest.approx(plan.affinity.same_key_share)
    assert measured.random_share == pytest.approx(plan.affinity.random_share)


def long_tail(n: int, max_len: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(5.5, 1.2, n), 1, max_len).astype(np.int64)


@pytest.mark.parametrize("num_keys, min_share", [(5, 0.95), (400, 0.8)])
def test_related_packs_on_long_tailed_lengths(num_keys: int, min_share: float) -> None:
    n, max_len = 60_000, 4096
    lengths = long_tail(n, max_len)
    keys = np.random.default_rng(1).integers(0, num_keys, n)
    plan = fastpack.pack(lengths, max_len, affinity=keys)
    bfd = fastpack.pack(lengths, max_len)
    a = plan.affinity
    assert a is not None and a.slack > 0, "the keys' placement itself meets the bound"
    assert plan.num_packs <= bfd.num_packs * 1.001
    assert plan.efficiency >= bfd.efficiency * 0.999
    assert a.same_key_share >= min_share
    assert a.num_keys == num_keys
    # Plain best fit packs about as related as random.
    plain = fastpack.measure_affinity(bfd, keys)
    assert plain.same_key_share < 2 * a.random_share + 0.01


def test_random_share_is_a_random_packings() -> None:
    # The analytic baseline against packings of shuffled documents in order (next fit).
    n, max_len = 40_000, 2048
    lengths = long_tail(n, max_len, seed=2)
    keys = np.random.default_rng(3).zipf(1.5, n) % 50
    plan = fastpack.pack(lengths, max_len, affinity=keys)
    assert plan.affinity is not None
    shares = []
    for seed in range(3):
        perm = np.random.default_rng(seed).permutation(n)
        shuffled = fastpack.pack(lengths[perm], max_len, strategy="next_fit")
        shares.append(fastpack.measure_affinity(shuffled, keys[perm]).same_key_share)
    assert np.mean(shares) == pytest.approx(plan.affinity.random_share, rel=0.05)
    # By hand: tokens per key and per sequence.
    t_k = np.bincount(keys, weights=lengths).astype(np.float64)
    sq = float((lengths.astype(np.float64) ** 2).sum())
    total = float(lengths.sum())
    expected = ((t_k**2).sum() - sq) / (total**2 - sq)
    assert plan.affinity.random_share == pytest.approx(expected, rel=1e-9)


def test_one_key_per_pack_when_keys_fill_packs() -> None:
    lengths = np.array([4, 4, 4, 4, 2, 2, 6, 6])
    keys = np.array([0, 1, 0, 1, 2, 3, 2, 3])
    plan = fastpack.pack(lengths, 8, affinity=keys, shuffle=False)
    for p in range(plan.num_packs):
        ids = plan.segments(p)[0]
        assert len(set(keys[ids].tolist())) == 1
    assert plan.affinity is not None and plan.affinity.same_key_share == 1.0
    assert plan.affinity.pure_packs == 1.0
    # Plain best fit mixes them.
    assert fastpack.measure_affinity(fastpack.pack(lengths, 8), keys).same_key_share < 1.0


@pytest.mark.parametrize(
    "keys, error, words",
    [
        ([0, 1], FastpackError, "2 keys for 3 sequences"),
        ([0, -2, 1], FastpackError, "negative key -2 at index 1"),
        ([0.5, 1, 2], FastpackError, "not a whole number"),
        (np.array(["a", "b", "c"]), FastpackTypeError, "affinity_keys"),
        ([[0], [1], [2]], FastpackError, "1-D"),
        ("abc", FastpackTypeError, "expected a 1-D"),
        (np.array([True, False, True]), FastpackTypeError, "booleans"),
    ],
)
def test_bad_keys_raise_naming_affinity(keys: object, error: type, words: str) -> None:
    with pytest.raises(error, match="affinity") as info:
        fastpack.pack([3, 4, 5], 8, affinity=keys)
    assert words in str(info.value)


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"strategy": "ffd"}, "strategy='ffd'"),
        ({"strategy": "next_fit"}, "keeps input order"),
        ({"strategy": "wrapped"}, "strategy='wrapped'"),
        ({"long_max_len": 64}, "not supported with long_max_len"),
        ({"group_tokens": 16}, "not supported with group_tokens"),
        ({"limits": {"images": ([0, 1, 0], 1)}}, "not supported with limits"),
        ({"cp_size": 2}, "not supported with cp_size"),
    ],
)
def test_affinity_refuses_options_it_cannot_honour(kw: dict, words: str) -> None:
    with pytest.raises(FastpackError, match="affinity") as info:
        fastpack.pack([3, 4, 5], 8, affinity=[0, 1, 0], **kw)
    assert words in str(info.value)


def test_a_plan_without_keys_has_no_affinity() -> None:
    plan = fastpack.pack([3, 4, 5], 8, affinity=[0, 1, 0])
    assert plan.affinity is not None and "affinity:" in plan.summary()
    assert fastpack.pack([3, 4, 5], 8).affinity is None
    fields = {name: getattr(plan, name) for name in fastpack.Plan._FIELDS}
    assert fastpack.Plan(fields).affinity is None
    assert pickle.loads(pickle.dumps(plan)).affinity == plan.affinity


def test_affinity_keys_hash_strings_deterministically() -> None:
    keys = fastpack.affinity_keys(["a.com", "b.org", "a.com"])
    assert keys.dtype == np.int64 and keys[0] == keys[2] != keys[1] and (keys >= 0).all()
    # Fixed across runs and machines (BLAKE2b of the UTF-8 text), numpy or Arrow alike.
    assert int(keys[0]) == 3651783651345958261
    arrow = pa.chunked_array([["a.com"], ["b.org", "a.com"]])
    np.testing.assert_array_equal(fastpack.affinity_keys(arrow), keys)
    np.testing.assert_array_equal(fastpack.affinity_keys(np.array([7, 3])), [7, 3])
    with pytest.raises(FastpackError, match="nulls"):
        fastpack.affinity_keys(pa.array(["a", None]))
    with pytest.raises(FastpackError, match="negative"):
        fastpack.affinity_keys([-1, 2])


# ---------------------------------------------------------------------------------------
# the command: fastpack pack --affinity-column


def _corpus_with_keys(tmp_path: Path) -> tuple[list[str], list[np.ndarray], list[object]]:
    from corpus import documents, write

    rng = np.random.default_rng(5)
    paths, docs, keys = [], [], []
    domains = ["a.org", "b.com", "c.net", "d.io"]
    for name in ["p.parquet", "q.parquet"]:
        lengths = rng.integers(1, 120, 80).tolist()
        part = documents(lengths, first=len(docs))
        path = write(tmp_path / name, part)
        table = pq.read_table(path)
        domain = [domains[i % 4] for i in rng.integers(0, 4, len(part))]
        table = table.append_column("domain", pa.array(domain))
        table = table.append_column("cluster", pa.array(rng.integers(0, 6, len(part))))
        pq.write_table(table, path)
        paths.append(str(path))
        docs.extend(part)
        keys.extend(domain)
    return paths, docs, keys


def test_cli_packs_a_parquet_key_column_together(tmp_path: Path) -> None:
    from click.testing import CliRunner
    from corpus import check_output, read_rows

    from fastpack.cli import main

    paths, docs, domains = _corpus_with_keys(tmp_path)
    out_dir = tmp_path / "out"
    result = CliRunner().invoke(main, ["pack", *paths, "-o", str(out_dir), "--max-len", "256",
                                       "--seed", "4", "--affinity-column", "domain",
                                       "--no-plot"])
    assert result.exit_code == 0, result.output
    rows = check_output(out_dir, docs, max_len=256)
    # Exactly fastpack.pack's plan with the hashed domains as keys.
    lengths = np.array([len(d) for d in docs])
    keys = fastpack.affinity_keys(domains)
    plan = fastpack.pack(lengths, 256, seed=4, affinity=keys)
    assert rows.num_rows == plan.num_packs
    for p in range(plan.num_packs):
        assert rows.column("seq_lengths")[p].as_py() == plan.segments(p)[2].tolist()
    report = json.loads((out_dir / "report.json").read_text())
    assert plan.affinity is not None
    assert report["affinity"]["same_key_share"] == pytest.approx(plan.affinity.same_key_share)
    assert report["settings"]["affinity_column"] == "domain"
    assert "token pairs of one key in a pack" in result.output
    # An integer column is a key as it is; a run without the flag has no affinity.
    out2 = tmp_path / "out2"
    result = CliRunner().invoke(main, ["pack", *paths, "-o", str(out2), "--max-len", "256",
                                       "--affinity-column", "cluster", "--no-plot"])
    assert result.exit_code == 0, result.output
    cluster = pa.concat_arrays([pq.read_table(p).column("cluster").combine_chunks()
                                for p in paths]).to_numpy()
    plan = fastpack.pack(lengths, 256, affinity=cluster)
    assert read_rows(out2).num_rows == plan.num_packs
    report = json.loads((out2 / "report.json").read_text())
    assert plan.affinity is not None
    assert report["affinity"]["num_keys"] == plan.affinity.num_keys == 6


def test_cli_refuses_a_bad_key_column(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from fastpack.cli import main

    paths, _, _ = _corpus_with_keys(tmp_path)
    for column, words in [("nope", "no such column"), ("input_ids", "needs integers or strings")]:
        result = CliRunner().invoke(main, ["pack", *paths, "-o", str(tmp_path / column),
                                           "--max-len", "256", "--affinity-column", column])
        assert result.exit_code == 2, result.output
        assert words in result.output and column in result.output
    result = CliRunner().invoke(main, ["pack", *paths, "-o", str(tmp_path / "x"), "--max-len",
                                       "256", "--affinity-column", "domain", "--strategy",
                                       "next_fit"])
    assert result.exit_code == 2 and "--affinity-column" in result.output, result.output


def test_keys_from_json_lines_integers_or_strings(tmp_path: Path) -> None:
    from fastpack._offline.affinity import read_keys
    from fastpack._offline.sources import expand_inputs

    rows = [{"input_ids": [1, 2], "n": 7, "d": "x.org"}, {"input_ids": [3], "n": 2, "d": "y"}]
    path = tmp_path / "k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sources = expand_inputs([str(path)])
    np.testing.assert_array_equal(read_keys(sources, "n"), [7, 2])
    np.testing.assert_array_equal(read_keys(sources, "d"), fastpack.affinity_keys(["x.org", "y"]))


def test_cli_affinity_shard_jobs_write_one_jobs_bytes(tmp_path: Path) -> None:
    from click.testing import CliRunner
    from corpus import assert_same_output

    from fastpack.cli import main

    paths, _, _ = _corpus_with_keys(tmp_path)
    args = [*paths, "--max-len", "256", "--affinity-column", "domain", "--shard-rows", "9",
            "--no-plot", "-q"]
    run = CliRunner().invoke
    assert run(main, ["pack", *args, "-o", str(tmp_path / "one")]).exit_code == 0
    for i in (1, 0):
        result = run(main, ["pack", *args, "-o", str(tmp_path / "split"), "--shard", f"{i}/2"])
        assert result.exit_code == 0, result.output
    result = run(main, ["pack", "-o", str(tmp_path / "split"), "--finalize", "--no-plot"])
    assert result.exit_code == 0, result.output
    assert_same_output(tmp_path / "split", tmp_path / "one")  # report.json's affinity too
    assert json.loads((tmp_path / "split" / "report.json").read_text())["affinity"]
    # A mixture decides which documents are packed: not combined with keys yet.
    mix = tmp_path / "mix.yaml"
    mix.write_text("step_tokens: 4096\nsources:\n"
                   + "".join(f"  - {{name: s{i}, paths: [{p}], weight: 1}}\n"
                             for i, p in enumerate(paths)))
    result = run(main, ["pack", "-o", str(tmp_path / "m"), "--max-len", "256",
                        "--affinity-column", "domain", "--mix", str(mix)])
    assert result.exit_code == 2, result.output
    assert "--affinity-column: affinity_column: not supported with a mixture" in result.output
    result = run(main, ["pack", *paths, "-o", str(tmp_path / "r"), "--max-len", "256",
                        "--affinity-column", "domain", "--ray", "local"])
    assert result.exit_code == 2 and "not on Ray yet" in result.output, result.output
