"""One options object (issue 18): every entry point that packs takes the same options, as
keywords or as a ``fastpack.PackOptions``, and says the same thing about the same mistake.

The table below is generated from ``PackOptions``' fields, so an option added there is
checked at every entry point without a new row: the proof that the options are defined
and checked in one place.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

import fastpack
import fastpack.ray
from fastpack import FastpackError, FastpackTypeError, PackOptions, StreamPacker
from fastpack._offline.settings import PackSettings
from fastpack._options import PLAN_OPTIONS, PackArgs, _Args
from fastpack.cli import main as command

try:
    import torch

    from fastpack.torch import PackedCollator, PackedDataset, PackedIterableDataset
except ImportError:  # pragma: no cover - the torch extra is not installed
    torch = None
try:
    import datasets

    from fastpack._stream import pack_iterable_dataset
    from fastpack.hf import pack_dataset
except ImportError:  # pragma: no cover - the hf extra is not installed
    datasets = None

MAX_LEN = 8
TOKENS = [[1, 2, 3], [4, 5]]
FIELDS = [f.name for f in dataclasses.fields(PackOptions)]

Entry = Callable[..., Any]


def _with_max_len(kwargs: dict[str, Any]) -> dict[str, Any]:
    return kwargs if "options" in kwargs else {"max_len": MAX_LEN, **kwargs}


class _Checked(Exception):
    """Raised by a Ray dataset when it is first read: its options were checked by then."""


class _UnreadDataset:
    """Stands for a ``ray.data.Dataset``: ``fastpack.ray.pack_dataset`` checks its options
    before it reads anything (so the table needs no Ray cluster)."""

    def schema(self) -> Any:
        raise _Checked


def _ray_pack_dataset(**kwargs: Any) -> Any:
    try:
        return fastpack.ray.pack_dataset(_UnreadDataset(), **_with_max_len(kwargs))
    except _Checked:
        return None


def entry_points() -> dict[str, Entry]:
    """Each entry point that packs, called with the options as keywords (``max_len`` is
    the collator's for the datasets). ``fastpack pack`` is its settings builder (the
    command's flags go through it: see test_the_command_says_it_of_its_flag)."""
    points: dict[str, Entry] = {
        "pack": lambda **kw: fastpack.pack([3, 2], **_with_max_len(kw)),
        "StreamPacker": lambda **kw: StreamPacker(**_with_max_len(kw)),
        "fastpack pack": lambda **kw: PackSettings(**_with_max_len(kw)),
        "ray.pack_dataset": _ray_pack_dataset,
    }
    if datasets is not None:
        table = datasets.Dataset.from_dict({"input_ids": TOKENS})
        points["hf.pack_dataset"] = lambda **kw: pack_dataset(table, **_with_max_len(kw))
        points["pack_iterable_dataset"] = lambda **kw: pack_iterable_dataset(
            table.to_iterable_dataset(), **_with_max_len(kw))
    if torch is not None:
        samples = [{"input_ids": t} for t in TOKENS]
        points["PackedCollator"] = lambda **kw: PackedCollator(**_with_max_len(kw))
        points["PackedDataset"] = lambda **kw: PackedDataset(TOKENS, PackedCollator(MAX_LEN),
                                                             **kw)
        points["PackedIterableDataset"] = lambda **kw: PackedIterableDataset(
            samples, PackedCollator(MAX_LEN), **kw)
    return points


POINTS = entry_points()
#: The entry points that take max_len themselves (the datasets take their collator's).
OWN_MAX_LEN = [n for n in POINTS if n not in ("PackedDataset", "PackedIterableDataset")]


def _bad_values() -> list[tuple[str, Any]]:
    """A value of the wrong type for every option (generated: a new option gets its row),
    then the out-of-range values of test_errors.py's pack rows."""
    rows: list[tuple[str, Any]] = [(name, [1]) for name in FIELDS]
    rows += [
        ("max_len", 0), ("max_len", 2**30), ("strategy", "best"), ("overlong", "cut"),
        ("reserve", MAX_LEN), ("reserve", -1), ("shuffle", "yes"), ("seed", -1),
        ("seed", 2**64), ("long_max_len", MAX_LEN), ("long_max_len", 2**25),
        ("group_tokens", MAX_LEN - 1), ("group_tokens", 2**31),
    ]
    return rows


def _message(call: Callable[[], Any]) -> tuple[type[BaseException], str]:
    with pytest.raises(FastpackError) as info:
        call()
    return type(info.value), str(info.value)


@pytest.mark.parametrize(("name", "value"), _bad_values(),
                         ids=[f"{n}={v!r}" for n, v in _bad_values()])
def test_every_entry_point_says_the_same_of_a_bad_value(name: str, value: Any) -> None:
    # The one check: what PackOptions says is what every entry point says.
    want = _message(lambda: PackOptions(**{"max_len": MAX_LEN, name: value}))
    assert want[1].startswith(f"{name}: ")
    points = OWN_MAX_LEN if name == "max_len" else list(POINTS)
    for point in points:
        got = _message(lambda point=point: POINTS[point](**{name: value}))  # type: ignore[misc]
        assert got == want, point
    assert len(points) >= (4 if torch is None or datasets is None else 7)


#: The rows of the table a command line can spell: values as text, a flag per option but
#: ``reserve`` (refused) and ``shuffle`` (``--shuffle/--no-shuffle``: no value to get wrong).
_FLAG_ROWS = [(n, v) for n, v in _bad_values()
              if n not in ("reserve", "shuffle") and not isinstance(v, list)]


@pytest.mark.parametrize(("name", "value"), _FLAG_ROWS, ids=[f"{n}={v!r}" for n, v in _FLAG_ROWS])
def test_the_command_says_it_of_its_flag(name: str, value: Any, tmp_path: Any) -> None:
    # What PackOptions says, after the flag it came from; status 2, before any input is read.
    _, want = _message(lambda: PackOptions(**{"max_len": MAX_LEN, name: value}))
    flag = "--" + name.replace("_", "-")
    args = ["pack", str(tmp_path / "missing.parquet"), "-o", str(tmp_path / "out"),
            "--max-len", str(MAX_LEN), flag, str(value)]
    result = CliRunner().invoke(command, args)
    assert result.exit_code == 2
    assert result.output == f"fastpack: error: {flag}: {want}\n"
    assert not (tmp_path / "out").exists()


def test_the_command_and_ray_refuse_the_options_they_cannot_honour() -> None:
    # reserve: neither writes a separator into the reserved slots; cp_size: neither pads
    # its rows for a context-parallel group; share_prefix: neither writes trees; limits:
    # neither has a document's use of a budget besides tokens.
    want = (FastpackError, "reserve: got 1; fastpack pack writes no separator, so it reserves "
                           "no slot after a document")
    for point in ("fastpack pack", "ray.pack_dataset"):
        assert _message(lambda point=point: POINTS[point](reserve=1)) == want  # type: ignore[misc]
        assert _message(lambda point=point: POINTS[point](  # type: ignore[misc]
            options=PackOptions(MAX_LEN, reserve=1))) == want
        POINTS[point](reserve=0)  # the default is no slot: fine
        assert _message(lambda point=point: POINTS[point](cp_size=2))[1].startswith(  # type: ignore[misc]
            "cp_size: got 2; fastpack pack does not plan for context parallelism")
        assert _message(lambda point=point: POINTS[point](share_prefix=True))[1].startswith(  # type: ignore[misc]
            "share_prefix: got True; fastpack pack writes rows of whole documents")
        assert _message(lambda point=point: POINTS[point](limits={"images": 2}))[1].startswith(  # type: ignore[misc]
            "limits: got {'images': 2}; fastpack pack plans token lengths only")


def test_the_command_and_ray_plan_with_their_options(monkeypatch: Any) -> None:
    want = PackOptions(MAX_LEN, strategy="ffd", overlong="split", seed=9, long_max_len=16,
                       group_tokens=32)
    given = {name: getattr(want, name) for name in FIELDS if name not in ("max_len", "reserve")}
    by_keywords = PackSettings(MAX_LEN, shard_rows=4, **given)
    assert by_keywords.options == want == PackSettings(options=want, shard_rows=4).options
    assert by_keywords == PackSettings.from_json(by_keywords.to_json())
    seen: list[PackSettings] = []

    class Pipeline:
        def __init__(self, _ds: Any, settings: PackSettings, *_args: Any) -> None:
            seen.append(settings)
            raise _Checked

    class Schemaless:
        def schema(self) -> None:
            return None

    monkeypatch.setattr(fastpack.ray, "_Pipeline", Pipeline)
    for kwargs in (given, {"options": want}):
        with pytest.raises(_Checked):
            fastpack.ray.pack_dataset(Schemaless(), **_with_max_len(kwargs))
        assert seen.pop().options == want


def test_every_option_has_a_keyword_a_check_and_a_wrong_type_row() -> None:
    assert set(PackArgs.__annotations__) == set(FIELDS) - {"max_len"}
    assert set(_Args.__annotations__) == set(FIELDS) - {"max_len", "strategy"}
    assert {n for n, _ in _bad_values()} == set(FIELDS)
    assert set(PLAN_OPTIONS) < set(FIELDS)


@pytest.mark.parametrize("point", list(POINTS))
def test_a_misspelt_option_names_the_closest(point: str) -> None:
    kind, text = _message(lambda: POINTS[point](strategey="bfd"))
    assert kind is FastpackTypeError
    assert re.match(r"^strategey: not an option of [\w.]+\(\); did you mean 'strategy'\? it "
                    r"takes .*\bstrategy\b", text), text


@pytest.mark.parametrize("point", list(POINTS))
def test_an_option_given_both_ways_must_agree(point: str) -> None:
    options = PackOptions(MAX_LEN, overlong="truncate")
    assert _message(lambda: POINTS[point](options=options, overlong="drop")) == (
        FastpackError, "overlong: got overlong='drop' and options with overlong='truncate'; "
                       "pass it once (as a keyword or in options)")
    if point in OWN_MAX_LEN:  # (a dataset's overlong is its collator's)
        POINTS[point](options=options, overlong="truncate")  # one value both ways is fine
    assert _message(lambda: POINTS[point](options={"max_len": 8})) == (
        FastpackTypeError, "options: expected a fastpack.PackOptions, got dict")


def test_every_entry_point_takes_the_same_options() -> None:
    batch = dict(strategy="next_fit", overlong="truncate")
    plan = dict(shuffle=False, seed=5, long_max_len=2 * MAX_LEN)
    want = PackOptions(MAX_LEN, **batch, **plan)
    lengths = [3, 2, 9]
    for options in ({**batch, **plan}, {"options": want}):
        assert fastpack.pack(lengths, **_with_max_len(options)).options == want
        assert StreamPacker(**_with_max_len(options)).options == want
    assert fastpack.pack(lengths, options=want).seqlens.tolist() == \
        fastpack.pack(lengths, MAX_LEN, **batch, **plan).seqlens.tolist()
    if torch is not None:
        collator = PackedCollator(MAX_LEN, **batch)
        assert collator.options == PackOptions(MAX_LEN, **batch)
        tokens = [list(range(1, n + 1)) for n in lengths]
        for options in (plan, {**batch, **plan}, {"options": want}):
            data = PackedDataset(tokens, collator, **options)
            assert data.options == want and data.plan.options == want
            stream = PackedIterableDataset([{"input_ids": t} for t in tokens], collator,
                                           **options)
            assert stream.options == want
            assert stream._packer((0, 1)).options == want.replace(
                seed=stream._packer((0, 1)).options.seed)
    if datasets is not None:
        table = datasets.Dataset.from_dict({"input_ids": [list(range(1, n + 1))
                                                          for n in lengths]})
        by_keywords = pack_dataset(table, MAX_LEN, **batch, **plan)
        by_object = pack_dataset(table, options=want)
        assert by_keywords.to_dict() == by_object.to_dict()
        summary = fastpack.pack(lengths, options=want).summary()
        assert summary in by_object.info.description
        stream = table.to_iterable_dataset()
        rows = list(pack_iterable_dataset(stream, options=want.replace(long_max_len=None)))
        assert rows == list(pack_iterable_dataset(stream, MAX_LEN, **batch, shuffle=False,
                                                  seed=5))
        assert sum(len(r["input_ids"]) for r in rows) == 3 + 2 + MAX_LEN  # 9 truncated


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_a_collator_takes_the_batch_options_and_a_dataset_the_plan_options() -> None:
    for name, value in (("shuffle", False), ("seed", 3), ("long_max_len", 16),
                        ("group_tokens", 32)):
        assert name in PLAN_OPTIONS
        with pytest.raises(FastpackError, match=rf"^{name}: got {value!r}; orders, buckets or "
                                                r"groups the packs of a whole plan"):
            PackedCollator(MAX_LEN, **{name: value})
    collator = PackedCollator(MAX_LEN, strategy="ffd", separator_id=0)
    assert collator.options == PackOptions(MAX_LEN, strategy="ffd", reserve=1)
    for make in (lambda **kw: PackedDataset(TOKENS, collator, **kw),
                 lambda **kw: PackedIterableDataset([{"input_ids": t} for t in TOKENS],
                                                    collator, **kw)):
        make(strategy="ffd", reserve=1)  # the collator's own values may be repeated
        with pytest.raises(FastpackError, match=r"^strategy: got 'bfd', but the collator plans "
                                                r"with 'ffd'; set it once, on the collator"):
            make(strategy="bfd")
        with pytest.raises(FastpackError, match=r"^reserve: got 0, but the collator plans "
                                                r"with 1"):
            make(options=PackOptions(MAX_LEN, strategy="ffd"))
        make(options=collator.options.replace(shuffle=False))


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_a_given_plan_is_compared_by_its_options() -> None:
    lengths = [len(t) for t in TOKENS]
    collator = PackedCollator(MAX_LEN)
    plan = fastpack.pack(lengths, MAX_LEN, group_tokens=16, shuffle=False)
    assert PackedDataset(TOKENS, collator, plan=plan).plan is plan
    # Only what the caller stated (and what building a batch reads) is compared.
    PackedDataset(TOKENS, collator, plan=plan, group_tokens=16, shuffle=False)
    for kwargs, message in (
        ({"group_tokens": 32}, r"^group_tokens: got 32, but the given plan was made with 16"),
        ({"shuffle": True}, r"^shuffle: got True, but the given plan was made with False"),
    ):
        with pytest.raises(FastpackError, match=message):
            PackedDataset(TOKENS, collator, plan=plan, **kwargs)
    with pytest.raises(FastpackError, match=r"^max_len: got 8, but the given plan was made "
                                            r"with 16"):
        PackedDataset(TOKENS, collator, plan=fastpack.pack(lengths, 16))
    with pytest.raises(FastpackError, match=r"^reserve: got 1, but the given plan was made "
                                            r"with 0"):
        PackedDataset(TOKENS, PackedCollator(MAX_LEN, separator_id=0),
                      plan=fastpack.pack(lengths, MAX_LEN))


def test_plans_remember_their_options() -> None:
    options = PackOptions(6, strategy="ffd", overlong="split", seed=7, group_tokens=12)
    plan = fastpack.pack([3, 9, 4, 2], options=options, threads=2)
    assert plan.options == options
    assert fastpack.pack([3, 9, 4, 2], options=options, threads=1).options == options
    fields = {name: getattr(plan, name) for name in fastpack.Plan._FIELDS}
    # Assembled from its arrays: the options its fields record, in the order given.
    assembled = fastpack.Plan(fields)
    assert assembled.options == options.replace(shuffle=False, seed=0, group_tokens=None)
    assert fastpack.Plan({**fields, "shuffle": True, "seed": 7}).options == \
        options.replace(group_tokens=None)


def test_options_are_frozen_and_replace_checks() -> None:
    options = PackOptions(8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.max_len = 9  # type: ignore[misc]
    assert options.replace(reserve=2).reserve == 2
    with pytest.raises(FastpackError, match=r"^reserve: got 8; expected an integer in 0\.\.=7"):
        options.replace(reserve=8)
    with pytest.raises(FastpackTypeError, match=r"^sede: not an option of PackOptions\(\); "
                                                r"did you mean 'seed'\?"):
        options.replace(sede=1)  # type: ignore[call-arg]
    assert PackOptions(np.int64(8), seed=np.uint64(3)) == PackOptions(8, seed=3)
    assert type(PackOptions(np.int64(8)).max_len) is int


def test_options_made_from_keywords_are_reused_only_for_the_same_values_and_types() -> None:
    lengths = [3, 2]
    first = fastpack.pack(lengths, 8, shuffle=True, seed=3).options
    assert fastpack.pack(lengths, 8, seed=3, shuffle=True).options is first  # checked once
    assert fastpack.pack(lengths, np.int64(8), shuffle=True, seed=3).options == first
    # Equal values of a refused type are refused again, not served from the first call.
    with pytest.raises(FastpackTypeError, match=r"^shuffle: expected a bool, got int 1"):
        fastpack.pack(lengths, 8, shuffle=1, seed=3)
    with pytest.raises(FastpackTypeError, match=r"^seed: expected an integer, got float 3\.0"):
        fastpack.pack(lengths, 8, shuffle=True, seed=3.0)
    with pytest.raises(FastpackTypeError, match=r"^max_len: expected an integer, got float"):
        fastpack.pack(lengths, 8.0, shuffle=True, seed=3)
    with pytest.raises(FastpackTypeError, match=r"^group_tokens: expected an integer, got list"):
        fastpack.pack(lengths, 8, group_tokens=[16])  # unhashable: checked, not cached


def test_a_stream_state_of_before_an_option_existed_still_loads() -> None:
    packer = StreamPacker(8, buffer_size=4, seed=3)
    packer.push({"input_ids": (np.arange(9), np.array([0, 3, 5, 9]))})
    state = packer.state_dict()
    del state["options"]["group_tokens"]  # a state saved before the option existed
    again = StreamPacker(8, buffer_size=4, seed=3)
    again.load_state_dict(state)
    assert again.current is not None and again.current.emit.tolist() == \
        packer.current.emit.tolist()  # type: ignore[union-attr]
    with pytest.raises(FastpackError, match=r"^state: saved with other options; .*seed=3/4"):
        StreamPacker(8, buffer_size=4, seed=4).load_state_dict(state)


def _mostly(valid: st.SearchStrategy[Any], *invalid: Any) -> st.SearchStrategy[Any]:
    """``valid`` values, and one time in eight one of ``invalid``."""
    return st.tuples(st.integers(0, 7), valid, st.sampled_from(invalid)).map(
        lambda t: t[2] if t[0] == 0 else t[1])


_VALUES = {
    "strategy": _mostly(st.sampled_from(list(fastpack.STRATEGIES)), "best", 1),
    "overlong": _mostly(st.sampled_from(["error", "truncate", "split", "drop"]), "cut", None),
    "reserve": _mostly(st.integers(0, 10), -1, 1.0),
    "shuffle": _mostly(st.sampled_from([True, False, np.True_]), 1, "yes"),
    "seed": _mostly(st.integers(0, 2**64 - 1), -1, 2**64, 2.5),
    "long_max_len": _mostly(st.one_of(st.none(), st.integers(0, 20)), "16"),
    "group_tokens": _mostly(st.one_of(st.none(), st.integers(0, 40)), 16.0),
}


@settings(max_examples=150, deadline=None)
@given(max_len=_mostly(st.integers(1, 12), 0, -1, 8.0),
       options=st.fixed_dictionaries({}, optional=_VALUES))
def test_keywords_and_the_object_are_one_check(max_len: Any, options: dict[str, Any]) -> None:
    """Whatever the values: ``PackOptions``, ``pack`` and ``StreamPacker`` raise the same
    error, or all accept and agree."""
    def outcome(call: Callable[[], Any]) -> Any:
        try:
            return call()
        except FastpackError as e:
            return (type(e), str(e))

    made = outcome(lambda: PackOptions(max_len, **options))
    plan = outcome(lambda: fastpack.pack([], max_len, **options))
    packer = outcome(lambda: StreamPacker(max_len, **options))
    if isinstance(made, tuple):
        assert plan == made
        assert packer == made
        return
    if isinstance(plan, tuple):  # the core's own checks of a valid-looking combination
        assert plan[1].startswith("long_max_len: strategy \"wrapped\"")
    else:
        assert plan.options == made
        assert fastpack.pack([], options=made).options is made  # kept, not checked again
    if made.group_tokens is None:
        assert packer.options == made
    else:
        assert packer[1].startswith("group_tokens: got ")
