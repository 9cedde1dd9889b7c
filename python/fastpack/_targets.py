"""Target tokens per segment of a plan: how many labels other than -100 each segment gets
from :func:`fastpack.materialize`, counted in Rust without building any row.

A sampler needs these to give every micro-batch the normaliser of its whole optimizer
step (``num_items_in_batch``) before any rank has built a batch. The rules are
materialize's: a segment writes ``n`` data tokens (its piece of the sequence, after
truncation) then ``seqlen - n`` separators; a data token is a target when its label (the
token itself without ``labels``) is not -100 and its loss mask is not 0; a separator is a
target with ``train_separators``; the first position of every segment never is.
"""

from __future__ import annotations

import numpy as np

from . import _core
from ._errors import FastpackError
from ._materialize import Ragged
from ._plan import Plan

__all__ = ["segment_targets"]


def segment_targets(
    plan: Plan,
    tokens: Ragged,
    *,
    labels: Ragged | None = None,
    loss_mask: Ragged | None = None,
    separator_id: int | None = None,
    train_separators: bool = False,
    threads: int | None = None,
    ignore_tokens: tuple[int, ...] = (),
) -> np.ndarray:
    """Targets of every segment of ``plan`` (uint32 [S]), as materialize would label them:
    one parallel pass over the labels and the loss mask of the plan's sequences, read where
    they lie (Arrow chunks through a dataset's indices mapping, never copied). The token
    ids themselves are read only with ``ignore_tokens`` (a token id is never -100: without
    labels and mask the counts follow from the segments' lengths). A token whose id is in
    ``ignore_tokens`` is never a target: a vision-language batch's image and video
    placeholders, whose labels the collator sets to -100."""
    if plan.num_sequences != len(tokens):
        raise FastpackError(
            f"plan: made from {plan.num_sequences} lengths, but the token data has "
            f"{len(tokens)} sequences"
        )
    result: np.ndarray = _core.segment_targets(
        plan, tokens.column,
        None if labels is None else labels.column,
        None if loss_mask is None else loss_mask.column,
        separator_id, bool(train_separators), threads,
        [int(t) for t in ignore_tokens] or None,
    )
    return result
