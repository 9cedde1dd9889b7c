"""The settings of a ``fastpack pack`` run: everything that decides the output's bytes
(a resumed run must match them), and ``--memory``'s sizes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .._errors import FastpackError
from .._plan import pack
from .layout import default_shard_rows
from .plan import PlanConfig

__all__ = ["PackSettings", "parse_size", "token_columns"]


def parse_size(text: str) -> int:
    """``"512M"``, ``"2G"``, ``"1.5GiB"``, ``"1000000"`` -> bytes (K/M/G/T are powers of
    1024)."""
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = 1
    for i, unit in enumerate("KMGT", start=1):
        if value.endswith(unit):
            value, scale = value[:-1], 1024**i
            break
    try:
        size = int(float(value) * scale)
    except ValueError:
        raise FastpackError(
            f"memory: cannot read {text!r}; expected bytes like 512M, 2G or 1.5GiB") from None
    if size <= 0:
        raise FastpackError(f"memory: got {text!r}; expected a positive size")
    return size


def token_columns(column: str, columns: Sequence[str] | None) -> list[str]:
    """The packed per-token columns: ``column`` (whose lengths are packed) first, then
    the others named."""
    return [column] + [c for c in columns or () if c != column]


@dataclass(frozen=True)
class PackSettings:
    """Everything that decides the output's bytes: the same settings and inputs give the
    same shards, and a run resumes only with the settings it started with."""

    max_len: int
    column: str = "input_ids"
    #: The other per-token columns to pack; None: every column of the inputs that holds
    #: one integer per token (:func:`~fastpack._offline.scan.resolve_columns`), as
    #: ``fastpack.hf.pack_dataset``.
    columns: tuple[str, ...] | None = None
    text_column: str | None = None
    tokenizer: str | None = None
    strategy: str = "bfd"
    overlong: str = "error"
    long_max_len: int | None = None
    group_tokens: int | None = None
    shuffle: bool = True
    seed: int = 0
    shard_rows: int | None = None
    plan_shards: int = 1

    def __post_init__(self) -> None:
        if self.shard_rows is None:
            object.__setattr__(self, "shard_rows", default_shard_rows(self.max_len))

    def validate(self) -> None:
        """The argument checks of ``fastpack.pack`` (caps, policies, the seed), before any
        input is read."""
        pack(np.zeros(0, np.int32), self.max_len, strategy=self.strategy,
             overlong=self.overlong, long_max_len=self.long_max_len,
             group_tokens=self.group_tokens, seed=self.seed)

    @property
    def token_columns(self) -> list[str]:
        """Packed per-token columns, the length column first (only those named: see
        :func:`~fastpack._offline.scan.resolve_columns` for ``columns=None``)."""
        return token_columns(self.column, self.columns)

    @property
    def plan_config(self) -> PlanConfig:
        return PlanConfig(self.max_len, self.strategy, self.overlong, self.shuffle, self.seed,
                          self.long_max_len, self.group_tokens)

    @property
    def max_cap(self) -> int:
        return self.long_max_len or self.max_len

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self),
                "columns": None if self.columns is None else list(self.columns)}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> PackSettings:
        columns = value["columns"]
        return cls(**{**value, "columns": None if columns is None else tuple(columns)})
