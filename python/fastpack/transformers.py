"""A drop-in for transformers' ``DataCollatorWithFlattening``: change one import.

>>> from fastpack.transformers import DataCollatorWithFlattening  # was: from transformers

Same arguments, same keys, values, shapes and dtypes, samples in input order, one row
(``[1, total_tokens]``); the rows are flattened in Rust (lists of ints read straight from
the list objects) and the boundaries computed with numpy, instead of a Python loop over
every token. It is a subclass of transformers' class, so code that checks
``isinstance(collator, transformers.DataCollatorWithFlattening)`` (the Trainer, TRL)
treats it as the original. ``transformers`` must be installed.

fastpack's own :class:`fastpack.torch.PackedCollator` packs a batch into rows of
``max_len`` and adds keys of its own: it is the native API, not the drop-in.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _core
from ._errors import FastpackError
from ._materialize import as_ragged

try:
    from transformers.data.data_collator import DataCollatorWithFlattening as _HFFlattening
    from transformers.data.data_collator import DefaultDataCollator as _HFDefault
except ImportError as e:  # pragma: no cover - exercised without transformers installed
    raise ImportError(
        "fastpack.transformers is a drop-in for transformers' DataCollatorWithFlattening "
        "and needs transformers: pip install transformers"
    ) from e

__all__ = ["DataCollatorWithFlattening"]

#: HF's dtypes: token ids, labels and positions int64; seq_idx and cu_seq_lens int32.
_INT32 = ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k")


class DataCollatorWithFlattening(_HFFlattening):  # type: ignore[misc]
    """transformers' ``DataCollatorWithFlattening``, flattened by fastpack.

    Concatenates the batch's samples (those with at least one token, in input order)
    into one row. Returns ``input_ids`` and ``labels`` (``[1, T]`` int64: each sample's
    ``labels``, or its ``input_ids`` without them, with ``separator_id`` at every
    sample's first token, so no sample predicts the next one's first token), then, as
    asked, ``position_ids`` (``[1, T]`` int64, ``position_ids_start`` at every sample's
    first token), ``seq_idx`` (``[1, T]`` int32, the sample of each token) and the flash
    attention keys ``cu_seq_lens_q/k`` (``[N + 1]`` int32) and ``max_length_q/k``
    (Python ints). Nothing else: no ``attention_mask``, no extra keys.

    Args:
        return_tensors: ``"pt"`` (torch, the default) or ``"np"``.
        return_position_ids: return ``position_ids`` (default True).
        separator_id: the label at every sample's first token (default -100: ignored
            by the loss).
        return_flash_attn_kwargs: return ``cu_seq_lens_q/k`` and ``max_length_q/k``.
        return_seq_idx: return ``seq_idx``.
        position_ids_start: the position of every sample's first token (default 0).

    ``__call__(features, return_tensors=None, separator_id=None)`` overrides both for
    one call. A batch of only empty samples raises a ``FastpackError`` (a
    ``ValueError``, as transformers raises).
    """

    def __init__(
        self,
        *args: Any,
        return_position_ids: bool = True,
        separator_id: int = -100,
        return_flash_attn_kwargs: bool = False,
        return_seq_idx: bool = False,
        position_ids_start: int = 0,
        **kwargs: Any,
    ) -> None:
        # DefaultDataCollator's own fields (return_tensors); the rest set here, so the
        # signature is this one whatever version of transformers is installed.
        _HFDefault.__init__(self, *args, **kwargs)
        self.return_position_ids = return_position_ids
        self.separator_id = separator_id
        self.return_flash_attn_kwargs = return_flash_attn_kwargs
        self.return_seq_idx = return_seq_idx
        self.position_ids_start = position_ids_start

    def __call__(self, features: Any, return_tensors: str | None = None,
                 separator_id: int | None = None) -> dict[str, Any]:
        return_tensors = self.return_tensors if return_tensors is None else return_tensors
        if return_tensors not in ("pt", "np"):
            raise FastpackError(
                f"return_tensors: expected 'pt' or 'np', got {return_tensors!r}")
        separator_id = self.separator_id if separator_id is None else separator_id
        features = list(features)
        if not features:
            raise FastpackError("features: the batch is empty")
        ids = as_ragged([f["input_ids"] for f in features], name="input_ids")
        lengths = np.diff(ids.offsets)
        # Empty samples are left out; they hold no values, so the values stay as they are.
        keep = lengths > 0
        if not keep.any():
            raise FastpackError("features: every example in the batch is empty")
        starts, lens = ids.offsets[:-1][keep], lengths[keep]
        if "labels" in features[0]:
            labels_rows = as_ragged([f["labels"] for f in features], name="labels")
            label_lengths = np.diff(labels_rows.offsets)
            if not np.array_equal(label_lengths, lengths):
                i = int(np.argmax(label_lengths != lengths))
                raise FastpackError(
                    f"labels: sample {i} has {int(label_lengths[i])} labels for "
                    f"{int(lengths[i])} input_ids; expected one label per token")
            labels = np.array(labels_rows.values, dtype=np.int64)
        else:
            labels = ids.values.copy()
        labels[starts] = separator_id
        batch: dict[str, Any] = {"input_ids": ids.values, "labels": labels}
        if self.return_position_ids or self.return_flash_attn_kwargs:
            seqlens = lens.astype(np.int32)
            one_row = np.array([0, len(seqlens)], dtype=np.int64)
            cu, positions = _core.varlen(seqlens, one_row, np.zeros(1, dtype=np.int64), 1)
            if self.return_position_ids:
                if self.position_ids_start:
                    positions += self.position_ids_start
                batch["position_ids"] = positions
        if self.return_seq_idx:
            batch["seq_idx"] = np.repeat(np.arange(len(lens), dtype=np.int32), lens)
        for key in batch:  # every per-token key is one row: [1, T]
            batch[key] = batch[key].reshape(1, -1)
        if self.return_flash_attn_kwargs:
            batch["cu_seq_lens_q"] = cu
            batch["cu_seq_lens_k"] = cu.copy()
            batch["max_length_q"] = batch["max_length_k"] = int(lens.max())
        return _tensors(batch, return_tensors)


def _tensors(batch: dict[str, Any], return_tensors: str) -> dict[str, Any]:
    for key, value in batch.items():
        if isinstance(value, np.ndarray):
            value = value.astype(np.int32 if key in _INT32 else np.int64, copy=False)
            batch[key] = value
    if return_tensors == "pt":
        import torch

        for key, value in batch.items():
            if isinstance(value, np.ndarray):
                batch[key] = torch.from_numpy(value)
    return batch
