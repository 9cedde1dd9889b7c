"""The built-in example corpus: token lengths of CPython's standard library."""

from __future__ import annotations

from importlib import resources

import numpy as np

from ._errors import FastpackError, FastpackTypeError

__all__ = ["EXAMPLES", "example_lengths"]

EXAMPLES = ("functions", "modules")


def example_lengths(name: str = "functions") -> np.ndarray:
    """Token lengths (uint32) of the built-in example corpus: ``"functions"`` or
    ``"modules"`` of CPython's standard library."""
    if not isinstance(name, str):
        raise FastpackTypeError(f"name: expected a string, got {type(name).__name__}")
    if name not in EXAMPLES:
        raise FastpackError(
            f"name: unknown example {name!r}; expected one of {', '.join(map(repr, EXAMPLES))}"
        )
    data = resources.files("fastpack") / "data" / f"stdlib_{name}.npy"
    with data.open("rb") as f:
        return np.load(f)
