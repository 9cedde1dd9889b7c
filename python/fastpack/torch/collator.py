"""The collator: a planning policy (which samples share a pack) plus a batch format."""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._checks import _bool_arg, _choice, _int_arg, _threads
from .._errors import FastpackError, FastpackTypeError
from .._materialize import (
    IGNORE_INDEX,
    Ragged,
    TokenData,
    _from_rows,
    as_ragged,
    materialize,
)
from .._options import (
    PLAN_OPTIONS,
    PackArgs,
    PackOptions,
    WithOptions,
    layered,
    with_separator,
)
from .._plan import Plan, pack
from .._tree import pack_trees, pair_keys, preference_samples, prompt_codes, tree_rows
from ..vlm import VlmConfig
from .formats import BACKENDS, MASK_MODES, RETURN_TENSORS, BatchFormat
from .media import MEDIA_KEYS, media_batch, media_budgets, sample_media
from .tree import flex_available, tree_batch

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["LOSS_MASK_KEYS", "PackedCollator"]

#: Per-sample keys read as a 0/1 loss mask, first match wins (Hugging Face chat templates
#: give ``assistant_masks``; TRL gives ``completion_mask``).
LOSS_MASK_KEYS = ("assistant_masks", "completion_mask", "loss_mask")
#: Per-token keys a sample may carry that fastpack reads or rebuilds itself: the tokens,
#: labels and loss masks are packed; ``attention_mask`` (all ones: an unpadded sample) and
#: ``position_ids`` (``0..n-1``) are checked and rebuilt per pack.
KNOWN_KEYS = ("input_ids", "labels", *LOSS_MASK_KEYS, "attention_mask", "position_ids")
#: The padded backend's strategy: every sample in a row (a pack) of its own.
_ONE_PER_ROW = "one_per_pack"
#: The sample key whose value says which samples share their longest common prefix with
#: ``share_prefix=True``: the id of the prompt a sample continues (RL rollouts of one
#: prompt, a preference pair). Not a *group*, which is packs under ``group_tokens``.
PROMPT_KEY = "prompt_id"
#: :data:`PROMPT_KEY`'s earlier name (deprecated): read, with a warning, from samples that
#: have no :data:`PROMPT_KEY`.
OLD_PROMPT_KEY = "group"
#: The backends that can express a tree batch (``share_prefix=True``): fastpack's
#: registered attention reads the tree, Hugging Face's flex attention its ``BlockMask``.
TREE_BACKENDS = ("flash", "flex")
#: The plan options a collator refuses: one batch is packed on its own, in order.
_PER_PLAN = {
    name: "orders, buckets or groups the packs of a whole plan, not of one batch; pass it to "
          "PackedDataset (or collator.plan())"
    for name in PLAN_OPTIONS
}


class PackedCollator(WithOptions):
    """Pack a list of samples into one batch for ``model(**batch)``.

    Args:
        max_len: tokens per pack (row). Samples of a batch are bin-packed into packs of at
            most ``max_len`` tokens.
        backend: ``"flash"``, ``"sdpa"``, ``"eager"``, ``"flex"`` or ``"padded"`` — the
            model's ``attn_implementation`` (``"padded"``: the unpacked baseline, one sample
            per row: its strategy is ``"one_per_pack"``, and no other). ``"flex"``: Hugging
            Face compiles ``flex_attention`` on its first call, tens of seconds on a CPU
            (warned once where there is no accelerator).
        mask: ``"position_ids"`` (default; no ``attention_mask``) or ``"explicit"``
            (sdpa / eager / flex only; see the module docs).
        pad_to_multiple_of: round the row width (flash: the flat row) up to a multiple.
        pad_to: pad rows to exactly this width (flash: the flat row to this many tokens),
            for fixed shapes (CUDA graphs, ``torch.compile`` without recompiles).
        fixed_cu_seqlens: flash: pad ``cu_seq_lens_q/k`` to this many entries by
            repeating the last value (empty trailing sequences), for CUDA graphs.
        return_tensors: ``"pt"`` (torch, via ``torch.from_numpy``: no copy) or ``"np"``.
        separator_id: insert this token after every sample (one slot reserved by the plan
            unless ``reserve`` says more); ``train_separators`` makes it a target.
        options, **kwargs: the packing options of every batch (:class:`fastpack.PackOptions`
            as in :func:`fastpack.pack`: ``strategy``; ``overlong``, what happens to a
            sample longer than ``max_len``, ``"error"`` by default; ``reserve``). The
            options of a whole plan (``shuffle``, ``seed``, ``long_max_len``,
            ``group_tokens``) go to :class:`PackedDataset` or :meth:`plan`.
        loss_mask_key: per-sample key of a 0/1 loss mask (default: the first of
            :data:`LOSS_MASK_KEYS` present); ``False`` to ignore masks.
        mask_dtype: dtype of the additive eager mask (match the model's dtype).
        return_seq_idx: add ``seq_idx`` (int32, segment index per token; Mamba / FLA).
        return_num_items: add ``num_items_in_batch`` (targets in the batch; the Trainer
            computes the same number itself, so this is for plain training loops) and
            ``num_sequences_in_batch`` (sequences with at least one target:
            ``weighting="sequence"``'s normaliser, which a context-parallel shard needs).
        share_prefix (an option: a keyword or in ``options``): compute shared prefixes
            once: samples with the same ``group`` value
            share their longest common token prefix (RL rollouts of one prompt), samples
            without a ``group`` key share every common prefix (a trie: branching
            conversations), and preference pairs (``prompt_ids`` / ``chosen_ids`` /
            ``rejected_ids``, or token ids under ``chosen`` / ``rejected`` with or
            without ``prompt``, TRL's names) share their prompt and stay in one pack. The
            batch is a tree batch (see :mod:`fastpack.torch.tree`) for fastpack's
            registered attention (``backend="flash"``; flash-attn with the prefix's keys
            gathered on CUDA, per-segment SDPA on the CPU) or Hugging Face's
            ``flex_attention`` (``backend="flex"``); ``max_len`` counts each shared token
            once. Backends "sdpa", "eager" and "padded" cannot express a tree and raise.
        ignore_keys: per-token keys to drop without packing them. A sample's key that
            holds one number per token (a list, array or tensor as long as its
            ``input_ids``) and is none of :data:`KNOWN_KEYS` raises, naming it: a
            misspelled mask (``assistant_mask``) or labels (``label``) would otherwise
            silently train every token. Other keys — text (``messages``, ``prompt``,
            ``completion``), scalars and other metadata — are ignored.
        model_config: a vision-language model's config (``model.config`` or its dict):
            samples may carry the processor's media keys (``pixel_values``,
            ``image_grid_thw``, ``pixel_values_videos``, ``video_grid_thw``,
            ``second_per_grid_ts``, ``image_sizes``), concatenated in placeholder order;
            mRoPE models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) get ``position_ids``
            ``[4, rows, width]`` and ``mm_token_type_ids``; labels are -100 on every
            placeholder. With ``limits`` (say ``{"patches": 16384, "images": 8}``) every
            pack of a batch stays within them, each sample's use counted from its media
            (:data:`fastpack.torch.media.MEDIA_BUDGETS`). See docs/vision_language.md.

    A sample with ``seq_lengths`` is already packed and raises, as does an
    ``attention_mask`` with zeros (a padded sample) or ``position_ids`` other than
    ``0..n-1``: packing them again would attend across their sequences or train on padding.
    A batch with no tokens at all raises, naming its empty samples.

    :meth:`plan` (whole datasets) uses ``strategy`` whatever ``shuffle`` is; one batch
    (``collator(samples)``) keeps its samples in order on the flat layout, where bin
    packing could only reorder them.
    """

    def __init__(
        self,
        max_len: int | None = None,
        backend: str = "sdpa",
        *,
        mask: str = "position_ids",
        pad_to_multiple_of: int | None = None,
        pad_to: int | None = None,
        fixed_cu_seqlens: int | None = None,
        return_tensors: str = "pt",
        separator_id: int | None = None,
        train_separators: bool = False,
        pad_id: int = 0,
        options: PackOptions | None = None,
        loss_mask_key: str | bool | None = None,
        mask_dtype: torch.dtype = torch.float32,
        return_seq_idx: bool = False,
        return_num_items: bool = False,
        threads: int | None = None,
        ignore_keys: Sequence[str] = (),
        model_config: Any = None,
        **kwargs: Unpack[PackArgs],
    ) -> None:
        # Every option is checked here, so a mistake fails where the collator is built,
        # not at the first batch.
        self.backend = _choice("backend", backend, BACKENDS)
        if self.backend == "flex":
            _warn_flex_on_cpu()
        if self.backend == "padded" and options is None and "strategy" not in kwargs:
            kwargs = {**kwargs, "strategy": _ONE_PER_ROW}  # the padded backend's default
        #: The packing options of every batch (and the base of a dataset's).
        self.options = with_separator(PackedCollator, options, max_len, kwargs, separator_id,
                                      refuse=_PER_PLAN)
        self.mask = _choice("mask", mask, MASK_MODES)
        self.pad_to_multiple_of = None if pad_to_multiple_of is None else _int_arg(
            "pad_to_multiple_of", pad_to_multiple_of, minimum=1, maximum=2**31 - 1
        )
        self.pad_to = None if pad_to is None else _int_arg(
            "pad_to", pad_to, minimum=1, maximum=2**63 - 1
        )
        self.separator_id = None if separator_id is None else _int_arg(
            "separator_id", separator_id, minimum=-(2**63), maximum=2**63 - 1
        )
        self.train_separators = _bool_arg("train_separators", train_separators)
        self.pad_id = _int_arg("pad_id", pad_id, minimum=-(2**63), maximum=2**63 - 1)
        if self.backend == "padded":
            if self.strategy != _ONE_PER_ROW:
                raise FastpackError(
                    f"strategy: {self.strategy!r} does not apply to backend='padded' (one "
                    f"sample per row); leave it out, or pass {_ONE_PER_ROW!r}"
                )
            if self.overlong in ("split", "drop"):
                raise FastpackError(
                    f"overlong: {self.overlong!r} does not apply to backend='padded' (one "
                    f"sample per row); expected 'error' or 'truncate'"
                )
            if self.options.cp_size is not None:
                raise FastpackError(
                    f"cp_size: {self.options.cp_size} does not apply to backend='padded' (one "
                    f"sample per row); context parallelism shards packed rows: backend='flash'"
                )
        if not (loss_mask_key is None or loss_mask_key is False or isinstance(loss_mask_key, str)):
            raise FastpackTypeError(
                f"loss_mask_key: expected a key (str), None (the first of {LOSS_MASK_KEYS} "
                f"present) or False (no mask), got {type(loss_mask_key).__name__} "
                f"{loss_mask_key!r}"
            )
        self.loss_mask_key = loss_mask_key
        if isinstance(ignore_keys, str) or not (
            isinstance(ignore_keys, Sequence) and all(isinstance(k, str) for k in ignore_keys)
        ):
            raise FastpackTypeError(
                f"ignore_keys: expected a sequence of key names, e.g. ('pixel_values',), "
                f"got {ignore_keys!r}"
            )
        self.ignore_keys = frozenset(ignore_keys)
        self._known = frozenset((*KNOWN_KEYS, *([loss_mask_key] if isinstance(
            loss_mask_key, str) else []))) | self.ignore_keys
        self.threads = _threads(threads)
        #: What the collator reads of a vision-language model's config (None: text only).
        self.vlm = None if model_config is None else VlmConfig.of(model_config)
        if self.vlm is not None:
            self._known |= frozenset(MEDIA_KEYS)
            if self.overlong in ("truncate", "split"):
                raise FastpackError(
                    f"overlong: {self.overlong!r} would cut a sample's image placeholders "
                    f"from its pixels; with model_config use 'error' or 'drop'"
                )
            if self.vlm.mrope and self.backend == "flex" and self.mask == "explicit":
                raise FastpackError(
                    f"mask: 'explicit' with backend='flex' makes a flex BlockMask, and Hugging "
                    f"Face runs {self.vlm.model_type} without flex attention; use "
                    f"backend='flash' or 'sdpa'"
                )
            if self.options.share_prefix:
                raise FastpackError(
                    f"share_prefix: True with model_config ({self.vlm.model_type}): a tree "
                    f"batch carries no media and no mRoPE positions (a response's would "
                    f"continue its prefix's compressed positions, not its tokens); pass one of "
                    f"model_config and share_prefix"
                )
            if self.options.cp_size is not None:
                raise FastpackError(
                    f"cp_size: {self.options.cp_size} with model_config "
                    f"({self.vlm.model_type}): vision-language batches are not sharded for "
                    f"context parallelism (shard_for_context_parallel would split the image "
                    f"placeholders and the mRoPE positions across ranks, not the media); pass "
                    f"one of model_config and cp_size"
                )
            placeholders = {self.vlm.image_token_id, self.vlm.video_token_id} - {None}
            for name, token in (("pad_id", self.pad_id), ("separator_id", self.separator_id)):
                if token is not None and token in placeholders:
                    raise FastpackError(
                        f"{name}: {token} is the model's image or video placeholder token; "
                        f"pick another id"
                    )
        if self.options.budgets and self.vlm is None:
            raise FastpackError(
                f"limits: {dict(self.options.budgets)} are counted from each sample's media; "
                f"pass model_config=model.config (or pack the dataset with fastpack.pack("
                f"lengths, limits={{name: (values, cap)}}))"
            )
        if self.options.share_prefix:
            self._check_tree_options(mask, return_tensors, fixed_cu_seqlens, return_seq_idx)
        self.format = BatchFormat(
            backend=self.backend, mask=self.mask,
            return_tensors=_choice("return_tensors", return_tensors, RETURN_TENSORS),
            fixed_cu_seqlens=fixed_cu_seqlens, mask_dtype=mask_dtype,
            return_seq_idx=return_seq_idx, return_num_items=return_num_items,
        )
        # One batch keeps its samples in order on the flat layout, where bin packing could
        # only reorder them; under budgets besides tokens the fit strategy places them (the
        # order of the media follows).
        flat = self.layout == "flat" and not self.options.budgets
        self._batch_options = self.options.replace(
            strategy="next_fit" if flat else self.options.strategy,
            shuffle=False,
        )

    def _check_tree_options(self, mask: str, return_tensors: Any, fixed_cu_seqlens: Any,
                            return_seq_idx: Any) -> None:
        """Refuses, by name, every argument a tree batch cannot honour (the packing
        options' own, ``overlong`` and the rest, are PackOptions')."""
        if self.backend not in TREE_BACKENDS:
            raise FastpackError(
                f"share_prefix: backend={self.backend!r} cannot express a tree (its packed "
                f"rows restart positions per sequence, so a response could not see its "
                f"prefix); use backend='flash' with attn_implementation="
                f"register_hf_attention(), or backend='flex' with 'flex_attention'"
            )
        refused = {
            "mask": (mask, "position_ids" if self.backend == "flash" else mask),
            "return_tensors": (return_tensors, "pt"),
            "fixed_cu_seqlens": (fixed_cu_seqlens, None),
            "return_seq_idx": (return_seq_idx, False),
        }
        for name, (value, accepted) in refused.items():
            if value != accepted:
                raise FastpackError(
                    f"{name}: {value!r} does not apply with share_prefix=True (a tree batch "
                    f"is one torch row whose attention_mask is the tree); expected "
                    f"{accepted!r}"
                )
        reason = flex_available()
        if reason is not None:
            raise FastpackError(f"share_prefix: needs flex attention's BlockMask; {reason}")

    @property
    def layout(self) -> str:
        return self.format.layout

    @property
    def return_tensors(self) -> str:
        return self.format.return_tensors

    # ------------------------------------------------------------------ collate
    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if isinstance(features, (str, bytes, Mapping)) or not isinstance(features, Sequence):
            raise FastpackTypeError(
                f"features: expected a list of samples (dicts with 'input_ids'), got "
                f"{type(features).__name__}"
            )
        if not features:
            raise FastpackError("features: got an empty batch; expected at least one sample")
        for i, f in enumerate(features):
            if type(f) is not dict and not isinstance(f, Mapping):
                raise FastpackTypeError(
                    f"features: sample {i} is {type(f).__name__}; expected a dict with "
                    f"'input_ids'"
                )
        pair = pair_keys(features[0])
        if pair is not None:
            if self.share_prefix:
                return self._pairs(features)
            if "input_ids" not in features[0]:
                raise FastpackError(
                    f"features: sample 0 is a preference pair ({', '.join(map(repr, pair))}"
                    f"); pairs are packed as trees, their prompt shared: pass "
                    f"share_prefix=True (backend 'flash' or 'flex')"
                )
        tokens = _from_rows(self._column(features, "input_ids"), mask=False, name="input_ids")
        lengths = tokens.lengths
        _refuse_negative(tokens)
        # Every key of the batch, once: the per-sample checks below run only when some
        # sample has a key that needs one (a batch of input_ids and labels skips them).
        keys = set().union(*features) if len(features) > 1 else set(features[0])
        if keys - self._known or "attention_mask" in keys or "position_ids" in keys:
            for i, f in enumerate(features):
                if f.keys() - self._known:
                    self.check_keys(f, i, int(lengths[i]))
                if "attention_mask" in f or "position_ids" in f:
                    _check_unpacked(f, i, int(lengths[i]), self.ignore_keys)
        if not lengths.any():
            raise FastpackError(
                f"features: the batch holds no tokens: sample(s) "
                f"{', '.join(map(str, range(min(len(features), 5))))}"
                f"{', ...' if len(features) > 5 else ''} have empty 'input_ids'"
            )
        labels = None
        if "labels" in keys:
            labels = _from_rows(self._column(features, "labels"), mask=False, name="labels")
        key = self._mask_key(features, keys)
        loss_mask = None if key is None else _from_rows(
            self._column(features, key), mask=True, name=key
        )
        if labels is not None:
            _warn_shifted(tokens, labels)
        if self.share_prefix:
            prompts = None
            key = prompt_key(features, stacklevel=3)
            if key is not None:
                prompts = prompt_codes(self._column(features, key), len(features), key)
            # One flat row holds every pack: the trees in the samples' order.
            plan = pack_trees(tokens, prompt_ids=prompts, options=self._batch_options,
                              threads=self.threads)
            if prompts is None and len(features) > 1 and plan.sample_tokens == plan.total_tokens:
                warnings.warn(
                    f"share_prefix: True, but the {len(features)} samples of this batch share "
                    f"no prefix ({plan.total_tokens} tokens computed, 0 saved): no sample has "
                    f"a {PROMPT_KEY!r} key, so they form a trie, and no two start alike; give "
                    f"RL rollouts of one prompt the prompt's id as {PROMPT_KEY!r}",
                    stacklevel=2,
                )
        elif self.options.budgets:
            assert self.vlm is not None
            values = media_budgets(features, [n for n, _ in self.options.budgets],
                                   mrope=self.vlm.mrope)
            limits = {n: (values[n], cap) for n, cap in self.options.budgets}
            plan = pack(lengths, options=self._batch_options, threads=self.threads,
                        limits=limits)
        else:
            plan = pack(lengths, options=self._batch_options, threads=self.threads)
        return self.batch(plan, tokens, None, labels=labels, loss_mask=loss_mask,
                          media=features if self.vlm is not None else None)

    def _pairs(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Preference pairs as a tree batch: pair ``k`` is samples ``2k`` (chosen) and
        ``2k + 1`` (rejected), sharing their prompt, in one pack."""
        keys = pair_keys(features[0])
        assert keys is not None
        for i, f in enumerate(features):
            extra = [k for k in ("input_ids", "labels", *LOSS_MASK_KEYS) if k in f]
            if extra:
                raise FastpackError(
                    f"features: pair {i} has {extra[0]!r} beside {keys[1]!r} / {keys[2]!r}; a "
                    f"preference pair is its prompt and two completions (the loss covers the "
                    f"completions), so pass one or the other"
                )
        tokens, loss_mask, prompts = preference_samples(features)
        plan = pack_trees(tokens, prompt_ids=prompts, split=False, options=self._batch_options,
                          threads=self.threads)
        return self.batch(plan, tokens, None, loss_mask=loss_mask)

    def check_keys(self, sample: Mapping[str, Any], index: int, length: int) -> None:
        """Raises if ``sample`` (number ``index``, of ``length`` tokens) carries a per-token
        key this collator would drop unasked (see ``ignore_keys``)."""
        if "seq_lengths" in sample:
            raise FastpackError(
                f"features: sample {index} has 'seq_lengths': it is already packed; pass "
                f"unpacked samples (one sequence each), or its rows with the boundaries "
                f"straight to the model"
            )
        for key in sorted(sample.keys() - self._known, key=str):
            if key in (PROMPT_KEY, OLD_PROMPT_KEY) and not self.share_prefix:
                raise FastpackError(
                    f"features: sample {index} has {key!r}, which says which samples "
                    f"share a prefix, but the collator packs them without sharing any; pass "
                    f"share_prefix=True (backend 'flash' or 'flex'), or ignore_keys="
                    f"({key!r},) to pack them plainly"
                )
            if key in MEDIA_KEYS and sample[key] is not None:
                raise FastpackError(
                    f"features: sample {index} has the media key {key!r}, but the collator "
                    f"has no model_config, so its images would be packed without their "
                    f"positions; pass PackedCollator(..., model_config=model.config), or "
                    f"ignore_keys=({key!r},) to drop it"
                )
            if length and _per_token(sample[key], length):
                close = difflib.get_close_matches(str(key), KNOWN_KEYS, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise FastpackError(
                    f"features: sample {index} has the per-token key {key!r} ({length} "
                    f"values, one per token), which is not packed: {hint}the keys read are "
                    f"{', '.join(KNOWN_KEYS)}; pass ignore_keys=({key!r},) to drop it"
                )

    @staticmethod
    def _column(features: Sequence[Mapping[str, Any]], key: str) -> list[Any]:
        try:
            return [f[key] for f in features]
        except KeyError:
            pass
        missing = [i for i, f in enumerate(features) if key not in f]
        if missing:
            raise FastpackError(
                f"features: sample {missing[0]} has no {key!r} ({len(missing)} of "
                f"{len(features)} samples lack it); expected every sample of a batch to have "
                f"{key!r} or none"
            )
        return [f[key] for f in features]

    def _mask_key(self, features: Sequence[Mapping[str, Any]], keys: set[Any]) -> str | None:
        """The loss-mask key of a batch whose samples have ``keys`` (all of them)."""
        if self.loss_mask_key is False:
            return None
        if isinstance(self.loss_mask_key, str):
            if self.loss_mask_key not in keys:
                raise FastpackError(
                    f"loss_mask_key: no sample has {self.loss_mask_key!r}; its keys are "
                    f"{sorted(features[0])}"
                )
            return self.loss_mask_key
        return next((k for k in LOSS_MASK_KEYS if k in keys), None)

    def plan(
        self, lengths: Any, *, options: PackOptions | None = None, media: Any = None,
        **kwargs: Unpack[PackArgs]
    ) -> Plan:
        """The plan this collator uses for samples of these lengths (a whole dataset): its
        per-batch options (``strategy`` whatever ``shuffle`` is), with the plan options
        given here (``shuffle``, ``seed``, ``long_max_len``, ``group_tokens``: see
        :func:`fastpack.pack`; shuffled with seed 0 by default). With the padded backend
        (strategy ``"one_per_pack"``) every sample is its own pack, in input order or
        shuffled by ``seed``. With ``limits``, ``media`` (the samples, or a
        ``datasets.Dataset`` with their grid columns) gives each sample's use of every
        budget."""
        opts, _ = layered(PackedCollator.plan, self.options, options, kwargs)
        if opts.share_prefix:
            raise FastpackError(
                "share_prefix: True plans the samples' tokens, not their lengths; use "
                "PackedDataset(tokens, collator) or fastpack.pack_trees(tokens, ...)"
            )
        return self._plan(lengths, opts, media)

    def _plan(self, lengths: Any, options: PackOptions, media: Any = None) -> Plan:
        if options.budgets:
            if media is None or self.vlm is None:
                raise FastpackError(
                    f"media: limits {dict(options.budgets)} are counted from each sample's "
                    f"media; pass media= (the samples, or a datasets.Dataset with their "
                    f"image_grid_thw / video_grid_thw columns)"
                )
            values = media_budgets(media, [n for n, _ in options.budgets], mrope=self.vlm.mrope)
            return pack(lengths, options=options, threads=self.threads,
                        limits={n: (values[n], cap) for n, cap in options.budgets})
        if self.backend == "padded" and (
                options.long_max_len is not None or options.group_tokens is not None):
            raise FastpackError(
                "long_max_len/group_tokens: do not apply to backend='padded' (one sample "
                "per row)"
            )
        return pack(lengths, options=options, threads=self.threads)

    def batch(
        self,
        plan: Plan,
        tokens: TokenData,
        packs: Any = None,
        *,
        labels: TokenData | None = None,
        loss_mask: TokenData | None = None,
        sample_ids: np.ndarray | None = None,
        media: Any = None,
    ) -> dict[str, Any]:
        """The batch of ``packs`` (default: all) of ``plan`` over ``tokens``. Every batch
        lists its samples in input order, on every backend — ``sample_ids`` (int64 [N],
        ascending: indices into ``tokens``, or into ``sample_ids`` when given; a split
        sample once per piece), ``sample_tokens`` (the flattened row positions of each
        sample's tokens, in order) and ``sample_offsets`` (int64 [N+1]) — which
        :func:`fastpack.torch.per_sample` reads. A plan of trees gives a tree batch. With a
        ``model_config``, ``media[i]`` is sample ``i``'s dict of media keys (a list of
        samples, a ``datasets.Dataset``, anything indexable like ``tokens``)."""
        if plan.parents is not None:
            if not self.share_prefix:
                raise FastpackError(
                    "plan: a plan of shared-prefix trees needs a collator made with "
                    "share_prefix=True"
                )
            rows = tree_rows(
                plan, tokens, packs, labels=labels, loss_mask=loss_mask, pad_to=self.pad_to,
                pad_to_multiple_of=self.pad_to_multiple_of, pad_id=self.pad_id,
                threads=self.threads,
            )
            if sample_ids is not None:
                rows["sample_ids"] = np.asarray(sample_ids, dtype=np.int64)[rows["sample_ids"]]
            return tree_batch(rows, return_num_items=self.format.return_num_items)
        if self.backend == "padded" and plan.strategy != _ONE_PER_ROW:
            # The padded format masks all but a row's first sequence as padding.
            raise FastpackError(
                f"plan: made with strategy {plan.strategy!r}, but backend='padded' needs one "
                f"sample per row; plan with the collator (collator.plan) or strategy="
                f"{_ONE_PER_ROW!r}"
            )
        rows = materialize(
            plan, tokens, packs, labels=labels, loss_mask=loss_mask,
            separator_id=self.separator_id, train_separators=self.train_separators,
            layout=self.layout, pad_to=self.pad_to, pad_to_multiple_of=self.pad_to_multiple_of,
            pad_id=self.pad_id, threads=self.threads,
        )
        # The media path sets the placeholders' labels to -100 (and lowers the rows' target
        # count), so it runs before the format reads the labels and num_items_in_batch.
        media_keys = (self._media(plan, tokens, packs, rows, media)
                      if self.vlm is not None else None)
        out = self.format(rows)
        if media_keys is not None:
            out.update(media_keys)
        listed = _samples(plan, packs, rows, sample_ids)
        conv = torch.from_numpy if self.return_tensors == "pt" else (lambda a: a)
        out.update({key: conv(value) for key, value in listed.items()})
        return out


    def _media(self, plan: Plan, tokens: TokenData, packs: Any, rows: dict[str, Any],
               media: Any) -> dict[str, Any]:
        """The media keys of the batch's rows (see :func:`fastpack.torch.media.media_batch`):
        every chosen sample's media, checked, in the order its placeholders take."""
        assert self.vlm is not None
        if media is None:
            raise FastpackError(
                "media: the collator has a model_config; pass each sample's media (its "
                "dict of pixel_values, image_grid_thw, ...) as media="
            )
        chosen = plan._packs(packs)
        offsets = np.asarray(plan.pack_offsets)
        order: Any = np.concatenate([np.asarray(plan.sample_ids[a:b]) for a, b in zip(
            offsets[chosen].tolist(), offsets[chosen + 1].tolist())]) if len(chosen) else []
        ragged = as_ragged(tokens)
        checked = [sample_media(self.vlm, media[i], i, np.asarray(ragged[i]))
                   for i in np.asarray(order, dtype=np.int64).tolist()]
        return media_batch(self.vlm, checked, rows, padded=self.backend == "padded",
                           return_tensors=self.return_tensors, threads=self.threads)


def _samples(plan: Plan, packs: Any, rows: dict[str, Any], mapping: np.ndarray | None
             ) -> dict[str, np.ndarray]:
    """The samples a plain batch holds, one per segment, in input order (ascending sample
    ids, a split sample's pieces in order) whatever order the plan put them in the rows:
    their ids, and each one's tokens as flattened row positions (a row's padding is in no
    sample)."""
    chosen = plan._packs(packs)
    offsets = np.asarray(plan.pack_offsets, dtype=np.int64)
    counts = offsets[chosen + 1] - offsets[chosen]
    segments = (np.repeat(offsets[chosen] - np.cumsum(counts) + counts, counts)
                + np.arange(int(counts.sum()), dtype=np.int64))
    seqlens = np.asarray(plan.seqlens, dtype=np.int64)[segments]
    ids = np.asarray(plan.sample_ids, dtype=np.int64)[segments]
    if mapping is not None:
        ids = np.asarray(mapping, dtype=np.int64)[ids]
    sample_offsets = np.zeros(len(seqlens) + 1, dtype=np.int64)
    np.cumsum(seqlens, out=sample_offsets[1:])
    total = int(sample_offsets[-1])
    width = int(rows["input_ids"].shape[-1])
    if rows["input_ids"].shape[0] == 1:  # one flat row: the packs end to end, padding last
        tokens = np.arange(total, dtype=np.int64)
    else:  # a row per pack, each padded at its end
        fills = plan.pack_fills[chosen]
        starts = np.cumsum(fills) - fills
        rows_of = np.repeat(np.arange(len(chosen), dtype=np.int64), fills)
        tokens = rows_of * width + np.arange(total, dtype=np.int64) - np.repeat(starts, fills)
    # One order on every backend: bin packing (rows) may reorder the samples, and code that
    # zips per-sample results with its inputs (rewards, advantages) reads them in input order.
    pieces = np.asarray(plan.starts, dtype=np.int64)[segments]
    order = np.lexsort((pieces, ids))
    if len(order) and np.any(order != np.arange(len(order))):
        lengths = seqlens[order]
        begins = sample_offsets[:-1][order]
        ids = ids[order]
        np.cumsum(lengths, out=sample_offsets[1:])
        tokens = tokens[np.repeat(begins - sample_offsets[:-1], lengths)
                        + np.arange(total, dtype=np.int64)]
    return {"sample_ids": ids, "sample_tokens": tokens, "sample_offsets": sample_offsets}


#: Whether the flex-on-the-CPU warning was given (once per process).
_FLEX_WARNED = False


def _warn_flex_on_cpu() -> None:
    """Hugging Face's ``flex_attention`` compiles (inductor) on its first call: tens of
    seconds on a CPU (~50 s for a small model), where a GPU takes a few. Said once, on a
    machine with no accelerator, where the model will run on the CPU."""
    global _FLEX_WARNED
    accelerator = getattr(torch, "accelerator", None)
    has = (accelerator.is_available() if accelerator is not None
           else torch.cuda.is_available())
    if _FLEX_WARNED or has:
        return
    _FLEX_WARNED = True
    warnings.warn(
        "backend='flex': no accelerator here, so the model's flex_attention runs on the "
        "CPU, where torch.compile compiles it on its first call (~50 s for a small model; "
        "later calls are fast). For short CPU runs, backend='flash' with "
        "register_hf_attention() (per-sequence SDPA, no compile) or backend='sdpa' is "
        "exact too",
        stacklevel=3,
    )


def _refuse_negative(tokens: Ragged) -> None:
    """Token ids index the embedding: a negative one would fail there, far from here."""
    values = np.asarray(tokens.values)
    if values.size and values.dtype.kind == "i" and values.min() < 0:
        at = int(np.argmax(values < 0))
        sample = int(np.searchsorted(np.asarray(tokens.offsets), at, side="right")) - 1
        raise FastpackError(
            f"input_ids: sample {sample} holds the negative token id {int(values[at])} (token "
            f"{at - int(tokens.offsets[sample])}); token ids index the vocabulary from 0"
        )


def _warn_shifted(tokens: Ragged, labels: Ragged) -> None:
    """Warns when every sample's labels look shifted already (``labels[:-1] ==
    input_ids[1:]``, the classic off-by-one: Hugging Face shifts them once more) and not
    aligned (``labels == input_ids``)."""
    ids, lab = np.asarray(tokens.values), np.asarray(labels.values)
    if ids.shape != lab.shape or ids.size < 2:
        return
    offsets = np.asarray(tokens.offsets)
    first = int(np.argmax(np.diff(offsets) > 1))  # a sample of 2 tokens or more
    lo, hi = int(offsets[first]), int(offsets[first + 1])
    if hi - lo < 2 or not np.all((lab[lo:hi - 1] == ids[lo + 1:hi])
                                 | (lab[lo:hi - 1] == IGNORE_INDEX)):
        return  # the common case, decided by one sample
    ends = offsets[1:] - 1
    inside = np.ones(ids.size, dtype=bool)
    inside[ends[ends >= 0]] = False  # a sample's last label has no next token
    inside[-1] = False
    where = np.flatnonzero(inside & (lab != IGNORE_INDEX))
    if not where.size:
        return
    shifted = bool(np.all(lab[where] == ids[where + 1]))
    if shifted and not np.all(lab[where] == ids[where]):
        warnings.warn(
            "labels: every label equals the next token (labels[:-1] == input_ids[1:]), so "
            "they look shifted already; Hugging Face models and fastpack's loss shift them "
            "once more (label t is the target of the logits at t - 1): pass unshifted labels "
            "(a copy of input_ids, -100 where there is no target)",
            stacklevel=3,
        )


def prompt_key(names: Any, stacklevel: int = 2) -> str | None:
    """The key (or column) of ``names`` that holds each sample's prompt id: every
    sample's keys (a sequence of samples) or a dataset's column names. The key of earlier
    releases, :data:`OLD_PROMPT_KEY`, is read with a ``DeprecationWarning``."""
    def has(key: str) -> bool:
        if isinstance(names, (list, tuple)) and names and isinstance(names[0], Mapping):
            return any(key in f for f in names)
        return key in names

    if has(PROMPT_KEY):
        return PROMPT_KEY
    if has(OLD_PROMPT_KEY):
        warnings.warn(f"the samples' {OLD_PROMPT_KEY!r} key is deprecated: name it "
                      f"{PROMPT_KEY!r} (a group is packs under group_tokens)",
                      DeprecationWarning, stacklevel=stacklevel + 1)
        return OLD_PROMPT_KEY
    return None


def as_collator(value: Any) -> PackedCollator:
    """``value`` if it is a :class:`PackedCollator` (what a dataset packs with), else the
    one error for it."""
    if not isinstance(value, PackedCollator):
        raise FastpackTypeError(
            f"collator: expected a fastpack.torch.PackedCollator, got {type(value).__name__}"
        )
    return value


def _per_token(value: Any, length: int) -> bool:
    """Whether ``value`` holds one number per token: a flat list, tuple, array or tensor
    of numbers as long as the sample's ``input_ids``."""
    if isinstance(value, (list, tuple)):
        return len(value) == length and isinstance(value[0], (int, float, np.number))
    if isinstance(value, np.ndarray) or type(value).__module__.startswith("torch"):
        shape = tuple(value.shape)
        return len(shape) == 1 and shape[0] == length
    return False


def _check_unpacked(sample: Mapping[str, Any], index: int, length: int,
                    ignore: frozenset[str]) -> None:
    """An ``attention_mask`` of ones and ``position_ids`` of ``0..n-1``: what an unpadded,
    unpacked sample carries (and fastpack rebuilds per pack)."""
    for key in ("attention_mask", "position_ids"):
        if key not in sample or key in ignore:
            continue
        value = sample[key]
        if type(value).__module__.startswith("torch"):
            value = value.detach().cpu().numpy()
        array = np.asarray(value).reshape(-1)
        expected = np.ones(length) if key == "attention_mask" else np.arange(length)
        if array.shape != (length,) or not np.array_equal(array, expected):
            what = ("zeros (a padded sample: fastpack packs unpadded ones)"
                    if key == "attention_mask" else "values other than 0..n-1 (a packed row?)")
            raise FastpackError(
                f"features: sample {index} has {key!r} with {what}; pass the sample's "
                f"real tokens only, or ignore_keys=({key!r},) if it is meant to be dropped"
            )

