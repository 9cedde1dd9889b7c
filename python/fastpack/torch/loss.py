"""The loss of a packed batch, normalised over the whole optimizer step.

A packed step's loss must not depend on how its samples were cut into micro-batches and
ranks. :func:`packed_loss` divides the summed token losses by a normaliser that covers
the *whole optimizer step* — every accumulation micro-step on every data-parallel rank —
which :class:`~fastpack.torch.PackedSampler` puts into every batch
(``num_items_in_batch``, ``num_sequences_in_batch``) with no collective. The gradients of
the micro-steps then simply add up to the gradient of one unpacked full-batch step:

* **gradient accumulation**: call ``backward()`` on every micro-step's loss as it is —
  do *not* divide by the number of accumulation steps (the normaliser already covers
  them); under DDP skip the all-reduce on all but the last (``model.no_sync()``).
* **DDP / FSDP** average gradients over the ``W`` data-parallel ranks (they divide the
  sum by ``W``), but this loss is already divided by the global normaliser: multiply it
  by ``W`` — the sampler's ``num_replicas``, i.e. ``torch.distributed.get_world_size()``
  of the data-parallel group — before ``backward()``. (Tensor- or context-parallel ranks
  that share one batch do not count.)

Hugging Face models compute the ``"token"`` loss themselves from a batch that carries
``num_items_in_batch`` (``model(**batch).loss`` is exactly ``packed_loss(logits, batch)``),
so for them only the ``W`` factor is left to do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import torch

from .._errors import FastpackError, FastpackTypeError
from .._materialize import IGNORE_INDEX

__all__ = ["WEIGHTINGS", "packed_loss", "segment_ids"]

#: ``"token"``: every target token weighs the same (Hugging Face's default);
#: ``"sequence"``: every sequence weighs the same, whatever its number of targets.
WEIGHTINGS = ("token", "sequence")
Weighting = Literal["token", "sequence"]


def packed_loss(
    logits: torch.Tensor,
    batch: Mapping[str, Any],
    *,
    weighting: Weighting = "token",
    num_items_in_batch: int | np.integer | np.ndarray | torch.Tensor | None = None,
    num_sequences_in_batch: int | np.integer | np.ndarray | torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Causal-LM cross-entropy of a packed batch, normalised over its optimizer step.

    Labels are the batch's unshifted ``labels`` (the model's logits at position ``t``
    predict the label at ``t + 1``), with ``ignore_index`` at the first token of every
    sequence, so no sequence is trained to predict its neighbour. A batch with
    ``shift_labels`` (a context-parallel shard: its tokens are not contiguous, so they
    were shifted on the whole row) has position ``t`` predict ``shift_labels[t]``, as
    Hugging Face's loss does.

    **Context parallelism**: a shard from
    :func:`~fastpack.torch.shard_for_context_parallel` gives this rank's share of the
    row's loss — the ranks' losses add up to the row's, for both weightings (a sequence
    split across ranks weighs by its whole target count) — and needs the normaliser
    (``num_items_in_batch`` / ``num_sequences_in_batch``) of the row or step, not its own.

    ``weighting="token"``: the sum of the token losses divided by ``num_items_in_batch``
    (the target tokens of the whole optimizer step) — what unpacked training computes
    with one big batch. ``weighting="sequence"``: each sequence's mean token loss, summed
    and divided by ``num_sequences_in_batch`` (the sequences with at least one target in
    the whole step), so a 20-token answer weighs as much as a 2,000-token one. A piece of
    a sequence split by ``overlong="split"`` counts as a sequence of its own.

    Args:
        logits: ``[rows, T, vocab]`` (or ``[T, vocab]`` for one row), matching
            ``batch["labels"]``; half precision is upcast to float32 for the loss, as
            Hugging Face does.
        batch: the batch the logits come from; reads ``labels`` and, to find the
            sequences for ``"sequence"`` weighting, ``seq_idx``, ``cu_seq_lens_q`` or
            ``position_ids`` (first present; restarts mark new sequences), else one
            sequence per row (the ``"padded"`` format). A tree batch
            (``share_prefix=True``) has no ``labels``: its target map (``target_index``,
            ``target_labels``, ``target_offsets``) lists every target of every sample,
            each counted once with its own label, and its sequences are its samples.
        weighting: ``"token"`` (default) or ``"sequence"``.
        num_items_in_batch, num_sequences_in_batch: the normalisers; default: the
            batch's keys of those names (set by :class:`~fastpack.torch.PackedSampler`
            steps), else the counts of this batch alone (a plain mean). An int, a numpy
            integer or one-element integer array (as in ``return_tensors="np"`` batches),
            or a one-element tensor.
        ignore_index: the label that is not a target.

    Returns:
        A 0-d tensor (float32, or float64 for float64 logits). A step without targets
        gives 0 (with zero gradients), not NaN. Multiply by the data-parallel world size
        under DDP / FSDP (module docs).

    Raises:
        FastpackError: unknown ``weighting``, a missing ``labels`` key, shapes that do
            not match, or a negative normaliser.
        FastpackTypeError: ``logits`` is not a floating-point tensor, ``batch`` not a dict,
            ``labels`` not integers, or a normaliser not an integer count.
    """
    if weighting not in WEIGHTINGS:
        raise FastpackError(
            f"weighting: unknown value {weighting!r}; expected 'token' or 'sequence'"
        )
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise FastpackTypeError(
            f"logits: expected a floating-point torch.Tensor, got "
            f"{type(logits).__name__ if not isinstance(logits, torch.Tensor) else logits.dtype}"
        )
    if not isinstance(batch, Mapping):
        raise FastpackTypeError(
            f"batch: expected the batch as a dict (a Mapping with 'labels'), got "
            f"{type(batch).__name__}"
        )
    if "target_index" in batch:
        return _tree_loss(logits, batch, weighting, num_items_in_batch, num_sequences_in_batch)
    if "labels" not in batch and "shift_labels" not in batch:
        raise FastpackError(f"batch: no 'labels' key (keys: {sorted(batch)})")
    if isinstance(ignore_index, (bool, np.bool_)) or not isinstance(
        ignore_index, (int, np.integer)
    ):
        raise FastpackTypeError(
            f"ignore_index: expected an int, got {type(ignore_index).__name__} {ignore_index!r}"
        )
    # Already shifted (a context-parallel shard, whose tokens are not contiguous): the
    # target of position t is shift_labels[t], not labels[t + 1].
    shifted = batch.get("shift_labels") is not None
    labels = _labels(batch["shift_labels"] if shifted else batch["labels"])
    if logits.ndim == 2:
        logits = logits.unsqueeze(0)
    if labels.ndim == 1:
        labels = labels.unsqueeze(0)
    if logits.ndim != 3 or tuple(logits.shape[:2]) != tuple(labels.shape):
        raise FastpackError(
            f"logits: shape {tuple(logits.shape)} does not match "
            f"{'shift_labels' if shifted else 'labels'} {tuple(labels.shape)}; "
            "expected [rows, T, vocab] with labels [rows, T]"
        )
    sharded = "cp_size" in batch
    if sharded:
        key = "num_items_in_batch" if weighting == "token" else "num_sequences_in_batch"
        given = num_items_in_batch if weighting == "token" else num_sequences_in_batch
        if given is None and batch.get(key) is None:
            raise FastpackError(
                f"{key}: a context-parallel batch holds one rank's share of its sequences, so "
                f"its own counts are not the row's; pass {key} (PackedSampler steps carry it, "
                f"PackedCollator(return_num_items=True) the row's)"
            )
    if labels.device.type == "cpu":  # on an accelerator the check would sync
        ids = labels[labels != ignore_index]
        if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < logits.shape[-1]:
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise FastpackError(
                f"labels: token id {bad} is outside the vocabulary 0..{logits.shape[-1] - 1} "
                f"(logits.shape[-1] = {logits.shape[-1]}); the only other label allowed is "
                f"ignore_index ({ignore_index})"
            )
    labels = labels.to(logits.device)
    targets = labels if shifted else labels[:, 1:]
    flat = (logits if shifted else logits[:, :-1]).reshape(-1, logits.shape[-1])
    if flat.dtype not in (torch.float32, torch.float64):  # half precision: upcast, as HF does
        flat = flat.float()
    token_loss = torch.nn.functional.cross_entropy(
        flat, targets.reshape(-1),
        ignore_index=ignore_index, reduction="none",
    )  # 0 where ignored
    valid = targets.reshape(-1) != ignore_index

    if weighting == "token":
        n = _normaliser("num_items_in_batch", num_items_in_batch, batch, valid.sum())
        return token_loss.sum() / n.to(token_loss.device).clamp(min=1)

    if sharded:
        # Each rank holds pieces (runs) of sequences: weigh each target by its whole
        # sequence's target count, which the shard carries per run.
        runs = torch.as_tensor(batch["seq_idx"]).to(labels.device, torch.int64).reshape(-1)
        per_run = torch.as_tensor(batch["cp_sequence_targets"]).to(labels.device)
        weights = 1.0 / per_run[runs].clamp(min=1).to(token_loss.dtype)
        n = _normaliser("num_sequences_in_batch", num_sequences_in_batch, batch,
                        torch.zeros((), dtype=torch.int64))
        return (token_loss * weights).sum() / n.to(token_loss.device).clamp(min=1)
    # Each target belongs to the sequence of the token it labels (position t + 1; the
    # token itself when the labels come shifted).
    seg = segment_ids(batch, labels.shape, labels.device)
    seg = (seg if shifted else seg[:, 1:]).reshape(-1)
    num_segments = labels.numel()  # an upper bound: reading the true count would sync
    sums = token_loss.new_zeros(num_segments).index_add_(0, seg, token_loss)
    counts = torch.zeros(num_segments, dtype=torch.int64, device=seg.device).index_add_(
        0, seg, valid.to(torch.int64)
    )
    has_targets = counts > 0
    per_sequence = sums / counts.clamp(min=1)  # 0 for sequences without targets
    n = _normaliser("num_sequences_in_batch", num_sequences_in_batch, batch, has_targets.sum())
    return per_sequence.sum() / n.to(per_sequence.device).clamp(min=1)


def _tree_loss(
    logits: torch.Tensor,
    batch: Mapping[str, Any],
    weighting: Weighting,
    num_items_in_batch: Any,
    num_sequences_in_batch: Any,
) -> torch.Tensor:
    """The loss of a batch with a target map (a tree batch): every target of every sample
    once, with its own label, from the logit that predicts it (shared by the targets of
    the samples that share a prefix)."""
    from .tree import per_sample, token_logprobs

    token_loss = -token_logprobs(logits, batch)
    if weighting == "token":
        n = _normaliser("num_items_in_batch", num_items_in_batch, batch,
                        torch.tensor(token_loss.numel()))
        return token_loss.sum() / n.to(token_loss.device).clamp(min=1)
    means = per_sample(token_loss, batch, of="targets", reduction="mean")
    assert isinstance(means, torch.Tensor)
    counts = torch.as_tensor(batch["target_offsets"]).diff()
    n = _normaliser("num_sequences_in_batch", num_sequences_in_batch, batch,
                    (counts > 0).sum())
    return means.sum() / n.to(means.device).clamp(min=1)


def segment_ids(
    batch: Mapping[str, Any], shape: tuple[int, ...] | torch.Size, device: torch.device
) -> torch.Tensor:
    """int64 ``[rows, T]``: a batch-wide index of the sequence each token belongs to
    (padding may form segments of its own; they have no targets)."""
    rows, width = int(shape[0]), int(shape[1])
    if "seq_idx" in batch:
        local = torch.as_tensor(batch["seq_idx"]).to(device=device, dtype=torch.int64)
        _check_shape("seq_idx", local, rows, width)
        starts = torch.ones_like(local, dtype=torch.bool)
        starts[:, 1:] = local[:, 1:] != local[:, :-1]
    elif "cu_seq_lens_q" in batch:
        if rows != 1:
            raise FastpackError(
                f"cu_seq_lens_q: describes one flat row, but the batch has {rows} rows"
            )
        cu = torch.as_tensor(batch["cu_seq_lens_q"]).to(device=device, dtype=torch.int64)
        starts = torch.zeros(1, width, dtype=torch.bool, device=device)
        begins = cu[:-1][cu[:-1] < width]  # repeated trailing entries: empty sequences
        starts[0, begins] = True
    elif "position_ids" in batch:
        pos = torch.as_tensor(batch["position_ids"]).to(device)
        if pos.ndim == 1:
            pos = pos.unsqueeze(0)
        _check_shape("position_ids", pos, rows, width)
        starts = pos == 0
    else:  # the padded format: a row is a sequence
        starts = torch.zeros(rows, width, dtype=torch.bool, device=device)
    starts[:, 0] = True  # no sequence spans two rows
    return starts.reshape(-1).cumsum(0).sub_(1).reshape(rows, width)


def _labels(value: Any) -> torch.Tensor:
    try:
        labels = torch.as_tensor(value)
    except (TypeError, RuntimeError, ValueError):
        raise FastpackTypeError(
            f"labels: expected integer token ids (a tensor, array or nested list), "
            f"got {type(value).__name__}"
        ) from None
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise FastpackTypeError(
            f"labels: expected integer token ids, got dtype {labels.dtype}"
        )
    return labels


def _check_shape(name: str, t: torch.Tensor, rows: int, width: int) -> None:
    if tuple(t.shape) != (rows, width):
        raise FastpackError(
            f"{name}: shape {tuple(t.shape)} does not match labels ({rows}, {width})"
        )


def _normaliser(
    name: str, given: Any, batch: Mapping[str, Any], local: torch.Tensor
) -> torch.Tensor:
    value = given if given is not None else batch.get(name)
    if value is None:
        return local
    if isinstance(value, (np.integer, np.ndarray)):
        # numpy counts are exact when they are integers: a numpy scalar, or a one-element
        # array (``PackedDataset(..., return_tensors="np")`` batches carry a 0-d one).
        array = np.asarray(value)
        if array.dtype.kind not in "iu" or array.size != 1:
            raise FastpackTypeError(
                f"{name}: expected an integer count (an int, a numpy integer, a one-element "
                f"integer array or tensor), got a numpy array of dtype {array.dtype} and "
                f"shape {array.shape}"
            )
        value = int(array.reshape(()))
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, torch.Tensor)):
        raise FastpackTypeError(
            f"{name}: expected an integer count (an int, a numpy integer, a one-element "
            f"integer array or tensor), got {type(value).__name__} "
            f"{value if isinstance(value, np.generic) else repr(value)}"
        )
    t = torch.as_tensor(value)
    if t.numel() != 1:
        raise FastpackError(f"{name}: expected one number, got shape {tuple(t.shape)}")
    if t.device.type == "cpu" and int(t) < 0:  # no device sync for the check
        raise FastpackError(f"{name}: must be >= 0, got {int(t)}")
    return t.reshape(())
