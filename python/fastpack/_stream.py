"""Streams: packing a source of unknown length inside a bounded window of samples.

A :class:`StreamPacker` reads samples a window at a time (``buffer_size`` samples), packs
the window with :func:`fastpack.pack` (best fit decreasing by default, in Rust), emits the
packs that are full, and carries the samples of the under-filled ones into the next
window, where later samples fill the gaps. Efficiency so approaches the offline plan's
(``benches/results/stream.md``: 99.99% at 10^4 samples on SFT-like lengths) with memory
bounded by the window. At the end of the stream everything left is flushed.

Why windows of :func:`fastpack.pack` and not an incremental best fit: a window of
``buffer_size`` lengths packs in O(buffer_size + max_len) (0.3 ms for 10^4 samples), so a
sample costs about 30 ns of planning; best fit *decreasing* over the window beats an
online best fit (which places samples in arrival order), and carrying the under-filled
packs removes the window edge that a plain windowed plan pays for.

This module is torch-free: :class:`fastpack.torch.PackedIterableDataset` feeds batches
from it, and :func:`pack_iterable_dataset` turns a ``datasets.IterableDataset`` into a
packed one (``fastpack.hf.pack_dataset`` dispatches streams here).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _core
from ._checks import _int_arg, _threads
from ._errors import FastpackError, FastpackTypeError
from ._gather import WRITTEN, check_packable, separators, written_fields
from ._options import PackArgs, PackOptions, WithOptions, resolve, with_separator
from ._plan import Plan, pack

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["Gathered", "Round", "StreamPacker", "StreamStats", "pack_iterable_dataset"]

logger = logging.getLogger("fastpack")

#: A pack whose fill is below this share of its cap waits for later samples (bfd/ffd).
CARRY_BELOW = 0.999
#: At most this share of a window is carried into the next one, so each window reads at
#: least half new samples and planning stays O(1) per sample.
CARRY_SHARE = 0.5
#: A sample is carried at most this many times; then its pack is emitted as it is, so no
#: sample waits more than about ``MAX_CARRIES * buffer_size`` samples.
MAX_CARRIES = 8
#: Samples per window unless ``buffer_size`` says otherwise.
DEFAULT_BUFFER_SIZE = 10_000
#: The state format; bumped when it changes.
STATE_VERSION = 1

#: A ragged column in the Arrow list layout: row ``i`` is ``values[offsets[i]:offsets[i+1]]``.
Column = tuple[np.ndarray, np.ndarray]

_ORDERED = ("next_fit", "wrapped", "one_per_pack")

#: The packing options a stream cannot honour, and why (see ``_options.resolve``).
STREAM_REFUSES = {
    "group_tokens": "groups of packs need the whole plan, and a stream is packed a window "
                    "at a time; plan the whole dataset (fastpack.pack, a datasets.Dataset) "
                    "for groups, or use None",
    "limits": "a stream's windows are packed on tokens only; plan the whole dataset "
              "(fastpack.pack with limits={name: (values, cap)}, PackedDataset, or "
              "hf.pack_dataset of a datasets.Dataset) for budgets besides tokens, or use None",
    "share_prefix": "a stream is packed a window at a time, as rows of whole sequences; "
                    "plan the whole dataset (a PackedDataset) for trees, or use the "
                    "collator as a DataLoader's collate_fn",
}


@dataclass
class StreamStats:
    """What a :class:`StreamPacker` did so far. Nothing is lost silently: every token read
    is in an emitted pack, waiting in the window, or counted as dropped or truncated."""

    #: Samples read from the source.
    num_sequences: int = 0
    empty_sequences: int = 0
    dropped_sequences: int = 0
    dropped_tokens: int = 0
    truncated_sequences: int = 0
    truncated_tokens: int = 0
    #: Samples cut into several segments (``overlong="split"`` or ``"wrapped"``).
    split_sequences: int = 0
    #: Packs emitted.
    num_packs: int = 0
    #: Tokens in the emitted packs, reserved separator slots included.
    total_tokens: int = 0
    #: Sum of the emitted packs' caps (``max_len``, or ``long_max_len`` for long packs).
    capacity: int = 0
    #: Windows planned.
    rounds: int = 0

    @property
    def efficiency(self) -> float:
        """``total_tokens / capacity`` of the emitted packs; 1.0 before the first pack."""
        return self.total_tokens / self.capacity if self.capacity else 1.0


class Round:
    """One planned window: its rows (``columns``), the plan over them, and the packs it
    emits (``emit``, in order) or carries into the next window (``carry``).

    ``origins[r]`` is the stream index of the sample row ``r`` comes from and
    ``row_starts[r]`` the token offset of the row inside that sample (non-zero for the
    rest of a split or wrapped sample); ``ages[r]`` counts how often the row was carried.
    """

    __slots__ = (
        "_handles", "ages", "carry", "columns", "cursor", "emit", "final", "index", "origins",
        "plan", "row_starts",
    )

    def __init__(
        self,
        index: int,
        columns: dict[str, Column],
        origins: np.ndarray,
        row_starts: np.ndarray,
        ages: np.ndarray,
        plan: Plan,
        emit: np.ndarray,
        carry: np.ndarray,
        final: bool,
        cursor: int = 0,
    ) -> None:
        self.index = index
        self.columns = columns
        self.origins = origins
        self.row_starts = row_starts
        self.ages = ages
        self.plan = plan
        self.emit = emit
        self.carry = carry
        self.final = final
        self.cursor = cursor
        self._handles: list[Any] | None = None

    @property
    def remaining(self) -> int:
        """Packs of ``emit`` not taken yet."""
        return len(self.emit) - self.cursor

    def take(self, n: int) -> np.ndarray:
        """The next ``n`` packs to emit (fewer at the end of the round)."""
        packs = self.emit[self.cursor : self.cursor + n]
        self.cursor += len(packs)
        return packs

    def gather(
        self,
        packs: Any,
        *,
        separator_id: int | None = None,
        separator_values: Mapping[str, Any] | None = None,
        position_ids: bool = True,
    ) -> Gathered:
        """The rows of ``packs`` (pack indices of :attr:`plan`, say from :meth:`take`),
        copied by the same Rust gather as :func:`fastpack.gather`: a truncated sample
        keeps ``seqlen - reserve`` tokens and its separator, reserved slots hold
        ``separator_id`` in ``input_ids`` and ``separator_values`` (default: ``labels``
        -100, ``attention_mask`` 1, other columns 0) elsewhere. numpy only."""
        packs = np.asarray(packs, dtype=np.int64).reshape(-1)
        names = list(self.columns)
        dtypes = [self.columns[n][0].dtype for n in names]
        plan = self.plan
        slots = separators(names, dtypes, plan.reserve, separator_id, separator_values)
        out = _core.gather(plan, packs, self.handles(), slots, position_ids, None)
        columns = {}
        for name, dtype, buf in zip(names, dtypes, out["columns"]):
            if isinstance(buf, tuple):  # booleans come back as bits
                bits, n = buf
                columns[name] = np.unpackbits(bits, count=n, bitorder="little").astype(bool)
            else:
                columns[name] = buf.view(dtype)
        return Gathered(out["offsets"], columns, out["seq_offsets"], out["seq_lengths"],
                        out["position_ids"] if position_ids else None)

    def handles(self) -> list[Any]:
        """The rows as ``fastpack._core.ListColumn``s (made once per round), in the
        order of :attr:`columns`: what the Rust gather reads in place."""
        if self._handles is None:
            self._handles = [_list_column(k, v, o) for k, (v, o) in self.columns.items()]
        return self._handles


@dataclass
class Gathered:
    """Packed rows from :meth:`Round.gather`: row ``k`` holds values
    ``offsets[k]:offsets[k + 1]`` of every column and of ``position_ids``, and segments
    ``seq_offsets[k]:seq_offsets[k + 1]`` of ``seq_lengths`` (each segment's tokens,
    reserved slots included)."""

    offsets: np.ndarray
    columns: dict[str, np.ndarray]
    seq_offsets: np.ndarray
    seq_lengths: np.ndarray
    position_ids: np.ndarray | None


#: The column whose row lengths are planned.
LENGTH_COLUMN = "input_ids"


class StreamPacker(WithOptions):
    """Packs a stream a window at a time; torch-free.

    Feed it windows of new samples with :meth:`push` (at most :attr:`room` rows; fewer,
    or ``final=True``, at the end of the stream) and take the packs of each :class:`Round`
    before pushing the next. Every pack holds at most ``max_len`` tokens (``long_max_len``
    for the long bucket); each sample lands in exactly one emitted pack (or, split, in
    several), or is counted in :attr:`stats` as empty, dropped or truncated.

    Args:
        max_len, options, **kwargs: the packing options (:class:`fastpack.PackOptions`),
            as in :func:`fastpack.pack` (``overlong="error"`` names the sample's stream
            index); ``shuffle`` shuffles the packs each window emits (with ``seed`` and the
            round index), a window's packs otherwise come roughly sorted by size.
            ``group_tokens`` raises: groups need the whole plan.
        buffer_size: samples per window (the memory bound). Larger windows pack closer
            to the offline plan: about 99.4% of capacity at 10^2 samples on SFT-like
            lengths, 99.98% at 10^3, 99.99% at 10^4.
        packs_multiple: each round emits a multiple of this many packs (but the last),
            so batches of that many packs never straddle two windows.
        threads: worker threads, as in :func:`fastpack.pack`.

    Which packs wait: with ``"bfd"``/``"ffd"``, those filled below ``CARRY_BELOW`` of
    their cap, least filled first, up to ``CARRY_SHARE`` of the window, and never a
    sample already carried ``MAX_CARRIES`` times. With ``"next_fit"``/``"wrapped"``, the
    last (still open) pack of each bucket waits, so the stream packs exactly as the
    offline plan over the whole stream would (as long as that pack fits the share).
    """

    def __init__(
        self,
        max_len: int | None = None,
        *,
        options: PackOptions | None = None,
        buffer_size: int = DEFAULT_BUFFER_SIZE,
        packs_multiple: int = 1,
        threads: int | None = None,
        **kwargs: Unpack[PackArgs],
    ) -> None:
        #: The packing options (checked once, here).
        self.options = resolve(StreamPacker, options, max_len, kwargs, refuse=STREAM_REFUSES)
        # Each window is planned unshuffled: its emitted packs are shuffled in push().
        self._window = self.options.replace(shuffle=False, seed=0)
        self.buffer_size = _int_arg("buffer_size", buffer_size, minimum=1)
        self.packs_multiple = _int_arg("packs_multiple", packs_multiple, minimum=1)
        self.threads = _threads(threads)
        self.stats = StreamStats()
        self.current: Round | None = None
        self._next_origin = 0

    # ------------------------------------------------------------------ windows
    @property
    def room(self) -> int:
        """New samples the next window takes: ``buffer_size`` less the carried rows."""
        return max(self.buffer_size - self._carried_rows(), 0)

    @property
    def finished(self) -> bool:
        """True once the final round's packs are all taken."""
        return self.current is not None and self.current.final and not self.current.remaining

    def _carried_rows(self) -> int:
        rnd = self.current
        if rnd is None or not len(rnd.carry):
            return 0
        offsets = rnd.plan.pack_offsets
        return int((offsets[rnd.carry + 1] - offsets[rnd.carry]).sum())

    def push(
        self,
        columns: Mapping[str, Column],
        *,
        final: bool = False,
        origins: np.ndarray | None = None,
    ) -> Round:
        """Plan a window: the rows carried from the last round, then ``columns`` (new
        samples, each a ``(values, offsets)`` pair; ``"input_ids"`` gives the lengths).

        ``origins`` are the new samples' stream indices (default: counted from 0), used
        in error messages and in :attr:`Round.origins`. ``final`` flushes everything.
        """
        previous = self.current
        if previous is not None and previous.remaining:
            raise FastpackError(
                f"push: the current round still has {previous.remaining} packs to take"
            )
        if previous is not None and previous.final:
            raise FastpackError("push: the stream already ended (a final round was pushed)")
        new = _check_columns(columns, previous)
        n = len(new[LENGTH_COLUMN][1]) - 1
        if n > self.room:
            raise FastpackError(f"columns: got {n} new samples; the window has room for "
                                f"{self.room} (buffer_size {self.buffer_size})")
        if origins is None:
            origins = np.arange(self._next_origin, self._next_origin + n, dtype=np.int64)
        else:
            origins = np.asarray(origins, dtype=np.int64)
            if origins.shape != (n,):
                raise FastpackError(f"origins: expected {n} stream indices, got shape "
                                    f"{origins.shape}")
        _check_lengths(new, origins)
        lengths = _row_lengths(new[LENGTH_COLUMN])
        self._check_overlong(lengths, origins)
        if previous is not None and len(previous.carry):
            carried = _carry(previous)
            window = {k: _concat(k, carried[0][k], new[k]) for k in new}
            origins = np.concatenate([carried[1], origins])
            row_starts = np.concatenate([carried[2], np.zeros(n, dtype=np.int64)])
            ages = np.concatenate([carried[3], np.zeros(n, dtype=np.int32)])
        else:
            window, row_starts, ages = new, np.zeros(n, dtype=np.int64), np.zeros(n, np.int32)
        plan = pack(_row_lengths(window[LENGTH_COLUMN]), options=self._window,
                    threads=self.threads)
        index = 0 if previous is None else previous.index + 1
        emit, carry = self._select(plan, window, row_starts, ages, final)
        if self.options.shuffle and len(emit) > 1:
            rng = np.random.default_rng(np.random.SeedSequence([self.options.seed, index]))
            emit = emit[rng.permutation(len(emit))]
        rnd = Round(index, window, origins, row_starts, ages, plan, emit, carry, final)
        if n:
            self._next_origin = int(origins[-1]) + 1
        self._count(plan, rnd, n)
        self.current = rnd
        return rnd

    def _check_overlong(self, lengths: np.ndarray, origins: np.ndarray) -> None:
        if self.overlong != "error" or self.strategy == "wrapped":
            return
        long_max_len = self.options.long_max_len
        cap = long_max_len or self.max_len
        over = lengths + self.reserve > cap
        if over.any():
            i = int(np.argmax(over))
            name = "long_max_len" if long_max_len else "max_len"
            raise FastpackError(
                f"input_ids: sample {int(origins[i])} of the stream has {int(lengths[i])} "
                f"tokens, more than {name} - reserve = {cap - self.reserve}; pass "
                f"overlong='truncate', 'split' or 'drop', or raise {name}"
            )

    def _select(self, plan: Plan, window: dict[str, Column], row_starts: np.ndarray,
                ages: np.ndarray, final: bool) -> tuple[np.ndarray, np.ndarray]:
        """Which packs to emit now and which to carry (both in plan order)."""
        n_packs = plan.num_packs
        every = np.arange(n_packs, dtype=np.int64)
        if final or n_packs == 0:
            return every, every[:0]
        counts = np.diff(plan.pack_offsets)
        caps = plan.pack_caps.astype(np.int64)
        fill = plan.pack_fills
        # A pack can wait only if each of its segments becomes a row of the next window
        # as it is: a segment that ends its sample (so it holds the reserved slots) and
        # holds a real token.
        lengths = _row_lengths(window[LENGTH_COLUMN])[plan.sample_ids]
        ends = plan.starts + plan.seqlens == lengths + self.reserve
        whole = ends & (plan.starts < lengths)
        carryable = np.logical_and.reduceat(whole, plan.pack_offsets[:-1])
        if self.strategy == "one_per_pack":
            # A pack holds one sample and never more: waiting gains it nothing.
            candidates = np.zeros(n_packs, dtype=bool)
        elif self.strategy in _ORDERED:
            # The open pack of each bucket (packs come short bucket first, in order).
            last = np.zeros(n_packs, dtype=bool)
            boundary = np.flatnonzero(np.diff(caps)) if len(caps) > 1 else np.zeros(0, int)
            last[np.concatenate([boundary, [n_packs - 1]]).astype(np.int64)] = True
            candidates = carryable & last & (fill < caps)
        else:
            oldest = np.maximum.reduceat(ages[plan.sample_ids], plan.pack_offsets[:-1])
            carryable &= oldest < MAX_CARRIES
            candidates = carryable & (fill < CARRY_BELOW * caps)
        limit = int(CARRY_SHARE * self.buffer_size)
        ratio = fill / caps
        order = np.lexsort((every, ratio))
        order = order[candidates[order]]
        take = order[np.cumsum(counts[order]) <= limit]
        carry = np.zeros(n_packs, dtype=bool)
        carry[take] = True
        if (n_packs - len(take)) % self.packs_multiple:
            carry = self._round_to_multiple(carry, carryable, counts, ratio, caps)
        return every[~carry], every[carry]

    def _round_to_multiple(self, carry: np.ndarray, carryable: np.ndarray, counts: np.ndarray,
                           ratio: np.ndarray, caps: np.ndarray) -> np.ndarray:
        """Make the emitted count a multiple of ``packs_multiple``: carry a few more packs
        (least filled first; with an ordered strategy, the ones just before the carried
        tail) if the window keeps room for a new sample, else emit the fullest carried."""
        m = self.packs_multiple
        extra = int((~carry).sum()) % m
        carry = carry.copy()
        if self.strategy in _ORDERED:
            # Only a contiguous tail of the last bucket re-packs as it was packed.
            n = len(carry)
            bucket = n - int(np.argmax(caps[::-1] != caps[-1])) if (caps != caps[-1]).any() else 0
            tail = n - 1 if carry[-1] else n
            more = np.arange(tail - extra, tail) if tail - extra >= bucket else np.zeros(0, int)
            if len(more) and not carryable[more].all():
                more = more[:0]
        else:
            more = np.flatnonzero(carryable & ~carry)
            more = more[np.lexsort((more, ratio[more]))][:extra]
        if len(more) == extra and int(counts[carry].sum() + counts[more].sum()) < self.buffer_size:
            carry[more] = True
            return carry
        held = np.flatnonzero(carry)
        release = m - extra
        if len(held) >= release:
            if self.strategy in _ORDERED:
                held = held[:0] if release > 1 else held[-1:]  # the open pack, if anything
            else:
                held = held[np.lexsort((held, -ratio[held]))][:release]
            if len(held) == release:
                carry[held] = False
        return carry

    def _count(self, plan: Plan, rnd: Round, n_new: int) -> None:
        s = self.stats
        s.rounds += 1
        s.num_sequences += n_new
        s.empty_sequences += plan.empty_sequences
        s.dropped_sequences += plan.dropped_sequences
        s.dropped_tokens += plan.dropped_tokens
        s.truncated_sequences += plan.truncated_sequences
        s.truncated_tokens += plan.truncated_tokens
        emit = rnd.emit
        fill = plan.pack_fills
        s.num_packs += len(emit)
        s.total_tokens += int(fill[emit].sum())
        s.capacity += int(plan.pack_caps[emit].astype(np.int64).sum())
        # A carried piece re-enters whole (it fit before), so no sample is counted twice.
        s.split_sequences += plan.split_sequences

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The packer's state: its options, counters and the current round (its rows,
        plan, emitted and carried packs, and how many packs were taken). numpy arrays
        are shared with the round, not copied (rounds are never modified in place)."""
        rnd = self.current
        state: dict[str, Any] = {
            "version": STATE_VERSION,
            "options": self._options(),
            "next_origin": self._next_origin,
            "stats": asdict(self.stats),
            "round": None,
        }
        if rnd is not None:
            plan = rnd.plan
            state["round"] = {
                "index": rnd.index,
                "columns": {k: {"values": v, "offsets": o} for k, (v, o) in rnd.columns.items()},
                "origins": rnd.origins,
                "row_starts": rnd.row_starts,
                "ages": rnd.ages,
                "plan": _plan_state(plan),
                "emit": rnd.emit,
                "carry": rnd.carry,
                "cursor": rnd.cursor,
                "final": rnd.final,
            }
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the packer must have the same options."""
        version = state.get("version") if isinstance(state, Mapping) else None
        if version != STATE_VERSION or "options" not in state:
            raise FastpackError(
                f"state: not a StreamPacker state of version {STATE_VERSION} (got a "
                f"{type(state).__name__} of version {version!r})"
            )
        saved, mine = dict(state["options"]), self._options()
        # Compared over this packer's options: an option added since the state was saved
        # compares with None, its value when unused.
        diff = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
        if diff:
            raise FastpackError(
                "state: saved with other options; (saved, now): "
                + ", ".join(f"{k}={a!r}/{b!r}" for k, (a, b) in diff.items())
            )
        self._next_origin = int(state["next_origin"])
        counts = state["stats"]
        self.stats = StreamStats(**{f.name: int(counts[f.name]) for f in fields(StreamStats)})
        r = state["round"]
        if r is None:
            self.current = None
            return
        arr = np.asarray
        self.current = Round(
            index=int(r["index"]),
            columns={k: (arr(c["values"]), arr(c["offsets"])) for k, c in r["columns"].items()},
            origins=arr(r["origins"]), row_starts=arr(r["row_starts"]), ages=arr(r["ages"]),
            plan=_plan_from_state(r["plan"]), emit=arr(r["emit"]), carry=arr(r["carry"]),
            final=bool(r["final"]), cursor=int(r["cursor"]),
        )

    def _options(self) -> dict[str, Any]:
        return {**asdict(self.options), "buffer_size": self.buffer_size,
                "packs_multiple": self.packs_multiple}


# ---------------------------------------------------------------------- columns
def _row_lengths(column: Column) -> np.ndarray:
    return np.diff(column[1].astype(np.int64, copy=False))


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concat(arange(s, s + c) for s, c in zip(starts, counts))``, vectorized."""
    counts = counts.astype(np.int64, copy=False)
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(counts)
    index = np.arange(total, dtype=np.int64)
    index += np.repeat(starts.astype(np.int64, copy=False) - (ends - counts), counts)
    return index


def _as_column(name: str, column: Any) -> Column:
    if not (isinstance(column, tuple) and len(column) == 2):
        raise FastpackTypeError(
            f"columns[{name!r}]: expected a (values, offsets) pair, got {type(column).__name__}"
        )
    values, offsets = np.asarray(column[0]), np.asarray(column[1])
    if values.ndim != 1 or offsets.ndim != 1 or offsets.size == 0:
        raise FastpackError(f"columns[{name!r}]: expected 1-D values and 1-D offsets "
                            f"(num_rows + 1 entries)")
    if offsets.dtype.kind not in "iu":
        raise FastpackTypeError(f"columns[{name!r}]: offsets must be integers, got "
                                f"{offsets.dtype}")
    if values.dtype.kind not in "iufb" or values.dtype.itemsize > 8:
        raise FastpackTypeError(f"columns[{name!r}]: values must be integers, floats or "
                                f"booleans, got {values.dtype}")
    offsets = offsets.astype(np.int64, copy=False)
    if offsets[0] < 0 or offsets[-1] > len(values) or np.any(np.diff(offsets) < 0):
        raise FastpackError(f"columns[{name!r}]: offsets must rise from >= 0 to at most "
                            f"len(values) = {len(values)}")
    return values, offsets


def _check_columns(columns: Mapping[str, Any], previous: Round | None) -> dict[str, Column]:
    if not isinstance(columns, Mapping) or LENGTH_COLUMN not in columns:
        raise FastpackError(f"columns: expected a mapping with {LENGTH_COLUMN!r}, got "
                            f"{sorted(columns) if isinstance(columns, Mapping) else columns!r}")
    new = {str(k): _as_column(str(k), v) for k, v in columns.items()}
    if previous is not None and set(new) != set(previous.columns):
        raise FastpackError(
            f"columns: got {sorted(new)}; earlier windows had {sorted(previous.columns)}"
        )
    rows = {k: len(o) - 1 for k, (_, o) in new.items()}
    if len(set(rows.values())) > 1:
        raise FastpackError(f"columns: different numbers of rows: {rows}")
    return new


def _check_lengths(columns: dict[str, Column], origins: np.ndarray) -> None:
    """Every column's row lengths equal ``input_ids``'."""
    lengths = _row_lengths(columns[LENGTH_COLUMN])
    for name, column in columns.items():
        if name == LENGTH_COLUMN:
            continue
        other = _row_lengths(column)
        bad = other != lengths
        if bad.any():
            i = int(np.argmax(bad))
            raise FastpackError(
                f"{name}: sample {int(origins[i])} of the stream has {int(other[i])} values "
                f"but {int(lengths[i])} input_ids; every packed column needs one value per "
                f"token (choose the packed columns with columns=[...])"
            )


def _take(column: Column, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> Column:
    """Rows ``values[offsets[r] + s : ... + c]`` for each (r, s, c), as a new column."""
    values, offsets = column
    index = _ranges(offsets[rows] + starts, counts)
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return values[index], out


def _concat(name: str, a: Column, b: Column) -> Column:
    if len(b[1]) == 1:
        return a
    kinds = a[0].dtype.kind + b[0].dtype.kind
    if "f" not in kinds and np.promote_types(a[0].dtype, b[0].dtype).kind == "f":
        raise FastpackTypeError(  # int64 with uint64: numpy would make floats of both
            f"columns[{name!r}]: {b[0].dtype} values after {a[0].dtype} ones; no integer "
            f"type holds both; give every window the same dtype"
        )
    values = np.concatenate([a[0][a[1][0] : a[1][-1]], b[0][b[1][0] : b[1][-1]]])
    offsets = np.concatenate([a[1] - a[1][0], b[1][1:] - b[1][0] + (a[1][-1] - a[1][0])])
    return values, offsets


def _carry(rnd: Round) -> tuple[dict[str, Column], np.ndarray, np.ndarray, np.ndarray]:
    """The carried packs' segments as rows of the next window, with their origins,
    offsets and ages. A carried segment is the rest of its row (``_select`` carries only
    those): its real tokens run from its start to the row's end, and the next plan adds
    the reserved slots back."""
    plan = rnd.plan
    lo = plan.pack_offsets[rnd.carry]
    index = _ranges(lo, plan.pack_offsets[rnd.carry + 1] - lo)
    rows, starts = plan.sample_ids[index], plan.starts[index]
    tokens = _row_lengths(rnd.columns[LENGTH_COLUMN])[rows] - starts
    columns = {k: _take(c, rows, starts, tokens) for k, c in rnd.columns.items()}
    return columns, rnd.origins[rows], rnd.row_starts[rows] + starts, rnd.ages[rows] + 1


def _list_column(name: str, values: np.ndarray, offsets: np.ndarray) -> Any:
    """A ``(values, offsets)`` column as a ``ListColumn`` over the same buffers (booleans
    as bits, the layout the Rust column reads)."""
    values = np.ascontiguousarray(values)
    if values.dtype.kind == "b":
        data, dtype = np.packbits(values, bitorder="little"), "bool"
    else:
        if not values.dtype.isnative:
            values = values.astype(values.dtype.newbyteorder("="))
        data, dtype = values, values.dtype.name
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    return _core.ListColumn(name, dtype, [(offsets, data.view(np.uint8), 0, len(values))])


def _plan_state(plan: Plan) -> dict[str, Any]:
    state = {name: getattr(plan, name) for name in Plan._FIELDS}
    state["long_max_len"] = plan.long_max_len
    state["pack_caps"] = plan._pack_caps
    state["buckets"] = [
        {"max_len": b.max_len, "num_sequences": b.num_sequences, "num_packs": b.num_packs,
         "total_tokens": b.total_tokens}
        for b in plan.buckets
    ]
    return state


def _plan_from_state(state: Mapping[str, Any]) -> Plan:
    plan_fields = {name: state[name] for name in Plan._FIELDS}
    for name in ("sample_ids", "starts", "seqlens", "pack_offsets"):
        plan_fields[name] = np.array(plan_fields[name])
    plan_fields["long_max_len"] = state["long_max_len"]
    if state["pack_caps"] is not None:
        plan_fields["pack_caps"] = np.array(state["pack_caps"])
    plan_fields["buckets"] = [dict(b) for b in state["buckets"]]
    return Plan(plan_fields)


# ---------------------------------------------------------------------- datasets
def _stream_seed(*parts: int) -> int:
    """One 64-bit seed from several (seed, epoch, shard...)."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1, np.uint64)[0])


def pack_iterable_dataset(
    dataset: Any,
    max_len: int | None = None,
    *,
    options: PackOptions | None = None,
    separator_id: int | None = None,
    columns: Sequence[str] | None = None,
    threads: int | None = None,
    buffer_size: int = DEFAULT_BUFFER_SIZE,
    **kwargs: Unpack[PackArgs],
) -> Any:
    """Pack a ``datasets.IterableDataset`` lazily: a packed ``IterableDataset`` with one
    row per pack, as ``fastpack.hf.pack_dataset`` gives for a ``Dataset`` (which calls
    this for streams). The packing options (``max_len``, ``options`` and the keywords
    of :class:`fastpack.PackOptions`) are :func:`fastpack.pack`'s.

    Every per-token list column (``columns``: default, every list-of-numbers column but
    ``seq_lengths`` and ``position_ids``; ``input_ids`` gives the lengths) is packed,
    keeping its Arrow type, and two columns are added: ``seq_lengths`` (int32, each
    segment's tokens, as TRL's ``pack_dataset`` writes it, so TRL's collators and
    ``SFTTrainer`` read it) and ``position_ids`` (int64, restarting at 0 in every
    segment). The rows are copied by the same Rust gather as for a ``Dataset``
    (:func:`fastpack.gather`), so a pack holds exactly what the Dataset path writes for
    it: a truncated row keeps ``max_len - reserve`` tokens and its separator; the
    reserved slots hold ``separator_id`` in ``input_ids``, -100 in ``labels``, 1 in
    ``attention_mask`` and 0 in other columns (a separator value that does not fit a
    column's type raises). ``separator_id`` without ``reserve`` reserves one slot;
    ``reserve=0`` with a separator, or ``reserve`` without one, raises.

    Each shard of the source is packed on its own by a :class:`StreamPacker` with a
    window of ``buffer_size`` samples, read as Arrow batches; the output has the
    source's shards, so ``datasets`` spreads them over DataLoader workers and
    (``split_dataset_by_node``) ranks, and each sample is packed exactly once.

    Differences from the offline ``pack_dataset``, because a stream is read once:
    ``shuffle`` shuffles the packs of each window (``seed``, the shard and the window
    index), not the whole dataset — chain ``.shuffle(buffer_size=...)`` for more;
    ``group_tokens`` raises (groups need the whole plan); the packs are planned window
    by window. Over-long samples follow ``overlong``; a shard's dropped and truncated
    tokens are logged (logger ``"fastpack"``) when it ends.

    Resuming (``state_dict()``/``load_state_dict()`` of the output) replays the shard
    from its start and skips the packs already yielded: the packs are the same for a
    deterministic source. To resume big streams cheaply, use
    :class:`fastpack.torch.PackedIterableDataset`, whose state holds the window.
    """
    import datasets

    if not isinstance(dataset, datasets.IterableDataset):
        raise FastpackTypeError(
            f"dataset: expected a datasets.IterableDataset, got {type(dataset).__name__}"
        )
    opts = with_separator(pack_iterable_dataset, options, max_len, kwargs, separator_id,
                          refuse=STREAM_REFUSES)
    if separator_id is not None:
        separator_id = _int_arg("separator_id", separator_id, minimum=-(2**63),
                                maximum=2**63 - 1)
    # Checks every other argument now, not in a worker later.
    StreamPacker(options=opts, buffer_size=buffer_size, threads=threads)
    if columns is not None:
        if isinstance(columns, str) or not isinstance(columns, Sequence):
            raise FastpackTypeError(f"columns: expected a list of column names, got "
                                    f"{type(columns).__name__}")
        columns = [str(c) for c in columns]
        if LENGTH_COLUMN not in columns:
            raise FastpackError(f"columns: {columns} lacks {LENGTH_COLUMN!r}, which gives "
                                "the lengths to pack")
        check_packable(columns, "pack_dataset")
    known = _list_columns(dataset.features, columns) if dataset.features is not None else None
    features = None
    if known is not None:
        import pyarrow as pa

        from ._gather import _output_type

        schema = datasets.Features({k: dataset.features[k] for k in known}).arrow_schema
        out = [pa.field(k, _output_type(schema.field(k).type)) for k in known]
        out += written_fields()
        features = datasets.Features.from_arrow_schema(pa.schema(out))
    source = dataset
    n_shards = max(source.num_shards, 1)
    generate = functools.partial(
        _packed_tables, source=source, num_shards=n_shards, options=opts,
        buffer_size=buffer_size, threads=threads, columns=columns, separator_id=separator_id,
    )
    from datasets.iterable_dataset import ArrowExamplesIterable

    ex_iterable = ArrowExamplesIterable(generate, {"shards": list(range(n_shards))})
    info = datasets.DatasetInfo(features=features)
    return datasets.IterableDataset(ex_iterable, info=info, split=dataset.split)


def _list_columns(features: Any, columns: Sequence[str] | None) -> list[str]:
    """The per-token columns to pack, from ``features`` (a dict of feature types)."""
    import datasets

    def numeric_list(feature: Any) -> bool:
        inner = getattr(feature, "feature", None)
        if not isinstance(feature, (datasets.List, datasets.LargeList, datasets.Sequence)):
            return False
        return isinstance(inner, datasets.Value) and (
            inner.dtype.startswith(("int", "uint", "float")) or inner.dtype == "bool"
        )

    if columns is None:
        chosen = [k for k, f in features.items() if numeric_list(f) and k not in WRITTEN]
        if LENGTH_COLUMN not in chosen:
            raise FastpackError(
                f"dataset: no {LENGTH_COLUMN!r} list column to pack (columns: "
                f"{', '.join(features)}); tokenize first"
            )
        return chosen
    for k in columns:
        if k not in features:
            raise FastpackError(f"columns: {k!r} not in the dataset; it has "
                                f"{', '.join(features)}")
        if not numeric_list(features[k]):
            raise FastpackError(f"columns: {k!r} is not a list of numbers (one per token); "
                                f"its type is {features[k]}")
    return list(columns)


def _packed_tables(
    shards: list[int], *, source: Any, num_shards: int, options: PackOptions,
    buffer_size: int, threads: int | None, columns: list[str] | None,
    separator_id: int | None,
) -> Iterator[tuple[str, Any]]:
    """The packed Arrow tables of source shards ``shards``, one table per pack (so a
    resumed iteration skips exactly the packs already yielded)."""
    for shard in shards:
        part = source.shard(num_shards=num_shards, index=shard) if num_shards > 1 else source
        packer = StreamPacker(options=options.replace(seed=_stream_seed(options.seed, shard)),
                              buffer_size=buffer_size, threads=threads)
        for i, table in enumerate(_pack_shard(part, packer, columns, separator_id)):
            yield f"{shard}_{i}", table
        _report(packer.stats, shard)


def _report(stats: StreamStats, shard: int) -> None:
    if stats.dropped_tokens or stats.truncated_tokens:
        logger.warning(
            "fastpack: shard %d: %d sequences dropped (%d tokens), %d truncated (%d tokens)",
            shard, stats.dropped_sequences, stats.dropped_tokens, stats.truncated_sequences,
            stats.truncated_tokens,
        )


def _pack_shard(part: Any, packer: StreamPacker, columns: list[str] | None,
                separator_id: int | None) -> Iterator[Any]:
    """One shard's packs, one single-row table each, in the order each window emits
    them; after a window's last pack, ``packer.current`` is that window."""
    import pyarrow as pa

    from ._gather import prepare

    batches = part.with_format("arrow").iter(batch_size=min(packer.buffer_size, 1000))
    pending: list[Any] = []  # tables read but not yet in a window
    pending_rows = 0
    origin = 0
    types: dict[str, Any] | None = None  # the packed columns' Arrow types (first window's)
    exhausted = False
    while True:
        room = packer.room
        while pending_rows < room and not exhausted:
            batch = next(batches, None)
            if batch is None:
                exhausted = True
            elif batch.num_rows:
                pending.append(batch)
                pending_rows += batch.num_rows
        take = min(room, pending_rows)
        table = pa.concat_tables(pending, promote_options="permissive") if pending else None
        if table is not None:
            rest = table.slice(take)
            table = table.slice(0, take)
            pending, pending_rows = ([rest], rest.num_rows) if rest.num_rows else ([], 0)
            if types is None:
                types = {k: table.schema.field(k).type for k in _table_columns(table, columns)}
        final = exhausted and pending_rows == 0
        if table is None or take == 0:
            if packer.current is None:
                return  # an empty shard
            new = {k: (v[:0], np.zeros(1, np.int64))
                   for k, (v, _) in packer.current.columns.items()}
        else:
            assert types is not None
            new = {k: _arrow_column(table.column(k), k, origin, t) for k, t in types.items()}
        rnd = packer.push(new, final=final,
                          origins=np.arange(origin, origin + take, dtype=np.int64))
        origin += take
        packs = rnd.take(rnd.remaining)
        if types is not None:  # even without packs: a separator that does not fit raises
            separators = None if separator_id is None else {LENGTH_COLUMN: separator_id}
            _, out = prepare(
                rnd.plan, rnd.handles(), list(types.values()), packs, separator_id=None,
                separator_values=separators, position_ids=True, batch_tokens=_BATCH_TOKENS,
                threads=packer.threads,
            )
            for record_batch in out:
                rows = pa.Table.from_batches([record_batch])
                for i in range(rows.num_rows):
                    yield rows.slice(i, 1)
        if final:
            return


#: Tokens per gathered record batch of a window (its packs are yielded one by one).
_BATCH_TOKENS = 1 << 22


def _table_columns(table: Any, columns: list[str] | None) -> list[str]:
    import datasets

    features = datasets.Features.from_arrow_schema(table.schema)
    return _list_columns(features, columns)


def _arrow_column(chunked: Any, name: str, origin: int, want: Any) -> Column:
    """A list column of an Arrow table (of type ``want``: the first window's) as
    ``(values, offsets)``; nulls, nested lists and values of another type raise,
    naming the column and the sample."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if chunked.type != want:
        try:
            chunked = chunked.cast(want)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            raise FastpackTypeError(
                f"{name}: samples {origin}.. of the stream are {chunked.type}; earlier ones "
                f"were {want}, and the values do not fit it"
            ) from None
    array = chunked.combine_chunks() if isinstance(chunked, pa.ChunkedArray) else chunked
    fixed = isinstance(array, pa.FixedSizeListArray)
    if not (fixed or isinstance(array, (pa.ListArray, pa.LargeListArray))):
        raise FastpackError(f"{name}: expected a list column (one value per token), got "
                            f"type {array.type}")
    if array.null_count:
        i = int(np.argmax(pc.is_null(array).to_numpy(zero_copy_only=False)))
        raise FastpackError(f"{name}: sample {origin + i} of the stream is null")
    child = array.values  # the whole child array: the offsets index into it
    if pa.types.is_nested(child.type):
        raise FastpackError(f"{name}: expected a flat list of numbers per sample, got nested "
                            f"type {array.type}")
    if fixed:
        size = array.type.list_size
        offsets = (np.arange(len(array) + 1, dtype=np.int64) + array.offset) * size
    else:
        offsets = array.offsets.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    if child.null_count:
        used = child.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
        if used.null_count:
            at = int(offsets[0]) + int(np.argmax(pc.is_null(used).to_numpy(zero_copy_only=False)))
            i = int(np.searchsorted(offsets, at, side="right")) - 1
            raise FastpackError(f"{name}: sample {origin + i} of the stream holds a null value")
    return child.to_numpy(zero_copy_only=False), offsets
