"""Micro-batches under a hard cap: the sequences of a global step split over ``R`` ranks
into ``k`` micro-batches each, every micro-batch under a token cap and/or a cost cap.

The planner (numpy only, no torch) is what :class:`~fastpack.torch.PackedSampler` runs
inside every global step, and :func:`plan_micro_batches` is the same planner over plain
lengths (an RL rollout batch, a benchmark). Its guarantees, per global step:

- no micro-batch holds more than the token cap or costs more than the cost cap (a
  sequence over a cap raises, or with ``overlong="drop"`` is left out and counted);
- every rank gets the same number ``k`` of micro-batches, a multiple of
  ``micro_batch_multiple`` (a pipeline's stages, for an interleaved schedule); a
  micro-batch is empty only in a step with fewer sequences than ``R·k`` (a few long
  ones): each sequence then has a micro-batch to itself and the rest stay empty, so that
  every rank still runs ``k`` (the sampler turns an empty one into a filler batch with
  no targets, see :class:`~fastpack.torch.PackedDataset`);
- the ranks and the micro-batches carry nearly the same cost (longest-processing-time
  first, twice: a step's sequences in decreasing cost each to the lightest rank, then a
  rank's each into its lightest micro-batch that stays under the caps; a step where a rank
  would have fewer sequences than micro-batches is planned over all its ``R·k``
  micro-batches at once);
- with ``pipeline_order``, each rank's micro-batches run light ones first and last, heavy
  ones in the middle (the pipeline's warm-up and cool-down expose the first and the last).

``k`` starts at the lower bound ``ceil(Σ tokens / (R·cap))`` (and the cost's) and grows
by ``micro_batch_multiple`` until the greedy placement fits every sequence under the caps: the
bound alone is not enough (8 sequences of 7 tokens under a cap of 8 need 8 micro-batches,
not ``ceil(56/8) = 7``). The whole run is planned at once, vectorised over its global
steps: one pass per rank of a sequence inside its step.

Also here: :class:`MemoryModel` (bytes per token from a model config, calibrated from one
measured step, turned into a token cap) and :class:`BudgetController` (the seeds' rule
``new = current × (1 + α × (target − signal))`` that moves a cap while training).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from . import _core
from ._checks import _int_arg
from ._errors import FastpackError, FastpackTypeError
from .cost import _get, _Moe

__all__ = ["BudgetController", "MemoryModel", "MicroBatches", "plan_micro_batches",
           "sequence_cost"]

#: The linear coefficient of the default cost ``a·l + l²``: ``6·hidden_size`` for a
#: hidden size of 4096 (see :mod:`fastpack.torch.sampler`; verl uses the same constant).
DEFAULT_LINEAR = 6 * 4096


def micro_batch_multiple_arg(value: int, old: int | None, stacklevel: int = 3) -> int:
    """``micro_batch_multiple``, or ``pipeline_group``, its earlier name (*group* now means
    only packs under ``group_tokens``), with a ``DeprecationWarning``; both given raises."""
    if old is not None:
        if value != 1:
            raise FastpackError("micro_batch_multiple, pipeline_group: pass one of them "
                                "(pipeline_group is micro_batch_multiple's earlier name)")
        warnings.warn("pipeline_group is deprecated: pass micro_batch_multiple (the same "
                      "number)", DeprecationWarning, stacklevel=stacklevel)
        value = old
    return _int_arg("micro_batch_multiple", value, minimum=1)


def sequence_cost(lengths: np.ndarray, cost: Any = None) -> np.ndarray:
    """The cost of each sequence of ``lengths`` (float64): ``cost.sequence_flops(lengths)``
    for a cost model (:class:`fastpack.CostModel` or any object with that method), ``a·l +
    l²`` for a number ``a``, or ``6·4096·l + l²`` by default."""
    lengths = np.asarray(lengths)
    if cost is None or isinstance(cost, (int, float, np.integer, np.floating)):
        a = float(DEFAULT_LINEAR if cost is None else cost)
        values = lengths.astype(np.float64)
        return a * values + values * values
    flops = getattr(cost, "sequence_flops", None)
    if not callable(flops):
        raise FastpackTypeError(
            f"cost: expected a number a (cost a·l + l²) or an object with "
            f"sequence_flops(lengths), got {type(cost).__name__}"
        )
    values = np.asarray(flops(lengths), dtype=np.float64)
    if values.shape != lengths.shape:
        raise FastpackError(
            f"cost: sequence_flops returned shape {values.shape} for lengths of shape "
            f"{lengths.shape}"
        )
    return values


def _lpt(group: np.ndarray, cost: np.ndarray, tokens: np.ndarray, bins: np.ndarray,
         token_cap: float, cost_cap: float) -> tuple[np.ndarray, np.ndarray]:
    """Longest-processing-time first inside every group at once: the units of group ``g``
    (in decreasing cost, ties by index) each into the lightest of its ``bins[g]`` bins
    that stays under both caps (ties: the lowest bin). Returns each unit's bin and which
    groups failed (a unit fitted nowhere, or a bin left empty). In Rust (groups in
    parallel) when the core has it, else :func:`_lpt_numpy`: the same result."""
    native = getattr(_core, "lpt_groups", None)
    if native is None:
        return _lpt_numpy(group, cost, tokens, bins, token_cap, cost_cap)
    placed, failed = native(
        np.ascontiguousarray(group, dtype=np.int64), np.ascontiguousarray(cost, dtype=np.float64),
        np.ascontiguousarray(tokens, dtype=np.float64), np.ascontiguousarray(bins, dtype=np.int64),
        float(token_cap), float(cost_cap))
    return np.asarray(placed), np.asarray(failed)


def _lpt_numpy(group: np.ndarray, cost: np.ndarray, tokens: np.ndarray, bins: np.ndarray,
               token_cap: float, cost_cap: float) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_lpt` in numpy: round ``j`` places the ``j``-th unit of every group, so the
    loop runs over the largest group's size, each round vectorised over the groups."""
    count, n = len(bins), len(group)
    width = int(bins.max()) if count else 0
    order = np.lexsort((-cost, group))  # by group, then decreasing cost (stable ties)
    sizes = np.bincount(group, minlength=count)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    within = np.arange(n) - starts[group[order]]
    rounds = np.argsort(within, kind="stable")
    bounds = np.searchsorted(within[rounds], np.arange(int(sizes.max(initial=0)) + 1))
    load = np.where(np.arange(width)[None, :] < bins[:, None], 0.0, np.inf)
    held = np.zeros((count, width), dtype=np.float64)
    out = np.full(n, -1, dtype=np.int64)
    failed = np.zeros(count, dtype=bool)
    for j in range(len(bounds) - 1):
        units = order[rounds[bounds[j] : bounds[j + 1]]]
        g = group[units]
        room = ((held[g] + tokens[units, None] <= token_cap)
                & (load[g] + cost[units, None] <= cost_cap))
        candidates = np.where(room, load[g], np.inf)
        b = candidates.argmin(axis=1)
        fits = np.isfinite(candidates[np.arange(len(g)), b])
        failed[g[~fits]] = True
        g, b, units = g[fits], b[fits], units[fits]
        load[g, b] += cost[units]
        held[g, b] += tokens[units]
        out[units] = b
    # Every bin must hold a unit: an empty micro-batch would leave its rank idle.
    used = np.zeros((count, width), dtype=bool)
    placed = out >= 0
    used[group[placed], out[placed]] = True
    failed |= (used.sum(axis=1) < bins)
    return out, failed


@dataclass(frozen=True)
class MicroBatches:
    """Micro-batches of one or many global steps, as flat arrays (no Python object per
    sequence).

    Micro-batch ``b`` holds sequences ``order[offsets[b]:offsets[b+1]]`` (indices into the
    planned lengths, ascending inside a micro-batch); it belongs to global step
    ``batch_step[b]``, rank ``batch_rank[b]``, and is that rank's ``batch_micro[b]``-th in
    running order. A step's micro-batches come rank by rank, each rank's in running order.
    ``num_micro[s]`` is the micro-batches per rank of step ``s``; ``batch_tokens`` and
    ``batch_cost`` sum each micro-batch; ``dropped`` lists the sequences left out by
    ``overlong="drop"``.
    """

    order: np.ndarray
    offsets: np.ndarray
    batch_step: np.ndarray
    batch_rank: np.ndarray
    batch_micro: np.ndarray
    batch_tokens: np.ndarray
    batch_cost: np.ndarray
    num_micro: np.ndarray
    ranks: int
    dropped: np.ndarray

    def __len__(self) -> int:
        return len(self.batch_step)

    def step_offsets(self) -> np.ndarray:
        """Global step ``s`` holds micro-batches ``step_offsets()[s]:step_offsets()[s+1]``."""
        return np.concatenate(([0], np.cumsum(self.num_micro * self.ranks))).astype(np.int64)

    def rank_cost(self) -> np.ndarray:
        """[steps, R]: each rank's cost in each global step."""
        out = np.zeros((len(self.num_micro), self.ranks))
        np.add.at(out, (self.batch_step, self.batch_rank), self.batch_cost)
        return out

    def imbalance(self) -> tuple[float, float]:
        """The mean over global steps of max/mean cost, over the step's micro-batches and
        over its ranks (1.0: perfectly balanced)."""
        steps = len(self.num_micro)
        if not steps:
            return 1.0, 1.0
        top = np.zeros(steps)
        np.maximum.at(top, self.batch_step, self.batch_cost)
        total = np.bincount(self.batch_step, weights=self.batch_cost, minlength=steps)
        mean = total / (self.num_micro * self.ranks)
        ranks = self.rank_cost()
        return (float(np.mean(top / np.maximum(mean, 1e-300))),
                float(np.mean(ranks.max(axis=1) / np.maximum(ranks.mean(axis=1), 1e-300))))


def _one_each(step: np.ndarray, cost: np.ndarray, k: np.ndarray, ranks: int) -> np.ndarray:
    """A micro-batch to each unit of steps with at most ``R·k`` units (any unit fits a
    micro-batch alone): the ``j``-th costliest of its step goes to rank ``j % R`` (in a
    snake, ``R-1-j % R`` on odd rounds, to even out the ranks), micro-batch ``j // R``.
    Returns each unit's bin inside its step (``rank·k + micro``)."""
    order = np.lexsort((-cost, step))
    sizes = np.bincount(step, minlength=len(k))
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    j = np.empty(len(step), dtype=np.int64)
    j[order] = np.arange(len(step)) - starts[step[order]]
    rnd, rank = j // ranks, j % ranks
    rank = np.where(rnd % 2 == 1, ranks - 1 - rank, rank)
    return np.asarray(rank * k[step] + rnd, dtype=np.int64)


def split_steps(step: np.ndarray, tokens: np.ndarray, cost: np.ndarray, *, steps: int,
                ranks: int, token_cap: float | None, cost_cap: float | None,
                micro_batch_multiple: int = 1, pipeline_order: bool = False,
                min_micro_batches: int = 1) -> MicroBatches:
    """The planner: units of global step ``step[i]`` (``0 <= step[i] < steps``, any order)
    with ``tokens`` and ``cost``, into ``R·k_s`` micro-batches per step. Every unit must
    fit the caps alone (checked by the callers, which name their own argument)."""
    tcap = math.inf if token_cap is None else float(token_cap)
    ccap = math.inf if cost_cap is None else float(cost_cap)
    n = len(step)
    sizes = np.bincount(step, minlength=steps)
    floor = max(1, min_micro_batches)
    weights = tokens.astype(np.float64)
    # Two units each over half a cap never share a micro-batch: a second lower bound, which
    # spares the placement the rounds that must fail (RL rollouts, many near the cap).
    big = ((weights > tcap / 2) | (cost > ccap / 2)).astype(np.float64)

    def bound(index: np.ndarray, count: int, share: int) -> np.ndarray:
        """The least micro-batches (a multiple of ``micro_batch_multiple``) that the units
        by ``index`` can fit, by their sums and by their units over half a cap."""
        need = np.maximum.reduce([
            np.ceil(np.bincount(index, weights=weights, minlength=count) / (share * tcap)),
            np.ceil(np.bincount(index, weights=cost, minlength=count) / (share * ccap)),
            np.ceil(np.bincount(index, weights=big, minlength=count) / share)])
        k = np.maximum(need.astype(np.int64), floor)
        return np.asarray(-(-k // micro_batch_multiple) * micro_batch_multiple, dtype=np.int64)

    def units_of(chosen: np.ndarray) -> np.ndarray:
        """The units of steps ``chosen``, ascending."""
        mask = np.zeros(steps, dtype=bool)
        mask[chosen] = True
        return np.flatnonzero(mask[step])

    pooled_k = bound(step, steps, ranks)
    # Two levels first: each step's sequences over its ranks by cost (LPT, no cap), then
    # each rank's into k micro-batches under the caps (k the largest any rank needs). A
    # placement costs O(R + k) this way, not O(R·k).
    rank, _ = _lpt(step, cost, weights, np.full(steps, ranks, dtype=np.int64),
                   math.inf, math.inf)
    group = step * ranks + rank
    group_size = np.bincount(group, minlength=steps * ranks).reshape(steps, ranks)
    k = bound(group, steps * ranks, 1).reshape(steps, ranks).max(axis=1)
    unit_bin = np.full(n, -1, dtype=np.int64)
    pooled = np.zeros(steps, dtype=bool)
    todo = np.arange(steps)
    while len(todo):
        # A rank with fewer sequences than k micro-batches: plan that step pooled.
        short = group_size[todo].min(axis=1) < k[todo]
        pooled[todo[short]] = True
        todo = todo[~short]
        if not len(todo):
            break
        units = units_of(todo)
        groups = (todo[:, None] * ranks + np.arange(ranks)).ravel()
        remap = np.full(steps * ranks, -1, dtype=np.int64)
        remap[groups] = np.arange(len(groups))
        slots, failed = _lpt(remap[group[units]], cost[units], weights[units],
                             np.repeat(k[todo], ranks), tcap, ccap)
        unit_bin[units] = rank[units] * k[step[units]] + slots
        todo = np.unique(groups[failed] // ranks)
        k[todo] += micro_batch_multiple
    # Pooled: the step's sequences into all its R·k micro-batches at once; a step with no
    # more sequences than that gives each its own (some left empty when fewer).
    k[pooled] = pooled_k[pooled]
    todo = np.flatnonzero(pooled)
    while len(todo):
        few = sizes[todo] <= k[todo] * ranks
        if np.any(few):
            units = units_of(todo[few])
            unit_bin[units] = _one_each(step[units], cost[units], k, ranks)
            todo = todo[~few]
            if not len(todo):
                break
        units = units_of(todo)
        remap = np.full(steps, -1, dtype=np.int64)
        remap[todo] = np.arange(len(todo))
        bins, failed = _lpt(remap[step[units]], cost[units], weights[units],
                            k[todo] * ranks, tcap, ccap)
        unit_bin[units] = bins
        todo = todo[failed]
        k[todo] += micro_batch_multiple
    # Bin b of step s: rank b // k, that rank's (b % k)-th micro-batch before ordering.
    step_first = np.concatenate(([0], np.cumsum(k * ranks)[:-1])).astype(np.int64)
    batch = step_first[step] + unit_bin
    total = int((k * ranks).sum())
    batch_tokens = np.bincount(batch, weights=tokens, minlength=total)
    batch_cost = np.bincount(batch, weights=cost, minlength=total)
    batch_step = np.repeat(np.arange(steps), k * ranks)
    local = np.arange(total) - step_first[batch_step]
    k_batch = k[batch_step]
    batch_rank = local // k_batch
    position = local % k_batch
    if pipeline_order:
        # Rank the micro-batches of each (step, rank) by cost; the i-th lightest runs at
        # i/2 from the front (even i) or from the back (odd i).
        by = np.lexsort((batch_cost, batch_rank, batch_step))
        first = step_first[batch_step] + batch_rank * k_batch
        ascending = np.empty(total, dtype=np.int64)
        ascending[by] = np.arange(total) - first[by]
        position = np.where(ascending % 2 == 0, ascending // 2,
                            k_batch - 1 - ascending // 2)
    # Renumber micro-batches in running order: step, rank, position.
    final = step_first[batch_step] + batch_rank * k_batch + position
    unit_final = final[batch]
    order = np.lexsort((np.arange(n), unit_final)).astype(np.int64)
    counts = np.bincount(unit_final, minlength=total)
    inverse = np.empty(total, dtype=np.int64)
    inverse[final] = np.arange(total)
    return MicroBatches(
        order=order,
        offsets=np.concatenate(([0], np.cumsum(counts))).astype(np.int64),
        batch_step=batch_step, batch_rank=batch_rank[inverse],
        batch_micro=position[inverse], batch_tokens=batch_tokens[inverse].astype(np.int64),
        batch_cost=batch_cost[inverse], num_micro=k, ranks=ranks,
        dropped=np.zeros(0, dtype=np.int64),
    )


def plan_micro_batches(
    lengths: Any,
    *,
    ranks: int = 1,
    token_cap: int | None = None,
    cost_cap: float | None = None,
    cost: Any = None,
    steps: Any = None,
    micro_batch_multiple: int = 1,
    pipeline_order: bool = False,
    min_micro_batches: int = 1,
    overlong: str = "error",
    pipeline_group: int | None = None,
) -> MicroBatches:
    """Split the sequences of ``lengths`` over ``ranks`` data-parallel ranks into
    micro-batches under a hard cap (see the module docs for the guarantees).

    Args:
        lengths: token counts (int array [N]): one global batch, or many with ``steps``.
        ranks: data-parallel ranks sharing each global step.
        token_cap, cost_cap: the most tokens / cost one micro-batch may hold (one at least).
        cost: the cost of a sequence (see :func:`sequence_cost`; default ``6·4096·l + l²``).
        steps: the global step of each sequence (int array [N], values ``0..S-1``);
            default: all one step.
        micro_batch_multiple: every rank's micro-batch count is a multiple of it (a
            pipeline's stages, which an interleaved schedule takes micro-batches by).
        pipeline_order: light micro-batches first and last on every rank.
        min_micro_batches: at least this many micro-batches per rank.
        overlong: a sequence over a cap: ``"error"`` raises, ``"drop"`` leaves it out
            (listed in ``dropped``).
        pipeline_group: ``micro_batch_multiple``'s earlier name (deprecated).

    >>> mb = plan_micro_batches([7] * 8, token_cap=8)
    >>> int(mb.num_micro[0]), int(mb.batch_tokens.max())
    (8, 7)
    """
    values = np.asarray(lengths)
    if values.ndim != 1 or not (values.dtype.kind in "iu" or values.size == 0):
        raise FastpackTypeError(
            f"lengths: expected a 1-D integer array, got {values.dtype} of shape {values.shape}"
        )
    if values.size and values.min() < 1:
        raise FastpackError("lengths: every length must be >= 1")
    ranks = _int_arg("ranks", ranks, minimum=1)
    micro_batch_multiple = micro_batch_multiple_arg(micro_batch_multiple, pipeline_group)
    min_micro_batches = _int_arg("min_micro_batches", min_micro_batches, minimum=1)
    if token_cap is None and cost_cap is None:
        raise FastpackError("token_cap, cost_cap: pass at least one cap")
    if token_cap is not None:
        token_cap = _int_arg("token_cap", token_cap, minimum=1)
    if cost_cap is not None and not (isinstance(cost_cap, (int, float, np.number))
                                     and cost_cap > 0):
        raise FastpackError(f"cost_cap: got {cost_cap!r}; expected a number > 0")
    if overlong not in ("error", "drop"):
        raise FastpackError(f"overlong: got {overlong!r}; expected 'error' or 'drop'")
    if steps is None:
        step = np.zeros(len(values), dtype=np.int64)
    else:
        step = np.asarray(steps)
        if step.shape != values.shape or step.dtype.kind not in "iu":
            raise FastpackError(
                f"steps: expected an integer array of the shape of lengths {values.shape}, "
                f"got {step.dtype} {step.shape}"
            )
        step = step.astype(np.int64)
        if step.size and step.min() < 0:
            raise FastpackError("steps: every global step must be >= 0")
    count = int(step.max()) + 1 if step.size else 0
    costs = sequence_cost(values, cost)
    over = np.zeros(len(values), dtype=bool)
    if token_cap is not None:
        over |= values > token_cap
    if cost_cap is not None:
        over |= costs > cost_cap
    dropped = np.flatnonzero(over)
    if len(dropped) and overlong == "error":
        i = int(dropped[0])
        raise FastpackError(
            f"lengths: {len(dropped)} sequence(s) over the cap (sequence {i}: "
            f"{int(values[i])} tokens, cost {costs[i]:.4g}; token_cap {token_cap}, cost_cap "
            f"{cost_cap}); raise the cap, split them, or pass overlong='drop'"
        )
    kept = np.flatnonzero(~over)
    plan = split_steps(step[kept], values[kept].astype(np.int64), costs[kept], steps=count,
                       ranks=ranks, token_cap=token_cap, cost_cap=cost_cap,
                       micro_batch_multiple=micro_batch_multiple, pipeline_order=pipeline_order,
                       min_micro_batches=min_micro_batches)
    return MicroBatches(**{**plan.__dict__, "order": kept[plan.order], "dropped": dropped})


# ---------------------------------------------------------------------- memory
_DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2,
                "float8": 1, "fp8": 1}


@dataclass
class MemoryModel:
    """Memory of a training step as ``base_bytes + bytes_per_token · tokens``: the weights,
    gradients and optimizer state (``base_bytes``, measured before the step) plus the
    activations kept for the backward pass, which grow with the micro-batch's tokens.

    :meth:`from_config` estimates ``bytes_per_token`` from the model's shape;
    :meth:`calibrate` replaces it with one measured step; :meth:`token_cap` turns a
    memory budget into the token cap of a micro-batch.
    """

    bytes_per_token: float
    base_bytes: float = 0.0

    @classmethod
    def from_config(cls, config: Any, *, dtype: str = "bfloat16",
                    checkpointing: bool = False, base_bytes: float = 0.0) -> MemoryModel:
        """The activations a decoder layer keeps per token for its backward pass, in
        ``dtype``: the inputs of its norms and projections, q/k/v, the attention output
        and the MLP's gate, up and activation (about ``6·h + 2·kv + 4·ffn`` values with a
        gated MLP; attention scores are not stored, as with flash/SDPA kernels). A layer
        with experts keeps, instead of the MLP's, the ``top_k`` experts' (``4·moe_ffn``
        each, plus the token's copy dispatched to each), the shared experts' and the
        router's logits. With ``checkpointing`` a layer keeps only its input (``h``) and
        one layer at a time is recomputed in full. The logits add ``vocab`` values in
        ``dtype`` plus two float32 copies (the upcast for the loss and its gradient).
        ``config``: ``model.config`` or its dict (``text_config`` read when present)."""
        text = _get(config, "text_config") or config

        def get(*names: str, default: Any = None) -> Any:
            for name in names:
                value = _get(text, name)
                if value is not None:
                    return value
            return default

        hidden = get("hidden_size", "d_model", "n_embd")
        if hidden is None:
            raise FastpackError("config: has no hidden_size (nor d_model, n_embd)")
        hidden = int(hidden)
        layers = int(get("num_hidden_layers", "n_layer", "num_layers", default=1))
        heads = int(get("num_attention_heads", "n_head", default=1))
        kv_heads = int(get("num_key_value_heads", default=heads))
        head_dim = int(get("head_dim", default=hidden // max(heads, 1)))
        ffn = int(get("intermediate_size", "ffn_dim", "n_inner", default=4 * hidden))
        vocab = int(get("vocab_size", default=0))
        if dtype not in _DTYPE_BYTES:
            raise FastpackError(f"dtype: got {dtype!r}; expected one of {sorted(_DTYPE_BYTES)}")
        size = _DTYPE_BYTES[dtype]
        attention = 6 * hidden + 2 * kv_heads * head_dim + heads * head_dim
        moe = _Moe.of(text, ffn)
        expert_mlp = (moe.top_k * (4 * moe.inter + hidden)
                      + (4 * moe.shared if moe.shared else 0) + moe.experts)
        per_layer = [(attention + (expert_mlp if moe.is_moe(i) else 4 * ffn)) * size
                     for i in range(layers)]
        kept = layers * hidden * size + max(per_layer) if checkpointing else sum(per_layer)
        logits = vocab * (size + 8)
        return cls(bytes_per_token=float(kept + logits), base_bytes=float(base_bytes))

    def calibrate(self, *, tokens: int, peak_bytes: float,
                  base_bytes: float | None = None) -> MemoryModel:
        """The model fitted to one measured step of ``tokens`` tokens that peaked at
        ``peak_bytes`` (``torch.cuda.max_memory_allocated()``) over ``base_bytes`` held
        before it (``torch.cuda.memory_allocated()``; default: this model's)."""
        tokens = _int_arg("tokens", tokens, minimum=1)
        base = self.base_bytes if base_bytes is None else float(base_bytes)
        if peak_bytes <= base:
            raise FastpackError(
                f"peak_bytes: {peak_bytes} is not above base_bytes {base}; measure the peak "
                "of a step (torch.cuda.max_memory_allocated after reset_peak_memory_stats)"
            )
        return MemoryModel(bytes_per_token=(peak_bytes - base) / tokens, base_bytes=base)

    def measure(self, step: Callable[[], Any], tokens: int) -> MemoryModel:
        """Run ``step()`` (one forward and backward of ``tokens`` tokens) on the current
        CUDA device and :meth:`calibrate` from its peak."""
        import torch

        if not torch.cuda.is_available():
            raise FastpackError("measure: needs a CUDA device; on the CPU, pass a measured "
                                "peak to calibrate()")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return self.calibrate(tokens=tokens, peak_bytes=torch.cuda.max_memory_allocated(),
                              base_bytes=base)

    def bytes_for(self, tokens: Any) -> Any:
        """Predicted peak bytes of a step of ``tokens`` tokens."""
        return self.base_bytes + self.bytes_per_token * np.asarray(tokens, dtype=np.float64)

    def token_cap(self, budget_bytes: float, *, margin: float = 0.0) -> int:
        """The most tokens a micro-batch may hold to stay under ``budget_bytes`` (less a
        ``margin`` fraction for fragmentation)."""
        if not 0.0 <= margin < 1.0:
            raise FastpackError(f"margin: got {margin}; expected 0 <= margin < 1")
        room = budget_bytes * (1.0 - margin) - self.base_bytes
        cap = int(room // self.bytes_per_token)
        if cap < 1:
            raise FastpackError(
                f"budget_bytes: {budget_bytes:.4g} leaves no room for a token over the "
                f"{self.base_bytes:.4g} bytes held before the step"
            )
        return cap


# ---------------------------------------------------------------------- control
class BudgetController:
    """Moves a budget (a micro-batch token cap, tokens per step) from a measured signal
    with the rule ``new = current × (1 + α × (target − signal))`` (seed §4.1), clipped to
    ``[minimum, maximum]`` — ``maximum`` is the hard cap it never exceeds — and rounded
    down to a multiple of ``quantum``. ``signal`` and ``target`` are in the same unit, a
    utilisation (memory in use over the budget, say 0.9). Feed every rank the same
    signal (the max over ranks) so that every rank moves the same way.

    Its state (``state_dict``) is plain ints and floats; :class:`~fastpack.torch.
    PackedSampler` records the caps it applied in its own state, so a resumed run replays
    the same schedule.
    """

    def __init__(self, initial: int, *, target: float, maximum: int, minimum: int = 1,
                 alpha: float = 0.2, quantum: int = 1) -> None:
        self.minimum = _int_arg("minimum", minimum, minimum=1)
        self.maximum = _int_arg("maximum", maximum, minimum=self.minimum,
                                why=f" (minimum is {self.minimum})")
        self.value = _int_arg("initial", initial, minimum=self.minimum, maximum=self.maximum)
        self.quantum = _int_arg("quantum", quantum, minimum=1)
        if not 0.0 < float(alpha) <= 1.0:
            raise FastpackError(f"alpha: got {alpha}; expected 0 < alpha <= 1 (0.1-0.3 "
                                "is the seeds' range)")
        if not float(target) > 0.0:
            raise FastpackError(f"target: got {target}; expected a utilisation > 0")
        self.alpha = float(alpha)
        self.target = float(target)

    def update(self, signal: float) -> int:
        """The next budget after a step that measured ``signal``."""
        signal = float(signal)
        if not math.isfinite(signal) or signal < 0:
            raise FastpackError(f"signal: got {signal}; expected a finite number >= 0")
        moved = self.value * (1.0 + self.alpha * (self.target - signal))
        value = int(moved // self.quantum) * self.quantum
        self.value = int(min(max(value, self.minimum), self.maximum))
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "minimum": self.minimum, "maximum": self.maximum,
                "alpha": self.alpha, "target": self.target, "quantum": self.quantum}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = _int_arg("state['value']", state["value"], minimum=self.minimum,
                              maximum=self.maximum)
