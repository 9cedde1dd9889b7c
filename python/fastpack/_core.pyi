from typing import Any, final

import numpy as np

from fastpack._plan import Plan

__all__ = [
    "affinity_metrics",
    "best_fit_oldest",
    "bucket_metrics",
    "by_cost",
    "ListColumn",
    "column_lengths",
    "cp_plan_lengths",
    "cp_rank_attention",
    "cp_rank_tokens",
    "cp_real_seqlens",
    "cp_stream",
    "cp_streams",
    "cu_seqlens",
    "default_threads",
    "lpt_groups",
    "flatten_int_lists",
    "gather",
    "materialize",
    "media_grids",
    "pack",
    "pack_affinity",
    "pack_segments",
    "plan_metrics",
    "permutation",
    "rope_index",
    "segment_targets",
    "step_sums",
    "pack_tokens",
    "tree_expand",
    "tree_items",
    "tree_path_targets",
    "tree_rows",
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
    limits: list[tuple[str, np.ndarray, int]] | None = None,
) -> dict[str, Any]: ...
def pack_segments(
    lengths: np.ndarray,
    offsets: np.ndarray,
    max_len: int,
    strategy: str = "bfd",
    overlong: str = "error",
    reserve: int = 0,
    seeds: np.ndarray | None = None,
    threads: int | None = None,
    long_max_len: int | None = None,
) -> dict[str, Any]: ...
def pack_affinity(
    lengths: np.ndarray,
    keys: np.ndarray,
    max_len: int,
    overlong: str = "error",
    reserve: int = 0,
    seed: int | None = None,
    threads: int | None = None,
    slack: int | None = None,
) -> dict[str, Any]: ...
def affinity_metrics(
    sample_ids: np.ndarray, seqlens: np.ndarray, pack_offsets: np.ndarray, keys: np.ndarray
) -> dict[str, Any]: ...
def rope_index(
    input_ids: np.ndarray,
    cu_seqlens: np.ndarray | None,
    model_type: str,
    image_token_id: int,
    video_token_id: int,
    spatial_merge_size: int,
    tokens_per_second: float,
    image_grid_thw: np.ndarray | None = None,
    video_grid_thw: np.ndarray | None = None,
    second_per_grid_ts: np.ndarray | None = None,
    time_math: str = "float32",
    text_row: bool = False,
    threads: int | None = None,
) -> np.ndarray: ...
def media_grids(
    heights: np.ndarray,
    widths: np.ndarray,
    frames: np.ndarray | None,
    patch_size: int,
    merge_size: int,
    temporal_patch_size: int,
    min_pixels: int,
    max_pixels: int,
    temporal: bool = False,
    threads: int | None = None,
) -> np.ndarray: ...
def best_fit_oldest(lengths: np.ndarray, max_len: int) -> np.ndarray: ...
def cu_seqlens(seqlens: np.ndarray, pack_offsets: np.ndarray, packs: np.ndarray) -> np.ndarray: ...
def varlen(
    seqlens: np.ndarray, pack_offsets: np.ndarray, packs: np.ndarray, threads: int | None
) -> tuple[np.ndarray, np.ndarray]: ...
def plan_metrics(
    seqlens: np.ndarray,
    pack_offsets: np.ndarray,
    max_len: int,
    bucket_sequences: list[int],
    pack_caps: np.ndarray | None = None,
    long_max_len: int | None = None,
    group_offsets: np.ndarray | None = None,
    group_tokens: int | None = None,
) -> dict[str, Any]: ...
def bucket_metrics(
    buckets: list[tuple[int, int, int, int]],
    group_tokens: int | None = None,
    num_groups: int = 0,
) -> dict[str, Any]: ...
def default_threads() -> int: ...
def cp_stream(
    cu_seqlens: np.ndarray, cp_size: int, mode: str, pad_multiple: int
) -> tuple[np.ndarray, np.ndarray]: ...
def cp_rank_tokens(
    cu_seqlens: np.ndarray,
    cp_size: int,
    mode: str,
    pad_multiple: int,
    rank: int,
    threads: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...
def cp_rank_attention(
    cu_seqlens: np.ndarray,
    cp_size: int,
    mode: str,
    pad_multiple: int,
    rank: int,
    threads: int | None = None,
) -> dict[str, Any]: ...
def cp_streams(
    seqlens: np.ndarray,
    offsets: np.ndarray,
    cp_size: int,
    mode: str,
    pad_multiple: int,
    threads: int | None = None,
    work: bool = True,
) -> tuple[np.ndarray, np.ndarray | None]: ...
def cp_plan_lengths(
    lengths: np.ndarray,
    cp_size: int,
    mode: str,
    pad_multiple: int,
    reserve: int,
    top: int,
    threads: int | None = None,
) -> tuple[np.ndarray | None, int, int | None, int, int]: ...
def cp_real_seqlens(
    plan: dict[str, Any],
    lengths: np.ndarray,
    reserve: int,
    threads: int | None = None,
) -> None: ...
def materialize(
    plan: Plan,
    packs: np.ndarray,
    tokens: ListColumn,
    labels: ListColumn | None = None,
    loss_mask: ListColumn | None = None,
    separator_id: int | None = None,
    train_separators: bool = False,
    layout: str = "flat",
    pad_to: int | None = None,
    pad_to_multiple_of: int = 1,
    pad_id: int = 0,
    threads: int | None = None,
) -> dict[str, Any]: ...
def permutation(n: int, seed: int, threads: int | None = None) -> np.ndarray: ...
def by_cost(cost: np.ndarray, seed: int, threads: int | None = None) -> np.ndarray: ...
def lpt_groups(
    group: np.ndarray,
    cost: np.ndarray,
    tokens: np.ndarray,
    bins: np.ndarray,
    token_cap: float,
    cost_cap: float,
    threads: int | None = None,
) -> tuple[np.ndarray, np.ndarray]: ...
def step_sums(
    seqlens: np.ndarray,
    segment_targets: np.ndarray,
    segment_offsets: np.ndarray,
    threads: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]: ...
def segment_targets(
    plan: Plan,
    tokens: ListColumn,
    labels: ListColumn | None = None,
    loss_mask: ListColumn | None = None,
    separator_id: int | None = None,
    train_separators: bool = False,
    threads: int | None = None,
    ignore_tokens: list[int] | None = None,
) -> np.ndarray: ...
def flatten_int_lists(rows: list[Any], mask: bool = False) -> tuple[np.ndarray, np.ndarray]: ...
def tree_items(
    tokens: ListColumn,
    prompt_ids: np.ndarray | None,
    max_len: int,
    overlong: str = "error",
    split: bool = True,
    threads: int | None = None,
) -> dict[str, Any]: ...
def tree_expand(
    sample_ids: np.ndarray,
    starts: np.ndarray,
    seqlens: np.ndarray,
    parents: np.ndarray,
    item_offsets: np.ndarray,
    path_sample_ids: np.ndarray,
    path_ends: np.ndarray,
    path_offsets: np.ndarray,
    item_ids: np.ndarray,
    item_pack_offsets: np.ndarray,
) -> dict[str, Any]: ...
def tree_path_targets(
    plan: Plan,
    tokens: ListColumn,
    labels: ListColumn | None = None,
    loss_mask: ListColumn | None = None,
    threads: int | None = None,
) -> np.ndarray: ...
def tree_rows(
    plan: Plan,
    packs: np.ndarray,
    tokens: ListColumn,
    labels: ListColumn | None = None,
    loss_mask: ListColumn | None = None,
    threads: int | None = None,
) -> dict[str, Any]: ...

@final
class ListColumn:
    def __new__(
        cls,
        name: str,
        dtype: str,
        chunks: list[tuple[np.ndarray, np.ndarray, int, int]],
        indices: list[np.ndarray] | None = None,
    ) -> ListColumn: ...
    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def rows(self) -> int: ...
    @property
    def num_chunks(self) -> int: ...
    def __len__(self) -> int: ...

def column_lengths(columns: list[ListColumn], threads: int | None = None) -> np.ndarray: ...
def pack_tokens(plan: Plan, packs: np.ndarray) -> np.ndarray: ...
def gather(
    plan: Plan,
    packs: np.ndarray,
    columns: list[ListColumn],
    separator_values: list[bytes],
    position_ids: bool = True,
    threads: int | None = None,
) -> dict[str, Any]: ...
