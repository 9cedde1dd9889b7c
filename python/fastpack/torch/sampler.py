"""The schedule: which step of one global plan each rank runs at each global step.

Every rank computes the same schedule from ``(plan, seed, epoch, ranks, accumulation)``,
so nothing is communicated. It guarantees: every rank gets the same number of non-empty
steps; every sample is used exactly once per epoch (a remainder that does not divide
evenly among the ranks is cut into smaller steps, or dropped and counted with
``drop_last``); the R steps that run at the same time carry nearly the same work; every
micro-step knows the target tokens of its whole optimizer step.

Cost model (``balance="flops"``): with ``cost=`` a :class:`fastpack.CostModel` (built from
the model's config), a step costs its training FLOPs, ``linear·Σl + quadratic·Σl²`` plus
its sliding windows' corrections (see :mod:`fastpack.cost`). Without it, ``hidden_size``
gives the older estimate: a step costs ``6·hidden_size·Σl + Σl²`` over its
sequences' lengths ``l`` (over a plan of trees, ``Σl`` counts each shared token once and
``Σl²`` becomes ``P² + Σ(Rᵢ² + 2·P·Rᵢ)`` for a prompt of ``P`` tokens with responses
``Rᵢ``, see :class:`~fastpack.torch.StepTable`). Per layer, the forward pass of a
transformer with hidden size ``h`` spends ``2·12h²`` FLOPs per token in its matrix products
(``4h²`` for the attention projections, ``8h²`` for an MLP of width ``4h``) and ``4·h·l``
per token in attention (``QKᵀ`` and ``AV`` over ``l`` positions); divided by ``4h`` this is
``6h·l + l²`` per sequence, and the backward pass scales both terms alike. See
docs/training.md for models of other shapes.

With a vision-language :class:`PackedDataset` (media), a step also pays its vision
encoder: per encoder layer ``6·w·p + p²`` for every frame of ``p`` patches (encoder width
``w``), scaled by ``(vision layers · w) / (text layers · hidden_size)`` into the same
units, so ranks that share a global step carry about the same images as well as tokens.
With a ``cost`` read from a vision-language config, each frame of ``p`` patches costs
``cost.image_flops(p)``; with a text-only ``cost``, ``12·w·(vision layers)`` FLOPs per unit
of that per-layer work.
"""

from __future__ import annotations

import hashlib
import heapq
import struct
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from .. import _core
from .._checks import _int_arg
from .._context_parallel import cp_rows
from .._errors import FastpackError, FastpackTypeError
from .._microbatch import MicroBatches, micro_batch_multiple_arg, split_steps
from ..cost import CostModel
from .data import PackedDataset, StepTable
from .step import Step

__all__ = ["BALANCES", "PackedSampler", "Schedule", "Step"]

#: Accepted values of ``balance``: the cost a global step's ranks are balanced by.
BALANCES = ("flops", "tokens", None)


@dataclass(frozen=True)
class Schedule:
    """One epoch of a :class:`PackedSampler`, for every rank.

    The epoch's micro-steps are listed once (``micro_*``, [M]): micro-step ``j`` reads
    segments ``micro_lo[j]:micro_hi[j]`` of dataset step ``micro_steps[j]`` (the whole
    step when ``micro_whole[j]``). ``layout`` [G, R] says which micro-step rank ``r`` runs
    at global step ``g``; the [G, R] views (``steps``, ``lo``, ``hi``, ``whole``,
    ``tokens``, ``cost`` = the sampler's cost model whatever ``balance`` is, and
    ``targets``) are gathered through it on access. ``num_items`` and ``num_sequences``
    [G] are the normalisers of the optimizer step each global step belongs to;
    ``dropped_*`` count what ``drop_last`` left out of this epoch.
    """

    epoch: int
    layout: np.ndarray
    micro_steps: np.ndarray
    micro_lo: np.ndarray
    micro_hi: np.ndarray
    micro_whole: np.ndarray
    micro_tokens: np.ndarray
    micro_cost: np.ndarray
    micro_targets: np.ndarray
    num_items: np.ndarray
    num_sequences: np.ndarray
    dropped_steps: int
    dropped_tokens: int
    dropped_sequences: int
    #: Context parallelism: each micro-step's attention work per CP rank ([M, cp]).
    micro_cp_work: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.layout)

    def cp_imbalance(self) -> np.ndarray:
        """[G, R]: the busiest CP rank's attention work over the mean, for the step every
        data-parallel rank runs at every global step (1.0: balanced; zigzag stays near 1,
        contiguous gives the last CP rank the long sequences' ends). All ones without
        context parallelism."""
        if self.micro_cp_work is None:
            return np.ones(self.layout.shape)
        work = self.micro_cp_work.astype(np.float64)
        mean = work.mean(axis=1)
        ratio = np.divide(work.max(axis=1), mean, out=np.ones_like(mean), where=mean > 0)
        return ratio[self.layout]

    @property
    def steps(self) -> np.ndarray:
        return self.micro_steps[self.layout]

    @property
    def lo(self) -> np.ndarray:
        return self.micro_lo[self.layout]

    @property
    def hi(self) -> np.ndarray:
        return self.micro_hi[self.layout]

    @property
    def whole(self) -> np.ndarray:
        return self.micro_whole[self.layout]

    @property
    def tokens(self) -> np.ndarray:
        return self.micro_tokens[self.layout]

    @property
    def cost(self) -> np.ndarray:
        return self.micro_cost[self.layout]

    @property
    def targets(self) -> np.ndarray:
        return self.micro_targets[self.layout]

    def imbalance(self, of: str = "cost") -> np.ndarray:
        """max/mean over ranks of ``cost`` or ``tokens`` at every global step ``[G]``."""
        values = self.cost if of == "cost" else self.tokens
        mean = values.mean(axis=1)
        return np.divide(values.max(axis=1), mean, out=np.ones_like(mean), where=mean > 0)


class PackedSampler(torch.utils.data.Sampler):  # type: ignore[type-arg]
    """A sampler of steps of a :class:`~fastpack.torch.PackedDataset` for data-parallel
    training: ``DataLoader(dataset, batch_size=None, sampler=PackedSampler(dataset))``.

    Args:
        dataset: the :class:`~fastpack.torch.PackedDataset` (every rank builds the same).
        num_replicas, rank: data-parallel world size and this process's rank (default:
            from ``torch.distributed`` when it is initialized, else 1 and 0). With a plan
            made for context parallelism (``cp_size``) they are the data-parallel ones of a
            dp × cp mesh: every CP rank of a data-parallel rank gets the same steps (the
            default: ``world_size // cp_size`` and ``rank // cp_size``, cp innermost), and
            ``balance="flops"`` weighs each step by its busiest CP rank's share.
        shuffle: a new order of the global steps every epoch, from ``(seed, epoch)``.
        seed: the seed of that order (the same on every rank).
        drop_last: drop the ``len(dataset) % num_replicas`` steps that do not divide
            evenly (counted in :meth:`schedule`), instead of cutting them into
            ``num_replicas`` smaller steps.
        balance: ``"flops"`` balances ``cost`` (or ``6·hidden_size·Σl + Σl²``) per global step (plus
            the vision encoder's cost with media: see the module docs),
            ``"tokens"`` balances Σl, ``None`` keeps the (shuffled) order.
        hidden_size: the ``h`` of the older cost estimate, used when ``cost`` is None (see
            the module docs, docs/training.md).
        cost: a :class:`fastpack.CostModel` (or a model config to build one from): the
            FLOPs ``balance="flops"`` balances; replaces ``hidden_size``.
        accumulation_steps: micro-steps per optimizer step; every micro-step carries the
            target tokens of its whole optimizer step (all ranks, all its micro-steps) as
            ``num_items_in_batch``. With a cap, global steps per optimizer step.
        micro_batch_tokens, micro_batch_cost: a hard cap on the tokens (cost, in the units
            of ``balance="flops"``) of one micro-batch: every global step's sequences are
            split over its ranks into micro-batches under the cap, the same number on
            every rank (see :mod:`fastpack._microbatch`), and the sampler yields those
            micro-batches. A sequence over the cap raises here (pack with ``max_len`` at
            most the cap: the plan's ``overlong`` policy counts what it cuts).
            :meth:`set_micro_batch_cap` moves the cap while training.
        micro_batch_multiple: with a cap, every rank's micro-batches per global step are a
            multiple of it (a pipeline's stages, which an interleaved schedule takes
            micro-batches by). ``pipeline_group``: its earlier name (deprecated).
        pipeline_order: with a cap, each rank runs its light micro-batches first and last.

    ``set_epoch(e)`` chooses the epoch; ``state_dict()`` / ``load_state_dict()`` save and
    restore the position, so a resumed run yields exactly the steps it would have, through
    any loader (see :meth:`state_dict` for a plain ``DataLoader`` with workers, which
    prefetches; torchdata's ``StatefulDataLoader`` saves the position itself). A state
    records a fingerprint of the dataset's plan: loading it over another plan raises. A
    state saved with other ``num_replicas`` or ``accumulation_steps`` at a global-step
    boundary loads too: the rest of the epoch is re-planned for this world size.
    """

    def __init__(
        self,
        dataset: PackedDataset,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        balance: str | None = "flops",
        hidden_size: int = 4096,
        accumulation_steps: int = 1,
        cost: Any = None,
        micro_batch_tokens: int | None = None,
        micro_batch_cost: float | None = None,
        micro_batch_multiple: int = 1,
        pipeline_order: bool = False,
        pipeline_group: int | None = None,
    ) -> None:
        if not isinstance(dataset, PackedDataset):
            raise FastpackTypeError(
                f"dataset: expected a fastpack.torch.PackedDataset, got {type(dataset).__name__}"
            )
        if num_replicas is None or rank is None:
            dist = torch.distributed
            initialized = dist.is_available() and dist.is_initialized()
            # A plan made for context parallelism: every cp_size consecutive processes
            # (cp inside dp, as accelerate's and torchtitan's meshes) share one step.
            cp = dataset.plan.cp_size or 1
            world = dist.get_world_size() if initialized else 1
            if initialized and world % cp:
                raise FastpackError(
                    f"cp_size: the plan was made for {cp} context-parallel ranks, which do "
                    f"not divide the world size {world}; pass num_replicas and rank (the "
                    f"data-parallel ones)"
                )
            if num_replicas is None:
                num_replicas = world // cp
            if rank is None:
                rank = (dist.get_rank() if initialized else 0) // cp
        self.num_replicas = _int_arg("num_replicas", num_replicas, minimum=1)
        self.rank = _int_arg(
            "rank", rank, minimum=0, maximum=self.num_replicas - 1,
            why=f" (num_replicas is {self.num_replicas})",
        )
        for name, flag in (("shuffle", shuffle), ("drop_last", drop_last),
                           ("pipeline_order", pipeline_order)):
            if not isinstance(flag, (bool, np.bool_)):
                raise FastpackTypeError(f"{name}: expected a bool, got {type(flag).__name__}")
        if balance not in BALANCES:
            raise FastpackError(
                f"balance: unknown value {balance!r}; expected one of "
                f"{', '.join(map(repr, BALANCES))}"
            )
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = _int_arg("seed", seed, minimum=0, maximum=2**64 - 1)
        self.drop_last = bool(drop_last)
        self.balance = balance
        self.hidden_size = _int_arg("hidden_size", hidden_size, minimum=1)
        self.cost = (CostModel.from_hidden_size(self.hidden_size) if cost is None
                     else CostModel.from_config(cost))
        self.cost_key = self.cost.key  # what a state records of the cost model
        self.accumulation_steps = _int_arg("accumulation_steps", accumulation_steps, minimum=1)
        packs = dataset.plan.num_packs
        if packs < self.num_replicas:
            raise FastpackError(
                f"num_replicas: {self.num_replicas} ranks but the dataset has only {packs} "
                f"pack(s); every rank needs at least one non-empty step: use fewer ranks, a "
                f"smaller max_len or more data"
            )
        if self.drop_last and len(dataset) < self.num_replicas:
            raise FastpackError(
                f"drop_last: the dataset has {len(dataset)} steps for {self.num_replicas} "
                "ranks, so every step would be dropped; pass drop_last=False to cut them "
                "into smaller steps"
            )
        self.micro_batch_multiple = micro_batch_multiple_arg(micro_batch_multiple,
                                                             pipeline_group)
        self.pipeline_order = bool(pipeline_order)
        #: The caps of this epoch: (first global step, tokens, cost) from that step on.
        self._caps: list[tuple[int, int | None, float | None]] = []
        if micro_batch_tokens is not None or micro_batch_cost is not None:
            if dataset.plan.parents is not None or dataset.plan.cp_size:
                raise FastpackError(
                    "micro_batch_tokens: micro-batches split a step's sequences, which a "
                    "plan of trees (share_prefix) or for context parallelism (cp_size) "
                    "does not allow; cap the step with group_tokens instead"
                )
            self._caps = [(0, *self._check_cap(micro_batch_tokens, micro_batch_cost))]
        #: Earlier world sizes of this epoch: (ranks, accumulation, global steps run).
        self._history: list[tuple[int, int, int]] = []
        self._micro_cache: dict[tuple[Any, ...], tuple[Any, np.ndarray, int]] = {}
        self.epoch = 0
        self._position = 0  # micro-steps of this epoch yielded so far
        self._start = 0  # where this epoch's pass began (or will begin)
        self._resume: int | None = None  # a loaded position the next pass starts at
        self._schedule: Schedule | None = None
        self._schedule_key: tuple[Any, ...] = ()
        self._warned = False

    # ------------------------------------------------------------------ epochs
    def __len__(self) -> int:
        if self._caps:
            return int(self._num_micro().sum())
        if self._history:
            return len(self.schedule())
        n, r = len(self.dataset), self.num_replicas
        return n // r if self.drop_last else -(-n // r)

    @property
    def micro_batching(self) -> bool:
        """Whether the sampler splits global steps into micro-batches under a cap."""
        return bool(self._caps)

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` from the next iteration on. A position restored by
        :meth:`load_state_dict` survives a ``set_epoch`` of the same epoch; another epoch
        starts at its first step."""
        epoch = _int_arg("epoch", epoch, minimum=0)
        if epoch != self.epoch:
            self._resume = None
            self._position = self._start = 0  # a checkpoint taken now starts the new epoch
            self._history = []  # a new epoch is planned whole for this world size
            if self._caps:  # the cap in force carries over (a controller moved it)
                self._caps = [(0, *self._caps[-1][1:])]
        self.epoch = epoch

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps per epoch: ``ceil(global steps / accumulation_steps)`` (the
        last one has fewer micro-steps when they do not divide evenly, on every rank
        alike; without a cap a rank's micro-steps are the global steps)."""
        steps = len(self.schedule()) if self._caps or self._history else len(self)
        return -(-steps // self.accumulation_steps)

    def __iter__(self) -> Iterator[Step]:
        return self._pass()

    def _pass(self) -> Iterator[Step]:
        if self._caps:
            return self._pass_micro()
        return self._pass_steps()

    def _pass_steps(self) -> Iterator[Step]:
        # A generator: nothing below runs until the first step is asked for. A loader may
        # call iter() more than once before it reads a step (torch's DataLoader with
        # workers does, in its iterator's __init__ and again in _reset; torchdata's on
        # restore), so only the iterator that runs spends a loaded position.
        schedule = self.schedule(self.epoch)
        start = self._resume if self._resume is not None else 0
        self._resume = None
        self._position = self._start = start
        column = schedule.layout[:, self.rank]
        steps, lo, hi, whole = (schedule.micro_steps[column], schedule.micro_lo[column],
                                schedule.micro_hi[column], schedule.micro_whole[column])
        items, sequences = schedule.num_items, schedule.num_sequences
        for g in range(start, len(schedule)):
            segments = None if whole[g] else (int(lo[g]), int(hi[g]))
            step = Step(int(steps[g]), segments, int(items[g]), int(sequences[g]))
            self._position = g + 1
            yield step

    def _pass_micro(self) -> Iterator[Step]:
        schedule = self.schedule(self.epoch)
        start = self._resume if self._resume is not None else 0
        self._resume = None
        self._position = self._start = start
        g, j = self._locate(start)
        items, sequences = schedule.num_items, schedule.num_sequences
        column = schedule.micro_steps[schedule.layout[:, self.rank]]
        span, last = self.accumulation_steps, len(schedule) - 1
        while g < len(schedule):
            # Looked up at every global step: a cap set meanwhile applies from its step.
            plan, segments, first = self._micro_at(g)
            local = g - first
            k = int(plan.num_micro[local])
            base = int(plan.step_offsets()[local]) + self.rank * k
            ends = g % span == span - 1 or g == last
            for m in range(j, k):
                b = base + m
                chosen = np.sort(segments[plan.order[plan.offsets[b] : plan.offsets[b + 1]]])
                self._position += 1
                yield Step(int(column[g]), chosen, int(items[g]), int(sequences[g]), m, k,
                           ends and m == k - 1)
            g, j = g + 1, 0

    # ------------------------------------------------------------------ micro-batches
    def _check_cap(self, tokens: Any, cost: Any) -> tuple[int | None, float | None]:
        """The cap ``(tokens, cost)``, checked against the plan's longest sequence."""
        if tokens is None and cost is None:
            raise FastpackError("micro_batch_tokens, micro_batch_cost: pass at least one cap")
        seqlens = self.dataset.plan.seqlens
        if tokens is not None:
            tokens = _int_arg("micro_batch_tokens", tokens, minimum=1)
            longest = int(seqlens.max(initial=0))
            if longest > tokens:
                raise FastpackError(
                    f"micro_batch_tokens: {tokens} is below the plan's longest sequence "
                    f"({longest} tokens), which no micro-batch could hold; pack with "
                    f"max_len <= {tokens} (overlong='split' or 'truncate' counts what it "
                    f"cuts) or raise the cap"
                )
        if cost is not None:
            if isinstance(cost, (bool, np.bool_)) or not isinstance(
                    cost, (int, float, np.integer, np.floating)) or not cost > 0:
                raise FastpackError(f"micro_batch_cost: got {cost!r}; expected a number > 0")
            cost = float(cost)
            top = float(_unit_costs(self, np.arange(len(seqlens))).max(initial=0.0))
            if top > cost:
                raise FastpackError(
                    f"micro_batch_cost: {cost:.6g} is below the costliest sequence's cost "
                    f"({top:.6g}); pack with a smaller max_len or raise the cap"
                )
        return tokens, cost

    def set_micro_batch_cap(self, tokens: int | None = None, cost: float | None = None, *,
                            step: int | None = None) -> int:
        """Move the cap (a :class:`fastpack.BudgetController`'s output) from optimizer step
        ``step`` of this epoch on (default: the first one the sampler has not begun) and
        re-plan the rest of the epoch's micro-batches under it: the same sequences in the
        same global steps, so every sample is still trained exactly once. Every rank must
        make the same call (the same cap, the same step). The change is part of
        :meth:`state_dict`, so a resumed run replays it. Returns the optimizer step it
        applies from."""
        if not self._caps:
            raise FastpackError("set_micro_batch_cap: the sampler was made without a cap "
                                "(micro_batch_tokens or micro_batch_cost)")
        cap = self._check_cap(tokens, cost)
        span = self.accumulation_steps
        g, j = self._locate(self._position)
        begun = g + 1 if j else g
        earliest = -(-begun // span)
        if step is None:
            step = earliest
        step = _int_arg("step", step, minimum=earliest,
                        why=f" (the sampler has begun optimizer step {earliest - 1})")
        at = step * span
        self._caps = [c for c in self._caps if c[0] < at] + [(at, *cap)]
        return step

    def micro_batches(self, epoch: int | None = None) -> list[tuple[int, Any, np.ndarray]]:
        """The micro-batches of ``epoch`` under the caps set so far, for every rank: a
        list of ``(first global step, MicroBatches, segments)``, one per cap in force;
        micro-batch ``b`` of a ``MicroBatches`` holds the plan's segments
        ``segments[order[offsets[b]:offsets[b+1]]]``, its steps counted from the first."""
        if epoch is not None and epoch != self.epoch:
            raise FastpackError(f"epoch: the caps are known for epoch {self.epoch} only")
        bounds = [c[0] for c in self._caps] + [len(self.schedule())]
        return [(g, *self._micro_at(g)[:2]) for g in bounds[:-1] if g < bounds[-1]]

    def _micro_at(self, g: int) -> tuple[Any, np.ndarray, int]:
        """The micro-batch plan of the cap in force at global step ``g``: the plan, its
        segments and the global step it starts at."""
        schedule = self.schedule()
        total = len(schedule)
        bounds = [c[0] for c in self._caps] + [total]
        i = int(np.searchsorted(bounds[:-1], g, side="right")) - 1
        first, tokens, cost = self._caps[i]
        end = min(bounds[i + 1], total)
        key = (self.epoch, len(self._history), first, tokens, cost)
        cached = self._micro_cache.get(key)
        if cached is None or cached[2] < end:
            plan, segments = _split(self, schedule, self.num_replicas, first, end, tokens, cost)
            cached = (plan, segments, end)
            self._micro_cache = {k: v for k, v in self._micro_cache.items()
                                 if k[:2] == key[:2]}
            self._micro_cache[key] = cached
        return cached[0], cached[1], first

    def _num_micro(self) -> np.ndarray:
        """Micro-batches per rank of every global step of the epoch, under the caps."""
        total = len(self.schedule())
        bounds = [c[0] for c in self._caps] + [total]
        parts = [self._micro_at(a)[0].num_micro[: max(min(b, total) - a, 0)]
                 for a, b in zip(bounds[:-1], bounds[1:]) if a < total]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def _locate(self, position: int) -> tuple[int, int]:
        """The global step and micro-batch inside it of a position (micro-batches)."""
        if not self._caps:
            return position, 0
        ends = np.cumsum(self._num_micro())
        g = int(np.searchsorted(ends, position, side="right"))
        return g, position - (int(ends[g - 1]) if g else 0)

    # ------------------------------------------------------------------ state
    _SETTINGS = ("seed", "num_replicas", "accumulation_steps", "balance", "hidden_size",
                 "cost_key", "shuffle", "drop_last", "micro_batch_multiple", "pipeline_order")
    #: Settings a state may differ in: the rest of the epoch is planned again for them.
    _RESIZABLE = ("num_replicas", "accumulation_steps")

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The position to resume from: the epoch, the micro-steps of it this rank has
        consumed, the settings the schedule depends on and a fingerprint of the dataset's
        plan (both checked on load). Plain ``int``/``str``/``bool`` values: it pickles and
        loads through ``torch.load(weights_only=True)``.

        By default the position is what the sampler has yielded, which is what the
        training loop consumed with ``num_workers=0`` and what torchdata's
        ``StatefulDataLoader`` records with any ``num_workers``. A plain ``DataLoader``
        with workers prefetches: the sampler runs up to ``prefetch_factor · num_workers``
        steps ahead of the loop, so pass ``consumed=k``, the batches the loop has taken
        from the loader in this epoch's pass (what ``enumerate(loader)`` counts; in a
        resumed run, those since the resume: the sampler adds the position it resumed
        from). ``k`` is at most what the sampler yielded in this pass."""
        position = self._position
        if consumed is not None:
            yielded = self._position - self._start
            position = self._start + _int_arg(
                "consumed", consumed, minimum=0, maximum=yielded,
                why=(f" (this epoch's pass began at step {self._start} and the sampler has "
                     f"yielded {yielded} step(s) of it: a loader cannot have consumed more)"),
            )
        return {
            "epoch": self.epoch,
            "position": position,
            **{key: getattr(self, key) for key in self._SETTINGS},
            "num_steps": len(self.dataset),
            "plan": dict(self.dataset.fingerprint),
            "caps": [[g, t, c] for g, t, c in self._caps],
            "history": [list(h) for h in self._history],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state`` (from :meth:`state_dict`): the next iteration starts at its
        position in its epoch. A state saved at the end of epoch ``e`` (every step
        consumed) loaded into a sampler already set to a later epoch (``set_epoch`` before
        the load, as with ``StatefulDataLoader``, which loads when iterated) starts that
        epoch from its first step. Raises when the state was saved with other settings or
        over another plan."""
        if not isinstance(state, dict):
            raise FastpackTypeError(f"state: expected a dict, got {type(state).__name__}")
        if "pipeline_group" in state and "micro_batch_multiple" not in state:
            # Saved before the setting's rename: the same number under its earlier name.
            state = {**state, "micro_batch_multiple": state["pipeline_group"]}
        missing = [k for k in ("epoch", "position", "plan") if k not in state]
        if missing:
            raise FastpackError(f"state: missing {', '.join(missing)}; expected a state from "
                                "PackedSampler.state_dict()")
        resized = any(key in state and state[key] != getattr(self, key)
                      for key in self._RESIZABLE)
        for key in (*self._SETTINGS, "num_steps"):
            mine = len(self.dataset) if key == "num_steps" else getattr(self, key)
            if key in self._RESIZABLE and resized:
                continue
            if key in state and state[key] != mine:
                raise FastpackError(
                    f"state: saved with {key}={state[key]!r}, but this sampler has "
                    f"{key}={mine!r}; the schedule would differ, so the position "
                    "does not carry over"
                )
        _check_plan(state["plan"], self.dataset.fingerprint)
        epoch = _int_arg("state['epoch']", state["epoch"], minimum=0)
        history = [tuple(_int_arg("state['history']", v, minimum=0) for v in h)
                   for h in state.get("history", [])]
        caps = [(int(g), None if t is None else int(t), None if c is None else float(c))
                for g, t, c in state.get("caps", [])]
        mine = (self.epoch, self._history, self._caps, self._micro_cache)
        try:
            self.epoch, self._history = epoch, [(r, a, p) for r, a, p in history]
            if resized:
                # Where the saved world size stopped: re-plan what it had not run for this one.
                ranks = _int_arg("state['num_replicas']", state["num_replicas"], minimum=1)
                accumulation = _int_arg("state['accumulation_steps']",
                                        state["accumulation_steps"], minimum=1)
                saved = _build(self, epoch, self._history, ranks, accumulation)
                g = _int_arg("state['position']", state["position"], minimum=0)
                if caps:  # the position counts micro-batches: find its global step
                    plan_ranks = ranks
                    k = np.concatenate([
                        _split(self, saved, plan_ranks, a, min(b, len(saved)), t, c)[0].num_micro
                        for (a, t, c), b in zip(caps, [c[0] for c in caps[1:]] + [len(saved)])
                        if a < len(saved)] or [np.zeros(0, dtype=np.int64)])
                    ends = np.concatenate(([0], np.cumsum(k)))
                    at = int(np.searchsorted(ends, g))
                    if at > len(k) or ends[at] != g:
                        raise FastpackError(
                            f"state: saved inside global step {int(np.searchsorted(ends, g)) - 1} "
                            f"(micro-batch position {g}) with {ranks} ranks; another world size "
                            "resumes only at a global-step boundary (save at optimizer steps)"
                        )
                    g = at
                if g > len(saved):
                    raise FastpackError(f"state['position']: {g} is past the {len(saved)} global "
                                        "steps of the saved schedule")
                self._history.append((ranks, accumulation, g))
                position = 0
                if self._caps or caps:
                    last = caps[-1][1:] if caps else self._caps[-1][1:]
                    self._caps = [(0, *last)] if self._caps else []
            else:
                if self._caps and caps:
                    self._caps = caps
                position = _int_arg("state['position']", state["position"], minimum=0)
            self._micro_cache = {}
            if position > len(self):
                raise FastpackError(f"state['position']: got {position}; expected an integer in "
                                    f"0..={len(self)} (this epoch's micro-steps)")
        except FastpackError:
            # A state that does not load leaves the sampler as it was.
            self.epoch, self._history, self._caps, self._micro_cache = mine
            raise
        if not resized and position == len(self) and mine[0] > epoch:
            self.epoch, self._history, self._caps, self._micro_cache = mine
            return  # epoch `epoch` is done and this sampler is already past it
        self._resume = self._position = self._start = position

    # ------------------------------------------------------------------ schedule
    def schedule(self, epoch: int | None = None) -> Schedule:
        """The schedule of ``epoch`` (default: the current one) for every rank."""
        epoch = self.epoch if epoch is None else _int_arg("epoch", epoch, minimum=0)
        key = (epoch, tuple(self._history) if epoch == self.epoch else ())
        if self._schedule is None or self._schedule_key != key:
            self._schedule_key = key
            self._schedule = _build(self, epoch, self._history if epoch == self.epoch else [],
                                    self.num_replicas, self.accumulation_steps)
            if self._schedule.dropped_steps and not self._warned:
                self._warned = True
                s = self._schedule
                warnings.warn(
                    f"PackedSampler(drop_last=True) drops {s.dropped_steps} step(s) per "
                    f"epoch ({s.dropped_tokens} tokens, {s.dropped_sequences} sequences with "
                    f"targets in epoch {epoch}); see sampler.schedule()",
                    stacklevel=3,
                )
        return self._schedule


# What each digest of PackedDataset.fingerprint covers, for the error that names it.
_PLAN_PARTS = {
    "num_steps": "steps", "num_packs": "packs", "num_segments": "segments",
    "num_sequences": "input sequences",
    "steps": "which packs each step holds (group_tokens, packs_per_batch, or the pack "
             "order: seed, shuffle)",
    "sample_ids": "which samples the packs hold (the seed, shuffle, strategy or data "
                  "lengths)",
    "segments": "the segments' offsets and lengths (max_len, overlong, reserve or data "
                "lengths)",
    "trees": "the trees: which segments continue which, and which samples they train "
             "(share_prefix, the groups or the data's tokens)",
}


def _check_plan(saved: Any, mine: dict[str, Any]) -> None:
    if not isinstance(saved, dict):
        raise FastpackTypeError(
            f"state['plan']: expected a dict (PackedDataset.fingerprint), got "
            f"{type(saved).__name__}"
        )
    differ = [k for k in mine if saved.get(k) != mine[k]]
    if differ:
        what = "; ".join(
            f"{_PLAN_PARTS[k]}: {saved.get(k)!r} saved, {mine[k]!r} here" if k.startswith("num_")
            else _PLAN_PARTS[k] for k in differ
        )
        raise FastpackError(
            f"state['plan']: saved over another plan than this dataset's; differs in {what}. "
            "Its position would replay some samples and skip others: resume over the "
            "dataset the state was saved with (same data, collator options, seed, "
            "group_tokens or packs_per_batch)"
        )


def _seed(seed: int, epoch: int, stream: int) -> int:
    """A 64-bit seed for one random stream of one epoch: the same on every rank and
    platform."""
    digest = hashlib.blake2b(struct.pack("<QQQ", seed, epoch, stream), digest_size=8)
    return int.from_bytes(digest.digest(), "little")


def _segment_cost(sampler: PackedSampler, table: StepTable, lo: int, hi: int) -> np.ndarray:
    seqlens = sampler.dataset.plan.seqlens[lo:hi]
    lengths = seqlens.astype(np.float64)
    if sampler.balance == "flops":
        return sampler.cost.polynomial(lengths, _squared(table, lo, hi, seqlens))
    return lengths


def _squared(table: StepTable, lo: int, hi: int, seqlens: np.ndarray) -> np.ndarray:
    """Attention's term of the cost of segments ``lo:hi`` (of lengths ``seqlens``): ``l²``, or in a
    plan of trees ``l² + 2·a·l`` (``a`` tokens on the path before the segment)."""
    if table.segment_squared is not None:
        return np.asarray(table.segment_squared[lo:hi], dtype=np.int64)
    lengths = np.asarray(seqlens, dtype=np.int64)
    return lengths * lengths


def _units(table: StepTable, steps: np.ndarray) -> np.ndarray:
    """How many pieces each step can be cut into at most: its segments, or in a plan of
    trees its trees (a tree is never cut)."""
    seg = table.segment_offsets
    return _capacity(table, seg[steps], seg[steps + 1])


def _capacity(table: StepTable, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """How many pieces segments ``lo[i]:hi[i]`` can be cut into at most."""
    if table.cuts is None:
        return hi - lo
    return np.searchsorted(table.cuts, hi) - np.searchsorted(table.cuts, lo)


def _cut_points(table: StepTable, lo: int, hi: int) -> np.ndarray:
    """Where segments ``lo:hi`` may be cut, both ends included."""
    if table.cuts is None:
        return np.arange(lo, hi + 1, dtype=np.int64)
    a, b = np.searchsorted(table.cuts, (lo, hi))
    return np.append(table.cuts[a:b], hi).astype(np.int64)


def _cost(sampler: PackedSampler, tokens: np.ndarray, squared: np.ndarray,
          cp: tuple[np.ndarray, np.ndarray] | None = None,
          vision: np.ndarray | float = 0.0) -> np.ndarray:
    if sampler.balance == "flops":
        return _flops(sampler, tokens, squared, cp) + vision
    return (tokens if cp is None else cp[0]).astype(np.float64)


def _flops(sampler: PackedSampler, tokens: np.ndarray, squared: np.ndarray,
           cp: tuple[np.ndarray, np.ndarray] | None) -> np.ndarray:
    """The cost model of the module docs; under context parallelism, that of the step's
    slowest CP rank: its share of the padded row plus its attention pairs, ×2 (Σl² counts
    each sequence's causal pairs twice)."""
    cost = sampler.cost
    if cp is None:
        return cost.polynomial(tokens, squared)
    padded, work = cp
    ranks = work.shape[1]
    return (cost.linear * padded / ranks
            + 2.0 * cost.quadratic * work.max(axis=1, initial=0).astype(np.float64))


def _vision(sampler: PackedSampler, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The cost of segments ``lo:hi`` beyond ``linear·Σl + quadratic·Σl²``: the sliding
    windows' corrections of a :class:`~fastpack.CostModel` (segment by segment), and the
    vision encoder's cost. In ``hidden_size`` units (a text layer's FLOPs over
    ``4·hidden_size``) that is its per-layer work times ``vision layers · vision width /
    (text layers · hidden_size)``; zeros without media."""
    table = sampler.dataset.steps
    cost = sampler.cost
    out = np.zeros(len(lo), dtype=np.float64)
    if cost.windows and table.segment_squared is None:
        cumulative = _window_cumulative(sampler)
        out += cumulative[hi] - cumulative[lo]
    vlm = sampler.dataset.collator.vlm
    if table.segment_vision is None or vlm is None:
        return out
    if (cost.vision_linear or cost.vision_quadratic) and table.segment_patches is not None:
        patches = np.concatenate(([[0.0, 0.0]], np.cumsum(table.segment_patches, axis=0)))
        terms = patches[hi] - patches[lo]
        return out + cost.vision_linear * terms[:, 0] + cost.vision_quadratic * terms[:, 1]
    if cost.name.startswith("hidden_size="):
        ratio = (vlm.vision_layers * vlm.vision_hidden_size) / (
            max(vlm.text_layers, 1) * sampler.hidden_size)
    else:  # FLOPs: per layer 4·w FLOPs per unit of 6·w·p + p², ×3 for training
        ratio = 12.0 * vlm.vision_hidden_size * vlm.vision_layers
    return out + ratio * table.vision_between(lo, hi)


def _window_cumulative(sampler: PackedSampler) -> np.ndarray:
    """Cumulative window corrections over the plan's segments (computed once)."""
    cached = getattr(sampler, "_windows", None)
    if cached is None:
        seqlens = sampler.dataset.plan.seqlens
        cached = np.concatenate(([0.0], np.cumsum(sampler.cost.window_flops(seqlens))))
        sampler._windows = cached  # type: ignore[attr-defined]
    return cached


def _build(sampler: PackedSampler, epoch: int, history: list[tuple[int, int, int]],
           ranks: int, accumulation: int) -> Schedule:
    """The schedule of ``epoch`` for ``ranks``: planned whole, or after the earlier world
    sizes of ``history`` (each ran its schedule's first global steps), over what they left:
    each later schedule takes the micro-steps its predecessor had not run, in order."""
    if not history:
        return _schedule(sampler, epoch, ranks, accumulation)
    schedule = _schedule(sampler, epoch, *history[0][:2])
    dropped = np.zeros(3, dtype=np.int64)
    sizes = [h[:2] for h in history[1:]] + [(ranks, accumulation)]
    for salt, ((_, _, ran), size) in enumerate(zip(history, sizes), start=1):
        dropped += (schedule.dropped_steps, schedule.dropped_tokens, schedule.dropped_sequences)
        rest = schedule.layout[min(ran, len(schedule)):].ravel()
        units = (schedule.micro_steps[rest], schedule.micro_lo[rest], schedule.micro_hi[rest])
        schedule = _schedule(sampler, epoch, *size, units=units, salt=salt)
    return replace(schedule, dropped_steps=schedule.dropped_steps + int(dropped[0]),
                   dropped_tokens=schedule.dropped_tokens + int(dropped[1]),
                   dropped_sequences=schedule.dropped_sequences + int(dropped[2]))


def _range_sums(sampler: PackedSampler, table: StepTable, lo: np.ndarray, hi: np.ndarray
                ) -> tuple[np.ndarray, ...]:
    """Tokens, attention's term, targets and sequences of segments ``lo[i]:hi[i]``."""
    seqlens = np.asarray(sampler.dataset.plan.seqlens, dtype=np.int64)
    squared = (seqlens * seqlens if table.segment_squared is None
               else np.asarray(table.segment_squared, dtype=np.int64))
    sequences = (table.segment_targets > 0 if table.segment_sequences is None
                 else table.segment_sequences)
    out = []
    for values in (seqlens, squared, table.segment_targets, sequences):
        running = np.concatenate(([0], np.cumsum(values, dtype=np.int64)))
        out.append(running[hi] - running[lo])
    return tuple(out)


def _range_cp(sampler: PackedSampler, lo: np.ndarray, hi: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
    """The CP rows of segments ``lo[i]:hi[i]``, each sharded on its own."""
    plan = sampler.dataset.plan
    counts = hi - lo
    flat = np.repeat(lo - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
    offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    return cp_rows(plan, plan.seqlens[flat], offsets)


def _empty(epoch: int, ranks: int) -> Schedule:
    none = np.zeros(0, dtype=np.int64)
    return Schedule(epoch=epoch, layout=none.reshape(0, ranks), micro_steps=none, micro_lo=none,
                    micro_hi=none, micro_whole=none.astype(bool), micro_tokens=none,
                    micro_cost=none.astype(np.float64), micro_targets=none, num_items=none,
                    num_sequences=none, dropped_steps=0, dropped_tokens=0,
                    dropped_sequences=0)


def _schedule(sampler: PackedSampler, epoch: int, ranks: int, k: int,
              units: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
              salt: int = 0) -> Schedule:
    """One epoch's schedule over the dataset's steps, or over ``units`` (step, segments
    ``lo:hi``) that an earlier world size left, with seeds of their own (``salt``)."""
    table = sampler.dataset.steps
    seg = table.segment_offsets
    if units is None:
        u_index = np.arange(len(table))
        u_lo, u_hi = seg[:-1], seg[1:]
    else:
        u_index, u_lo, u_hi = units
        if not len(u_index):
            return _empty(epoch, ranks)
    n = len(u_index)
    order = (_core.permutation(n, _seed(sampler.seed, epoch, 16 * salt)).astype(np.int64)
             if sampler.shuffle else np.arange(n))
    remainder = n % ranks
    removed = np.zeros(0, dtype=np.int64)
    dropped = removed
    pieces: tuple[np.ndarray, ...] | None = None
    if units is None:
        capacity = _units(table, u_index)
    else:
        sums = _range_sums(sampler, table, u_lo, u_hi)
        capacity = _capacity(table, u_lo, u_hi)
        u_cp = None
        if table.cp_work is not None and table.padded_tokens is not None:
            u_cp = _range_cp(sampler, u_lo, u_hi)
    if remainder and sampler.drop_last:
        order, dropped = order[: n - remainder], order[n - remainder :]
        removed = dropped
    elif remainder:
        order, removed = _pool(capacity, order, ranks, remainder, table.cuts is not None)
        if units is None:
            cp_pool = None
            if table.cp_work is not None and table.padded_tokens is not None:
                cp_pool = (table.padded_tokens[removed], table.cp_work[removed])
            pool_cost = _cost(sampler, table.tokens[removed], table.squared_tokens[removed],
                              cp_pool, _vision(sampler, seg[removed], seg[removed + 1]))
        else:
            cp_pool = None if u_cp is None else (u_cp[0][removed], u_cp[1][removed])
            pool_cost = _cost(sampler, sums[0][removed], sums[1][removed], cp_pool,
                              _vision(sampler, u_lo[removed], u_hi[removed]))
        pieces = _cut(sampler, table, u_index[removed], u_lo[removed], u_hi[removed],
                      pool_cost, ranks)

    # Micro-steps: the kept whole steps in dataset order (read sequentially), then the
    # pieces; only the final layout gathers at random.
    keep = np.ones(n, dtype=bool)
    keep[removed] = False
    index = u_index[keep]
    lo, hi = u_lo[keep], u_hi[keep]
    cp = None
    if units is None:
        tokens, squared = table.tokens[keep], table.squared_tokens[keep]
        targets, sequences = table.targets[keep], table.sequences[keep]
        if table.cp_work is not None and table.padded_tokens is not None:
            cp = (table.padded_tokens[keep], table.cp_work[keep])
        dropped_tokens = int(table.tokens[dropped].sum())
        dropped_sequences = int(table.sequences[dropped].sum())
    else:
        tokens, squared, targets, sequences = (v[keep] for v in sums)
        if u_cp is not None:
            cp = (u_cp[0][keep], u_cp[1][keep])
        dropped_tokens = int(sums[0][dropped].sum())
        dropped_sequences = int(sums[3][dropped].sum())
    whole = (lo == seg[index]) & (hi == seg[index + 1])
    if pieces is not None:
        p_index, p_lo, p_hi, p_tokens, p_squared, p_targets, p_sequences = pieces
        index = np.concatenate((index, p_index))
        lo, hi = np.concatenate((lo, p_lo)), np.concatenate((hi, p_hi))
        tokens = np.concatenate((tokens, p_tokens))
        squared = np.concatenate((squared, p_squared))
        targets = np.concatenate((targets, p_targets))
        sequences = np.concatenate((sequences, p_sequences))
        whole = np.concatenate((whole, (p_lo == seg[p_index]) & (p_hi == seg[p_index + 1])))
        if cp is not None:  # the pieces' rows, each sharded on its own
            plan = sampler.dataset.plan
            rows = [plan.seqlens[a:b] for a, b in zip(p_lo.tolist(), p_hi.tolist())]
            offsets = np.concatenate(([0], np.cumsum([len(r) for r in rows])))
            p_padded, p_work = cp_rows(plan, np.concatenate(rows), offsets)
            cp = (np.concatenate((cp[0], p_padded)), np.concatenate((cp[1], p_work)))
    micro = len(index)
    assert micro % ranks == 0
    g = micro // ranks
    vision = _vision(sampler, lo, hi)

    if sampler.balance is None:
        # The epoch's (shuffled) order as it is: whole steps, then the pieces.
        position = np.cumsum(keep) - 1
        layout = np.concatenate((position[order], np.arange(keep.sum(), micro)))
        layout = layout.reshape(g, ranks)
    else:
        # Steps of similar cost run together: sort by cost (ties broken at random, so the
        # company a step keeps changes every epoch), cut into global steps of R, then
        # shuffle the global steps. Both in Rust: millions of steps per epoch.
        cost = _cost(sampler, tokens, squared, cp, vision)
        layout = _core.by_cost(cost, _seed(sampler.seed, epoch, 16 * salt + 1)).astype(np.int64)
        layout = layout.reshape(g, ranks)
        if sampler.shuffle:
            layout = layout[_core.permutation(g, _seed(sampler.seed, epoch, 16 * salt + 2))]
        else:
            layout = layout[np.argsort(layout.min(axis=1), kind="stable")]
        # Alternate which rank gets the heavier end, so no rank is always the slowest.
        layout[1::2] = layout[1::2, ::-1]

    starts = np.arange(0, g, k)
    per_opt_items = np.add.reduceat(targets[layout].sum(axis=1), starts) if g else starts
    per_opt_sequences = np.add.reduceat(sequences[layout].sum(axis=1), starts) if g else starts
    repeats = np.diff(np.append(starts, g))
    return Schedule(
        epoch=epoch,
        layout=layout,
        micro_steps=index,
        micro_lo=lo,
        micro_hi=hi,
        micro_whole=whole,
        micro_tokens=tokens,
        micro_cost=_flops(sampler, tokens, squared, cp) + vision,
        micro_cp_work=None if cp is None else cp[1],
        micro_targets=targets,
        num_items=np.repeat(per_opt_items, repeats).astype(np.int64),
        num_sequences=np.repeat(per_opt_sequences, repeats).astype(np.int64),
        dropped_steps=len(dropped),
        dropped_tokens=dropped_tokens,
        dropped_sequences=dropped_sequences,
    )


def _pool(
    capacity: np.ndarray, order: np.ndarray, ranks: int, remainder: int, trees: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Split the epoch's ``order`` into whole steps and the pool cut into smaller ones:
    the last ``remainder`` steps, plus as few whole global steps (R steps each) as give
    the pool enough segments for ``R·(x+1)`` non-empty pieces (``capacity``: the pieces
    each step can be cut into)."""
    n = len(order)
    last = order[n - remainder :]
    if int(capacity[last].sum()) >= ranks:  # the usual case: enough to cut
        return order[: n - remainder], last
    segments = capacity[order[::-1]]
    available = np.cumsum(segments)
    extra = np.arange((n - remainder) // ranks + 1)
    sizes = remainder + ranks * extra
    feasible = np.flatnonzero(available[sizes - 1] >= ranks * (extra + 1))
    if not len(feasible):
        raise FastpackError(
            f"num_replicas: {n} steps do not divide among {ranks} ranks and hold only "
            f"{int(available[-1])} {'trees' if trees else 'sequences'}, too few "
            f"to cut the remainder into "
            f"{ranks} non-empty steps per global step; pass drop_last=True (drops "
            f"{remainder} step(s), counted) or use fewer ranks"
        )
    size = int(sizes[feasible[0]])
    return order[: n - size], order[n - size :]


def _cut(
    sampler: PackedSampler, table: StepTable, pool: np.ndarray, pool_lo: np.ndarray,
    pool_hi: np.ndarray, cost: np.ndarray, ranks: int
) -> tuple[np.ndarray, ...]:
    """Cut the pool's units (segments ``pool_lo:pool_hi`` of steps ``pool``, of ``cost``)
    into a multiple of R pieces, each a contiguous run of whole packs (or of segments when
    a unit has fewer packs than pieces) inside one unit; pieces per unit in proportion to
    its cost, cut points at its cost quantiles."""
    plan = sampler.dataset.plan
    parts_total = -(-len(pool) // ranks) * ranks
    pack_offsets = np.asarray(plan.pack_offsets, dtype=np.int64)
    capacity = _capacity(table, pool_lo, pool_hi)
    parts = np.ones(len(pool), dtype=np.int64)
    heap = [(-float(c), i) for i, c in enumerate(cost) if capacity[i] > 1]
    heapq.heapify(heap)
    for _ in range(parts_total - len(pool)):
        _, i = heapq.heappop(heap)
        parts[i] += 1
        if parts[i] < capacity[i]:
            heapq.heappush(heap, (-float(cost[i]) / float(parts[i]), i))

    out: list[list[int]] = [[], [], []]
    seqlens = plan.seqlens
    for step, lo, hi, c in zip(pool.tolist(), pool_lo.tolist(), pool_hi.tolist(),
                               parts.tolist()):
        if c == 1:
            cuts = [lo, hi]
        else:
            a, b = np.searchsorted(pack_offsets, (lo, hi), side="right")
            bounds = np.concatenate(([lo], pack_offsets[a : b - 1], [hi]))
            if len(bounds) - 1 < c:
                bounds = _cut_points(table, lo, hi)
            per = _segment_cost(sampler, table, lo, hi)
            if sampler.balance == "flops":
                per = per + _vision(sampler, np.arange(lo, hi), np.arange(lo + 1, hi + 1))
            running = np.concatenate(([0.0], np.cumsum(per)))
            at = running[bounds - lo]
            cuts = [lo]
            u = 0
            units = len(bounds) - 1
            for j in range(1, c):
                target = at[-1] * j / c
                v = int(np.searchsorted(at, target))
                if v > 0 and target - at[v - 1] <= at[min(v, units)] - target:
                    v -= 1
                v = min(max(v, u + 1), units - (c - j))
                cuts.append(int(bounds[v]))
                u = v
            cuts.append(hi)
        for a, b in zip(cuts[:-1], cuts[1:]):
            out[0].append(step)
            out[1].append(a)
            out[2].append(b)
    index, lo_arr, hi_arr = (np.asarray(v, dtype=np.int64) for v in out)
    # A handful of pieces (fewer than 2R): sums over their own segments only.
    terms = np.zeros((4, len(index)), dtype=np.int64)
    for j, (a, b) in enumerate(zip(lo_arr.tolist(), hi_arr.tolist())):
        lengths = seqlens[a:b].astype(np.int64)
        piece_targets = table.segment_targets[a:b]
        sequences = (np.count_nonzero(piece_targets) if table.segment_sequences is None
                     else int(table.segment_sequences[a:b].sum(dtype=np.int64)))
        terms[:, j] = (lengths.sum(), _squared(table, a, b, lengths).sum(),
                       piece_targets.sum(dtype=np.int64), sequences)
    return (index, lo_arr, hi_arr, *terms)


def _unit_costs(sampler: PackedSampler, segments: np.ndarray) -> np.ndarray:
    """The cost of each of ``segments`` that micro-batches balance and cap: with
    ``balance="flops"`` the sampler's cost model (``linear·l + quadratic·l²``, its sliding
    windows' corrections and the vision encoder's cost), else the tokens."""
    seqlens = np.asarray(sampler.dataset.plan.seqlens)[segments].astype(np.float64)
    if sampler.balance != "flops":
        return seqlens
    return sampler.cost.polynomial(seqlens, seqlens * seqlens) + _vision(
        sampler, segments, segments + 1)


def _split(sampler: PackedSampler, schedule: Schedule, ranks: int, first: int, end: int,
           tokens: int | None, cost: float | None) -> tuple[MicroBatches, np.ndarray]:
    """Micro-batches of global steps ``first:end`` of ``schedule`` under a cap: every
    global step's segments (all its ranks' micro-steps) over ``ranks`` ranks. Returns the
    plan (its steps counted from ``first``) and the segments it indexes."""
    ids = schedule.layout[first:end].ravel()
    lo, hi = schedule.micro_lo[ids], schedule.micro_hi[ids]
    counts = hi - lo
    segments = np.repeat(lo - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
    steps = np.repeat(np.arange(end - first).repeat(schedule.layout.shape[1]), counts)
    seqlens = np.asarray(sampler.dataset.plan.seqlens, dtype=np.int64)[segments]
    plan = split_steps(steps, seqlens, _unit_costs(sampler, segments), steps=end - first,
                       ranks=ranks, token_cap=tokens, cost_cap=cost,
                       micro_batch_multiple=sampler.micro_batch_multiple,
                       pipeline_order=sampler.pipeline_order)
    return plan, segments
