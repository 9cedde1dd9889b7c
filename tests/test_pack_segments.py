"""`_core.pack_segments`: every step of a mixture packed in one core call, each segment
exactly as `_core.pack` packs it alone (the joined plan the mixture planner builds)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastpack import FastpackError, _core


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), max_size=200),
       cuts=st.lists(st.integers(0, 200), max_size=8),
       strategy=st.sampled_from(["bfd", "ffd", "next_fit", "one_per_pack"]),
       shuffle=st.booleans(), long=st.booleans(), threads=st.sampled_from([1, 3]))
def test_segments_at_once_equal_each_alone(lengths: list[int], cuts: list[int], strategy: str,
                                           shuffle: bool, long: bool, threads: int) -> None:
    arr = np.array(lengths, dtype=np.int64)
    bounds = np.array(sorted({0, len(arr), *(c % (len(arr) + 1) for c in cuts)}), np.int64)
    if len(bounds) == 1:
        bounds = np.array([0, 0], np.int64)
    seeds = np.arange(len(bounds) - 1, dtype=np.uint64) * np.uint64(977) + np.uint64(5)
    long_max_len = 32 if long else None
    out = _core.pack_segments(arr, bounds, 16, strategy, "split", 0,
                              seeds if shuffle else None, threads, long_max_len)
    packs = out["pack_starts"]
    assert packs[0] == 0 and len(packs) == len(bounds)
    for k in range(len(bounds) - 1):
        alone = _core.pack(arr[bounds[k]:bounds[k + 1]], 16, strategy, "split", 0,
                           int(seeds[k]) if shuffle else None, 1, None, long_max_len)
        a, b = out["pack_offsets"][packs[k]], out["pack_offsets"][packs[k + 1]]
        np.testing.assert_array_equal(out["sample_ids"][a:b], alone["sample_ids"] + bounds[k])
        np.testing.assert_array_equal(out["seqlens"][a:b], alone["seqlens"])
        np.testing.assert_array_equal(out["starts"][a:b], alone["starts"])
        np.testing.assert_array_equal(out["pack_offsets"][packs[k]:packs[k + 1] + 1] - a,
                                      alone["pack_offsets"])
        if long:
            np.testing.assert_array_equal(out["pack_caps"][packs[k]:packs[k + 1]],
                                          alone["pack_caps"])


@pytest.mark.parametrize(("offsets", "seeds", "named"), [
    ([0, 2], None, "offsets"),        # does not end at the lengths
    ([0, 3, 1, 4], None, "offsets"),  # decreasing
    ([0, -1, 4], None, "offsets"),
    ([0, 4], [1, 2], "seeds"),        # one seed per segment
])
def test_bad_bounds_are_refused_by_name(offsets: list[int], seeds: list[int] | None,
                                        named: str) -> None:
    lengths = np.array([1, 2, 3, 4], dtype=np.int64)
    s = None if seeds is None else np.array(seeds, dtype=np.uint64)
    with pytest.raises(FastpackError, match=named):
        _core.pack_segments(lengths, np.array(offsets, dtype=np.int64), 8, seeds=s)
