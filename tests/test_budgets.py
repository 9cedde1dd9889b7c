"""Packing under several budgets (``limits``), checked against the rule as documented
(docs/vision_language.md, "Budgets besides tokens") by an independent replay:

- every kept item in exactly one pack, every pack within ``max_len`` and every cap, the
  items over a budget dropped and counted;
- items of one length (longest first, input order) go in runs: an item follows the item
  before it into its pack while that pack has room for it in tokens and in every budget;
  an item that starts a run goes where best fit (least token room) or first fit (earliest
  pack) puts it among the packs with room for its exact needs, or to a new pack when none
  has room;
- the same plan on one thread and on several.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import fastpack

NAMES = ("patches", "images", "frames")


def pack_of(plan: fastpack.Plan, n: int) -> np.ndarray:
    """The pack of every item (-1: not packed)."""
    out = np.full(n, -1, dtype=np.int64)
    offsets = plan.pack_offsets
    packs = np.repeat(np.arange(plan.num_packs), np.diff(offsets))
    out[plan.sample_ids] = packs
    return out


def check_caps(plan: fastpack.Plan, lengths: np.ndarray, values: list[np.ndarray],
               caps: list[int], max_len: int) -> np.ndarray:
    """Every pack within every budget; each item packed once or dropped for a reason."""
    where = pack_of(plan, len(lengths))
    assert np.bincount(plan.sample_ids, minlength=len(lengths)).max(initial=0) <= 1
    packed = where >= 0
    for v, cap in zip(values, caps):
        used = np.bincount(where[packed], weights=v[packed], minlength=plan.num_packs)
        assert used.max(initial=0) <= cap, "a pack over a budget"
    assert np.all(plan.pack_fills <= max_len)
    over = np.zeros(len(lengths), dtype=bool)
    for v, cap in zip(values, caps):
        over |= v > cap
    over |= lengths > max_len
    expected = (lengths > 0) & ~over
    assert np.array_equal(packed, expected), "every item within its budgets packed, once"
    assert plan.dropped_sequences == int(((lengths > 0) & over).sum())
    return where


def check_rule(where: np.ndarray, lengths: np.ndarray, values: list[np.ndarray],
               caps: list[int], max_len: int, best: bool) -> None:
    """Replays the placement item by item (see the module docs)."""
    items = sorted(np.flatnonzero(where >= 0), key=lambda i: (-int(lengths[i]), int(i)))
    rooms: dict[int, list[int]] = {}  # pack -> [opened at, token room, budget rooms...]
    before: tuple[int, int] | None = None  # (length, pack) of the item before

    def fits(p: list[int], i: int) -> bool:
        return p[1] >= lengths[i] and all(int(v[i]) <= r for v, r in zip(values, p[2:]))

    for i in items:
        q = int(where[i])
        if before is not None and before[0] == lengths[i] and fits(rooms[before[1]], i):
            assert q == before[1], f"item {i}: its run's pack had room, yet it went elsewhere"
        else:
            feasible = [p for p in rooms.values() if fits(p, i)]
            if q not in rooms:
                assert not feasible, f"item {i} opened a pack while another had room"
                rooms[q] = [len(rooms), max_len, *caps]
            else:
                assert fits(rooms[q], i), f"item {i} went to a pack without room"
                if best:
                    assert rooms[q][1] == min(p[1] for p in feasible), f"item {i}: not best fit"
                else:
                    assert rooms[q][0] == min(p[0] for p in feasible), f"item {i}: not first fit"
        p = rooms[q]
        p[1] -= int(lengths[i])
        for d, v in enumerate(values):
            p[2 + d] -= int(v[i])
        before = (int(lengths[i]), q)


@st.composite
def cases(draw: Any) -> tuple[int, np.ndarray, list[np.ndarray], list[int]]:
    max_len = draw(st.integers(1, 60))
    n = draw(st.integers(0, 120))
    caps = draw(st.lists(st.integers(1, 30), min_size=1, max_size=3))
    lengths = np.array(draw(st.lists(st.integers(0, max_len + 1), min_size=n, max_size=n)),
                       dtype=np.int64)
    values = [np.array(draw(st.lists(st.one_of(st.just(0), st.integers(0, cap),
                                               st.integers(0, 2 * cap + 1)),
                                     min_size=n, max_size=n)), dtype=np.int64)
              for cap in caps]
    return max_len, lengths, values, caps


@settings(max_examples=150, deadline=None)
@given(case=cases(), strategy=st.sampled_from(["bfd", "ffd"]))
def test_each_item_goes_where_the_run_rule_puts_it(case: Any, strategy: str) -> None:
    max_len, lengths, values, caps = case
    limits = {NAMES[d]: (v, c) for d, (v, c) in enumerate(zip(values, caps))}
    plan = fastpack.pack(lengths, max_len, strategy=strategy, overlong="drop", limits=limits)
    where = check_caps(plan, lengths, values, caps, max_len)
    check_rule(where, lengths, values, caps, max_len, best=strategy == "bfd")


def test_runs_on_a_media_mix_within_every_cap_and_the_same_on_any_thread_count() -> None:
    """A mix large enough to be packed on several threads (2^17 items and more)."""
    rng = np.random.default_rng(5)
    n = 200_000
    images = rng.choice(5, n, p=[0.3, 0.5, 0.1, 0.05, 0.05])
    patches = images * rng.integers(64, 4000, n)
    lengths = rng.integers(20, 3000, n) + patches // 4
    values, caps, max_len = [patches, images], [32768, 16], 8192
    limits = {"patches": (patches, caps[0]), "images": (images, caps[1])}
    one = fastpack.pack(lengths, max_len, limits=limits, threads=1, overlong="drop")
    many = fastpack.pack(lengths, max_len, limits=limits, threads=4, overlong="drop")
    for name in ("sample_ids", "seqlens", "pack_offsets"):
        assert np.array_equal(getattr(one, name), getattr(many, name)), name
    check_caps(one, lengths, values, caps, max_len)
    assert one.num_packs >= max(one.lower_bound, one.limits["patches"].lower_bound,
                                one.limits["images"].lower_bound)
