"""``fastpack doctor``: what this machine has (versions, optional kernels) and, from that,
which packed-training paths run here, exactly and fast.

Nothing here changes state; optional packages are looked up (``find_spec`` and their
distribution's version) rather than imported, except torch, whose devices and attention
kernels are only known by asking it.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import sys
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any

__all__ = ["Compiler", "Package", "Path", "Report", "report"]

#: transformers releases before this lack what PackedTrainerMixin needs
#: (``Trainer.loss_is_scaled_for_ga``).
TRANSFORMERS_FLOOR = (5, 19)


@dataclass(frozen=True)
class Package:
    """One package: its import name, its distribution's version (``None``: not
    installed) and what fastpack uses it for."""

    module: str
    distribution: str
    used_for: str
    version: str | None


@dataclass(frozen=True)
class Compiler:
    """What compiles flex attention's kernels on one kind of device: ``found`` is the
    compiler's path or the package's version (``None``: missing)."""

    name: str
    found: str | None
    used_for: str


@dataclass(frozen=True)
class Path:
    """One packed-training path: whether it computes exactly what the unpacked model does
    here, and with which kernel (the fast one, or the exact fallback)."""

    name: str
    exact: bool
    kernel: str
    note: str = ""


@dataclass
class Report:
    python: str
    platform: str
    fastpack: str
    fastpack_location: str
    threads: int
    device: str
    packages: list[Package] = field(default_factory=list)
    compilers: list[Compiler] = field(default_factory=list)
    paths: list[Path] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "python": self.python,
            "platform": self.platform,
            "fastpack": self.fastpack,
            "fastpack_location": self.fastpack_location,
            "threads": self.threads,
            "device": self.device,
            "packages": [vars(p) for p in self.packages],
            "compilers": [vars(c) for c in self.compilers],
            "paths": [vars(p) for p in self.paths],
        }

    def format(self) -> str:
        lines = [
            f"fastpack {self.fastpack} ({self.fastpack_location})",
            f"python {self.python} on {self.platform}; {self.threads} planning threads; "
            f"device: {self.device}",
            "",
            "packages",
        ]
        width = max(len(p.module) for p in self.packages)
        for p in self.packages:
            shown = p.version if p.version is not None else "-"
            lines.append(f"  {p.module:<{width}}  {shown:<12}  {p.used_for}")
        if self.compilers:
            lines += ["", "compilers (flex attention)"]
            width = max(len(c.name) for c in self.compilers)
            for c in self.compilers:
                shown = c.found if c.found is not None else "-"
                lines.append(f"  {c.name:<{width}}  {shown:<12}  {c.used_for}")
        lines += ["", "paths on this machine"]
        width = max(len(path.name) for path in self.paths)
        for path in self.paths:
            state = "exact" if path.exact else "REFUSED"
            note = f"  ({path.note})" if path.note else ""
            lines.append(f"  {path.name:<{width}}  {state:<7}  {path.kernel}{note}")
        return "\n".join(lines)


# (import name, distribution, what fastpack uses it for)
_PACKAGES: tuple[tuple[str, str, str], ...] = (
    ("numpy", "numpy", "plans and rows (required)"),
    ("pyarrow", "pyarrow", "Arrow / parquet inputs, the command (required)"),
    ("torch", "torch", "fastpack.torch: batches, attention, loss, samplers"),
    ("transformers", "transformers", "register_hf_attention, PackedTrainerMixin (>= 5.19)"),
    ("datasets", "datasets", "fastpack.hf.pack_dataset"),
    ("trl", "trl", "SFTTrainer with PackedTrainerMixin"),
    ("torchdata", "torchdata", "StatefulDataLoader resume"),
    ("ray", "ray", "fastpack pack --ray"),
    ("matplotlib", "matplotlib", "the command's pictures"),
    ("flash_attn", "flash-attn", "flash-attn varlen kernel (CUDA, fp16/bf16)"),
    ("fla", "flash-linear-attention", "delta net / KDA kernels, cu_seqlens (CUDA)"),
    ("mamba_ssm", "mamba-ssm", "Mamba2 scan kernels, seq_idx (CUDA)"),
    ("causal_conv1d", "causal-conv1d", "mixer convolutions, seq_idx (CUDA)"),
    ("ring_flash_attn", "ring-flash-attn", "context-parallel flash kernels (CUDA)"),
)


def _version(module: str, distribution: str) -> str | None:
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    if found is None:
        return None
    try:
        return version(distribution)
    except PackageNotFoundError:
        return "present"


def _at_least(found: str | None, floor: tuple[int, ...]) -> bool:
    if found is None:
        return False
    parts: list[int] = []
    for piece in found.split(".")[: len(floor)]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) >= floor


def _torch_paths(have: dict[str, str | None]) -> tuple[str, list[Path]]:
    import torch

    from .torch.attention import available_kernels

    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else "cpu (no CUDA device)"
    probe = torch.zeros(1, 1, 8, device="cuda" if cuda else "cpu",
                        dtype=torch.bfloat16 if cuda else torch.float32)
    kernels = available_kernels(probe)
    paths = [
        Path("flash batches (cu_seqlens)", True, kernels[0],
             "fastest available: " + ", ".join(kernels)),
        Path("rows with reset position_ids (sdpa/eager)", True,
             kernels[0] if cuda else "per-sequence SDPA"),
    ]
    # HF's flex_attention implementation compiles its kernel on every device.
    # Without its compiler flex attention fails at its first call (an error, never a wrong
    # result): not a path that runs here.
    if cuda:
        flex_runs = have["triton"] is not None
        flex_note = "" if flex_runs else "needs triton (its compiler on CUDA), not installed"
    else:
        flex_runs = _compiler() is not None
        flex_note = "compiles for ~50 s on its first CPU call" + (
            "" if flex_runs else "; needs a C++ compiler (g++ or $CXX), none found")
    paths.append(Path("flex batches (attn_implementation='flex_attention')", flex_runs,
                      "compiled flex_attention", flex_note))
    # What prepare_model runs (strategy="auto"): the whole packed row through the kernels
    # with their own boundaries where they take them on CUDA, else right-padded groups.
    from .torch.mixers import kernel_problem

    def mixer_kernels(*functions: str) -> tuple[str, str]:
        if not cuda:
            return "", "no CUDA device"
        problems = [p for p in map(kernel_problem, functions) if p is not None]
        if problems:
            return "", "; ".join(problems)
        return " + ".join(functions), ""

    batched = "right-padded groups per length (prepare_model, exact)"
    used, why = mixer_kernels("chunk_gated_delta_rule", "causal_conv1d_fn")
    paths.append(Path("linear attention / gated delta net", True,
                      f"{used} with cu_seqlens / seq_idx (prepare_model)" if used else batched,
                      why and f"no kernel path: {why}"))
    used, why = mixer_kernels("mamba_chunk_scan_combined", "causal_conv1d_fn")
    paths.append(Path("Mamba2 mixers", True,
                      f"{used} with seq_idx (prepare_model)" if used else batched,
                      (f"no kernel path: {why}; " if why else "")
                      + "Mamba-1 mixers (Jamba, Mamba, Falcon-Mamba): right-padded groups"))
    paths.append(Path("short causal convolutions", True,
                      "varlen convolution masked at sequence starts (prepare_model, torch)"))
    cp = "ring-flash-attn" if cuda and have["ring_flash_attn"] else (
        "flash-attn" if cuda and have["flash_attn"] else "per-run SDPA")
    paths.append(Path("context parallelism", True, cp))
    trainer = _at_least(have["transformers"], TRANSFORMERS_FLOOR)
    paths.append(Path(
        "PackedTrainerMixin", trainer, "transformers Trainer",
        "" if trainer else f"needs transformers >= {'.'.join(map(str, TRANSFORMERS_FLOOR))}, "
        f"found {have['transformers'] or 'none'}"))
    return device, paths


def report() -> Report:
    """What this machine has and which paths run here (the ``fastpack doctor`` report)."""
    import fastpack

    from ._core import default_threads

    have = {module: _version(module, dist) for module, dist, _ in _PACKAGES}
    have["triton"] = _version("triton", "triton")  # reported with the compilers
    packages = [Package(module, dist, used, have[module]) for module, dist, used in _PACKAGES]
    if have["torch"] is not None:
        device, paths = _torch_paths(have)
    else:
        device = "unknown (torch is not installed)"
        paths = [Path("packed batches for training", False, "-",
                      "install torch for fastpack.torch; plans and the command work without")]
    location = os.path.dirname(os.path.abspath(fastpack.__file__))
    compilers = [
        Compiler("C++ (torch.compile, CPU)", _compiler(), "flex attention on the CPU"),
        Compiler("triton", have["triton"], "flex attention on CUDA"),
    ] if have["torch"] is not None else []
    return Report(
        python=platform.python_version(),
        platform=f"{platform.system()} {platform.machine()}",
        fastpack=fastpack.__version__,
        fastpack_location=location,
        threads=default_threads(),
        device=device,
        packages=packages,
        compilers=compilers,
        paths=paths,
    )


def _compiler() -> str | None:
    """The path of the C++ compiler torch.compile's CPU backend (inductor) calls, which
    flex attention needs on the CPU; None when it is not on PATH. Inductor's own setting
    says which (``torch._inductor.config.cpp.cxx``: ``$CXX``, else g++, clang++ on macOS)."""
    names: list[str] = []
    try:
        from torch._inductor import config

        cxx = config.cpp.cxx
        names = [c for c in (cxx if isinstance(cxx, (list, tuple)) else (cxx,)) if c]
    except Exception:  # an older or newer torch without that setting
        pass
    if not names:
        names = [os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++")]
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    return None
