"""Hugging Face integration: fastpack's per-sequence attention as an attention
implementation of transformers models."""

from __future__ import annotations

from typing import Any

import torch

from .._errors import FastpackError
from .attention import varlen_attention

__all__ = ["register_hf_attention"]


def register_hf_attention(name: str = "fastpack_varlen") -> str:
    """Registers :func:`varlen_attention` as a Hugging Face attention implementation.

    Load or switch the model with ``attn_implementation=name`` and feed it
    ``PackedCollator(backend="flash")`` batches: attention then runs per sequence from
    ``cu_seq_lens_q`` — flash-attn, ``torch.nn.attention.varlen`` or flex on CUDA, a
    per-sequence SDPA loop on the CPU — with no ``attention_mask`` and no O(T²) mask.
    Calls without ``cu_seq_lens_q`` (say, generation) fall back to Hugging Face's SDPA.
    Attention dropout is not supported on the packed path (it raises)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def fastpack_varlen(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        cu_seqlens = kwargs.get("cu_seq_lens_q")
        if cu_seqlens is None:
            return sdpa_attention_forward(  # type: ignore[no-any-return]
                module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                **kwargs,
            )
        if query.shape[0] != 1:
            raise FastpackError(
                f"{name}: expected one packed row (batch size 1), got {query.shape[0]} rows; "
                f"use PackedCollator(backend='flash')"
            )
        if dropout and module.training:
            raise FastpackError(
                f"{name}: attention dropout {dropout} is not supported on packed batches; "
                f"set the model's attention dropout to 0"
            )
        # Hugging Face hands (1, heads, T, D); varlen_attention takes (T, heads, D).
        out = varlen_attention(
            query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
            cu_seqlens, int(kwargs["max_length_q"]), causal=getattr(module, "is_causal", True),
            softmax_scale=scaling,
        )
        return out.unsqueeze(0), None  # (1, T, heads, D), as Hugging Face's sdpa returns

    AttentionInterface.register(name, fastpack_varlen)
    return name
