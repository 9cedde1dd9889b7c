"""fastpack's exceptions. The Rust extension raises these too."""

from __future__ import annotations

__all__ = ["FastpackError", "FastpackTypeError"]


class FastpackError(ValueError):
    """A bad argument or an input fastpack cannot pack. The message names the argument,
    the value it got and what it accepts."""


class FastpackTypeError(FastpackError, TypeError):
    """An argument of the wrong type (also a ``TypeError``)."""
