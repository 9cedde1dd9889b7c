"""The README's first command: the demo on the built-in corpus."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import fastpack
from fastpack.demo import main


def test_example_corpora_are_real_and_shipped():
    functions = fastpack.example_lengths("functions")
    modules = fastpack.example_lengths()
    assert functions.dtype == np.uint32 and len(functions) > 5_000
    assert len(fastpack.example_lengths("modules")) > 500 and modules.sum() > 0
    with pytest.raises(ValueError, match="name: unknown example"):
        fastpack.example_lengths("wiki")


def test_demo_reports_packing_against_padding(capsys):
    assert main(["--max-len", "2048"]) == 0
    out = capsys.readouterr().out
    assert "pad every sequence to max_len" in out
    assert "fastpack.pack(strategy='bfd')" in out
    assert "0 tokens lost" in out
    plan = fastpack.pack(fastpack.example_lengths(), 2048, overlong="split")
    assert f"{plan.num_packs:,} packs for a lower bound of {plan.lower_bound:,}" in out


def test_demo_runs_as_a_module():
    result = subprocess.run([sys.executable, "-W", "error", "-m", "fastpack.demo", "--example",
                             "modules"], capture_output=True, text=True, timeout=120, check=True)
    assert "packs for a lower bound of" in result.stdout
