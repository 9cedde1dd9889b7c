"""fastpack.gather: a plan's packs as packed Arrow record batches, read in place."""

from __future__ import annotations

import pytest

import fastpack

pa = pytest.importorskip("pyarrow")


def test_chunked_columns_and_separators() -> None:
    seqs = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    ids = pa.chunked_array([pa.array(seqs[:1], pa.list_(pa.int32())),
                            pa.array(seqs[1:], pa.list_(pa.int32()))])
    mask = pa.chunked_array([pa.array([[s > 4 for s in r] for r in seqs], pa.list_(pa.bool_()))])
    table = pa.table({"input_ids": ids, "mask": mask, "text": ["a", "b", "c", "d"]})
    plan = fastpack.pack([3, 2, 1, 4], 5, reserve=1, strategy="next_fit")
    batches = list(fastpack.gather(plan, table, separator_id=0, batch_tokens=4))
    assert [b.num_rows for b in batches] == [1, 1, 1]
    out = pa.Table.from_batches(batches).to_pydict()
    assert out["input_ids"] == [[1, 2, 3, 0], [4, 5, 0, 6, 0], [7, 8, 9, 10, 0]]
    assert out["seq_lengths"] == [[4], [3, 2], [5]]
    assert out["mask"] == [[False] * 4, [False, True, False, True, False], [True] * 4 + [False]]
    assert out["position_ids"] == [[0, 1, 2, 3], [0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]
    assert "text" not in out
