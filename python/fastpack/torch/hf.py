"""Hugging Face integration: fastpack's per-sequence attention as an attention
implementation of transformers models (:func:`register_hf_attention`), and the
``Trainer`` / TRL ``SFTTrainer`` on many ranks with one global plan
(:class:`PackedTrainerMixin`)."""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch

from .._checks import _choice
from .._context_parallel import CP_MODES
from .._errors import FastpackError, FastpackTypeError
from ..cost import CostModel
from ..vlm import MROPE_FAMILIES
from .attention import KERNELS, Kernel, varlen_attention
from .collator import LOSS_MASK_KEYS, PackedCollator
from .context_parallel import (
    CP_KERNELS,
    ShardMask,
    context_parallel_attention,
    shard_for_context_parallel,
)
from .data import PackedDataset, first_item
from .loss import WEIGHTINGS, packed_loss
from .mixers import _unwrap, current_layout, prepare_model, token_mixers
from .sampler import BALANCES, PackedSampler, Step
from .tree import is_tree_batch, tree_attention, tree_layout

__all__ = [
    "PackedTrainerMixin", "StepBatches", "StepLoader", "check_model_batch",
    "register_hf_attention",
]


def register_hf_attention(
    name: str | None = None,
    *,
    kernel: str = "auto",
    context_parallel_group: Any = None,
    mode: str | None = None,
) -> str:
    """Registers :func:`varlen_attention` as a Hugging Face attention implementation.

    Load or switch the model with ``attn_implementation=name``. It computes exactly what
    the unpacked model computes for every batch :class:`PackedCollator` makes, reading the
    sequence boundaries from what the batch carries:

    * ``cu_seq_lens_q`` (``backend="flash"``): per-sequence attention from it —
      flash-attn, ``torch.nn.attention.varlen`` or flex on CUDA, a per-sequence SDPA loop
      on the CPU — with no ``attention_mask`` and no O(T²) mask;
    * else ``position_ids`` restarting at every sequence (``backend="sdpa" | "eager" |
      "flex"`` with ``mask="position_ids"``): the same per-sequence attention, the
      boundaries read from where the positions restart;
    * else an explicit 4-D mask (``mask="explicit"`` for sdpa / eager) or a padding mask
      (``backend="padded"``, generation, a KV cache): Hugging Face's SDPA over the mask
      (its eager math where the model soft-caps), as ``attn_implementation="sdpa"``.

    The model's ``sliding_window`` and ``softcap`` are honoured on every path (the
    per-sequence kernels take them; a window is added to an explicit mask from the
    positions); a flex ``BlockMask``, packed ``position_ids`` beside a padding mask or a
    KV cache, and attention dropout raise a :class:`~fastpack.FastpackError` instead.
    ``cu_seqlens`` (or the positions' boundaries) are validated once per forward, not
    once per layer.

    ``kernel`` is :func:`varlen_attention`'s (``"auto"``: the fastest that runs; name one
    to force it, say to compare kernels under one model). Returns ``name`` (default
    ``"fastpack_varlen"``).

    **Context parallelism**: with ``context_parallel_group`` (the process group of the ranks
    that share one packed row) it registers
    :func:`~fastpack.torch.context_parallel_attention` instead, for batches that
    :func:`~fastpack.torch.shard_for_context_parallel` made with the same ``mode``
    (``"zigzag"`` by default, ``"contiguous"`` or ``"ulysses"``); ``kernel`` is one of
    :data:`~fastpack.torch.CP_KERNELS`, and ``name`` defaults to ``"fastpack_cp_<mode>"``.
    An unsharded batch raises there, and a sharded one raises in every other attention: in
    a context-parallel one of another mode, and in Hugging Face's mask code before the
    first layer (its ``attention_mask`` is a :class:`~fastpack.torch.ShardMask`).
    Registered with no mask function, so Hugging Face hands it no mask."""
    if context_parallel_group is not None or mode is not None:
        return _register_context_parallel(name, kernel, context_parallel_group, mode)
    if name is None:
        name = "fastpack_varlen"
    if not isinstance(kernel, str) or kernel not in KERNELS:
        raise FastpackError(
            f"kernel: expected one of {', '.join(map(repr, KERNELS))}, got {kernel!r}"
        )
    return _register(name, functools.partial(_attention, cast(Kernel, kernel)), None)


#: The attn_implementation names :func:`register_hf_attention` registered.
_REGISTERED: set[str] = set()
#: Those registered for context parallelism: name -> (group, mode).
_CONTEXT_PARALLEL: dict[str, tuple[Any, str]] = {}


def _register_context_parallel(name: str | None, kernel: Any, group: Any,
                               mode: str | None) -> str:
    if group is None:
        raise FastpackError(
            f"mode: {mode!r} applies to context parallelism; pass context_parallel_group= "
            f"(the process group of the ranks that share a packed row)"
        )
    if not isinstance(group, torch.distributed.ProcessGroup):
        raise FastpackTypeError(
            f"context_parallel_group: expected a torch.distributed.ProcessGroup, got "
            f"{type(group).__name__}"
        )
    mode = _choice("mode", "zigzag" if mode is None else mode, CP_MODES)
    if not isinstance(kernel, str) or kernel not in CP_KERNELS:
        raise FastpackError(
            f"kernel: expected one of {', '.join(map(repr, CP_KERNELS))} with "
            f"context_parallel_group, got {kernel!r}"
        )
    if name is None:
        name = f"fastpack_cp_{mode}"
    return _register(name, functools.partial(_cp_attention, kernel, group, mode), (group, mode))


def _register(name: Any, attend: Callable[..., tuple[torch.Tensor, None]],
              context_parallel: tuple[Any, str] | None) -> str:
    """Registers ``attend(name, module, query, key, value, attention_mask, scaling,
    dropout, kwargs)`` as the attention implementation ``name``, with fastpack's mask
    function; ``context_parallel``: the ``(group, mode)`` it was registered for."""
    if not isinstance(name, str) or not name:
        raise FastpackTypeError(
            f"name: expected a non-empty string (the attn_implementation to register), got "
            f"{type(name).__name__} {name!r}"
        )
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    registered: str = name

    def fastpack_attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        return attend(registered, module, query, key, value, attention_mask, scaling, dropout,
                      kwargs)

    AttentionInterface.register(name, fastpack_attention)
    _REGISTERED.add(name)
    if context_parallel is None:
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, _fastpack_mask)
        _CONTEXT_PARALLEL.pop(name, None)
    else:
        # No mask function: Hugging Face then hands the attention no mask and never reads
        # the shard's attention_mask (a ShardMask, which raises in every other attention).
        ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.pop(name, None)
        _CONTEXT_PARALLEL[name] = context_parallel
    return name


def _cp_attention(
    kernel: str,
    group: Any,
    mode: str,
    name: str,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    if "cp_size" not in kwargs:
        raise FastpackError(
            f"{name}: the batch is not sharded for context parallelism (no cp_size); pass "
            f"fastpack.torch.shard_for_context_parallel(batch, cp_size, cp_rank, "
            f"mode={mode!r}) to the model"
        )
    if kwargs["cp_mode"] != mode:
        raise FastpackError(f"{name}: the batch was sharded with mode={kwargs['cp_mode']!r}, "
                            f"this attention was registered for mode={mode!r}")
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = getattr(module, "is_causal", True)
    rows, heads, width, dim = query.shape
    if not causal or rows != 1 or attention_mask is not None or key.shape[2] != width:
        raise FastpackError(
            f"{name}: context parallelism takes one causal packed row with no "
            f"attention_mask and no KV cache (got {rows} rows, causal={causal}, "
            f"attention_mask {type(attention_mask).__name__}, {key.shape[2]} keys for "
            f"{width} queries); pass the batch of shard_for_context_parallel"
        )
    if dropout and module.training:
        raise FastpackError(f"{name}: attention dropout {dropout} is not supported with "
                            f"context parallelism; set the model's attention dropout to 0")
    device = query.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    out = context_parallel_attention(
        q, k, v, kwargs, group, kernel=kernel, softmax_scale=scaling,
        sliding_window=kwargs.get("sliding_window"), softcap=kwargs.get("softcap"),
    )
    return out[None], None


def _fastpack_mask(
    *,
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: Any = 0,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The model-level mask for fastpack's attention: none where every query sees its
    whole sequence's past (the attention reads the boundaries from the batch, O(T) not
    O(T²)); Hugging Face's SDPA mask otherwise (a padding mask, a KV cache)."""
    from transformers.masking_utils import sdpa_mask

    plain = (attention_mask is None and q_length == kv_length
             and isinstance(q_offset, int) and q_offset == 0)
    if plain:
        return None
    mask: torch.Tensor | None = sdpa_mask(
        batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
        kv_offset=kv_offset, attention_mask=attention_mask, **kwargs,
    )
    if mask is not None:
        _BUILT_MASKS.append((weakref.ref(mask), attention_mask))
    return mask


#: The last masks built by :func:`_fastpack_mask` (a model builds one per layer type),
#: with the padding mask each came from: they already hold the layer's window.
_BUILT_MASKS: deque[tuple[weakref.ref[torch.Tensor], torch.Tensor | None]] = deque(maxlen=8)


def _built_from(mask: torch.Tensor) -> tuple[bool, torch.Tensor | None]:
    """Whether :func:`_fastpack_mask` built ``mask``, and from which padding mask."""
    for ref, padding in _BUILT_MASKS:
        if ref() is mask:
            return True, padding
    return False, None


class _OncePerBatch:
    """Remembers the last batch tensor checked (by identity and in-place version), so a
    forward checks its ``cu_seqlens`` (a host read) once, not in every layer."""

    def __init__(self) -> None:
        self._ref: weakref.ref[torch.Tensor] | None = None
        self._version = -1
        self.value: Any = None

    def hit(self, tensor: torch.Tensor) -> bool:
        return (self._ref is not None and self._ref() is tensor
                and self._version == tensor._version)

    def remember(self, tensor: torch.Tensor, value: Any) -> None:
        self._ref, self._version, self.value = weakref.ref(tensor), tensor._version, value


_CU_CHECKED = _OncePerBatch()
_POSITION_BOUNDS = _OncePerBatch()


def _position_starts(position_ids: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """``[rows, width]`` bool on the host: where a sequence starts — every row start and
    wherever the position does not follow the previous one (Hugging Face's
    ``find_packed_sequence_indices`` rule)."""
    host = position_ids.detach().to("cpu", torch.int64)
    if host.ndim == 3 and host.shape[0] == 4:
        host = host[0]  # mRoPE [4, B, T]: row 0 is the text position, where documents restart
    elif host.ndim == 3:
        raise FastpackError(
            f"position_ids: got shape {tuple(position_ids.shape)}: 3-D positions without the "
            f"text row (expected [4, batch, tokens], row 0 restarting in every document), so "
            f"the documents' boundaries cannot be read; build the batch with "
            f"PackedCollator(model_config=...)"
        )
    if host.ndim == 1:
        host = host[None]
    if host.ndim != 2 or host.shape[-1] != width or host.shape[0] not in (1, rows):
        raise FastpackError(
            f"position_ids: expected shape (batch, {width}) for {rows} rows of {width} "
            f"tokens, got {tuple(position_ids.shape)}"
        )
    host = host.expand(rows, width)
    starts = torch.ones(rows, width, dtype=torch.bool)
    starts[:, 1:] = host[:, 1:] - host[:, :-1] != 1
    return starts


def _position_bounds(
    position_ids: torch.Tensor, rows: int, width: int, device: torch.device
) -> tuple[torch.Tensor, int]:
    """``cu_seqlens`` (int32 on ``device``) and the longest sequence of ``rows`` rows laid
    end to end, the boundaries read from the positions; once per forward."""
    key = (rows, width, device)
    if _POSITION_BOUNDS.hit(position_ids) and _POSITION_BOUNDS.value[0] == key:
        return _POSITION_BOUNDS.value[1]  # type: ignore[no-any-return]
    begin = torch.nonzero(_position_starts(position_ids, rows, width).reshape(-1))[:, 0]
    cu = torch.cat([begin, torch.tensor([rows * width])])
    longest = int((cu[1:] - cu[:-1]).max()) if width else 0
    result = (cu.to(device=device, dtype=torch.int32), longest)
    _POSITION_BOUNDS.remember(position_ids, (key, result))
    return result


def _packed_under_padding(
    position_ids: torch.Tensor, padding: torch.Tensor, rows: int, width: int
) -> bool:
    """Whether two real (unpadded) neighbours of a row belong to different sequences by
    their positions: packed rows that a padding mask would let attend to each other."""
    if _PADDING_CHECKED.hit(position_ids):
        return bool(_PADDING_CHECKED.value)
    real = padding.detach().to("cpu", torch.bool)[:, -width:].expand(rows, width)
    starts = _position_starts(position_ids, rows, width)
    packed = bool((starts[:, 1:] & real[:, 1:] & real[:, :-1]).any())
    _PADDING_CHECKED.remember(position_ids, packed)
    return packed


_PADDING_CHECKED = _OncePerBatch()


def _attention(
    kernel: Kernel,
    name: str,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    if "cp_size" in kwargs:
        raise FastpackError(
            f"{name}: a context-parallel batch (cp_mode={kwargs.get('cp_mode')!r}, "
            f"cp_size={kwargs['cp_size']}) holds one rank's tokens; it needs the attention "
            f"register_hf_attention(context_parallel_group=group, mode=...) registers"
        )
    window = kwargs.pop("sliding_window", None)
    if window is None:
        window = _layer_window(module)
    sinks = kwargs.pop("s_aux", None)
    softcap = kwargs.pop("softcap", None)
    causal = kwargs.pop("is_causal", None)
    if causal is None:
        causal = getattr(module, "is_causal", True)
    if sinks is not None:
        return _with_sinks(name, module, query, key, value, attention_mask, scaling, dropout,
                           causal, window, softcap, sinks, kwargs)
    rows, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    position_ids = kwargs.get("position_ids")
    if kwargs.get("tree_parents") is not None:
        return _tree(name, kernel, module, query, key, value, kwargs, scaling, dropout, causal,
                     window, softcap)
    if cu_seqlens is not None and not causal and (
            rows != 1 or q_len != int(cu_seqlens[-1])):
        # Not the packed row: an encoder inside the model (LLaVA's CLIP tower) that Hugging
        # Face handed the text row's kwargs. Its rows are its own sequences (an image
        # each), bidirectional, as sdpa computes them. Causal calls never take this way.
        return _dense(name, module, query, key, value, attention_mask, scaling, dropout,
                      False, softcap, kwargs)
    if cu_seqlens is not None:
        cu_k = kwargs.get("cu_seq_lens_k")
        if cu_k is not None and cu_k is not cu_seqlens and not torch.equal(
            cu_k.detach().cpu(), cu_seqlens.detach().cpu()
        ):
            raise FastpackError(f"{name}: cu_seq_lens_k differs from cu_seq_lens_q; packed "
                                f"queries and keys must share their boundaries")
        if rows != 1:
            raise FastpackError(
                f"{name}: expected one packed row (batch size 1), got {rows} rows; use "
                f"PackedCollator(backend='flash') (cu_seq_lens_q spans one row)"
            )
        if kv_len != q_len or attention_mask is not None:
            raise FastpackError(
                f"{name}: a packed row (cu_seq_lens_q) takes no KV cache and no "
                f"attention_mask (got {kv_len} keys for {q_len} queries, attention_mask "
                f"{type(attention_mask).__name__}); pass use_cache=False"
            )
        max_len = int(kwargs["max_length_q"])
        return _packed(name, kernel, module, query, key, value, cu_seqlens, max_len, causal,
                       scaling, dropout, window, softcap)
    if attention_mask is None and q_len == kv_len:
        if position_ids is None and not causal:
            # A bidirectional call with no boundaries is one whole sequence: a vision
            # encoder's image (Qwen-VL towers call once per image).
            return _dense(name, module, query, key, value, None, scaling, dropout, False,
                          softcap, kwargs)
        active = current_layout(rows, q_len) if position_ids is None and causal else None
        if active is not None:  # a prepared model's batch: its boundaries, read once
            cu, longest = active
            return _packed(name, kernel, module, query, key, value,
                           cu.to(device=query.device, dtype=torch.int32), longest, causal,
                           scaling, dropout, window, softcap, validate=False)
        if position_ids is None:
            raise FastpackError(
                f"{name}: {type(module).__name__} passed neither cu_seq_lens_q nor "
                f"position_ids to the attention, so the sequence boundaries cannot be seen; "
                f"use PackedCollator(backend='flash')"
            )
        cu, longest = _position_bounds(position_ids, rows, q_len, query.device)
        return _packed(name, kernel, module, query, key, value, cu, longest, causal, scaling,
                       dropout, window, softcap, validate=False)  # valid by construction
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise FastpackError(
            f"{name}: attention_mask is a {type(attention_mask).__name__} (a flex BlockMask "
            f"from PackedCollator(backend='flex', mask='explicit')?); use "
            f"attn_implementation='flex_attention' for it, or backend='flash' / "
            f"mask='position_ids' with {name}"
        )
    built, padding = (False, None) if attention_mask is None else _built_from(attention_mask)
    if attention_mask is not None and not built:
        # A mask the batch brought (mask="explicit"): block-diagonal and causal, but
        # without the layer's window, which Hugging Face does not add to a 4-D mask.
        if attention_mask.ndim != 4:
            raise FastpackError(
                f"{name}: expected a 4-D attention_mask, got shape "
                f"{tuple(attention_mask.shape)}"
            )
        if window is not None:
            attention_mask = _with_window(name, attention_mask, position_ids, q_len, kv_len,
                                          window)
    elif (padding is not None and position_ids is not None and q_len == kv_len
          and _packed_under_padding(position_ids, padding, rows, q_len)):
        raise FastpackError(
            f"{name}: position_ids restart inside a row while a padding attention_mask is "
            f"given: the mask would let the row's sequences attend to each other. Pass no "
            f"attention_mask with packed rows (PackedCollator does not)"
        )
    return _dense(name, module, query, key, value, attention_mask, scaling, dropout, causal,
                  softcap, kwargs)


def _with_sinks(
    name: str,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None,
    dropout: float,
    causal: bool,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    """Attention with sinks (GPT-OSS's ``s_aux``: one more logit per head in every query's
    softmax, its value zero), the eager math per sequence of a packed row, or over a row
    with its mask."""
    if dropout and module.training:
        raise FastpackError(f"{name}: attention dropout {dropout} with attention sinks is not "
                            f"supported; set the model's attention dropout to 0")
    rows, heads, width, dim = query.shape
    if kwargs.get("tree_parents") is not None or "cp_size" in kwargs:
        raise FastpackError(f"{name}: attention sinks on a tree or context-parallel batch "
                            f"are not supported")
    cu = kwargs.get("cu_seq_lens_q")
    position_ids = kwargs.get("position_ids")
    if attention_mask is not None or key.shape[2] != width:
        if not isinstance(attention_mask, torch.Tensor | None):
            raise FastpackError(f"{name}: attention sinks with a "
                                f"{type(attention_mask).__name__} mask are not supported")
        if attention_mask is not None and window and not _built_from(attention_mask)[0]:
            # the batch's own mask (mask="explicit") has no window: add it
            attention_mask = _with_window(name, attention_mask, position_ids, width,
                                          key.shape[2], window)
        out = _eager(query, key, value, attention_mask, scaling, causal and attention_mask is None,
                     softcap, sinks, None)
        return out.transpose(1, 2).contiguous(), None
    if cu is not None:
        bounds = cu.detach().to("cpu", torch.int64)
    elif position_ids is not None:
        bounds = _position_bounds(position_ids, rows, width, torch.device("cpu"))[0].long()
    else:
        active = current_layout(rows, width)
        bounds = active[0] if active is not None else torch.arange(rows + 1) * width
    # (rows, heads, width, dim) -> (1, heads, rows * width, dim): the rows end to end
    q, k, v = (t.transpose(0, 1).reshape(1, t.shape[1], rows * width, dim)
               for t in (query, key, value))
    pieces = [_eager(q[:, :, b:e], k[:, :, b:e], v[:, :, b:e], None, scaling, causal, softcap,
                     sinks, window)
              for b, e in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True) if e > b]
    out = torch.cat(pieces, dim=2).reshape(heads, rows, width, dim)
    return out.permute(1, 2, 0, 3).contiguous(), None


def _eager(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    causal: bool,
    softcap: float | None,
    sinks: torch.Tensor | None,
    window: int | None,
) -> torch.Tensor:
    """Hugging Face's eager attention math, ``(B, heads, q, D)`` out: soft-capped scores,
    a mask (or causal, the queries the last keys), a sliding window, and sinks."""
    q_len, kv_len = query.shape[2], key.shape[2]
    groups = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(groups, dim=1) if groups > 1 else t for t in (key, value))
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None and (causal or window) and q_len > 1:  # the queries are the last keys
        idx = torch.arange(kv_len, device=query.device)
        distance = idx[kv_len - q_len:, None] - idx[None, :]
        mask = distance >= 0 if causal else torch.ones_like(distance, dtype=torch.bool)
        if window:
            mask = mask & (distance < window)
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    if sinks is not None:
        sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sink], dim=-1)
    work = torch.promote_types(query.dtype, torch.float32)
    probs = torch.softmax(scores, dim=-1, dtype=work).to(query.dtype)
    if sinks is not None:
        probs = probs[..., :-1]  # the sink's value is zero
    return torch.matmul(probs, value)


def _layer_window(module: torch.nn.Module) -> int | None:
    """The window of a sliding layer whose model keeps it in the layer and its mask only
    (Qwen2-MoE passes no ``sliding_window`` keyword): the layer's ``sliding_window`` where
    the config's ``layer_types`` say the layer slides."""
    window = getattr(module, "sliding_window", None)
    layer = getattr(module, "layer_idx", None)
    types = getattr(getattr(module, "config", None), "layer_types", None)
    if not window or layer is None or types is None or not 0 <= layer < len(types):
        return None
    return int(window) if types[layer] == "sliding_attention" else None


def _packed_inputs(
    name: str, module: torch.nn.Module, dropout: float, query: torch.Tensor,
    key: torch.Tensor, value: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of a packed batch (per sequence or a tree): dropout refused (it would be
    dropped), cast to the autocast dtype as SDPA does under autocast."""
    if dropout and module.training:
        raise FastpackError(
            f"{name}: attention dropout {dropout} is not supported on packed batches; "
            f"set the model's attention dropout to 0"
        )
    device = query.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    return query, key, value


def _packed(
    name: str,
    kernel: Kernel,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int,
    causal: bool,
    scaling: float | None,
    dropout: float,
    window: int | None,
    softcap: float | None,
    validate: bool = True,
) -> tuple[torch.Tensor, None]:
    query, key, value = _packed_inputs(name, module, dropout, query, key, value)
    rows, heads, width, dim = query.shape
    shape = (rows * width, max_len)
    validate = validate and not (
        isinstance(cu_seqlens, torch.Tensor) and _CU_CHECKED.hit(cu_seqlens)
        and _CU_CHECKED.value == shape
    )
    # Hugging Face hands (B, heads, W, D); varlen_attention takes (B * W, heads, D).
    q, k, v = (t.transpose(1, 2).reshape(rows * width, t.shape[1], dim)
               for t in (query, key, value))
    out = varlen_attention(
        q, k, v, cu_seqlens, max_len, causal=bool(causal), softmax_scale=scaling,
        kernel=kernel, validate=validate, sliding_window=window, softcap=softcap,
    )
    if validate and isinstance(cu_seqlens, torch.Tensor):
        _CU_CHECKED.remember(cu_seqlens, shape)
    return out.reshape(rows, width, heads, dim), None  # as Hugging Face's sdpa returns


def _tree(
    name: str,
    kernel: Kernel,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kwargs: dict[str, Any],
    scaling: float | None,
    dropout: float,
    causal: bool,
    window: int | None,
    softcap: float | None,
) -> tuple[torch.Tensor, None]:
    """A tree batch (``share_prefix=True``): each token over its path and its own past."""
    rows, heads, width, dim = query.shape
    if rows != 1 or key.shape[2] != width:
        raise FastpackError(
            f"{name}: a tree batch is one row with no KV cache; got {rows} rows and "
            f"{key.shape[2]} keys for {width} queries (pass use_cache=False)"
        )
    if not causal:
        raise FastpackError(f"{name}: a tree batch needs causal attention (a decoder)")
    query, key, value = _packed_inputs(name, module, dropout, query, key, value)
    positions = kwargs.get("position_ids")
    layout = tree_layout(kwargs["tree_cu_seqlens"], kwargs["tree_parents"], width, positions)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, heads, D)
    out = tree_attention(
        q, k, v, layout, softmax_scale=scaling, kernel=kernel, sliding_window=window,
        softcap=softcap, positions=positions,
    )
    return out.reshape(1, width, heads, dim), None


def _with_window(
    name: str,
    mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    q_len: int,
    kv_len: int,
    window: int,
) -> torch.Tensor:
    if position_ids is None or q_len != kv_len:
        raise FastpackError(
            f"{name}: an explicit 4-D attention_mask on a sliding-window layer "
            f"(sliding_window={window}) needs position_ids and no KV cache to add the window"
        )
    pos = position_ids.to(mask.device)
    if pos.ndim == 1:
        pos = pos[None]
    # Inside a sequence positions count tokens, and the mask already keeps sequences apart.
    distance = pos[:, None, :, None] - pos[:, None, None, :]
    inside = distance < window
    if mask.dtype == torch.bool:
        return mask & inside
    return mask.masked_fill(~inside, torch.finfo(mask.dtype).min)


def _dense(
    name: str,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float,
    causal: bool,
    softcap: float | None,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    """Attention over a whole row with a mask (one sequence a row, or an explicit mask):
    Hugging Face's SDPA, or its eager math where the model soft-caps (SDPA cannot)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs = {k: v for k, v in kwargs.items() if k not in _PACKED_KWARGS}
    if softcap is None:
        out, _ = sdpa_attention_forward(module, query, key, value, mask, dropout=dropout,
                                        scaling=scaling, is_causal=causal, **kwargs)
        return out, None
    if dropout and module.training:
        raise FastpackError(
            f"{name}: attention dropout {dropout} with soft-capping is not supported; set "
            f"the model's attention dropout to 0"
        )
    out = _eager(query, key, value, mask, scaling, causal, softcap, None, None)
    return out.transpose(1, 2).contiguous(), None


#: Attention kwargs of the packed formats, which Hugging Face's SDPA does not take.
_PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
                  "position_ids")


# ------------------------------------------------------------------- batch check

#: Hugging Face's attention implementations that take a 4-D tensor mask, by mask dtype.
_TENSOR_MASK_IMPLS = {True: ("sdpa",), False: ("sdpa", "eager")}


def _config_of(model: Any) -> Any:
    inner = _unwrap(model)  # DDP / FSDP wrappers, torch.compile
    config = getattr(inner, "config", None)
    if config is None:
        raise FastpackTypeError(
            f"model: expected a Hugging Face model (with a .config), got {type(model).__name__}"
        )
    return config


def _window(config: Any) -> int | None:
    """The model's sliding window where some layer uses one, else ``None``."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def _check_router_loss(config: Any, batch: dict[str, Any], mask: Any,
                       refuse: Callable[[str, str], None]) -> None:
    """Hugging Face's MoE router loss (``output_router_logits=True``) averages over every
    token of the batch that its ``attention_mask`` does not exclude: packed rows padded to
    the longest carry no mask, so their padding would count as tokens routed."""
    if not getattr(config, "output_router_logits", False) or mask is not None:
        return
    real, ids = batch.get("sample_tokens"), batch.get("input_ids")
    if not isinstance(real, torch.Tensor) or not isinstance(ids, torch.Tensor):
        return
    padding = ids.numel() - real.numel()  # sample_tokens: each sample token's place
    if padding > 0 and "tree_parents" not in batch:
        refuse(f"rows holding {padding} padding token(s) and the router's auxiliary loss "
               f"(output_router_logits=True)",
               "Hugging Face averages that loss over every token of the rows, padding "
               "included, with no attention_mask to leave it out: use backend='flash' (one "
               "row, no padding) or output_router_logits=False")


def check_model_batch(model: Any, batch: dict[str, Any]) -> None:
    """Raises a :class:`~fastpack.FastpackError` when ``model(**batch)`` would not compute
    what the unpacked model computes for this batch format and the model's
    ``attn_implementation``; returns ``None`` when it would.

    Call it on the first batch (it is cheap: shapes and dtypes; the data only for
    ``position_ids`` beside a 2-D ``attention_mask``) in a plain training loop;
    :class:`PackedTrainerMixin` calls it on every batch. What it refuses, each silently
    wrong in Hugging Face (fastpack's own attention refuses or handles these itself):

    * an explicit mask (``mask="explicit"``) for an implementation that reads it
      otherwise: a bool mask for ``"eager"`` (added as 0/1), a tensor mask for
      ``"flex_attention"`` or a flex ``BlockMask`` for anything but ``"flex_attention"``;
    * an explicit mask on a model with sliding-window layers whose window is shorter than
      the row (Hugging Face uses a 4-D mask as is, so the window is dropped) — except
      for fastpack's attention, which adds the window from the positions;
    * packed rows (``position_ids`` restarting inside a row) with an ``attention_mask``,
      or with ``use_cache`` on, on a Hugging Face implementation: it then skips the
      per-sequence mask;
    * rows of packed sequences without ``cu_seq_lens_q`` for ``flash_attention_*``, which
      reads the boundaries from the positions of a single row only;
    * a tree batch (``share_prefix=True``) for anything but fastpack's attention and
      ``"flex_attention"`` (and for flex, on sliding-window layers whose window is shorter
      than a path: the batch's ``BlockMask`` has no window).
    * a context-parallel batch (:func:`~fastpack.torch.shard_for_context_parallel`) for
      anything but a context-parallel attention of its mode
      (``register_hf_attention(context_parallel_group=..., mode=...)``) — every other
      attention would attend within one rank's tokens — and an unsharded batch for one;
    * packed rows with padding for an MoE model that returns its router loss
      (``output_router_logits=True``): Hugging Face would average it over the padding;
    * for mRoPE models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): ``position_ids`` of 3 rows (no
      text row: the model then builds no per-document mask) or 2-D beside media (no
      mRoPE for the images); ``PackedCollator(model_config=...)`` gives ``[4, rows,
      width]``.
    """
    if not isinstance(batch, dict):
        raise FastpackTypeError(f"batch: expected a dict, got {type(batch).__name__}")
    config = _config_of(model)
    impl = getattr(config, "_attn_implementation", None) or "eager"
    ours = impl in _REGISTERED
    mask = batch.get("attention_mask")
    positions = batch.get("position_ids")
    window = _window(config)
    mrope = getattr(config, "model_type", None) in MROPE_FAMILIES

    def refuse(what: str, fix: str) -> None:
        raise FastpackError(f"batch: {what} with attn_implementation={impl!r} "
                            f"({type(config).__name__}) would not compute the unpacked "
                            f"model; {fix}")

    if _packs_sequences(batch):
        _check_mixing(model, config, batch, impl, ours, refuse)
    _check_router_loss(config, batch, mask, refuse)

    sharded = "cp_size" in batch
    if sharded or impl in _CONTEXT_PARALLEL:
        registered = _CONTEXT_PARALLEL.get(impl)
        if not sharded:
            mode = registered[1] if registered else "zigzag"
            refuse("a batch not sharded for context parallelism",
                   f"pass fastpack.torch.shard_for_context_parallel(batch, cp_size, "
                   f"cp_rank, mode={mode!r})")
        elif registered is None:
            refuse(f"a context-parallel batch (cp_mode={batch.get('cp_mode')!r}, one rank's "
                   f"tokens)", "use register_hf_attention(context_parallel_group=group, "
                   f"mode={batch.get('cp_mode')!r}) as the attn_implementation")
        elif registered[1] != batch.get("cp_mode"):
            refuse(f"a context-parallel batch sharded with mode={batch.get('cp_mode')!r}",
                   f"shard with mode={registered[1]!r}, the attention's")
        return

    if is_tree_batch(batch):
        if ours:
            return
        if impl != "flex_attention":
            refuse("a tree batch (share_prefix=True)",
                   "use attn_implementation=register_hf_attention() or 'flex_attention'")
        longest = int(torch.as_tensor(positions).max()) + 1 if positions is not None else 0
        if window is not None and longest > window:
            refuse(f"a tree batch with paths of {longest} tokens on sliding-window layers "
                   f"(sliding_window={window}: Hugging Face's flex attention uses the "
                   f"batch's BlockMask as it is)",
                   "use attn_implementation=register_hf_attention(), which honours the window")
        return

    if isinstance(positions, torch.Tensor) and positions.ndim == 3:
        if positions.shape[0] != 4:
            refuse(f"position_ids of shape {tuple(positions.shape)} (mRoPE rows without the "
                   f"text row, so no per-document mask)",
                   "build the batch with PackedCollator(model_config=model.config): "
                   "[4, rows, width], row 0 the text position")
        positions = positions[0]  # the text row: where documents restart
    elif mrope and isinstance(positions, torch.Tensor) and (
            "image_grid_thw" in batch or "video_grid_thw" in batch):
        refuse("2-D position_ids beside images or videos (no mRoPE for them)",
               "build the batch with PackedCollator(model_config=model.config)")
    if mask is not None and getattr(mask, "ndim", len(getattr(mask, "shape", ()))) == 4:
        from torch.nn.attention.flex_attention import BlockMask

        if isinstance(mask, BlockMask):
            if impl != "flex_attention":
                refuse("a flex BlockMask (mask='explicit', backend='flex')",
                       "use attn_implementation='flex_attention', or mask='position_ids'")
        elif ours:
            return
        elif impl not in _TENSOR_MASK_IMPLS[mask.dtype == torch.bool]:
            kind = "bool" if mask.dtype == torch.bool else "additive float"
            refuse(f"an explicit {kind} 4-D mask",
                   "use the collator backend that matches the model's attn_implementation")
        width = int(mask.shape[-1])
        if window is not None and width > window:
            refuse(f"an explicit mask over rows of {width} tokens on sliding-window layers "
                   f"(sliding_window={window})",
                   "use mask='position_ids' (the default) or backend='flash'")
        return
    blind = None if ours or not _packs_sequences(batch) else _mask_builder(model, "omitted")
    if blind is not None:
        refuse(f"packed rows on a model that builds its attention mask without position_ids "
               f"({blind}: every token would see the whole row)",
               "use attn_implementation=register_hf_attention() with prepare_model(model), "
               "or an explicit mask (mask='explicit')")
    if ours or "cu_seq_lens_q" in batch or positions is None:
        return
    if not isinstance(positions, torch.Tensor):
        return
    rows = positions.reshape(-1, positions.shape[-1])
    starts = rows[:, 1:] - rows[:, :-1] != 1
    if mask is not None:
        real = torch.as_tensor(mask).to(torch.bool).reshape(rows.shape)
        starts &= real[:, 1:] & real[:, :-1]
        if bool(starts.any()):
            refuse("packed rows (position_ids restart inside a row) with a 2-D "
                   "attention_mask", "pass no attention_mask (PackedCollator does not)")
        return
    if not bool(starts.any()):
        return
    cache = batch.get("use_cache", getattr(config, "use_cache", False))
    if cache or batch.get("past_key_values") is not None:
        refuse("packed rows with use_cache on", "pass use_cache=False (PackedCollator does)")
    if impl.startswith("flash_attention") and rows.shape[0] > 1:
        refuse(f"{rows.shape[0]} packed rows without cu_seq_lens_q",
               "use PackedCollator(backend='flash')")


def _packs_sequences(batch: dict[str, Any]) -> bool:
    """Whether a row of the batch holds more than one sequence (or a tree, or a piece of
    one shared by context-parallel ranks): where a layer that mixes tokens along the row
    must keep them apart."""
    if is_tree_batch(batch) or "cp_size" in batch:
        return True
    cu = batch.get("cu_seq_lens_q")
    if cu is not None:
        return len(cu) > 2
    mask = batch.get("attention_mask")
    if mask is not None and getattr(mask, "ndim", 2) == 4:
        return True  # an explicit mask: block-diagonal rows
    positions = batch.get("position_ids")
    if not isinstance(positions, torch.Tensor):
        return False
    if positions.ndim == 3:
        positions = positions[0]
    rows = positions.reshape(-1, positions.shape[-1])
    starts = rows[:, 1:] - rows[:, :-1] != 1
    if isinstance(mask, torch.Tensor) and mask.ndim == 2:
        real = mask.to(torch.bool).reshape(rows.shape)
        starts &= real[:, 1:] & real[:, :-1]
    return bool(starts.any())


#: Module classes, by name, that mix tokens along the sequence beyond softmax attention
#: and that fastpack does not keep apart (a new architecture is refused until proven).
_MIXING_NAMES = re.compile(
    r"Mamba|Mixer|ShortConv|DeltaNet|DeltaAttention|LinearAttention|Lightning|Recurrent|"
    r"Rwkv|RWKV|Retention|Hyena|SSM|Rglru|RgLru|Xlstm|xLSTM|TimeMix", re.ASCII)
#: Classes that hold layers rather than mix tokens themselves (their layers are checked).
_CONTAINERS = re.compile(r"(Model|For[A-Z]\w*|Block|DecoderLayer|MLP|Experts|Norm|Output)$")
#: Softmax attention (through the attention interface) whose class name reads like a mixer.
_SOFTMAX_ATTENTION = ("KimiLinearAttention",)
#: Parameters of a recurrent state (Mamba's decay and step, RWKV's decay).
_STATE_PARAMETERS = ("A_log", "dt_bias", "time_decay", "time_first", "recurrent_param")
#: Submodules that run on the media of a vision-language or audio batch, not on its row.
_MEDIA_TOWERS = re.compile(r"(^|\.)(visual|vision_tower|vision_model|vision_encoder|"
                           r"audio_tower|audio_model|audio_encoder|audio_embed|"
                           r"embed_tokens_extend|multi_modal_projector)(\.|$)")
#: Hugging Face's mask builders: given ``position_ids`` they keep packed sequences apart.
_MASK_BUILDERS = re.compile(r"create_\w*causal_mask$", re.ASCII)
#: Model types that cannot keep packed sequences apart, and why (found by the sweep of
#: every causal LM transformers registers: silently different on packed rows).
_NOT_PACKABLE = {
    "openai-gpt": "its attention adds its own causal bias over the whole row",
    "xglm": "its sinusoidal positions are offset from the row's padding",
    "xlm": "its attention masks and positions run over the whole row",
    "xlnet": "its relative attention runs over the whole row",
    "cpmant": "its position bias runs over the whole row",
    "reformer": "its LSH / axial attention and positions run over the whole row",
    "prophetnet": "its n-gram attention runs over the whole row",
    "big_bird": "its bidirectional attention is its own, not the attention interface: every "
                "token sees the whole row",
    "megatron-bert": "its bidirectional attention is its own, not the attention interface: "
                     "every token sees the whole row",
    "rembert": "its bidirectional attention is its own, not the attention interface: every "
               "token sees the whole row",
}
#: Model types that keep a text-only packed row apart (Hugging Face's attentions) but not one
#: beside images, and why.
_NOT_PACKABLE_WITH_MEDIA = {
    "git": "its image tokens are one prefix of the row, which every sequence of the row sees",
}
#: Token-mixing classes that keep packed sequences apart themselves (checked by the sweep).
_KEEPS_APART = {
    "InklingShortConvolution": "masks its window with the model's conv_mask",
}
#: Sparse-attention indexers that select keys per document from Hugging Face's 4-D mask
#: (read in their source; exact in the sweep with budgets smaller than its samples). The
#: others take ``torch.topk`` over the row, whose ties (ReLU scores are often exactly 0)
#: fall on other keys once the sequence sits elsewhere in the row: AXK2 and HY-V4 are
#: exact in the sweep with ``index_topk=4`` by luck, 0.06 / 4e-3 off with 2.
_INDEXES_PER_DOCUMENT = {
    "Kolibri1_1Indexer": "groups queries by their first visible key and breaks ties "
                         "towards that document's earlier keys",
}
#: Model types whose attention adds ALiBi biases outside the attention interface.
_ALIBI_TYPES = ("bloom", "mpt")


#: What :func:`_mask_positions` and :func:`_own_mask` read from each class's source.
_SOURCE_FACTS: dict[type, tuple[str | None, bool, bool]] = {}


def _source_facts(cls: type) -> tuple[str | None, bool, bool]:
    """:func:`_mask_positions`, :func:`_own_mask` and :func:`_own_softmax` of ``cls``,
    parsed once per class."""
    facts = _SOURCE_FACTS.get(cls)
    if facts is None:
        facts = _SOURCE_FACTS[cls] = (_mask_positions(cls), _own_mask(cls),
                                      _own_softmax(cls))
    return facts


def _own_softmax(cls: type) -> bool:
    """Whether ``cls.forward`` takes a softmax itself and calls no attention interface
    (GIT's text attention: the registered attention never runs there)."""
    tree = _forward_tree(cls)
    if tree is None:
        return False
    calls = {_call_name(node) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    return "softmax" in calls and "attention_interface" not in calls


def _forward_tree(cls: type) -> ast.FunctionDef | None:
    """The syntax tree of a module class's ``forward``, its own or inherited (``None``
    where its source is not readable: compiled or built at run time)."""
    forward = getattr(cls, "forward", None)  # inherited: the parent's runs
    if forward is None:
        return None
    try:
        node = ast.parse(textwrap.dedent(inspect.getsource(forward))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    return node if isinstance(node, ast.FunctionDef) else None


def _call_name(node: ast.Call) -> str:
    func = node.func
    return func.id if isinstance(func, ast.Name) else (
        func.attr if isinstance(func, ast.Attribute) else "")


def _mask_positions(cls: type) -> str | None:
    """How ``cls.forward`` gives Hugging Face's mask builders the positions: ``"omitted"``
    where no builder call gets any (the mask then spans the whole row), ``"none"`` where
    one gets ``position_ids=None`` on purpose (a mask over a sequence of the model's own,
    e.g. BLT's patches of the row's bytes), else ``None`` (positions given, or no mask
    built)."""
    tree = _forward_tree(cls)
    if tree is None:
        return None
    literals = {}  # mask_kwargs = {...}: the keys of dicts the calls unpack
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and (
                len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            literals[node.targets[0].id] = {
                k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    calls = given = 0
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and _MASK_BUILDERS.match(_call_name(node))):
            continue
        calls += 1
        for kw in node.keywords:
            if kw.arg == "position_ids":
                if isinstance(kw.value, ast.Constant) and kw.value.value is None:
                    return "none"
                given += 1
            elif kw.arg is None and not (isinstance(kw.value, ast.Name) and (
                    "position_ids" not in literals.get(kw.value.id, {"position_ids"}))):
                given += 1  # **kwargs that hold, or may hold, the positions
    return "omitted" if calls and not given else None


def _mask_builder(model: Any, how: str) -> str | None:
    """The first module (``"path (Class)"``) whose forward builds its attention mask with
    positions ``how`` (see :func:`_mask_positions`), else ``None``."""
    inner = _unwrap(model)
    if not isinstance(inner, torch.nn.Module):
        return None
    for path, module in inner.named_modules():
        if not _MEDIA_TOWERS.search(path) and _source_facts(type(module))[0] == how:
            return f"{path or 'the model'} ({type(module).__name__})"
    return None


def _own_mask(cls: type) -> bool:
    """Whether ``cls.forward`` hands its attention a mask it computes itself (Doge's
    dynamic mask: a bias per key and a top-k over the keys), not the one it was given."""
    tree = _forward_tree(cls)
    if tree is None:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _call_name(node) == "attention_interface":
            for kw in node.keywords:
                if kw.arg == "attention_mask" and not (
                        isinstance(kw.value, ast.Constant) and kw.value.value is None) and not (
                        isinstance(kw.value, ast.Name) and kw.value.id == "attention_mask"):
                    return True
    return False


def _takes_positions(model: torch.nn.Module) -> bool:
    """Whether ``model(position_ids=...)`` reaches its layers: a ``position_ids``
    parameter, or ``**kwargs`` passed on to a stack of layers (a module holding a
    ``ModuleList``) that takes them (Whisper's decoder, a multimodal model's language
    model)."""
    params = inspect.signature(model.forward).parameters
    if "position_ids" in params:
        return True
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return False
    for path, module in model.named_modules():
        if not path or _MEDIA_TOWERS.search(path):
            continue
        if any(isinstance(c, torch.nn.ModuleList) for c in module.children()) and (
                "position_ids" in inspect.signature(module.forward).parameters):
            return True
    return False


def _mixing_reason(module: torch.nn.Module) -> str | None:
    """Why ``module`` mixes tokens along the sequence (by its class and what it holds),
    or ``None``."""
    cls = type(module).__name__
    for child in module.children():
        if isinstance(child, torch.nn.Conv1d) and child.kernel_size[0] > 1:
            return (f"it convolves over the sequence (Conv1d, kernel {child.kernel_size[0]}): "
                    f"the window reads the previous sequence's tokens")
    for name, _ in module.named_parameters(recurse=False):
        if name in _STATE_PARAMETERS:
            return f"it carries a recurrent state along the sequence (parameter {name})"
    if _MIXING_NAMES.search(cls) and not _CONTAINERS.search(cls) and (
            cls not in _SOFTMAX_ATTENTION):
        return "its class is a token mixer fastpack does not know"
    return None


def _check_mixing(model: Any, config: Any, batch: dict[str, Any], impl: str, ours: bool,
                  refuse: Callable[[str, str], None]) -> None:
    """Refuses a packed batch for a model with a layer that would mix its sequences: a
    known token mixer :func:`~fastpack.torch.prepare_model` has not prepared (or one it
    cannot keep apart on this batch), any other module that mixes tokens, ALiBi, attention
    a mask over a sequence of the model's own or computed in a layer, and bidirectional
    attention."""
    from .mixers import MIXERS, is_prepared

    kind = getattr(config, "model_type", None)
    if kind in _ALIBI_TYPES or getattr(config, "alibi", False):
        refuse(f"packed rows on a model with ALiBi position biases ({kind})",
               "fastpack does not add ALiBi per sequence (the biases run across the row); "
               "use PackedCollator(backend='padded')")
    if kind in _NOT_PACKABLE:
        refuse(f"packed rows on {kind} ({_NOT_PACKABLE[kind]})",
               "use PackedCollator(backend='padded') for this model")
    if kind in _NOT_PACKABLE_WITH_MEDIA and "pixel_values" in batch:
        refuse(f"packed rows with pixel_values on {kind} ({_NOT_PACKABLE_WITH_MEDIA[kind]})",
               "pack text only, or use PackedCollator(backend='padded') for this model")
    if ours and getattr(config, "attention_chunk_size", None):
        refuse(f"packed rows on a model with chunked attention (attention_chunk_size="
               f"{config.attention_chunk_size}: fastpack's attention does not add the chunks)",
               "use attn_implementation='sdpa' or 'eager' with PackedCollator(backend='sdpa')")
    inner = _unwrap(model)
    if not isinstance(inner, torch.nn.Module):
        return
    prepared = is_prepared(inner)
    forward = getattr(inner, "forward", None)
    attends = any("Attention" in type(m).__name__ for m in inner.modules())
    if attends and forward is not None and not _takes_positions(inner):
        refuse(f"packed rows on a model that takes no position_ids ({type(inner).__name__}: "
               f"its positions count along the row, so they do not restart per sequence)",
               "use PackedCollator(backend='padded') for this model")
    known: list[str] = []
    for path, module in inner.named_modules():
        if any(path == k or path.startswith(k + ".") for k in known) or _MEDIA_TOWERS.search(path):
            continue
        cls = type(module).__name__
        builds, owns, softmax = _source_facts(type(module))
        if softmax and ours and "Attention" in cls:
            raise FastpackError(
                f"{path} ({cls}) computes its attention itself (a softmax in its forward, not "
                f"the attention interface): not supported with attn_implementation={impl!r} "
                f"on packed rows because fastpack's attention never runs there and the layer "
                f"gets no mask that keeps the sequences apart; use attn_implementation="
                f"'eager' (its mask then comes from position_ids) or "
                f"PackedCollator(backend='padded')")
        if builds == "none":
            raise FastpackError(
                f"{path or 'the model'} ({cls}) builds an attention mask over a sequence of "
                f"its own (position_ids=None: not the row's tokens, e.g. patches of them): "
                f"not supported on packed rows because that sequence runs across the packed "
                f"sequences; use PackedCollator(backend='padded') for this model")
        if owns:
            # Doge's: a bias per key and, on rows longer than keep_window_size, a top-k of
            # the row's keys (the sweep's rows are shorter and come out exact; with
            # keep_window_size=3 they are 0.28 off): nothing proves it per sequence.
            why = ("fastpack's attention adds no mask to a packed row" if ours else
                   "its terms and any selection of keys are computed over the whole row")
            raise FastpackError(
                f"{path} ({cls}) hands its attention a mask it computes itself (attention_"
                f"mask=... built in the layer: a bias or a selection of keys): not supported "
                f"on packed rows with attn_implementation={impl!r} because {why}; use "
                f"PackedCollator(backend='padded') for this model")
        if hasattr(module, "create_position_ids_from_input_ids"):
            raise FastpackError(
                f"{path} ({cls}) numbers positions from the padding index along the row: "
                f"not supported on packed rows because position_ids restarting at 0 are not "
                f"its positions; use PackedCollator(backend='padded') for this model")
        if cls in _KEEPS_APART:
            known.append(path)
            continue
        if cls in _INDEXES_PER_DOCUMENT and not ours:
            known.append(path)
            continue
        if cls in _INDEXES_PER_DOCUMENT:
            raise FastpackError(
                f"{path} ({cls}) selects keys from the model's 4-D mask (it "
                f"{_INDEXES_PER_DOCUMENT[cls]}): not supported with attn_implementation="
                f"{impl!r} because fastpack's attention leaves it no mask; use "
                f"attn_implementation='sdpa' or 'eager' with PackedCollator(backend='sdpa')")
        if "Indexer" in cls:
            raise FastpackError(
                f"{path} ({cls}) selects keys for sparse attention over the whole row: "
                f"not supported on packed rows because its scores and top-k run across "
                f"sequences; use PackedCollator(backend='padded') for this model")
        if cls in MIXERS:
            known.append(path)
            if not prepared:
                raise FastpackError(
                    f"{path} ({cls}) mixes tokens across sequences: call "
                    f"fastpack.torch.prepare_model(model) before training on packed batches "
                    f"(it restarts the layer's state at every sequence), or use "
                    f"PackedCollator(backend='padded')")
            if is_tree_batch(batch) or "cp_size" in batch:
                what = "a tree batch" if is_tree_batch(batch) else "a context-parallel batch"
                raise FastpackError(
                    f"{path} ({cls}) mixes tokens across sequences: not supported on {what} "
                    f"because its recurrent state runs along the row (a shared prefix or a "
                    f"rank's piece is not a whole sequence); use share_prefix=False / no "
                    f"context parallelism for this model")
            continue
        reason = _mixing_reason(module)
        if reason is not None:
            known.append(path)
            raise FastpackError(
                f"{path} ({cls}) mixes tokens across sequences: not supported because "
                f"{reason}, so its packed rows would leak between sequences; use "
                f"PackedCollator(backend='padded') for this model")


# --------------------------------------------------------------------------- Trainer

#: Batch keys that carry an optimizer step's normalisers; models do not need them.
STEP_KEYS = ("num_items_in_batch", "num_sequences_in_batch")


_COST_WARNED: set[str] = set()


def _warn_cost_fallback(error: Exception) -> None:
    """Warn once per message that the cost model could not read the model's config."""
    text = str(error)
    if text in _COST_WARNED:
        return
    _COST_WARNED.add(text)
    warnings.warn(f"fastpack: the cost model cannot read this model's config ({text}); "
                  "the sampler balances 6·hidden_size·l + l² instead (pass cost= or "
                  "hidden_size= to choose)", stacklevel=3)


class PackedTrainerMixin:
    """Hugging Face ``Trainer`` / TRL ``SFTTrainer`` on many ranks with one global plan.

    Mix it in *before* the trainer class::

        class PackedTrainer(PackedTrainerMixin, Trainer): ...      # or SFTTrainer

        trainer = PackedTrainer(model=model, args=args, train_dataset=ds,
                                data_collator=PackedCollator(max_len=4096, backend="flash"),
                                group_tokens=16384)

    What it changes, and why:

    * **Data** (``get_train_dataloader``): ``train_dataset`` — a tokenized
      ``datasets.Dataset`` (TRL accepts nothing else) or a ready
      :class:`~fastpack.torch.PackedDataset` — is packed *once* into one global plan
      (identical on every rank), and a :class:`~fastpack.torch.PackedSampler` hands each
      rank its steps: balanced in work, every sample once per epoch, the same number of
      non-empty steps on every rank. Its ``num_replicas``/``rank`` are the data-parallel
      group's: ``world_size // tp_size`` replicas, the ``tp_size`` tensor-parallel ranks
      of a replica (consecutive processes, accelerate's mesh order) sharing its steps;
      accelerate's context / sequence parallelism (``cp_size``/``sp_size`` > 1) raise.
    * **Context parallelism** (fastpack's): when the model's attention is
      ``register_hf_attention(context_parallel_group=group, mode=...)``, the collator
      must pack for that group (``PackedCollator(..., cp_size=, cp_mode=)``: every pack
      fits ``max_len`` once padded, checked), the ``cp · tp``
      consecutive processes of a data-parallel rank share its steps (``group`` must be
      those ranks), and every micro-batch is sharded for this rank
      (:func:`~fastpack.torch.shard_for_context_parallel`) before the forward. The loss
      is scaled by ``dp · cp`` (DDP averages the gradients of all of them; the CP ranks'
      add up to the step's), which is the Trainer's own ``num_processes // tp_size``.
      ``accumulation_steps`` is ``gradient_accumulation_steps``,
      the seed ``data_seed`` (else ``seed``), the cost model the model config's. Accelerate's
      own sharding is bypassed: it would re-split steps that are already per rank.
      ``per_device_train_batch_size`` is ignored — a step *is* the batch.
    * **Normaliser** (``get_batch_samples``): the Trainer counts the labels of a step's
      micro-batches and all-gathers the count; here every micro-batch already carries
      the exact count of its optimizer step over all ranks (``num_items_in_batch``), so
      there is no collective.
    * **Loss** (``compute_loss``): ``weighting="token"`` keeps the trainer's own loss
      (a model that takes ``num_items_in_batch``, TRL's fused loss and its metrics),
      which divides by that count and multiplies by the data-parallel size
      (``num_processes // tp_size``), as DDP/FSDP average gradients.
      ``weighting="sequence"`` (or a model that takes no loss kwargs) computes
      :func:`~fastpack.torch.packed_loss` from the logits, times the data-parallel size.
    * **Format check**: the first batch of each format goes through
      :func:`check_model_batch` against the model's ``attn_implementation``.
    * **Proof** (``verify_packing=True``, the default): the first training micro-batch
      of each rank goes through :func:`~fastpack.torch.verify_packing` — a few of its
      samples (``VERIFY_SAMPLES``, or the count given) run alone and compared with the
      packed forward, no gradients — and its cost is printed once (the local main
      process). A difference raises before the first backward, naming the module.
      Skipped with fastpack's context parallelism (a rank holds a shard, not samples).
      Either way the loss is already scaled for accumulation (``loss_is_scaled_for_ga``).

    Resuming from a checkpoint replays the schedule (the Trainer skips the consumed
    steps' indices; no batch is built for them). Evaluation is untouched.

    Keyword args (besides the trainer's own):
        group_tokens, packs_per_batch: what a step is (see :class:`PackedDataset`);
            default: ``group_tokens = 4 * max_len``. Ignored for a ready PackedDataset.
        weighting: ``"token"`` (default) or ``"sequence"`` (see :func:`packed_loss`).
        balance: ``"flops"`` (default), ``"tokens"`` or ``None`` (see PackedSampler).
        cost: a :class:`fastpack.CostModel` (default: built from ``model.config``, or
            the older ``hidden_size`` estimate when the config is not one it reads).
        hidden_size: the older estimate's ``h``; given, it is used instead of the config.
        verify_packing: ``True`` (default: :attr:`VERIFY_SAMPLES` samples), a number of
            samples, or ``False`` to skip the check of the first micro-batch.
    """

    #: Samples of the first micro-batch that :func:`~fastpack.torch.verify_packing`
    #: runs alone by default.
    VERIFY_SAMPLES = 4

    def __init__(
        self,
        *args: Any,
        group_tokens: int | None = None,
        packs_per_batch: int | None = None,
        weighting: str = "token",
        balance: str | None = "flops",
        hidden_size: int | None = None,
        cost: Any = None,
        verify_packing: bool | int = True,
        **kwargs: Any,
    ) -> None:
        if isinstance(verify_packing, bool):
            self._fastpack_verify = self.VERIFY_SAMPLES if verify_packing else 0
        elif isinstance(verify_packing, int) and verify_packing >= 1:
            self._fastpack_verify = verify_packing
        else:
            raise FastpackError(
                f"verify_packing: expected True, False or a number of samples >= 1, got "
                f"{verify_packing!r}"
            )
        if weighting not in WEIGHTINGS:
            raise FastpackError(
                f"weighting: unknown value {weighting!r}; expected 'token' or 'sequence'"
            )
        if balance not in BALANCES:
            raise FastpackError(
                f"balance: unknown value {balance!r}; expected one of "
                f"{', '.join(map(repr, BALANCES))}"
            )
        self.fastpack_weighting = weighting
        self._fastpack_options: dict[str, Any] = {
            "group_tokens": group_tokens, "packs_per_batch": packs_per_batch,
            "balance": balance, "hidden_size": hidden_size, "cost": cost,
        }
        self._fastpack_dataset: PackedDataset | None = None
        self._fastpack_sampler: PackedSampler | None = None
        import transformers

        if not hasattr(transformers.Trainer, "loss_is_scaled_for_ga"):
            raise FastpackError(
                f"PackedTrainerMixin needs transformers >= 5.19 (Trainer.loss_is_scaled_for_ga),"
                f" got {transformers.__version__}"
            )
        super().__init__(*args, **kwargs)
        if any(token_mixers(self.model)):  # type: ignore[attr-defined]
            prepare_model(self.model)  # type: ignore[attr-defined]  # mixers exact when packed
        if not self.args.average_tokens_across_devices:  # type: ignore[attr-defined]
            raise FastpackError(
                "average_tokens_across_devices: must be True with PackedTrainerMixin: the "
                "normaliser counts the tokens of every rank, so the loss is multiplied by the "
                "world size to undo the gradient averaging of DDP / FSDP"
            )
        self.loss_is_scaled_for_ga = True  # each micro-step carries its step's normaliser
        self._fastpack_checked: set[Any] = set()
        self._fastpack_cp = self._context_parallel()
        self.data_parallel_size, self.data_parallel_rank = self._data_parallel()

    def _parallel_size(self, method: str) -> int:
        get = getattr(self, method, None)
        return int(get()) if callable(get) else 1

    def _context_parallel(self) -> tuple[Any, str, int, int] | None:
        """``(group, mode, size, rank)`` when the model's attention is a context-parallel
        one (``register_hf_attention(context_parallel_group=...)``), else ``None``."""
        impl = getattr(_config_of(self.model), "_attn_implementation", None)  # type: ignore[attr-defined]
        if impl not in _CONTEXT_PARALLEL:
            return None
        group, mode = _CONTEXT_PARALLEL[impl]
        return group, mode, int(group.size()), int(group.rank())

    @property
    def context_parallel_size(self) -> int:
        """Ranks that share each step (1 without context parallelism)."""
        return 1 if self._fastpack_cp is None else self._fastpack_cp[2]

    def _data_parallel(self) -> tuple[int, int]:
        """``(size, rank)`` of this process's data-parallel group. Tensor-parallel ranks
        share a batch: accelerate's canonical mesh (dp_replicate, dp_shard, cp, sp, tp)
        puts tp innermost, so the ``tp_size`` consecutive processes form one replica;
        fastpack's context parallelism (the model's attention) puts cp around it, so
        ``cp · tp`` consecutive processes share each step."""
        args: Any = self.args  # type: ignore[attr-defined]
        for method, setting in (("get_cp_size", "cp_size"), ("get_sp_size", "sp_size")):
            size = self._parallel_size(method)
            if size > 1:
                raise FastpackError(
                    f"{setting}: {size}; PackedTrainerMixin does not support accelerate's "
                    f"context or sequence parallelism (it would split packed rows across ranks "
                    f"without their sequence boundaries); set parallelism_config's {setting} "
                    f"to 1 and use fastpack's: register_hf_attention(context_parallel_group=...)"
                )
        if hasattr(self, "get_tp_size"):
            tp = self._parallel_size("get_tp_size")
        else:  # a Trainer without get_tp_size: refuse a tensor-parallel model outright
            tp = int(getattr(getattr(self, "model", None), "_tp_size", None) or 1)
            if tp > 1:
                raise FastpackError(
                    f"tp_size: {tp}; this transformers has no Trainer.get_tp_size, so "
                    f"PackedTrainerMixin cannot map ranks to data-parallel replicas"
                )
        world = int(args.world_size)
        if tp < 1 or world % tp:
            raise FastpackError(
                f"tp_size: {tp} does not divide the world size {world}; expected a divisor"
            )
        cp = self.context_parallel_size
        if world % (tp * cp):
            raise FastpackError(
                f"context_parallel_group: {cp} ranks (times tp_size {tp}) do not divide the "
                f"world size {world}"
            )
        index = int(args.process_index)
        if self._fastpack_cp is not None and cp > 1:
            group, _, _, cp_rank = self._fastpack_cp
            first = index // (cp * tp) * cp * tp + index % tp
            want = [first + c * tp for c in range(cp)]
            have = sorted(torch.distributed.get_process_group_ranks(group))
            if have != want or want[cp_rank] != index:
                raise FastpackError(
                    f"context_parallel_group: process {index} is in the group of ranks "
                    f"{have}; PackedTrainerMixin expects ranks {want} (the cp · tp = {cp * tp} "
                    f"consecutive processes of one data-parallel rank, tp innermost)"
                )
        return world // (tp * cp), index // (tp * cp)

    # ------------------------------------------------------------------- data
    @property
    def packed_dataset(self) -> PackedDataset:
        """The packed training set (built from ``train_dataset`` on first use)."""
        if self._fastpack_dataset is None:
            self._fastpack_dataset = self._build_packed_dataset()
            self._check_context_parallel(self._fastpack_dataset)
        return self._fastpack_dataset

    @property
    def packed_sampler(self) -> PackedSampler:
        """This rank's :class:`PackedSampler` over :attr:`packed_dataset`."""
        if self._fastpack_sampler is None:
            args: Any = self.args  # type: ignore[attr-defined]
            options = self._fastpack_options
            hidden, cost = options["hidden_size"], options["cost"]
            config = getattr(self.model, "config", None)  # type: ignore[attr-defined]
            if hidden is None and cost is None and config is not None:
                try:
                    cost = CostModel.from_config(config)
                except (FastpackError, TypeError, ValueError) as error:
                    # A config it does not read (a new layer kind): balance on the
                    # hidden_size estimate rather than fail the run.
                    _warn_cost_fallback(error)
                    cost = None
            if hidden is None:
                hidden = getattr(config, "hidden_size", None) or 4096
            seed = args.data_seed if args.data_seed is not None else args.seed
            self._fastpack_sampler = PackedSampler(
                self.packed_dataset, num_replicas=self.data_parallel_size,
                rank=self.data_parallel_rank,
                shuffle=True, seed=seed, drop_last=bool(args.dataloader_drop_last),
                balance=options["balance"], hidden_size=int(hidden), cost=cost,
                accumulation_steps=args.gradient_accumulation_steps,
            )
        return self._fastpack_sampler

    def _build_packed_dataset(self) -> PackedDataset:
        data: Any = self.train_dataset  # type: ignore[attr-defined]
        if isinstance(data, PackedDataset):
            return data
        if data is None:
            raise FastpackError("train_dataset: PackedTrainerMixin needs a training dataset")
        collator: Any = self.data_collator  # type: ignore[attr-defined]
        if not isinstance(collator, PackedCollator):
            raise FastpackTypeError(
                f"data_collator: expected a fastpack PackedCollator (its max_len, backend and "
                f"options pack the dataset), got {type(collator).__name__}"
            )
        columns = list(getattr(data, "column_names", None) or [])
        if "input_ids" not in columns:
            raise FastpackError(
                f"train_dataset: expected a tokenized datasets.Dataset with an 'input_ids' "
                f"column (or a PackedDataset), got columns {columns}"
            )
        mask = collator.loss_mask_key
        if mask is None:
            mask = next((k for k in LOSS_MASK_KEYS if k in columns), None)
        options = self._fastpack_options
        group, packs = options["group_tokens"], options["packs_per_batch"]
        if group is None and packs is None:
            group = 4 * collator.max_len
        args: Any = self.args  # type: ignore[attr-defined]
        return PackedDataset(
            data, collator, labels="labels" if "labels" in columns else None,
            loss_mask=mask or None, group_tokens=group, packs_per_batch=packs, seed=args.seed,
        )

    def _check_context_parallel(self, dataset: PackedDataset) -> None:
        """The packing options must be the model's CP group's (every pack fits max_len once
        padded for it) — or no CP at all when the model's attention is not a CP one."""
        cp = self._fastpack_cp
        have = (dataset.options.cp_size, dataset.options.cp_mode)
        want = (None, "zigzag") if cp is None else (cp[2], cp[1])
        if have != want and not (cp is None and have[0] is None):
            if cp is None:
                model, fix = "not context-parallel", "leave cp_size out"
            else:
                model = f"context-parallel over {want[0]} ranks, mode {want[1]!r}"
                fix = f"build it with PackedCollator(..., cp_size={want[0]}, cp_mode={want[1]!r})"
            raise FastpackError(
                f"data_collator: packs for cp_size={have[0]}, cp_mode={have[1]!r}, but the "
                f"model's attention is {model}; {fix}"
            )

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
        args: Any = self.args  # type: ignore[attr-defined]
        kwargs: dict[str, Any] = {}
        if args.dataloader_num_workers > 0:
            kwargs["persistent_workers"] = args.dataloader_persistent_workers
            kwargs["prefetch_factor"] = args.dataloader_prefetch_factor
        return StepLoader(
            self.packed_dataset, self.packed_sampler, num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory, **kwargs,
        )

    # ------------------------------------------------------------------- loss
    def get_batch_samples(
        self, epoch_iterator: Iterator[dict[str, Any]], num_batches: int, device: Any
    ) -> tuple[list[dict[str, Any]], torch.Tensor | None]:
        batches: list[dict[str, Any]] = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        counts = {int(b["num_items_in_batch"]) for b in batches if "num_items_in_batch" in b}
        if len(counts) > 1:
            raise FastpackError(
                f"num_items_in_batch: the micro-batches of one optimizer step disagree "
                f"({sorted(counts)}); gradient_accumulation_steps must equal the sampler's "
                f"accumulation_steps"
            )
        if not counts:
            return batches, None
        return batches, torch.tensor(counts.pop(), device=device)

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        if self._fastpack_cp is not None:  # this rank's share of the step's row
            self._refuse_own_loss("context parallelism")
            _, mode, size, rank = self._fastpack_cp
            inputs = shard_for_context_parallel(
                inputs, size, rank, mode,
                pad_multiple=self.packed_dataset.options.pad_multiple)
        steps = {k: inputs[k] for k in STEP_KEYS if k in inputs}
        inputs = {k: v for k, v in inputs.items() if k not in STEP_KEYS}
        self._check_format(model, inputs)
        self._verify_first(model, inputs)
        parent: Any = super()
        accepts = bool(getattr(self, "model_accepts_loss_kwargs", False))
        # A tree batch has no labels (a shared token has several next tokens): its loss is
        # packed_loss over its target map.
        tree = is_tree_batch(inputs)
        if not tree and (not steps or (self.fastpack_weighting == "token" and accepts)):
            if steps and num_items_in_batch is None:
                num_items_in_batch = steps["num_items_in_batch"]
            return parent.compute_loss(model, inputs, return_outputs=return_outputs,
                                       num_items_in_batch=num_items_in_batch)
        self._refuse_own_loss("packed_loss")
        outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
        loss = packed_loss(outputs.logits, {**inputs, **steps},
                           weighting=self.fastpack_weighting)  # type: ignore[arg-type]
        # DDP / FSDP average gradients over every process but the tensor-parallel copies
        # (the data-parallel replicas and their CP ranks, whose gradients add up to the
        # step's); the normaliser counts all of them (the Trainer's own loss scales by
        # num_processes // tp_size, the same number).
        loss = loss * self.data_parallel_size * self.context_parallel_size
        return (loss, outputs) if return_outputs else loss

    def _verify_first(self, model: torch.nn.Module, inputs: dict[str, Any]) -> None:
        """:func:`~fastpack.torch.verify_packing` on the first training micro-batch (each
        rank its own; no collective), its cost printed once."""
        if not self._fastpack_verify or not model.training or "sample_ids" not in inputs:
            return
        count, self._fastpack_verify = self._fastpack_verify, 0
        show = getattr(self, "is_local_process_zero", lambda: True)()
        if self._fastpack_cp is not None:
            if show:
                print("fastpack: verify_packing skipped (context parallelism: each rank "
                      "holds a shard of the row, not whole samples)")
            return
        from .verify import verify_packing

        inner = model.module if isinstance(
            model, torch.nn.parallel.DistributedDataParallel) else model
        report = verify_packing(inner, inputs, samples=count)
        if show:
            print(f"fastpack: {report} (first micro-batch; off with verify_packing=False)")

    def _refuse_own_loss(self, path: str) -> None:
        """Hugging Face's label smoother and a ``compute_loss_func`` take ``labels`` and
        shift them themselves: on a context-parallel shard (not contiguous) that pairs
        tokens across chunk boundaries, and on the ``packed_loss`` path they would not run
        at all. Refused before the forward, by the option's name."""
        why = ("a context-parallel shard's labels are one rank's chunks glued together, "
               "so shifting them pairs tokens across chunk boundaries (the shard's "
               "shift_labels hold the right targets)" if path == "context parallelism" else
               "this step's loss is fastpack's packed_loss (weighting='sequence', a tree "
               "batch or a model without loss kwargs), which would skip it")
        if getattr(self, "label_smoother", None) is not None:
            factor = getattr(self.args, "label_smoothing_factor", None)  # type: ignore[attr-defined]
            raise FastpackError(
                f"label_smoothing_factor: {factor} is not supported with PackedTrainerMixin "
                f"here: {why}; set it to 0"
            )
        if getattr(self, "compute_loss_func", None) is not None:
            raise FastpackError(
                f"compute_loss_func: is not supported with PackedTrainerMixin here: {why}; "
                f"leave it out (or override compute_loss and read the batch's shift_labels)"
            )

    def _check_format(self, model: torch.nn.Module, inputs: dict[str, Any]) -> None:
        """:func:`check_model_batch` once per batch format (its keys and mask kind), so a
        wrong format/attention pair raises before the first forward, at no cost after."""
        mask = inputs.get("attention_mask")
        if isinstance(mask, ShardMask):  # a guard that raises on every read
            mask = None
        key = (tuple(sorted(inputs)), type(mask).__name__, getattr(mask, "ndim", None),
               getattr(mask, "dtype", None))
        if key not in self._fastpack_checked:
            check_model_batch(model, inputs)
            self._fastpack_checked.add(key)


class StepBatches(torch.utils.data.Sampler):  # type: ignore[type-arg]
    """A :class:`PackedSampler` as a batch sampler of one step per batch (what Accelerate's
    ``skip_first_batches`` can skip by index, when the Trainer resumes mid-epoch)."""

    def __init__(self, sampler: PackedSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[list[Step]]:
        return ([step] for step in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


class StepLoader(torch.utils.data.DataLoader):  # type: ignore[type-arg]
    """A ``DataLoader`` of a :class:`PackedDataset`'s steps in a :class:`PackedSampler`'s
    order, with ``set_epoch`` (which the Trainer calls every epoch)."""

    def __init__(self, dataset: PackedDataset, sampler: PackedSampler, **kwargs: Any) -> None:
        super().__init__(dataset, batch_sampler=StepBatches(sampler), collate_fn=first_item,
                         **kwargs)
        self.step_sampler = sampler

    def set_epoch(self, epoch: int) -> None:
        self.step_sampler.set_epoch(epoch)
