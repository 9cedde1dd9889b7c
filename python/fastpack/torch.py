"""The PyTorch layer: packed batches that every attention backend trains on correctly.

:class:`PackedCollator` is a drop-in ``collate_fn`` for a ``torch.utils.data.DataLoader``
and ``data_collator`` for the Hugging Face ``Trainer`` / TRL: it packs the samples of a
batch (best-fit decreasing) and returns what ``model(**batch)`` needs for the chosen
backend. :class:`PackedDataset` packs a whole dataset once (near-zero padding across the
dataset, not only within a batch) and serves ready batches.

Backends (see ``../shared/RESEARCH.md`` for why each needs what it gets):

``"flash"``
    One flat row ``[1, T]`` with ``position_ids``, ``cu_seq_lens_q/k`` (int32) and
    ``max_length_q/k`` (int): Hugging Face's padding-free flash-attention path.
``"sdpa"``, ``"eager"``, ``"flex"``
    Default ``mask="position_ids"``: one row per pack ``[P, W]``, positions restarting at
    0 in every sequence, **no** ``attention_mask`` and ``use_cache=False`` — the only
    combination under which Hugging Face models build the block-diagonal mask from the
    positions (an all-ones mask or a KV cache silently attends across sequences).
    ``mask="explicit"`` passes the mask itself: bool ``[P, 1, W, W]`` for sdpa,
    additive float for eager (O(W²) memory per row), and for flex a ``BlockMask`` built
    from ``cu_seqlens`` over one flat row, with no dense intermediate.
``"padded"``
    The baseline: one sample per row, right-padded, with a 0/1 ``attention_mask``.

Every batch's ``labels`` are unshifted (the model shifts), -100 at the first token of
every sequence, on padding and where the sample's loss mask is 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ._errors import FastpackError, FastpackTypeError
from ._materialize import Ragged, TokenData, _from_rows, as_ragged, materialize
from ._plan import OVERLONG_POLICIES, STRATEGIES, Plan, _choice, _int_arg, pack
from .attention import varlen_attention

__all__ = [
    "BACKENDS",
    "LOSS_MASK_KEYS",
    "PackedCollator",
    "PackedDataset",
    "first_item",
    "register_hf_attention",
    "varlen_attention",
]

BACKENDS = ("flash", "sdpa", "eager", "flex", "padded")
MASK_MODES = ("position_ids", "explicit")
#: Per-sample keys read as a 0/1 loss mask, first match wins (Hugging Face chat templates
#: give ``assistant_masks``; TRL gives ``completion_mask``).
LOSS_MASK_KEYS = ("assistant_masks", "completion_mask", "loss_mask")


def register_hf_attention(name: str = "fastpack_varlen") -> str:
    """Registers :func:`varlen_attention` as a Hugging Face attention implementation.

    Load or switch the model with ``attn_implementation=name`` and feed it
    ``PackedCollator(backend="flash")`` batches: attention then runs per sequence from
    ``cu_seq_lens_q`` — flash-attn, ``torch.nn.attention.varlen`` or flex on CUDA, a
    per-sequence SDPA loop on the CPU — with no ``attention_mask`` and no O(T²) mask.
    Calls without ``cu_seq_lens_q`` (say, generation) fall back to Hugging Face's SDPA.
    Attention dropout is not supported on the packed path (it raises)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def fastpack_varlen(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        cu_seqlens = kwargs.get("cu_seq_lens_q")
        if cu_seqlens is None:
            return sdpa_attention_forward(  # type: ignore[no-any-return]
                module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                **kwargs,
            )
        if query.shape[0] != 1:
            raise FastpackError(
                f"{name}: expected one packed row (batch size 1), got {query.shape[0]} rows; "
                f"use PackedCollator(backend='flash')"
            )
        if dropout and module.training:
            raise FastpackError(
                f"{name}: attention dropout {dropout} is not supported on packed batches; "
                f"set the model's attention dropout to 0"
            )
        # Hugging Face hands (1, heads, T, D); varlen_attention takes (T, heads, D).
        out = varlen_attention(
            query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
            cu_seqlens, int(kwargs["max_length_q"]), causal=getattr(module, "is_causal", True),
            softmax_scale=scaling,
        )
        return out.unsqueeze(0), None  # (1, T, heads, D), as Hugging Face's sdpa returns

    AttentionInterface.register(name, fastpack_varlen)
    return name


def first_item(items: Sequence[Any]) -> Any:
    """``data_collator`` for a :class:`PackedDataset` under the Hugging Face ``Trainer``
    (with ``per_device_train_batch_size=1``): each item already is a whole batch."""
    if len(items) != 1:
        raise FastpackError(
            f"first_item: got {len(items)} items; a PackedDataset item is a whole batch, "
            "so use batch size 1"
        )
    return items[0]


class PackedCollator:
    """Pack a list of samples into one batch for ``model(**batch)``.

    Args:
        max_len: tokens per pack (row). Samples of a batch are bin-packed into packs of at
            most ``max_len`` tokens.
        backend: ``"flash"``, ``"sdpa"``, ``"eager"``, ``"flex"`` or ``"padded"`` — the
            model's ``attn_implementation`` (``"padded"``: the unpacked baseline).
        mask: ``"position_ids"`` (default; no ``attention_mask``) or ``"explicit"``
            (sdpa / eager / flex only; see the module docs).
        pad_to_multiple_of: round the row width (flash: the flat row) up to a multiple.
        pad_to: pad rows to exactly this width (flash: the flat row to this many tokens),
            for fixed shapes (CUDA graphs, ``torch.compile`` without recompiles).
        fixed_cu_seqlens: flash: pad ``cu_seq_lens_q/k`` to this many entries by
            repeating the last value (empty trailing sequences), for CUDA graphs.
        return_tensors: ``"pt"`` (torch, via ``torch.from_numpy``: no copy) or ``"np"``.
        separator_id: insert this token after every sample (reserved by the plan);
            ``train_separators`` makes it a target.
        strategy, overlong: passed to :func:`fastpack.pack` (``overlong`` decides what
            happens to a sample longer than ``max_len``: ``"error"`` by default).
        loss_mask_key: per-sample key of a 0/1 loss mask (default: the first of
            :data:`LOSS_MASK_KEYS` present); ``False`` to ignore masks.
        mask_dtype: dtype of the additive eager mask (match the model's dtype).
        return_seq_idx: add ``seq_idx`` (int32, segment index per token; Mamba / FLA).
        return_num_items: add ``num_items_in_batch`` (targets in the batch; the Trainer
            computes the same number itself, so this is for plain training loops).
    """

    def __init__(
        self,
        max_len: int,
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
        strategy: str = "bfd",
        overlong: str = "error",
        loss_mask_key: str | bool | None = None,
        mask_dtype: torch.dtype = torch.float32,
        return_seq_idx: bool = False,
        return_num_items: bool = False,
        threads: int | None = None,
    ) -> None:
        self.max_len = _int_arg("max_len", max_len, minimum=1)
        self.backend = _choice("backend", backend, BACKENDS)
        self.mask = _choice("mask", mask, MASK_MODES)
        if self.mask == "explicit" and self.backend not in ("sdpa", "eager", "flex"):
            raise FastpackError(
                f"mask: 'explicit' applies to sdpa, eager and flex, not {self.backend!r}"
            )
        self.pad_to_multiple_of = pad_to_multiple_of
        self.pad_to = pad_to
        self.fixed_cu_seqlens = fixed_cu_seqlens
        self.return_tensors = _choice("return_tensors", return_tensors, ("pt", "np"))
        self.separator_id = separator_id
        self.train_separators = train_separators
        self.pad_id = pad_id
        self.strategy = _choice("strategy", strategy, STRATEGIES)
        self.overlong = _choice("overlong", overlong, OVERLONG_POLICIES)
        self.loss_mask_key = loss_mask_key
        self.mask_dtype = mask_dtype
        self.return_seq_idx = return_seq_idx
        self.return_num_items = return_num_items
        self.threads = threads
        if fixed_cu_seqlens is not None and self.backend != "flash":
            raise FastpackError("fixed_cu_seqlens: applies to backend='flash' only")

    @property
    def reserve(self) -> int:
        return 0 if self.separator_id is None else 1

    @property
    def layout(self) -> str:
        flat = self.backend == "flash" or (self.backend == "flex" and self.mask == "explicit")
        return "flat" if flat else "rows"

    # ------------------------------------------------------------------ collate
    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if not features:
            raise FastpackError("features: got an empty batch")
        if not isinstance(features[0], Mapping):
            raise FastpackTypeError(
                f"features: expected dicts with 'input_ids', got {type(features[0]).__name__}"
            )
        tokens = _from_rows([f["input_ids"] for f in features], mask=False)
        labels = _from_rows([f["labels"] for f in features], mask=False) if (
            "labels" in features[0]
        ) else None
        key = self._mask_key(features[0])
        loss_mask = _from_rows([f[key] for f in features], mask=True) if key else None
        plan = self.plan(tokens.lengths)
        return self.batch(plan, tokens, None, labels=labels, loss_mask=loss_mask)

    def _mask_key(self, feature: Mapping[str, Any]) -> str | None:
        if self.loss_mask_key is False:
            return None
        if isinstance(self.loss_mask_key, str):
            if self.loss_mask_key not in feature:
                raise FastpackError(f"loss_mask_key: samples have no {self.loss_mask_key!r}")
            return self.loss_mask_key
        return next((k for k in LOSS_MASK_KEYS if k in feature), None)

    def plan(self, lengths: Any, *, shuffle: bool = False, seed: int = 0) -> Plan:
        """The plan this collator uses for samples of these lengths."""
        if self.backend == "padded":
            return _one_per_pack(np.asarray(lengths, dtype=np.int64), self.max_len,
                                 self.reserve, self.overlong)
        # One flat row holds every pack end to end: bin packing would only reorder the
        # samples, so keep their order (unless this plans a whole dataset).
        strategy = "next_fit" if self.layout == "flat" and not shuffle else self.strategy
        return pack(lengths, self.max_len, strategy=strategy, overlong=self.overlong,
                    reserve=self.reserve, shuffle=shuffle, seed=seed, threads=self.threads)

    def batch(
        self,
        plan: Plan,
        tokens: TokenData,
        packs: Any = None,
        *,
        labels: TokenData | None = None,
        loss_mask: TokenData | None = None,
    ) -> dict[str, Any]:
        """The batch of ``packs`` (default: all) of ``plan`` over ``tokens``."""
        rows = materialize(
            plan, tokens, packs, labels=labels, loss_mask=loss_mask,
            separator_id=self.separator_id, train_separators=self.train_separators,
            layout=self.layout, width=self.pad_to, pad_to_multiple_of=self.pad_to_multiple_of,
            pad_id=self.pad_id, threads=self.threads,
        )
        return self._format(rows)

    # ------------------------------------------------------------------ format
    def _format(self, rows: dict[str, Any]) -> dict[str, Any]:
        pt = self.return_tensors == "pt"
        conv = torch.from_numpy if pt else (lambda a: a)
        out: dict[str, Any] = {"input_ids": conv(rows["input_ids"])}
        seq_idx = rows["seq_idx"]
        if self.backend == "padded":
            out["attention_mask"] = conv((seq_idx == 0).astype(np.int64))
            out["labels"] = conv(rows["labels"])
            return self._extras(out, rows, conv)
        out["position_ids"] = conv(rows["position_ids"])
        out["labels"] = conv(rows["labels"])
        if self.backend == "flash":
            cu = rows["cu_seqlens"]
            if self.fixed_cu_seqlens is not None:
                cu = _pad_cu(cu, self.fixed_cu_seqlens)
            cu_t = conv(cu)
            out["cu_seq_lens_q"] = cu_t
            out["cu_seq_lens_k"] = cu_t
            out["max_length_q"] = int(rows["max_seqlen"])
            out["max_length_k"] = int(rows["max_seqlen"])
        elif self.mask == "explicit":
            out["attention_mask"] = self._explicit_mask(rows)
        out["use_cache"] = False
        return self._extras(out, rows, conv)

    def _extras(self, out: dict[str, Any], rows: dict[str, Any], conv: Any) -> dict[str, Any]:
        if self.return_seq_idx:
            out["seq_idx"] = conv(rows["seq_idx"])
        if self.return_num_items:
            n = int(rows["num_targets"])
            out["num_items_in_batch"] = torch.tensor(n) if self.return_tensors == "pt" else n
        return out

    def _explicit_mask(self, rows: dict[str, Any]) -> Any:
        if self.backend == "flex":
            from .attention import _document_block_mask

            cu = torch.from_numpy(rows["cu_seqlens"])
            return _document_block_mask(cu, int(cu[-1]), causal=True)
        seq = torch.from_numpy(rows["seq_idx"])
        width = seq.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool).tril_()
        allowed = (seq[:, :, None] == seq[:, None, :]) & causal  # [B, W, W]
        allowed = allowed[:, None]
        if self.backend == "sdpa":
            return allowed if self.return_tensors == "pt" else allowed.numpy()
        additive = torch.zeros(allowed.shape, dtype=self.mask_dtype)
        additive.masked_fill_(~allowed, torch.finfo(self.mask_dtype).min)
        return additive if self.return_tensors == "pt" else additive.numpy()


def _pad_cu(cu: np.ndarray, size: int) -> np.ndarray:
    if len(cu) > size:
        raise FastpackError(
            f"fixed_cu_seqlens: the batch has {len(cu) - 1} segments, more than "
            f"{size - 1}; raise fixed_cu_seqlens"
        )
    return np.pad(cu, (0, size - len(cu)), mode="edge")


def _one_per_pack(lengths: np.ndarray, max_len: int, reserve: int, overlong: str) -> Plan:
    """A plan with every sample in its own pack, in order (the padded baseline)."""
    if overlong in ("split", "drop"):
        raise FastpackError(f"overlong: {overlong!r} does not apply to backend='padded'")
    extended = lengths + reserve
    over = extended > max_len
    if over.any() and overlong == "error":
        i = int(np.argmax(over))
        raise FastpackError(
            f"lengths: {int(over.sum())} sequence(s) longer than {max_len} tokens (first at "
            f"index {i}, length {int(lengths[i])}); pass overlong='truncate' or raise max_len"
        )
    keep = lengths > 0
    seqlens = np.minimum(extended, max_len)[keep]
    n = int(keep.sum())
    return Plan({
        "sample_ids": np.flatnonzero(keep).astype(np.int64),
        "starts": np.zeros(n, dtype=np.int64),
        "seqlens": seqlens.astype(np.int32),
        "pack_offsets": np.arange(n + 1, dtype=np.int64),
        "max_len": max_len, "reserve": reserve, "strategy": "next_fit",
        "overlong": "truncate" if over.any() else "error",
        "num_sequences": len(lengths), "empty_sequences": int((~keep).sum()),
        "dropped_sequences": 0, "dropped_tokens": 0,
        "truncated_sequences": int(over.sum()),
        "truncated_tokens": int((extended - np.minimum(extended, max_len)).sum()),
        "split_sequences": 0, "total_tokens": int(seqlens.sum()),
    })


class PackedDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A whole dataset packed once; item ``b`` is a ready batch of ``packs_per_batch``
    packs (formatted by ``collator``).

    Pack the full dataset instead of each batch and padding all but disappears:
    best-fit decreasing over every length reaches within a pack or two of the lower
    bound. Packs are shuffled (``seed``) so batches do not come sorted by length.

    >>> ds = PackedDataset(tokens, PackedCollator(max_len=4096, backend="sdpa"))
    >>> loader = torch.utils.data.DataLoader(ds, batch_size=None, shuffle=True)

    With the Hugging Face ``Trainer``: ``train_dataset=ds``,
    ``data_collator=fastpack.torch.first_item``, ``per_device_train_batch_size=1``.

    Args:
        tokens: token data (see :func:`fastpack.as_ragged`; a ``datasets.Dataset`` is read
            from its Arrow buffers, column ``"input_ids"``).
        collator: the :class:`PackedCollator` whose ``max_len``, backend and options to use.
        labels, loss_mask: optional per-token labels / 0/1 mask (column names with a
            ``datasets.Dataset``).
        packs_per_batch: packs (rows) per item.
        plan: a precomputed plan over ``tokens`` (default: packed here).
    """

    def __init__(
        self,
        tokens: TokenData,
        collator: PackedCollator,
        *,
        labels: TokenData | str | None = None,
        loss_mask: TokenData | str | None = None,
        packs_per_batch: int = 1,
        plan: Plan | None = None,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        dataset = tokens if _is_dataset(tokens) else None
        self.tokens: Ragged = as_ragged(tokens)
        self.labels = _resolve(labels, dataset, mask=False)
        self.loss_mask = _resolve(loss_mask, dataset, mask=True)
        self.collator = collator
        self.packs_per_batch = _int_arg("packs_per_batch", packs_per_batch, minimum=1)
        self.plan = plan if plan is not None else collator.plan(
            self.tokens.lengths, shuffle=shuffle, seed=seed
        )

    def __len__(self) -> int:
        return -(-self.plan.num_packs // self.packs_per_batch)

    def __getitem__(self, index: int) -> dict[str, Any]:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"batch {index} out of range; the dataset has {n} batches")
        lo = (index % n) * self.packs_per_batch
        packs = np.arange(lo, min(lo + self.packs_per_batch, self.plan.num_packs))
        return self.collator.batch(
            self.plan, self.tokens, packs, labels=self.labels, loss_mask=self.loss_mask
        )

    def __iter__(self) -> Iterable[dict[str, Any]]:
        return (self[i] for i in range(len(self)))


def _is_dataset(obj: Any) -> bool:
    return type(obj).__module__.startswith("datasets") and hasattr(obj, "column_names")


def _resolve(data: Any, dataset: Any, *, mask: bool) -> Ragged | None:
    if data is None:
        return None
    if isinstance(data, str):
        if dataset is None:
            raise FastpackTypeError("labels/loss_mask: a column name needs a datasets.Dataset")
        return as_ragged(dataset, column=data, mask=mask)
    return as_ragged(data, mask=mask)


