"""Context parallelism (CP) of packed batches: one packed row split across the ranks of a
CP group, and the exact attention that trains on the pieces.

:func:`shard_for_context_parallel` turns a packed flash-format batch
(``PackedCollator(backend="flash")``) into one rank's batch, from
:func:`fastpack.cp_layout`: its tokens, labels, global positions, and the arrays its
attention and loss read (the ``cp_*`` keys, :data:`CP_KEYS`).

:func:`context_parallel_attention` computes, for the rank's queries, exactly what
attention over the whole row computes: every query attends to its own sequence's keys up
to its position, whichever rank holds them.

- ``"zigzag"`` and ``"contiguous"``: K and V are all-gathered over the group in the
  forward pass and their gradients reduce-scattered back in the backward pass; each run
  of local queries (a piece of one sequence, see :class:`fastpack.RankLayout`) attends to
  its sequence's keys. Kernels: ring-flash-attn (``"ring"``: ``llama3_flash_attn_varlen_func``
  for contiguous, ``zigzag_ring_flash_attn_varlen_func`` for zigzag) or flash-attn varlen
  over the gathered keys (``"flash"``, causal bottom-right aligned) on CUDA in half
  precision; else (``"sdpa"``) one ``scaled_dot_product_attention`` per run, its mask at
  most a block of queries by that run's keys — never a T×T mask.
- ``"ulysses"``: an all-to-all gives every rank all tokens for ``heads / cp`` of the heads;
  :func:`~fastpack.torch.varlen_attention` runs over whole sequences; a second all-to-all
  returns the rank's tokens with every head.

The loss: Hugging Face's causal-LM loss shifts ``labels`` by one *inside* the model, which
on a rank's non-contiguous tokens pairs the wrong tokens at every chunk boundary; the
local batch therefore carries ``shift_labels``, shifted on the whole row before slicing
(the key Hugging Face's ``ForCausalLMLoss`` and accelerate's CP use), and
:func:`~fastpack.torch.packed_loss` reads them. ``num_items_in_batch`` is unchanged: every
target is on exactly one rank, so the group's losses add up to the row's.
"""

from __future__ import annotations

import functools
import importlib
import math
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .._checks import _choice, _int_arg
from .._context_parallel import CP_MODES, CPLayout, cp_layout
from .._errors import FastpackError, FastpackTypeError
from .._materialize import IGNORE_INDEX
from .._options import check_cp
from ..vlm import MEDIA_KEYS
from .attention import (
    _attend,
    _check_qkv,
    _check_window_options,
    _repeat_kv,
    _sdpa_gqa,
    varlen_attention,
)
from .tree import SAMPLE_KEYS

__all__ = [
    "CP_KERNELS", "CP_KEYS", "ShardMask", "attend_gathered", "context_parallel_attention",
    "shard_for_context_parallel",
]

#: ``"auto"`` picks the first that runs: ``"ring"`` (ring-flash-attn, CUDA, fp16/bf16;
#: zigzag and contiguous), ``"flash"`` (flash-attn varlen over the all-gathered keys, CUDA,
#: fp16/bf16), ``"sdpa"`` (everywhere). Ulysses runs :func:`varlen_attention` after its
#: all-to-all: ``"flash"`` and ``"sdpa"`` force that kernel, ``"auto"`` picks as it does.
CP_KERNELS = ("auto", "ring", "flash", "sdpa")

#: What a local batch carries besides its per-token tensors (``input_ids``, ``labels``,
#: ``shift_labels``, ``position_ids``, ``loss_mask``, ``seq_idx``), from its rank's
#: :class:`~fastpack.CPLayout`: the group (``cp_size``, ``cp_rank``, ``cp_mode``), the
#: row's ``cp_cu_seqlens`` (real) and ``cp_cu_seqlens_padded`` (TransformerEngine's
#: ``cu_seqlens_q/kv`` and ``cu_seqlens_q/kv_padded``) and ``cp_max_seqlen`` (the longest
#: padded sequence), the rank's runs ``cp_cu_seqlens_q`` / ``cp_cu_seqlens_k`` /
#: ``cp_max_seqlen_q`` / ``cp_max_seqlen_k`` (ring-flash-attn's llama3 arrays in the
#: contiguous modes), ``cp_local_k_slice`` (contiguous, Ulysses) or ``cp_k_index``
#: (zigzag), and ``cp_sequence_targets`` (the targets of each run's whole sequence, for
#: ``weighting="sequence"``). Hugging Face's own attention reads none of them; the
#: shard's ``attention_mask`` (a :class:`ShardMask`) is what keeps it from being taken for
#: a plain packed batch: Hugging Face's mask code reads it and raises.
CP_KEYS = (
    "cp_size", "cp_rank", "cp_mode", "cp_cu_seqlens", "cp_cu_seqlens_padded", "cp_max_seqlen",
    "cp_cu_seqlens_q", "cp_cu_seqlens_k", "cp_max_seqlen_q", "cp_max_seqlen_k",
    "cp_local_k_slice", "cp_k_index", "cp_sequence_targets",
)

class ShardMask:
    """The ``attention_mask`` of a context-parallel shard: a guard, not a mask.

    Hugging Face's own attention (sdpa, eager, flash, flex) would run a shard's forward
    with each rank attending to its own tokens only, silently. Every one of them reads
    ``attention_mask`` in its mask code before the first layer, and reading anything of
    this object (``.ndim``, ``.shape``, ...) raises, naming the fix. fastpack's
    context-parallel attention is registered without a mask function, so Hugging Face
    hands it no mask and never reads this one. ``.to(...)`` returns it unchanged, so
    code that moves a batch's values to a device keeps it.
    """

    __slots__ = ()

    def to(self, *args: Any, **kwargs: Any) -> ShardMask:
        return self

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise FastpackError(
            "attention_mask: this batch is one rank's share of a context-parallel row "
            "(shard_for_context_parallel), and the model's attention is not fastpack's "
            "context-parallel one, so every rank would attend to its own tokens only; load "
            "the model with attn_implementation=register_hf_attention("
            "context_parallel_group=group, mode=...) (Hugging Face read the mask's "
            f"{name!r})"
        )

    def __repr__(self) -> str:
        return "ShardMask()"

    def __reduce__(self) -> tuple[Any, ...]:
        return (ShardMask, ())


#: Per-token keys of a flash batch that sharding rebuilds; other per-token keys raise.
_TOKEN_KEYS = ("input_ids", "labels", "position_ids", "seq_idx")
#: Keys of a flash batch that describe the whole row and do not pass to a rank (a rank
#: holds pieces of the samples, so ``per_sample`` does not apply to a shard).
_ROW_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", *SAMPLE_KEYS)

#: Queries x keys of one masked SDPA call on the CPU path (a block of a run's queries).
_MASK_BUDGET = 1 << 22
#: Queries x keys of a run batched with others by the SDPA path; larger runs go alone.
#: Measured (CPU, fwd+bwd, benches/bench_speed_traps.py): batching wins where the calls'
#: overhead dominates (zigzag over 32-token sequences: ~2x); on rows of mixed lengths,
#: batching runs of 10^3 pairs and more measured 0.66-1.0x (padding to powers of two,
#: masks), so only the smallest runs are batched.
_SHORT_RUN = 1 << 8


# ------------------------------------------------------------------------- sharding


def _to_torch(value: Any, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    raise FastpackTypeError(f"batch[{name!r}]: expected a tensor or numpy array, got "
                            f"{type(value).__name__}")


def shard_for_context_parallel(
    batch: Mapping[str, Any],
    cp_size: int,
    cp_rank: int,
    mode: str = "zigzag",
    *,
    pad_multiple: int = 1,
    pad_id: int = 0,
) -> dict[str, Any]:
    """One CP rank's share of a packed flash-format batch.

    Args:
        batch: one flat row (``PackedCollator(backend="flash")``, or a
            :class:`~fastpack.torch.PackedDataset` step of that format): ``input_ids``
            ``[1, T]``, ``cu_seq_lens_q`` (the sequences), and optionally ``labels``,
            ``position_ids`` (checked: they must restart at every sequence),
            ``num_items_in_batch``, ``num_sequences_in_batch``.
        cp_size, cp_rank: the CP group's size and this rank's index in it.
        mode: ``"zigzag"``, ``"contiguous"`` or ``"ulysses"`` (:data:`fastpack.CP_MODES`).
        pad_multiple, pad_id: padding (see :func:`fastpack.cp_layout`) and its token id.

    Returns:
        A batch for ``model(**batch)`` under a CP attention (register_hf_attention with a
        ``context_parallel_group``): ``input_ids``, ``labels`` (-100 on pads),
        ``shift_labels`` (the row's labels shifted by one within each sequence *before*
        slicing, -100 on pads: what the loss reads), ``position_ids`` (positions in the
        padded row, computed before slicing), ``loss_mask`` (``shift_labels != -100``),
        ``seq_idx`` (int32, the run of every token: rank-local, from 0), the
        :data:`CP_KEYS`, ``use_cache=False``, ``attention_mask`` (a :class:`ShardMask`:
        Hugging Face's own attention raises on it before the first layer, where it would
        attend within this rank's tokens only), and ``num_items_in_batch`` /
        ``num_sequences_in_batch`` unchanged (each target counts once over the group).
        Tensors are on ``input_ids``' device; numpy in, numpy out.

    Raises:
        FastpackError: a batch that is not one flat row with ``cu_seq_lens_q``, one already
            sharded, a vision-language batch (mRoPE ``position_ids`` ``[4, 1, T]`` or
            media keys), ``position_ids`` that do not restart at every sequence, a per-token
            key it cannot shard, or bad CP options.
    """
    if not isinstance(batch, Mapping):
        raise FastpackTypeError(f"batch: expected a dict (a packed batch), got "
                                f"{type(batch).__name__}")
    if "cp_size" in batch:
        raise FastpackError(
            f"batch: already sharded for context parallelism (cp_rank={batch.get('cp_rank')} "
            f"of cp_size={batch['cp_size']}); shard the full batch once on every rank"
        )
    cp, mode, multiple = check_cp(cp_size, mode, pad_multiple)
    _refuse_vision_language(batch, cp)

    rank = _int_arg("cp_rank", cp_rank, minimum=0, maximum=cp - 1, why=f" (cp_size is {cp})")
    pad_id = _int_arg("pad_id", pad_id, minimum=-(2**63), maximum=2**63 - 1)
    if "cu_seq_lens_q" not in batch:
        raise FastpackError(
            f"batch: no 'cu_seq_lens_q' (keys: {sorted(batch)}); context parallelism shards "
            f"one flat packed row with its sequence boundaries: PackedCollator(backend='flash')"
        )
    numpy_in = isinstance(batch.get("input_ids"), np.ndarray)
    if "input_ids" not in batch:
        raise FastpackError(f"batch: no 'input_ids' (keys: {sorted(batch)})")
    ids = _to_torch(batch["input_ids"], "input_ids")
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise FastpackError(
            f"input_ids: expected one flat row of shape [1, T], got {tuple(ids.shape)}"
        )
    device, width = ids.device, ids.shape[1]
    cu_t = _to_torch(batch["cu_seq_lens_q"], "cu_seq_lens_q")
    cu_k = batch.get("cu_seq_lens_k")
    if cu_k is not None and cu_k is not batch["cu_seq_lens_q"] and not torch.equal(
        _to_torch(cu_k, "cu_seq_lens_k").detach().cpu().long(), cu_t.detach().cpu().long()
    ):
        raise FastpackError("cu_seq_lens_k: differs from cu_seq_lens_q; a packed row's queries "
                            "and keys share their boundaries")
    layout = cp_layout(cu_t, cp, mode=mode, pad_multiple=multiple)
    if layout.real_total != width:
        raise FastpackError(
            f"cu_seq_lens_q: ends at {layout.real_total}, but input_ids holds {width} tokens; "
            f"expected cu_seq_lens_q[-1] == input_ids.shape[1]"
        )
    for key, value in batch.items():
        if key in _TOKEN_KEYS or key in _ROW_KEYS:
            continue
        shape = getattr(value, "shape", None)
        if shape is not None and len(shape) >= 1 and width > 1 and width in tuple(shape):
            raise FastpackError(
                f"batch: {key!r} has shape {tuple(shape)}, one value per token of the row; "
                f"shard_for_context_parallel does not know how to split it (it shards "
                f"{', '.join(_TOKEN_KEYS)}); drop it or split it with layout.indices(rank)"
            )
    return _shard(batch, layout, rank, ids, device, pad_id, numpy_in)


def _refuse_vision_language(batch: Mapping[str, Any], cp: int) -> None:
    """A vision-language batch is not sharded: its mRoPE rows would need the per-document
    t/h/w positions cut with the tokens, and its media (every image's patches, in
    placeholder order) would stay whole on every rank while the placeholders are split."""
    positions = batch.get("position_ids")
    shape = tuple(getattr(positions, "shape", ()))
    if len(shape) == 3:
        raise FastpackError(
            f"position_ids: shape {shape} holds mRoPE rows (a vision-language batch of "
            f"PackedCollator(model_config=...)); shard_for_context_parallel(cp_size={cp}) "
            f"takes a text batch's positions [1, T]: vision-language batches are not sharded "
            f"for context parallelism"
        )
    media = [k for k in MEDIA_KEYS if batch.get(k) is not None]
    if media:
        raise FastpackError(
            f"batch: {media[0]!r} is media of a vision-language batch; "
            f"shard_for_context_parallel(cp_size={cp}) would split its placeholder tokens "
            f"across ranks but not the media: vision-language batches are not sharded for "
            f"context parallelism"
        )


def _shard(batch: Mapping[str, Any], layout: CPLayout, rank: int, ids: torch.Tensor,
           device: torch.device, pad_id: int, numpy_in: bool) -> dict[str, Any]:
    def on_device(a: np.ndarray) -> torch.Tensor:
        return torch.tensor(a, device=device)

    cu = layout.cu_seqlens.astype(np.int64)
    lengths = np.diff(cu)
    sequence_of = on_device(np.repeat(np.arange(len(lengths)), lengths))  # [T]
    starts = on_device(cu[:-1])
    if "position_ids" in batch:
        pos = _to_torch(batch["position_ids"], "position_ids").to(device).reshape(-1)
        want = torch.arange(ids.shape[1], device=device) - starts[sequence_of]
        if pos.shape != want.shape or not torch.equal(pos.long(), want):
            raise FastpackError(
                "position_ids: do not restart at 0 at every sequence of cu_seq_lens_q; a "
                "context-parallel shard computes positions from the boundaries (before "
                "slicing), so the batch must agree with them"
            )
    source = on_device(layout.sources(rank))
    pad = source < 0
    take = source.clamp(min=0)
    out: dict[str, Any] = {
        "input_ids": ids[0, take].masked_fill(pad, pad_id)[None],
        "position_ids": on_device(layout.positions(rank))[None],
    }
    local = layout.local(rank)
    run_sequences = on_device(local.run_sequences)
    if "labels" in batch:
        labels = _to_torch(batch["labels"], "labels").to(device)
        if tuple(labels.shape) != tuple(ids.shape):
            raise FastpackError(f"labels: shape {tuple(labels.shape)} does not match "
                                f"input_ids {tuple(ids.shape)}")
        row = labels[0]
        shifted = torch.full_like(row, IGNORE_INDEX)
        shifted[:-1] = row[1:]
        ends = on_device(cu[1:][lengths > 0] - 1)
        shifted[ends] = IGNORE_INDEX  # a sequence's last token predicts nothing
        out["labels"] = row[take].masked_fill(pad, IGNORE_INDEX)[None]
        out["shift_labels"] = shifted[take].masked_fill(pad, IGNORE_INDEX)[None]
        out["loss_mask"] = out["shift_labels"] != IGNORE_INDEX
        targets = torch.zeros(len(lengths), dtype=torch.int64, device=device)
        targets.index_add_(0, sequence_of, (shifted != IGNORE_INDEX).long())
        out["cp_sequence_targets"] = targets[run_sequences]
    out["seq_idx"] = on_device(local.seq_idx)[None]
    out.update(
        cp_size=layout.cp_size, cp_rank=rank, cp_mode=layout.mode,
        cp_cu_seqlens=on_device(layout.cu_seqlens),
        cp_cu_seqlens_padded=on_device(layout.cu_seqlens_padded),
        cp_max_seqlen=layout.max_seqlen_padded,
        cp_cu_seqlens_q=on_device(local.cu_seqlens_q),
        cp_cu_seqlens_k=on_device(local.cu_seqlens_k),
        cp_max_seqlen_q=local.max_seqlen_q, cp_max_seqlen_k=local.max_seqlen_k,
    )
    if local.local_k_slice is not None:
        out["cp_local_k_slice"] = local.local_k_slice
    if local.k_index is not None:
        out["cp_k_index"] = on_device(local.k_index)
    out["use_cache"] = False
    out["attention_mask"] = ShardMask()
    for key in ("num_items_in_batch", "num_sequences_in_batch"):
        if key in batch:
            out[key] = batch[key]
    if numpy_in:
        out = {k: v.cpu().numpy() if isinstance(v, torch.Tensor) else v for k, v in out.items()}
    return out


# ------------------------------------------------------------------- collectives


def _group_size(group: Any) -> int:
    return 1 if group is None else int(group.size())


class _AllGather(torch.autograd.Function):
    """K or V of every rank, in rank order (forward: all-gather); their gradients summed
    over the group and returned to their rank (backward: reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        size = _group_size(group)
        if size == 1:
            return x.clone()
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        torch.distributed.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        size = _group_size(ctx.group)
        if size == 1:
            return grad, None
        out = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
        torch.distributed.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


def _all_to_all(x: torch.Tensor, group: Any, to_heads: bool) -> torch.Tensor:
    """Ulysses' exchange. ``to_heads``: ``(n, H, D)`` local tokens with every head ->
    ``(cp·n, H/cp, D)`` every token with this rank's heads; else the reverse."""
    size = _group_size(group)
    if to_heads:
        n, heads, dim = x.shape
        send = x.reshape(n, size, heads // size, dim).transpose(0, 1).contiguous()
        recv = torch.empty_like(send)
        torch.distributed.all_to_all_single(recv, send, group=group)
        return recv.reshape(size * n, heads // size, dim)
    total, part, dim = x.shape
    send = x.reshape(size, total // size, part, dim).contiguous()
    recv = torch.empty_like(send)
    torch.distributed.all_to_all_single(recv, send, group=group)
    return recv.transpose(0, 1).reshape(total // size, size * part, dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        if _group_size(group) == 1:
            return x.clone()
        return _all_to_all(x, group, to_heads)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if _group_size(ctx.group) == 1:
            return grad, None, None
        return _all_to_all(grad, ctx.group, not ctx.to_heads), None, None


# --------------------------------------------------------------------- kernels


@functools.cache
def _ring() -> Any:
    try:
        return importlib.import_module("ring_flash_attn")
    except Exception:  # ImportError, or a broken CUDA build raising something else
        return None


@functools.cache
def _flash() -> Any:
    try:
        return importlib.import_module("flash_attn").flash_attn_varlen_func
    except Exception:
        return None


def _kernel_reason(kernel: str, q: torch.Tensor) -> str | None:
    """Why ``kernel`` cannot run on inputs like ``q``; ``None`` when it can."""
    if kernel == "sdpa":
        return None
    if q.device.type != "cuda":
        return f"it needs CUDA tensors, got device {q.device.type!r}"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"it needs float16 or bfloat16 inputs, got {q.dtype}"
    if kernel == "ring" and _ring() is None:
        return "ring-flash-attn is not installed (pip install ring-flash-attn)"
    if kernel == "flash" and _flash() is None:
        return "flash-attn is not installed (pip install flash-attn)"
    return None


def _resolve(kernel: str, q: torch.Tensor, mode: str, window: int | None,
             softcap: float | None) -> str:
    if mode == "ulysses":
        if kernel == "ring":
            raise FastpackError("kernel: 'ring' has no Ulysses form; use 'auto', 'flash' or "
                                "'sdpa' with mode='ulysses'")
        return kernel
    if kernel == "auto":
        # ring-flash-attn takes neither windows nor soft-capping: flash-attn takes both.
        order = ("flash", "sdpa") if (window or softcap) else ("ring", "flash", "sdpa")
        return next(k for k in order if _kernel_reason(k, q) is None)
    reason = _kernel_reason(kernel, q)
    if reason is not None:
        raise FastpackError(f"kernel={kernel!r} is not available: {reason}")
    if kernel == "ring" and (window is not None or softcap is not None):
        raise FastpackError(
            f"kernel='ring': ring-flash-attn has no sliding window or soft-capping (got "
            f"sliding_window={window}, softcap={softcap}); use kernel='flash' or 'sdpa'"
        )
    return kernel


class _Runs:
    """A rank's runs as the attention reads them, built once per batch (the boundaries
    read on the host once, not in every layer): the host bounds, the device ``cu`` arrays
    of the flash kernel, and the SDPA kernel's plan — short runs batched into padded
    groups (one SDPA call per group), long ones alone."""

    def __init__(self, cu_q: list[int], cu_k: list[int], device: torch.device) -> None:
        self.cu_q, self.cu_k = cu_q, cu_k
        self.device = device
        self._flash: tuple[torch.Tensor, torch.Tensor] | None = None
        self._plan: _SdpaPlan | None = None

    def flash(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._flash is None:
            self._flash = tuple(torch.tensor(c, dtype=torch.int32, device=self.device)
                                for c in (self.cu_q, self.cu_k))  # type: ignore[assignment]
        assert self._flash is not None
        return self._flash

    def plan(self) -> _SdpaPlan:
        """The SDPA kernel's plan (see :class:`_SdpaPlan`), built on the first call."""
        if self._plan is None:
            self._plan = _SdpaPlan(self.cu_q, self.cu_k, self.device)
        return self._plan


class _SdpaPlan:
    """Short runs in padded groups (sizes rounded up to powers of two; a group's mask at
    most :data:`_MASK_BUDGET` entries) and the others alone: long runs, and runs whose
    queries are all their keys (one causal call each).

    ``q_index`` / ``k_index``: the rows of every group's queries and keys, group after
    group (one gather per tensor and layer: each gather's backward writes a gradient as
    large as the whole tensor); padding reads row 0. Per group ``(limits [R, Lq], real,
    R, Lq, Lk)``: each query's last key (0 for a padding query: it sees its run's first
    key, so no softmax row is empty; its output is dropped) and which of its ``R·Lq``
    outputs are real. ``long``: the runs computed alone; ``order``: the inverse of the
    local rows of the outputs, the groups' then the long runs' (None: already in order).
    """

    def __init__(self, host_q: list[int], host_k: list[int], device: torch.device) -> None:
        cu_q, cu_k = np.asarray(host_q, np.int64), np.asarray(host_k, np.int64)
        lq, lk = np.diff(cu_q), np.diff(cu_k)
        runs = np.flatnonzero(lq > 0)
        # A run whose queries are its keys (a whole sequence, or its first piece) is one
        # causal call without a mask, SDPA's fastest: it is never batched.
        batched = (lq * lk <= _SHORT_RUN) & (lq < lk)
        short = runs[batched[runs]]
        self.long = [int(r) for r in runs if not batched[r]]
        bucket_q = np.left_shift(1, np.ceil(np.log2(np.maximum(lq[short], 1))).astype(np.int64))
        bucket_k = np.left_shift(1, np.ceil(np.log2(np.maximum(lk[short], 1))).astype(np.int64))
        by = np.lexsort((short, bucket_q, bucket_k))
        self.groups: list[tuple[Any, ...]] = []
        q_rows: list[np.ndarray] = []
        k_rows: list[np.ndarray] = []
        dest: list[np.ndarray] = []
        i = 0
        while i < len(by):
            bq, bk = int(bucket_q[by[i]]), int(bucket_k[by[i]])
            j = i
            while (j < len(by) and bucket_q[by[j]] == bq and bucket_k[by[j]] == bk
                   and (j - i + 1) * bq * bk <= _MASK_BUDGET):
                j += 1
            members = short[by[i:j]]
            width_q, width_k = int(lq[members].max()), int(lk[members].max())
            col_q, col_k = np.arange(width_q), np.arange(width_k)
            real_q = col_q[None, :] < lq[members][:, None]
            q_index = np.where(real_q, cu_q[members][:, None] + col_q[None, :], 0).reshape(-1)
            q_rows.append(q_index)
            k_rows.append(np.where(col_k[None, :] < lk[members][:, None],
                                   cu_k[members][:, None] + col_k[None, :], 0).reshape(-1))
            # Query i of a run sits at key position (lk - lq) + i of its keys.
            limits = np.where(real_q, (lk[members] - lq[members])[:, None] + col_q[None, :], 0)
            real = np.flatnonzero(real_q.reshape(-1))
            dest.append(q_index[real])
            self.groups.append((torch.from_numpy(limits).to(device),
                                torch.from_numpy(real).to(device),
                                len(members), width_q, width_k))
            i = j
        self.q_index, self.k_index = (
            torch.from_numpy(np.concatenate(rows) if rows else np.zeros(0, np.int64)).to(device)
            for rows in (q_rows, k_rows))
        self.q_sizes = [len(r) for r in q_rows]
        self.k_sizes = [len(r) for r in k_rows]
        dest.extend(np.arange(cu_q[r], cu_q[r + 1]) for r in self.long)
        order = np.concatenate(dest) if dest else np.zeros(0, np.int64)
        self.order: torch.Tensor | None = None
        if not np.array_equal(order, np.arange(len(order))):
            inverse = np.empty_like(order)
            inverse[order] = np.arange(len(order))
            self.order = torch.from_numpy(inverse).to(device)


class _RunsCache:
    """The :class:`_Runs` of the last batch (by the identity and in-place version of its
    ``cp_cu_seqlens_q`` / ``_k`` tensors, and the device), so a forward reads its
    boundaries on the host once, not in every layer."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._refs: tuple[Any, Any] | None = None
        self.runs: _Runs | None = None

    def get(self, batch: Mapping[str, Any], device: torch.device) -> _Runs:
        cu_q, cu_k = batch["cp_cu_seqlens_q"], batch["cp_cu_seqlens_k"]
        tensors = isinstance(cu_q, torch.Tensor) and isinstance(cu_k, torch.Tensor)
        if tensors:
            key = (cu_q._version, cu_k._version, device)
            if (self._refs is not None and self._refs[0]() is cu_q and self._refs[1]() is cu_k
                    and self._key == key and self.runs is not None):
                return self.runs
        host_q, host_k = (torch.as_tensor(c).detach().to("cpu", torch.int64).tolist()
                          for c in (cu_q, cu_k))
        runs = _Runs(host_q, host_k, device)
        if tensors:
            self._refs = (weakref.ref(cu_q), weakref.ref(cu_k))
            self._key, self.runs = key, runs
        return runs


_RUNS = _RunsCache()


def _runs_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, runs: _Runs,
               scale: float | None, window: int | None, softcap: float | None) -> torch.Tensor:
    """Each run's queries over its keys, causally with the queries aligned to the keys'
    end (the run's queries are its sequence's last ones so far). Short runs go in padded
    groups, one masked SDPA call each (a row of many short sequences is a few calls per
    layer, not one or more per run); a long run is one SDPA call (``is_causal`` where
    queries and keys coincide) or a few masked calls over blocks of its queries. Every
    mask is at most :data:`_MASK_BUDGET` entries."""
    keys, values, gqa = _sdpa_gqa(q, keys, values, softcap)
    plan = runs.plan()
    outs = []
    if plan.groups:
        q_all = q.index_select(0, plan.q_index).split(plan.q_sizes)
        k_all, v_all = (t.index_select(0, plan.k_index).split(plan.k_sizes)
                        for t in (keys, values))
    for g, (limits, real, count, width_q, width_k) in enumerate(plan.groups):
        qs = q_all[g].view(count, width_q, *q.shape[1:]).transpose(1, 2)
        ks, vs = (t[g].view(count, width_k, *t[g].shape[1:]).transpose(1, 2)
                  for t in (k_all, v_all))
        key_pos = torch.arange(width_k, device=q.device)
        allowed = key_pos <= limits[:, :, None]
        if window is not None:
            allowed &= limits[:, :, None] - key_pos < window
        out = _attend(qs, ks, vs, allowed[:, None], True, scale, softcap, gqa)
        outs.append(out.transpose(1, 2).reshape(1, count * width_q, *out.shape[1::2])
                    .index_select(1, real))
    long, order = plan.long, plan.order
    if long:
        # Split once, in SDPA's layout (1, H, T, D): a slice per run would write a
        # gradient as large as the whole tensor in the backward pass, and views per run
        # add autograd nodes that cost more than tiny runs' attention.
        cu_q, cu_k = runs.cu_q, runs.cu_k
        q_parts = q.transpose(0, 1).unsqueeze(0).split(
            [b - a for a, b in zip(cu_q[:-1], cu_q[1:])], dim=2)
        k_parts, v_parts = (t.transpose(0, 1).unsqueeze(0).split(
            [b - a for a, b in zip(cu_k[:-1], cu_k[1:])], dim=2) for t in (keys, values))
    for r in long:
        qs, ks, vs = q_parts[r], k_parts[r], v_parts[r]
        lq, lk = qs.shape[2], ks.shape[2]
        offset = lk - lq  # query i sits at key position offset + i
        if offset == 0 and softcap is None and (window is None or lk <= window):
            out = _attend(qs, ks, vs, None, True, scale, softcap, gqa)
            outs.append(out.transpose(1, 2))
            continue
        block = max(1, _MASK_BUDGET // max(lk, 1))
        for i0 in range(0, lq, block):
            i1 = min(lq, i0 + block)
            first = 0 if window is None else max(0, offset + i0 - window + 1)
            last = offset + i1  # keys first..last-1
            query_pos = torch.arange(offset + i0, offset + i1, device=q.device)[:, None]
            key_pos = torch.arange(first, last, device=q.device)[None, :]
            allowed = key_pos <= query_pos
            if window is not None:
                allowed &= query_pos - key_pos < window
            out = _attend(qs[:, :, i0:i1], ks[:, :, first:last], vs[:, :, first:last],
                          allowed, True, scale, softcap, gqa)
            outs.append(out.transpose(1, 2))
    if not outs:
        return q[:0]
    result = (torch.cat(outs, dim=1) if len(outs) > 1 else outs[0])[0]
    return result if order is None else result.index_select(0, order)


# ------------------------------------------------------------------------ attention


def _local_meta(batch: Mapping[str, Any], n: int, device: torch.device) -> dict[str, Any]:
    missing = [k for k in ("cp_size", "cp_rank", "cp_mode", "cp_cu_seqlens_q",
                           "cp_cu_seqlens_k", "cp_cu_seqlens_padded") if k not in batch]
    if missing:
        raise FastpackError(
            f"batch: not a context-parallel batch (no {', '.join(map(repr, missing))}); "
            f"shard it with fastpack.torch.shard_for_context_parallel"
        )
    mode = _choice("batch['cp_mode']", batch["cp_mode"], CP_MODES)
    runs = _RUNS.get(batch, device)  # the boundaries on the host, once per batch
    if runs.cu_q[-1] != n:
        raise FastpackError(
            f"q: holds {n} tokens, but the batch's rank holds {runs.cu_q[-1]} "
            f"(cp_cu_seqlens_q[-1]); pass the local batch these q/k/v were computed from"
        )
    return {"mode": mode, "size": int(batch["cp_size"]), "rank": int(batch["cp_rank"]),
            "runs": runs}


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: Mapping[str, Any],
    group: Any = None,
    *,
    kernel: str = "auto",
    softmax_scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of one CP rank's queries over their sequences' keys on every rank.

    Args:
        q: ``(n, Hq, D)``, the rank's tokens in its local order; ``k``, ``v``:
            ``(n, Hkv, D)`` with ``Hq`` a multiple of ``Hkv`` (GQA). Ulysses needs ``Hq``
            and ``Hkv`` divisible by the group size.
        batch: the rank's batch from :func:`shard_for_context_parallel` (its ``cp_*``
            keys: the layout).
        group: the CP process group (``None`` only for ``cp_size == 1``); its size and
            this process's rank in it must be the batch's ``cp_size`` and ``cp_rank``.
        kernel: one of :data:`CP_KERNELS`.
        softmax_scale: defaults to ``1 / sqrt(D)``.
        sliding_window, softcap: as :func:`~fastpack.torch.varlen_attention` (Hugging
            Face's ``sliding_window`` over positions in the sequence; Gemma 2's cap);
            ring-flash-attn has neither.

    Returns:
        ``(n, Hq, D)``: for every local query, what attention over the whole row gives it.
        Differentiable: the gradients of every rank's q, k and v are those of the whole
        row's attention (collectives in the backward pass, as in the forward).
    """
    _check_qkv(q, k, v)
    if not isinstance(kernel, str) or kernel not in CP_KERNELS:
        raise FastpackError(
            f"kernel: expected one of {', '.join(map(repr, CP_KERNELS))}, got {kernel!r}"
        )
    window, cap = _check_window_options(sliding_window, softcap, True)
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
                or not softmax_scale > 0 or math.isinf(softmax_scale):
            raise FastpackError(f"softmax_scale: expected a positive finite number, got "
                                f"{softmax_scale!r}")
        softmax_scale = float(softmax_scale)
    meta = _local_meta(batch, q.shape[0], q.device)
    mode, size, rank = meta["mode"], meta["size"], meta["rank"]
    if mode == "ulysses":
        _check_heads(q.shape[1], k.shape[1], size)
    chosen = _resolve(kernel, q, mode, window, cap)
    if group is None and size != 1:
        raise FastpackError(f"group: None, but the batch was sharded for cp_size={size}; "
                            f"pass the context-parallel process group")
    if group is not None:
        g_size, g_rank = int(group.size()), int(group.rank())
        if (g_size, g_rank) != (size, rank):
            raise FastpackError(
                f"group: this process is rank {g_rank} of a group of {g_size}, but the batch "
                f"was sharded for cp_rank={rank} of cp_size={size}"
            )
    if mode == "ulysses":
        return _ulysses(q, k, v, batch, group, size, chosen, softmax_scale, window, cap)
    if chosen == "ring":
        return _ring_attention(q, k, v, batch, group, size, mode, softmax_scale)
    keys, values = _AllGather.apply(k, group), _AllGather.apply(v, group)
    return attend_gathered(q, keys, values, batch, chosen, softmax_scale, window, cap)


def attend_gathered(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    batch: Mapping[str, Any], kernel: str, scale: float | None,
                    window: int | None, softcap: float | None) -> torch.Tensor:
    """One rank's attention once K and V of every rank are gathered in rank order (the
    zigzag and contiguous modes' local step, with kernel ``"flash"`` or ``"sdpa"``): each
    run's keys are taken from them (a slice, or ``cp_k_index``) and the run's queries
    attend to them, causally aligned to the keys' end."""
    device = q.device
    if batch.get("cp_local_k_slice") is not None:  # contiguous, or zigzag on one rank
        k_slice = batch["cp_local_k_slice"]
        keys, values = keys[k_slice], values[k_slice]
    else:
        index = torch.as_tensor(batch["cp_k_index"]).to(device)
        keys, values = keys.index_select(0, index), values.index_select(0, index)
    runs = _RUNS.get(batch, device)  # read on the host once per batch, not per layer
    if kernel == "flash":
        cu_q, cu_k = runs.flash()
        kwargs: dict[str, Any] = {}
        if window is not None:
            kwargs["window_size"] = (window - 1, 0)  # inclusive, as flash-attn counts
        if softcap is not None:
            kwargs["softcap"] = softcap
        # flash-attn (>= 2.1) aligns causal masks and windows to the bottom right when a
        # sequence has more keys than queries: a run's queries are its keys' last ones.
        out: torch.Tensor = _flash()(
            q, keys.contiguous(), values.contiguous(), cu_q, cu_k,
            int(batch["cp_max_seqlen_q"]), int(batch["cp_max_seqlen_k"]), dropout_p=0.0,
            softmax_scale=scale, causal=True, **kwargs,
        )
        return out
    return _runs_sdpa(q, keys, values, runs, scale, window, softcap)


def _ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    batch: Mapping[str, Any], group: Any, size: int, mode: str,
                    scale: float | None) -> torch.Tensor:
    ring = _ring()
    if mode == "contiguous" or batch.get("cp_local_k_slice") is not None:
        # ring-flash-attn's llama3 arrays are the batch's (heads_k_stride: every key/value
        # head in one all-gather, the fastest when memory allows).
        cu_q, cu_k = (torch.as_tensor(batch[key]).to(q.device, torch.int32)
                      for key in ("cp_cu_seqlens_q", "cp_cu_seqlens_k"))
        out: torch.Tensor = ring.llama3_flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, int(batch["cp_max_seqlen_q"]), int(batch["cp_max_seqlen_k"]),
            heads_k_stride=k.shape[1], local_k_slice=batch["cp_local_k_slice"],
            softmax_scale=scale, causal=True, group=group,
        )
        return out
    # Zigzag: ring-flash-attn reads each sequence's local share (both chunks) as one
    # sequence of cu_seqlens_padded / cp tokens.
    padded = torch.as_tensor(batch["cp_cu_seqlens_padded"]).to(q.device, torch.int32)
    out = ring.zigzag_ring_flash_attn_varlen_func(
        q, k, v, padded // size, int(batch["cp_max_seqlen"]) // size, softmax_scale=scale,
        causal=True, group=group,
    )
    return out


def _check_heads(heads: int, kv_heads: int, size: int) -> None:
    if heads % size or (kv_heads % size and size % kv_heads):
        raise FastpackError(
            f"cp_size: {size} does not divide the {heads} query heads, or neither divides "
            f"nor is a multiple of the {kv_heads} key/value heads; Ulysses gives every rank "
            f"heads/cp_size of them: use mode='zigzag' or 'contiguous', or another cp_size"
        )


def _ulysses(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Mapping[str, Any],
             group: Any, size: int, kernel: str, scale: float | None, window: int | None,
             softcap: float | None) -> torch.Tensor:
    kv_heads = k.shape[1]
    if kv_heads % size:
        # Fewer key/value heads than ranks: each rank gets one, repeated (as verl does).
        k, v = _repeat_kv(k, v, size // kv_heads, dim=1)
    qh, kh, vh = (_AllToAll.apply(t, group, True) for t in (q, k, v))
    cu = torch.as_tensor(batch["cp_cu_seqlens_padded"])
    out = varlen_attention(
        qh, kh, vh, cu, int(batch["cp_max_seqlen"]), causal=True, softmax_scale=scale,
        kernel=kernel, validate=False, sliding_window=window, softcap=softcap,  # type: ignore[arg-type]
    )
    result: torch.Tensor = _AllToAll.apply(out, group, False)
    return result
