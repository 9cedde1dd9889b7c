"""The argument checks every module shares: one wording of "argument: got value; expected
what is accepted" for integers, booleans, choices and the thread count."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

import numpy as np

from ._errors import FastpackError, FastpackTypeError

__all__ = ["_bool_arg", "_choice", "_int_arg", "_threads", "did_you_mean"]

#: The most worker threads an argument may ask for.
MAX_THREADS = 4096


def _int_arg(
    name: str, value: Any, *, minimum: int, maximum: int | None = None, why: str = ""
) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise FastpackTypeError(
            f"{name}: expected an integer, got {type(value).__name__} {value!r}"
        )
    value = int(value)
    if value < minimum or (maximum is not None and value > maximum):
        accepted = f">= {minimum}" if maximum is None else f"in {minimum}..={maximum}"
        raise FastpackError(f"{name}: got {value}; expected an integer {accepted}{why}")
    return value


def _threads(threads: Any, name: str = "threads") -> int | None:
    """A worker-thread count (None: the default pool). The one check of it: ``pack``,
    ``materialize``, ``gather``, the streams and ``map_kwargs['num_proc']`` use it."""
    return None if threads is None else _int_arg(name, threads, minimum=1, maximum=MAX_THREADS)


def _bool_arg(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise FastpackTypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise FastpackTypeError(
            f"{name}: expected one of {', '.join(map(repr, choices))}, got "
            f"{type(value).__name__} {value!r}"
        )
    if value not in choices:
        raise FastpackError(
            f"{name}: unknown value {value!r}; expected one of {', '.join(map(repr, choices))}"
        )
    return value


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``"did you mean 'x'? "`` for the known name closest to ``name``, or ``""``."""
    close = difflib.get_close_matches(name, list(known), n=1)
    return f"did you mean {close[0]!r}? " if close else ""
