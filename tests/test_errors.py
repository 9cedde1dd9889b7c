"""Every user mistake fastpack knows of, and what it gets: one table.

Each row is a call that a user could write, the exception it must raise and a regex its
message must match — the argument named, the value it got, what is accepted. Bad input
raises ``fastpack.FastpackError`` (a ``ValueError``) or ``FastpackTypeError`` (also a
``TypeError``); the few protocol exceptions (``IndexError`` from ``__getitem__``,
``SystemExit`` from a command line, ``MemoryError``) are listed too. A row marked
``gap`` is a known miss in a module this table does not own yet: it fails strictly
(``xfail(strict=True)``), so it turns red the day it is fixed and its mark must go.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pytest

import fastpack
from fastpack import FastpackError, FastpackTypeError
from fastpack.demo import main as demo

E, T = FastpackError, FastpackTypeError


class Row(NamedTuple):
    id: str
    call: Callable[[], Any]
    error: type[BaseException]
    match: str
    gap: str = ""


def _plan(**kwargs: Any) -> fastpack.Plan:
    """The plan of the token rows ``[[1, 2, 3], [4, 5]]``: one pack."""
    return fastpack.pack([3, 2], 8, **kwargs)


def _pack(lengths: Any = (3, 5), max_len: Any = 8, **kwargs: Any) -> Callable[[], Any]:
    return lambda: fastpack.pack(lengths, max_len, **kwargs)


def _gen():  # a generator is accepted; a set is not (no order)
    yield from (3, 5)


PACK = [
    Row("lengths-negative", _pack([1, -2, 3]), E, r"^lengths: negative length -2 at index 1;"),
    Row("lengths-negative-int8", _pack(np.array([1, -2], np.int8)), E,
        r"^lengths: negative length -2 at index 1"),
    Row("lengths-fraction", _pack([1.5, 2]), E, r"^lengths: 1\.5 at index 0 is not a whole"),
    Row("lengths-nan", _pack([1, float("nan")]), E, r"^lengths: nan at index 1"),
    Row("lengths-2d", _pack([[1, 2], [3, 4]]), E, r"^lengths: expected a 1-D array, got shape"),
    Row("lengths-bool", _pack([True, False]), T, r"^lengths: expected integers, got booleans"),
    Row("lengths-str", _pack(["a", "b"]), T, r"^lengths: expected integers"),
    Row("lengths-scalar", _pack(5), T, r"^lengths: expected a 1-D array-like .* got int"),
    Row("lengths-string", _pack("35"), T, r"^lengths: expected a 1-D array-like .* got str"),
    Row("lengths-set", _pack({3, 5}), T, r"^lengths: expected a 1-D array-like .* got set"),
    Row("lengths-dict", _pack({0: 3}), T, r"^lengths: expected a 1-D array-like .* got dict"),
    Row("lengths-generator-of-str", _pack(iter("ab")), T, r"^lengths: expected integers"),
    Row("lengths-none-element", _pack([1, None]), T, r"^lengths: element 1 is NoneType None"),
    Row("lengths-huge", _pack([2**70]), E, r"^lengths: .*int64"),
    Row("lengths-token-lists", _pack([[1, 2], [3]]), E,
        r"^lengths: rows of different lengths; this looks like token lists; pass the lengths "
        r"\(e\.g\. \[len\(x\) for x in rows\]\)"),
    Row("lengths-token-arrays", _pack([np.array([1, 2]), np.array([3])]), E,
        r"^lengths: rows of different lengths; this looks like token lists"),
    Row("lengths-token-lists-one-width", _pack([[1, 2], [3, 4]]), E,
        r"^lengths: expected a 1-D array, got shape \(2, 2\); this looks like token lists"),
    Row("lengths-token-lists-object-array", _pack(np.array([[1], [2, 3]], dtype=object)), E,
        r"^lengths: element 0 is a list of values; this looks like token lists"),
    Row("lengths-none", _pack(None), T, r"^lengths: expected a 1-D array-like .* got NoneType"),
    Row("lengths-masked-array", _pack(np.ma.array([3, 5], mask=[0, 1])), T,
        r"^lengths: got a masked array, whose masked entries would be read as lengths"),
    Row("lengths-float16", _pack(np.array([3, 5], np.float16)), T,
        r"^lengths: expected integers, got dtype float16, which cannot hold every length"),
    Row("lengths-overlong", _pack([3, 9, 4, 12]), E,
        r"^lengths: 2 sequence\(s\) longer than 8 tokens \(first at index 1, length 9\); pass "
        r"overlong=\"truncate\", \"split\" or \"drop\""),
    Row("lengths-overlong-reserve", _pack([3, 7], reserve=2), E,
        r"1 sequence\(s\) longer than 8 tokens with 2 reserved separator token\(s\) each"),
    Row("lengths-wrapped-too-many-packs", _pack([10**15], 4096, strategy="wrapped"), E,
        r"^lengths: strategy \"wrapped\" would cut 1000000000000000 tokens into 244140625000 "
        r"packs of 4096 tokens; at most 4294967294"),
    Row("lengths-split-too-many-segments", _pack([10**15], 4096, overlong="split"), E,
        r"^lengths: the plan would hold 244140625000 segments; at most 4294967294"),
    Row("max_len-zero", _pack(max_len=0), E, r"^max_len: got 0; expected an integer in 1\.\.=16777216"),
    Row("max_len-negative", _pack(max_len=-3), E, r"^max_len: got -3; expected"),
    Row("max_len-huge", _pack(max_len=2**30), E, r"^max_len: got 1073741824; expected .*16777216"),
    Row("max_len-float", _pack(max_len=8.0), T, r"^max_len: expected an integer, got float 8\.0"),
    Row("max_len-bool", _pack(max_len=True), T, r"^max_len: expected an integer, got bool"),
    Row("max_len-str", _pack(max_len="8"), T, r"^max_len: expected an integer, got str '8'"),
    Row("strategy-unknown", _pack(strategy="best"), E,
        r"^strategy: unknown value 'best'; expected one of 'bfd', 'ffd', 'next_fit', 'wrapped'"),
    Row("strategy-not-str", _pack(strategy=1), T, r"^strategy: expected one of 'bfd', .* got int"),
    Row("overlong-unknown", _pack(overlong="cut"), E,
        r"^overlong: unknown value 'cut'; expected one of 'error', 'truncate', 'split', 'drop'"),
    Row("reserve-too-big", _pack(reserve=8), E,
        r"^reserve: got 8; expected an integer in 0\.\.=7: fewer tokens than max_len \(8\)"),
    Row("reserve-negative", _pack(reserve=-1), E, r"^reserve: got -1"),
    Row("threads-zero", _pack(threads=0), E, r"^threads: got 0; expected an integer in 1\.\.=4096"),
    Row("threads-float", _pack(threads=1.5), T, r"^threads: expected an integer, got float"),
    Row("seed-negative", _pack(seed=-1), E, r"^seed: got -1; expected an integer in 0\.\.="),
    Row("seed-huge", _pack(seed=2**64), E, r"^seed: got 18446744073709551616"),
    Row("shuffle-str", _pack(shuffle="yes"), T, r"^shuffle: expected a bool, got str 'yes'"),
    Row("long_max_len-not-above", _pack([1, 2], 100, long_max_len=100), E,
        r"^long_max_len: got 100; expected an integer in 101\.\.=16777216, above max_len \(100\)"),
    Row("long_max_len-below", _pack([1, 2], 100, long_max_len=50), E, r"^long_max_len: got 50"),
    Row("long_max_len-huge", _pack([1, 2], 100, long_max_len=1 << 25), E,
        r"^long_max_len: got 33554432"),
    Row("long_max_len-float", _pack([1, 2], 100, long_max_len=200.0), T,
        r"^long_max_len: expected an integer"),
    Row("long_max_len-wrapped", _pack([1, 2], 100, long_max_len=200, strategy="wrapped"), E,
        r"^long_max_len: strategy \"wrapped\" cuts every sequence at max_len"),
    Row("long-overlong-index", _pack([1, 9, 2, 17, 3], 8, long_max_len=16), E,
        r"^lengths: 1 sequence\(s\) longer than 16 tokens \(first at index 3, length 17\)"),
    Row("group_tokens-below-cap", _pack([1, 2], 100, group_tokens=99), E,
        r"^group_tokens: got 99; expected an integer in 100\.\.=2147483647: at least max_len"),
    Row("group_tokens-below-long-cap", _pack([1, 2], 100, group_tokens=150, long_max_len=200),
        E, r"^group_tokens: got 150; .*at least long_max_len \(200\)"),
    Row("group_tokens-huge", _pack([1, 2], 100, group_tokens=2**31), E,
        r"^group_tokens: got 2147483648"),
    Row("group_tokens-str", _pack([1, 2], 100, group_tokens="4096"), T,
        r"^group_tokens: expected an integer, got str"),
    # The options object (fastpack.PackOptions) and the keywords that stand for it.
    Row("option-misspelt", _pack(stratgy="ffd"), T,
        r"^stratgy: not an option of pack\(\); did you mean 'strategy'\? it takes lengths, "
        r"max_len, options, threads, affinity, strategy"),
    Row("max_len-missing", lambda: fastpack.pack([3, 5]), T,
        r"^max_len: missing \(the tokens per pack\); pass it, or options="),
    Row("options-not-PackOptions", lambda: fastpack.pack([3, 5], options={"max_len": 8}), T,
        r"^options: expected a fastpack\.PackOptions, got dict"),
    Row("options-and-keyword-disagree",
        lambda: fastpack.pack([3, 5], options=fastpack.PackOptions(8, strategy="ffd"),
                              strategy="bfd"), E,
        r"^strategy: got strategy='bfd' and options with strategy='ffd'; pass it once"),
    Row("PackOptions-reserve", lambda: fastpack.PackOptions(8, reserve=8), E,
        r"^reserve: got 8; expected an integer in 0\.\.=7: fewer tokens than max_len \(8\)"),
    Row("PackOptions-replace-misspelt", lambda: fastpack.PackOptions(8).replace(sede=1), T,
        r"^sede: not an option of PackOptions\(\); did you mean 'seed'\?"),
    Row("stream-group_tokens", lambda: fastpack.StreamPacker(8, group_tokens=16), E,
        r"^group_tokens: got 16; groups of packs need the whole plan, and a stream is packed "
        r"a window at a time"),
]

def _plan_of(**change: Any) -> Callable[[], Any]:
    """A Plan built from the arrays of a 3-pack, 4-segment plan with ``change``: as Python
    code or a user assembles one."""
    def build() -> Any:
        plan = fastpack.pack([3, 2, 5], 4, overlong="split", shuffle=False)
        fields = {name: getattr(plan, name) for name in fastpack.Plan._FIELDS}
        return fastpack.Plan({**fields, **change})
    return build


def _unchecked_plan_layout() -> Any:
    """The layout of a plan whose ``pack_offsets`` nobody checked (changed after it was
    built): the layout checks what it reads."""
    plan = fastpack.pack([3, 2, 5], 4, overlong="split", shuffle=False)
    fields = {name: getattr(plan, name) for name in fastpack.Plan._FIELDS}
    fields["pack_offsets"] = np.array([0, 3, 1, 4])
    return fastpack.Plan._from_core(fields).cu_seqlens([1])


PLAN = [
    Row("plan-pack_offsets-decreasing", _plan_of(pack_offsets=np.array([0, 3, 1, 4])), E,
        r"^pack_offsets: decreases at index 2: 3 then 1; expected non-decreasing offsets"),
    Row("plan-pack_offsets-start", _plan_of(pack_offsets=np.array([1, 3, 4])), E,
        r"^pack_offsets: starts at 1; expected 0"),
    Row("plan-pack_offsets-end", _plan_of(pack_offsets=np.array([0, 1, 3])), E,
        r"^pack_offsets: ends at 3 \(index 2\); expected the number of segments, 4"),
    Row("plan-pack_offsets-float", _plan_of(pack_offsets=np.array([0.0, 1, 3, 4])), T,
        r"^pack_offsets: expected integers, got dtype float64"),
    Row("plan-starts-length", _plan_of(starts=np.zeros(2, np.int64)), E,
        r"^starts: has 2 entries; seqlens has 4 \(one per segment\)"),
    Row("plan-fields-none", lambda: fastpack.Plan(None), T,  # type: ignore[arg-type]
        r"^fields: expected a dict of the plan's arrays and counts, got NoneType"),
    Row("plan-fields-missing", lambda: fastpack.Plan({"seqlens": np.array([3], np.int32)}), E,
        r"^fields: missing 'sample_ids', 'starts', 'pack_offsets', 'max_len', .*; a plan needs"),
    Row("plan-max_len-negative", _plan_of(max_len=-1), E,
        r"^max_len: got -1; expected an integer >= 1"),
    Row("plan-pack_offsets-unchecked-layout", _unchecked_plan_layout, E,
        r"^pack_offsets: entries 1 and 2 are 3 and 1: not a range of the 4 segments"),
    Row("packs-out-of-range", lambda: _plan().cu_seqlens(5), E,
        r"^packs: pack 5 out of range; the plan has 1 packs"),
    Row("packs-negative-index", lambda: _plan().cu_seqlens(np.array([-1])), E,
        r"^packs: pack index -1 out of range; the plan has 1 packs"),
    Row("packs-bool", lambda: _plan().cu_seqlens(True), T, r"^packs: expected an int"),
    Row("packs-float", lambda: _plan().varlen(np.array([0.5])), T,
        r"^packs: expected an int, slice, range or 1-D array of ints"),
    Row("segments-out-of-range", lambda: _plan().segments(3), E, r"^packs: pack 3 out of range"),
    Row("varlen-threads", lambda: _plan().varlen([0], threads=0), E, r"^threads: got 0"),
    Row("varlen-threads-negative", lambda: _plan().varlen([0], threads=-1), E,
        r"^threads: got -1"),
    Row("group-without-groups", lambda: _plan().group_packs(0), E,
        r"^group: the plan has no groups; pass group_tokens= to pack\(\)"),
    Row("group-out-of-range", lambda: fastpack.pack([5, 5, 5], 10, group_tokens=10).group_packs(2),
        E, r"^group: got 2; expected an integer in -2\.\.=1"),
    Row("group-float", lambda: fastpack.pack([5, 5], 10, group_tokens=10).group_packs(0.5), T,
        r"^group: expected an integer, got float"),
]


def _mat(tokens: Any = ([1, 2, 3], [4, 5]), plan: Any = None, **kwargs: Any) -> Callable[[], Any]:
    return lambda: fastpack.materialize(_plan() if plan is None else plan, list(tokens), **kwargs)


MATERIALIZE = [
    Row("plan-not-a-plan", lambda: fastpack.materialize({"sample_ids": []}, [[1]]), T,
        r"^plan: expected a fastpack\.Plan, got dict"),
    Row("tokens-int", lambda: fastpack.materialize(_plan(), 5), T,
        r"^tokens: expected Ragged, \(values, offsets\), a pyarrow list array"),
    Row("tokens-rows-of-str", _mat(["abc", "de"]), T, r"^tokens: row 0 is str; expected"),
    Row("tokens-rows-of-floats", _mat([[1.5, 2.0, 3.0], [4.0, 5.0]]), T,
        r"^tokens: values: expected integers, got dtype float64"),
    Row("tokens-offsets-not-monotone",
        lambda: fastpack.materialize(_plan(), (np.arange(5), np.array([0, 3, 2, 5]))), E,
        r"column 'tokens': row 1 has offsets 3, 2: not monotone"),
    Row("tokens-offsets-past-end",
        lambda: fastpack.materialize(_plan(), (np.arange(5), np.array([0, 3, 9]))), E,
        r"column 'tokens': row 1 ends at value 9, past the end of its chunk's 5 values"),
    Row("tokens-offsets-empty", lambda: fastpack.materialize(_plan(), (np.arange(5), [])), E,
        r"^offsets: expected at least one entry"),
    Row("tokens-values-2d",
        lambda: fastpack.materialize(_plan(), (np.zeros((2, 3), np.int64), [0, 3, 5])), E,
        r"^values: expected a 1-D array, got shape \(2, 3\)"),
    Row("tokens-too-few-rows",
        lambda: fastpack.materialize(_plan(), (np.array([1, 2, 3]), np.array([0, 3]))), E,
        r"token data has 1 sequences"),
    Row("tokens-row-shorter-than-plan",
        lambda: fastpack.materialize(_plan(), (np.arange(1, 7), np.array([0, 4, 6]))), E,
        r"whole sequence"),
    Row("labels-row-length", _mat(labels=[[1, 2, 3], [4]]), E,
        r"column 'labels': row 1 has 1 values, but 'tokens' has 2"),
    Row("labels-column-without-dataset", _mat(labels="labels"), T,
        r"^labels: got the column name 'labels', which needs a datasets\.Dataset"),
    Row("loss_mask-strings", _mat(loss_mask=[["a", "b", "c"], ["d", "e"]]), T,
        r"^loss_mask: "),
    Row("layout-unknown", _mat(layout="cols"), E,
        r"^layout: unknown value 'cols'; expected one of 'flat', 'rows'"),
    Row("pad_to-too-small", _mat(pad_to=3), E, r"more than the row width"),
    Row("pad_to-negative", _mat(pad_to=-1), E, r"^pad_to: got -1"),
    Row("pad_to-float", _mat(pad_to=8.5), T, r"^pad_to: expected an integer, got float"),
    Row("pad_to_multiple_of-zero", _mat(pad_to_multiple_of=0), E,
        r"^pad_to_multiple_of: got 0; expected an integer in 1\.\."),
    Row("pad_id-float", _mat(pad_id=0.5), T, r"^pad_id: expected an integer, got float"),
    Row("separator_id-missing", _mat(plan=fastpack.pack([3, 2], 8, reserve=1)), E,
        r"separator_id"),
    Row("separator_id-str", _mat(plan=fastpack.pack([3, 2], 8, reserve=1), separator_id="eos"),
        T, r"^separator_id: expected an integer, got str"),
    Row("train_separators-str", _mat(train_separators="yes"), T,
        r"^train_separators: expected a bool, got str"),
    Row("materialize-packs-out-of-range", _mat(packs=[5]), E, r"out of range"),
    Row("materialize-threads-zero", _mat(threads=0), E, r"^threads: got 0"),
]

RAGGED = [
    Row("ragged-float-values", lambda: fastpack.Ragged(np.array([1.5]), [0, 1]), T,
        r"^values: expected integers, got dtype float64"),
    Row("ragged-mask-strings", lambda: fastpack.Ragged(np.array(["a"]), [0, 1], mask=True), T,
        r"^loss_mask: expected 0/1 values, got dtype <U1"),
    Row("ragged-offsets-negative-start", lambda: fastpack.Ragged(np.arange(3), [-1, 2]), E,
        r"^offsets: starts at -1; expected >= 0"),
    Row("as_ragged-int", lambda: fastpack.as_ragged(5), T, r"^data: expected Ragged"),
    Row("as_ragged-dict", lambda: fastpack.as_ragged({"input_ids": [[1]]}), T,
        r"^data: expected Ragged, .* got dict"),
    Row("as_ragged-column-not-str", lambda: fastpack.as_ragged([[1]], column=1), T,
        r"^column: expected a string, got int"),
    Row("spans-row-count", lambda: fastpack.loss_mask_from_spans([4, 2], [[(0, 1)]]), E,
        r"^spans: got 1 rows for 2 lengths"),
    Row("spans-reversed", lambda: fastpack.loss_mask_from_spans([4], [[(3, 1)]]), E,
        r"^spans: row 0 has the span \(3, 1\); expected \(start, end\) pairs with 0 <= start"),
    Row("spans-negative", lambda: fastpack.loss_mask_from_spans([4, 2], [[], [(-1, 1)]]), E,
        r"^spans: row 1 has the span \(-1, 1\)"),
    Row("spans-not-pairs", lambda: fastpack.loss_mask_from_spans([4], [[(0, 1, 2)]]), E,
        r"^spans: expected \(start, end\) pairs"),
    Row("spans-not-a-list", lambda: fastpack.loss_mask_from_spans([4], 5), T,
        r"^spans: expected a sequence of per-row lists"),
    Row("spans-lengths-negative", lambda: fastpack.loss_mask_from_spans([-4], [[]]), E,
        r"^lengths: negative length -4 at index 0"),
    Row("spans-lengths-str", lambda: fastpack.loss_mask_from_spans("ab", [[]]), T,
        r"^lengths: expected a 1-D array-like"),
    Row("example-unknown", lambda: fastpack.example_lengths("wiki"), E,
        r"^name: unknown example 'wiki'; expected one of 'functions', 'modules'"),
    Row("example-not-str", lambda: fastpack.example_lengths(1), T,
        r"^name: expected a string, got int"),
    Row("demo-max-len-zero", lambda: demo(["--max-len", "0"]), SystemExit, r"^2$"),
    Row("demo-max-len-text", lambda: demo(["--max-len", "big"]), SystemExit, r"^2$"),
    Row("demo-example-unknown", lambda: demo(["--example", "wiki"]), SystemExit, r"^2$"),
]


LIMITS = [
    Row("limits-not-dict", _pack(limits=[(1, 2)]), T, r"^limits: expected a dict \{name: cap\}, "
        r"e\.g\. \{'patches': 16384, 'images': 8\} \(pack\(\) also takes \{name: \(values, "
        r"cap\)\}\), got list"),
    Row("limits-tokens-name", _pack(limits={"tokens": ([1, 1], 2)}), E,
        r"^limits: budget name 'tokens'; expected distinct non-empty strings other than "
        r"'tokens'"),
    Row("limits-spec", _pack(limits={"images": ([1, 1], 2), "patches": 3}), T,
        r"^limits\['patches'\]: expected \(values, cap\)"),
    Row("limits-cap-zero", _pack(limits={"images": ([1, 1], 0)}), E,
        r"^limits\['images'\]: got 0; expected an integer in 1\.\.=4294967294 \(the most a "
        r"pack holds\)"),
    Row("limits-no-values", _pack(limits={"images": 2}), E,
        r"^limits: \{'images': 2\} has no values per sequence; pass limits=\{name: \(values, "
        r"cap\)\} to pack\(\)"),
    Row("limits-length", _pack(limits={"images": ([1], 2)}), E,
        r"^limits: limits\[\"images\"\]: 1 values for 2 sequences; expected one per sequence"),
    Row("limits-negative", _pack(limits={"images": ([1, -1], 2)}), E,
        r"^limits: limits\[\"images\"\]: negative value -1 at index 1"),
    Row("limits-over-cap", _pack(limits={"images": ([1, 3], 2)}), E,
        r"^limits: 1 sequence\(s\) over the \"images\" budget or another \(first at index 1: "
        r"3 images over the cap of 2\); pass overlong=\"drop\""),
    Row("limits-next-fit", _pack(strategy="next_fit", limits={"images": ([1, 1], 2)}), E,
        r"^limits: strategy 'next_fit' keeps input order or cuts sequences; budgets besides "
        r"tokens take 'bfd' or 'ffd'"),
    Row("limits-split", _pack(overlong="split", limits={"images": ([1, 1], 2)}), E,
        r"^limits: overlong='split' would cut a sequence, and the media it holds with it"),
    Row("limits-too-many", _pack(limits={str(i): ([0, 0], 1) for i in range(5)}), E,
        r"^limits: got 5 budgets; at most 4 besides tokens"),
    Row("limits-with-cp", _pack(cp_size=2, limits={"images": ([1, 1], 2)}), E,
        r"^limits: budgets besides tokens are not planned together with cp_size=2"),
    Row("limits-with-share-prefix", lambda: fastpack.pack_trees([[1, 2], [1, 3]], 8,
                                                                limits={"images": 2}), E,
        r"^limits: budgets besides tokens are not planned together with share_prefix=True"),
    Row("limits-stream", lambda: fastpack.StreamPacker(8, limits={"images": 2}), E,
        r"^limits: got \{'images': 2\}; a stream's windows are packed on tokens only"),
]


def _vlm_rows() -> list[Row]:
    try:
        import torch
        import transformers
    except ImportError:
        return []
    import fastpack.vlm as vlm
    from fastpack.torch import PackedCollator, shard_for_context_parallel

    qwen = transformers.Qwen2VLConfig(image_token_id=60, video_token_id=61,
                                      vision_config={"spatial_merge_size": 2, "patch_size": 2})
    llava = transformers.LlavaConfig(image_token_id=60, image_seq_length=4)
    image = {"input_ids": [1, 60, 60, 60, 60, 2], "image_grid_thw": torch.tensor([[1, 4, 4]]),
             "pixel_values": torch.zeros(16, 24)}

    def collate(*features: Any, config: Any = qwen, **kwargs: Any) -> Callable[[], Any]:
        return lambda: PackedCollator(**{"max_len": 32, "model_config": config, **kwargs})(
            list(features))

    def without(key: str, **change: Any) -> dict[str, Any]:
        return {k: v for k, v in {**image, **change}.items() if k != key}

    vlm_flash = PackedCollator(32, backend="flash", model_config=qwen)([image])

    return [
        Row("vlm-unknown-family", lambda: PackedCollator(8, model_config=transformers.LlamaConfig()),
            E, r"^config: model_type 'llama' is not a vision-language family fastpack packs; "
            r"expected one of 'qwen2_vl'"),
        Row("vlm-config-type", lambda: vlm.rope_index("qwen2_vl", [1, 2]), T,
            r"^config: expected a Hugging Face model config \(model\.config\) or its dict, got "
            r"str"),
        Row("vlm-rope-plain-family", lambda: vlm.rope_index(llava, [1, 2]), E,
            r"^config: llava takes plain positions, not mRoPE"),
        Row("vlm-rope-placeholders", lambda: vlm.rope_index(qwen, [1, 60, 60, 60, 2],
                                                            image_grid_thw=[[1, 4, 4]]), E,
            r"^input_ids: image 0 has 3 placeholder token\(s\) from token 1, but its grid needs "
            r"4 \(t·h·w / merge²\)"),
        Row("vlm-rope-grids-left", lambda: vlm.rope_index(qwen, [1, 2], image_grid_thw=[[1, 4, 4]]),
            E, r"^image_grid_thw: 1 image grid\(s\) given, but the placeholders use 0"),
        Row("vlm-rope-grid-shape", lambda: vlm.rope_index(qwen, [1, 2], image_grid_thw=[1, 4, 4]),
            E, r"^image_grid_thw: expected integers of shape \(n, 3\)"),
        Row("vlm-rope-grid-merge", lambda: vlm.rope_index(qwen, [1] + [60] * 3,
                                                          image_grid_thw=[[1, 3, 4]]), E,
            r"^image_grid_thw: grid 0 is \(1, 3, 4\): h and w must be multiples of "
            r"vision_config\.spatial_merge_size \(2\)"),
        Row("vlm-rope-no-grid", lambda: vlm.rope_index(qwen, [1, 60, 60, 60, 60]), E,
            r"^image_grid_thw: a image placeholder at token 1 has no grid left"),
        Row("vlm-media-tokens-config", lambda: vlm.media_tokens([4], [4], {"patch_size": 14}), E,
            r"^config: .* has no integer merge_size, min_pixels, max_pixels"),
        Row("vlm-media-tokens-aspect", lambda: vlm.media_tokens(
            [10], [2500], transformers.Qwen2VLImageProcessor()), E,
            r"^heights: item 0: a 10x2500 image has an aspect ratio over 200"),
        Row("vlm-media-tokens-frames", lambda: vlm.media_tokens(
            [448], [448], {"video_processor_type": "Qwen3VLVideoProcessor", "patch_size": 16,
                           "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 4096,
                           "max_pixels": 10**6}, frames=[1]), E,
            r"^frames: item 0: got 1 frames; expected 2\.\.=4096 \(at least temporal_patch_size\)"),
        Row("vlm-media-without-config", lambda: PackedCollator(32)([image]), E,
            r"^features: sample 0 has the media key 'image_grid_thw', but the "
            r"collator has no model_config"),
        Row("vlm-grids-without-pixels", collate(without("pixel_values")), E,
            r"^features: sample 0 'image_grid_thw': image grids without pixel_values"),
        Row("vlm-pixels-without-grids", collate(without("image_grid_thw")), E,
            r"^features: sample 0 'pixel_values': image pixel values without image_grid_thw"),
        Row("vlm-placeholders-vs-grids", collate({"input_ids": [3]}, dict(
            image, input_ids=[1, 60, 60, 60, 2])), E,
            r"^features: sample 1 'image_grid_thw': its grids need 4 image placeholder token\(s\) "
            r"\(t\*h\*w / 4\), the sample's input_ids hold 3"),
        Row("vlm-pixels-vs-grids", collate(dict(image, pixel_values=torch.zeros(12, 24))), E,
            r"^features: sample 0 'pixel_values': 12 rows, but its grids hold 16 patches"),
        Row("vlm-placeholders-no-grids", collate({"input_ids": [1, 60, 60]}), E,
            r"^features: sample 0 'image_grid_thw': missing, but the sample has 2 image "
            r"placeholder token\(s\)"),
        Row("vlm-seconds-wrong-family", collate(dict(image, second_per_grid_ts=[1.0])), E,
            r"^features: sample 0 'second_per_grid_ts': applies to qwen2_5_vl, not qwen2_vl"),
        Row("vlm-sizes-on-qwen", collate(dict(image, image_sizes=torch.tensor([[8, 8]]))), E,
            r"^features: sample 0 'image_sizes': qwen2_vl reads image_grid_thw, not image_sizes"),
        Row("vlm-video-on-llava", collate({"input_ids": [1, 2], "video_grid_thw": [[1, 2, 2]],
                                           "pixel_values_videos": torch.zeros(4, 3)},
                                          config=llava), E,
            r"^features: sample 0 'pixel_values_videos': llava takes images as pixel_values \(and "
            r"image_sizes\), not pixel_values_videos"),
        Row("vlm-llava-placeholders", collate({"input_ids": [1, 60, 60, 60],
                                               "pixel_values": torch.zeros(1, 3, 8, 8)},
                                              config=llava), E,
            r"^features: sample 0 'pixel_values': 1 image\(s\) need 4 placeholder tokens \(4 "
            r"each\), the sample's input_ids hold 3"),
        Row("vlm-overlong-split", lambda: PackedCollator(8, model_config=qwen, overlong="split"),
            E, r"^overlong: 'split' would cut a sample's image placeholders from its pixels"),
        Row("vlm-pad-is-placeholder", lambda: PackedCollator(8, model_config=qwen, pad_id=60), E,
            r"^pad_id: 60 is the model's image or video placeholder token"),
        Row("vlm-limits-without-config", lambda: PackedCollator(8, limits={"images": 2}), E,
            r"^limits: \{'images': 2\} are counted from each sample's media; pass "
            r"model_config=model\.config"),
        Row("vlm-limits-padded", lambda: PackedCollator(8, backend="padded", model_config=qwen,
                                                        limits={"images": 2}), E,
            r"^limits: strategy 'one_per_pack' puts every sequence in a pack of its own \(the "
            r"padded backend's\)"),
        Row("vlm-limits-unknown-budget", collate(image, limits={"frames": 2}), E,
            r"^limits: 'frames' is not counted from a sample's media; the budgets are "
            r"'patches', 'images', 'videos'"),
        Row("vlm-limits-plain-patches", collate({"input_ids": [1, 60, 60, 60, 60],
                                                 "pixel_values": torch.zeros(1, 3, 8, 8)},
                                                config=llava, limits={"patches": 8}), E,
            r"^limits: a model with plain positions has no grids to count patches or videos "
            r"from; its budget is 'images'"),
        Row("vlm-plan-without-media", lambda: PackedCollator(
            8, model_config=qwen, limits={"images": 2}).plan([3, 4]), E,
            r"^media: limits \{'images': 2\} are counted from each sample's media; pass media="),
        Row("vlm-collator-share-prefix", lambda: PackedCollator(
            32, backend="flash", model_config=qwen, share_prefix=True), E,
            r"^share_prefix: True with model_config \(qwen2_vl\): a tree batch carries no "
            r"media and no mRoPE positions"),
        Row("vlm-collator-cp", lambda: PackedCollator(32, backend="flash", model_config=qwen,
                                                      cp_size=2), E,
            r"^cp_size: 2 with model_config \(qwen2_vl\): vision-language batches are not "
            r"sharded for context parallelism .*; pass one of model_config and cp_size"),
        Row("vlm-shard-mrope-positions", lambda: shard_for_context_parallel(vlm_flash, 2, 0), E,
            r"^position_ids: shape \(4, 1, 6\) holds mRoPE rows \(a vision-language batch of "
            r"PackedCollator\(model_config=\.\.\.\)\); shard_for_context_parallel\(cp_size=2\) "
            r"takes a text batch's positions \[1, T\]"),
        Row("vlm-shard-media", lambda: shard_for_context_parallel(
            {k: v for k, v in vlm_flash.items() if k != "position_ids"}, 2, 0), E,
            r"^batch: 'pixel_values' is media of a vision-language batch; "
            r"shard_for_context_parallel\(cp_size=2\) would split its placeholder tokens"),
        Row("vlm-dataset-without-media", lambda: fastpack.torch.PackedDataset(
            [[1, 2], [3]], PackedCollator(8, model_config=qwen)), E,
            r"^media: the collator has a model_config; pass each sample's media"),
    ]


def _datasets_rows() -> list[Row]:
    try:
        import datasets
        import pyarrow as pa
    except ImportError:
        return []
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]]})
    return [
        Row("dataset-missing-column", lambda: fastpack.as_ragged(ds, column="text"), E,
            r"^data: no column 'text' in the dataset; it has 'input_ids'"),
        Row("dataset-labels-column-missing",
            lambda: fastpack.materialize(_plan(), ds, labels="labels"), E,
            r"^labels: no column 'labels' in the dataset; it has 'input_ids'"),
        Row("arrow-not-a-list", lambda: fastpack.as_ragged(pa.array([1, 2])), T,
            r"^data: expected a pyarrow list array \(list<int>\), got Int64Array of int64"),
        Row("arrow-nulls", lambda: fastpack.materialize(_plan(), pa.array([[1, None, 3], [4, 5]])),
            E, r"column 'tokens': row 0 holds a null value"),
    ]


def _torch_rows() -> list[Row]:
    try:
        import torch
    except ImportError:
        return []
    from fastpack.torch import BatchFormat, PackedCollator, PackedDataset, first_item
    from fastpack.torch import varlen_attention as attend

    def collate(*features: Any, **kwargs: Any) -> Callable[[], Any]:
        return lambda: PackedCollator(**{"max_len": 8, **kwargs})(list(features))

    def collator(**kwargs: Any) -> Callable[[], Any]:
        return lambda: PackedCollator(**{"max_len": 8, **kwargs})

    sample = {"input_ids": [1, 2, 3]}
    tokens = [[1, 2, 3], [4, 5]]

    def dataset(**kwargs: Any) -> Callable[[], Any]:
        return lambda: PackedDataset(tokens, **{"collator": PackedCollator(max_len=8), **kwargs})

    lengths = [3, 0, 5]
    total = sum(lengths)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(total, 4, 16, generator=gen)
    kv = torch.randn(total, 2, 16, generator=gen)
    cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32)

    def attn(**change: Any) -> Callable[[], Any]:
        args = {"q": q, "k": kv, "v": kv, "cu_seqlens": cu, "max_seqlen": 5, **change}
        kwargs = {k: args.pop(k) for k in list(args) if k not in ("q", "k", "v", "cu_seqlens",
                                                                   "max_seqlen")}
        return lambda: attend(args["q"], args["k"], args["v"], args["cu_seqlens"],
                              args["max_seqlen"], **kwargs)

    def hf_call(batch_rows: int = 1, dropout: float = 0.0) -> Callable[[], Any]:
        def run() -> Any:
            import transformers

            from fastpack.torch import register_hf_attention

            name = register_hf_attention()
            forward = transformers.AttentionInterface()[name]
            module = torch.nn.Linear(1, 1)
            module.train(dropout > 0)
            query = torch.randn(batch_rows, 4, 8, 16)
            key = torch.randn(batch_rows, 4, 8, 16)
            return forward(module, query, key, key, None, dropout=dropout,
                           cu_seq_lens_q=torch.tensor([0, 3, 8], dtype=torch.int32),
                           max_length_q=5)
        return run

    from fastpack.torch import packed_loss

    loss_batch = PackedCollator(max_len=8)([sample])
    loss_logits = torch.zeros(1, 3, 5)

    def loss(**kwargs: Any) -> Callable[[], Any]:
        return lambda: packed_loss(loss_logits, loss_batch, **kwargs)

    return [
        # fastpack.pack with tensors of lengths.
        Row("lengths-bfloat16-tensor", _pack(torch.tensor([3.0, 5.0], dtype=torch.bfloat16)), T,
            r"^lengths: expected integers, got a torch\.bfloat16 tensor, which cannot hold every "
            r"length exactly; keep the lengths in an integer tensor"),
        Row("lengths-meta-tensor", _pack(torch.tensor([3, 5], device="meta")), E,
            r"^lengths: got a tensor on the 'meta' device, which holds no values"),
        # packed_loss's normalisers: integer counts, whatever their container.
        Row("loss-num_items-numpy-float", loss(num_items_in_batch=np.float64(5.0)), T,
            r"^num_items_in_batch: expected an integer count .* got float64 5\.0"),
        Row("loss-num_items-numpy-float-array", loss(num_items_in_batch=np.array(5.0)), T,
            r"^num_items_in_batch: expected an integer count .* got a numpy array of dtype float64"),
        Row("loss-num_items-float", loss(num_items_in_batch=5.0), T,
            r"^num_items_in_batch: expected an integer count .* got float 5\.0"),
        Row("loss-batch-none", lambda: packed_loss(loss_logits, None), T,  # type: ignore[arg-type]
            r"^batch: expected the batch as a dict \(a Mapping with 'labels'\), got NoneType"),
        Row("loss-labels-float", lambda: packed_loss(loss_logits, {"labels": torch.zeros(1, 3)}),
            T, r"^labels: expected integer token ids, got dtype torch\.float32"),
        Row("loss-labels-past-vocab",
            lambda: packed_loss(loss_logits, {"labels": torch.tensor([[-100, 2, 9]])}), E,
            r"^labels: token id 9 is outside the vocabulary 0\.\.4 \(logits\.shape\[-1\] = 5\)"),
        Row("loss-ignore_index-str", loss(ignore_index="pad"), T,
            r"^ignore_index: expected an int, got str 'pad'"),
        # PackedCollator: every option is checked where the collator is built.
        Row("collator-max_len", collator(max_len=0), E, r"^max_len: got 0; expected an integer"),
        Row("collator-max_len-str", collator(max_len="8"), T, r"^max_len: expected an integer"),
        Row("collator-backend", collator(backend="xformers"), E,
            r"^backend: unknown value 'xformers'; expected one of 'flash', 'sdpa', 'eager', "
            r"'flex', 'padded'"),
        Row("collator-mask", collator(mask="dense"), E,
            r"^mask: unknown value 'dense'; expected one of 'position_ids', 'explicit'"),
        Row("collator-mask-explicit-flash", collator(backend="flash", mask="explicit"), E,
            r"^mask: 'explicit' applies to backend 'sdpa', 'eager' or 'flex', not 'flash'"),
        Row("collator-pad_to_multiple_of", collator(pad_to_multiple_of=0), E,
            r"^pad_to_multiple_of: got 0"),
        Row("collator-pad_to_multiple_of-str", collator(pad_to_multiple_of="8"), T,
            r"^pad_to_multiple_of: expected an integer, got str"),
        Row("collator-pad_to", collator(pad_to=0), E, r"^pad_to: got 0; expected an integer"),
        Row("collator-pad_to-float", collator(pad_to=64.0), T, r"^pad_to: expected an integer"),
        Row("collator-fixed_cu_seqlens-sdpa", collator(fixed_cu_seqlens=16), E,
            r"^fixed_cu_seqlens: applies to backend='flash' only, not 'sdpa'"),
        Row("collator-fixed_cu_seqlens-one", collator(backend="flash", fixed_cu_seqlens=1), E,
            r"^fixed_cu_seqlens: got 1; expected an integer in 2\.\."),
        Row("collator-return_tensors", collator(return_tensors="tf"), E,
            r"^return_tensors: unknown value 'tf'; expected one of 'pt', 'np'"),
        Row("collator-separator_id", collator(separator_id="eos"), T,
            r"^separator_id: expected an integer, got str"),
        Row("collator-train_separators", collator(train_separators=1), T,
            r"^train_separators: expected a bool, got int"),
        Row("collator-pad_id", collator(pad_id=None), T, r"^pad_id: expected an integer"),
        Row("collator-strategy", collator(strategy="best"), E, r"^strategy: unknown value"),
        Row("collator-overlong", collator(overlong="cut"), E, r"^overlong: unknown value"),
        Row("collator-padded-split", collator(backend="padded", overlong="split"), E,
            r"^overlong: 'split' does not apply to backend='padded'"),
        Row("collator-padded-strategy", collator(backend="padded", strategy="bfd"), E,
            r"^strategy: 'bfd' does not apply to backend='padded' \(one sample per row\); "
            r"leave it out, or pass 'one_per_pack'"),
        Row("dataset-padded-plan", lambda: PackedDataset(
            tokens, PackedCollator(max_len=8, backend="padded"),
            plan=fastpack.pack([3, 2], 8))[0], E,
            r"^plan: made with strategy 'bfd', but backend='padded' needs one sample per row"),
        Row("collator-loss_mask_key", collator(loss_mask_key=1), T,
            r"^loss_mask_key: expected a key \(str\), None .* or False \(no mask\), got int"),
        Row("collator-mask_dtype", collator(mask_dtype=torch.int32), T,
            r"^mask_dtype: expected a floating torch dtype"),
        Row("collator-return_seq_idx", collator(return_seq_idx="yes"), T,
            r"^return_seq_idx: expected a bool"),
        Row("collator-return_num_items", collator(return_num_items=None), T,
            r"^return_num_items: expected a bool"),
        Row("collator-threads", collator(threads=0), E, r"^threads: got 0"),
        Row("collator-plan-option", collator(group_tokens=64), E,
            r"^group_tokens: got 64; orders, buckets or groups the packs of a whole plan, not "
            r"of one batch; pass it to PackedDataset"),
        Row("collator-reserve-without-separator", collator(reserve=1), E,
            r"^reserve: got 1 reserved slots but no separator_id to write into them"),
        Row("format-backend", lambda: BatchFormat(backend="xformers"), E, r"^backend: unknown"),
        # PackedCollator.__call__: the batch itself.
        Row("batch-empty", collate(), E, r"^features: got an empty batch"),
        Row("batch-not-a-list", lambda: PackedCollator(max_len=8)(sample), T,
            r"^features: expected a list of samples \(dicts with 'input_ids'\), got dict"),
        Row("batch-not-dicts", collate([1, 2, 3]), T,
            r"^features: sample 0 is list; expected a dict with 'input_ids'"),
        Row("batch-no-input_ids", collate(sample, {"ids": [1]}), E,
            r"^features: sample 1 has no 'input_ids' \(1 of 2 samples lack it\)"),
        Row("batch-labels-on-some", collate({**sample, "labels": [1, 2, 3]}, {"input_ids": [4]}),
            E, r"^features: sample 1 has no 'labels'"),
        Row("batch-labels-only-later", collate(sample, {"input_ids": [4], "labels": [4]}), E,
            r"^features: sample 0 has no 'labels'"),
        Row("batch-mask-on-some", collate({**sample, "assistant_masks": [0, 1, 1]}, {
            "input_ids": [4]}), E, r"^features: sample 1 has no 'assistant_masks'"),
        Row("batch-loss_mask_key-absent", collate(sample, loss_mask_key="completion_mask"), E,
            r"^loss_mask_key: no sample has 'completion_mask'; its keys are \['input_ids'\]"),
        Row("batch-input_ids-str", collate({"input_ids": "abc"}), T,
            r"^input_ids: row 0 is str; expected a sequence of integers"),
        Row("batch-input_ids-floats", collate({"input_ids": np.array([1.5, 2.0])}), T,
            r"^input_ids: values: expected integers"),
        Row("batch-labels-length", collate({**sample, "labels": [1, 2]}), E,
            r"column 'labels': row 0 has 2 values, but 'input_ids' has 3"),
        Row("batch-overlong", collate({"input_ids": list(range(1, 12))}), E,
            r"^lengths: 1 sequence\(s\) longer than 8 tokens \(first at index 0, length 11\)"),
        # PackedDataset and first_item.
        Row("dataset-packs_per_batch", dataset(packs_per_batch=0), E,
            r"^packs_per_batch: got 0; expected an integer >= 1"),
        Row("dataset-labels-column", dataset(labels="labels"), T,
            r"^labels/loss_mask: a column name needs a datasets\.Dataset"),
        Row("dataset-shuffle", dataset(shuffle="yes"), T, r"^shuffle: expected a bool"),
        Row("dataset-seed", dataset(seed=-1), E, r"^seed: got -1"),
        Row("dataset-index", lambda: dataset()()[10], IndexError,
            r"^step 10 out of range; the dataset has 1 steps"),
        Row("dataset-collator-not-a-collator", dataset(collator="sdpa"), T, r"^collator: "),
        Row("dataset-plan-not-a-plan", dataset(plan=[0, 1]), T, r"^plan: "),
        Row("dataset-plan-of-other-data", dataset(plan=fastpack.pack([1, 2, 3], 8)), E,
            r"^plan: "),
        Row("dataset-strategy-not-the-collators", dataset(strategy="ffd"), E,
            r"^strategy: got 'ffd', but the collator plans with 'bfd'; set it once, on the "
            r"collator \(PackedCollator\(\.\.\., strategy='ffd'\)\), and leave it out here"),
        Row("dataset-plan-other-max_len", dataset(plan=fastpack.pack([3, 2], 16)), E,
            r"^max_len: got 8, but the given plan was made with 16; pass max_len=8 when "
            r"planning"),
        Row("dataset-plan-other-group_tokens",
            dataset(plan=fastpack.pack([3, 2], 8, group_tokens=16), group_tokens=32), E,
            r"^group_tokens: got 32, but the given plan was made with 16"),
        Row("first_item-two", lambda: first_item([1, 2]), E,
            r"^first_item: got 2 items; a PackedDataset item is a whole batch"),
        # varlen_attention.
        Row("attn-cu-not-zero", attn(cu_seqlens=torch.tensor([1, 3, 3, 8])), E,
            r"^cu_seqlens must start at 0, got 1"),
        Row("attn-cu-decreasing", attn(cu_seqlens=torch.tensor([0, 5, 3, 8])), E,
            r"^cu_seqlens must be non-decreasing, got cu_seqlens\[1\]=5 > cu_seqlens\[2\]=3"),
        Row("attn-cu-last-short", attn(cu_seqlens=torch.tensor([0, 3, 3, 7])), E,
            r"^cu_seqlens\[-1\] must equal total_tokens = q\.shape\[0\] = 8, got 7"),
        Row("attn-cu-last-long", attn(cu_seqlens=torch.tensor([0, 3, 3, 9])), E,
            r"cu_seqlens\[-1\].*8, got 9"),
        Row("attn-cu-2d", attn(cu_seqlens=torch.tensor([[0, 3, 3, 8]])), E,
            r"^cu_seqlens must be 1-D of shape \[N\+1\], got shape \(1, 4\)"),
        Row("attn-cu-empty", attn(cu_seqlens=torch.tensor([], dtype=torch.int32)), E,
            r"^cu_seqlens must have at least one element"),
        Row("attn-cu-float", attn(cu_seqlens=torch.tensor([0.0, 3.0, 3.0, 8.0])), E,
            r"^cu_seqlens must hold integers, got dtype torch\.float32"),
        Row("attn-cu-bool", attn(cu_seqlens=torch.tensor([False, True])), E,
            r"^cu_seqlens must hold integers"),
        Row("attn-cu-strings", attn(cu_seqlens=["a"]), E,
            r"^cu_seqlens must be a 1-D integer torch tensor, numpy array or sequence of ints"),
        Row("attn-max-too-small", attn(max_seqlen=4), E,
            r"^max_seqlen=4 is smaller than the longest sequence in cu_seqlens \(5\)"),
        Row("attn-max-negative", attn(max_seqlen=-1), E, r"^max_seqlen must be >= 0, got -1"),
        Row("attn-max-float", attn(max_seqlen=5.0), T, r"^max_seqlen must be an int, got float"),
        Row("attn-max-bool", attn(max_seqlen=True), T, r"^max_seqlen must be an int, got bool"),
        Row("attn-max-float-tensor", attn(max_seqlen=torch.tensor(5.0)), T,
            r"^max_seqlen must be an int \(or a one-element integer tensor\)"),
        Row("attn-q-not-tensor", attn(q=[[[0.0]]]), T, r"^q must be a torch\.Tensor, got list"),
        Row("attn-q-2d", attn(q=torch.randn(8, 64)), E,
            r"^q must have 3 dimensions \(total_tokens, heads, head_dim\), got shape \(8, 64\)"),
        Row("attn-k-4d", attn(k=torch.randn(1, 8, 2, 16)), E, r"^k must have 3 dimensions"),
        Row("attn-q-int", attn(q=torch.zeros(8, 4, 16, dtype=torch.int64)), E,
            r"^q must be a floating-point tensor, got torch\.int64"),
        Row("attn-heads", attn(k=torch.randn(8, 3, 16), v=torch.randn(8, 3, 16)), E,
            r"^the number of query heads must be a multiple of the number of key/value heads "
            r"\(q has 4 heads, k/v have 3\)"),
        Row("attn-dtype", attn(k=torch.randn(8, 2, 16, dtype=torch.float64)), E,
            r"^q, k and v must share a dtype"),
        Row("attn-kv-shape", attn(v=torch.randn(8, 2, 8)), E,
            r"^k and v must have the same shape, got \(8, 2, 16\) and \(8, 2, 8\)"),
        Row("attn-tokens", attn(k=torch.randn(7, 2, 16), v=torch.randn(7, 2, 16)), E,
            r"^q and k/v must have the same number of tokens \(dim 0\), got 8 and 7"),
        Row("attn-head-dim", attn(k=torch.randn(8, 2, 8), v=torch.randn(8, 2, 8)), E,
            r"^q and k/v must have the same head_dim \(dim 2\), got 16 and 8"),
        Row("attn-softmax_scale-zero", attn(softmax_scale=0.0), E,
            r"^softmax_scale must be a positive finite number, got 0\.0"),
        Row("attn-softmax_scale-str", attn(softmax_scale="big"), T,
            r"^softmax_scale must be a number or None, got str"),
        Row("attn-kernel-unknown", attn(kernel="xformers"), E,
            r"^kernel must be one of 'auto', 'flash', 'varlen', 'flex', 'sdpa'; got 'xformers'"),
        Row("attn-kernel-not-str", attn(kernel=None), T, r"^kernel must be a string, got NoneType"),
        Row("attn-kernel-unavailable", attn(kernel="flash"), E,
            r"^kernel='flash' is not available: it needs CUDA tensors, got device 'cpu'"),
        Row("attn-causal-str", attn(causal="yes"), T, r"^causal must be a bool, got str 'yes'"),
        Row("attn-validate-int", attn(validate=1), T, r"^validate must be a bool, got int 1"),
        # register_hf_attention and the implementation it registers.
        Row("hf-batch-of-two", hf_call(batch_rows=2), E,
            r"^fastpack_varlen: expected one packed row \(batch size 1\), got 2 rows; use "
            r"PackedCollator\(backend='flash'\)"),
        Row("hf-dropout", hf_call(dropout=0.1), E,
            r"^fastpack_varlen: attention dropout 0\.1 is not supported on packed batches"),
        Row("hf-name-not-str", lambda: fastpack.torch.register_hf_attention(5), T, r"^name: "),
    ]


def _cp(cu: Any = (0, 7, 18, 23), cp_size: Any = 2, **kwargs: Any) -> Callable[[], Any]:
    return lambda: fastpack.cp_layout(cu, cp_size, **kwargs)


CONTEXT_PARALLEL = [
    Row("cp-size-zero", _cp(cp_size=0), E, r"^cp_size: got 0; expected an integer in 1\.\.=65536"),
    Row("cp-size-str", _cp(cp_size="2"), T, r"^cp_size: expected an integer, got str '2'"),
    Row("cp-mode-unknown", _cp(mode="ring"), E,
        r"^mode: unknown value 'ring'; expected one of 'zigzag', 'contiguous', 'ulysses'"),
    Row("cp-pad-multiple-zero", _cp(pad_multiple=0), E, r"^pad_multiple: got 0; expected an "
        r"integer in 1\.\.="),
    Row("cp-pad-multiple-huge", _cp(pad_multiple=2**29), E,
        r"^pad_multiple: got 536870912; with cp_size=2 and mode='zigzag' lengths would be "
        r"padded to multiples of 2147483648, more than 2\^30"),
    Row("cp-cu-sentinel", _cp(cu=[0, 7, 18, -1]), E,
        r"^cu_seqlens: entry 3 is -1: a padding sentinel \(fixed-shape cu_seqlens pad with "
        r"-1\)\? expected non-negative offsets; pass only the valid prefix"),
    Row("cp-cu-start", _cp(cu=[2, 7]), E, r"^cu_seqlens: starts at 2; expected 0"),
    Row("cp-cu-decreasing", _cp(cu=[0, 7, 5]), E,
        r"^cu_seqlens: decreases at entry 2: 5 after 7; expected non-decreasing offsets"),
    Row("cp-cu-2d", _cp(cu=[[0, 7]]), E, r"^cu_seqlens: expected a 1-D array \[N\+1\], got "
        r"shape \(1, 2\)"),
    Row("cp-cu-float", _cp(cu=[0.0, 7.0]), T, r"^cu_seqlens: expected integers, got dtype float64"),
    Row("cp-cu-empty", _cp(cu=np.zeros(0, np.int32)), E, r"^cu_seqlens: is empty"),
    Row("cp-cu-too-long", _cp(cu=[0, 2**31 - 2], cp_size=4, mode="contiguous"), E,
        r"^cu_seqlens: padded to multiples of 4 \(contiguous mode, cp_size=4, pad_multiple=1\) "
        r"the stream would hold 2147483648 tokens or more, over 2\^31 - 1"),
    Row("cp-rank-out-of-range", lambda: fastpack.cp_layout([0, 8], 2).indices(2), E,
        r"^cp_rank: got 2; expected an integer in 0\.\.=1 \(cp_size is 2\)"),
    Row("pack-cp-pad-exceeds-max-len",
        _pack([3, 5], 10, cp_size=2, cp_mode="zigzag", pad_multiple=4), E,
        r"^pad_multiple: with cp_size=2, cp_mode='zigzag' and pad_multiple=4, every sequence is "
        r"padded to a multiple of 16 tokens, so a padded pack exceeds max_len \(10\)"),
    Row("pack-cp-overlong", _pack([3, 8], 8, cp_size=2, cp_mode="contiguous", pad_multiple=3), E,
        r"^lengths: 1 sequence\(s\) longer than 6 tokens \(first at index 1, length 8\): "
        r"max_len \(8\) holds 6 once every pack is padded to a multiple of 6"),
    # Zigzag plans on padded lengths: a negative one was once planned as an empty sequence.
    Row("pack-cp-zigzag-negative", _pack(np.array([3, 5, -2], np.int8), 64, cp_size=2), E,
        r"^lengths: negative length -2 at index 2; lengths must be non-negative integers"),
    Row("pack-cp-uint64-huge", _pack(np.array([3, 2**63 + 5], np.uint64), 64, cp_size=2), E,
        r"^lengths: 1 sequence\(s\) longer than 64 tokens \(first at index 1, length "
        r"9223372036854775813\): max_len \(64\) holds 64 once every sequence is padded"),
    Row("pack-cp-mode", _pack(cp_size=2, cp_mode="llama3"), E, r"^cp_mode: unknown value "
        r"'llama3'"),
    Row("pack-cp-long-max-len", _pack([3, 5], 8, cp_size=2, long_max_len=10), E,
        r"^long_max_len: 10 holds 8 tokens once padded to multiples of 4"),
    Row("pack-cp-mode-without-size", _pack(cp_mode="ulysses"), E,
        r"^cp_mode: got 'ulysses' without cp_size; pass cp_size"),
    Row("pack-pad-multiple-without-size", _pack(pad_multiple=8), E,
        r"^pad_multiple: got 8 without cp_size; pass cp_size"),
    Row("pack-cp-size-zero", _pack(cp_size=0), E, r"^cp_size: got 0; expected an integer in "
        r"1\.\.=65536"),
]


def _context_parallel_torch_rows() -> list[Row]:
    try:
        import torch
    except ImportError:
        return []
    from fastpack.torch import (
        PackedCollator,
        context_parallel_attention,
        packed_loss,
        register_hf_attention,
        shard_for_context_parallel,
    )

    flash = PackedCollator(max_len=16, backend="flash")(
        [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6, 7, 8]}])

    def shard(batch: Any = None, *args: Any, **kwargs: Any) -> Callable[[], Any]:
        return lambda: shard_for_context_parallel(flash if batch is None else batch,
                                                  *(args or (2, 0)), **kwargs)

    local = shard_for_context_parallel(flash, 2, 0)
    ulysses = shard_for_context_parallel(flash, 2, 0, "ulysses")
    n = local["input_ids"].shape[1]

    def attend(batch: Any, heads: int = 4, kv: int = 2, tokens: int | None = None,
               **kwargs: Any) -> Callable[[], Any]:
        t = n if tokens is None else tokens
        q, k = torch.zeros(t, heads, 8), torch.zeros(t, kv, 8)
        return lambda: context_parallel_attention(q, k, k, batch, **kwargs)

    def hf(name: str, batch: dict[str, Any]) -> Callable[[], Any]:
        def run() -> Any:
            import transformers

            forward = transformers.AttentionInterface()[name]
            q = torch.zeros(1, 4, batch["input_ids"].shape[1], 8)
            # The layers get the model's mask, not the batch's (a shard's is a guard).
            kwargs = {k: v for k, v in batch.items() if k != "attention_mask"}
            return forward(torch.nn.Linear(1, 1), q, q, q, None, **kwargs)
        return run

    def register(**kwargs: Any) -> Callable[[], Any]:
        return lambda: register_hf_attention(**kwargs)

    group = torch.distributed.ProcessGroup(torch.distributed.HashStore(), 0, 1)
    name = register_hf_attention("fastpack_cp_errors", context_parallel_group=group)
    plain = register_hf_attention()
    return [
        Row("collator-padded-cp", lambda: PackedCollator(max_len=16, backend="padded",
                                                         cp_size=2), E,
            r"^cp_size: 2 does not apply to backend='padded' \(one sample per row\)"),
        Row("shard-no-cu-seq-lens", shard(PackedCollator(max_len=16)([{"input_ids": [1, 2]}])),
            E, r"^batch: no 'cu_seq_lens_q' \(keys: .*\); context parallelism shards one flat "
            r"packed row with its sequence boundaries: PackedCollator\(backend='flash'\)"),
        Row("shard-twice", shard(local), E, r"^batch: already sharded for context parallelism "
            r"\(cp_rank=0 of cp_size=2\); shard the full batch once on every rank"),
        Row("shard-rank", shard(None, 2, 2), E, r"^cp_rank: got 2; expected an integer in "
            r"0\.\.=1 \(cp_size is 2\)"),
        Row("shard-cp-size-zero", shard(None, 0, 0), E, r"^cp_size: got 0"),
        Row("shard-positions", shard({**flash, "position_ids": torch.arange(8)[None]}), E,
            r"^position_ids: do not restart at 0 at every sequence of cu_seq_lens_q"),
        Row("shard-unknown-token-key", shard({**flash, "token_type_ids": torch.zeros(1, 8)}), E,
            r"^batch: 'token_type_ids' has shape \(1, 8\), one value per token of the row; "
            r"shard_for_context_parallel does not know how to split it"),
        Row("shard-cu-end", shard({**flash, "cu_seq_lens_q": torch.tensor([0, 3, 7]),
                                   "cu_seq_lens_k": torch.tensor([0, 3, 7])}), E,
            r"^cu_seq_lens_q: ends at 7, but input_ids holds 8 tokens"),
        Row("shard-two-rows", shard({**flash, "input_ids": torch.zeros(2, 8, dtype=torch.long)}),
            E, r"^input_ids: expected one flat row of shape \[1, T\], got \(2, 8\)"),
        Row("cp-attention-unsharded", attend(flash, tokens=8), E,
            r"^batch: not a context-parallel batch \(no 'cp_size'"),
        Row("cp-attention-tokens", attend(local, tokens=n + 1), E,
            rf"^q: holds {n + 1} tokens, but the batch's rank holds {n} \(cp_cu_seqlens_q"),
        Row("cp-attention-no-group", attend(local), E, r"^group: None, but the batch was "
            r"sharded for cp_size=2; pass the context-parallel process group"),
        Row("cp-attention-group-size", attend(local, group=group), E, r"^group: this process "
            r"is rank 0 of a group of 1, but the batch was sharded for cp_rank=0 of cp_size=2"),
        Row("cp-ulysses-heads", attend(ulysses, heads=3, kv=3,
                                       tokens=ulysses["input_ids"].shape[1]), E,
            r"^cp_size: 2 does not divide the 3 query heads, or neither divides nor is a "
            r"multiple of the 3 key/value heads; Ulysses gives every rank heads/cp_size"),
        Row("cp-attention-kernel", attend(local, kernel="varlen"), E,
            r"^kernel: expected one of 'auto', 'ring', 'flash', 'sdpa', got 'varlen'"),
        Row("cp-attention-ring-cpu", attend(local, kernel="ring"), E,
            r"^kernel='ring' is not available: it needs CUDA tensors, got device 'cpu'"),
        Row("hf-cp-mode-without-group", register(mode="zigzag"), E,
            r"^mode: 'zigzag' applies to context parallelism; pass context_parallel_group="),
        Row("hf-cp-group-type", register(context_parallel_group="cp"), T,
            r"^context_parallel_group: expected a torch\.distributed\.ProcessGroup, got str"),
        Row("hf-cp-kernel", register(context_parallel_group=group, kernel="varlen"), E,
            r"^kernel: expected one of 'auto', 'ring', 'flash', 'sdpa' with "
            r"context_parallel_group, got 'varlen'"),
        Row("hf-cp-unsharded", hf(name, flash), E, r"^fastpack_cp_errors: the batch is not "
            r"sharded for context parallelism \(no cp_size\); pass "
            r"fastpack\.torch\.shard_for_context_parallel"),
        Row("hf-cp-mode-mismatch", hf(name, ulysses), E, r"^fastpack_cp_errors: the batch was "
            r"sharded with mode='ulysses', this attention was registered for mode='zigzag'"),
        Row("hf-plain-attention-cp-batch", hf(plain, local), E, r"^fastpack_varlen: a "
            r"context-parallel batch \(cp_mode='zigzag', cp_size=2\) holds one rank's tokens"),
        Row("loss-cp-normaliser", lambda: packed_loss(torch.zeros(1, n, 9), local), E,
            r"^num_items_in_batch: a context-parallel batch holds one rank's share of its "
            r"sequences"),
    ]


def _tree_rows() -> list[Row]:
    """Shared prefixes (``share_prefix=True``, ``fastpack.pack_trees``): what cannot be
    expressed as a tree, preference pairs that are not pairs, trees that must not split."""
    try:
        import torch
    except ImportError:
        return []
    from fastpack.torch import (
        PackedCollator,
        PackedDataset,
        PackedIterableDataset,
        per_sample,
        token_logprobs,
    )
    from fastpack.torch.tree import check_tree, tree_attention

    rows = [[1, 2, 3, 4], [1, 2, 5]]
    tree_plan = fastpack.pack_trees(rows, 8)

    def tree_collate(*features: Any, **kwargs: Any) -> Callable[[], Any]:
        return lambda: PackedCollator(**{"max_len": 16, "backend": "flash",
                                         "share_prefix": True, **kwargs})(list(features))

    def tree_collator(**kwargs: Any) -> Callable[[], Any]:
        return lambda: PackedCollator(**{"max_len": 16, "share_prefix": True, **kwargs})

    batch = PackedCollator(16, backend="flash", share_prefix=True)(
        [{"input_ids": r, "prompt_id": 0} for r in rows])
    try:
        import datasets

        from fastpack.hf import pack_dataset

        hf_rows = [Row("share-prefix-not-for-pack-dataset",
                       lambda: pack_dataset(datasets.Dataset.from_dict({"input_ids": rows}), 8,
                                            share_prefix=True), E,
                       r"^share_prefix: got True; its rows are packs of whole sequences, which "
                       r"cannot hold trees")]
    except ImportError:
        hf_rows = []
    logits = torch.zeros(1, batch["input_ids"].shape[1], 8)
    q = torch.zeros(5, 2, 4)
    layout = check_tree(batch["tree_cu_seqlens"], batch["tree_parents"], 5)
    return [
        Row("share-prefix-sdpa", tree_collator(backend="sdpa"), E,
            r"^share_prefix: backend='sdpa' cannot express a tree .* use backend='flash' with "
            r"attn_implementation=register_hf_attention\(\), or backend='flex'"),
        Row("share-prefix-eager", tree_collator(backend="eager"), E,
            r"^share_prefix: backend='eager' cannot express a tree"),
        Row("share-prefix-padded", tree_collator(backend="padded"), E,
            r"^share_prefix: backend='padded' cannot express a tree"),
        Row("share-prefix-not-bool", tree_collator(backend="flash", share_prefix=1), T,
            r"^share_prefix: expected a bool, got int 1"),
        Row("share-prefix-separator", tree_collator(backend="flash", separator_id=2), E,
            r"^share_prefix: True does not take reserve=1 \(slots after every sample, as a "
            r"separator_id reserves: a tree's samples end inside it; put the separator in the "
            r"samples' tokens\)"),
        Row("share-prefix-numpy", tree_collator(backend="flash", return_tensors="np"), E,
            r"^return_tensors: 'np' does not apply with share_prefix=True .* expected 'pt'"),
        Row("share-prefix-seq-idx", tree_collator(backend="flash", return_seq_idx=True), E,
            r"^return_seq_idx: True does not apply with share_prefix=True"),
        Row("share-prefix-split", tree_collator(backend="flash", overlong="split"), E,
            r"^share_prefix: True does not take overlong='split' \(a piece of a sample could "
            r"not attend to the pieces before it; use 'error', 'truncate' or 'drop'\)"),
        Row("share-prefix-wrapped", tree_collator(backend="flex", strategy="wrapped"), E,
            r"^share_prefix: True does not take strategy='wrapped' \(it cuts every max_len "
            r"tokens, through trees"),
        Row("share-prefix-not-for-pack", lambda: fastpack.pack([3, 2], 8, share_prefix=True),
            E, r"^share_prefix: got True; trees are found from the samples' tokens, and pack\(\) "
               r"plans lengths; use fastpack\.pack_trees"),
        Row("share-prefix-collator-plan",
            lambda: PackedCollator(8, backend="flash", share_prefix=True).plan([3, 2]), E,
            r"^share_prefix: True plans the samples' tokens, not their lengths"),
        Row("share-prefix-prompt-on-some", tree_collate({"input_ids": [1, 2], "prompt_id": 0},
                                                       {"input_ids": [1, 3]}), E,
            r"^features: sample 1 has no 'prompt_id' \(1 of 2 samples lack it\)"),
        Row("share-prefix-prompt-unhashable", tree_collate({"input_ids": [1, 2], "prompt_id": [0]}), T,
            r"^prompt_id: sample 0 has the unhashable value \[0\]"),
        Row("share-prefix-overlong", tree_collate({"input_ids": list(range(1, 20))}), E,
            r"^lengths: 1 sequence\(s\) longer than 16 tokens \(first at index 0, length 19\)"),
        Row("pair-prompts-differ", tree_collate({"chosen": [1, 2, 3], "rejected": [4, 5]}), E,
            r"^features: pair 0: 'chosen' and 'rejected' share no prefix, so their prompts "
            r"differ; give each pair's prompt under 'prompt'"),
        Row("pair-empty-completion", tree_collate({"prompt_ids": [1, 2], "chosen_ids": [],
                                                   "rejected_ids": [3]}), E,
            r"^features: pair 0: the 'chosen_ids' completion is empty \(after a prompt of 2 "
            r"tokens\)"),
        Row("pair-missing-rejected", tree_collate({"prompt_ids": [1], "chosen_ids": [2]}), E,
            r"^features: pair 0 has no 'rejected_ids'; expected every sample to be a pair"),
        Row("pair-and-input-ids", tree_collate({"chosen": [1, 2], "rejected": [1, 3],
                                                "input_ids": [1]}), E,
            r"^features: pair 0 has 'input_ids' beside 'chosen' / 'rejected'"),
        Row("pair-too-big-for-a-pack", tree_collate({"prompt_ids": list(range(1, 10)),
                                                     "chosen_ids": [20] * 5,
                                                     "rejected_ids": [30] * 5}), E,
            r"^max_len: samples 0, 1 share a prefix of 9 tokens and hold 19 tokens together, "
            r"more than max_len \(16\); they must stay in one pack"),
        Row("pair-ids-not-ints", tree_collate({"chosen": [1.5], "rejected": [1, 2]}), T,
            r"^features: pair 0 'chosen': expected token ids"),
        Row("trees-prompts-count", lambda: fastpack.pack_trees(rows, 8, prompt_ids=[0]), E,
            r"^prompt_ids: got 1 values for 2 samples; expected one per sample"),
        Row("trees-wrapped", lambda: fastpack.pack_trees(rows, 8, strategy="wrapped"), E,
            r"^share_prefix: True does not take strategy='wrapped'"),
        Row("trees-split", lambda: fastpack.pack_trees(rows, 8, overlong="split"), E,
            r"^share_prefix: True does not take overlong='split'"),
        Row("trees-materialize", lambda: fastpack.materialize(tree_plan, rows), E,
            r"^plan: a plan of shared-prefix trees has no per-token labels"),
        Row("trees-gather", lambda: fastpack.gather(tree_plan, {}), E,
            r"^plan: a plan of shared-prefix trees cannot be gathered"),
        Row("trees-rows-of-a-plain-plan", lambda: fastpack.tree_rows(fastpack.pack([4, 3], 8),
                                                                     rows), E,
            r"^plan: not a plan of shared-prefix trees \(no parents\); make it with "
            r"fastpack\.pack_trees"),
        Row("trees-other-data", lambda: fastpack.tree_rows(tree_plan, [[1, 2, 3, 4], [1, 9, 5]]),
            E, r"^plan: sample 1 differs from segment \d+ \(sample 0, positions 0\.\.2\) that its "
               r"path shares; was the plan made from this data\?"),
        Row("dataset-prompts-without-share-prefix",
            lambda: PackedDataset(rows, PackedCollator(8), prompt_ids=[0, 0]), E,
            r"^prompt_ids: apply with a collator made with share_prefix=True"),
        Row("dataset-trees-long-max-len",
            lambda: PackedDataset(rows, PackedCollator(8, backend="flash", share_prefix=True),
                                  long_max_len=16), E,
            r"^share_prefix: True does not take long_max_len=16 \(a tree larger than max_len "
            r"is split, its prefix repeated; raise max_len instead\)"),
        Row("dataset-tree-plan-plain-collator",
            lambda: PackedDataset(rows, PackedCollator(8), plan=tree_plan), E,
            r"^share_prefix: got False, but the given plan was made with True"),
        Row("stream-share-prefix",
            lambda: PackedIterableDataset(
                [{"input_ids": [1, 2]}], PackedCollator(8, backend="flash", share_prefix=True)),
            E, r"^share_prefix: got True; a stream is packed a window at a time"),
        Row("per-sample-no-samples", lambda: per_sample(logits, {"input_ids": batch["input_ids"]}),
            E, r"^batch: no 'sample_tokens'; per_sample and token_logprobs read the samples"),
        Row("per-sample-shape", lambda: per_sample(torch.zeros(3, 2), batch), E,
            r"^values: shape \(3, 2\) does not match the batch's tokens \(1, 5\)"),
        Row("per-sample-of", lambda: per_sample(logits, batch, of="rows"), E,
            r"^of: unknown value 'rows'; expected 'tokens' or 'targets'"),
        Row("per-sample-targets-count", lambda: per_sample(torch.zeros(2), batch, of="targets"),
            E, r"^values: shape \(2,\); expected one value per target of the batch \(5\)"),
        Row("token-logprobs-not-float", lambda: token_logprobs(torch.zeros(1, 5, 8,
                                                                           dtype=torch.int64),
                                                               batch), T,
            r"^logits: expected a floating-point torch\.Tensor"),
        Row("tree-kernel-varlen", lambda: tree_attention(q, q, q, layout, kernel="varlen"), E,
            r"^kernel: 'varlen' cannot compute a tree batch; expected one of 'auto', 'flash', "
            r"'flex', 'sdpa'"),
        Row("tree-kernel-flash-cpu", lambda: tree_attention(q, q, q, layout, kernel="flash"), E,
            r"^kernel='flash' is not available: it needs CUDA tensors, got device 'cpu'"),
        Row("tree-parent-later", lambda: check_tree([0, 2, 5], [1, -1], 5), E,
            r"^tree_parents: segment 0 has parent 1; expected -1 or an earlier segment"),
        Row("tree-not-preorder", lambda: check_tree([0, 1, 2, 3, 4], [-1, 0, -1, 0], 4), E,
            r"^tree_parents: segment 3's parent 0 is not the segment before it or one of its "
            r"ancestors; a tree's segments must be in preorder"),
        Row("tree-bounds", lambda: check_tree([0, 2, 4], [-1, 0], 5), E,
            r"^tree_cu_seqlens: expected bounds rising from 0 to the row's 5 tokens"),
        Row("tree-positions-restart", lambda: check_tree([0, 2, 4], [-1, 0], 4, [0, 1, 0, 1]),
            E, r"^position_ids: segment 1 starts at position 0; expected 2 \(continuing its "
               r"parent 0\)"),
        Row("tree-positions-jump", lambda: check_tree([0, 4], [-1], 4, [0, 1, 3, 4]), E,
            r"^position_ids: position 3 at row position 2 does not follow 1 inside its segment"),
        *hf_rows,
    ]


def _mb(lengths: Any = (3, 4), **kwargs: Any) -> Callable[[], Any]:
    return lambda: fastpack.plan_micro_batches(lengths, **kwargs)


_WEB = {"web": {"weight": 1}}
STEPS_AND_CORPORA = [
    # Micro-batches under caps, the budget controller, the memory and cost models.
    Row("micro-batches-no-cap", _mb(), E, r"^token_cap, cost_cap: pass at least one cap"),
    Row("micro-batches-over-cap", _mb([3, 9], token_cap=8), E,
        r"^lengths: 1 sequence\(s\) over the cap \(sequence 1: 9 tokens, .*token_cap 8.*"
        r"pass overlong='drop'"),
    Row("micro-batches-overlong", _mb([3], token_cap=8, overlong="split"), E,
        r"^overlong: got 'split'; expected 'error' or 'drop'"),
    Row("micro-batches-steps-shape", _mb(token_cap=8, steps=[0]), E,
        r"^steps: expected an integer array of the shape of lengths \(2,\)"),
    Row("micro-batches-steps-negative", _mb(token_cap=8, steps=[0, -1]), E,
        r"^steps: every global step must be >= 0"),
    Row("micro-batches-cost-cap", _mb(cost_cap=0), E, r"^cost_cap: got 0; expected a number > 0"),
    Row("micro-batches-cost", _mb(token_cap=8, cost="flops"), T,
        r"^cost: expected a number a .* or an object with sequence_flops\(lengths\), got str"),
    Row("micro-batches-ranks", _mb(token_cap=8, ranks=0), E,
        r"^ranks: got 0; expected an integer >= 1"),
    Row("controller-alpha",
        lambda: fastpack.BudgetController(10, target=0.9, maximum=20, alpha=1.5), E,
        r"^alpha: got 1\.5; expected 0 < alpha <= 1"),
    Row("controller-initial", lambda: fastpack.BudgetController(30, target=0.9, maximum=20), E,
        r"^initial: got 30; expected an integer in 1\.\.=20"),
    Row("memory-dtype", lambda: fastpack.MemoryModel.from_config({"hidden_size": 8},
                                                                 dtype="int4"),
        E, r"^dtype: got 'int4'; expected one of \["),
    Row("memory-config", lambda: fastpack.MemoryModel.from_config({"n_layers": 8}), E,
        r"^config: has no hidden_size \(nor d_model, n_embd\)"),
    Row("memory-margin", lambda: fastpack.MemoryModel(1.0).token_cap(10, margin=1.0), E,
        r"^margin: got 1\.0; expected 0 <= margin < 1"),
    Row("cost-config-type", lambda: fastpack.CostModel.from_config("llama"), T,
        r"^config: expected a Hugging Face model config \(model\.config\) or its dict, got str"),
    Row("cost-config-missing", lambda: fastpack.CostModel.from_config({"hidden_size": 8}), E,
        r"^config: num_hidden_layers is None; expected a positive integer"),
    # Mixtures by tokens.
    Row("mix-weight-and-epochs", lambda: fastpack.MixSource("web", weight=1, epochs=2), E,
        r"^mix: source 'web': give exactly one of weight .* or epochs"),
    Row("mix-no-name", lambda: fastpack.MixSource("", weight=1), E,
        r"^mix: a source needs a name \(a non-empty string\), got ''"),
    Row("mix-weight-negative", lambda: fastpack.MixSource("web", weight=-1), E,
        r"^mix: source 'web': weight must be a positive number, got -1"),
    Row("mix-spec-not-mapping", lambda: fastpack.Mixture({"web": 3}), E,
        r"^mix: source 'web': expected a mapping with weight or epochs, got 3"),
    Row("mix-no-sources", lambda: fastpack.Mixture([]), E, r"^mix: no sources"),
    Row("mix-unknown-source",
        lambda: fastpack.mix({"web": [3], "x": [4]}, fastpack.Mixture(_WEB), max_len=8), E,
        r"^lengths: expected one array per source of the mixture \(web\); 'x' is not a source"),
    Row("mix-missing-source", lambda: fastpack.mix({}, fastpack.Mixture(_WEB), max_len=8), E,
        r"^lengths: expected one array per source of the mixture \(web\); missing 'web'"),
    # Related documents packed together.
    Row("affinity-negative", _pack([3, 4], affinity=[0, -1]), E,
        r"^affinity: negative key -1 at index 1; keys must be non-negative integers"),
    Row("affinity-length", _pack([3, 4], affinity=[0]), E,
        r"^affinity: got 1 keys for 2 sequences; expected one key per sequence"),
    Row("affinity-fraction", _pack([3, 4], affinity=[0.5, 1]), E,
        r"^affinity: 0\.5 at index 0 is not a whole number"),
    Row("affinity-first-fit", _pack([3, 4], strategy="ffd", affinity=[0, 1]), E,
        r"^affinity: packs related documents together by best fit; strategy='ffd'"),
    Row("affinity-group-tokens", _pack([3, 4], affinity=[0, 1], group_tokens=16), E,
        r"^affinity: not supported with group_tokens \(level-2 groups\) yet"),
    Row("measure-affinity-length",
        lambda: fastpack.measure_affinity(fastpack.pack([3, 4], 8), [0]), E,
        r"^affinity: got 1 keys; the plan has sequences up to index 1"),
]


ROWS = (PACK + LIMITS + PLAN + MATERIALIZE + RAGGED + CONTEXT_PARALLEL + _datasets_rows()
        + _torch_rows() + _context_parallel_torch_rows() + _vlm_rows() + _tree_rows()
        + STEPS_AND_CORPORA)


def _param(row: Row) -> Any:
    marks = [pytest.mark.xfail(strict=True, reason=row.gap)] if row.gap else []
    return pytest.param(row, id=row.id, marks=marks)


def test_ids_are_unique() -> None:
    ids = [row.id for row in ROWS]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("row", [_param(row) for row in ROWS])
def test_user_mistake(row: Row) -> None:
    with pytest.raises(row.error) as info:
        row.call()
    got = info.value
    # The exact class, not just a base: a FastpackTypeError is also a FastpackError.
    if row.error is E:
        assert type(got) is E, f"{type(got).__name__}: {got}"
    text = str(got.code) if isinstance(got, SystemExit) else str(got)
    assert re.search(row.match, text), f"{text!r} does not match {row.match!r}"
    if isinstance(got, (E, ValueError, TypeError)) and not isinstance(got, SystemExit):
        assert isinstance(got, E), f"{type(got).__name__} is not a FastpackError: {got}"


def test_errors_are_value_and_type_errors() -> None:
    assert issubclass(FastpackError, ValueError)
    assert issubclass(FastpackTypeError, TypeError)
    assert issubclass(FastpackTypeError, FastpackError)
