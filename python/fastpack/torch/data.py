"""The data layer: a whole dataset packed once (one global plan), served as ready steps."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .. import _core
from .._errors import FastpackError, FastpackTypeError
from .._materialize import Ragged, TokenData, as_ragged
from .._plan import Plan, _int_arg
from .._targets import segment_targets
from .collator import PackedCollator

if TYPE_CHECKING:
    from .sampler import Step

__all__ = ["PackedDataset", "StepTable", "first_item"]


def first_item(items: Sequence[Any]) -> Any:
    """``data_collator`` for a :class:`PackedDataset` under the Hugging Face ``Trainer``
    (with ``per_device_train_batch_size=1``): each item already is a whole batch."""
    if len(items) != 1:
        raise FastpackError(
            f"first_item: got {len(items)} items; a PackedDataset item is a whole batch, "
            "so use batch size 1"
        )
    return items[0]


@dataclass(frozen=True)
class StepTable:
    """Per-step arrays of a :class:`PackedDataset`: what a sampler balances, and the
    normaliser of every step, known before any batch is built.

    Step ``i`` holds packs ``pack_offsets[i]:pack_offsets[i+1]`` of the plan, that is
    segments ``segment_offsets[i]:segment_offsets[i+1]`` (a segment is a sequence, or a
    piece of a split one). ``tokens`` (Σ l) and ``squared_tokens`` (Σ l²) sum over the
    step's segments, reserved separator slots included: the linear layers' work grows with
    the first, attention's with the second. ``targets`` are the labels other than -100 the
    step's batch will hold (loss masks, ``labels``, separators and split pieces included);
    ``sequences`` the segments with at least one target. All int64 [N].
    ``segment_targets`` (uint32 [S]) is the same count per segment, for steps cut smaller.
    """

    pack_offsets: np.ndarray
    segment_offsets: np.ndarray
    tokens: np.ndarray
    squared_tokens: np.ndarray
    targets: np.ndarray
    sequences: np.ndarray
    segment_targets: np.ndarray

    def __len__(self) -> int:
        return len(self.tokens)


class PackedDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A whole dataset packed once; item ``i`` is step ``i``: a ready batch (formatted by
    ``collator``) of one group of the plan (``group_tokens``) or of ``packs_per_batch``
    packs.

    Pack the full dataset instead of each batch and padding all but disappears:
    best-fit decreasing over every length reaches within a pack or two of the lower
    bound. Packs (or groups) are shuffled (``seed``) so steps do not come sorted by length.

    >>> ds = PackedDataset(tokens, PackedCollator(max_len=4096, backend="flash"),
    ...                    group_tokens=65536)
    >>> loader = DataLoader(ds, batch_size=None, sampler=PackedSampler(ds))

    With the Hugging Face ``Trainer``: ``train_dataset=ds``,
    ``data_collator=fastpack.torch.first_item``, ``per_device_train_batch_size=1``.

    Args:
        tokens: token data (see :func:`fastpack.as_ragged`; a ``datasets.Dataset`` is read
            from its Arrow buffers, column ``"input_ids"``).
        collator: the :class:`PackedCollator` whose ``max_len``, backend and options to use.
        labels, loss_mask: optional per-token labels / 0/1 mask (column names with a
            ``datasets.Dataset``).
        packs_per_batch: a step is this many packs (rows), in plan order (default 1
            without ``group_tokens``).
        group_tokens: a step is one group of the two-level plan: packs of ``max_len``
            bin-packed under this token budget, so every step carries nearly the same
            tokens (see :func:`fastpack.pack`). At least ``long_max_len`` (or ``max_len``).
        long_max_len: a second bucket for sequences over ``max_len``, packed into packs of
            this cap (never mixed with short ones in a pack or a group).
        plan: a precomputed plan over ``tokens`` (default: packed here); its groups are
            the steps unless ``packs_per_batch`` is given.
        shuffle, seed: shuffle the packs (groups) of the plan, once.

    An item is an ``int`` (step ``i``) or a :class:`fastpack.torch.sampler.Step` from a
    :class:`~fastpack.torch.PackedSampler`, which may name a smaller piece of a step and
    adds the 0-d int64 ``num_items_in_batch`` (target tokens of the whole optimizer step:
    every rank, every accumulation micro-step) and ``num_sequences_in_batch``. Building a
    step reads only that step's data.
    """

    def __init__(
        self,
        tokens: TokenData,
        collator: PackedCollator,
        *,
        labels: TokenData | str | None = None,
        loss_mask: TokenData | str | None = None,
        packs_per_batch: int | None = None,
        group_tokens: int | None = None,
        long_max_len: int | None = None,
        plan: Plan | None = None,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        if not isinstance(collator, PackedCollator):
            raise FastpackTypeError(
                f"collator: expected a PackedCollator, got {type(collator).__name__}"
            )
        dataset = tokens if _is_dataset(tokens) else None
        self.tokens: Ragged = as_ragged(tokens)
        self.labels = _resolve(labels, dataset, mask=False)
        self.loss_mask = _resolve(loss_mask, dataset, mask=True)
        self.collator = collator
        if packs_per_batch is not None and group_tokens is not None:
            raise FastpackError(
                "packs_per_batch, group_tokens: pass one: a fixed number of packs per step, "
                "or a token budget per step"
            )
        if plan is None:
            plan = collator.plan(
                self.tokens.lengths, shuffle=shuffle, seed=seed, long_max_len=long_max_len,
                group_tokens=group_tokens,
            )
        elif not isinstance(plan, Plan):
            raise FastpackTypeError(f"plan: expected a fastpack.Plan, got {type(plan).__name__}")
        else:
            for name, value, have in (("group_tokens", group_tokens, plan.group_tokens),
                                      ("long_max_len", long_max_len, plan.long_max_len)):
                if value is not None and value != have:
                    raise FastpackError(
                        f"{name}: got {value}, but the given plan was made with {have}; "
                        f"pass {name} to fastpack.pack() when planning"
                    )
        if plan.num_sequences != len(self.tokens):
            raise FastpackError(
                f"plan: made from {plan.num_sequences} lengths, but the token data has "
                f"{len(self.tokens)} sequences"
            )
        self.plan = plan
        if packs_per_batch is None and plan.group_offsets is not None:
            self.packs_per_batch: int | None = None
            offsets = np.asarray(plan.group_offsets, dtype=np.int64)
        else:
            self.packs_per_batch = _int_arg(
                "packs_per_batch", 1 if packs_per_batch is None else packs_per_batch, minimum=1
            )
            offsets = np.append(
                np.arange(0, plan.num_packs, self.packs_per_batch, dtype=np.int64),
                np.int64(plan.num_packs),
            )
            if plan.num_packs == 0:
                offsets = offsets[:1]
        offsets.flags.writeable = False
        #: Step ``i`` holds packs ``step_pack_offsets[i]:step_pack_offsets[i+1]`` (int64).
        self.step_pack_offsets = offsets

    def __len__(self) -> int:
        return len(self.step_pack_offsets) - 1

    @cached_property
    def steps(self) -> StepTable:
        """The per-step arrays (computed once, on first use: one parallel pass in Rust over
        the labels or token ids and the loss mask)."""
        per_segment = segment_targets(
            self.plan, self.tokens, labels=self.labels, loss_mask=self.loss_mask,
            separator_id=self.collator.separator_id,
            train_separators=self.collator.train_separators, threads=self.collator.threads,
        )
        return step_table(self.plan, self.step_pack_offsets, per_segment)

    def __getitem__(self, index: int | Step) -> dict[str, Any]:
        from .sampler import Step

        n = len(self)
        step = index if isinstance(index, Step) else None
        i = step.index if step is not None else index
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
            raise FastpackTypeError(
                f"index: expected an int or a fastpack.torch.sampler.Step, got "
                f"{type(index).__name__}"
            )
        if not -n <= i < n:
            raise IndexError(f"step {i} out of range; the dataset has {n} steps")
        i = int(i) % n
        p0, p1 = int(self.step_pack_offsets[i]), int(self.step_pack_offsets[i + 1])
        pack_offsets = self.plan.pack_offsets
        lo, hi = int(pack_offsets[p0]), int(pack_offsets[p1])
        if step is not None and step.segments is not None:
            cut_lo, cut_hi = (int(v) for v in step.segments)
            if not lo <= cut_lo < cut_hi <= hi:
                raise FastpackError(
                    f"step.segments: {step.segments} is not a non-empty range inside step "
                    f"{i} (segments {lo}..{hi})"
                )
            lo, hi = cut_lo, cut_hi
        batch = self.collator.batch(
            _sub_plan(self.plan, p0, p1, lo, hi), self.tokens, None,
            labels=self.labels, loss_mask=self.loss_mask,
        )
        if step is not None:
            for key in ("num_items_in_batch", "num_sequences_in_batch"):
                value = int(getattr(step, key))
                batch[key] = (torch.tensor(value, dtype=torch.int64)
                              if self.collator.return_tensors == "pt"
                              else np.array(value, dtype=np.int64))
        return batch

    def __iter__(self) -> Iterable[dict[str, Any]]:
        return (self[i] for i in range(len(self)))


def step_table(plan: Plan, step_pack_offsets: np.ndarray, per_segment: np.ndarray) -> StepTable:
    """The :class:`StepTable` of steps ``step_pack_offsets`` (CSR over the plan's packs)
    given the targets of every segment (from :func:`fastpack._targets.segment_targets`)."""
    segments = np.asarray(plan.pack_offsets, dtype=np.int64)[step_pack_offsets]
    per_segment = np.ascontiguousarray(per_segment, dtype=np.uint32)
    tokens, squared, targets, sequences = _core.step_sums(plan.seqlens, per_segment, segments)
    table = StepTable(
        pack_offsets=step_pack_offsets, segment_offsets=segments, tokens=tokens,
        squared_tokens=squared, targets=targets, sequences=sequences,
        segment_targets=per_segment,
    )
    for array in (table.segment_offsets, table.tokens, table.squared_tokens,
                  table.targets, table.sequences, table.segment_targets):
        array.flags.writeable = False
    return table


def _sub_plan(plan: Plan, p0: int, p1: int, lo: int, hi: int) -> Plan:
    """Segments ``lo:hi`` of packs ``p0:p1`` as a plan of their own (views, plus the pack
    bounds inside): materializing it reads and checks only these segments."""
    bounds = plan.pack_offsets[p0 : p1 + 1]
    inner = bounds[(bounds > lo) & (bounds < hi)]
    fields = {name: getattr(plan, name) for name in Plan._FIELDS}
    fields.update(
        sample_ids=plan.sample_ids[lo:hi], starts=plan.starts[lo:hi],
        seqlens=plan.seqlens[lo:hi],
        pack_offsets=np.concatenate(([lo], inner, [hi])).astype(np.int64) - lo,
    )
    return Plan(fields)

def _is_dataset(obj: Any) -> bool:
    return type(obj).__module__.startswith("datasets") and hasattr(obj, "column_names")


def _resolve(data: Any, dataset: Any, *, mask: bool) -> Ragged | None:
    if data is None:
        return None
    if isinstance(data, str):
        if dataset is None:
            raise FastpackTypeError("labels/loss_mask: a column name needs a datasets.Dataset")
        return as_ragged(dataset, column=data, mask=mask)
    return as_ragged(data, mask=mask)


