from typing import Any

import numpy as np

__all__ = [
    "cu_seqlens",
    "default_threads",
    "flatten_int_lists",
    "materialize",
    "pack",
    "varlen",
]

def pack(
    lengths: np.ndarray,
    max_len: int,
    strategy: str = "bfd",
    overlong: str = "error",
    reserve: int = 0,
    seed: int | None = None,
    threads: int | None = None,
    shard_items: int | None = None,
    long_max_len: int | None = None,
    group_tokens: int | None = None,
) -> dict[str, Any]: ...
def cu_seqlens(seqlens: np.ndarray, pack_offsets: np.ndarray, packs: np.ndarray) -> np.ndarray: ...
def varlen(
    seqlens: np.ndarray, pack_offsets: np.ndarray, packs: np.ndarray, threads: int | None
) -> tuple[np.ndarray, np.ndarray]: ...
def default_threads() -> int: ...
def materialize(
    sample_ids: np.ndarray,
    starts: np.ndarray,
    seqlens: np.ndarray,
    pack_offsets: np.ndarray,
    reserve: int,
    strategy: str,
    overlong: str,
    packs: np.ndarray,
    tokens: np.ndarray,
    token_offsets: np.ndarray,
    labels: np.ndarray | None = None,
    label_offsets: np.ndarray | None = None,
    loss_mask: np.ndarray | None = None,
    mask_offsets: np.ndarray | None = None,
    separator_id: int | None = None,
    train_separators: bool = False,
    layout: str = "flat",
    pad_to: int | None = None,
    pad_to_multiple_of: int = 1,
    pad_id: int = 0,
    threads: int | None = None,
) -> dict[str, Any]: ...
def flatten_int_lists(rows: list[Any], mask: bool = False) -> tuple[np.ndarray, np.ndarray]: ...
