"""The PyTorch layer: packed batches that every attention implementation trains on correctly.

Its modules are its layers:

- :mod:`~fastpack.torch.formats` — one batch format per backend (``flash``, ``sdpa``,
  ``eager``, ``flex``, ``padded``): what ``model(**batch)`` needs for it.
- :mod:`~fastpack.torch.collator` — :class:`PackedCollator`: which samples of a batch share
  a pack (the planning policy) plus the batch format; a drop-in ``collate_fn`` /
  ``data_collator``.
- :mod:`~fastpack.torch.step` — :class:`Step`: one rank's share of a global step, which
  ``data`` serves and ``sampler`` schedules.
- :mod:`~fastpack.torch.data` — :class:`PackedDataset`: a whole dataset packed once (one
  global plan), item ``i`` is step ``i``.
- :mod:`~fastpack.torch.stream` — :class:`PackedIterableDataset`: a stream of samples
  packed a window at a time, split across workers and ranks, resumable mid-window.
- :mod:`~fastpack.torch.sampler` — :class:`PackedSampler`: the schedule of those steps over
  data-parallel ranks (balanced, every sample once, resumable) and every micro-step's
  ``num_items_in_batch``.
- :mod:`~fastpack.torch.attention` — :func:`varlen_attention` over ``cu_seqlens`` with the
  fastest kernel available (flash-attn, ``torch.nn.attention.varlen``, flex, SDPA).
- :mod:`~fastpack.torch.loss` — :func:`packed_loss`: the loss of a packed batch normalised
  over its whole optimizer step (all micro-steps, all ranks), per token or per sequence.
- :mod:`~fastpack.torch.context_parallel` — one packed row split across a context-parallel
  group (:func:`shard_for_context_parallel`) and the exact attention over the pieces
  (:func:`context_parallel_attention`).
- :mod:`~fastpack.torch.tree` — tree batches (``share_prefix=True``: shared prefixes
  computed once), their attention and :func:`per_sample` / :func:`token_logprobs`: every
  sample's values, plain batch or tree.
- :mod:`~fastpack.torch.mixers` — :func:`prepare_model`: the token mixers beyond softmax
  attention (Mamba / Mamba2, gated delta nets, short convolutions) restart their state at
  every sequence of a packed batch.
- :mod:`~fastpack.torch.verify` — :func:`verify_packing`: a packed batch's samples run
  alone through the user's model and compared, naming the first module that differs.
- :mod:`~fastpack.torch.hf_attention` — :func:`register_hf_attention`: fastpack's
  attention as a Hugging Face attention implementation.
- :mod:`~fastpack.torch.hf_check` — :func:`check_model_batch`: whether a Hugging Face
  model computes on a packed batch what it computes unpacked, before any forward.
- :mod:`~fastpack.torch.trainer` — :class:`PackedTrainerMixin` for the ``Trainer`` / TRL
  ``SFTTrainer`` on many ranks (``fastpack.torch.hf`` re-exports these three modules'
  names).

Every batch's ``labels`` are unshifted (the model shifts), -100 at the first token of
every sequence, on padding and where the sample's loss mask is 0. The layers of the whole
package, and which module owns which idea: docs/architecture.md.
"""

from __future__ import annotations

from .attention import KERNELS, varlen_attention
from .collator import LOSS_MASK_KEYS, PackedCollator
from .context_parallel import (
    CP_KERNELS,
    CP_KEYS,
    ShardMask,
    context_parallel_attention,
    shard_for_context_parallel,
)
from .data import PackedDataset, StepTable, first_item
from .formats import BACKENDS, BatchFormat
from .hf_attention import register_hf_attention
from .hf_check import check_model_batch
from .loss import WEIGHTINGS, packed_loss
from .mixers import MIXERS, mixer_paths, prepare_model
from .sampler import PackedSampler, Schedule, Step
from .stream import SHARDINGS, PackedIterableDataset
from .trainer import PackedTrainerMixin
from .tree import per_sample, token_logprobs
from .verify import VerifyReport, verify_packing

__all__ = [
    "BACKENDS",
    "CP_KERNELS",
    "CP_KEYS",
    "KERNELS",
    "LOSS_MASK_KEYS",
    "MIXERS",
    "WEIGHTINGS",
    "BatchFormat",
    "PackedCollator",
    "PackedDataset",
    "PackedIterableDataset",
    "SHARDINGS",
    "PackedSampler",
    "PackedTrainerMixin",
    "Schedule",
    "ShardMask",
    "Step",
    "StepTable",
    "check_model_batch",
    "context_parallel_attention",
    "first_item",
    "mixer_paths",
    "packed_loss",
    "prepare_model",
    "per_sample",
    "register_hf_attention",
    "shard_for_context_parallel",
    "token_logprobs",
    "varlen_attention",
    "verify_packing",
    "VerifyReport",
]
