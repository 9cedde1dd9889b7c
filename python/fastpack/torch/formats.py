"""One batch format per backend: packed rows (from :func:`fastpack.materialize`) turned
into exactly what ``model(**batch)`` needs for the model's attention implementation.

``"flash"``
    One flat row ``[1, T]`` with ``position_ids``, ``cu_seq_lens_q/k`` (int32) and
    ``max_length_q/k`` (int): Hugging Face's padding-free flash-attention path.
``"sdpa"``, ``"eager"``, ``"flex"``
    Default ``mask="position_ids"``: one row per pack ``[P, W]``, positions restarting at
    0 in every sequence, **no** ``attention_mask`` and ``use_cache=False`` — the only
    combination under which Hugging Face models build the block-diagonal mask from the
    positions (an all-ones mask or a KV cache silently attends across sequences).
    ``mask="explicit"`` passes the mask itself: bool ``[P, 1, W, W]`` for sdpa,
    additive float for eager (O(W²) memory per row), and for flex a ``BlockMask`` built
    from ``cu_seqlens`` over one flat row, with no dense intermediate.
``"padded"``
    The baseline: one sample per row, right-padded, with a 0/1 ``attention_mask``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._checks import _bool_arg, _choice, _int_arg
from .._errors import FastpackError, FastpackTypeError

__all__ = ["BACKENDS", "MASK_MODES", "RETURN_TENSORS", "BatchFormat"]

#: The batch formats, one per Hugging Face ``attn_implementation`` (plus the padded
#: baseline). Not :data:`fastpack.torch.KERNELS`, the kernels of ``varlen_attention``.
BACKENDS = ("flash", "sdpa", "eager", "flex", "padded")
MASK_MODES = ("position_ids", "explicit")
RETURN_TENSORS = ("pt", "np")


@dataclass(frozen=True)
class BatchFormat:
    """How packed rows become a batch for one backend (see the module docs)."""

    backend: str
    mask: str = "position_ids"
    return_tensors: str = "pt"
    fixed_cu_seqlens: int | None = None
    mask_dtype: torch.dtype = torch.float32
    return_seq_idx: bool = False
    return_num_items: bool = False

    def __post_init__(self) -> None:
        _choice("backend", self.backend, BACKENDS)
        _choice("mask", self.mask, MASK_MODES)
        _choice("return_tensors", self.return_tensors, RETURN_TENSORS)
        if self.mask == "explicit" and self.backend not in ("sdpa", "eager", "flex"):
            raise FastpackError(
                f"mask: 'explicit' applies to backend 'sdpa', 'eager' or 'flex', not "
                f"{self.backend!r}; expected mask='position_ids'"
            )
        if self.fixed_cu_seqlens is not None:
            if self.backend != "flash":
                raise FastpackError(
                    f"fixed_cu_seqlens: applies to backend='flash' only, not {self.backend!r}"
                )
            _int_arg("fixed_cu_seqlens", self.fixed_cu_seqlens, minimum=2, maximum=2**31 - 1)
        if not isinstance(self.mask_dtype, torch.dtype) or not self.mask_dtype.is_floating_point:
            raise FastpackTypeError(
                f"mask_dtype: expected a floating torch dtype (the additive eager mask), got "
                f"{self.mask_dtype!r}"
            )
        _bool_arg("return_seq_idx", self.return_seq_idx)
        _bool_arg("return_num_items", self.return_num_items)

    @property
    def layout(self) -> str:
        """``"flat"`` (every pack end to end in one row) or ``"rows"`` (a row per pack),
        the layout :func:`fastpack.materialize` must produce for this format."""
        flat = self.backend == "flash" or (self.backend == "flex" and self.mask == "explicit")
        return "flat" if flat else "rows"

    def __call__(self, rows: dict[str, Any]) -> dict[str, Any]:
        pt = self.return_tensors == "pt"
        conv = torch.from_numpy if pt else (lambda a: a)
        out: dict[str, Any] = {"input_ids": conv(rows["input_ids"])}
        seq_idx = rows["seq_idx"]
        if self.backend == "padded":
            out["attention_mask"] = conv((seq_idx == 0).astype(np.int64))
            out["labels"] = conv(rows["labels"])
            return self._extras(out, rows, conv)
        out["position_ids"] = conv(rows["position_ids"])
        out["labels"] = conv(rows["labels"])
        if self.backend == "flash":
            cu = rows["cu_seqlens"]
            if self.fixed_cu_seqlens is not None:
                cu = _pad_cu(cu, self.fixed_cu_seqlens)
            cu_t = conv(cu)
            out["cu_seq_lens_q"] = cu_t
            out["cu_seq_lens_k"] = cu_t
            out["max_length_q"] = int(rows["max_seqlen"])
            out["max_length_k"] = int(rows["max_seqlen"])
        elif self.mask == "explicit":
            out["attention_mask"] = self._explicit_mask(rows)
        out["use_cache"] = False
        return self._extras(out, rows, conv)

    def _extras(self, out: dict[str, Any], rows: dict[str, Any], conv: Any) -> dict[str, Any]:
        if self.return_seq_idx:
            out["seq_idx"] = conv(rows["seq_idx"])
        if self.return_num_items:
            pt = self.return_tensors == "pt"
            n = int(rows["num_targets"])
            out["num_items_in_batch"] = torch.tensor(n) if pt else n
            seqs = _sequences_with_targets(rows)
            out["num_sequences_in_batch"] = torch.tensor(seqs) if pt else seqs
        return out

    def _explicit_mask(self, rows: dict[str, Any]) -> Any:
        if self.backend == "flex":
            from .attention import _document_block_mask

            cu = torch.from_numpy(rows["cu_seqlens"])
            return _document_block_mask(cu, int(cu[-1]), causal=True)
        seq = torch.from_numpy(rows["seq_idx"])
        width = seq.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool).tril_()
        allowed = (seq[:, :, None] == seq[:, None, :]) & causal  # [B, W, W]
        allowed = allowed[:, None]
        if self.backend == "sdpa":
            return allowed if self.return_tensors == "pt" else allowed.numpy()
        additive = torch.zeros(allowed.shape, dtype=self.mask_dtype)
        additive.masked_fill_(~allowed, torch.finfo(self.mask_dtype).min)
        return additive if self.return_tensors == "pt" else additive.numpy()


def _sequences_with_targets(rows: dict[str, Any]) -> int:
    """The sequences (segments) of the rows with at least one target: ``weighting=
    "sequence"``'s normaliser. A target's label sits on a token of its own sequence (the
    first token of every sequence has none)."""
    labels, seq_idx = rows["labels"], rows["seq_idx"]
    keep = labels != -100
    if not keep.any():
        return 0
    width = int(seq_idx.max()) + 1
    row = np.broadcast_to(np.arange(labels.shape[0])[:, None], labels.shape)
    # O(T): a count per (row, segment), no sort.
    return int(np.count_nonzero(np.bincount((row[keep] * width + seq_idx[keep]).ravel())))


def _pad_cu(cu: np.ndarray, size: int) -> np.ndarray:
    if len(cu) > size:
        raise FastpackError(
            f"fixed_cu_seqlens: the batch has {len(cu) - 1} segments, more than "
            f"{size - 1}; raise fixed_cu_seqlens"
        )
    return np.pad(cu, (0, size - len(cu)), mode="edge")


class OncePerBatch:
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


_STARTS = OncePerBatch()


def position_starts(position_ids: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """``[rows, width]`` bool on the host: where a sequence starts — every row start and
    wherever the position does not follow the previous one (Hugging Face's
    ``find_packed_sequence_indices`` rule). Read once per batch: a prepared model's hook
    and its attention layers read the same ``position_ids`` tensor."""
    key = (rows, width)
    if _STARTS.hit(position_ids) and _STARTS.value[0] == key:
        return _STARTS.value[1]  # type: ignore[no-any-return]
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
    _STARTS.remember(position_ids, (key, starts))
    return starts
