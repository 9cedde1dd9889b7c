"""Hugging Face integration: fastpack's per-sequence attention as an attention
implementation of transformers models (:func:`register_hf_attention`), and the
``Trainer`` / TRL ``SFTTrainer`` on many ranks with one global plan
(:class:`PackedTrainerMixin`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from .._errors import FastpackError, FastpackTypeError
from .attention import varlen_attention
from .collator import LOSS_MASK_KEYS, PackedCollator
from .data import PackedDataset, first_item
from .loss import WEIGHTINGS, packed_loss
from .sampler import BALANCES, PackedSampler, Step

__all__ = ["PackedTrainerMixin", "StepBatches", "StepLoader", "register_hf_attention"]


def register_hf_attention(name: str = "fastpack_varlen") -> str:
    """Registers :func:`varlen_attention` as a Hugging Face attention implementation.

    Load or switch the model with ``attn_implementation=name`` and feed it
    ``PackedCollator(backend="flash")`` batches: attention then runs per sequence from
    ``cu_seq_lens_q`` — flash-attn, ``torch.nn.attention.varlen`` or flex on CUDA, a
    per-sequence SDPA loop on the CPU — with no ``attention_mask`` and no O(T²) mask.
    Calls without ``cu_seq_lens_q`` (say, generation) fall back to Hugging Face's SDPA.
    Attention dropout is not supported on the packed path (it raises)."""
    if not isinstance(name, str) or not name:
        raise FastpackTypeError(
            f"name: expected a non-empty string (the attn_implementation to register), got "
            f"{type(name).__name__} {name!r}"
        )
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
        device = query.device.type
        if torch.is_autocast_enabled(device):  # as SDPA does under autocast
            dtype = torch.get_autocast_dtype(device)
            query, key, value = (t.to(dtype) for t in (query, key, value))
        # Hugging Face hands (1, heads, T, D); varlen_attention takes (T, heads, D).
        out = varlen_attention(
            query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
            cu_seqlens, int(kwargs["max_length_q"]), causal=getattr(module, "is_causal", True),
            softmax_scale=scaling,
        )
        return out.unsqueeze(0), None  # (1, T, heads, D), as Hugging Face's sdpa returns

    AttentionInterface.register(name, fastpack_varlen)
    return name


# --------------------------------------------------------------------------- Trainer

#: Batch keys that carry an optimizer step's normalisers; models do not need them.
STEP_KEYS = ("num_items_in_batch", "num_sequences_in_batch")


class PackedTrainerMixin:
    """Hugging Face ``Trainer`` / TRL ``SFTTrainer`` on many ranks with one global plan.

    Mix it in *before* the trainer class::

        class PackedTrainer(PackedTrainerMixin, Trainer): ...      # or SFTTrainer

        trainer = PackedTrainer(model=model, args=args, train_dataset=ds,
                                data_collator=PackedCollator(max_len=4096, backend="flash"),
                                group_tokens=16384)

    What it changes, and why:

    * **Data** (``get_train_dataloader``): ``train_dataset`` — a tokenized
      ``datasets.Dataset`` (TRL accepts nothing else) or a ready
      :class:`~fastpack.torch.PackedDataset` — is packed *once* into one global plan
      (identical on every rank), and a :class:`~fastpack.torch.PackedSampler` hands each
      rank its steps: balanced in work, every sample once per epoch, the same number of
      non-empty steps on every rank. Its ``num_replicas``/``rank`` come from the
      ``TrainingArguments``, ``accumulation_steps`` is ``gradient_accumulation_steps``,
      the seed ``data_seed`` (else ``seed``), ``hidden_size`` the model's. Accelerate's
      own sharding is bypassed: it would re-split steps that are already per rank.
      ``per_device_train_batch_size`` is ignored — a step *is* the batch.
    * **Normaliser** (``get_batch_samples``): the Trainer counts the labels of a step's
      micro-batches and all-gathers the count; here every micro-batch already carries
      the exact count of its optimizer step over all ranks (``num_items_in_batch``), so
      there is no collective.
    * **Loss** (``compute_loss``): ``weighting="token"`` keeps the trainer's own loss
      (a model that takes ``num_items_in_batch``, TRL's fused loss and its metrics),
      which divides by that count and multiplies by the world size, as DDP/FSDP average
      gradients. ``weighting="sequence"`` (or a model that takes no loss kwargs) computes
      :func:`~fastpack.torch.packed_loss` from the logits, times the world size.
      Either way the loss is already scaled for accumulation (``loss_is_scaled_for_ga``).

    Resuming from a checkpoint replays the schedule (the Trainer skips the consumed
    steps' indices; no batch is built for them). Evaluation is untouched.

    Keyword args (besides the trainer's own):
        group_tokens, packs_per_batch: what a step is (see :class:`PackedDataset`);
            default: ``group_tokens = 4 * max_len``. Ignored for a ready PackedDataset.
        weighting: ``"token"`` (default) or ``"sequence"`` (see :func:`packed_loss`).
        balance: ``"flops"`` (default), ``"tokens"`` or ``None`` (see PackedSampler).
        hidden_size: the cost model's ``h`` (default: ``model.config.hidden_size``).
    """

    def __init__(
        self,
        *args: Any,
        group_tokens: int | None = None,
        packs_per_batch: int | None = None,
        weighting: str = "token",
        balance: str | None = "flops",
        hidden_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        if weighting not in WEIGHTINGS:
            raise FastpackError(
                f"weighting: unknown value {weighting!r}; expected 'token' or 'sequence'"
            )
        if balance not in BALANCES:
            raise FastpackError(
                f"balance: unknown value {balance!r}; expected one of "
                f"{', '.join(map(repr, BALANCES))}"
            )
        self.fastpack_weighting = weighting
        self._fastpack_options: dict[str, Any] = {
            "group_tokens": group_tokens, "packs_per_batch": packs_per_batch,
            "balance": balance, "hidden_size": hidden_size,
        }
        self._fastpack_dataset: PackedDataset | None = None
        self._fastpack_sampler: PackedSampler | None = None
        import transformers

        if not hasattr(transformers.Trainer, "loss_is_scaled_for_ga"):
            raise FastpackError(
                f"PackedTrainerMixin needs transformers >= 5.19 (Trainer.loss_is_scaled_for_ga),"
                f" got {transformers.__version__}"
            )
        super().__init__(*args, **kwargs)
        if not self.args.average_tokens_across_devices:  # type: ignore[attr-defined]
            raise FastpackError(
                "average_tokens_across_devices: must be True with PackedTrainerMixin: the "
                "normaliser counts the tokens of every rank, so the loss is multiplied by the "
                "world size to undo the gradient averaging of DDP / FSDP"
            )
        self.loss_is_scaled_for_ga = True  # each micro-step carries its step's normaliser

    # ------------------------------------------------------------------- data
    @property
    def packed_dataset(self) -> PackedDataset:
        """The packed training set (built from ``train_dataset`` on first use)."""
        if self._fastpack_dataset is None:
            self._fastpack_dataset = self._build_packed_dataset()
        return self._fastpack_dataset

    @property
    def packed_sampler(self) -> PackedSampler:
        """This rank's :class:`PackedSampler` over :attr:`packed_dataset`."""
        if self._fastpack_sampler is None:
            args: Any = self.args  # type: ignore[attr-defined]
            options = self._fastpack_options
            hidden = options["hidden_size"]
            if hidden is None:
                config = getattr(self.model, "config", None)  # type: ignore[attr-defined]
                hidden = getattr(config, "hidden_size", None) or 4096
            seed = args.data_seed if args.data_seed is not None else args.seed
            self._fastpack_sampler = PackedSampler(
                self.packed_dataset, num_replicas=args.world_size, rank=args.process_index,
                shuffle=True, seed=seed, drop_last=bool(args.dataloader_drop_last),
                balance=options["balance"], hidden_size=int(hidden),
                accumulation_steps=args.gradient_accumulation_steps,
            )
        return self._fastpack_sampler

    def _build_packed_dataset(self) -> PackedDataset:
        data: Any = self.train_dataset  # type: ignore[attr-defined]
        if isinstance(data, PackedDataset):
            return data
        if data is None:
            raise FastpackError("train_dataset: PackedTrainerMixin needs a training dataset")
        collator: Any = self.data_collator  # type: ignore[attr-defined]
        if not isinstance(collator, PackedCollator):
            raise FastpackTypeError(
                f"data_collator: expected a fastpack PackedCollator (its max_len, backend and "
                f"options pack the dataset), got {type(collator).__name__}"
            )
        columns = list(getattr(data, "column_names", None) or [])
        if "input_ids" not in columns:
            raise FastpackError(
                f"train_dataset: expected a tokenized datasets.Dataset with an 'input_ids' "
                f"column (or a PackedDataset), got columns {columns}"
            )
        mask = collator.loss_mask_key
        if mask is None:
            mask = next((k for k in LOSS_MASK_KEYS if k in columns), None)
        options = self._fastpack_options
        group, packs = options["group_tokens"], options["packs_per_batch"]
        if group is None and packs is None:
            group = 4 * collator.max_len
        args: Any = self.args  # type: ignore[attr-defined]
        return PackedDataset(
            data, collator, labels="labels" if "labels" in columns else None,
            loss_mask=mask or None, group_tokens=group, packs_per_batch=packs, seed=args.seed,
        )

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
        args: Any = self.args  # type: ignore[attr-defined]
        kwargs: dict[str, Any] = {}
        if args.dataloader_num_workers > 0:
            kwargs["persistent_workers"] = args.dataloader_persistent_workers
            kwargs["prefetch_factor"] = args.dataloader_prefetch_factor
        return StepLoader(
            self.packed_dataset, self.packed_sampler, num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory, **kwargs,
        )

    # ------------------------------------------------------------------- loss
    def get_batch_samples(
        self, epoch_iterator: Iterator[dict[str, Any]], num_batches: int, device: Any
    ) -> tuple[list[dict[str, Any]], torch.Tensor | None]:
        batches: list[dict[str, Any]] = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        counts = {int(b["num_items_in_batch"]) for b in batches if "num_items_in_batch" in b}
        if len(counts) > 1:
            raise FastpackError(
                f"num_items_in_batch: the micro-batches of one optimizer step disagree "
                f"({sorted(counts)}); gradient_accumulation_steps must equal the sampler's "
                f"accumulation_steps"
            )
        if not counts:
            return batches, None
        return batches, torch.tensor(counts.pop(), device=device)

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        steps = {k: inputs[k] for k in STEP_KEYS if k in inputs}
        inputs = {k: v for k, v in inputs.items() if k not in STEP_KEYS}
        parent: Any = super()
        accepts = bool(getattr(self, "model_accepts_loss_kwargs", False))
        if not steps or (self.fastpack_weighting == "token" and accepts):
            if steps and num_items_in_batch is None:
                num_items_in_batch = steps["num_items_in_batch"]
            return parent.compute_loss(model, inputs, return_outputs=return_outputs,
                                       num_items_in_batch=num_items_in_batch)
        outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
        loss = packed_loss(outputs.logits, {**inputs, **steps},
                           weighting=self.fastpack_weighting)  # type: ignore[arg-type]
        loss = loss * self.args.world_size  # type: ignore[attr-defined]
        return (loss, outputs) if return_outputs else loss


class StepBatches(torch.utils.data.Sampler):  # type: ignore[type-arg]
    """A :class:`PackedSampler` as a batch sampler of one step per batch (what Accelerate's
    ``skip_first_batches`` can skip by index, when the Trainer resumes mid-epoch)."""

    def __init__(self, sampler: PackedSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[list[Step]]:
        return ([step] for step in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


class StepLoader(torch.utils.data.DataLoader):  # type: ignore[type-arg]
    """A ``DataLoader`` of a :class:`PackedDataset`'s steps in a :class:`PackedSampler`'s
    order, with ``set_epoch`` (which the Trainer calls every epoch)."""

    def __init__(self, dataset: PackedDataset, sampler: PackedSampler, **kwargs: Any) -> None:
        super().__init__(dataset, batch_sampler=StepBatches(sampler), collate_fn=first_item,
                         **kwargs)
        self.step_sampler = sampler

    def set_epoch(self, epoch: int) -> None:
        self.step_sampler.set_epoch(epoch)
