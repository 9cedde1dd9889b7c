"""The packing options, defined and checked in one place: :class:`PackOptions`.

Every entry point that packs — :func:`fastpack.pack`, :func:`fastpack.hf.pack_dataset`,
``pack_iterable_dataset``, :class:`fastpack.StreamPacker`, :func:`fastpack.ray.pack_dataset`,
the ``fastpack pack`` command (its settings, ``_offline/settings.py``), and in
``fastpack.torch`` ``PackedCollator``, ``PackedDataset`` and ``PackedIterableDataset`` —
takes the same options, as keywords or as one object, and checks them here, with the same
messages::

    fastpack.pack(lengths, 4096, strategy="ffd")
    fastpack.pack(lengths, options=fastpack.PackOptions(4096, strategy="ffd"))

Passing an option both ways with two values raises, naming both; a misspelt keyword
raises with the closest name ("did you mean").

Why this shape:

- **One frozen dataclass.** The fields are the options; ``__post_init__`` runs one check
  per field (``_CHECKS``), in field order, so a check may read the fields before it
  (``reserve`` below ``max_len``). An options object is valid once made: an entry point
  given one does not check it again (the collator plans every batch with the one it
  made), and two plans' options compare with ``==``.
- **Typed ``**kwargs`` in the signatures** (``**kwargs: Unpack[PackArgs]``, PEP 692):
  mypy and editors check each keyword's name and type at the call site and list them, and
  an option added here reaches every entry point without touching its signature. Spelling
  the options out in each signature reads best in ``help()``, but it is the nine copies
  of one list, each checked its own way, that this module replaces. ``max_len`` stays a
  positional parameter (``pack(lengths, 4096)``), as does ``strategy`` of
  ``hf.pack_dataset`` (TRL's signature).
- **``threads`` is not an option.** It says how to compute a plan, not which plan: the
  plan is the same on any number of threads (a tested contract), so two plans made on 1
  and 8 threads have equal options. It stays a keyword of its own wherever work runs
  (``pack``, ``materialize``, ``gather``, the streams), checked by
  :func:`fastpack._checks._threads`.
- **Two scopes.** Most options say how any set of samples is packed (``max_len``,
  ``strategy``, ``overlong``, ``reserve``): a ``PackedCollator`` takes them and plans each
  batch with them. :data:`PLAN_OPTIONS` (``shuffle``, ``seed``, ``long_max_len``,
  ``group_tokens``) order, bucket and group the packs of a whole plan: a dataset takes
  them, and :func:`layered` checks that the per-batch options a dataset is given are its
  collator's. A collator refuses the plan options (a batch would ignore them).

Adding an option: a field (its default and a ``#:`` line), its check in ``_CHECKS``, its
key in ``_Args``; when it changes the plan, its value passed to the core in
:func:`fastpack.pack`. Every entry point hands its whole ``PackOptions`` on (to ``pack``,
a ``StreamPacker``, a collator), never field by field, so that is all. It is a per-batch
option unless listed in :data:`PLAN_OPTIONS` (context parallelism's ``cp_size``,
``cp_mode`` and ``pad_multiple``, several budgets per pack, a collator's ``share_prefix``:
per-batch). An entry point that cannot honour it refuses it by name (``refuse=``, as the
streams refuse ``group_tokens`` and the command ``reserve``), so it is never silently
ignored; ``tests/test_options.py`` then checks it at every entry point without a new row.
The command's settings take, check and record a new option unasked; a command line sets
it once it has a flag in ``cli.py``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

from ._checks import _bool_arg, _choice, _int_arg, did_you_mean
from ._errors import FastpackError, FastpackTypeError

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "CP_MODES", "GROUP_TOKENS_LIMIT", "LIMIT_CAP", "MAX_CP_SIZE", "MAX_LEN_LIMIT", "MAX_LIMITS",
    "MAX_PAD_DIVISOR", "OVERLONG_POLICIES", "PLAN_OPTIONS", "STRATEGIES", "check_cp",
    "cp_divisor",
    "PackArgs", "PackOptions", "WithOptions", "check_plan", "layered", "resolve",
    "separator_reserve", "with_separator",
]

STRATEGIES = ("bfd", "ffd", "next_fit", "wrapped", "one_per_pack")
OVERLONG_POLICIES = ("error", "truncate", "split", "drop")
# The fit strategies keep an index over every capacity 0..=max_len (the core's limit).
MAX_LEN_LIMIT = 2**24
# A group flattens into one varlen row whose cu_seqlens are int32.
GROUP_TOKENS_LIMIT = 2**31 - 1
# Budgets besides tokens (the core's MAX_LIMITS and LIMIT_CAP).
MAX_LIMITS = 4
LIMIT_CAP = 2**32 - 2

#: Context parallelism's modes (see :func:`fastpack.cp_layout`). ``"zigzag"``: every
#: sequence padded to a multiple of ``2·cp·pad_multiple`` and cut into ``2·cp`` chunks,
#: rank ``r`` holding chunks ``r`` and ``2·cp−1−r`` (TransformerEngine's THD layout: the
#: same causal work on every rank). ``"contiguous"``: the row padded to a multiple of
#: ``cp·pad_multiple`` and cut into ``cp`` slices (ring-flash-attn's llama3 layout: no
#: per-sequence pad, uneven work). ``"ulysses"``: the contiguous slices, heads exchanged
#: around attention by an all-to-all.
CP_MODES = ("zigzag", "contiguous", "ulysses")
#: The largest context-parallel group (the core's limit).
MAX_CP_SIZE = 1 << 16


def cp_divisor(cp_size: int, mode: str, pad_multiple: int) -> int:
    """What context parallelism's padded lengths are multiples of (the core's
    ``CpSpec::divisor``): each sequence's (zigzag: ``2·cp·pad_multiple``; ``pad_multiple``
    at ``cp_size=1``, where nothing is cut) or the row's (contiguous and Ulysses:
    ``cp·pad_multiple``)."""
    if mode == "zigzag":
        return (2 * cp_size if cp_size > 1 else 1) * pad_multiple
    return cp_size * pad_multiple


#: The largest ``pad_multiple``, and the largest multiple padded lengths may be rounded to.
MAX_PAD_DIVISOR = 1 << 30


def check_cp(
    cp_size: Any, mode: Any, pad_multiple: Any, *,
    names: tuple[str, str, str] = ("cp_size", "mode", "pad_multiple"),
) -> tuple[int, str, int]:
    """A context-parallel group (``cp_size``, its mode, ``pad_multiple``) checked: the one
    check behind ``PackOptions``' fields and the functions about CP alone (``cp_layout``,
    ``shard_for_context_parallel``), its errors naming the arguments as the caller spells
    them (``names``)."""
    cp = _int_arg(names[0], cp_size, minimum=1, maximum=MAX_CP_SIZE)
    mode = _choice(names[1], mode, CP_MODES)
    multiple = _int_arg(names[2], pad_multiple, minimum=1, maximum=MAX_PAD_DIVISOR)
    d = cp_divisor(cp, mode, multiple)
    if d > MAX_PAD_DIVISOR:
        raise FastpackError(
            f"{names[2]}: got {multiple}; with {names[0]}={cp} and {names[1]}={mode!r} lengths "
            f"would be padded to multiples of {d}, more than 2^30; expected a smaller multiple"
        )
    return cp, mode, multiple


#: Options about a whole plan's packs (their order, buckets and groups), not about how
#: one batch of samples is packed: a dataset takes them, a collator refuses them.
PLAN_OPTIONS = ("shuffle", "seed", "long_max_len", "group_tokens")


@dataclass(frozen=True)
class PackOptions:
    """How sequences are packed: the options every packing entry point takes.

    >>> options = PackOptions(4096, strategy="ffd", overlong="split")
    >>> fastpack.pack(lengths, options=options)  # or pack(lengths, 4096, strategy=...)

    Checked when made (a bad value raises a ``FastpackError`` naming it); frozen, so
    :meth:`replace` makes a changed copy. A :class:`fastpack.Plan` remembers its options
    (``plan.options``). Worker ``threads`` are not an option: the plan does not depend
    on them.
    """

    #: Tokens per pack (1 to 2**24).
    max_len: int
    #: ``"bfd"`` best-fit decreasing (fewest packs), ``"ffd"`` first-fit decreasing,
    #: ``"next_fit"`` (keeps input order), ``"wrapped"`` (concatenate and cut every
    #: ``max_len`` tokens; ``overlong`` does not apply), ``"one_per_pack"`` (every
    #: sequence in a pack of its own, in input order: the padded baseline).
    strategy: str = "bfd"
    #: A sequence longer than ``max_len - reserve``: ``"error"`` (raise, giving how many
    #: and the first index), ``"truncate"``, ``"split"`` into pieces packed on their own,
    #: or ``"drop"``. Every dropped or truncated token is counted in the plan.
    overlong: str = "error"
    #: Slots kept after every sequence (a separator written later), so no pack overflows
    #: once they are filled; ``seqlens`` include them. Below ``max_len``.
    reserve: int = 0
    #: Shuffle the pack order (the same order for the same ``seed``); ``False`` keeps the
    #: packs as placed: roughly sorted by size for ``bfd``/``ffd``, in input order for the
    #: others.
    shuffle: bool = True
    #: The shuffle's seed (0 to 2**64 - 1).
    seed: int = 0
    #: A second, long bucket: sequences longer than ``max_len - reserve`` go to packs of
    #: this cap (``overlong`` then applies against it); no pack mixes the two.
    long_max_len: int | None = None
    #: Two-level packing: the packs are bin-packed, by their tokens, into groups of at
    #: most this many (at least the largest pack cap): one group per step.
    group_tokens: int | None = None
    #: Context parallelism: plan for a group of this many ranks that share each packed row
    #: (see :func:`fastpack.cp_layout`); every pack fits ``max_len`` once padded for it.
    cp_size: int | None = None
    #: ``"zigzag"`` (every sequence padded to a multiple of ``2·cp_size·pad_multiple``),
    #: ``"contiguous"`` or ``"ulysses"`` (the row padded to a multiple of
    #: ``cp_size·pad_multiple``); needs ``cp_size``.
    cp_mode: str = "zigzag"
    #: Each rank's share of a sequence (zigzag) or of the row is a multiple of this too: the
    #: tensor-parallel size with sequence parallelism, an FP8 kernel's divisor (NeMo-RL's
    #: rules); needs ``cp_size``.
    pad_multiple: int = 1
    #: Shared prefixes computed once: samples that start with the same tokens are packed
    #: as trees, each shared token once (docs/shared_prefix.md). It plans tokens, not
    #: lengths: ``PackedCollator``, ``PackedDataset`` and ``fastpack.pack_trees`` take it;
    #: the entry points that plan lengths or streams refuse it.
    share_prefix: bool = False
    #: Budgets besides tokens, ``{name: cap}`` (at most 4; held as ``((name, cap), ...)``):
    #: no pack holds more than ``cap`` of one. Each sequence's use comes with the data:
    #: ``pack(lengths, limits={name: (values, cap)})``, or a collator's or dataset's
    #: samples' media (``"patches"``, ``"images"``, ``"videos"``). Best or first fit on
    #: tokens among the packs with room in every budget; a sequence is never cut, so one
    #: over a budget follows ``overlong`` (``"error"`` or ``"drop"``, counted).
    limits: Mapping[str, int] | tuple[tuple[str, int], ...] | None = None

    def __post_init__(self) -> None:
        for name, check in _CHECKS.items():
            value = getattr(self, name)
            checked = check(self, value)
            if checked is not value:  # normalised (np.int64 -> int): keep the plain value
                object.__setattr__(self, name, checked)

    @property
    def budgets(self) -> tuple[tuple[str, int], ...]:
        """``limits`` as checked: ``((name, cap), ...)``, empty without budgets."""
        return self.limits or ()  # type: ignore[return-value]  # normalised by its check

    def replace(self, max_len: int | None = None, **changes: Unpack[PackArgs]) -> PackOptions:
        """A copy with ``changes`` (checked like any option)."""
        _check_names(PackOptions, changes)
        if max_len is not None:
            return dataclasses.replace(self, max_len=max_len, **changes)
        return dataclasses.replace(self, **changes)

    def differences(self, other: PackOptions, names: Any = None) -> dict[str, tuple[Any, Any]]:
        """``{name: (self's, other's)}`` for each option (of ``names``, default all) whose
        values differ."""
        return {n: (getattr(self, n), getattr(other, n)) for n in _NAMES
                if (names is None or n in names) and getattr(self, n) != getattr(other, n)}


class WithOptions:
    """An object that packs with ``options``, read through its most used ones."""

    options: PackOptions

    @property
    def max_len(self) -> int:
        return self.options.max_len

    @property
    def strategy(self) -> str:
        return self.options.strategy

    @property
    def overlong(self) -> str:
        return self.options.overlong

    @property
    def reserve(self) -> int:
        return self.options.reserve

    @property
    def share_prefix(self) -> bool:
        return self.options.share_prefix


def _cap(options: PackOptions) -> tuple[str, int]:
    if options.long_max_len is not None:
        return "long_max_len", options.long_max_len
    return "max_len", options.max_len


def _check_reserve(o: PackOptions, value: Any) -> int:
    return _int_arg(
        "reserve", value, minimum=0, maximum=o.max_len - 1,
        why=f": fewer tokens than max_len ({o.max_len}) so that a sequence fits",
    )


def _check_long_max_len(o: PackOptions, value: Any) -> int | None:
    if value is None:
        return None
    return _int_arg("long_max_len", value, minimum=o.max_len + 1, maximum=MAX_LEN_LIMIT,
                    why=f", above max_len ({o.max_len})")


def _check_group_tokens(o: PackOptions, value: Any) -> int | None:
    if value is None:
        return None
    cap_name, cap = _cap(o)
    return _int_arg(
        "group_tokens", value, minimum=cap, maximum=GROUP_TOKENS_LIMIT,
        why=f": at least {cap_name} ({cap}) so every pack fits a group, and int32 cu_seqlens",
    )


def _check_cp_size(o: PackOptions, value: Any) -> int | None:
    return None if value is None else check_cp(value, "zigzag", 1, names=_CP_NAMES)[0]


#: How ``PackOptions`` spells a context-parallel group's settings.
_CP_NAMES = ("cp_size", "cp_mode", "pad_multiple")


def _check_cp_mode(o: PackOptions, value: Any) -> str:
    mode = _choice("cp_mode", value, CP_MODES)
    if o.cp_size is None and mode != "zigzag":
        raise FastpackError(f"cp_mode: got {mode!r} without cp_size; pass cp_size (the ranks "
                            f"of the context-parallel group) or leave cp_mode out")
    return mode


def _check_pad_multiple(o: PackOptions, value: Any) -> int:
    if o.cp_size is None:
        multiple = _int_arg("pad_multiple", value, minimum=1, maximum=MAX_PAD_DIVISOR)
        if multiple != 1:
            raise FastpackError(f"pad_multiple: got {multiple} without cp_size; pass cp_size "
                                f"(context parallelism pads) or leave pad_multiple out")
        return multiple
    _, _, multiple = check_cp(o.cp_size, o.cp_mode, value, names=_CP_NAMES)
    d = cp_divisor(o.cp_size, o.cp_mode, multiple)
    setting = f"cp_size={o.cp_size}, cp_mode={o.cp_mode!r} and pad_multiple={multiple}"
    what = "every sequence" if o.cp_mode == "zigzag" else "every pack"
    caps = [("max_len", o.max_len)]
    if o.long_max_len is not None:
        caps.append(("long_max_len", o.long_max_len))
    for name, cap in caps:
        held = cap // d * d
        if held <= o.reserve:
            raise FastpackError(
                f"pad_multiple: with {setting}, {what} is padded to a multiple of {d} tokens, "
                f"so a padded pack exceeds {name} ({cap}) unless it holds at most {held}"
                f"{f' (reserve={o.reserve})' if o.reserve else ''} tokens; expected a smaller "
                f"pad_multiple or cp_size, or a larger {name}"
            )
    if o.long_max_len is not None and o.long_max_len // d <= o.max_len // d:
        raise FastpackError(
            f"long_max_len: {o.long_max_len} holds {o.long_max_len // d * d} tokens once padded "
            f"to multiples of {d} ({setting}), no more than max_len's {o.max_len // d * d}; "
            f"expected a larger long_max_len"
        )
    return multiple


def _check_share_prefix(o: PackOptions, value: Any) -> bool:
    share = _bool_arg("share_prefix", value)
    if not share:
        return share
    refused = {
        "overlong": (o.overlong == "split", "a piece of a sample could not attend to the "
                     "pieces before it; use 'error', 'truncate' or 'drop'"),
        "strategy": (o.strategy == "wrapped", "it cuts every max_len tokens, through trees; "
                     "use 'bfd', 'ffd' or 'next_fit'"),
        "reserve": (o.reserve > 0, "slots after every sample, as a separator_id reserves: a "
                    "tree's samples end inside it; put the separator in the samples' tokens"),
        "long_max_len": (o.long_max_len is not None, "a tree larger than max_len is split, "
                         "its prefix repeated; raise max_len instead"),
        "cp_size": (o.cp_size is not None, "context parallelism of tree batches is not "
                    "supported: a rank's shard would cut paths that its queries need"),
    }
    for name, (bad, why) in refused.items():
        if bad:
            raise FastpackError(
                f"share_prefix: True does not take {name}={getattr(o, name)!r} ({why})"
            )
    return share


def _check_limits(o: PackOptions, value: Any) -> tuple[tuple[str, int], ...] | None:
    if value is None:
        return None
    pairs = value.items() if isinstance(value, Mapping) else value
    if isinstance(value, (str, bytes)) or not isinstance(value, (Mapping, tuple)) or not all(
            isinstance(p, tuple) and len(p) == 2 for p in pairs):
        raise FastpackTypeError(
            f"limits: expected a dict {{name: cap}}, e.g. {{'patches': 16384, 'images': 8}} "
            f"(pack() also takes {{name: (values, cap)}}), got {type(value).__name__} {value!r}"
        )
    out: list[tuple[str, int]] = []
    for name, cap in pairs:
        if not isinstance(name, str) or not name or name == "tokens" or name in dict(out):
            raise FastpackError(
                f"limits: budget name {name!r}; expected distinct non-empty strings other than "
                f"'tokens' (max_len is the token budget)"
            )
        out.append((name, _int_arg(f"limits[{name!r}]", cap, minimum=1, maximum=LIMIT_CAP,
                                   why=" (the most a pack holds)")))
    if not out:
        return None
    if len(out) > MAX_LIMITS:
        raise FastpackError(f"limits: got {len(out)} budgets; at most {MAX_LIMITS} besides "
                            f"tokens")
    if o.strategy == "one_per_pack":
        raise FastpackError(
            "limits: strategy 'one_per_pack' puts every sequence in a pack of its own (the "
            "padded backend's), where no budget has anything to limit; budgets besides "
            "tokens take 'bfd' or 'ffd'"
        )
    if o.strategy not in ("bfd", "ffd"):
        raise FastpackError(
            f"limits: strategy {o.strategy!r} keeps input order or cuts sequences; budgets "
            f"besides tokens take 'bfd' or 'ffd'"
        )
    if o.overlong not in ("error", "drop"):
        raise FastpackError(
            f"limits: overlong={o.overlong!r} would cut a sequence, and the media it holds "
            f"with it; with budgets besides tokens use 'error' or 'drop'"
        )
    if o.cp_size is not None:
        raise FastpackError(
            f"limits: budgets besides tokens are not planned together with cp_size="
            f"{o.cp_size} (the context-parallel plan pads the tokens and knows nothing of the "
            f"media); pass one of them"
        )
    if o.share_prefix:
        raise FastpackError(
            "limits: budgets besides tokens are not planned together with share_prefix=True "
            "(a tree is planned by its distinct tokens, and its samples' media would be "
            "counted once per sample); pass one of them"
        )
    return tuple(out)


#: Each option's check, in field order: ``check(options so far, value) -> value``.
_CHECKS: dict[str, Callable[[PackOptions, Any], Any]] = {
    "max_len": lambda o, v: _int_arg("max_len", v, minimum=1, maximum=MAX_LEN_LIMIT),
    "strategy": lambda o, v: _choice("strategy", v, STRATEGIES),
    "overlong": lambda o, v: _choice("overlong", v, OVERLONG_POLICIES),
    "reserve": _check_reserve,
    "shuffle": lambda o, v: _bool_arg("shuffle", v),
    "seed": lambda o, v: _int_arg("seed", v, minimum=0, maximum=2**64 - 1),
    "long_max_len": _check_long_max_len,
    "group_tokens": _check_group_tokens,
    "cp_size": _check_cp_size,
    "cp_mode": _check_cp_mode,
    "pad_multiple": _check_pad_multiple,
    "share_prefix": _check_share_prefix,
    "limits": _check_limits,
}

_NAMES = tuple(f.name for f in dataclasses.fields(PackOptions))
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(PackOptions)
             if f.default is not dataclasses.MISSING}


class _Args(TypedDict, total=False):
    """PackOptions' fields but ``max_len`` and ``strategy``, as keywords (``hf.pack_dataset``
    takes those two by position, as TRL's does). A new option's key goes here."""

    overlong: str
    reserve: int
    shuffle: bool
    seed: int
    long_max_len: int | None
    group_tokens: int | None
    cp_size: int | None
    cp_mode: str
    pad_multiple: int
    share_prefix: bool
    #: ``{name: cap}``; ``pack`` also takes ``{name: (values, cap)}``.
    limits: Mapping[str, Any] | tuple[tuple[str, int], ...] | None


class PackArgs(_Args, total=False):
    """PackOptions' fields but ``max_len``, as keywords: an entry point's
    ``**kwargs: Unpack[PackArgs]``."""

    strategy: str


def _where(entry: Any) -> str:
    name = getattr(entry, "__qualname__", str(entry))
    return f"{name}()"


def _check_names(entry: Any, kwargs: Mapping[str, Any]) -> None:
    """Raises for a keyword that is no option of ``entry`` (a function or class), with the
    closest accepted name: an entry point's ``**kwargs`` would otherwise swallow it."""
    for name in kwargs:
        if name not in _DEFAULTS:
            accepted = [n for n in inspect.signature(entry).parameters if n not in (
                "self", "kwargs", "changes")]
            accepted += [n for n in _NAMES if n not in accepted]
            raise FastpackTypeError(
                f"{name}: not an option of {_where(entry)}; {did_you_mean(name, accepted)}"
                f"it takes {', '.join(accepted)}"
            )


def resolve(
    entry: Any,
    options: PackOptions | None,
    max_len: Any,
    kwargs: Mapping[str, Any],
    *,
    refuse: Mapping[str, str] | None = None,
) -> PackOptions:
    """The options an entry point (``entry``, named in errors) was given: ``options``, or
    ``max_len`` and the keywords; both ways at once only where they agree. ``refuse``:
    options this entry point cannot honour (name -> why), which raise when not their
    default."""
    _check_names(entry, kwargs)
    if options is None:
        if max_len is None:
            raise FastpackTypeError(
                "max_len: missing (the tokens per pack); pass it, or options="
                "fastpack.PackOptions(max_len, ...)"
            )
        made = _made(max_len, kwargs)
    else:
        if not isinstance(options, PackOptions):
            raise FastpackTypeError(
                f"options: expected a fastpack.PackOptions, got {type(options).__name__}"
            )
        given = dict(kwargs)
        if max_len is not None:
            given["max_len"] = max_len
        made = options
        if given:
            # Checked as any option is, then compared with the object's (normalised) value.
            _agree(dataclasses.replace(options, **given), options, given, lambda n, v, h: (
                f"{n}: got {n}={given[n]!r} and options with {n}={h!r}; pass it once (as a "
                f"keyword or in options)"
            ))
    if refuse:
        _refuse(made, refuse)
    return made


#: Options made from keywords, by the exact values (and types) given: a loop that calls
#: ``pack(lengths, 4096, strategy="ffd")`` per batch checks its options once. Only options
#: that passed their checks are kept; the checks read nothing but the values.
_MADE: dict[tuple[Any, ...], PackOptions] = {}
_MADE_MAX = 256


def _made(max_len: Any, kwargs: Mapping[str, Any]) -> PackOptions:
    try:
        key = (type(max_len), max_len, *((k, type(v), v) for k, v in sorted(kwargs.items())))
        made = _MADE.get(key)
    except TypeError:  # an unhashable value (never a valid one): let the checks say so
        return PackOptions(max_len, **kwargs)
    if made is None:
        made = PackOptions(max_len, **kwargs)
        if len(_MADE) >= _MADE_MAX:
            _MADE.clear()
        _MADE[key] = made
    return made


def _refuse(options: PackOptions, refuse: Mapping[str, str]) -> None:
    for name, why in refuse.items():
        value = getattr(options, name)
        if value != _DEFAULTS[name]:
            shown = dict(value) if name == "limits" else value  # as it is given: {name: cap}
            raise FastpackError(f"{name}: got {shown!r}; {why}")


def layered(
    entry: Any,
    base: PackOptions,
    options: PackOptions | None,
    kwargs: Mapping[str, Any],
    *,
    refuse: Mapping[str, str] | None = None,
) -> tuple[PackOptions, frozenset[str]]:
    """The options of an entry point that plans for a collator (``PackedDataset``,
    ``PackedIterableDataset``): the collator's (``base``: its per-batch options), with the
    plan options given here (keywords or ``options``). A per-batch option given here must
    be the collator's — it is set once, on the collator. Returns the options and the names
    the caller stated (every field when ``options`` is given)."""
    _check_names(entry, kwargs)
    if options is None:
        stated = frozenset(kwargs)
        merged = dataclasses.replace(base, **kwargs) if kwargs else base
    else:
        merged = resolve(entry, options, None, kwargs)
        stated = frozenset(_NAMES)
    batch = [n for n in _NAMES if n in stated and n not in PLAN_OPTIONS]
    _agree(merged, base, batch, lambda n, v, h: (
        f"{n}: got {v!r}, but the collator plans with {h!r}; set it once, on the collator "
        f"(PackedCollator(..., {n}={v!r})), and leave it out here"
    ))
    if refuse:
        _refuse(merged, refuse)
    return merged, stated


def check_plan(plan_options: PackOptions, wanted: PackOptions, names: Any) -> None:
    """Raises if a given plan was made with other values of ``names`` than ``wanted``:
    the one comparison of a plan with the options it is used under."""
    _agree(wanted, plan_options, names, lambda n, v, h: (
        f"{n}: got {v!r}, but the given plan was made with {h!r}; pass {n}={v!r} when "
        f"planning (fastpack.pack or collator.plan)"
    ))


def _agree(stated: PackOptions, held: PackOptions, names: Any,
           message: Callable[[str, Any, Any], str]) -> None:
    """Raises ``message(name, stated's, held's)`` for the first option of ``names`` (in
    field order) whose values differ."""
    for name, (value, have) in stated.differences(held, names).items():
        raise FastpackError(message(name, value, have))


def separator_reserve(reserve: int | None, separator_id: Any) -> int:
    """The reserved slots per sequence (``reserve``: a checked option, or None when not
    stated): a separator needs a slot, one unless ``reserve`` says more, and slots need a
    separator to hold. The one statement of that rule (collator, ``hf.pack_dataset``, the
    streams)."""
    if separator_id is None:
        if reserve:
            raise FastpackError(f"reserve: got {reserve} reserved slots but no separator_id "
                                "to write into them; pass separator_id")
        return 0
    if reserve == 0:
        raise FastpackError(
            f"reserve: 0 with separator_id={separator_id!r}; a separator needs a reserved "
            "slot after every sequence: leave reserve out (1 slot) or pass reserve >= 1"
        )
    return 1 if reserve is None else reserve


def with_separator(
    entry: Any,
    options: PackOptions | None,
    max_len: Any,
    kwargs: Mapping[str, Any],
    separator_id: Any,
    *,
    refuse: Mapping[str, str] | None = None,
) -> PackOptions:
    """:func:`resolve` for an entry point that writes ``separator_id`` into the reserved
    slots: ``reserve`` left out (or 0 in an options object) means one slot with a
    separator and none without (:func:`separator_reserve`)."""
    stated = kwargs.get("reserve") is not None
    if not stated and "reserve" in kwargs:
        kwargs = {k: v for k, v in kwargs.items() if k != "reserve"}
    made = resolve(entry, options, max_len, kwargs, refuse=refuse)
    slots = separator_reserve(made.reserve if stated or made.reserve else None, separator_id)
    return made if slots == made.reserve else made.replace(reserve=slots)


if TYPE_CHECKING:
    # The keyword form must accept exactly the fields (checked by mypy at each use).
    def _keywords_match(max_len: int, **kwargs: Unpack[PackArgs]) -> PackOptions:
        return PackOptions(max_len, **kwargs)
