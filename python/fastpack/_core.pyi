from typing import Any

import numpy as np

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
