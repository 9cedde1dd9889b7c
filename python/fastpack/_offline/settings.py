"""The settings of a ``fastpack pack`` run: everything that decides the output's bytes
(a resumed run must match them), and ``--memory``'s sizes. The packing options in them are
a :class:`fastpack.PackOptions`, taken and checked as every entry point takes them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from .._checks import _int_arg
from .._errors import FastpackError
from .._options import PackArgs, PackOptions, WithOptions, resolve
from .formats import check_format, check_token_dtype

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["REFUSED", "PackSettings", "default_shard_rows", "parse_size", "token_columns"]

# Tokens per shard when --shard-rows is not given (about 100 MB of zstd parquet).
SHARD_TOKENS = 1 << 25


def default_shard_rows(max_len: int) -> int:
    return max(1, SHARD_TOKENS // max_len)


#: The packing options the command (and ``fastpack.ray``) cannot honour, with why: given
#: another value than the default, they raise, naming it (so they are always at their
#: defaults, and the settings' JSON leaves them out).
_NO_CP = ("fastpack pack does not plan for context parallelism (its rows are not padded for "
          "a CP group); plan it where the rows are trained: PackedCollator(cp_size=...)")
REFUSED = {
    "reserve": "fastpack pack writes no separator, so it reserves no slot after a document",
    "cp_size": _NO_CP, "cp_mode": _NO_CP, "pad_multiple": _NO_CP,
    "share_prefix": "fastpack pack writes rows of whole documents, which cannot hold "
                    "shared-prefix trees; train with PackedDataset(..., "
                    "PackedCollator(share_prefix=True))",
    "limits": "fastpack pack plans token lengths only, and budgets besides tokens need each "
              "document's use of them; plan with fastpack.pack(lengths, limits={name: (values, "
              "cap)}) or fastpack.hf.pack_dataset(..., limits=...)",
}

#: The order of the settings in report.json, the manifest and the run's state (kept, so the
#: same settings give the same bytes); options not listed here (a new one) follow.
_ORDER = ("max_len", "column", "columns", "text_column", "tokenizer", "strategy", "overlong",
          "long_max_len", "group_tokens", "shuffle", "seed", "shard_rows", "plan_shards")


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


def _checked_mix(mix: dict[str, Any] | None, options: PackOptions,
                 plan_shards: int) -> dict[str, Any] | None:
    """A mixture's JSON, checked (``fastpack.Mixture``'s messages) and in its canonical
    form; what a mixture cannot be combined with is refused, naming it."""
    if mix is None:
        return None
    from .._mix import Mixture

    if plan_shards != 1:
        raise FastpackError("plan_shards: a mixture is planned step by step in one plan; "
                            "leave --plan-shards out with --mix")
    if options.group_tokens is not None:
        raise FastpackError("group_tokens: a mixture's steps are its groups (step_tokens "
                            "in the mix file); leave --group-tokens out with --mix")
    return Mixture.from_dict(mix).to_json()


@dataclass(frozen=True, init=False)
class PackSettings(WithOptions):
    """Everything that decides the output's bytes: the same settings and inputs give the
    same shards, and a run resumes only with the settings it started with.

    The packing options are ``options`` (a :class:`fastpack.PackOptions`, given as one or
    as ``max_len`` and keywords, checked with every entry point's messages); ``reserve``
    is refused (:data:`REFUSED`). The other fields are the command's own."""

    options: PackOptions
    column: str = "input_ids"
    #: The other per-token columns to pack; None: every column of the inputs that holds
    #: one integer per token (:func:`~fastpack._offline.scan.resolve_columns`), as
    #: ``fastpack.hf.pack_dataset``.
    columns: tuple[str, ...] | None = None
    text_column: str | None = None
    tokenizer: str | None = None
    #: Packs per output shard (default: 2^25 tokens' worth at ``max_len``).
    shard_rows: int | None = None
    plan_shards: int = 1
    #: The output's format (:data:`~fastpack._offline.formats.FORMATS`): the same packs
    #: in every one.
    format: str = "parquet"
    #: The dtype of the megatron format's tokens (``--token-dtype``;
    #: :data:`~fastpack._offline.formats.TOKEN_DTYPES`): auto chooses as Megatron does.
    token_dtype: str = "auto"
    #: A mixture of sources by tokens (``fastpack.Mixture.to_json()``; ``--mix``): the
    #: inputs are its sources' files, and it decides which documents the output holds.
    mix: dict[str, Any] | None = None
    #: The column of each document's key (``fastpack.pack(..., affinity=keys)``), or None.
    affinity_column: str | None = None

    def __init__(
        self,
        max_len: int | None = None,
        *,
        options: PackOptions | None = None,
        column: str = "input_ids",
        columns: Sequence[str] | None = None,
        text_column: str | None = None,
        tokenizer: str | None = None,
        shard_rows: int | None = None,
        plan_shards: int = 1,
        format: str = "parquet",
        token_dtype: str = "auto",
        mix: dict[str, Any] | None = None,
        affinity_column: str | None = None,
        **kwargs: Unpack[PackArgs],
    ) -> None:
        made = resolve(PackSettings, options, max_len, kwargs, refuse=REFUSED)
        rows = default_shard_rows(made.max_len) if shard_rows is None else _int_arg(
            "shard_rows", shard_rows, minimum=1)
        values = {
            "options": made, "column": column,
            "columns": None if columns is None else tuple(columns),
            "text_column": text_column, "tokenizer": tokenizer, "shard_rows": rows,
            "plan_shards": _int_arg("plan_shards", plan_shards, minimum=1),
            "format": check_format(format),
            "token_dtype": check_token_dtype(token_dtype, format),
            "mix": _checked_mix(mix, made, plan_shards),
            "affinity_column": affinity_column,
        }
        if affinity_column is not None:
            from .._affinity import check_options

            try:
                check_options(made)
            except FastpackError as e:
                raise FastpackError(
                    "affinity_column: " + str(e).removeprefix("affinity: ")) from None
            if mix is not None:
                raise FastpackError("affinity_column: not supported with a mixture (mix) "
                                    "yet; pack without one of them")
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @property
    def token_columns(self) -> list[str]:
        """Packed per-token columns, the length column first (only those named: see
        :func:`~fastpack._offline.scan.resolve_columns` for ``columns=None``)."""
        return token_columns(self.column, self.columns)

    @property
    def max_cap(self) -> int:
        """The largest pack cap: ``long_max_len``, else ``max_len``."""
        return self.options.long_max_len or self.max_len

    def to_json(self) -> dict[str, Any]:
        """The settings as report.json, the manifest and the run's state hold them: the
        options (all but the refused ones) and the command's own, in :data:`_ORDER`."""
        values = {f.name: getattr(self.options, f.name) for f in fields(PackOptions)
                  if f.name not in REFUSED}
        values.update({f.name: getattr(self, f.name) for f in fields(self)
                       if f.name != "options"})
        if self.columns is not None:
            values["columns"] = list(self.columns)
        if self.format == "parquet":
            del values["format"]  # the settings of a parquet run keep their bytes
        if self.format != "megatron":
            del values["token_dtype"]  # the other formats store the parquet output's dtypes
        if self.mix is None:
            del values["mix"]  # a run without a mixture records what it always did
        if self.affinity_column is None:
            del values["affinity_column"]  # the settings of a run without keys, unchanged
        ordered = {name: values.pop(name) for name in _ORDER}
        return {**ordered, **values}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> PackSettings:
        return cls(**value)
