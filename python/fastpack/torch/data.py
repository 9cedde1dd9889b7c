"""The data layer: a whole dataset packed once (one global plan), served as ready steps."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .. import _core
from .._checks import _int_arg
from .._context_parallel import cp_rows
from .._errors import FastpackError, FastpackTypeError
from .._materialize import IGNORE_INDEX, Ragged, TokenData, _is_dataset, as_ragged
from .._options import PackArgs, PackOptions, WithOptions, check_plan, layered
from .._plan import Plan, select_plan, sub_plan
from .._targets import segment_targets
from .._tree import pack_trees, path_targets, prompt_codes, renamed
from ..vlm import vision_cost_of, vision_terms
from .collator import PackedCollator, as_collator, prompt_key
from .step import Step

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["PackedDataset", "StepTable", "first_item"]

logger = logging.getLogger("fastpack")


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
    step's batch will hold (loss masks, ``labels``, separators and split pieces included;
    a vision-language step's image and video placeholders not); ``sequences`` the
    segments with at least one target. All int64 [N].
    ``segment_targets`` (uint32 [S]) is the same count per segment, for steps cut smaller.

    A plan made for context parallelism (``cp_size``) adds, for the step's row sharded
    as :func:`~fastpack.torch.shard_for_context_parallel` shards it, ``padded_tokens``
    (int64 [N]) and ``cp_work`` (int64 [N, cp]): the (query, key) pairs each CP rank's
    attention computes (:attr:`fastpack.CPLayout.work`); ``None`` otherwise.

    A plan of trees (``share_prefix=True``) counts by its samples (its paths): a sample's
    targets and its sequence are counted at its last segment (``segment_targets``,
    ``segment_sequences``), and ``squared_tokens`` is attention's term of the cost (``Σl²``
    over sequences), a segment of ``l`` tokens after a path of ``a`` counting ``l² + 2·a·l``
    (``segment_squared``): a tree of a
    prompt of ``P`` tokens and responses ``Rᵢ`` costs ``P² + Σ(Rᵢ² + 2·P·Rᵢ)``. A step
    of it is cut only at ``cuts`` (its trees' first segments), never inside a tree.
    """

    pack_offsets: np.ndarray
    segment_offsets: np.ndarray
    tokens: np.ndarray
    squared_tokens: np.ndarray
    targets: np.ndarray
    sequences: np.ndarray
    segment_targets: np.ndarray
    padded_tokens: np.ndarray | None = None
    cp_work: np.ndarray | None = None
    #: Each segment's vision encoder cost (float64 [S]; see
    #: :func:`fastpack.torch.media.vision_cost`), or None without media.
    segment_vision: np.ndarray | None = None
    segment_squared: np.ndarray | None = None
    #: Each segment's ``Σ t·p`` and ``Σ t·p²`` over its frames (float64 [S, 2]; see
    #: :func:`fastpack.vlm.vision_terms`), or None without media.
    segment_patches: np.ndarray | None = None
    segment_sequences: np.ndarray | None = None
    cuts: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def vision(self) -> np.ndarray:
        """Each step's vision encoder cost (float64 [N]; zeros without media)."""
        return self.vision_between(self.segment_offsets[:-1], self.segment_offsets[1:])

    @cached_property
    def _vision_cumulative(self) -> np.ndarray | None:
        if self.segment_vision is None:
            return None
        return np.concatenate(([0.0], np.cumsum(self.segment_vision)))

    def vision_between(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """The vision cost of segments ``lo[i]:hi[i]`` for every ``i`` (float64)."""
        cumulative = self._vision_cumulative
        if cumulative is None:
            return np.zeros(len(lo), dtype=np.float64)
        return cumulative[hi] - cumulative[lo]


class PackedDataset(torch.utils.data.Dataset, WithOptions):  # type: ignore[type-arg]
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
        media: with a vision-language collator (``model_config``), each sample's media
            keys, indexed like ``tokens``: the samples, or a ``datasets.Dataset`` with the
            media columns (default: ``tokens`` itself when it is a Dataset). The collator's
            ``limits`` are counted from it, each step's batch takes its samples' media,
            and :class:`PackedSampler` balances the vision encoder's cost per step.
        plan: a precomputed plan over ``tokens`` (default: packed here); its groups are
            the steps unless ``packs_per_batch`` is given. It must have been made with the
            options given here and the collator's ``max_len``, ``reserve`` and
            ``share_prefix`` (``plan.options`` is compared).
        options, **kwargs: the options of the whole plan (:class:`fastpack.PackOptions`):
            ``group_tokens`` (a step is one group of the two-level plan: packs bin-packed
            under this token budget, so every step carries nearly the same tokens; at
            least ``long_max_len``, or ``max_len``), ``long_max_len`` (a second bucket for
            sequences over ``max_len``, never mixed with short ones in a pack or a group),
            ``shuffle`` and ``seed`` (shuffle the packs, or groups, of the plan, once). The
            per-batch options are the collator's: given here, they must equal them.
        prompt_ids: with a collator made with ``share_prefix=True``: one value per sample,
            the id of the prompt it continues (or, with a ``datasets.Dataset``, a column
            name); samples of one prompt share their longest common prefix. Default: the
            dataset's ``prompt_id`` column when it has one (``group``, its earlier name,
            with a ``DeprecationWarning``), else a trie over all samples. The plan is then
            :func:`fastpack.pack_trees`'s: a tree is never cut across steps or ranks.
        groups: ``prompt_ids``' earlier name (deprecated: a group is packs under
            ``group_tokens``).

    Context parallelism: a collator with ``cp_size`` (and ``cp_mode``, ``pad_multiple``)
    plans every pack to fit ``max_len`` once padded for the CP group; every CP rank of a
    data-parallel rank gets the same step and shards it
    (:func:`~fastpack.torch.shard_for_context_parallel`), and a :class:`PackedSampler`
    balances each step's busiest CP rank.

    An item is an ``int`` (step ``i``) or a :class:`fastpack.torch.Step` from a
    :class:`~fastpack.torch.PackedSampler`, which may name a smaller piece of a step and
    adds the 0-d int64 ``num_items_in_batch`` (target tokens of the whole optimizer step:
    every rank, every accumulation micro-step) and ``num_sequences_in_batch``. Building a
    step reads only that step's data; :meth:`samples` says which samples it holds without
    building it. A plan in which every sample was dropped gives 0 steps and a warning
    (logger ``"fastpack"``).
    """

    def __init__(
        self,
        tokens: TokenData,
        collator: PackedCollator,
        *,
        labels: TokenData | str | None = None,
        loss_mask: TokenData | str | None = None,
        packs_per_batch: int | None = None,
        plan: Plan | None = None,
        media: Any = None,
        options: PackOptions | None = None,
        prompt_ids: Any = None,
        groups: Any = None,
        **kwargs: Unpack[PackArgs],
    ) -> None:
        as_collator(collator)
        dataset: Any = tokens if _is_dataset(tokens) else None
        if collator.vlm is not None and media is None:
            if dataset is None:
                raise FastpackError(
                    "media: the collator has a model_config; pass each sample's media "
                    "(media=the samples, or a datasets.Dataset with their media columns)"
                )
            media = dataset  # its rows carry the media columns
        #: Each sample's media (with a vision-language collator), indexed like ``tokens``.
        self.media = media
        self.tokens: Ragged = as_ragged(tokens)
        self.labels = _resolve(labels, dataset, mask=False)
        self.loss_mask = _resolve(loss_mask, dataset, mask=True)
        self.collator = collator
        #: The packing options: the collator's per-batch ones and the plan options given.
        self.options, stated = layered(PackedDataset, collator.options, options, kwargs)
        if packs_per_batch is not None and self.options.group_tokens is not None:
            raise FastpackError(
                "packs_per_batch, group_tokens: pass one: a fixed number of packs per step, "
                "or a token budget per step"
            )
        prompt_ids = renamed("prompt_ids", "groups", prompt_ids, groups)
        if prompt_ids is not None and not self.options.share_prefix:
            raise FastpackError(
                "prompt_ids: apply with a collator made with share_prefix=True (they say "
                "which samples share a prefix)"
            )
        if plan is None and self.options.share_prefix:
            plan = pack_trees(self.tokens,
                              prompt_ids=_prompt_ids(prompt_ids, dataset, len(self.tokens)),
                              options=self.options, threads=collator.threads)
        elif plan is None:
            plan = collator._plan(self.tokens.lengths, self.options, media)
        elif not isinstance(plan, Plan):
            raise FastpackTypeError(f"plan: expected a fastpack.Plan, got {type(plan).__name__}")
        else:
            # What building the batches reads from the plan, and what the caller stated.
            check_plan(plan.options, self.options,
                       {"max_len", "reserve", "share_prefix"} | stated)
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
        if len(self) == 0:
            logger.warning(
                "PackedDataset: 0 steps: none of the %d samples is in the plan (%d empty, "
                "%d dropped by overlong=%r); a sampler or loader over it yields nothing",
                plan.num_sequences, plan.empty_sequences, plan.dropped_sequences,
                plan.overlong,
            )

    def __len__(self) -> int:
        return len(self.step_pack_offsets) - 1

    @cached_property
    def steps(self) -> StepTable:
        """The per-step arrays (computed once, on first use: one parallel pass in Rust over
        the labels or token ids and the loss mask)."""
        if self.plan.parents is not None:
            per_path = path_targets(self.plan, self.tokens, labels=self.labels,
                                    loss_mask=self.loss_mask, threads=self.collator.threads)
            return tree_step_table(self.plan, self.step_pack_offsets, per_path)
        vlm = self.collator.vlm
        # A vision-language batch's placeholders get label -100 (the collator's media
        # path): never targets, so never in a step's normaliser.
        placeholders = () if vlm is None else tuple(
            t for t in (vlm.image_token_id, vlm.video_token_id) if t is not None)
        per_segment = segment_targets(
            self.plan, self.tokens, labels=self.labels, loss_mask=self.loss_mask,
            separator_id=self.collator.separator_id,
            train_separators=self.collator.train_separators, threads=self.collator.threads,
            ignore_tokens=placeholders,
        )
        vision = patches = None
        if vlm is not None and vlm.mrope and self.media is not None:
            terms = vision_terms(self.media)[np.asarray(self.plan.sample_ids)]
            vision = vision_cost_of(terms, vlm.vision_hidden_size)
            patches = terms
        return step_table(self.plan, self.step_pack_offsets, per_segment, vision, patches)

    @cached_property
    def fingerprint(self) -> dict[str, Any]:
        """What identifies this dataset's steps, as :class:`PackedSampler` states record
        it: the counts, and a digest of each plan array the steps are read from (``steps``:
        the steps' pack bounds and the packs' segment bounds; ``sample_ids``; ``segments``:
        each segment's ``starts`` and ``seqlens``). Two datasets with equal fingerprints
        hold the same sample pieces in the same steps. Computed once, hashing the arrays'
        buffers (no per-sample Python objects: about 0.3 s at 10^7 segments)."""
        plan = self.plan

        def digest(*arrays: np.ndarray) -> str:
            h = hashlib.sha1(usedforsecurity=False)
            for array in arrays:
                array = np.ascontiguousarray(array)
                # The dtype is part of the digest: equal values in another width differ.
                h.update(array.dtype.str.encode())
                h.update(array.view(np.uint8).data)
            return h.hexdigest()[:16]

        fingerprint = {
            "num_steps": len(self), "num_packs": plan.num_packs,
            "num_segments": plan.num_segments, "num_sequences": plan.num_sequences,
            "steps": digest(self.step_pack_offsets, plan.pack_offsets),
            "sample_ids": digest(plan.sample_ids),
            "segments": digest(plan.starts, plan.seqlens),
        }
        if plan.parents is not None:
            assert plan.path_sample_ids is not None and plan.path_ends is not None
            fingerprint["trees"] = digest(plan.parents, plan.path_sample_ids, plan.path_ends)
        return fingerprint

    def _segments(self, index: int | Step) -> tuple[int, int, int, int]:
        """The packs ``p0:p1`` and segments ``lo:hi`` of step (or sampler ``Step``)
        ``index``."""
        n = len(self)
        step = index if isinstance(index, Step) else None
        i = step.index if step is not None else index
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
            raise FastpackTypeError(
                f"index: expected an int or a fastpack.torch.Step, got {type(index).__name__}"
            )
        if not -n <= i < n:
            raise IndexError(f"step {i} out of range; the dataset has {n} steps")
        i = int(i) % n
        p0, p1 = int(self.step_pack_offsets[i]), int(self.step_pack_offsets[i + 1])
        pack_offsets = self.plan.pack_offsets
        lo, hi = int(pack_offsets[p0]), int(pack_offsets[p1])
        if step is not None and isinstance(step.segments, np.ndarray):
            return p0, p1, -1, -1  # a selection: see _selection
        if step is not None and step.segments is not None:
            cut_lo, cut_hi = (int(v) for v in step.segments)
            if not lo <= cut_lo < cut_hi <= hi:
                raise FastpackError(
                    f"step.segments: {step.segments} is not a non-empty range inside step "
                    f"{i} (segments {lo}..{hi})"
                )
            lo, hi = cut_lo, cut_hi
        return p0, p1, lo, hi

    def samples(self, index: int | Step) -> np.ndarray:
        """The sample ids (indices into ``tokens``, int64, read-only) that step ``index``
        holds, one per segment in the order of the batch's sequences: a sample split into
        pieces appears once per piece it has in the step. In a plan of trees, the samples
        whose paths end in the step, ascending (the batch's ``sample_ids``). ``index`` is an
        ``int`` or a :class:`~fastpack.torch.Step` from a :class:`PackedSampler` (then only
        the piece of the step it names). Reads the plan only, builds no batch: log it, or
        check that a resumed run sees every sample once."""
        _, _, lo, hi = self._segments(index)
        plan = self.plan
        selection = _selection(index, plan.num_segments)
        if selection is not None:
            return plan.sample_ids[selection]
        if plan.path_ends is not None and plan.path_sample_ids is not None:
            a, b = np.searchsorted(plan.path_ends, (lo, hi))
            ids = np.sort(plan.path_sample_ids[a:b])
            ids.flags.writeable = False
            return ids
        return plan.sample_ids[lo:hi]

    def __getitem__(self, index: int | Step) -> dict[str, Any]:
        step = index if isinstance(index, Step) else None
        p0, p1, lo, hi = self._segments(index)
        selection = _selection(index, self.plan.num_segments)
        filler = selection is not None and not len(selection)
        if filler:
            # An empty micro-batch (a step with fewer sequences than R·k): the rank still
            # runs a forward and backward pass, so that every rank makes the same
            # collective calls, over the shortest sequence of its dataset step with no
            # targets (its loss and gradient are zero; num_items_in_batch is unchanged).
            a, b = int(self.plan.pack_offsets[p0]), int(self.plan.pack_offsets[p1])
            selection = np.asarray([a + int(np.argmin(self.plan.seqlens[a:b]))])
        part = (sub_plan(self.plan, p0, p1, lo, hi) if selection is None
                else select_plan(self.plan, selection))
        batch = self.collator.batch(
            part, self.tokens, None,
            labels=self.labels, loss_mask=self.loss_mask, media=self.media,
        )
        if filler:
            batch["labels"] = _no_targets(batch["labels"])
        if step is not None:
            for key in ("num_items_in_batch", "num_sequences_in_batch"):
                value = int(getattr(step, key))
                batch[key] = (torch.tensor(value, dtype=torch.int64)
                              if self.collator.return_tensors == "pt"
                              else np.array(value, dtype=np.int64))
            if selection is not None:
                # Micro-batches vary in number per step: the loop needs to know when the
                # optimizer step ends (pop this key before calling the model).
                batch["ends_optimizer_step"] = bool(step.last)
        return batch

    def __iter__(self) -> Iterable[dict[str, Any]]:
        return (self[i] for i in range(len(self)))


def _no_targets(labels: Any) -> Any:
    """``labels`` with every position ignored (-100), a tensor or an array alike."""
    out = labels.clone() if isinstance(labels, torch.Tensor) else np.array(labels)
    out[...] = IGNORE_INDEX
    return out


def _selection(index: int | Step, count: int) -> np.ndarray | None:
    """The segments a micro-batch ``Step`` names (checked), or None for a step or a range."""
    if not isinstance(index, Step) or not isinstance(index.segments, np.ndarray):
        return None
    segments = index.segments
    if (segments.ndim != 1 or segments.dtype.kind not in "iu"
            or (len(segments) and (segments[0] < 0 or segments[-1] >= count))
            or (len(segments) > 1 and np.any(np.diff(segments) <= 0))):
        raise FastpackError(
            f"step.segments: expected an ascending int array of the plan's segments "
            f"(0..{count - 1}), got {segments.dtype} {segments[:8]}"
        )
    return segments


def step_table(plan: Plan, step_pack_offsets: np.ndarray, per_segment: np.ndarray,
               segment_vision: np.ndarray | None = None,
               segment_patches: np.ndarray | None = None) -> StepTable:
    """The :class:`StepTable` of steps ``step_pack_offsets`` (CSR over the plan's packs)
    given the targets of every segment (from :func:`fastpack._targets.segment_targets`)
    and, with media, each segment's vision cost."""
    segments = np.asarray(plan.pack_offsets, dtype=np.int64)[step_pack_offsets]
    per_segment = np.ascontiguousarray(per_segment, dtype=np.uint32)
    tokens, squared, targets, sequences = _core.step_sums(plan.seqlens, per_segment, segments)
    padded = work = None
    if plan.cp_size is not None:
        padded, work = cp_rows(plan, plan.seqlens, segments)
    table = StepTable(
        pack_offsets=step_pack_offsets, segment_offsets=segments, tokens=tokens,
        squared_tokens=squared, targets=targets, sequences=sequences,
        segment_targets=per_segment, padded_tokens=padded, cp_work=work,
        segment_vision=segment_vision, segment_patches=segment_patches,
    )
    for array in (table.segment_offsets, table.tokens, table.squared_tokens,
                  table.targets, table.sequences, table.segment_targets, padded, work):
        if array is not None:
            array.flags.writeable = False
    return table


def tree_step_table(plan: Plan, step_pack_offsets: np.ndarray, per_path: np.ndarray
                    ) -> StepTable:
    """The :class:`StepTable` of a plan of trees, given the targets of every path (from
    :func:`fastpack._tree.path_targets`): each sample counted at its last segment."""
    assert plan.parents is not None and plan.path_ends is not None
    count = plan.num_segments
    ends = np.asarray(plan.path_ends, dtype=np.int64)
    per_path = np.asarray(per_path, dtype=np.int64)
    per_segment = np.bincount(ends, weights=per_path, minlength=count).astype(np.uint32)
    sequences = np.bincount(ends[per_path > 0], minlength=count).astype(np.uint32)
    seqlens = np.asarray(plan.seqlens, dtype=np.int64)
    squared = seqlens * seqlens + 2 * np.asarray(plan.starts, dtype=np.int64) * seqlens
    segments = np.asarray(plan.pack_offsets, dtype=np.int64)[step_pack_offsets]

    def sums(values: np.ndarray) -> np.ndarray:
        cumulative = np.concatenate(([0], np.cumsum(values, dtype=np.int64)))
        return np.diff(cumulative[segments])

    cuts = np.append(np.flatnonzero(np.asarray(plan.parents) < 0), count).astype(np.int64)
    table = StepTable(
        pack_offsets=step_pack_offsets, segment_offsets=segments, tokens=sums(seqlens),
        squared_tokens=sums(squared), targets=sums(per_segment), sequences=sums(sequences),
        segment_targets=per_segment, segment_squared=squared, segment_sequences=sequences,
        cuts=cuts,
    )
    for array in (table.segment_offsets, table.tokens, table.squared_tokens, table.targets,
                  table.sequences, table.segment_targets, squared, sequences, cuts):
        array.flags.writeable = False
    return table


def _prompt_ids(values: Any, dataset: Any, count: int) -> np.ndarray | None:
    """The prompt codes of a dataset's samples: ``values`` (ids, or a column name of
    ``dataset``), by default its ``prompt_id`` column if it has one, else None (a trie)."""
    column = values if isinstance(values, str) else None
    if values is None and dataset is not None:
        column = prompt_key(list(dataset.column_names), stacklevel=4)
    if column is not None:
        if dataset is None or column not in dataset.column_names:
            raise FastpackError(
                f"prompt_ids: {column!r} names a column, which needs a datasets.Dataset with "
                f"it as tokens"
            )
        values = dataset[column]
    return None if values is None else prompt_codes(values, count)


def _resolve(data: Any, dataset: Any, *, mask: bool) -> Ragged | None:
    if data is None:
        return None
    if isinstance(data, str):
        if dataset is None:
            raise FastpackTypeError("labels/loss_mask: a column name needs a datasets.Dataset")
        return as_ragged(dataset, column=data, mask=mask)
    return as_ragged(data, mask=mask)


