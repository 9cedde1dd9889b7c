"""Packs of a plan plus token columns -> a pyarrow record batch of packed rows, one row per
pack, with the columns of ``fastpack.hf.pack_dataset``: every per-token column packed,
``seq_lengths`` (list<int32>, TRL's column) and ``position_ids``.

This is the one seam between the offline passes (the command, Ray) and the gather itself.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pyarrow as pa

__all__ = ["Columns", "gather_batch"]


class Columns:
    """Token data of some documents in the Arrow list layout: every column shares
    ``offsets`` (int64 [D+1]); document ``i`` of column ``c`` is
    ``values[c][offsets[i]:offsets[i+1]]``."""

    __slots__ = ("offsets", "values")

    def __init__(self, values: Mapping[str, np.ndarray], offsets: np.ndarray) -> None:
        self.values = dict(values)
        self.offsets = offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1


def gather_batch(
    columns: Columns,
    sample_ids: np.ndarray,
    starts: np.ndarray,
    seqlens: np.ndarray,
    pack_offsets: np.ndarray,
) -> pa.RecordBatch:
    """Packed rows for the segments given (``sample_ids`` index ``columns``' documents;
    ``pack_offsets`` starts at 0)."""
    seqlens64 = seqlens.astype(np.int64)
    seg_out = np.zeros(len(seqlens64) + 1, dtype=np.int64)
    np.cumsum(seqlens64, out=seg_out[1:])
    total = int(seg_out[-1])
    # Every output token's source index: one repeat per segment, no Python loop.
    shift = np.repeat(columns.offsets[sample_ids] + starts - seg_out[:-1], seqlens64)
    index = shift + np.arange(total, dtype=np.int64)
    token_offsets = seg_out[pack_offsets]
    if total >= 2**31:
        raise OverflowError("a batch of packs holds 2^31 tokens or more")
    list_offsets = pa.array(token_offsets.astype(np.int32))
    arrays: dict[str, pa.Array] = {}
    for name, values in columns.values.items():
        arrays[name] = pa.ListArray.from_arrays(list_offsets, pa.array(values[index]))
    arrays["seq_lengths"] = pa.ListArray.from_arrays(
        pa.array((pack_offsets - pack_offsets[0]).astype(np.int32)),
        pa.array(seqlens.astype(np.int32)),
    )
    positions = np.arange(total, dtype=np.int64) - np.repeat(seg_out[:-1], seqlens64)
    arrays["position_ids"] = pa.ListArray.from_arrays(list_offsets, pa.array(positions))
    return pa.RecordBatch.from_pydict(arrays)
