"""Plan invariants shared by the tests, written independently of the implementation."""

from __future__ import annotations

import numpy as np

import fastpack


def kept_tokens(length: int, max_len: int, strategy: str, overlong: str, reserve: int) -> int:
    """Extended tokens (sequence + reserve) a sequence should contribute to the plan."""
    if length == 0:
        return 0
    extended = length + reserve
    if extended <= max_len or strategy == "wrapped":
        return extended
    return {"truncate": max_len, "split": extended, "drop": 0}[overlong]


def check_plan(plan: fastpack.Plan, lengths: np.ndarray, *, strategy: str, overlong: str,
               reserve: int = 0) -> None:
    lengths = np.asarray(lengths, dtype=np.int64)
    max_len = plan.max_len
    offsets = plan.pack_offsets
    assert plan.sample_ids.dtype == np.int64 and plan.starts.dtype == np.int64
    assert plan.seqlens.dtype == np.int32 and offsets.dtype == np.int64
    assert offsets[0] == 0 and offsets[-1] == plan.num_segments
    assert np.all(np.diff(offsets) > 0), "every pack holds a segment"
    assert np.all(plan.seqlens > 0)
    fills = plan.pack_fills
    assert np.all(fills <= max_len), "no pack over max_len"
    assert plan.total_tokens == int(plan.seqlens.sum())
    assert plan.num_packs >= plan.lower_bound
    # Each sequence's segments tile its kept tokens exactly once.
    order = np.lexsort((plan.starts, plan.sample_ids))
    ids, starts, lens = plan.sample_ids[order], plan.starts[order], plan.seqlens[order]
    expected = np.array(
        [kept_tokens(int(n), max_len, strategy, overlong, reserve) for n in lengths],
        dtype=np.int64,
    )
    covered = np.bincount(ids, weights=lens, minlength=len(lengths)).astype(np.int64)
    np.testing.assert_array_equal(covered, expected)
    first = np.ones(len(ids), dtype=bool)
    first[1:] = ids[1:] != ids[:-1]
    prev_end = np.zeros(len(ids), dtype=np.int64)
    prev_end[1:] = starts[:-1] + lens[:-1]
    np.testing.assert_array_equal(starts, np.where(first, 0, prev_end))
    dropped = sum(int(n) for n, k in zip(lengths, expected) if n > 0 and k == 0)
    truncated = sum(int(n) + reserve - int(k) for n, k in zip(lengths, expected)
                    if n > 0 and 0 < k < n + reserve)
    assert plan.dropped_tokens == dropped
    assert plan.truncated_tokens == truncated
    assert plan.empty_sequences == int((lengths == 0).sum())
