"""The README's first command: the demo on the built-in corpus. Every number it prints is
checked against the corpus itself (recomputed here, independently of the demo's code)."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

import fastpack
from fastpack.demo import main


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def test_example_corpora_are_real_and_shipped():
    functions = fastpack.example_lengths("functions")
    modules = fastpack.example_lengths()
    assert functions.dtype == np.uint32 and len(functions) > 5_000
    assert len(fastpack.example_lengths("modules")) > 500 and modules.sum() > 0


def _kept(lengths: np.ndarray, max_len: int, overlong: str) -> np.ndarray:
    """Tokens of each document that end up in a row, by the policy's definition."""
    over = lengths > max_len
    if overlong == "truncate":
        return np.where(over, max_len, lengths)
    if overlong == "drop":
        return np.where(over, 0, lengths)
    return lengths


@pytest.mark.parametrize(("example", "max_len", "overlong"), [
    ("functions", 2048, "split"), ("modules", 4096, "split"), ("functions", 1024, "truncate"),
    ("modules", 8192, "drop"),
])
def test_demo_prints_the_corpus_numbers(capsys, example, max_len, overlong):
    argv = ["--example", example, "--max-len", str(max_len), "--overlong", overlong]
    assert main(argv) == 0
    out = capsys.readouterr().out
    lengths = fastpack.example_lengths(example).astype(np.int64)
    tokens = int(lengths.sum())
    kept = _kept(lengths, max_len, overlong)

    head = re.search(r"demo: ([\d,]+) documents .*?, ([\d,]+) tokens, max_len ([\d,]+)", out)
    assert head and [_number(g) for g in head.groups()] == [len(lengths), tokens, max_len]
    stats = re.search(r"median ([\d,]+), mean ([\d,]+), max ([\d,]+); ([\d,]+) longer", out)
    assert stats
    assert [_number(g) for g in stats.groups()] == [
        int(np.median(lengths)), round(lengths.mean()), int(lengths.max()),
        int((lengths > max_len).sum()),
    ]

    # Padding every document to max_len: one row per piece (split), per document kept
    # whole or truncated, none for a dropped one.
    rows = {"split": int((-(-lengths // max_len)).sum()), "truncate": len(lengths),
            "drop": int((lengths <= max_len).sum())}[overlong]
    row = re.search(r"pad every sequence to max_len\s+([\d,]+)\s+([\d.]+)%", out)
    assert row and _number(row.group(1)) == rows
    expected = 100 * int(kept.sum()) / (rows * max_len)
    assert float(row.group(2)) == pytest.approx(expected, abs=0.006)

    # Every strategy's row: the packs and efficiency of that plan.
    for strategy in ("next_fit", "wrapped", "ffd", "bfd"):
        plan = fastpack.pack(lengths, max_len, strategy=strategy, overlong=overlong)
        row = re.search(rf"strategy='{strategy}'\)\s+([\d,]+)\s+([\d.]+)%", out)
        assert row and _number(row.group(1)) == plan.num_packs, strategy
        packed = int(plan.seqlens.sum())
        expected = 100 * packed / (plan.num_packs * max_len)
        assert float(row.group(2)) == pytest.approx(expected, abs=0.006), strategy
    wrapped = fastpack.pack(lengths, max_len, strategy="wrapped")
    assert wrapped.num_packs == -(-tokens // max_len)  # wrapped reaches the bound exactly

    bfd = re.search(
        r"bfd: ([\d,]+) packs for a lower bound of ([\d,]+) \(\+([\d,]+)\); ([\d,]+) sequences "
        r"split, ([\d,]+) tokens lost", out)
    assert bfd
    packs, bound, extra, split, lost = (_number(g) for g in bfd.groups())
    plan = fastpack.pack(lengths, max_len, overlong=overlong)
    assert (packs, bound, extra) == (plan.num_packs, -(-int(kept.sum()) // max_len), packs - bound)
    over = int((lengths > max_len).sum())
    assert split == (over if overlong == "split" else 0)
    # Tokens lost: none when split, the cut tails when truncated, whole documents dropped.
    assert lost == tokens - int(kept.sum())
    assert (lost > 0) == (overlong != "split" and over > 0)
    details = re.search(r"tokens lost \(([\d,]+) dropped, ([\d,]+) truncated\)", out)
    assert details and [_number(g) for g in details.groups()] == [
        lost if overlong == "drop" else 0, lost if overlong == "truncate" else 0]

    # Pack 0 as printed: its segments, tokens and cu_seqlens are those of the plan.
    first = re.search(r"pack 0: (\d+) segments, ([\d,]+) tokens, from sequences \[([\d, ]*)\]",
                      out)
    assert first
    ids, _, seqlens = plan.segments(0)
    assert int(first.group(1)) == len(ids) and _number(first.group(2)) == int(seqlens.sum())
    assert [int(i) for i in first.group(3).split(",")] == ids[:6].tolist()
    cu = re.search(r"cu_seqlens \[([\d, ]*)\]", out)
    assert cu and [int(c) for c in cu.group(1).split(",")] == plan.cu_seqlens(0)[:7].tolist()


def test_demo_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--max-len", "0"])
    assert exit_info.value.code == 2
    assert "--max-len: got 0; expected an integer in 1..=16777216" in capsys.readouterr().err


def test_demo_runs_as_a_module():
    result = subprocess.run([sys.executable, "-W", "error", "-m", "fastpack.demo", "--example",
                             "modules"], capture_output=True, text=True, timeout=120, check=True)
    assert "packs for a lower bound of" in result.stdout
