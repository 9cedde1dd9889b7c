"""The data layer: a whole dataset packed once, served as ready steps."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from .._errors import FastpackError, FastpackTypeError
from .._materialize import Ragged, TokenData, as_ragged
from .._plan import Plan, _int_arg
from .collator import PackedCollator

__all__ = ["PackedDataset", "first_item"]


def first_item(items: Sequence[Any]) -> Any:
    """``data_collator`` for a :class:`PackedDataset` under the Hugging Face ``Trainer``
    (with ``per_device_train_batch_size=1``): each item already is a whole batch."""
    if len(items) != 1:
        raise FastpackError(
            f"first_item: got {len(items)} items; a PackedDataset item is a whole batch, "
            "so use batch size 1"
        )
    return items[0]


class PackedDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A whole dataset packed once; item ``b`` is a ready batch of ``packs_per_batch``
    packs (formatted by ``collator``).

    Pack the full dataset instead of each batch and padding all but disappears:
    best-fit decreasing over every length reaches within a pack or two of the lower
    bound. Packs are shuffled (``seed``) so batches do not come sorted by length.

    >>> ds = PackedDataset(tokens, PackedCollator(max_len=4096, backend="sdpa"))
    >>> loader = torch.utils.data.DataLoader(ds, batch_size=None, shuffle=True)

    With the Hugging Face ``Trainer``: ``train_dataset=ds``,
    ``data_collator=fastpack.torch.first_item``, ``per_device_train_batch_size=1``.

    Args:
        tokens: token data (see :func:`fastpack.as_ragged`; a ``datasets.Dataset`` is read
            from its Arrow buffers, column ``"input_ids"``).
        collator: the :class:`PackedCollator` whose ``max_len``, backend and options to use.
        labels, loss_mask: optional per-token labels / 0/1 mask (column names with a
            ``datasets.Dataset``).
        packs_per_batch: packs (rows) per item.
        plan: a precomputed plan over ``tokens`` (default: packed here).
    """

    def __init__(
        self,
        tokens: TokenData,
        collator: PackedCollator,
        *,
        labels: TokenData | str | None = None,
        loss_mask: TokenData | str | None = None,
        packs_per_batch: int = 1,
        plan: Plan | None = None,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        dataset = tokens if _is_dataset(tokens) else None
        self.tokens: Ragged = as_ragged(tokens)
        self.labels = _resolve(labels, dataset, mask=False)
        self.loss_mask = _resolve(loss_mask, dataset, mask=True)
        self.collator = collator
        self.packs_per_batch = _int_arg("packs_per_batch", packs_per_batch, minimum=1)
        self.plan = plan if plan is not None else collator.plan(
            self.tokens.lengths, shuffle=shuffle, seed=seed
        )

    def __len__(self) -> int:
        return -(-self.plan.num_packs // self.packs_per_batch)

    def __getitem__(self, index: int) -> dict[str, Any]:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"batch {index} out of range; the dataset has {n} batches")
        lo = (index % n) * self.packs_per_batch
        packs = np.arange(lo, min(lo + self.packs_per_batch, self.plan.num_packs))
        return self.collator.batch(
            self.plan, self.tokens, packs, labels=self.labels, loss_mask=self.loss_mask
        )

    def __iter__(self) -> Iterable[dict[str, Any]]:
        return (self[i] for i in range(len(self)))


def _is_dataset(obj: Any) -> bool:
    return type(obj).__module__.startswith("datasets") and hasattr(obj, "column_names")


def _resolve(data: Any, dataset: Any, *, mask: bool) -> Ragged | None:
    if data is None:
        return None
    if isinstance(data, str):
        if dataset is None:
            raise FastpackTypeError("labels/loss_mask: a column name needs a datasets.Dataset")
        return as_ragged(dataset, column=data, mask=mask)
    return as_ragged(data, mask=mask)


