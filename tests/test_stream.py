"""Streams: the window packer (torch-free), PackedIterableDataset and packed HF streams.

Samples carry their identity in their tokens (sample ``i``, position ``p`` -> ``i * K + p +
1``), so every check below is made on the tokens that come out, independently of the
packer's bookkeeping.
"""

from __future__ import annotations

import itertools
import math
import types
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import fastpack
from fastpack import FastpackError, FastpackTypeError, StreamPacker
from fastpack._stream import CARRY_SHARE, MAX_CARRIES

# The StreamPacker tests need numpy only (the wheel's 3.9/3.13 runs have nothing else):
# torch and datasets are skipped per test, never for the whole file.
try:
    import torch
except ImportError:
    torch = None
try:
    import datasets
    import pyarrow as pa
except ImportError:
    datasets = pa = None

needs_torch = pytest.mark.skipif(torch is None, reason="needs torch")
needs_datasets = pytest.mark.skipif(datasets is None, reason="needs datasets and pyarrow")

K = 100_000  # token = sample * K + position + 1: positions stay below K

# --------------------------------------------------------------------------- helpers


def column(lengths: Any, first: int = 0) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    rows = np.repeat(np.arange(first, first + len(lengths)), lengths)
    values = rows * K + (np.arange(offsets[-1]) - np.repeat(offsets[:-1], lengths)) + 1
    return values, offsets


def drive(packer: StreamPacker, lengths: Any, *, take: int = 10**9,
          verify: bool = True) -> tuple[list[Any], list[Any]]:
    """Feed ``lengths`` window by window as a stream would; return the emitted packs (each a
    list of ``(sample, start, tokens, seqlen)``) and per round ``(emitted, final)``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n, pos = len(lengths), 0
    packs: list[Any] = []
    rounds: list[Any] = []
    while not packer.finished:
        room = packer.room
        count = min(room, n - pos)
        rnd = packer.push({"input_ids": column(lengths[pos : pos + count], pos)},
                          final=count < room)
        pos += count
        rounds.append((len(rnd.emit), rnd.final))
        while rnd.remaining:
            for p in rnd.take(take):
                if verify:
                    packs.append(segments_of(rnd, int(p)))
    return packs, rounds


def segments_of(rnd: Any, p: int) -> list[tuple[int, int, int, int]]:
    """``(sample, start, tokens, seqlen)`` of each segment of pack ``p``: where the plan
    says it comes from, and how many real tokens the gather wrote (checked to be that
    sample's tokens from that start, then only separators)."""
    plan = rnd.plan
    out = rnd.gather([p], separator_id=0 if plan.reserve else None)
    ids = out.columns["input_ids"]
    lo, hi = int(plan.pack_offsets[p]), int(plan.pack_offsets[p + 1])
    assert out.seq_lengths.tolist() == plan.seqlens[lo:hi].tolist()
    segments, at = [], 0
    for seg, q in zip(range(lo, hi), out.seq_lengths.tolist()):
        r = int(plan.sample_ids[seg])
        origin, start = int(rnd.origins[r]), int(rnd.row_starts[r] + plan.starts[seg])
        values = ids[at : at + q]
        t = int(np.count_nonzero(values))  # test tokens are >= 1; separators are 0
        np.testing.assert_array_equal(values[:t], origin * K + start + np.arange(t) + 1)
        assert not values[t:].any(), "a separator before the segment's last token"
        assert out.position_ids[at : at + q].tolist() == list(range(q))
        segments.append((origin, start, t, q))
        at += q
    return segments


def kept(length: int, cap: int, strategy: str, overlong: str, reserve: int) -> int:
    """Real tokens of a sample that end up in packs: a truncated sample keeps ``cap -
    reserve`` tokens and its reserved slots (the Rust gather's rule, the Dataset path's)."""
    if length + reserve <= cap or strategy == "wrapped" or overlong == "split":
        return length
    return {"truncate": cap - reserve, "drop": 0}[overlong]


def check_cover(packs: list[Any], lengths: Any, *, cap: int, strategy: str, overlong: str,
                reserve: int) -> None:
    """Every kept token of every sample is in exactly one pack, no pack is over ``cap``."""
    for pack in packs:
        assert sum(q for *_, q in pack) <= cap
        assert all(0 <= q - t <= reserve for _, _, t, q in pack)
    pieces: dict[int, list[tuple[int, int]]] = {}
    for pack in packs:
        for origin, start, t, _ in pack:
            if t:  # a piece may hold only reserved slots
                pieces.setdefault(origin, []).append((start, t))
    for i, length in enumerate(lengths):
        want = kept(int(length), cap, strategy, overlong, reserve)
        got = sorted(pieces.pop(i, []))
        covered = 0
        for start, t in got:
            assert start == covered, f"sample {i}: a gap or overlap at {start}"
            covered += t
        assert covered == want, f"sample {i}: {covered} of {want} tokens"
    assert not pieces, f"unknown samples {sorted(pieces)}"


# --------------------------------------------------------------------------- the core


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(0, 40), max_size=120),
    max_len=st.integers(4, 32),
    buffer_size=st.integers(1, 40),
    strategy=st.sampled_from(fastpack.STRATEGIES),
    overlong=st.sampled_from(("truncate", "split", "drop")),
    reserve=st.integers(0, 2),
    multiple=st.integers(1, 3),
    shuffle=st.booleans(),
)
def test_every_token_once_no_pack_over_max_len(
    lengths: list[int], max_len: int, buffer_size: int, strategy: str, overlong: str,
    reserve: int, multiple: int, shuffle: bool,
) -> None:
    assume(reserve < max_len)
    packer = StreamPacker(max_len, buffer_size=buffer_size, strategy=strategy,
                          overlong=overlong, reserve=reserve, packs_multiple=multiple,
                          shuffle=shuffle, seed=3)
    packs, rounds = drive(packer, lengths)
    check_cover(packs, lengths, cap=max_len, strategy=strategy, overlong=overlong,
                reserve=reserve)
    s = packer.stats
    assert s.num_sequences == len(lengths)
    assert s.num_packs == len(packs)
    assert s.total_tokens == sum(q for pack in packs for *_, q in pack)
    assert s.capacity == max_len * len(packs)
    assert s.empty_sequences == sum(1 for n in lengths if n == 0)
    over = [n for n in lengths if n + reserve > max_len]
    if strategy != "wrapped" and overlong == "drop":
        assert (s.dropped_sequences, s.dropped_tokens) == (len(over), sum(over))
    if strategy != "wrapped" and overlong == "truncate":
        assert s.truncated_tokens == sum(n + reserve - max_len for n in over)
    # The counts are exactly the tokens not written.
    written = sum(t for pack in packs for _, _, t, _ in pack)
    assert written + s.dropped_tokens + s.truncated_tokens == sum(lengths)
    if strategy == "wrapped" or overlong == "split":
        pieces = Counter(origin for pack in packs for origin, *_ in pack)
        assert s.split_sequences == sum(1 for c in pieces.values() if c > 1)
    # Memory stays bounded: a window never holds more than buffer_size rows.
    assert all(e >= 0 for e, _ in rounds) and rounds[-1][1]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 20), max_size=150),
    max_len=st.integers(4, 16),
    extra=st.integers(0, 30),
    strategy=st.sampled_from(("next_fit", "wrapped")),
    reserve=st.integers(0, 1),
)
def test_ordered_strategies_match_the_offline_plan(
    lengths: list[int], max_len: int, extra: int, strategy: str, reserve: int
) -> None:
    # With room for the open pack (at most max_len rows) the stream packs as the offline
    # plan over the whole stream does, pack for pack.
    packer = StreamPacker(max_len, buffer_size=2 * max_len + 2 + extra, strategy=strategy,
                          overlong="split", reserve=reserve, shuffle=False)
    packs, _ = drive(packer, lengths)
    plan = fastpack.pack(lengths, max_len, strategy=strategy, overlong="split",
                         reserve=reserve, shuffle=False)
    offline = [
        [(int(i), int(s), int(q)) for i, s, q in zip(*plan.segments(p))]
        for p in range(plan.num_packs)
    ]
    assert [[(o, s, q) for o, s, _, q in pack] for pack in packs] == offline
    assert packer.stats.split_sequences == plan.split_sequences
    assert packer.stats.total_tokens == plan.total_tokens


def sft_lengths(n: int, seed: int = 0, mean: float = 300, cap: int = 4096) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.lognormal(math.log(mean) - 0.5, 1.0, n)
    return np.clip(np.rint(x), 1, cap).astype(np.int64)


def test_efficiency_approaches_the_offline_plan() -> None:
    lengths = sft_lengths(20_000)
    offline = fastpack.pack(lengths, 4096, shuffle=False).efficiency
    effs = {}
    for b in (100, 1000):
        packer = StreamPacker(4096, buffer_size=b)
        drive(packer, lengths, verify=False)
        effs[b] = packer.stats.efficiency
    # Carrying under-filled packs: windows of 10^2 samples (7 packs) already reach 99%.
    assert effs[100] > 0.99 and effs[1000] > 0.998 and offline - effs[1000] < 1e-3
    # Without the carry (every pack emitted) a window of 100 wastes 6%.
    windows = [fastpack.pack(lengths[i : i + 100], 4096, shuffle=False) for i in range(0, len(lengths), 100)]
    plain = sum(p.total_tokens for p in windows) / (4096 * sum(p.num_packs for p in windows))
    assert plain < 0.95 < effs[100]


def test_no_sample_waits_forever() -> None:
    # Half-full samples leave every pack under-filled: the carry stops at MAX_CARRIES.
    lengths = np.full(400, 51)
    packer = StreamPacker(100, buffer_size=10)
    n, pos, ages = len(lengths), 0, []
    while not packer.finished:
        count = min(packer.room, n - pos)
        rnd = packer.push({"input_ids": column(lengths[pos : pos + count], pos)},
                          final=count < packer.room)
        pos += count
        ages.append(int(rnd.ages.max(initial=0)))
        rnd.take(rnd.remaining)
    assert max(ages) <= MAX_CARRIES
    assert packer.stats.num_packs == 400


@pytest.mark.parametrize("multiple", [2, 4])
def test_rounds_emit_whole_batches(multiple: int) -> None:
    lengths = sft_lengths(3000, seed=1, mean=40, cap=512)
    packer = StreamPacker(512, buffer_size=300, packs_multiple=multiple)
    _, rounds = drive(packer, lengths)
    assert all(e % multiple == 0 for e, final in rounds if not final)
    assert sum(e for e, _ in rounds) == packer.stats.num_packs


def test_carry_stays_within_its_share() -> None:
    lengths = sft_lengths(5000, seed=2, mean=60, cap=1024)
    packer = StreamPacker(1024, buffer_size=200)
    while not packer.finished:
        assert packer.room >= 200 - int(CARRY_SHARE * 200)
        count = min(packer.room, len(lengths))
        rnd = packer.push({"input_ids": column(lengths[:count])}, final=count < packer.room)
        lengths = lengths[count:]
        rnd.take(rnd.remaining)


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(0, 30), min_size=1, max_size=60),
       buffer_size=st.integers(1, 12), stop=st.integers(0, 200),
       strategy=st.sampled_from(("bfd", "wrapped")))
def test_core_state_roundtrip(lengths: list[int], buffer_size: int, stop: int,
                              strategy: str) -> None:
    def make() -> StreamPacker:
        return StreamPacker(16, buffer_size=buffer_size, overlong="split", strategy=strategy,
                            shuffle=True, seed=5, packs_multiple=2)

    full, _ = drive(make(), lengths, take=1)
    # Stop after `stop` packs, save, restore into a fresh packer, finish.
    packer, n, pos, out = make(), len(lengths), 0, []
    while not packer.finished and len(out) < stop:
        rnd = packer.current
        if rnd is None or not rnd.remaining:
            count = min(packer.room, n - pos)
            rnd = packer.push({"input_ids": column(lengths[pos : pos + count], pos)},
                              final=count < packer.room)
            pos += count
            continue
        out.append(segments_of(rnd, int(rnd.take(1)[0])))
    state = packer.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.stats == packer.stats
    while not resumed.finished:
        rnd = resumed.current
        if rnd is None or not rnd.remaining:
            count = min(resumed.room, n - pos)
            rnd = resumed.push({"input_ids": column(lengths[pos : pos + count], pos)},
                               final=count < resumed.room)
            pos += count
            continue
        out.append(segments_of(rnd, int(rnd.take(1)[0])))
    assert out == full


def test_core_errors() -> None:
    with pytest.raises(FastpackError, match="buffer_size"):
        StreamPacker(16, buffer_size=0)
    with pytest.raises(FastpackError, match="strategy"):
        StreamPacker(16, strategy="best")
    with pytest.raises(FastpackError, match="reserve"):
        StreamPacker(16, reserve=16)
    packer = StreamPacker(16, buffer_size=4)
    with pytest.raises(FastpackError, match="input_ids: sample 2 of the stream has 17 tokens"):
        packer.push({"input_ids": column([3, 4, 17])})
    with pytest.raises(FastpackError, match="room for 4"):
        packer.push({"input_ids": column([1] * 5)})
    ids = column([3, 4])
    with pytest.raises(FastpackError, match="labels: sample 1 of the stream has 3 values but 4"):
        packer.push({"input_ids": ids, "labels": column([3, 3])})
    with pytest.raises(FastpackTypeError, match="pair"):
        packer.push({"input_ids": [1, 2, 3]})
    with pytest.raises(FastpackError, match="input_ids"):
        packer.push({"labels": ids})
    rnd = packer.push({"input_ids": ids, "labels": ids})
    if rnd.remaining:
        with pytest.raises(FastpackError, match="still has"):
            packer.push({"input_ids": ids, "labels": ids})
        rnd.take(rnd.remaining)
    with pytest.raises(FastpackError, match="earlier windows had"):
        packer.push({"input_ids": ids})
    other = StreamPacker(16, buffer_size=5)
    with pytest.raises(FastpackError, match="buffer_size=4/5"):
        other.load_state_dict(packer.state_dict())
    with pytest.raises(FastpackError, match="not a StreamPacker state"):
        other.load_state_dict({"round": None})
    last = packer.push({"input_ids": column([]), "labels": column([])}, final=True)
    last.take(last.remaining)
    assert packer.finished
    with pytest.raises(FastpackError, match="already ended"):
        packer.push({"input_ids": ids, "labels": ids})


def reference_rows(samples: dict[str, list[np.ndarray]], segments: list[list[tuple[int, int, int]]],
                   *, reserve: int, truncate: bool,
                   separators: dict[str, Any]) -> list[dict[str, list[Any]]]:
    """The rule, written out: a segment ``(sample, start, seqlen)`` holds the sample's
    tokens from ``start`` (a truncated one, ``seqlen - reserve`` of them), then its
    column's separator value."""
    rows = []
    for pack in segments:
        row: dict[str, list[Any]] = {k: [] for k in samples}
        for i, start, q in pack:
            n = len(samples["input_ids"][i])
            end = n if not (truncate and q < n + reserve and start == 0) else q - reserve
            real = max(min(end - start, q), 0)
            for k, values in samples.items():
                row[k] += values[i][start : start + real].tolist() + [separators[k]] * (q - real)
        rows.append(row)
    return rows


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 30), max_size=40),
    max_len=st.integers(4, 20),
    buffer_size=st.integers(1, 10),
    strategy=st.sampled_from(fastpack.STRATEGIES),
    overlong=st.sampled_from(("truncate", "split", "drop")),
    reserve=st.integers(0, 2),
    dtype=st.sampled_from(("int32", "int64", "uint16")),
)
def test_round_gather_is_the_rule(lengths: list[int], max_len: int, buffer_size: int,
                                  strategy: str, overlong: str, reserve: int,
                                  dtype: str) -> None:
    # numpy only: every column keeps its dtype (bool too), truncated samples keep
    # seqlen - reserve tokens, reserved slots hold each column's separator value.
    assume(reserve < max_len)
    rng = np.random.default_rng(len(lengths))
    ids = [(i * 64 + np.arange(n) + 1).astype(dtype) for i, n in enumerate(lengths)]
    samples = {
        "input_ids": ids,
        "labels": [np.where(rng.random(len(r)) < 0.3, -100, r.astype(np.int64)) for r in ids],
        "flags": [rng.random(len(r)) < 0.5 for r in ids],
    }
    packer = StreamPacker(max_len, buffer_size=buffer_size, strategy=strategy,
                          overlong=overlong, reserve=reserve, shuffle=True, seed=1)
    separators = {"input_ids": 0, "labels": -100, "flags": False}
    dtypes = {"input_ids": dtype, "labels": np.int64, "flags": bool}
    pos, got, plans = 0, [], []
    while not packer.finished:
        count = min(packer.room, len(lengths) - pos)
        new = {}
        for k, rows in samples.items():
            part = rows[pos : pos + count]
            values = np.concatenate(part) if part else np.zeros(0, dtypes[k])
            new[k] = (values, np.cumsum([0] + [len(r) for r in part], dtype=np.int64))
        rnd = packer.push(new, final=count < packer.room)
        pos += count
        packs = rnd.take(rnd.remaining)
        out = rnd.gather(packs, separator_id=0 if reserve else None)
        assert {k: v.dtype for k, v in out.columns.items()} == {
            k: rnd.columns[k][0].dtype for k in samples}
        for k in range(len(packs)):
            lo, hi = out.offsets[k], out.offsets[k + 1]
            got.append({c: v[lo:hi].tolist() for c, v in out.columns.items()})
            plan, p = rnd.plan, int(packs[k])
            plans.append([(int(rnd.origins[plan.sample_ids[s]]),
                           int(rnd.row_starts[plan.sample_ids[s]] + plan.starts[s]),
                           int(plan.seqlens[s]))
                          for s in range(plan.pack_offsets[p], plan.pack_offsets[p + 1])])
    want = reference_rows(samples, plans, reserve=reserve,
                          truncate=overlong == "truncate" and strategy != "wrapped",
                          separators=separators)
    assert got == want
    written = sum(int(np.count_nonzero(r["input_ids"])) for r in got)
    s = packer.stats
    assert written + s.dropped_tokens + s.truncated_tokens == sum(lengths)


def test_round_gather_errors() -> None:
    packer = StreamPacker(8, buffer_size=4, reserve=1, overlong="truncate")
    ids = column([3, 12])
    rnd = packer.push({"input_ids": ids, "labels": (ids[0].astype(np.uint16), ids[1])},
                      final=True)
    packs = rnd.take(rnd.remaining)
    with pytest.raises(FastpackError, match="separator_id: the plan reserves 1"):
        rnd.gather(packs)
    with pytest.raises(FastpackError, match="separator_values: -100 for column 'labels' does not fit its "
                                            "type uint16"):
        rnd.gather(packs, separator_id=0)
    with pytest.raises(FastpackError, match="separator_values: 'nope' is not a packed column"):
        rnd.gather(packs, separator_id=0, separator_values={"nope": 1})
    out = rnd.gather(packs, separator_id=0, separator_values={"labels": 7})
    assert sorted(out.columns["labels"][out.columns["input_ids"] == 0].tolist()) == [7, 7]
    with pytest.raises(FastpackTypeError, match="integers, floats or booleans"):
        StreamPacker(8).push({"input_ids": (np.array(["a"]), np.array([0, 1]))})


# --------------------------------------------------------------------------- torch
if torch is not None:
    from fastpack.torch import PackedCollator, PackedIterableDataset


def samples(lengths: Any, *, labels: bool = False, mask: bool = False) -> list[dict[str, Any]]:
    out = []
    rng = np.random.default_rng(0)
    for i, n in enumerate(lengths):
        ids = (i * K + np.arange(n) + 1).tolist()
        s: dict[str, Any] = {"input_ids": ids}
        if labels:
            s["labels"] = [-t for t in ids]
        if mask:
            s["assistant_masks"] = rng.integers(0, 2, n).tolist()
        out.append(s)
    return out


def tokens_of(batches: list[dict[str, Any]]) -> Counter[int]:
    ids = [b["input_ids"].reshape(-1).numpy() for b in batches]
    flat = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    return Counter(flat[flat > 0].tolist())


def same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    def eq(x: dict[str, Any], y: dict[str, Any]) -> bool:
        return x.keys() == y.keys() and all(
            torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k] for k in x
        )

    return len(a) == len(b) and all(eq(x, y) for x, y in zip(a, b))


def as_worker(monkeypatch: pytest.MonkeyPatch, worker: int, workers: int) -> None:
    info = types.SimpleNamespace(id=worker, num_workers=workers)
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: info if workers > 1 else None)


@needs_torch
@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(0, 40), max_size=80),
    buffer_size=st.integers(1, 30),
    world=st.integers(1, 3),
    workers=st.integers(1, 3),
    per_batch=st.integers(1, 3),
    backend=st.sampled_from(("sdpa", "flash")),
    separator=st.sampled_from((None, 0)),
)
def test_each_sample_once_across_ranks_and_workers(
    monkeypatch: pytest.MonkeyPatch, lengths: list[int], buffer_size: int, world: int,
    workers: int, per_batch: int, backend: str, separator: int | None,
) -> None:
    collator = PackedCollator(max_len=32, backend=backend, overlong="truncate",
                              separator_id=separator)
    data = samples(lengths)
    batches = []
    for rank, worker in itertools.product(range(world), range(workers)):
        as_worker(monkeypatch, worker, workers)
        ds = PackedIterableDataset(data, collator, buffer_size=buffer_size,
                                   packs_per_batch=per_batch, rank=rank, world_size=world)
        got = list(ds)
        batches += got
        assert ds.stats.num_sequences == len(range(rank * workers + worker, len(data),
                                                   world * workers))
        for b in got:
            rows, width = b["input_ids"].shape
            if backend == "flash":  # every pack end to end in one row
                assert rows == 1 and width <= 32 * per_batch
            else:
                assert rows <= per_batch and width <= 32
    # A truncated sample keeps max_len - reserve tokens (then its separator).
    expected = Counter(t for s in data for t in s["input_ids"][:32 - collator.reserve])
    assert tokens_of(batches) == expected


@needs_torch
def test_batches_are_the_collators() -> None:
    # One window holding the whole stream: the batches are the collator's own batches of
    # the offline plan's packs, labels and loss masks included.
    data = samples([5, 17, 9, 30, 3, 12, 1, 22], labels=True, mask=True)
    collator = PackedCollator(max_len=32, backend="sdpa")
    ds = PackedIterableDataset(data, collator, buffer_size=100, shuffle=False,
                               packs_per_batch=2)
    got = list(ds)
    from fastpack._materialize import _from_rows

    tokens = _from_rows([s["input_ids"] for s in data], mask=False)
    labels = _from_rows([s["labels"] for s in data], mask=False)
    mask = _from_rows([s["assistant_masks"] for s in data], mask=True)
    plan = fastpack.pack(tokens.lengths, 32, shuffle=False)
    want = [collator.batch(plan, tokens, np.arange(p, min(p + 2, plan.num_packs)),
                           labels=labels, loss_mask=mask)
            for p in range(0, plan.num_packs, 2)]
    assert same(got, want)
    ids, lab = got[0]["input_ids"], got[0]["labels"]
    assert ((lab == -100) | (lab == -ids)).all()


def dataloader(ds: Any, workers: int) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(ds, batch_size=None, num_workers=workers)


def hf_stream(data: list[dict[str, Any]], shards: int) -> Any:
    if datasets is None:
        pytest.skip("needs datasets")
    return datasets.Dataset.from_list(data).to_iterable_dataset(num_shards=shards)


def generator_function(data: list[dict[str, Any]]) -> Any:
    def stream() -> Any:
        yield from data

    return stream


SOURCES = {
    "list": lambda data: data,
    "generator function": generator_function,
    "datasets.IterableDataset": lambda data: hf_stream(data, 2),
}
SHARDING = {"datasets.IterableDataset, stride": "stride"}
SOURCES["datasets.IterableDataset, stride"] = SOURCES["datasets.IterableDataset"]


@needs_torch
@pytest.mark.parametrize("source", SOURCES)
def test_resume_at_every_position(source: str) -> None:
    data = samples(sft_lengths(60, seed=3, mean=12, cap=40).tolist(), labels=True)
    collator = PackedCollator(max_len=48, backend="sdpa")

    def make() -> PackedIterableDataset:
        return PackedIterableDataset(SOURCES[source](data), collator, buffer_size=9, seed=1,
                                     sharding=SHARDING.get(source, "auto"))

    full = list(make())
    assert tokens_of(full) == Counter(t for s in data for t in s["input_ids"])
    for k in range(len(full) + 1):
        ds = make()
        it = iter(ds)
        head = [next(it) for _ in range(k)]
        state = ds.state_dict()
        resumed = make()
        resumed.load_state_dict(state)
        assert same(head + list(resumed), full), f"resumed after {k} batches"


@needs_torch
@pytest.mark.parametrize("source", ["list", "datasets.IterableDataset",
                                    "datasets.IterableDataset, stride"])
def test_resume_each_rank_at_every_position(monkeypatch: pytest.MonkeyPatch, source: str) -> None:
    # Three ranks (two workers each with the stride): the resumed stride must pick up each
    # shard's own samples.
    data = samples(sft_lengths(45, seed=11, mean=12, cap=40).tolist())
    collator = PackedCollator(max_len=48, backend="sdpa")
    seen: Counter[int] = Counter()
    sharding = SHARDING.get(source, "auto")
    workers = 2 if sharding == "stride" else 1
    for rank, worker in itertools.product(range(3), range(workers)):
        as_worker(monkeypatch, worker, workers)

        def make() -> PackedIterableDataset:
            return PackedIterableDataset(SOURCES[source](data), collator, buffer_size=5,
                                         rank=rank, world_size=3,  # noqa: B023
                                         sharding=sharding)

        full = list(make())
        seen += tokens_of(full)
        for k in range(len(full) + 1):
            ds = make()
            it = iter(ds)
            head = [next(it) for _ in range(k)]
            resumed = make()
            resumed.load_state_dict(ds.state_dict())
            assert same(head + list(resumed), full), f"rank {rank} resumed after {k} batches"
    assert seen == Counter(t for s in data for t in s["input_ids"])


@needs_torch
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("source", ["list", "datasets.IterableDataset"])
def test_resume_through_stateful_dataloader(workers: int, source: str) -> None:
    data = samples(sft_lengths(40, seed=4, mean=12, cap=40).tolist())
    collator = PackedCollator(max_len=48, backend="flash")

    def make() -> Any:
        ds = PackedIterableDataset(SOURCES[source](data), collator, buffer_size=10,
                                   packs_per_batch=2, seed=2)
        return dataloader(ds, workers)

    full = list(make())
    assert tokens_of(full) == Counter(t for s in data for t in s["input_ids"])
    positions = range(len(full) + 1) if workers == 0 else sorted({0, 1, 2, 3, len(full) // 2,
                                                                  len(full) - 1, len(full)})
    for k in positions:
        loader = make()
        it = iter(loader)
        head = [next(it) for _ in range(k)]
        state = loader.state_dict()
        del it
        resumed = make()
        resumed.load_state_dict(state)
        assert same(head + list(resumed), full), f"resumed after {k} batches"


@needs_torch
def test_state_survives_torch_save(tmp_path: Any) -> None:
    data = samples(sft_lengths(30, seed=5, mean=10, cap=30).tolist(), mask=True)
    collator = PackedCollator(max_len=32, backend="sdpa")
    full = list(PackedIterableDataset(data, collator, buffer_size=7))
    ds = PackedIterableDataset(data, collator, buffer_size=7)
    it = iter(ds)
    head = [next(it) for _ in range(3)]
    torch.save(ds.state_dict(), tmp_path / "state.pt")
    resumed = PackedIterableDataset(data, collator, buffer_size=7)
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert same(head + list(resumed), full)


@needs_torch
def test_finished_epoch_resumes_into_a_fresh_one() -> None:
    data = samples([5, 9, 3, 12, 7, 8])
    collator = PackedCollator(max_len=16, backend="sdpa")
    ds = PackedIterableDataset(data, collator, buffer_size=4)
    first = list(ds)
    done = ds.state_dict()
    resumed = PackedIterableDataset(data, collator, buffer_size=4)
    resumed.load_state_dict(done)
    assert list(resumed) == []  # the saved pass had ended
    assert same(list(resumed), first)  # the next pass starts over
    resumed.set_epoch(1)
    assert tokens_of(list(resumed)) == tokens_of(first)


@needs_torch
def test_hf_sharding_splits_by_rank_and_worker_shards() -> None:
    data = samples(sft_lengths(50, seed=6, mean=10, cap=30).tolist())
    collator = PackedCollator(max_len=32, backend="sdpa")
    batches = []
    for rank in range(2):
        ds = PackedIterableDataset(hf_stream(data, 4), collator, buffer_size=6, rank=rank,
                                   world_size=2)
        batches += list(dataloader(ds, 2))
    assert tokens_of(batches) == Counter(t for s in data for t in s["input_ids"])


class CountingSource:
    """An iterable with its own state (as a torch IterableDataset may have): resuming must
    not replay it."""

    def __init__(self, data: list[dict[str, Any]]) -> None:
        self.data, self.next, self.start, self.produced = data, 0, 0, 0

    def __iter__(self) -> Any:
        self.next = self.start
        while self.next < len(self.data):
            self.next += 1
            self.produced += 1
            yield self.data[self.next - 1]

    def state_dict(self) -> dict[str, int]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = int(state["next"])


@needs_torch
def test_torch_source_with_its_own_state() -> None:
    data = samples(sft_lengths(50, seed=12, mean=12, cap=40).tolist())
    collator = PackedCollator(max_len=48, backend="sdpa")
    full = list(PackedIterableDataset(CountingSource(data), collator, buffer_size=8))
    assert tokens_of(full) == Counter(t for s in data for t in s["input_ids"])
    for k in (1, len(full) // 2, len(full) - 1):
        ds = PackedIterableDataset(CountingSource(data), collator, buffer_size=8)
        it = iter(ds)
        head = [next(it) for _ in range(k)]
        state = ds.state_dict()
        source = CountingSource(data)
        resumed = PackedIterableDataset(source, collator, buffer_size=8)
        resumed.load_state_dict(state)
        assert same(head + list(resumed), full)
        # Resumed from the source's own state: only the unread samples were produced.
        assert source.produced == len(data) - int(state["position"])


@needs_torch
def test_ranks_from_torch_distributed(monkeypatch: pytest.MonkeyPatch) -> None:
    data = samples(sft_lengths(40, seed=13, mean=12, cap=40).tolist())
    collator = PackedCollator(max_len=48, backend="sdpa")
    seen: Counter[int] = Counter()
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    for rank in range(2):
        monkeypatch.setattr(torch.distributed, "get_rank", lambda rank=rank: rank)
        ds = PackedIterableDataset(data, collator, buffer_size=6)
        got = list(ds)
        assert ds.stats.num_sequences == 20
        seen += tokens_of(got)
    assert seen == Counter(t for s in data for t in s["input_ids"])


@needs_torch
def test_one_shot_generator() -> None:
    data = samples([4, 6, 2])
    ds = PackedIterableDataset(iter(data), PackedCollator(max_len=8), buffer_size=2)
    assert tokens_of(list(ds)) == Counter(t for s in data for t in s["input_ids"])
    with pytest.raises(FastpackError, match="already consumed"):
        list(ds)


@needs_torch
def test_torch_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    collator = PackedCollator(max_len=8)
    with pytest.raises(FastpackTypeError, match="collator"):
        PackedIterableDataset([], object())  # type: ignore[arg-type]
    with pytest.raises(FastpackError, match="padded"):
        PackedIterableDataset([], PackedCollator(max_len=8, backend="padded"))
    with pytest.raises(FastpackTypeError, match="source"):
        PackedIterableDataset(3, collator)
    with pytest.raises(FastpackError, match="sharding"):
        PackedIterableDataset([], collator, sharding="hf")
    with pytest.raises(FastpackError, match="rank"):
        PackedIterableDataset([], collator, rank=0)
    with pytest.raises(FastpackError, match="rank"):
        PackedIterableDataset([], collator, rank=2, world_size=2)
    bad = {
        "has no 'input_ids'": [{"input_ids": [1]}, {"ids": [2]}],
        "input_ids: sample 0 of the stream has no 'input_ids'": [{"text": "x"}],
        "labels: sample 1 of the stream has 1 values but 2": [
            {"input_ids": [1], "labels": [1]}, {"input_ids": [1, 2], "labels": [1]}],
        "input_ids: sample 1 of the stream is None": [{"input_ids": [1]}, {"input_ids": None}],
        "input_ids: sample 1 of the stream is a ragged nested list": [
            {"input_ids": [1]}, {"input_ids": [[1, 2], [3]]}],
        "input_ids: sample 0 of the stream has shape": [{"input_ids": [[1, 2], [3, 4]]}],
        "input_ids: sample 2 of the stream has 9 tokens": [[1], [2], list(range(1, 10))],
        "input_ids: sample 0 of the stream is str": [{"input_ids": "hello"}],
    }
    for message, data in bad.items():
        with pytest.raises(FastpackError, match=message):
            list(PackedIterableDataset(data, collator, buffer_size=4))
    data = samples([3, 4, 5])
    ds = PackedIterableDataset(data, collator, buffer_size=2, rank=0, world_size=2)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    other = PackedIterableDataset(data, collator, buffer_size=2, rank=1, world_size=2)
    other.load_state_dict(state)
    with pytest.raises(FastpackError, match="same ranks, workers"):
        list(other)
    with pytest.raises(FastpackError, match="not a PackedIterableDataset state"):
        other.load_state_dict({"epoch": 0})
    short = PackedIterableDataset(data[:1], collator, buffer_size=2, rank=0, world_size=2)
    short.load_state_dict(dict(state, position=torch.tensor(5)))
    with pytest.raises(FastpackError, match="source ends"):
        list(short)


# --------------------------------------------------------------------------- HF streams
from fastpack._stream import pack_iterable_dataset  # noqa: E402  (imports datasets when called)


def hf_rows(lengths: Any, seed: int = 0) -> dict[str, list[Any]]:
    rng = np.random.default_rng(seed)
    ids = [(i * K + np.arange(n) + 1).tolist() for i, n in enumerate(lengths)]
    return {
        "input_ids": ids,
        "labels": [[-t for t in row] for row in ids],
        "attention_mask": [[1] * len(row) for row in ids],
        "assistant_masks": [rng.integers(0, 2, len(row)).tolist() for row in ids],
        "text": ["not packed"] * len(ids),
    }


def check_packed_rows(rows: list[dict[str, Any]], data: dict[str, list[Any]], *, max_len: int,
                      separator_id: int | None = None) -> None:
    """Every packed column holds, segment by segment, the values of the sample its tokens
    come from; seq_lengths and position_ids describe the segments; every token once."""
    seen: Counter[int] = Counter()
    for row in rows:
        n = len(row["input_ids"])
        assert n <= max_len and sum(row["seq_lengths"]) == n
        assert all(len(row[k]) == n for k in ("labels", "attention_mask", "assistant_masks",
                                                "position_ids"))
        start = 0
        for q in row["seq_lengths"]:
            assert row["position_ids"][start : start + q] == list(range(q))
            ids = row["input_ids"][start : start + q]
            real = [t for t in ids if t != separator_id]
            if real:  # a piece of a split sample may hold only its separator
                sample, pos = (real[0] - 1) // K, (real[0] - 1) % K
                assert real == data["input_ids"][sample][pos : pos + len(real)]
                for k in ("labels", "attention_mask", "assistant_masks"):
                    got = row[k][start : start + len(real)]
                    assert got == data[k][sample][pos : pos + len(real)]
            if separator_id is not None and len(real) < q:
                # The separator ends the sample (the last piece, when it is split).
                assert len(real) == q - 1 and ids[-1] == separator_id
                assert row["labels"][start + q - 1] == -100
                assert row["attention_mask"][start + q - 1] == 1
                assert row["assistant_masks"][start + q - 1] == 0
            seen.update(real)
            start += q
    assert seen == Counter(t for row in data["input_ids"] for t in row)


@needs_datasets
@pytest.mark.parametrize("separator_id", [None, 0])
def test_packed_hf_stream_columns(separator_id: int | None) -> None:
    data = hf_rows(sft_lengths(300, seed=7, mean=15, cap=60))
    stream = datasets.Dataset.from_dict(data).to_iterable_dataset(num_shards=3)
    packed = pack_iterable_dataset(stream, 64, buffer_size=40, separator_id=separator_id,
                                   shuffle=True)
    assert list(packed.features) == ["input_ids", "labels", "attention_mask",
                                     "assistant_masks", "seq_lengths", "position_ids"]
    rows = list(packed)
    check_packed_rows(rows, data, max_len=64, separator_id=separator_id)
    efficiency = sum(len(r["input_ids"]) for r in rows) / (64 * len(rows))
    assert efficiency > 0.95


@needs_datasets
def test_packed_hf_stream_long_bucket() -> None:
    lengths = [5, 70, 3, 200, 8, 120, 64, 65]
    data = hf_rows(lengths)
    stream = datasets.Dataset.from_dict(data).to_iterable_dataset()
    rows = list(pack_iterable_dataset(stream, 64, long_max_len=256, buffer_size=3))
    check_packed_rows(rows, data, max_len=256)
    # No pack mixes the buckets: long samples (over 64) have packs of their own.
    for row in rows:
        if len(row["input_ids"]) > 64:
            assert all(q > 64 for q in row["seq_lengths"])


@needs_datasets
@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=40),
       buffer_size=st.integers(1, 12), shards=st.integers(1, 3),
       strategy=st.sampled_from(fastpack.STRATEGIES),
       separator=st.booleans())
def test_packed_hf_stream_property(lengths: list[int], buffer_size: int, shards: int,
                                   strategy: str, separator: bool) -> None:
    data = hf_rows(lengths)
    stream = datasets.Dataset.from_dict(data).to_iterable_dataset(
        num_shards=min(shards, len(lengths)))
    separator_id = 0 if separator else None
    rows = list(pack_iterable_dataset(stream, 16, strategy=strategy, overlong="split",
                                      buffer_size=buffer_size, separator_id=separator_id))
    check_packed_rows(rows, data, max_len=16, separator_id=separator_id)


@needs_datasets
def test_packed_hf_stream_matches_trl_segments() -> None:
    trl = pytest.importorskip("trl")
    lengths = sft_lengths(400, seed=8, mean=20, cap=80)
    data = hf_rows(lengths)
    del data["text"]
    stream = datasets.Dataset.from_dict(data).to_iterable_dataset(num_shards=2)
    ours = list(pack_iterable_dataset(stream, 64, overlong="truncate", buffer_size=50))
    theirs = list(trl.pack_dataset(stream, 64, strategy="bfd"))

    def segments(rows: list[dict[str, Any]]) -> Counter[tuple[int, ...]]:
        out: Counter[tuple[int, ...]] = Counter()
        for row in rows:
            start = 0
            for q in row["seq_lengths"]:
                out[tuple(row["input_ids"][start : start + q])] += 1
                start += q
        return out

    assert segments(ours) == segments(theirs)
    # TRL's collator reads our seq_lengths as it reads its own.
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    collate = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True,
                                              return_position_ids=True)
    batch = collate([{k: r[k] for k in ("input_ids", "seq_lengths")} for r in ours[:3]])
    ours_positions = [p for r in ours[:3] for p in r["position_ids"]]
    assert batch["position_ids"].reshape(-1).tolist() == ours_positions


@needs_datasets
def test_packed_hf_stream_resumes_at_every_position() -> None:
    data = hf_rows(sft_lengths(60, seed=9, mean=15, cap=40))
    stream = datasets.Dataset.from_dict(data).to_iterable_dataset(num_shards=2)
    packed = pack_iterable_dataset(stream, 48, buffer_size=8)
    full = list(packed)
    for k in range(1, len(full) + 1):
        it = iter(packed)
        head = [next(it) for _ in range(k)]
        state = packed.state_dict()
        packed.load_state_dict(state)
        assert head + list(packed) == full, f"resumed after {k} packs"
        packed.load_state_dict(None)


@needs_datasets
@needs_torch
def test_packed_hf_stream_across_workers() -> None:
    # Lengths up to 120 in packs of 48 with a separator: about a fifth of the samples are
    # truncated, each to its first 47 tokens.
    data = hf_rows(sft_lengths(200, seed=10, mean=30, cap=120))
    long = sum(1 for row in data["input_ids"] if len(row) > 47)
    assert long > 20
    stream = datasets.Dataset.from_dict(data).to_iterable_dataset(num_shards=4)
    packed = pack_iterable_dataset(stream, 48, buffer_size=30, overlong="truncate",
                                   separator_id=0)
    loader = torch.utils.data.DataLoader(packed.with_format("torch"), batch_size=None,
                                         num_workers=2)
    got: Counter[int] = Counter()
    separators = 0
    for row in loader:
        ids = row["input_ids"].tolist()
        separators += ids.count(0)
        got.update(t for t in ids if t)
    assert got == Counter(t for row in data["input_ids"] for t in row[:47])
    assert separators == len(data["input_ids"])  # truncated ones keep theirs


@needs_datasets
def test_packed_hf_stream_over_long_and_unknown_features() -> None:
    data = hf_rows([5, 70, 3, 200, 8])
    del data["text"]

    def gen() -> Any:
        for i in range(5):
            yield {k: v[i] for k, v in data.items()}

    stream = datasets.IterableDataset.from_generator(gen)
    stream = stream.map(lambda x: x)  # features become unknown
    with pytest.raises(FastpackError, match="sample 1 of the stream has 70 tokens"):
        list(pack_iterable_dataset(stream, 64))
    rows = list(pack_iterable_dataset(stream, 64, overlong="split"))
    check_packed_rows(rows, data, max_len=64)
    rows = list(pack_iterable_dataset(stream, 64, overlong="drop"))
    assert sorted(len(r["input_ids"]) for r in rows) == [16]


@needs_datasets
def test_packed_hf_stream_errors() -> None:
    data = hf_rows([3, 4, 5])
    stream = datasets.Dataset.from_dict(data).to_iterable_dataset()
    with pytest.raises(FastpackTypeError, match="datasets.IterableDataset"):
        pack_iterable_dataset(datasets.Dataset.from_dict(data), 8)
    with pytest.raises(FastpackError, match="group_tokens"):
        pack_iterable_dataset(stream, 8, group_tokens=64)
    with pytest.raises(FastpackError, match="separator_id"):
        pack_iterable_dataset(stream, 8, reserve=1)
    with pytest.raises(FastpackError, match="buffer_size"):
        pack_iterable_dataset(stream, 8, buffer_size=0)
    with pytest.raises(FastpackError, match="'text' is not a list of numbers"):
        pack_iterable_dataset(stream, 8, columns=["input_ids", "text"])
    with pytest.raises(FastpackError, match="'nope' not in the dataset"):
        pack_iterable_dataset(stream, 8, columns=["input_ids", "nope"])
    with pytest.raises(FastpackError, match="lacks 'input_ids'"):
        pack_iterable_dataset(stream, 8, columns=["labels"])
    bad = dict(data, labels=[[1, 2, 3], [1], [1, 2, 3, 4, 5]])
    stream = datasets.Dataset.from_dict(bad).to_iterable_dataset()
    with pytest.raises(FastpackError, match="labels: sample 1 of the stream has 1 values but 4"):
        list(pack_iterable_dataset(stream, 8))
    nulls = dict(data, labels=[[1, 2, 3], None, [1, 2, 3, 4, 5]])
    stream = datasets.Dataset.from_dict(nulls).to_iterable_dataset()
    with pytest.raises(FastpackError, match="labels: sample 1 of the stream is null"):
        list(pack_iterable_dataset(stream, 8))
    holes = dict(data, labels=[[1, 2, 3], [1, None, 3, 4], [1, 2, 3, 4, 5]])
    stream = datasets.Dataset.from_dict(holes).to_iterable_dataset()
    with pytest.raises(FastpackError, match="labels: sample 1 of the stream holds a null"):
        list(pack_iterable_dataset(stream, 8))
    nested = {"input_ids": [[[1, 2]], [[3]]]}
    stream = datasets.Dataset.from_dict(nested).to_iterable_dataset()
    with pytest.raises(FastpackError, match="no 'input_ids' list column"):
        pack_iterable_dataset(stream, 8)


def window_plans(part: Any, packer: StreamPacker, separator_id: int | None) -> tuple[
        list[Any], Any]:
    """The rows of ``_pack_shard`` (what ``pack_iterable_dataset`` yields for one shard)
    and one plan over the source's samples holding the same packs in the same order:
    each window's emitted segments mapped back to their samples."""
    from fastpack._stream import _pack_shard

    rows, seen = [], None
    sample_ids: list[np.ndarray] = []
    starts: list[np.ndarray] = []
    seqlens: list[np.ndarray] = []
    counts: list[np.ndarray] = []
    for table in _pack_shard(part, packer, None, separator_id):
        rows.append(table)
        rnd = packer.current
        if rnd is not seen:
            seen, plan = rnd, rnd.plan
            lo = plan.pack_offsets[rnd.emit]
            n = plan.pack_offsets[rnd.emit + 1] - lo
            index = np.concatenate([np.arange(a, a + c) for a, c in zip(lo, n)] or [[]])
            index = index.astype(np.int64)
            sample_ids.append(rnd.origins[plan.sample_ids[index]])
            starts.append(rnd.row_starts[plan.sample_ids[index]] + plan.starts[index])
            seqlens.append(plan.seqlens[index])
            counts.append(n)
    assert seen is None or len(rows) == sum(len(c) for c in counts)
    plan = seen.plan if seen is not None else fastpack.pack([], packer.max_len)
    joined = {name: getattr(plan, name) for name in fastpack.Plan._FIELDS}
    offsets = np.cumsum([0] + [int(c) for part_counts in counts for c in part_counts])
    joined.update(
        sample_ids=np.concatenate(sample_ids or [np.zeros(0, np.int64)]).astype(np.int64),
        starts=np.concatenate(starts or [np.zeros(0, np.int64)]).astype(np.int64),
        seqlens=np.concatenate(seqlens or [np.zeros(0, np.int32)]).astype(np.int32),
        pack_offsets=offsets.astype(np.int64), reserve=packer.reserve,
        strategy=packer.strategy, overlong=packer.overlong,
    )
    return rows, fastpack.Plan(joined)


@needs_datasets
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=40),
    max_len=st.integers(4, 24),
    buffer_size=st.integers(1, 12),
    strategy=st.sampled_from(fastpack.STRATEGIES),
    overlong=st.sampled_from(("truncate", "split", "drop")),
    separator=st.sampled_from((None, 0)),
    reserve=st.sampled_from((None, 0, 1, 2)),
    ids_type=st.sampled_from(("int32", "int64", "uint16")),
    labels_type=st.sampled_from(("int64", "int32", "uint16")),
    shuffle=st.booleans(),
)
def test_stream_rows_are_the_dataset_gather(
    lengths: list[int], max_len: int, buffer_size: int, strategy: str, overlong: str,
    separator: int | None, reserve: int | None, ids_type: str, labels_type: str,
    shuffle: bool,
) -> None:
    # What a stream yields for a pack is what fastpack.gather (the Dataset path) writes
    # for that pack from the source's rows, for every policy, separator, reserve and
    # dtype; StreamStats counts exactly the tokens not written.
    from fastpack._stream import _stream_seed

    rng = np.random.default_rng(len(lengths))
    ids = [(i * 64 + np.arange(n) + 1).tolist() for i, n in enumerate(lengths)]  # fits uint16
    signed = not labels_type.startswith("u")
    data = {
        "input_ids": ids,
        "labels": [[-100 if signed and rng.random() < 0.3 else t for t in r] for r in ids],
        "attention_mask": [(rng.random(len(r)) < 0.8).tolist() for r in ids],
    }
    features = datasets.Features({
        "input_ids": datasets.List(datasets.Value(ids_type)),
        "labels": datasets.List(datasets.Value(labels_type)),
        "attention_mask": datasets.List(datasets.Value("bool")),
    })
    source = datasets.Dataset.from_dict(data, features=features)
    options = dict(strategy=strategy, overlong=overlong, reserve=reserve,
                   separator_id=separator, buffer_size=buffer_size, shuffle=shuffle, seed=4)
    if (separator is None and reserve) or (separator is not None and reserve == 0):
        with pytest.raises(FastpackError, match="reserve"):
            pack_iterable_dataset(source.to_iterable_dataset(), max_len, **options)
        return
    slots = 0 if separator is None else (reserve or 1)
    assume(slots < max_len)
    packed = pack_iterable_dataset(source.to_iterable_dataset(), max_len, **options)
    if slots and not signed:
        with pytest.raises(FastpackError, match="separator_values: -100 for column 'labels' does not fit"):
            list(packed)
        return
    got = list(packed)
    packer = StreamPacker(max_len, buffer_size=buffer_size, strategy=strategy,
                          overlong=overlong, reserve=slots, shuffle=shuffle,
                          seed=_stream_seed(4, 0))
    tables, plan = window_plans(source.to_iterable_dataset(), packer, separator)
    rows = [t.to_pylist()[0] for t in tables]
    assert got == rows  # pack_iterable_dataset is _pack_shard, pack for pack
    batches = fastpack.gather(plan, source, separator_id=separator,
                              columns=["input_ids", "labels", "attention_mask"])
    want = pa.Table.from_batches(list(batches), schema=batches.schema)
    assert rows == want.to_pylist()
    if tables:
        assert tables[0].schema == want.schema
    # Each sample's written tokens are a prefix of it (or, split, all of it); the rest is
    # counted as dropped or truncated, and nothing else is.
    written: Counter[int] = Counter(t for r in rows for t in r["input_ids"] if t)
    assert all(c == 1 for c in written.values())
    per_sample = Counter((t - 1) // 64 for t in written)
    for i, row in enumerate(ids):
        assert set(row[: per_sample[i]]) <= set(written) and per_sample[i] <= len(row)
    s = packer.stats
    lost = [len(r) - per_sample[i] for i, r in enumerate(ids)]
    assert s.dropped_tokens == sum(n for i, n in enumerate(lost) if not per_sample[i])
    assert s.truncated_tokens == sum(n for i, n in enumerate(lost) if per_sample[i])


@needs_datasets
def test_stream_and_dataset_give_one_answer() -> None:
    # Review s1: a 10-token row truncated into packs of 4 with one separator slot.
    rows = {"input_ids": [list(range(1, 11)), [21, 22]], "labels": [list(range(1, 11)), [21, 22]]}
    ds = datasets.Dataset.from_dict(rows)
    options = dict(overlong="truncate", reserve=1, separator_id=0, strategy="next_fit")
    offline = fastpack.hf.pack_dataset(ds, 4, **options)
    streamed = list(fastpack.hf.pack_dataset(ds.to_iterable_dataset(), 4, buffer_size=10,
                                             **options))
    assert streamed == offline.to_list()
    assert [r["input_ids"] for r in streamed] == [[1, 2, 3, 0], [21, 22, 0]]
    assert [r["labels"] for r in streamed] == [[1, 2, 3, -100], [21, 22, -100]]
    packer = StreamPacker(4, buffer_size=10, strategy="next_fit", overlong="truncate",
                          reserve=1)
    window_plans(ds.to_iterable_dataset(), packer, 0)
    assert packer.stats.truncated_tokens == 7  # 3 of its 10 tokens were written


@needs_datasets
def test_separator_reserves_one_slot() -> None:
    # Review s11: a separator without reserve takes one slot; reserve=0 with one raises.
    stream = datasets.Dataset.from_dict({"input_ids": [[5, 6], [7]]}).to_iterable_dataset()
    implied = list(pack_iterable_dataset(stream, 8, separator_id=2, strategy="next_fit"))
    explicit = list(pack_iterable_dataset(stream, 8, separator_id=2, reserve=1,
                                          strategy="next_fit"))
    assert implied == explicit and implied[0]["input_ids"] == [5, 6, 2, 7, 2]
    two = list(pack_iterable_dataset(stream, 8, separator_id=2, reserve=2, strategy="next_fit"))
    assert two[0]["input_ids"] == [5, 6, 2, 2, 7, 2, 2]
    with pytest.raises(FastpackError, match="reserve: 0 with separator_id=2; a separator needs"):
        pack_iterable_dataset(stream, 8, separator_id=2, reserve=0)
    with pytest.raises(FastpackError, match="reserve: got 1 reserved slots but no separator_id"):
        pack_iterable_dataset(stream, 8, reserve=1)


@needs_datasets
def test_unsigned_labels_and_fixed_size_lists() -> None:
    # Review s11b: unsigned labels cannot hold the -100 of a separator slot: the Dataset
    # path's FastpackError, not a raw OverflowError. Fixed-size lists pack as on a Dataset.
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32")),
                                  "labels": datasets.List(datasets.Value("uint32"))})
    ds = datasets.Dataset.from_dict({"input_ids": [[5, 6], [7]], "labels": [[5, 6], [7]]},
                                    features=features)
    with pytest.raises(FastpackError, match="separator_values: -100 for column 'labels' does not fit its "
                                            "type uint32"):
        list(pack_iterable_dataset(ds.to_iterable_dataset(), 8, separator_id=2))
    fixed = datasets.Features({"input_ids": datasets.List(datasets.Value("int64"), length=3),
                               "flags": datasets.List(datasets.Value("bool"), length=3)})
    ds = datasets.Dataset.from_dict(
        {"input_ids": [[1, 2, 3], [4, 5, 6], [7, 8, 9]],
         "flags": [[True, False, True], [False, False, True], [True, True, False]]},
        features=fixed)
    packed = pack_iterable_dataset(ds.to_iterable_dataset(), 8, separator_id=0,
                                   strategy="next_fit", buffer_size=2)
    rows = list(packed)
    plan = fastpack.pack([3, 3, 3], 8, strategy="next_fit", reserve=1, shuffle=False)
    want = pa.Table.from_batches(list(fastpack.gather(plan, ds, separator_id=0)))
    assert rows == want.to_pylist()
    assert rows[0]["flags"] == [True, False, True, False, False, False, True, False]
    assert packed.features == datasets.Features.from_arrow_schema(want.schema)


@needs_datasets
def test_written_columns_are_not_packed() -> None:
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]], "position_ids": [[0, 1], [0]]})
    rows = list(pack_iterable_dataset(ds.to_iterable_dataset(), 8))
    assert [r["position_ids"] for r in rows] == [[0, 1, 0]]  # rewritten from the plan
    with pytest.raises(FastpackError, match="'position_ids' is written by pack_dataset"):
        pack_iterable_dataset(ds.to_iterable_dataset(), 8, columns=["input_ids", "position_ids"])


@needs_torch
def test_stream_refuses_misspelt_per_token_keys() -> None:
    # A later sample's `assistant_mask` (HF's key is `assistant_masks`) would otherwise be
    # dropped and its prompt trained; `ignore_keys` drops it on purpose.
    from fastpack.torch import PackedCollator, PackedIterableDataset

    samples = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6, 7], "assistant_mask": [0, 1, 1, 1]}]
    ds = PackedIterableDataset(samples, PackedCollator(max_len=16, backend="flash"), buffer_size=4)
    with pytest.raises(FastpackError, match=r"sample 1 has the per-token key 'assistant_mask'.*"
                                            r"did you mean 'assistant_masks'"):
        list(ds)
    ignoring = PackedCollator(max_len=16, backend="flash", ignore_keys=("assistant_mask",))
    (batch,) = list(PackedIterableDataset(samples, ignoring, buffer_size=4))
    assert batch["input_ids"].shape == (1, 7)


@needs_torch
def test_stream_keys_are_fixed_once() -> None:
    # Review s14: a later sample's mask or labels were dropped when sample 0 had none.
    collator = PackedCollator(max_len=16, backend="sdpa")
    first_plain = [{"input_ids": [1, 2, 3]},
                   {"input_ids": [4, 5, 6, 7], "assistant_masks": [0, 0, 0, 0]},
                   {"input_ids": [8, 9], "assistant_masks": [0, 0]}]
    with pytest.raises(FastpackError, match="assistant_masks: sample 1 of the stream has "
                                            "'assistant_masks', which sample 0 of the stream "
                                            "has not"):
        list(PackedIterableDataset(first_plain, collator, buffer_size=8))
    with pytest.raises(FastpackError, match="expected every sample of a batch"):
        collator(first_plain)  # the collator's answer to the same samples
    labels_later = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [-100, -100]}]
    with pytest.raises(FastpackError, match="labels: sample 1 of the stream has 'labels'"):
        list(PackedIterableDataset(labels_later, collator, buffer_size=8))
    mask_first = [{"input_ids": [1, 2], "completion_mask": [0, 1]}, {"input_ids": [3]}]
    with pytest.raises(FastpackError, match="completion_mask: sample 1 of the stream has no "
                                            "'completion_mask'"):
        list(PackedIterableDataset(mask_first, collator, buffer_size=8))
    # The check is per sample, across windows too (the window here is 1 sample).
    late = [{"input_ids": [i + 1]} for i in range(5)] + [{"input_ids": [9], "labels": [9]}]
    with pytest.raises(FastpackError, match="sample 5 of the stream has 'labels'"):
        list(PackedIterableDataset(late, collator, buffer_size=1))
    # Masks ignored (loss_mask_key=False) are not checked; a named key must be everywhere.
    ignore = PackedCollator(max_len=16, backend="sdpa", loss_mask_key=False)
    assert len(list(PackedIterableDataset(first_plain, ignore, buffer_size=8))) == 1
    named = PackedCollator(max_len=16, backend="sdpa", loss_mask_key="assistant_masks")
    with pytest.raises(FastpackError, match="loss_mask_key: sample 0 of the stream has no "
                                            "'assistant_masks'"):
        list(PackedIterableDataset(first_plain, named, buffer_size=8))
    # A consistent stream trains what the collator trains.
    good = [dict(s, assistant_masks=[1] * len(s["input_ids"])) for s in first_plain]
    (batch,) = list(PackedIterableDataset(good, collator, buffer_size=8, shuffle=False))
    want = collator(good)
    assert sorted(batch["labels"].reshape(-1).tolist()) == sorted(
        want["labels"].reshape(-1).tolist())


@needs_torch
@needs_datasets
def test_stream_keys_from_the_source_features() -> None:
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int64")),
                                  "labels": datasets.List(datasets.Value("int64"))})
    stream = datasets.Dataset.from_dict({"input_ids": [[1, 2]], "labels": [[1, 2]]},
                                        features=features).to_iterable_dataset()
    named = PackedCollator(max_len=16, backend="sdpa", loss_mask_key="assistant_masks")
    with pytest.raises(FastpackError, match="loss_mask_key: the source's features have no "
                                            "'assistant_masks'"):
        PackedIterableDataset(stream, named)  # at construction, before any sample
    collator = PackedCollator(max_len=16, backend="sdpa")
    got = list(PackedIterableDataset(stream, collator))
    assert same(got, [collator([{"input_ids": [1, 2], "labels": [1, 2]}])])


@needs_torch
def test_strategy_is_the_collators() -> None:
    # Issue 18: PackedIterableDataset's strategy used to override the collator's.
    data = samples([9, 2, 7, 3, 8, 1])
    collator = PackedCollator(max_len=12, backend="sdpa", strategy="next_fit")
    ds = PackedIterableDataset(data, collator, buffer_size=100, shuffle=False)
    assert ds.strategy == "next_fit"
    order = [t for b in ds for t in b["input_ids"].reshape(-1).tolist() if t]
    assert order == [t for s in data for t in s["input_ids"]]  # next fit keeps the order
    assert PackedIterableDataset(data, collator, strategy="next_fit").strategy == "next_fit"
    with pytest.raises(FastpackError, match="strategy: got 'bfd', but the collator plans "
                                            "with 'next_fit'"):
        PackedIterableDataset(data, collator, strategy="bfd")
    with pytest.raises(FastpackError, match="strategy"):
        PackedIterableDataset(data, collator, strategy="best")


@needs_torch
def test_stats_of_worker_passes(caplog: pytest.LogCaptureFixture) -> None:
    # With workers the main process packs nothing: ds.stats stays zeros, stats_of reads
    # every worker's counts from the loader's state, and each worker logs its losses.
    data = samples(sft_lengths(60, seed=14, mean=12, cap=40).tolist())
    collator = PackedCollator(max_len=24, backend="sdpa", overlong="truncate")
    ds = PackedIterableDataset(data, collator, buffer_size=10)
    loader = dataloader(ds, 2)
    list(loader)
    assert ds.stats.num_sequences == 0
    total = PackedIterableDataset.stats_of(loader.state_dict())
    over = [len(s["input_ids"]) - 24 for s in data if len(s["input_ids"]) > 24]
    assert over and total.num_sequences == len(data)
    assert (total.truncated_sequences, total.truncated_tokens) == (len(over), sum(over))
    one = PackedIterableDataset(data, collator, buffer_size=10)
    with caplog.at_level("WARNING", logger="fastpack"):
        list(one)
    assert PackedIterableDataset.stats_of([one.state_dict()]) == one.stats
    assert f"{len(over)} truncated ({sum(over)} tokens)" in caplog.text
