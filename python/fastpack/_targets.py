"""Target tokens per segment of a plan: how many labels other than -100 each segment
gets from :func:`fastpack.materialize`, counted without materializing.

A sampler needs these to give every micro-batch the normaliser of its whole optimizer
step (``num_items_in_batch``) before any rank has built a batch. The rules are
materialize's: a segment writes ``n`` data tokens (its piece of the sequence, after
truncation) then ``seqlen - n`` separators; a data token is a target when its label (the
token itself without ``labels``) is not -100 and its loss mask is not 0; a separator is a
target with ``train_separators``; the first position of every segment never is.
"""

from __future__ import annotations

import numpy as np

from ._errors import FastpackError
from ._materialize import IGNORE_INDEX, Ragged
from ._plan import Plan

__all__ = ["segment_targets"]

# Token positions per pass: bounds the temporaries (a bool and an int64 per position).
_CHUNK = 1 << 22


def segment_targets(
    plan: Plan,
    tokens: Ragged,
    *,
    labels: Ragged | None = None,
    loss_mask: Ragged | None = None,
    separator_id: int | None = None,
    train_separators: bool = False,
) -> np.ndarray:
    """Targets of every segment of ``plan`` (int64 [S]), as materialize would label them.

    One vectorised pass over the labels (or token ids) and the loss mask, in chunks of
    2^22 positions; nothing per sequence in Python.
    """
    rows = len(tokens)
    if plan.num_sequences != rows:
        raise FastpackError(
            f"plan: made from {plan.num_sequences} lengths, but the token data has {rows} "
            "sequences"
        )
    lengths = tokens.lengths
    for name, side in (("labels", labels), ("loss_mask", loss_mask)):
        if side is not None and not np.array_equal(side.lengths, lengths):
            if len(side) != rows:
                raise FastpackError(f"{name}: {len(side)} rows for {rows} token rows")
            i = int(np.flatnonzero(side.lengths != lengths)[0])
            raise FastpackError(
                f"{name}: row {i} has {int(side.lengths[i])} values for "
                f"{int(lengths[i])} tokens"
            )
    if plan.reserve and separator_id is None:
        raise FastpackError(
            f"separator_id: the plan reserves {plan.reserve} slot(s) after every sequence; "
            "pass the separator token id"
        )
    sample = plan.sample_ids
    start = plan.starts
    seqlen = plan.seqlens.astype(np.int64)
    length = lengths[sample]
    # The data tokens a segment writes (materialize's segment piece).
    whole = (start == 0) & (seqlen == length + plan.reserve)
    if plan.overlong == "truncate" and plan.strategy != "wrapped":
        kept = np.where(whole, length, seqlen - plan.reserve)
    else:
        kept = length
    n = np.minimum(np.maximum(kept - start, 0), seqlen)
    source_start = np.minimum(start, length)

    label_data = labels if labels is not None else tokens
    offsets = label_data.offsets.astype(np.int64, copy=False)
    a = offsets[sample] + source_start
    whole_rows = (source_start == 0) & (n == length)
    data = _count_valid(label_data, loss_mask, a, n, whole_rows=whole_rows, sample=sample)
    first = np.zeros(len(n), dtype=np.int64)
    has_data = n > 0
    if has_data.any():
        first_valid = label_data.values[a[has_data]] != IGNORE_INDEX
        if loss_mask is not None:
            mask_at = loss_mask.offsets.astype(np.int64, copy=False)[sample] + source_start
            first_valid &= loss_mask.values[mask_at[has_data]] != 0
        first[has_data] = first_valid
    separator = int(
        bool(train_separators) and separator_id is not None and separator_id != IGNORE_INDEX
    )
    separators = (seqlen - n) * separator - (~has_data) * separator
    return data - first + separators


def _count_valid(
    label_data: Ragged,
    loss_mask: Ragged | None,
    a: np.ndarray,
    n: np.ndarray,
    *,
    whole_rows: np.ndarray,
    sample: np.ndarray,
) -> np.ndarray:
    """Valid labels (not -100, mask not 0) in ``label_data.values[a : a + n]`` per segment."""
    values = label_data.values
    offsets = label_data.offsets.astype(np.int64, copy=False)
    lo, hi = int(offsets[0]), int(offsets[-1])
    if loss_mask is None:
        # Labels are mostly token ids or -100 spans; with no -100 at all, every data
        # position counts and one cheap scan replaces the prefix counts.
        any_ignored = any(
            np.count_nonzero(values[c : min(hi, c + _CHUNK)] == IGNORE_INDEX)
            for c in range(lo, hi, _CHUNK)
        )
        if not any_ignored:
            return n.copy()
        mask = None
    else:
        mask_offsets = loss_mask.offsets.astype(np.int64, copy=False)
        if np.array_equal(mask_offsets, offsets):
            mask = loss_mask.values
        else:  # the same rows laid out elsewhere: align the mask to the labels once
            mask = np.zeros(len(values), dtype=np.uint8)
            lengths = np.diff(offsets)
            within = np.arange(hi - lo, dtype=np.int64) - np.repeat(offsets[:-1] - lo, lengths)
            rows_of = np.repeat(np.arange(len(lengths)), lengths)
            mask[lo:hi] = loss_mask.values[mask_offsets[:-1][rows_of] + within]

    # Prefix counts C(q) = valid positions in [lo, q), at row starts (already sorted) and at
    # the bounds of segments that are not whole rows (sorted here: usually few).
    partial = np.flatnonzero(~whole_rows)
    bounds = np.concatenate((a[partial], a[partial] + n[partial]))
    order = np.argsort(bounds, kind="stable")
    at_rows, at_bounds = _prefix_counts(values, mask, lo, hi, [offsets, bounds[order]])
    row_counts = np.diff(at_rows)
    out = row_counts[sample]
    sorted_counts = np.empty_like(at_bounds)
    sorted_counts[order] = at_bounds
    k = len(partial)
    out[partial] = sorted_counts[k:] - sorted_counts[:k]
    return out


def _prefix_counts(
    values: np.ndarray, mask: np.ndarray | None, lo: int, hi: int, queries: list[np.ndarray]
) -> list[np.ndarray]:
    """For each sorted query array: valid positions in ``[lo, q)`` at every ``q``."""
    outs = [np.zeros(len(q), dtype=np.int64) for q in queries]
    base = 0
    for c0 in range(lo, hi, _CHUNK):
        c1 = min(hi, c0 + _CHUNK)
        valid = values[c0:c1] != IGNORE_INDEX
        if mask is not None:
            valid &= mask[c0:c1] != 0
        cumulative = np.cumsum(valid, dtype=np.int64)
        for q, out in zip(queries, outs):
            i, j = np.searchsorted(q, [c0, c1], side="right")
            out[i:j] = base + cumulative[q[i:j] - c0 - 1]
        base += int(cumulative[-1])
    for q, out in zip(queries, outs):  # queries past the data (none in a valid plan)
        out[np.searchsorted(q, hi, side="right"):] = base
    return outs
