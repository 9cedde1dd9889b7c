"""Variable-length (packed) attention for people writing their own model.

:func:`varlen_attention` takes the packed layout that flash-attn uses: ``q`` of shape
``(total_tokens, Hq, D)``, ``k``/``v`` of shape ``(total_tokens, Hkv, D)`` and
``cu_seqlens`` (``[N+1]``, starting at 0) marking where each sequence begins.  Tokens
attend only to tokens of their own sequence (causally by default).

Kernels (``kernel="auto"`` picks the first that applies):

``"flash"``
    ``flash_attn.flash_attn_varlen_func`` (flash-attn 2); CUDA, fp16/bf16.
``"varlen"``
    ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10); CUDA, fp16/bf16.  The
    signature changed between releases and is detected by inspection:
    ``is_causal=`` (2.10), ``window_size=(-1, 0)`` as a *tuple* for causal (2.11+;
    a list is silently read as non-causal) and ``enable_gqa=True`` (2.12+; older
    releases get repeated k/v heads instead).
``"flex"``
    ``torch.compile(flex_attention)`` with a document mask.  The ``BlockMask`` is
    built directly from ``cu_seqlens`` with ``BlockMask.from_kv_blocks``: only
    block-level tables of size ``(T/128)**2`` exist, never a ``T x T`` mask (eager
    ``create_block_mask`` materializes the dense mask, so it is not used).  CUDA only.
``"sdpa"``
    A loop over the sequences calling ``torch.nn.functional.scaled_dot_product_attention``
    on each slice: memory is O(max_seqlen**2) per call, never O(T**2) for the
    batch.  Works everywhere (this is the CPU path).

Sliding windows (``sliding_window=w``: a query sees itself and the ``w - 1`` tokens before
it, Hugging Face's convention) and soft-capping of the scores (``softcap=c``:
``c * tanh(score / c)``, Gemma 2) run on every kernel that has them: flash-attn
(``window_size`` / ``softcap``), flex (mask and score mods), the SDPA loop (a window mask
of O(l**2) per sequence, never per batch); ``torch.nn.attention.varlen`` has a window
(torch >= 2.11) but no soft-capping, so asking it for one raises.

Validating ``cu_seqlens`` reads it on the host once (a device sync when it lives on
the GPU); pass ``validate=False`` in hot loops or under ``torch.compile`` once the
batches are known to be well formed.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from .._errors import FastpackError, FastpackTypeError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    CuSeqlens = torch.Tensor | npt.NDArray[np.integer[Any]] | Sequence[int]

__all__ = ["KERNELS", "Kernel", "available_kernels", "varlen_attention"]

Kernel = Literal["auto", "flash", "varlen", "flex", "sdpa"]
KERNELS: tuple[str, ...] = ("auto", "flash", "varlen", "flex", "sdpa")

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_FLEX_BLOCK_SIZE = 128


# --------------------------------------------------------------------------- errors


def _error(message: str) -> FastpackError:
    return FastpackError(message)


def _type_error(message: str) -> FastpackTypeError:
    return FastpackTypeError(message)


# ------------------------------------------------------------------ optional imports


@functools.cache
def _flash_varlen_func() -> Callable[..., torch.Tensor] | None:
    try:
        module = importlib.import_module("flash_attn")
        fn: Callable[..., torch.Tensor] = module.flash_attn_varlen_func
    except Exception:  # ImportError, or a broken CUDA build raising something else
        return None
    return fn


@functools.cache
def _torch_varlen_attn() -> Callable[..., Any] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return None
    return varlen_attn


@functools.cache
def _signature_params(fn: Callable[..., Any]) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()


@functools.cache
def _flex_unavailable_reason() -> str | None:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except Exception:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention"
    if not hasattr(BlockMask, "from_kv_blocks"):
        return f"torch {torch.__version__} has no BlockMask.from_kv_blocks"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (torch.compile of flex_attention needs it)"
    return None


@functools.cache
def _compiled_flex_attention() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    # Uncompiled flex_attention falls back to a dense implementation that
    # materializes the full score matrix, so the compiled kernel is mandatory.
    compiled: Callable[..., torch.Tensor] = torch.compile(flex_attention)
    return compiled


@functools.cache
def _sdpa_has_enable_gqa() -> bool:
    # scaled_dot_product_attention is a builtin without an inspectable signature.
    x = torch.zeros(1, 2, 1, 1)
    y = torch.zeros(1, 1, 1, 1)
    try:
        torch.nn.functional.scaled_dot_product_attention(x, y, y, enable_gqa=True)
    except TypeError:
        return False
    except RuntimeError:
        return False
    return True


# ---------------------------------------------------------------- kernel selection


def _is_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def _unavailable_reason(kernel: str, q: torch.Tensor) -> str | None:
    """Why ``kernel`` cannot run on inputs like ``q``; ``None`` when it can."""
    if kernel == "sdpa":
        return None
    if not _is_cuda(q):
        return f"it needs CUDA tensors, got device {q.device.type!r}"
    if kernel == "flash":
        if q.dtype not in _HALF_DTYPES:
            return f"it needs float16 or bfloat16 inputs, got {q.dtype}"
        if _flash_varlen_func() is None:
            return "the flash-attn package is not installed (pip install flash-attn)"
        return None
    if kernel == "varlen":
        if q.dtype not in _HALF_DTYPES:
            return f"it needs float16 or bfloat16 inputs, got {q.dtype}"
        if _torch_varlen_attn() is None:
            return (
                f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn "
                "(added in torch 2.10)"
            )
        return None
    if kernel == "flex":
        return _flex_unavailable_reason()
    raise AssertionError(kernel)  # pragma: no cover


def available_kernels(q: torch.Tensor) -> list[str]:
    """Kernels that :func:`varlen_attention` could use for inputs like ``q``, in
    ``kernel="auto"`` priority order (``"sdpa"`` is always last and always there)."""
    return [k for k in KERNELS[1:] if _unavailable_reason(k, q) is None]


def _resolve_kernel(kernel: str, q: torch.Tensor) -> str:
    if kernel == "auto":
        return available_kernels(q)[0]
    reason = _unavailable_reason(kernel, q)
    if reason is not None:
        raise _error(f"kernel={kernel!r} is not available: {reason}")
    return kernel


# ------------------------------------------------------------------------ validation


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise _type_error(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 3:
            raise _error(
                f"{name} must have 3 dimensions (total_tokens, heads, head_dim), "
                f"got shape {tuple(t.shape)}"
            )
        if not t.is_floating_point():
            raise _error(f"{name} must be a floating-point tensor, got {t.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise _error(f"q, k and v must share a dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise _error(
            f"q, k and v must be on one device, got q={q.device}, k={k.device}, v={v.device}"
        )
    if k.shape != v.shape:
        raise _error(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != q.shape[0]:
        raise _error(
            "q and k/v must have the same number of tokens (dim 0), "
            f"got {q.shape[0]} and {k.shape[0]}"
        )
    if k.shape[2] != q.shape[2]:
        raise _error(
            f"q and k/v must have the same head_dim (dim 2), got {q.shape[2]} and {k.shape[2]}"
        )
    hq, hkv = q.shape[1], k.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise _error(
            f"the number of query heads must be a multiple of the number of key/value heads "
            f"(q has {hq} heads, k/v have {hkv})"
        )


def _check_max_seqlen(max_seqlen: object) -> int:
    if isinstance(max_seqlen, bool):
        raise _type_error("max_seqlen must be an int, got bool")
    if isinstance(max_seqlen, torch.Tensor):
        if max_seqlen.numel() != 1 or max_seqlen.is_floating_point():
            raise _type_error("max_seqlen must be an int (or a one-element integer tensor)")
        value = int(max_seqlen.item())
    else:
        try:
            value = int(max_seqlen.__index__())  # type: ignore[attr-defined]
        except AttributeError:
            raise _type_error(
                f"max_seqlen must be an int, got {type(max_seqlen).__name__}"
            ) from None
    if value < 0:
        raise _error(f"max_seqlen must be >= 0, got {value}")
    return value


def _as_cu_tensor(cu_seqlens: CuSeqlens) -> torch.Tensor:
    if isinstance(cu_seqlens, torch.Tensor):
        t = cu_seqlens
    else:
        try:
            t = torch.as_tensor(cu_seqlens)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise _error(
                "cu_seqlens must be a 1-D integer torch tensor, numpy array or sequence of ints "
                f"({exc})"
            ) from None
    if t.ndim != 1:
        raise _error(f"cu_seqlens must be 1-D of shape [N+1], got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise _error("cu_seqlens must have at least one element (it starts with 0)")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise _error(f"cu_seqlens must hold integers, got dtype {t.dtype}")
    return t


def _check_cu_values(host: torch.Tensor, total_tokens: int, max_seqlen: int) -> None:
    """``host`` is an int64 CPU copy of cu_seqlens."""
    first, last = int(host[0]), int(host[-1])
    if first != 0:
        raise _error(f"cu_seqlens must start at 0, got {first}")
    lengths = host[1:] - host[:-1]
    if lengths.numel() and bool((lengths < 0).any()):
        i = int(torch.nonzero(lengths < 0)[0, 0])
        raise _error(
            f"cu_seqlens must be non-decreasing, got cu_seqlens[{i}]={int(host[i])} > "
            f"cu_seqlens[{i + 1}]={int(host[i + 1])}"
        )
    if last != total_tokens:
        raise _error(
            f"cu_seqlens[-1] must equal total_tokens = q.shape[0] = {total_tokens}, got {last}"
        )
    longest = int(lengths.max()) if lengths.numel() else 0
    if longest > max_seqlen:
        raise _error(
            f"max_seqlen={max_seqlen} is smaller than the longest sequence "
            f"in cu_seqlens ({longest})"
        )


# --------------------------------------------------------------------------- kernels


def _repeat_kv(
    k: torch.Tensor, v: torch.Tensor, groups: int, dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=dim), v.repeat_interleave(groups, dim=dim)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _flash_forward(
    fn: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    max_seqlen: int,
    causal: bool,
    scale: float | None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    # flash-attn handles GQA natively when Hq is a multiple of Hkv.
    kwargs = _flash_options(fn, sliding_window, softcap)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    return fn(
        q, k, v, cu, cu, max_seqlen, max_seqlen, dropout_p=0.0, softmax_scale=scale,
        causal=causal, **kwargs,
    )


def _flash_options(
    fn: Callable[..., Any], sliding_window: int | None, softcap: float | None
) -> dict[str, Any]:
    """flash-attn's keyword arguments for a window and a soft cap, refusing a build that
    lacks them (an older flash-attn would silently attend over everything)."""
    params = _signature_params(fn)
    kwargs: dict[str, Any] = {}
    if sliding_window is not None:
        if "window_size" not in params:
            raise _error("kernel='flash': this flash-attn has no window_size; cannot apply "
                         f"sliding_window={sliding_window}")
        # flash-attn's bounds are inclusive: w - 1 tokens to the left plus the query itself.
        kwargs["window_size"] = (sliding_window - 1, 0)
    if softcap is not None:
        if "softcap" not in params:
            raise _error(f"kernel='flash': this flash-attn has no softcap (added in 2.6); "
                         f"cannot apply softcap={softcap}")
        kwargs["softcap"] = softcap
    return kwargs


def _torch_varlen_forward(
    fn: Callable[..., Any],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    max_seqlen: int,
    causal: bool,
    scale: float | None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    params = _signature_params(fn)
    kwargs: dict[str, Any] = {}
    if softcap is not None:
        raise _error(f"kernel='varlen': torch's varlen_attn has no soft-capping; cannot apply "
                     f"softcap={softcap} (use kernel='flash', 'flex' or 'sdpa')")
    if sliding_window is not None and "window_size" not in params:
        raise _error(f"kernel='varlen': torch {torch.__version__}'s varlen_attn has no "
                     f"window_size (torch >= 2.11); cannot apply sliding_window={sliding_window}")
    if "window_size" in params:  # torch >= 2.11: causal is window_size == (-1, 0)
        # Must be a tuple: torch compares `window_size == (-1, 0)`, a list is non-causal.
        left = -1 if sliding_window is None else sliding_window - 1  # inclusive, as flash-attn
        kwargs["window_size"] = (left, 0) if causal else (-1, -1)
    elif "is_causal" in params:  # torch 2.10
        kwargs["is_causal"] = causal
    elif causal:
        raise _error(
            "kernel='varlen': this torch's varlen_attn takes neither window_size nor is_causal; "
            "cannot request causal attention"
        )
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        if "enable_gqa" in params:  # torch >= 2.12
            kwargs["enable_gqa"] = True
        else:
            k, v = _repeat_kv(k, v, groups, dim=1)
    if scale is not None:
        if "scale" in params:
            kwargs["scale"] = scale
        else:  # torch 2.10 always uses 1/sqrt(D): fold the requested scale into q
            q = q * (scale * math.sqrt(q.shape[-1]))
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    # One tensor object for q and k: cuDNN's causal path requires `cu_seq_q is cu_seq_k`.
    out = fn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)
    result: torch.Tensor = out[0] if isinstance(out, tuple) else out
    return result


def _document_block_tables(
    cu: torch.Tensor, total_tokens: int, block_size: int, causal: bool,
    sliding_window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block-sparse tables of the document mask given by ``cu`` (no ``T x T`` tensor).

    Returns ``(doc_id, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)``
    in ``BlockMask.from_kv_blocks`` layout (``[1, 1, nb]`` / ``[1, 1, nb, nb]``, int32),
    where ``doc_id`` (int32, length ``nb * block_size``) maps each token to its
    sequence and is ``-1`` past ``total_tokens``.  "Full" blocks are those where every
    query attends every key (the mask_mod is skipped there); the other listed blocks
    are partial and get the mask_mod.  Every block holding at least one allowed
    (query, key) pair is listed, and no other block is.
    """
    device = cu.device
    cu64 = cu.to(torch.int64)
    lengths = cu64[1:] - cu64[:-1]
    n_seqs = lengths.numel()
    nb = -(-total_tokens // block_size)
    doc_id = torch.full((nb * block_size,), -1, dtype=torch.int32, device=device)
    doc_id[:total_tokens] = torch.repeat_interleave(
        torch.arange(n_seqs, dtype=torch.int32, device=device), lengths, output_size=total_tokens
    )
    starts = torch.arange(nb, device=device, dtype=torch.int64) * block_size
    lasts = torch.clamp(starts + block_size, max=total_tokens) - 1
    first_doc = doc_id[starts]
    last_doc = doc_id[lasts]
    # Rows: query blocks; columns: key blocks.  Documents are contiguous, so two blocks
    # share a document iff their [first_doc, last_doc] intervals overlap.
    touch = (first_doc[None, :] <= last_doc[:, None]) & (last_doc[None, :] >= first_doc[:, None])
    uniform = (first_doc == last_doc) & (lasts - starts + 1 == block_size)
    full = uniform[:, None] & uniform[None, :] & (first_doc[:, None] == first_doc[None, :])
    if causal:
        touch &= starts[None, :] <= lasts[:, None]
        full &= lasts[None, :] <= starts[:, None]
    if sliding_window is not None:  # (causal only) a key is seen while q - k < window
        touch &= starts[:, None] - lasts[None, :] < sliding_window
        full &= lasts[:, None] - starts[None, :] < sliding_window
    partial = touch & ~full
    return (doc_id, *_kv_blocks(partial), *_kv_blocks(full))


def _kv_blocks(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(num_blocks, indices)`` of ``BlockMask.from_kv_blocks`` (``[1, 1, nb]`` and
    ``[1, 1, nb, nb]``, int32) from a ``[nb, nb]`` bool table of query × key blocks."""
    num = dense.sum(dim=-1, dtype=torch.int32)
    idx = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True)
    return num[None, None], idx.to(torch.int32)[None, None]


def _from_kv_blocks(tables: Sequence[torch.Tensor], total_tokens: int,
                    mask_mod: Callable[..., torch.Tensor]) -> Any:
    """A ``BlockMask`` of ``total_tokens`` from its tables (partial then full blocks, as
    :func:`_kv_blocks` gives them) and ``mask_mod`` for the partial ones."""
    from torch.nn.attention.flex_attention import BlockMask

    kwargs: dict[str, Any] = {}
    if "seq_lengths" in _signature_params(BlockMask.from_kv_blocks):
        kwargs["seq_lengths"] = (total_tokens, total_tokens)
    kv_num, kv_idx, full_num, full_idx = tables
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx,
                                    BLOCK_SIZE=_FLEX_BLOCK_SIZE, mask_mod=mask_mod, **kwargs)


def _document_mask_mod(
    doc_id: torch.Tensor, causal: bool, sliding_window: int | None = None
) -> Callable[..., torch.Tensor]:
    if sliding_window is not None:
        window = sliding_window

        def windowed_document_mask(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            same = (doc_id[q_idx] == doc_id[kv_idx]) & (q_idx >= kv_idx)
            return same & (q_idx - kv_idx < window)

        return windowed_document_mask
    if causal:

        def causal_document_mask(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            return (doc_id[q_idx] == doc_id[kv_idx]) & (q_idx >= kv_idx)

        return causal_document_mask

    def document_mask(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        return doc_id[q_idx] == doc_id[kv_idx]

    return document_mask


def _document_block_mask(
    cu: torch.Tensor, total_tokens: int, causal: bool, sliding_window: int | None = None
) -> Any:
    doc_id, *tables = _document_block_tables(
        cu, total_tokens, _FLEX_BLOCK_SIZE, causal, sliding_window
    )
    return _from_kv_blocks(tables, total_tokens,
                           _document_mask_mod(doc_id, causal, sliding_window))


def _softcap_score_mod(softcap: float) -> Callable[..., torch.Tensor]:
    def softcapped(
        score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
        kv_idx: torch.Tensor,
    ) -> torch.Tensor:
        return softcap * torch.tanh(score / softcap)

    return softcapped


def _flex_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    causal: bool,
    scale: float | None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    *,
    compile: bool = True,
) -> torch.Tensor:
    if compile:
        flex = _compiled_flex_attention()
    else:  # dense reference implementation; only for testing the plumbing on CPU
        from torch.nn.attention.flex_attention import flex_attention as flex
    total = q.shape[0]
    block_mask = _document_block_mask(cu, total, causal, sliding_window)
    groups = q.shape[1] // k.shape[1]
    kwargs: dict[str, Any] = {}
    if groups > 1:
        kwargs["enable_gqa"] = True
    if softcap is not None:
        kwargs["score_mod"] = _softcap_score_mod(softcap)
    # (T, H, D) -> (1, H, T, D) views; flex returns its output in q's stride order, so
    # the transpose back is contiguous.
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out: torch.Tensor = flex(q4, k4, v4, block_mask=block_mask, scale=scale, **kwargs)
    return out[0].transpose(0, 1)


def _window_mask(length: int, sliding_window: int, device: torch.device) -> torch.Tensor:
    """``[length, length]`` bool: causal, and a key at most ``sliding_window - 1`` tokens
    before the query (Hugging Face's ``kv_idx > q_idx - sliding_window``)."""
    idx = torch.arange(length, device=device)
    distance = idx[:, None] - idx[None, :]
    return (distance >= 0) & (distance < sliding_window)


def _softcapped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    causal: bool,
    scale: float | None,
    softcap: float,
) -> torch.Tensor:
    """Attention with ``softcap * tanh(score / softcap)`` scores, on ``(1, H, L, D)``
    inputs with as many k/v heads as q heads; SDPA has no soft-capping."""
    length = q.shape[2]
    if scale is None:
        scale = q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if allowed is None and causal:
        allowed = torch.ones(length, length, dtype=torch.bool, device=q.device).tril_()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    # Softmax at least in fp32 (as Hugging Face's eager attention), in fp64 for fp64.
    work = torch.promote_types(q.dtype, torch.float32)
    probs = torch.softmax(scores, dim=-1, dtype=work).to(q.dtype)
    return torch.matmul(probs, v)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None,
    causal: bool, scale: float | None, softcap: float | None, gqa: dict[str, Any],
) -> torch.Tensor:
    """One attention call over ``(1, H, L, D)`` pieces (``gqa`` from :func:`_sdpa_gqa`):
    soft-capped scores by hand (SDPA cannot), else SDPA with the ``allowed`` mask, or
    causal (or not) without one. The per-sequence, per-segment and per-run loops share it."""
    if softcap is not None:
        return _softcapped_attention(q, k, v, allowed, causal, scale, softcap)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if allowed is not None:
        out: torch.Tensor = sdpa(q, k, v, attn_mask=allowed, scale=scale, **gqa)
    else:
        out = sdpa(q, k, v, is_causal=causal, scale=scale, **gqa)
    return out


def _sdpa_gqa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """``(k, v, kwargs)`` for SDPA calls over ``(T, H, D)`` inputs with fewer key/value
    heads than query heads: ``enable_gqa`` where SDPA has it (not with soft-capping, which
    is computed by hand), else k/v repeated once for the whole batch, not per sequence."""
    groups = q.shape[1] // k.shape[1]
    if groups == 1:
        return k, v, {}
    if _sdpa_has_enable_gqa() and softcap is None:
        return k, v, {"enable_gqa": True}
    k, v = _repeat_kv(k, v, groups, dim=1)
    return k, v, {}


def _sdpa_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: Sequence[int],
    causal: bool,
    scale: float | None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    k, v, gqa = _sdpa_gqa(q, k, v, softcap)
    # Split (1, H, T, D) views along the tokens, once: every piece is already in SDPA's
    # layout, so a sequence costs one SDPA call and one transpose, and autograd backs the
    # split with one concatenation. (Slicing and transposing each sequence, as before,
    # made ~9 autograd nodes per sequence: 30% of the attention time for 20-token ones.)
    # The leading and trailing pieces (tokens outside cu_seqlens, normally none) are dropped.
    sizes = [bounds[0], *(end - start for start, end in zip(bounds[:-1], bounds[1:]))]
    sizes.append(q.shape[0] - bounds[-1])
    q_parts, k_parts, v_parts = (
        t.transpose(0, 1).unsqueeze(0).split(sizes, dim=2)[1:-1] for t in (q, k, v)
    )
    outs = []
    for qs, ks, vs in zip(q_parts, k_parts, v_parts):
        length = qs.shape[2]
        if not length:
            continue
        # The window mask is O(l**2) for this sequence alone; a sequence no longer than
        # the window is plain causal attention.
        allowed = None
        if sliding_window is not None and length > sliding_window:
            allowed = _window_mask(length, sliding_window, qs.device)
        out = _attend(qs, ks, vs, allowed, causal, scale, softcap, gqa)
        outs.append(out.transpose(1, 2))  # (1, L, H, D)
    if not outs:
        return q[:0]
    return torch.cat(outs, dim=1)[0]


def _check_window_options(
    sliding_window: object, softcap: object, causal: bool
) -> tuple[int | None, float | None]:
    window: int | None = None
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not hasattr(sliding_window, "__index__"):
            raise _type_error(
                f"sliding_window must be an int or None, got {type(sliding_window).__name__} "
                f"{sliding_window!r}"
            )
        window = int(sliding_window.__index__())
        if window < 1:
            raise _error(f"sliding_window must be >= 1 (the query itself counts), got {window}")
        if not causal:
            raise _error(
                f"sliding_window={window} needs causal=True; a bidirectional window is not "
                "supported"
            )
    cap: float | None = None
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
            raise _type_error(
                f"softcap must be a number or None, got {type(softcap).__name__} {softcap!r}"
            )
        cap = float(softcap)
        if not cap > 0 or math.isinf(cap):
            raise _error(f"softcap must be a positive finite number, got {softcap}")
    return window, cap


# ------------------------------------------------------------------------ public API


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: CuSeqlens,
    max_seqlen: int,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    kernel: Kernel = "auto",
    validate: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention over packed sequences, each attending only to itself.

    Args:
        q: ``(total_tokens, Hq, D)``.
        k, v: ``(total_tokens, Hkv, D)``; ``Hq`` must be a multiple of ``Hkv`` (GQA/MQA).
        cu_seqlens: ``[N+1]`` cumulative sequence lengths starting at 0 and ending at
            ``total_tokens``; repeated values (empty sequences) are allowed.  An int32
            tensor on ``q``'s device is used as is; int64 tensors, numpy arrays and
            lists are converted once.
        max_seqlen: the longest sequence length (an upper bound is accepted).
        causal: causal attention within each sequence (default) or bidirectional.
        softmax_scale: defaults to ``1 / sqrt(D)``.
        kernel: ``"auto"`` (flash -> varlen -> flex -> sdpa, first that applies),
            or one of ``"flash"``, ``"varlen"``, ``"flex"``, ``"sdpa"`` to force a path;
            a forced kernel that cannot run raises.
        validate: check ``cu_seqlens`` values (costs a host read, i.e. a device sync
            when it lives on the GPU).
        sliding_window: a query attends to itself and the ``sliding_window - 1`` tokens
            before it in its sequence (Hugging Face's ``sliding_window``; causal only).
            Every kernel but torch's varlen before 2.11 has it.
        softcap: scores become ``softcap * tanh(score / softcap)`` before the softmax
            (Gemma 2's ``attn_logit_softcapping``); flash-attn (>= 2.6), flex and sdpa
            have it, ``kernel="varlen"`` raises.

    Returns:
        ``(total_tokens, Hq, D)`` in ``q``'s dtype.

    Raises:
        fastpack.FastpackError: invalid inputs or an unavailable forced kernel (a
            ``ValueError``; ``FastpackTypeError``, also a ``TypeError``, for an argument of
            the wrong type).
    """
    _check_qkv(q, k, v)
    longest = _check_max_seqlen(max_seqlen)
    for name, flag in (("causal", causal), ("validate", validate)):
        if not isinstance(flag, bool):
            raise _type_error(f"{name} must be a bool, got {type(flag).__name__} {flag!r}")
    if softmax_scale is not None:
        try:
            if isinstance(softmax_scale, bool):
                raise TypeError
            softmax_scale = float(softmax_scale)
        except (TypeError, ValueError):
            raise _type_error(
                f"softmax_scale must be a number or None, got {type(softmax_scale).__name__}"
            ) from None
        if not softmax_scale > 0 or math.isinf(softmax_scale):
            raise _error(f"softmax_scale must be a positive finite number, got {softmax_scale}")
    if not isinstance(kernel, str):
        raise _type_error(f"kernel must be a string, got {type(kernel).__name__}")
    if kernel not in KERNELS:
        raise _error(f"kernel must be one of {', '.join(map(repr, KERNELS))}; got {kernel!r}")
    window, cap = _check_window_options(sliding_window, softcap, causal)
    chosen = _resolve_kernel(kernel, q)
    if chosen == "varlen" and cap is not None and kernel == "auto":
        chosen = "flex" if _unavailable_reason("flex", q) is None else "sdpa"

    total = q.shape[0]
    cu_in = _as_cu_tensor(cu_seqlens)
    host: torch.Tensor | None = None
    if validate or chosen == "sdpa":
        host = cu_in.detach().to(device="cpu", dtype=torch.int64)  # the one host read
    if validate:
        assert host is not None
        _check_cu_values(host, total, longest)

    if total == 0:
        return q.clone()

    if chosen == "sdpa":
        assert host is not None
        return _sdpa_forward(q, k, v, host.tolist(), causal, softmax_scale, window, cap)

    cu = cu_in.to(device=q.device, dtype=torch.int32).contiguous()
    if chosen == "flash":
        flash = _flash_varlen_func()
        assert flash is not None
        return _flash_forward(flash, q, k, v, cu, longest, causal, softmax_scale, window, cap)
    if chosen == "varlen":
        fn = _torch_varlen_attn()
        assert fn is not None
        return _torch_varlen_forward(
            fn, q, k, v, cu, longest, causal, softmax_scale, window, cap
        )
    return _flex_forward(q, k, v, cu, causal, softmax_scale, window, cap)
