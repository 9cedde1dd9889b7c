"""Mixtures by tokens: documents of several sources, each up- or down-sampled to a share of
the output's tokens (``weight``) or a number of passes over it (``epochs``), interleaved
so that every step carries the sources in proportion, then packed step by step.

How (the one algorithm, for :func:`mix` and ``fastpack pack --mix``):

1. **Selection** -- source ``s`` is read ``e_s`` times: ``floor(e_s)`` whole passes (each
   in its own seeded order) and a seeded part of one more pass: for ``epochs``, that many
   of its documents (epochs 2.5: every document twice and half of them once more); for a
   ``weight``, documents until its target tokens are reached (within one document).
2. **Interleave** -- every selected copy of a document sits at the fraction of its
   source's selected tokens that precede it; all copies are ordered by that fraction
   (a smooth weighted round-robin by tokens), and cut into ``K`` steps of equal token
   budget: copy ``i`` of source ``s`` is in step ``floor(start_i * K / Q_s)``. So through
   every step ``k`` each source has supplied its share ``Q_s * k / K`` of tokens, less
   than one document short, and no step is more than one document of any source away
   from its share. With ``overlong="split"`` the unit is a piece of at most the cap
   (pieces train as sequences of their own), so a source of long documents stays within
   one piece per step, not one book.
3. **Pack** -- each step's documents are packed on their own (``fastpack.pack`` with the
   run's options, each step shuffled by its own seed); the steps' plans are laid end to
   end and ``step_offsets`` marks where each step's packs begin. Each step leaves at most
   a part of its last pack unfilled: ``benches/results/mix.md`` measures the cost against
   one plan of everything (``bfd``).

Everything is a function of the lengths, the mixture and the options' seed (seeded
permutations from the Rust core, stable across platforms and numpy versions); no
per-document Python objects.
"""

from __future__ import annotations

import glob as _glob
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _core
from ._errors import FastpackError
from ._options import PackArgs, PackOptions, resolve
from ._plan import Plan

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["STEP_TOKENS", "MixSource", "MixedPlan", "Mixture", "mix"]

#: Tokens per step when the mixture names none: about a global batch of pre-training
#: (512 packs of 4096); each step costs at most part of one pack of efficiency.
STEP_TOKENS = 1 << 21

_SALT_SOURCE = 0x6D69_7800  # "mix": seeds of the mixture's permutations, not the packs'
_SALT_STEP = 0x7374_6570  # "step"


def _seed(seed: int, *parts: int) -> int:
    """A seed (0..2^63) derived from ``seed`` and ``parts``, the same on every machine."""
    from ._offline.plan import shard_seed

    for p in parts:
        seed = shard_seed(seed, p)
    return seed


def _number(name: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value <= 0:
        raise FastpackError(f"mix: source {name!r}: {key} must be a positive number, "
                            f"got {value!r}")
    return float(value)


@dataclass(frozen=True)
class MixSource:
    """One source of a mixture: its ``name``, the files of the command (``paths``: files,
    directories or glob patterns; unused by :func:`mix`, which is given lengths) and
    exactly one of ``weight`` (its share of the output tokens, relative to the other
    weighted sources) or ``epochs`` (passes over it: 0.5 reads half its documents, 2.5
    every document twice and half of them once more)."""

    name: str
    paths: tuple[str, ...] = ()
    weight: float | None = None
    epochs: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise FastpackError(f"mix: a source needs a name (a non-empty string), got "
                                f"{self.name!r}")
        if (self.weight is None) == (self.epochs is None):
            raise FastpackError(f"mix: source {self.name!r}: give exactly one of weight "
                                "(a share of the output tokens) or epochs (passes over it)")
        if self.weight is not None:
            object.__setattr__(self, "weight", _number(self.name, "weight", self.weight))
        if self.epochs is not None:
            object.__setattr__(self, "epochs", _number(self.name, "epochs", self.epochs))
        paths = (self.paths,) if isinstance(self.paths, str) else tuple(self.paths)
        if not all(isinstance(p, str) for p in paths):
            raise FastpackError(f"mix: source {self.name!r}: paths must be strings, got "
                                f"{self.paths!r}")
        object.__setattr__(self, "paths", paths)

    def to_json(self) -> dict[str, Any]:
        value: dict[str, Any] = {"name": self.name, "paths": list(self.paths)}
        value.update({"weight": self.weight} if self.weight is not None
                     else {"epochs": self.epochs})
        return value


@dataclass(frozen=True, init=False)
class Mixture:
    """Sources mixed by tokens (see the module's docstring for how).

    ``sources``: :class:`MixSource` objects, or a mapping of names to their fields
    (``{"web": {"weight": 3}, "wiki": {"epochs": 2}}``). ``tokens``: the output's tokens;
    the weighted sources share what the ``epochs`` sources leave of it. Without it, the
    largest weighted source (most tokens) is read once and the others scaled to their
    weights. ``step_tokens``: the token budget of a step (default :data:`STEP_TOKENS`):
    every step carries each source's share within one document."""

    sources: tuple[MixSource, ...]
    tokens: int | None = None
    step_tokens: int = STEP_TOKENS

    def __init__(self, sources: Sequence[MixSource] | Mapping[str, Mapping[str, Any]], *,
                 tokens: int | None = None, step_tokens: int = STEP_TOKENS) -> None:
        if isinstance(sources, Mapping):
            items = []
            for name, spec in sources.items():
                if not isinstance(spec, Mapping):
                    raise FastpackError(f"mix: source {name!r}: expected a mapping with "
                                        f"weight or epochs, got {spec!r}")
                items.append(_source_of(str(name), spec))
            sources = items
        made = tuple(sources)
        if not made:
            raise FastpackError("mix: no sources; expected at least one")
        if not all(isinstance(s, MixSource) for s in made):
            raise FastpackError("mix: sources must be MixSource objects or a mapping of "
                                "names to {weight: ...} or {epochs: ...}")
        names = [s.name for s in made]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise FastpackError(f"mix: source {twice[0]!r} is named twice")
        for key, value in (("tokens", tokens), ("step_tokens", step_tokens)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise FastpackError(f"mix: {key} must be a positive integer, got {value!r}")
        if tokens is not None and not any(s.weight is not None for s in made):
            raise FastpackError("mix: tokens sets the weighted sources' total, but every "
                                "source has epochs; leave tokens out")
        object.__setattr__(self, "sources", made)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "step_tokens", step_tokens)

    @classmethod
    def from_dict(cls, value: Mapping[str, Any], base: str | os.PathLike[str] | None = None,
                  ) -> Mixture:
        """A mixture from its YAML/JSON form (``sources``: a list of ``{name, paths,
        weight | epochs}`` or a mapping of names to ``{paths, weight | epochs}``;
        ``tokens``; ``step_tokens``). Relative ``paths`` are taken from ``base``."""
        if not isinstance(value, Mapping):
            raise FastpackError(f"mix: expected a mapping with 'sources', got {value!r}")
        unknown = sorted(set(value) - {"sources", "tokens", "step_tokens"})
        if unknown:
            raise FastpackError(f"mix: unknown key {unknown[0]!r}; expected sources, tokens, "
                                "step_tokens")
        raw = value.get("sources")
        if isinstance(raw, Mapping):
            raw = [{"name": k, **(v if isinstance(v, Mapping) else {"weight": v})}
                   for k, v in raw.items()]
        if not isinstance(raw, list) or not raw:
            raise FastpackError("mix: 'sources' must list the sources (each with name, "
                                "paths and weight or epochs)")
        sources = []
        for spec in raw:
            if not isinstance(spec, Mapping):
                raise FastpackError(f"mix: a source must be a mapping, got {spec!r}")
            source = _source_of(str(spec.get("name", "")), spec)
            if base is not None:
                source = MixSource(source.name, tuple(
                    p if os.path.isabs(p) else str(Path(base) / p) for p in source.paths),
                    source.weight, source.epochs)
            sources.append(source)
        return cls(sources, tokens=value.get("tokens"),
                   step_tokens=value.get("step_tokens", STEP_TOKENS))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> Mixture:
        """A mixture from a YAML file (``fastpack pack --mix``); relative paths in it are
        taken from the file's directory. Needs pyyaml."""
        try:
            import yaml
        except ImportError:
            raise FastpackError("--mix: reading a mix file needs pyyaml: pip install "
                                "pyyaml") from None
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise FastpackError(f"--mix {path}: cannot read it ({e.strerror})") from None
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise FastpackError(f"--mix {path}: not valid YAML ({e})") from None
        try:
            return cls.from_dict(value, base=Path(path).resolve().parent)
        except FastpackError as e:
            raise FastpackError(f"--mix {path}: {e}") from None

    def to_json(self) -> dict[str, Any]:
        """The mixture as the run's settings record it (paths as given)."""
        return {"sources": [s.to_json() for s in self.sources], "tokens": self.tokens,
                "step_tokens": self.step_tokens}

    def files(self) -> list[list[str]]:
        """Each source's paths with glob patterns expanded (sorted), for the command."""
        expanded = []
        for s in self.sources:
            if not s.paths:
                raise FastpackError(f"mix: source {s.name!r} has no paths")
            mine: list[str] = []
            for p in s.paths:
                if _glob.has_magic(p):
                    found = sorted(_glob.glob(p))
                    if not found:
                        raise FastpackError(f"mix: source {s.name!r}: no file matches {p!r}")
                    mine.extend(found)
                else:
                    mine.append(p)
            expanded.append(mine)
        return expanded


def _source_of(name: str, spec: Mapping[str, Any]) -> MixSource:
    unknown = sorted(set(spec) - {"name", "paths", "weight", "epochs"})
    if unknown:
        raise FastpackError(f"mix: source {name!r}: unknown key {unknown[0]!r}; expected "
                            "name, paths, weight or epochs")
    paths = spec.get("paths", ())
    return MixSource(name, (paths,) if isinstance(paths, str) else tuple(paths or ()),
                     spec.get("weight"), spec.get("epochs"))


@dataclass
class MixedPlan:
    """A mixture's plan: ``plan`` (its ``sample_ids`` index the sources' documents laid
    end to end, in the mixture's order; a repeated document appears once per copy),
    ``step_offsets`` (int64 [K+1]: step ``k`` is packs ``step_offsets[k]:step_offsets[k+1]``),
    ``lengths`` (the token count of every copy, source by source: what the plan packed),
    ``copies`` (int32 per document: how many times it is in the output) and ``sources``
    (per source what was asked and what the output holds: report.json's ``mix``)."""

    plan: Plan
    step_offsets: np.ndarray
    lengths: np.ndarray
    copies: np.ndarray
    sources: list[dict[str, Any]]
    step_tokens: int = 0

    @property
    def num_steps(self) -> int:
        return len(self.step_offsets) - 1

    def report(self) -> dict[str, Any]:
        """What report.json's ``mix`` holds."""
        return {"steps": self.num_steps, "step_tokens": self.step_tokens,
                "sources": self.sources}


def _targets(mixture: Mixture, tokens: np.ndarray) -> np.ndarray:
    """Each source's target tokens (float): ``epochs × tokens``, or its weight's share of
    what the epochs sources leave of ``mixture.tokens`` (else of the total that reads the
    largest weighted source once)."""
    sources = mixture.sources
    target = np.zeros(len(sources))
    weighted = [i for i, s in enumerate(sources) if s.weight is not None]
    for i, s in enumerate(sources):
        if s.epochs is not None:
            target[i] = s.epochs * float(tokens[i])
    for i in weighted:
        if tokens[i] == 0:
            raise FastpackError(f"mix: source {sources[i].name!r} has no tokens, so it cannot "
                                "supply a share of the output")
    if not weighted:
        return target
    weights = np.array([sources[i].weight for i in weighted], dtype=np.float64)
    if mixture.tokens is not None:
        budget = float(mixture.tokens) - target.sum()
        if budget <= 0:
            raise FastpackError(f"mix: tokens={mixture.tokens:,} leaves nothing for the "
                                f"weighted sources: the epochs sources alone give "
                                f"{int(target.sum()):,}")
    else:
        largest = max(weighted, key=lambda i: (int(tokens[i]), -i))
        budget = float(tokens[largest]) * weights.sum() / sources[largest].weight  # type: ignore[operator]
    target[weighted] = budget * weights / weights.sum()
    return target


def _queue(lengths: np.ndarray, epochs: float, target: float, by_tokens: bool, seed: int,
           source: int, shuffle: bool, threads: int | None) -> np.ndarray:
    """The documents (indices, int64) of one source in the order they are read: whole
    passes, then the part of one more pass."""
    n = len(lengths)
    whole = int(math.floor(epochs + 1e-12))
    parts = []
    for c in range(whole):
        parts.append(_core.permutation(n, _seed(seed, _SALT_SOURCE, source, c), threads)
                     .astype(np.int64) if shuffle else np.arange(n, dtype=np.int64))
    # The extra pass's documents are a seeded choice even without shuffling (which one
    # is read is the mixture's decision); unshuffled they keep the files' order.
    extra = _core.permutation(n, _seed(seed, _SALT_SOURCE, source, whole),
                              threads).astype(np.int64)
    if by_tokens:
        left = target - whole * float(lengths.sum(dtype=np.int64))
        starts = np.cumsum(lengths[extra], dtype=np.int64) - lengths[extra]
        # (a float target's rounding error is no reason to read one more document)
        k = int(np.searchsorted(starts, left, side="left")) if left > 1e-6 else 0
    else:
        k = int(math.floor((epochs - whole) * n + 0.5))
    part = extra[:k]
    parts.append(part if shuffle else np.sort(part))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _units(docs: np.ndarray, lengths: np.ndarray, opts: PackOptions,
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The units one source's copies are interleaved in: ``(document, first token,
    tokens)`` each. A copy is one unit of the tokens the plan keeps of it (the cap's
    worth when truncated, none when dropped), or with ``overlong="split"`` one per piece
    of at most the cap (the pieces the plan would cut)."""
    cap = (opts.long_max_len or opts.max_len) - opts.reserve
    zero = np.zeros(len(docs), dtype=np.int64)
    if opts.strategy == "wrapped" or cap <= 0 or not (lengths > cap).any():
        return docs, zero, lengths
    if opts.overlong == "truncate":
        return docs, zero, np.minimum(lengths, cap)
    if opts.overlong == "drop":
        return docs, zero, np.where(lengths > cap, 0, lengths)
    if opts.overlong != "split":
        return docs, zero, lengths  # "error": refused before planning
    pieces = np.maximum(-(-lengths // cap), 1)
    first = np.cumsum(pieces) - pieces
    rank = np.arange(int(pieces.sum()), dtype=np.int64) - np.repeat(first, pieces)
    starts = rank * cap
    total = np.repeat(lengths, pieces)
    return np.repeat(docs, pieces), starts, np.minimum(total - starts, cap)


def _step_seeds(seed: int, num_steps: int) -> np.ndarray:
    """``_seed(seed, _SALT_STEP, k)`` for every step ``k`` at once (uint64)."""
    from ._offline.plan import mix64

    base = _seed(seed, _SALT_STEP)
    first = np.uint64(base * 1_000_003 % 2**64)
    with np.errstate(over="ignore"):  # modulo 2^64, as shard_seed
        keys = first + np.arange(num_steps, dtype=np.uint64)
    return mix64(keys) >> np.uint64(1)


def _pack_steps(lengths: np.ndarray, bounds: np.ndarray, opts: PackOptions,
                doc_order: np.ndarray, start_order: np.ndarray,
                threads: int | None) -> tuple[Plan, np.ndarray]:
    """The steps' plans laid end to end (step ``k``: ``lengths[bounds[k]:bounds[k+1]]``,
    shuffled by the step's own seed) and where each step's packs begin. One core call packs
    every step, each whole on one thread: the plan does not depend on how many. (One call
    per step cost a fixed overhead per step that dominated thousands of small steps.)"""
    seeds = _step_seeds(opts.seed, len(bounds) - 1) if opts.shuffle else None
    fields = _core.pack_segments(
        np.ascontiguousarray(lengths, dtype=np.int64), np.ascontiguousarray(bounds, np.int64),
        opts.max_len, opts.strategy, opts.overlong, opts.reserve, seeds, threads,
        opts.long_max_len)
    # As combine_plans joins shards: documents and pieces' first tokens by position, the
    # options recorded, each bucket's sequences kept (every metric is recomputed by Plan).
    positions = fields["sample_ids"]
    out: dict[str, Any] = {
        "sample_ids": doc_order[positions].astype(np.int64),
        "starts": (fields["starts"] + start_order[positions]).astype(np.int64),
        "seqlens": fields["seqlens"], "pack_offsets": fields["pack_offsets"],
        "buckets": [{"num_sequences": b["num_sequences"]} for b in fields["buckets"]]}
    for name in ("max_len", "reserve", "strategy", "overlong", "long_max_len", "group_tokens",
                 "shuffle", "seed"):
        out[name] = getattr(opts, name)
    for name in ("num_sequences", "empty_sequences", "dropped_sequences", "dropped_tokens",
                 "truncated_sequences", "truncated_tokens", "split_sequences", "total_tokens"):
        out[name] = fields[name]
    if opts.long_max_len is not None:
        out["pack_caps"] = fields["pack_caps"]
    return Plan(out), fields["pack_starts"]


def mix(
    lengths: Mapping[str, Any] | Sequence[Any],
    mixture: Mixture | Mapping[str, Any],
    max_len: int | None = None,
    *,
    options: PackOptions | None = None,
    threads: int | None = None,
    **kwargs: Unpack[PackArgs],
) -> MixedPlan:
    """Plans a mixture: the documents of each source (``lengths``: a mapping of source
    names to their documents' token lengths, or a sequence in the mixture's order)
    selected by weight or epochs, interleaved so that every step of
    ``mixture.step_tokens`` tokens carries every source's share within one document, and
    packed step by step with the packing options (``max_len``, ``options`` or keywords,
    as :func:`fastpack.pack`; the seed also chooses the documents repeated or left out).

    >>> import fastpack
    >>> m = fastpack.Mixture({"web": {"weight": 3}, "code": {"weight": 1}}, step_tokens=4096)
    >>> planned = fastpack.mix({"web": [300] * 90, "code": [200] * 40}, m, max_len=1024)
    >>> print(", ".join(f"{s['name']} {s['realised_share']:.0%}" for s in planned.sources))
    web 75%, code 25%
    """
    if not isinstance(mixture, Mixture):
        mixture = Mixture.from_dict(mixture)
    opts = resolve(mix, options, max_len, kwargs)
    if opts.group_tokens is not None:
        raise FastpackError("group_tokens: a mixture's steps are its groups "
                            "(mixture.step_tokens); leave group_tokens out")
    sources = mixture.sources
    if isinstance(lengths, Mapping):
        missing = [s.name for s in sources if s.name not in lengths]
        extra = [k for k in lengths if k not in {s.name for s in sources}]
        if missing or extra:
            raise FastpackError(f"lengths: expected one array per source of the mixture "
                                f"({', '.join(s.name for s in sources)}); "
                                + (f"missing {missing[0]!r}" if missing else
                                   f"{extra[0]!r} is not a source"))
        arrays = [lengths[s.name] for s in sources]
    else:
        arrays = list(lengths)
        if len(arrays) != len(sources):
            raise FastpackError(f"lengths: {len(arrays)} arrays for {len(sources)} sources")
    per_source = []
    for s, a in zip(sources, arrays):
        a = np.asarray(a)
        if a.ndim != 1 or (a.size and (a.dtype.kind not in "iu" or a.min() < 0)):
            raise FastpackError(f"lengths: source {s.name!r}: expected a 1-D array of "
                                f"non-negative integer lengths, got {a.dtype} {a.shape}")
        per_source.append(a.astype(np.int64, copy=False))
    return plan_mixture(per_source, mixture, opts, threads)


def plan_mixture(per_source: Sequence[np.ndarray], mixture: Mixture, opts: PackOptions,
                 threads: int | None = None) -> MixedPlan:
    """:func:`mix` on checked lengths (int64 per source) and options: the command's
    entry point."""
    sources = mixture.sources
    tokens = np.array([int(a.sum(dtype=np.int64)) for a in per_source], dtype=np.int64)
    counts = np.array([len(a) for a in per_source], dtype=np.int64)
    doc_base = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    target = _targets(mixture, tokens)
    cap = (opts.long_max_len or opts.max_len) - opts.reserve
    if opts.overlong == "error" and opts.strategy != "wrapped":
        for s, a in zip(sources, per_source):
            over = np.flatnonzero(a > cap)
            if over.size:  # named here: a step's plan would name its own index
                raise FastpackError(
                    f"lengths: source {s.name!r}, document {int(over[0])}: {int(a[over[0]]):,} "
                    f"tokens, over the cap of {cap:,} ({over.size - 1:,} more); pass "
                    "overlong='split', 'truncate' or 'drop'")
    seed = opts.seed
    queues, units, q_tokens = [], [], []
    for i, (s, a) in enumerate(zip(sources, per_source)):
        if s.epochs is not None:
            q = _queue(a, s.epochs, target[i], False, seed, i, opts.shuffle, threads)
        else:
            e = target[i] / float(tokens[i])
            q = _queue(a, e, target[i], True, seed, i, opts.shuffle, threads)
        queues.append(q)
        units.append(_units(q, a[q], opts))
        q_tokens.append(int(units[-1][2].sum(dtype=np.int64)))
    total = sum(q_tokens)
    num_steps = max(1, -(-total // mixture.step_tokens))
    # Step of every unit: floor(start * K / Q_s) (the source's tokens before it, as a
    # fraction of its own); ordering by (step, that fraction) interleaves the sources
    # smoothly within steps too (what the order-keeping strategies keep). A unit is a copy of a
    # document, or with overlong="split" a piece of one (at most the cap): pieces train
    # as sequences of their own, and the proportions then hold within one piece.
    steps, fracs, docs, lens_all, src_all, piece_starts = [], [], [], [], [], []
    for i, (unit_docs, offsets, lens) in enumerate(units):
        st = np.cumsum(lens, dtype=np.int64) - lens
        qs = max(q_tokens[i], 1)
        step = np.minimum((st * num_steps) // qs, num_steps - 1) if total else \
            np.zeros(len(unit_docs), dtype=np.int64)
        steps.append(step)
        fracs.append(st / qs)
        docs.append(unit_docs + doc_base[i])
        lens_all.append(lens)
        piece_starts.append(offsets)
        src_all.append(np.full(len(unit_docs), i, dtype=np.int32))
    step_of = np.concatenate(steps) if steps else np.zeros(0, np.int64)
    if opts.strategy in ("bfd", "ffd"):
        # Best/first fit sort each step by length: only the steps matter (a stable sort
        # of the sources' sorted runs, source by source within a step).
        order = np.argsort(step_of, kind="stable")
    else:
        order = np.lexsort((np.concatenate(fracs), step_of))
    step_of = step_of[order]
    doc_order = np.concatenate(docs)[order]
    len_order = np.concatenate(lens_all)[order]
    src_order = np.concatenate(src_all)[order]
    start_order = np.concatenate(piece_starts)[order]
    bounds = np.searchsorted(step_of, np.arange(num_steps + 1))
    plan, step_offsets = _pack_steps(len_order, bounds, opts, doc_order, start_order, threads)
    copies = np.zeros(int(doc_base[-1]), dtype=np.int32)
    for i, q in enumerate(queues):
        copies[doc_base[i]:doc_base[i + 1]] = np.bincount(q, minlength=int(counts[i]))
    # Per step and source, tokens against the share: the proportion guarantee, measured.
    per_step = np.bincount(src_order.astype(np.int64) * num_steps + step_of,
                           weights=len_order, minlength=len(sources) * num_steps
                           ).reshape(len(sources), num_steps)
    report = []
    target_total = float(target.sum()) or 1.0
    for i, s in enumerate(sources):
        mine = copies[doc_base[i]:doc_base[i + 1]]
        share = q_tokens[i] / total if total else 0.0
        deviation = np.abs(per_step[i] - q_tokens[i] / num_steps)
        report.append({
            "name": s.name,
            **({"weight": s.weight} if s.weight is not None else {"epochs": s.epochs}),
            "documents": int(counts[i]),
            "tokens": int(tokens[i]),
            "target_tokens": int(round(target[i])),
            "target_share": float(target[i] / target_total),
            "output_documents": int(len(queues[i])),
            "output_tokens": q_tokens[i],
            "realised_share": share,
            "epochs_target": float(target[i] / tokens[i]) if tokens[i] else 0.0,
            "epochs_realised": q_tokens[i] / int(tokens[i]) if tokens[i] else 0.0,
            "repeated": int(np.maximum(mine - 1, 0).sum(dtype=np.int64)),
            "left_out": int((mine == 0).sum()),
            "longest_document": int(per_source[i].max()) if counts[i] else 0,
            "longest_piece": int(lens_all[i].max()) if len(lens_all[i]) else 0,
            "max_step_deviation_tokens": float(deviation.max()) if num_steps else 0.0,
        })
    copy_lengths = np.concatenate([per_source[i][q] for i, q in enumerate(queues)])
    return MixedPlan(plan, step_offsets, copy_lengths, copies, report,
                     step_tokens=-(-total // num_steps) if total else 0)
