"""``fastpack doctor`` reports this machine truthfully: the versions it names are the ones
Python imports, a missing package reads as missing, and the paths follow from both."""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys

import pytest

from fastpack import doctor


def _paths(found: doctor.Report) -> dict[str, doctor.Path]:
    return {p.name: p for p in found.paths}


def test_the_command_prints_the_report_as_json() -> None:
    out = subprocess.run([sys.executable, "-m", "fastpack", "doctor", "--json"],
                         capture_output=True, text=True, check=True).stdout
    found = json.loads(out)
    versions = {p["module"]: p["version"] for p in found["packages"]}
    import numpy
    import pyarrow

    assert versions["numpy"] == numpy.__version__
    assert versions["pyarrow"] == pyarrow.__version__
    for module, shown in versions.items():
        assert (shown is None) == (importlib.util.find_spec(module) is None), module
    table = subprocess.run([sys.executable, "-m", "fastpack", "doctor"],
                           capture_output=True, text=True, check=True).stdout
    assert "paths on this machine" in table


def test_torch_and_its_device_are_what_torch_says() -> None:
    torch = pytest.importorskip("torch")
    found = doctor.report()
    versions = {p.module: p.version for p in found.packages}
    assert versions["torch"] == importlib.metadata.version("torch")
    assert ("cpu" in found.device) == (not torch.cuda.is_available())
    from fastpack.torch.attention import available_kernels

    flash = _paths(found)["flash batches (cu_seqlens)"]
    probe = torch.zeros(1, 1, 8)
    if not torch.cuda.is_available():
        assert flash.kernel == available_kernels(probe)[0] == "sdpa"


def test_a_missing_package_is_reported_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def without_transformers(name: str, *args: object) -> object:
        return None if name == "transformers" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_transformers)
    found = doctor.report()
    assert {p.module: p.version for p in found.packages}["transformers"] is None
    if importlib.util.find_spec("torch") is not None:
        mixin = _paths(found)["PackedTrainerMixin"]
        assert not mixin.exact and "found none" in mixin.note


@pytest.mark.parametrize(("installed", "runs"), [("5.18.2", False), ("5.19.0", True),
                                                 ("6.0.0.dev0", True)])
def test_the_trainer_needs_transformers_5_19(monkeypatch: pytest.MonkeyPatch, installed: str,
                                             runs: bool) -> None:
    pytest.importorskip("torch")
    real = doctor._version
    monkeypatch.setattr(doctor, "_version", lambda module, dist: installed
                        if module == "transformers" else real(module, dist))
    mixin = _paths(doctor.report())["PackedTrainerMixin"]
    assert mixin.exact is runs
    assert (installed in mixin.note) is not runs


def test_without_torch_no_training_path_is_claimed(monkeypatch: pytest.MonkeyPatch) -> None:
    real = doctor._version
    monkeypatch.setattr(doctor, "_version",
                        lambda module, dist: None if module == "torch" else real(module, dist))
    found = doctor.report()
    assert "torch is not installed" in found.device
    assert [p.exact for p in found.paths] == [False]


def test_flex_attention_s_compiler_is_the_one_torch_compile_calls(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The C++ compiler reported is the one inductor would call (its ``cpp.cxx`` setting,
    from ``$CXX``), and without it flex attention is not claimed to run on the CPU."""
    torch = pytest.importorskip("torch")
    import shutil

    from torch._inductor import config

    found = doctor.report()
    compilers = {c.name: c.found for c in found.compilers}
    expected = next((shutil.which(c) for c in config.cpp.cxx if c and shutil.which(c)), None)
    assert compilers["C++ (torch.compile, CPU)"] == expected
    assert compilers["triton"] == (importlib.metadata.version("triton")
                                   if importlib.util.find_spec("triton") else None)
    monkeypatch.setattr(config.cpp, "cxx", (None, "no-such-compiler-fastpack"))
    found = doctor.report()
    assert {c.name: c.found for c in found.compilers}["C++ (torch.compile, CPU)"] is None
    if not torch.cuda.is_available():
        flex = _paths(found)["flex batches (attn_implementation='flex_attention')"]
        assert not flex.exact and "none found" in flex.note
    assert "compilers (flex attention)" in found.format()
