"""What one micro-step reads: :class:`Step`, made by the sampler and read by the dataset.

Its own module so that :mod:`~fastpack.torch.sampler` (which makes steps) and
:mod:`~fastpack.torch.data` (which reads them) both import it, and neither the other.
"""

from __future__ import annotations

from typing import NamedTuple, Union

import numpy as np

__all__ = ["Step"]


class Step(NamedTuple):
    """One micro-step of one rank, as :class:`~fastpack.torch.PackedSampler` yields it and
    :class:`~fastpack.torch.PackedDataset` reads it.

    ``index`` is the dataset's step; ``segments`` is ``None`` for the whole step, or the
    range ``(lo, hi)`` of the plan's segments inside it when the step was cut into
    smaller ones (the remainder of an epoch). ``num_items_in_batch`` counts the target
    tokens (labels other than -100) of the whole optimizer step, over every rank and
    every accumulation micro-step; ``num_sequences_in_batch`` the sequences (segments)
    with at least one target in the same scope.

    A micro-batch of a sampler with a cap (``micro_batch_tokens``) names its sequences as
    ``segments``, an ascending int64 array of the plan's segments (taken from any of the
    global step's dataset steps; ``index`` is then this rank's dataset step, for the
    record); it is its rank's ``micro``-th of ``micro_batches`` in the global step, and
    ``last`` when it ends its optimizer step (step the optimizer after it). The array is
    empty for a filler micro-batch (a global step with fewer sequences than ranks ×
    micro-batches): the dataset gives a batch without targets, which keeps the rank in
    lockstep at zero loss.
    """

    index: int  # type: ignore[assignment]  # shadows tuple.index, by contract
    segments: Union[tuple[int, int], np.ndarray, None]  # noqa: UP007  (a runtime alias)
    num_items_in_batch: int
    num_sequences_in_batch: int
    micro: int = 0
    micro_batches: int = 1
    last: bool = False
