"""fastpack's per-sequence attention as a Hugging Face attention implementation
(:func:`register_hf_attention`): the function transformers calls in every attention layer,
which reads the sequence boundaries a packed batch carries and computes exactly what the
unpacked model computes (or refuses, naming why)."""

from __future__ import annotations

import functools
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import torch

from .._checks import _choice
from .._context_parallel import CP_MODES
from .._errors import FastpackError, FastpackTypeError
from .attention import KERNELS, Kernel, varlen_attention
from .context_parallel import CP_KERNELS, context_parallel_attention
from .formats import OncePerBatch, position_starts
from .mixers import current_layout
from .tree import tree_attention, tree_layout

__all__ = ["register_hf_attention"]


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


_CU_CHECKED = OncePerBatch()
_POSITION_BOUNDS = OncePerBatch()


def _position_bounds(
    position_ids: torch.Tensor, rows: int, width: int, device: torch.device
) -> tuple[torch.Tensor, int]:
    """``cu_seqlens`` (int32 on ``device``) and the longest sequence of ``rows`` rows laid
    end to end, the boundaries read from the positions; once per forward."""
    key = (rows, width, device)
    if _POSITION_BOUNDS.hit(position_ids) and _POSITION_BOUNDS.value[0] == key:
        return _POSITION_BOUNDS.value[1]  # type: ignore[no-any-return]
    begin = torch.nonzero(position_starts(position_ids, rows, width).reshape(-1))[:, 0]
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
    starts = position_starts(position_ids, rows, width)
    packed = bool((starts[:, 1:] & real[:, 1:] & real[:, :-1]).any())
    _PADDING_CHECKED.remember(position_ids, packed)
    return packed


_PADDING_CHECKED = OncePerBatch()


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
