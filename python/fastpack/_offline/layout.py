"""What the output holds: parquet shards of packed rows (``shard_rows`` packs each, never
across plan shards), their row groups, names and columns."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from .._gather import written_fields

if TYPE_CHECKING:
    from .settings import PackSettings

__all__ = [
    "ROW_GROUP_TOKENS",
    "output_schema",
    "row_group_packs",
    "shard_bounds",
    "shard_name",
]

# Tokens per output row group: the unit of the output side of the memory bound.
ROW_GROUP_TOKENS = 1 << 20
def shard_bounds(pack_counts: Sequence[int], shard_rows: int) -> np.ndarray:
    """Pack offsets (int64 [n+1]) of the output shards: ``shard_rows`` packs each, never
    across plan shards, so every plan shard's output is its own."""
    bounds = [0]
    base = 0
    for count in pack_counts:
        bounds.extend(range(base + shard_rows, base + count, shard_rows))
        base += count
        if count:
            bounds.append(base)
    return np.asarray(bounds, dtype=np.int64)


def shard_name(i: int, n: int) -> str:
    return f"shard-{i:05d}-of-{n:05d}.parquet"


def output_schema(settings: PackSettings, dtypes: dict[str, str]) -> pa.Schema:
    """The packed token columns (each in the dtype the lengths pass found it needs), then
    the columns the packing writes (``fastpack._gather.written_fields``)."""
    fields = [pa.field(c, pa.list_(pa.from_numpy_dtype(np.dtype(dtypes[c]))))
              for c in settings.token_columns]
    return pa.schema(fields + written_fields())


def row_group_packs(settings: PackSettings) -> int:
    """Packs per parquet row group: ``ROW_GROUP_TOKENS`` at the largest cap."""
    assert settings.shard_rows is not None
    return max(1, min(settings.shard_rows, ROW_GROUP_TOKENS // settings.max_cap))
