"""Mixtures by tokens (``fastpack.mix``, ``fastpack pack --mix``): every step carries each
source's share within one document, every copy of a document is packed whole and once,
documents repeated or left out are counted, the same seed gives the same plan; and the
command writes it, with the realised mix in report.json."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from corpus import STRIDE, corpus, read_rows
from hypothesis import given, settings
from hypothesis import strategies as st

import fastpack
from fastpack import FastpackError, MixSource, Mixture, mix
from fastpack.cli import main


def step_tokens_by_source(planned: fastpack.MixedPlan, bases: np.ndarray) -> np.ndarray:
    """Tokens of each source (rows) in each step (columns), from the plan alone."""
    plan = planned.plan
    pack_of_segment = np.repeat(np.arange(plan.num_packs), np.diff(plan.pack_offsets))
    step_of_pack = np.repeat(np.arange(planned.num_steps), np.diff(planned.step_offsets))
    source = np.searchsorted(bases, plan.sample_ids, side="right") - 1
    out = np.zeros((len(bases) - 1, planned.num_steps), dtype=np.int64)
    np.add.at(out, (source, step_of_pack[pack_of_segment]), plan.seqlens)
    return out


@st.composite
def mixtures(draw):
    k = draw(st.integers(1, 4))
    max_len = draw(st.sampled_from([64, 128, 300]))
    sources, lengths = [], []
    for i in range(k):
        n = draw(st.integers(1, 60))
        top = draw(st.sampled_from([max_len // 4, max_len, 2 * max_len]))
        lengths.append(np.asarray(draw(st.lists(st.integers(0, top), min_size=n,
                                                max_size=n)), dtype=np.int64))
        if draw(st.booleans()) and lengths[-1].sum() > 0:
            sources.append(MixSource(f"s{i}", weight=draw(st.floats(0.05, 5))))
        else:
            sources.append(MixSource(f"s{i}", epochs=draw(st.floats(0.1, 3.5))))
    weighted = any(s.weight is not None for s in sources)
    tokens = None
    if weighted and draw(st.booleans()):
        fixed = sum(s.epochs * a.sum() for s, a in zip(sources, lengths) if s.epochs)
        tokens = int(fixed) + draw(st.integers(1, 20_000))
    mixture = Mixture(sources, tokens=tokens, step_tokens=draw(st.integers(40, 3000)))
    return mixture, lengths, max_len, draw(st.integers(0, 2**64 - 1))


@settings(max_examples=80, deadline=None)
@given(mixtures(), st.sampled_from(["bfd", "next_fit", "wrapped"]))
def test_every_step_carries_each_source_within_one_document(case, strategy):
    mixture, lengths, max_len, seed = case
    planned = mix(lengths, mixture, max_len, strategy=strategy, overlong="split", seed=seed)
    plan = planned.plan
    bases = np.concatenate([[0], np.cumsum([len(a) for a in lengths])])
    everything = np.concatenate(lengths)
    # No pack over the cap; the steps tile the packs.
    assert (plan.pack_fills <= max_len).all()
    assert planned.step_offsets[0] == 0 and planned.step_offsets[-1] == plan.num_packs
    assert (np.diff(planned.step_offsets) >= 0).all()
    # Each copy of a document whole and once: a document's tokens in the plan are its
    # copies times its length, and its pieces tile every copy.
    tokens = np.bincount(plan.sample_ids, weights=plan.seqlens, minlength=len(everything))
    assert np.array_equal(tokens, planned.copies * everything)
    if strategy != "wrapped" and plan.num_segments:  # (wrapped cuts the stream anywhere: tokens checked above)
        pairs = np.stack([plan.sample_ids, plan.starts, plan.seqlens], axis=1)
        pieces, times = np.unique(pairs, axis=0, return_counts=True)
        assert np.array_equal(times, planned.copies[pieces[:, 0]])  # every copy alike
        first = np.concatenate([[True], pieces[1:, 0] != pieces[:-1, 0]])
        ends = np.cumsum(pieces[:, 2]) - np.repeat(np.cumsum(pieces[:, 2])[first] -
                                                   pieces[first, 2], np.diff(np.flatnonzero(
                                                       np.concatenate([first, [True]]))))
        assert np.array_equal(pieces[:, 1] + pieces[:, 2], ends)  # pieces tile the document
    per_step = step_tokens_by_source(planned, bases)
    for i, (s, a, report) in enumerate(zip(mixture.sources, lengths, planned.sources)):
        mine = planned.copies[bases[i]:bases[i + 1]]
        out_tokens = int(per_step[i].sum())
        # Counted: repeats and documents left out.
        assert report["repeated"] == int(np.maximum(mine - 1, 0).sum())
        assert report["left_out"] == int((mine == 0).sum())
        assert report["output_tokens"] == out_tokens
        assert report["output_documents"] == int(mine.sum())
        # The proportions: every step within one document of the source's share.
        longest = int(a.max()) if a.size else 0
        piece = min(longest, max_len) if strategy != "wrapped" else longest
        assert report["longest_piece"] <= piece
        assert (np.abs(per_step[i] - out_tokens / planned.num_steps) <= piece).all()
        assert report["max_step_deviation_tokens"] <= piece
        # Up- and down-sampling: whole passes, then part of one more.
        epochs = s.epochs if s.epochs is not None else report["epochs_target"]
        whole = int(np.floor(epochs + 1e-12))
        assert set(np.unique(mine)) <= {whole, whole + 1}
        if s.epochs is not None:
            assert (mine > whole).sum() == int(np.floor((s.epochs - whole) * len(a) + 0.5))
        else:  # by tokens: reached within one document
            target = epochs * a.sum()
            assert target - 1e-6 <= out_tokens < target + max(longest, 1)


@settings(max_examples=40, deadline=None)
@given(mixtures())
def test_the_same_seed_gives_the_same_mix(case):
    mixture, lengths, max_len, seed = case
    a = mix(lengths, mixture, max_len, overlong="split", seed=seed, threads=1)
    b = mix([x.copy() for x in lengths], mixture, max_len, overlong="split", seed=seed,
            threads=2)
    for name in ("sample_ids", "starts", "seqlens", "pack_offsets"):
        assert np.array_equal(getattr(a.plan, name), getattr(b.plan, name))
    assert np.array_equal(a.step_offsets, b.step_offsets)
    assert a.sources == b.sources


def test_epochs_and_weights_as_documented():
    """epochs 2.5 = every document twice and half of them once more (chosen by the seed);
    weights share the output's tokens, the largest weighted source read once."""
    web = np.full(1000, 100)
    code = np.full(100, 50)
    wiki = np.arange(1, 201)
    m = Mixture({"web": {"weight": 3}, "code": {"weight": 1}, "wiki": {"epochs": 2.5}},
                step_tokens=20_000)
    a = mix({"web": web, "code": code, "wiki": wiki}, m, 512, seed=1)
    web_r, code_r, wiki_r = a.sources
    assert web_r["output_tokens"] == 100_000 and web_r["repeated"] == web_r["left_out"] == 0
    # code: 33,333 tokens asked: 6 passes and 67 documents of one more (within one)
    assert code_r["output_tokens"] == 33_350
    assert code_r["repeated"] == code_r["output_documents"] - 100 and code_r["left_out"] == 0
    wiki_copies = a.copies[1100:]
    assert np.bincount(wiki_copies).tolist() == [0, 0, 100, 100]
    assert wiki_r["repeated"] == 300 and wiki_r["left_out"] == 0
    b = mix({"web": web, "code": code, "wiki": wiki}, m, 512, seed=2)
    assert not np.array_equal(b.copies[1100:], wiki_copies)  # the seed chooses which
    # Down-sampling: half the documents, the rest left out and counted.
    half = mix({"web": web}, Mixture({"web": {"epochs": 0.5}}), 512)
    assert half.sources[0]["left_out"] == 500 and half.sources[0]["output_documents"] == 500
    # A token target: the weighted sources share what the epochs sources leave.
    t = mix({"web": web, "wiki": wiki}, Mixture({"web": {"weight": 1}, "wiki": {"epochs": 1}},
                                                tokens=70_100), 512)
    assert t.sources[0]["target_tokens"] == 70_100 - int(wiki.sum())


def test_mix_loses_at_most_one_pack_per_step():
    """Each step is packed on its own: at most part of one pack per step lost."""
    rng = np.random.default_rng(0)
    lengths = [rng.integers(1, 2048, 20_000), rng.integers(1, 512, 20_000)]
    m = Mixture({"a": {"weight": 1}, "b": {"weight": 1}}, step_tokens=64 * 2048)
    planned = mix(lengths, m, 2048)
    bound = -(-int(planned.lengths.sum()) // 2048)
    assert planned.plan.num_packs <= bound + planned.num_steps


@pytest.mark.parametrize(("spec", "message"), [
    ({"sources": []}, "'sources' must list"),
    ({"sources": [{"name": "a", "paths": "x", "weight": 1, "epochs": 2}]}, "exactly one of"),
    ({"sources": [{"name": "a", "paths": "x", "weight": -1}]}, "weight must be a positive"),
    ({"sources": [{"name": "a", "paths": "x", "epochs": "2"}]}, "epochs must be a positive"),
    ({"sources": [{"name": "a", "weight": 1}, {"name": "a", "weight": 2}]}, "named twice"),
    ({"sources": {"a": {"weight": 1, "path": "x"}}}, "unknown key 'path'"),
    ({"sources": {"a": {"weight": 1}}, "step_tokens": 0}, "step_tokens must be"),
    ({"sources": {"a": {"epochs": 1}}, "tokens": 10}, "every source has epochs"),
    ({"sources": {"a": {"weight": 1}}, "steps": 3}, "unknown key 'steps'"),
])
def test_bad_mixtures_are_named(spec, message):
    with pytest.raises(FastpackError, match=message):
        Mixture.from_dict(spec)


def test_bad_lengths_and_options_are_named():
    m = Mixture({"a": {"weight": 1}, "b": {"epochs": 1}})
    with pytest.raises(FastpackError, match="missing 'b'"):
        mix({"a": [1, 2]}, m, 8)
    with pytest.raises(FastpackError, match="source 'a': expected a 1-D array"):
        mix({"a": [[1, 2]], "b": [1]}, m, 8)
    with pytest.raises(FastpackError, match="source 'a' has no tokens"):
        mix({"a": [0, 0], "b": [1]}, m, 8)
    with pytest.raises(FastpackError, match="group_tokens"):
        mix({"a": [1], "b": [1]}, m, 8, group_tokens=16)
    with pytest.raises(FastpackError, match="source 'b', document 1: 9 tokens, over the cap"):
        mix({"a": [1], "b": [3, 9]}, m, 8)


# ---------------------------------------------------------------------------------------
# the command


def write_mix(tmp: Path, text: str) -> Path:
    path = tmp / "mix.yaml"
    path.write_text(text)
    return path


def test_pack_mix_end_to_end(tmp_path):
    rng = np.random.default_rng(3)
    (tmp_path / "web").mkdir()
    paths, docs = corpus(tmp_path, [rng.integers(1, 400, 150).tolist(),
                                    rng.integers(1, 400, 150).tolist(),
                                    rng.integers(1, 200, 80).tolist(),
                                    rng.integers(1, 600, 40).tolist()],
                         ["web/a.parquet", "web/b.jsonl", "code.jsonl", "wiki.parquet"],
                         labels=True)
    mix_file = write_mix(tmp_path, """
step_tokens: 8000
sources:
  - {name: web, paths: ["web/*"], weight: 2}
  - {name: code, paths: code.jsonl, weight: 1}
  - {name: wiki, paths: [wiki.parquet], epochs: 2.5}
""")
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["pack", "--mix", str(mix_file), "-o", str(out),
                                       "--max-len", "1024", "--shard-rows", "8", "-q",
                                       "--columns", "labels", "--seed", "5"])
    assert result.exit_code == 0, result.output
    assert "mix of 3 sources" in result.output
    report = json.loads((out / "report.json").read_text())
    web, code, wiki = report["mix"]["sources"]
    # Counted against the rows themselves: which documents, how many times, which step.
    rows = read_rows(out)
    steps = np.load(out / "group_offsets.npy")
    assert steps[-1] == rows.num_rows == report["packs"]
    seen = np.zeros(len(docs), dtype=np.int64)
    bases = np.array([0, 300, 380, 420])
    per_step = np.zeros((3, len(steps) - 1), dtype=np.int64)
    row_step = np.repeat(np.arange(len(steps) - 1), np.diff(steps))
    for r, (tokens, labels, seqlens) in enumerate(zip(
            rows.column("input_ids").to_pylist(), rows.column("labels").to_pylist(),
            rows.column("seq_lengths").to_pylist())):
        assert len(tokens) <= 1024 and labels == [t + 7 for t in tokens]
        at = 0
        for n in seqlens:
            d = tokens[at] // STRIDE
            assert tokens[at:at + n] == list(range(d * STRIDE, d * STRIDE + n))
            assert n == len(docs[d])  # whole documents
            seen[d] += 1
            per_step[np.searchsorted(bases, d, side="right") - 1, row_step[r]] += n
            at += n
    for i, source in enumerate((web, code, wiki)):
        mine = seen[bases[i]:bases[i + 1]]
        assert source["output_documents"] == mine.sum()
        assert source["repeated"] == np.maximum(mine - 1, 0).sum()
        assert source["left_out"] == (mine == 0).sum()
        assert source["output_tokens"] == per_step[i].sum()
        longest = max(len(d) for d in docs[bases[i]:bases[i + 1]])
        assert np.abs(per_step[i] - per_step[i].sum() / per_step.shape[1]).max() <= longest
    assert np.bincount(seen[380:]).tolist() == [0, 0, 20, 20]  # epochs 2.5 of 40
    assert web["left_out"] == web["repeated"] == 0  # the largest weighted source, once
    assert abs(code["realised_share"] - web["realised_share"] / 2) < 400 / report[
        "packed_tokens"]
    assert report["settings"]["mix"]["sources"][0]["paths"] == [str(tmp_path / "web/*")]
    assert pq.ParquetFile(out / f"shard-00000-of-{report['shards']:05d}.parquet").metadata


def test_report_png_has_the_mix_panel(tmp_path, monkeypatch):
    # A --mix run's report.png draws a third panel: each source's target and realised
    # share of the tokens, as report.json's mix says; a run without --mix draws two.
    pytest.importorskip("matplotlib")
    import fastpack._offline.stats as stats

    drawn = []
    save = stats._save

    def spy(fig, path):
        drawn.append([(ax.get_title(), [t.get_text() for t in ax.get_xticklabels()],
                       [bar.get_height() for bar in ax.patches]) for ax in fig.axes])
        save(fig, path)

    monkeypatch.setattr(stats, "_save", spy)
    paths, _ = corpus(tmp_path, [[30, 50, 20, 70] * 5, [10, 40, 25] * 4],
                      ["web.parquet", "code.jsonl"])
    mix_file = write_mix(tmp_path, f"""
step_tokens: 400
sources:
  - {{name: web, paths: {paths[0]}, weight: 3}}
  - {{name: code, paths: {paths[1]}, epochs: 1.5}}
""")
    widths = []
    for args in (["--mix", str(mix_file)], paths):
        out = tmp_path / f"out{len(widths)}"
        result = CliRunner().invoke(main, ["pack", *args, "-o", str(out), "--max-len", "128",
                                           "-q"])
        assert result.exit_code == 0, result.output
        png = (out / "report.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        widths.append(int.from_bytes(png[16:20], "big"))  # IHDR: width, height
    mixed, plain = drawn
    assert len(mixed) == 3 and len(plain) == 2
    assert 2 * widths[0] == 3 * widths[1]  # three panels of the same size
    mix = json.loads((tmp_path / "out0" / "report.json").read_text())["mix"]
    sources = mix["sources"]
    title, ticks, heights = mixed[2]
    assert title.startswith(f"mix: {mix['steps']} steps of ~{mix['step_tokens']} tokens")
    assert ticks == [f"{s['name']}\n{s['output_documents']} docs\n+{s['repeated']} / "
                     f"-{s['left_out']}" for s in sources]
    assert sources[1]["repeated"] == 6  # half of code's documents again: not quite its target
    assert sources[1]["realised_share"] != pytest.approx(sources[1]["target_share"])
    assert heights == pytest.approx([100 * s[k] for k in ("target_share", "realised_share")
                                     for s in sources])


@pytest.mark.parametrize(("args", "message"), [
    (["a.parquet"], "--mix names the inputs"),
    (["--ray"], "--mix runs on one machine"),
    (["--plan-shards", "2"], "plan_shards: a mixture"),
    (["--group-tokens", "4096"], "group_tokens: a mixture's steps"),
])
def test_pack_mix_refusals(tmp_path, args, message):
    corpus(tmp_path, [[5, 6]], ["a.parquet"])
    mix_file = write_mix(tmp_path, "sources: {a: {paths: a.parquet, weight: 1}}\n")
    result = CliRunner().invoke(main, ["pack", "--mix", str(mix_file), "-o",
                                       str(tmp_path / "o"), "--max-len", "64",
                                       *[str(tmp_path / a) if a.endswith(".parquet") else a
                                         for a in args]])
    assert result.exit_code == 2 and message in result.output, result.output


def test_pack_mix_bad_file(tmp_path):
    bad = write_mix(tmp_path, "sources: [a, b\n")
    result = CliRunner().invoke(main, ["pack", "--mix", str(bad), "-o", str(tmp_path / "o"),
                                       "--max-len", "64"])
    assert result.exit_code == 2 and "not valid YAML" in result.output
    none = write_mix(tmp_path, "sources: {a: {paths: 'nothing-*.parquet', weight: 1}}\n")
    result = CliRunner().invoke(main, ["pack", "--mix", str(none), "-o", str(tmp_path / "o"),
                                       "--max-len", "64"])
    assert result.exit_code == 2 and "no file matches" in result.output
    assert not (tmp_path / "o").exists()
