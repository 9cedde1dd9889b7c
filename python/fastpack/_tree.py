"""Shared prefixes computed once: :func:`pack_trees` plans samples that start with the same
tokens as trees (the shared tokens stored once), and :func:`tree_rows` builds a batch of
such a plan with its target map.

The trees come from the Rust core (``fastpack_core::tree``): samples sharing a prompt id
(``prompt_ids``) share their longest common token prefix (RL rollouts of one prompt, a
preference pair); without prompt ids, a trie over all samples shares every common prefix (branching
conversations). A tree is packed as one item of its distinct tokens through
:func:`fastpack.pack`, so every strategy, shuffle and ``group_tokens`` applies; a tree
larger than ``max_len`` is split into items that each repeat its prefix.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _core
from ._checks import _bool_arg, _threads
from ._errors import FastpackError, FastpackTypeError
from ._materialize import TokenData, _from_rows, as_ragged, padding, token_sources
from ._options import PackArgs, PackOptions, resolve
from ._plan import PackIndex, Plan, pack

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["pack_trees", "path_targets", "preference_samples", "prompt_codes", "tree_rows"]


def prompt_codes(values: Any, count: int, name: str = "prompt_ids") -> np.ndarray:
    """int64 codes, equal where the prompt ids ``values`` (``name`` in messages) are
    equal: integers as they are, any other hashable value (a string, a tuple) by its first
    appearance."""
    if type(values).__module__.startswith("torch"):
        values = values.detach().cpu().numpy()
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__len__"):
        raise FastpackTypeError(
            f"{name}: expected one prompt id per sample (a list or array), got "
            f"{type(values).__name__}"
        )
    if len(values) != count:
        raise FastpackError(
            f"{name}: got {len(values)} values for {count} samples; expected one per sample"
        )
    array = np.asarray(values) if isinstance(values, np.ndarray) else None
    if array is not None and array.ndim == 1 and array.dtype.kind in "iu":
        return np.ascontiguousarray(array, dtype=np.int64)
    codes: dict[Any, int] = {}
    out = np.empty(count, dtype=np.int64)
    for i, value in enumerate(values):
        if isinstance(value, np.generic):
            value = value.item()
        try:
            out[i] = codes.setdefault(value, len(codes))
        except TypeError:
            raise FastpackTypeError(
                f"{name}: sample {i} has the unhashable value {value!r}; expected an id (an "
                f"int or a string)"
            ) from None
    return out


def renamed(new: str, old: str, new_value: Any, old_value: Any, stacklevel: int = 3) -> Any:
    """The value of argument ``new`` given as ``new`` or, deprecated, as ``old`` (its
    earlier name), with a ``DeprecationWarning``; both given raises."""
    if old_value is None:
        return new_value
    if new_value is not None:
        raise FastpackError(f"{old}: the old name of {new}; pass {new} alone")
    warnings.warn(f"{old}= is deprecated: pass {new}= (one word per idea: a group is packs "
                  f"under group_tokens)", DeprecationWarning, stacklevel=stacklevel)
    return old_value


def pack_trees(
    tokens: TokenData,
    max_len: int | None = None,
    *,
    prompt_ids: Any = None,
    split: bool = True,
    options: PackOptions | None = None,
    threads: int | None = None,
    groups: Any = None,
    **kwargs: Unpack[PackArgs],
) -> Plan:
    """Plan ``tokens`` as shared-prefix trees packed into packs of at most ``max_len``
    distinct tokens.

    Args:
        tokens: the token data (see :func:`fastpack.as_ragged`): trees are found from the
            tokens themselves, not their lengths.
        max_len: tokens per pack, each shared token counted once.
        prompt_ids: one value per sample, the id of the prompt it continues (RL rollouts
            of one prompt, a preference pair): samples with one value share their longest
            common prefix (nothing, if they share nothing). None: a trie over all samples
            shares every common prefix.
        split: a tree larger than ``max_len`` becomes several items, each repeating its
            prefix (the prefix charged again). False: such a tree raises (preference
            pairs, which stay in one pack).
        options, **kwargs: the packing options (:class:`fastpack.PackOptions`, as in
            :func:`fastpack.pack`): ``strategy`` packs the trees (``"wrapped"``, which
            cuts through them, is refused), ``overlong`` is what happens to a sample
            longer than ``max_len`` (``"error"``, ``"truncate"`` to its first ``max_len``
            tokens, or ``"drop"``, every such token counted; ``"split"`` is refused),
            ``shuffle``, ``seed`` and ``group_tokens`` order and group the packs. The plan
            shares prefixes whatever ``share_prefix`` says (its options record True).
        threads: worker threads; the plan does not depend on it.
        groups: ``prompt_ids``' earlier name (deprecated: a group is packs under
            ``group_tokens``).

    Returns:
        A :class:`fastpack.Plan` with ``parents``, ``path_sample_ids``, ``path_ends`` and
        ``sample_tokens`` (see its docs). Its metrics count distinct tokens.
    """
    data = as_ragged(tokens, name="tokens")
    opts = resolve(pack_trees, options, max_len, kwargs)
    if not opts.share_prefix:
        opts = opts.replace(share_prefix=True)  # checks what a tree cannot take
    split = _bool_arg("split", split)
    threads = _threads(threads)
    prompt_ids = renamed("prompt_ids", "groups", prompt_ids, groups)
    codes = None if prompt_ids is None else prompt_codes(prompt_ids, len(data))
    items = _core.tree_items(data.column, codes, opts.max_len, opts.overlong, split, threads)
    # Each item (a tree, or part of one) fits max_len: pack() never cuts it.
    packed = pack(items["item_costs"], options=opts.replace(share_prefix=False,
                                                            overlong="error"),
                  threads=threads)
    tree = _core.tree_expand(
        items["sample_ids"], items["starts"], items["seqlens"], items["parents"],
        items["item_offsets"], items["path_sample_ids"], items["path_ends"],
        items["path_offsets"], packed.sample_ids, packed.pack_offsets,
    )
    kept = int(items["num_sequences"] - items["empty_sequences"] - items["dropped_sequences"])
    fields: dict[str, Any] = {
        **tree,
        "max_len": opts.max_len, "reserve": 0, "strategy": opts.strategy,
        "overlong": opts.overlong, "shuffle": opts.shuffle, "seed": opts.seed,
        "num_sequences": int(items["num_sequences"]),
        "empty_sequences": int(items["empty_sequences"]),
        "dropped_sequences": int(items["dropped_sequences"]),
        "dropped_tokens": int(items["dropped_tokens"]),
        "truncated_sequences": int(items["truncated_sequences"]),
        "truncated_tokens": int(items["truncated_tokens"]),
        "split_sequences": 0,
        "sample_tokens": int(items["sample_tokens"]),
        "buckets": [{"max_len": opts.max_len, "num_sequences": kept}],
        "group_tokens": packed.group_tokens, "group_offsets": packed.group_offsets,
        "long_max_len": None,
    }
    return Plan(fields)


def check_tree_plan(plan: Plan, name: str = "plan") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(parents, path_sample_ids, path_ends)`` of ``plan``; raises unless it is a plan of
    trees (from :func:`pack_trees`)."""
    if not isinstance(plan, Plan):
        raise FastpackTypeError(f"{name}: expected a fastpack.Plan, got {type(plan).__name__}")
    if plan.parents is None or plan.path_sample_ids is None or plan.path_ends is None:
        raise FastpackError(
            f"{name}: not a plan of shared-prefix trees (no parents); make it with "
            f"fastpack.pack_trees"
        )
    return plan.parents, plan.path_sample_ids, plan.path_ends


def path_targets(
    plan: Plan,
    tokens: Any,
    *,
    labels: Any = None,
    loss_mask: Any = None,
    threads: int | None = None,
) -> np.ndarray:
    """Targets of every path of a tree plan (uint32 [M]): what :func:`tree_rows` lists for
    each sample, counted in one parallel pass in Rust without building a batch (labels and
    mask read in place)."""
    check_tree_plan(plan)
    token_data = as_ragged(tokens, name="tokens")
    if plan.num_sequences != len(token_data):
        raise FastpackError(
            f"plan: made from {plan.num_sequences} samples, but the token data has "
            f"{len(token_data)}"
        )
    label_data = None if labels is None else as_ragged(labels, name="labels")
    mask_data = None if loss_mask is None else as_ragged(loss_mask, mask=True, name="loss_mask")
    result: np.ndarray = _core.tree_path_targets(
        plan, token_data.column,
        None if label_data is None else label_data.column,
        None if mask_data is None else mask_data.column, _threads(threads),
    )
    return result


def tree_rows(
    plan: Plan,
    tokens: TokenData,
    packs: PackIndex | None = None,
    *,
    labels: TokenData | None = None,
    loss_mask: TokenData | None = None,
    pad_to: int | None = None,
    pad_to_multiple_of: int | None = None,
    pad_id: int = 0,
    threads: int | None = None,
) -> dict[str, Any]:
    """One row of ``packs`` (default: all) of a tree plan, laid end to end, as numpy.

    Returns ``input_ids`` and ``position_ids`` (int64 ``[1, T]``; a segment's positions
    continue from its parent's end), the segments (``tree_cu_seqlens``, int32 [S+1], and
    ``tree_parents``, int32 [S]: each segment's parent in the row, -1 for a root; padding
    is a root of its own at the end), the *target map* — every target of every sample, in
    sample order: ``target_index`` (int64: the row position of the logit that predicts
    it), ``target_labels`` (int64) and ``target_offsets`` (int64 [N+1]: sample ``k``'s
    targets) — and the samples: ``sample_ids`` (int64 [N], ascending), ``sample_tokens``
    (int64: the row positions of each sample's tokens, in order) and ``sample_offsets``
    (int64 [N+1]). ``num_targets`` is the number of targets, ``total_tokens`` the row's
    distinct tokens (padding not counted).

    A target is a position ``t >= 1`` of a sample whose label (default: its token) is not
    -100 and whose loss mask is not 0; the last token of a shared segment predicts the
    first token of each of its children, so a logit may serve several targets, each
    counted once with its own label.
    """
    check_tree_plan(plan)
    pad_to, multiple, pad_id = padding(pad_to, pad_to_multiple_of, pad_id)
    threads = _threads(threads)
    token_data, label_data, mask_data = token_sources(tokens, labels, loss_mask)
    chosen = plan._packs(packs)
    rows = _core.materialize(
        plan, chosen, token_data.column, None, None, None, False, "flat", pad_to, multiple,
        pad_id, threads,
    )
    tree = _core.tree_rows(
        plan, chosen, token_data.column,
        None if label_data is None else label_data.column,
        None if mask_data is None else mask_data.column, threads,
    )
    cu = rows["cu_seqlens"]
    pad_segments = len(cu) - 1 - len(tree["parents"])
    parents = tree.pop("parents")
    if pad_segments:
        parents = np.concatenate([parents, np.full(pad_segments, -1, dtype=np.int32)])
    width = int(rows["width"])
    return {
        "input_ids": rows["input_ids"].reshape(1, width),
        "position_ids": rows["position_ids"].reshape(1, width),
        "tree_cu_seqlens": cu,
        "tree_parents": parents,
        **tree,
        "num_targets": len(tree["target_index"]),
        "total_tokens": int(rows["total_tokens"]),
    }


#: The keys of a preference pair, TRL's: the tokenized form (``prompt_ids`` with
#: ``chosen_ids`` / ``rejected_ids``, completions only) and the form with token ids under
#: ``chosen`` / ``rejected`` (completions after a ``prompt``, or whole sequences whose
#: longest common prefix is the prompt).
PAIR_KEYS = (("prompt_ids", "chosen_ids", "rejected_ids"), ("prompt", "chosen", "rejected"))


def pair_keys(sample: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """The pair keys ``sample`` holds (``(prompt, chosen, rejected)``), or None."""
    for keys in PAIR_KEYS:
        if keys[1] in sample or keys[2] in sample:
            return keys
    return None


def _ids(value: Any, where: str) -> np.ndarray:
    if type(value).__module__.startswith("torch"):
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise FastpackTypeError(
            f"{where}: expected token ids (a flat list of ints), got "
            f"{type(value).__name__}" + (f" of shape {array.shape}" if array.ndim != 1 else
                                         f" of dtype {array.dtype}")
        )
    return array.astype(np.int64, copy=False)


def preference_samples(
    features: Sequence[Mapping[str, Any]],
) -> tuple[Any, Any, np.ndarray]:
    """Preference pairs as samples: pair ``k`` becomes sample ``2k`` (prompt + chosen) and
    ``2k + 1`` (prompt + rejected), both of prompt ``k``, with a loss mask on the
    completions. Returns ``(tokens, loss_mask, prompt_ids)`` as Ragged data and int64 codes.

    Raises when a pair lacks a key, when chosen and rejected given as whole sequences share
    no prefix (their prompts differ: pass the prompt under ``prompt``), or when a
    completion is empty (its log-probability would be 0 whatever the model)."""
    keys = pair_keys(features[0])
    assert keys is not None
    prompt_key, chosen_key, rejected_key = keys
    rows: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    for k, f in enumerate(features):
        missing = [key for key in (chosen_key, rejected_key) if key not in f]
        if missing or (prompt_key == "prompt_ids" and prompt_key not in f):
            raise FastpackError(
                f"features: pair {k} has no {(missing or [prompt_key])[0]!r}; expected every "
                f"sample to be a pair with {prompt_key!r}, {chosen_key!r} and {rejected_key!r}"
            )
        chosen = _ids(f[chosen_key], f"features: pair {k} {chosen_key!r}")
        rejected = _ids(f[rejected_key], f"features: pair {k} {rejected_key!r}")
        if prompt_key in f:
            prompt = _ids(f[prompt_key], f"features: pair {k} {prompt_key!r}")
            chosen, rejected = (np.concatenate([prompt, c]) for c in (chosen, rejected))
            shared = len(prompt)
        else:
            n = min(len(chosen), len(rejected))
            differ = np.flatnonzero(chosen[:n] != rejected[:n])
            shared = int(differ[0]) if len(differ) else n
            if shared == 0:
                raise FastpackError(
                    f"features: pair {k}: {chosen_key!r} and {rejected_key!r} share no prefix, "
                    f"so their prompts differ; give each pair's prompt under "
                    f"{prompt_key!r} (then {chosen_key!r} / {rejected_key!r} are completions)"
                )
        for name, seq in ((chosen_key, chosen), (rejected_key, rejected)):
            if len(seq) <= shared:
                raise FastpackError(
                    f"features: pair {k}: the {name!r} completion is empty (after a prompt of "
                    f"{shared} tokens); its log-probability would be 0 whatever the model"
                )
            rows.append(seq)
            mask = np.zeros(len(seq), dtype=np.uint8)
            mask[shared:] = 1
            masks.append(mask)
    tokens = _from_rows(rows, mask=False, name="input_ids")
    loss_mask = _from_rows(masks, mask=True, name="loss_mask")
    prompt_ids = np.repeat(np.arange(len(features), dtype=np.int64), 2)
    return tokens, loss_mask, prompt_ids
