"""Every causal-LM architecture the installed transformers registers, built tiny from its
default config (tests/architectures.py), on a packed batch of three samples of different
lengths in each format (``flash`` under fastpack's attention, ``sdpa`` rows under Hugging
Face's sdpa): each sample's logits equal the sample run alone, or the batch is refused
before the forward — never silently different.

A cell passes when it is ``EXACT`` or ``REFUSED`` with a message that names what fastpack
cannot keep apart (a module of the model, or an option to change). ``SILENT`` and ``CRASH``
fail; the ones the library does not handle yet are listed in :data:`KNOWN` (strict xfail:
the list stays explicit and an entry fails once it is fixed). :data:`architectures.SKIPS`
lists, with reasons, the few the sweep cannot build or run alone.

``verify_packing`` (where this fastpack has it) runs on every cell the model computed and
must agree with the sweep's own comparison: pass where the cell is exact, name a module
where it is not. The whole table: ``PYTHONPATH=python:tests python3 tests/architectures.py``.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import architectures as arch  # noqa: E402
import torch  # noqa: E402
from transformers.models.auto.modeling_auto import (  # noqa: E402
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
)

#: Cells (architecture, format) the library does not handle yet, and how they fail.
#: Strict xfail: each entry fails the suite once it passes, so the list only shrinks.
#: Regenerate: ``PYTHONPATH=python:tests python3 tests/architectures.py --known``.
KNOWN: dict[tuple[str, str], str] = {}

#: Cells exact by structure that an earlier, broader rule refused: each stays exact (a
#: refusal of an exact model costs its users packing).
EXACT_BY_STRUCTURE: dict[tuple[str, str], str] = {
    ("whisper", "flash"): "position_ids reach its decoder through **kwargs",
    ("whisper", "sdpa"): "position_ids reach its decoder through **kwargs",
    ("moss_transcribe_diarize", "flash"): "position_ids reach its language model (kwargs)",
    ("moss_transcribe_diarize", "sdpa"): "position_ids reach its language model (kwargs)",
    ("flint", "sdpa"): "sinks per head; its eager mask from position_ids",
    ("granite_swa", "sdpa"): "sinks per head; its eager mask from position_ids",
    ("granitemoe_swa", "sdpa"): "sinks per head; its eager mask from position_ids",
    ("mimo_v2_flash", "sdpa"): "sinks per head; its eager mask from position_ids",
    ("git", "sdpa"): "its own eager attention reads the mask built from position_ids",
    ("kolibri1_1", "sdpa"): "its indexer selects per document from the 4-D mask",
}


@dataclass
class Cell:
    outcome: arch.Outcome
    modules: set[str]
    verified: str | None  # None: not run; "" passed; else verify_packing's message
    parameters: int = 0


#: The largest tiny model (the vision and audio towers of multimodal ones are the biggest:
#: about 3M parameters).
MAX_PARAMETERS = 4_000_000

_MODEL: dict[str, tuple[Any, list[torch.Tensor]]] = {}


def _model(name: str) -> tuple[Any, list[torch.Tensor]]:
    """One architecture's model at a time (the cells of one architecture run in a row)."""
    if name not in _MODEL:
        _MODEL.clear()
        _MODEL[name] = arch.build(name)
    return _MODEL[name]


@functools.cache
def cell(name: str, fmt: str) -> Cell:
    with arch.quiet():
        try:
            model, alone = _model(name)
        except Exception as e:  # noqa: BLE001 - the cell reports it
            return Cell(arch.Outcome("CRASH", f"build: {arch._first_line(e)}"), set(), None)
        outcome = arch.run(model, fmt, alone)
        modules = {type(m).__name__ for m in model.modules()} | {
            path for path, _ in model.named_modules() if path}
        return Cell(outcome, modules, outcome.verified, sum(p.numel() for p in model.parameters()))


def names_what(message: str, modules: set[str]) -> bool:
    """A refusal names a module of the model (its class or path) or an option."""
    return any(m in message for m in modules if len(m) > 3) or bool(
        re.search(r"\b\w+=", message))


CELLS = [(name, fmt) for name in arch.ARCHITECTURES for fmt in arch.FORMATS]


def _param(name: str, fmt: str) -> Any:
    marks: list[Any] = []
    if name in arch.SKIPS:
        marks.append(pytest.mark.skip(reason=arch.SKIPS[name]))
    elif (name, fmt) in KNOWN:
        marks.append(pytest.mark.xfail(strict=True, reason=KNOWN[name, fmt]))
    return pytest.param(name, fmt, marks=marks, id=f"{name}-{fmt}")


@pytest.mark.parametrize(("name", "fmt"), [_param(n, f) for n, f in CELLS])
def test_architecture(name: str, fmt: str) -> None:
    got = cell(name, fmt)
    # A size the shrinker misses (a new config key) shows here, not as a slow CI.
    assert got.parameters <= MAX_PARAMETERS, f"{name}: {got.parameters} parameters, not tiny"
    status = got.outcome.status
    assert status in ("EXACT", "REFUSED"), f"{name} ({fmt} batch): {got.outcome}"
    if status == "REFUSED":
        # check_model_batch refuses before the forward (not fastpack's attention inside it,
        # nor transformers)
        assert "in the forward" not in got.outcome.detail, f"{name} ({fmt}): {got.outcome}"
        assert names_what(got.outcome.detail, got.modules), (
            f"{name}: the refusal names no module and no option: {got.outcome.detail}")
    if (name, fmt) in EXACT_BY_STRUCTURE:
        assert status == "EXACT", f"{name} ({fmt}) is exact by structure " \
                                  f"({EXACT_BY_STRUCTURE[name, fmt]}), yet {got.outcome}"


@pytest.mark.skipif(arch.VERIFY is None, reason="this fastpack has no verify_packing")
@pytest.mark.parametrize(("name", "fmt"), [
    pytest.param(n, f, id=f"{n}-{f}", marks=[pytest.mark.skip(reason=arch.SKIPS[n])]
                 if n in arch.SKIPS else []) for n, f in CELLS])
def test_verify_packing_agrees(name: str, fmt: str) -> None:
    """verify_packing passes every exact cell and names a module on every silent one."""
    got = cell(name, fmt)
    if got.verified is None:
        pytest.skip(f"nothing computed to verify: {got.outcome.status}")
    if got.outcome.status == "EXACT":
        assert got.verified == "", f"{name} ({fmt}): exact, yet verify_packing says: " \
                                   f"{got.verified}"
    else:
        assert got.verified, f"{name} ({fmt}): {got.outcome}, yet verify_packing passes"
        assert names_what(got.verified, got.modules), got.verified


def test_the_sweep_covers_the_registry() -> None:
    """Every registered architecture is swept; the skip and known lists hold only
    registered names, so they cannot go stale unnoticed."""
    assert arch.ARCHITECTURES == tuple(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
    assert set(arch.SKIPS) <= set(arch.ARCHITECTURES)
    assert {n for n, _ in KNOWN} <= set(arch.ARCHITECTURES) - set(arch.SKIPS)
    assert {n for n, _ in EXACT_BY_STRUCTURE} <= set(arch.ARCHITECTURES) - set(arch.SKIPS)
    assert len(arch.SKIPS) <= 10, "the sweep skips too many: shrink them instead"
