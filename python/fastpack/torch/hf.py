"""Hugging Face integration, one import for its three modules:
:mod:`~fastpack.torch.hf_attention` (:func:`register_hf_attention`),
:mod:`~fastpack.torch.hf_check` (:func:`check_model_batch`) and
:mod:`~fastpack.torch.trainer` (:class:`PackedTrainerMixin`, :class:`StepLoader`)."""

from __future__ import annotations

from .hf_attention import register_hf_attention
from .hf_check import check_model_batch
from .trainer import STEP_KEYS, PackedTrainerMixin, StepBatches, StepLoader

__all__ = [
    "STEP_KEYS", "PackedTrainerMixin", "StepBatches", "StepLoader", "check_model_batch",
    "register_hf_attention",
]
