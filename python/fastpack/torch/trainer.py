"""The Hugging Face ``Trainer`` / TRL ``SFTTrainer`` on many ranks with one global plan
(:class:`PackedTrainerMixin`), and the loader of a sampler's steps it trains on
(:class:`StepLoader`)."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from .._errors import FastpackError, FastpackTypeError
from ..cost import CostModel
from .collator import LOSS_MASK_KEYS, PackedCollator
from .context_parallel import ShardMask, shard_for_context_parallel
from .data import PackedDataset, first_item
from .hf_attention import _CONTEXT_PARALLEL
from .hf_check import _config_of, check_model_batch
from .loss import WEIGHTINGS, packed_loss
from .mixers import prepare_model, token_mixers
from .sampler import BALANCES, PackedSampler, Step
from .tree import is_tree_batch

__all__ = ["STEP_KEYS", "PackedTrainerMixin", "StepBatches", "StepLoader"]


#: Batch keys that carry an optimizer step's normalisers; models do not need them.
STEP_KEYS = ("num_items_in_batch", "num_sequences_in_batch")


_COST_WARNED: set[str] = set()


def _warn_cost_fallback(error: Exception) -> None:
    """Warn once per message that the cost model could not read the model's config."""
    text = str(error)
    if text in _COST_WARNED:
        return
    _COST_WARNED.add(text)
    warnings.warn(f"fastpack: the cost model cannot read this model's config ({text}); "
                  "the sampler balances 6·hidden_size·l + l² instead (pass cost= or "
                  "hidden_size= to choose)", stacklevel=3)


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
      non-empty steps on every rank. Its ``num_replicas``/``rank`` are the data-parallel
      group's: ``world_size // tp_size`` replicas, the ``tp_size`` tensor-parallel ranks
      of a replica (consecutive processes, accelerate's mesh order) sharing its steps;
      accelerate's context / sequence parallelism (``cp_size``/``sp_size`` > 1) raise.
    * **Context parallelism** (fastpack's): when the model's attention is
      ``register_hf_attention(context_parallel_group=group, mode=...)``, the collator
      must pack for that group (``PackedCollator(..., cp_size=, cp_mode=)``: every pack
      fits ``max_len`` once padded, checked), the ``cp · tp``
      consecutive processes of a data-parallel rank share its steps (``group`` must be
      those ranks), and every micro-batch is sharded for this rank
      (:func:`~fastpack.torch.shard_for_context_parallel`) before the forward. The loss
      is scaled by ``dp · cp`` (DDP averages the gradients of all of them; the CP ranks'
      add up to the step's), which is the Trainer's own ``num_processes // tp_size``.
      ``accumulation_steps`` is ``gradient_accumulation_steps``,
      the seed ``data_seed`` (else ``seed``), the cost model the model config's. Accelerate's
      own sharding is bypassed: it would re-split steps that are already per rank.
      ``per_device_train_batch_size`` is ignored — a step *is* the batch.
    * **Normaliser** (``get_batch_samples``): the Trainer counts the labels of a step's
      micro-batches and all-gathers the count; here every micro-batch already carries
      the exact count of its optimizer step over all ranks (``num_items_in_batch``), so
      there is no collective.
    * **Loss** (``compute_loss``): ``weighting="token"`` keeps the trainer's own loss
      (a model that takes ``num_items_in_batch``, TRL's fused loss and its metrics),
      which divides by that count and multiplies by the data-parallel size
      (``num_processes // tp_size``), as DDP/FSDP average gradients.
      ``weighting="sequence"`` (or a model that takes no loss kwargs) computes
      :func:`~fastpack.torch.packed_loss` from the logits, times the data-parallel size.
    * **Format check**: the first batch of each format goes through
      :func:`check_model_batch` against the model's ``attn_implementation``.
    * **Proof** (``verify_packing=True``, the default): the first training micro-batch
      of each rank goes through :func:`~fastpack.torch.verify_packing` — a few of its
      samples (``VERIFY_SAMPLES``, or the count given) run alone and compared with the
      packed forward, no gradients — and its cost is printed once (the local main
      process). A difference raises before the first backward, naming the module.
      Skipped with fastpack's context parallelism (a rank holds a shard, not samples).
      Either way the loss is already scaled for accumulation (``loss_is_scaled_for_ga``).

    Resuming from a checkpoint replays the schedule (the Trainer skips the consumed
    steps' indices; no batch is built for them); a checkpoint of another schedule (other
    ranks, accumulation steps, seed or dataset) is refused first (:meth:`check_resume`).
    Evaluation is untouched.

    Keyword args (besides the trainer's own):
        group_tokens, packs_per_batch: what a step is (see :class:`PackedDataset`);
            default: ``group_tokens = 4 * max_len``. Ignored for a ready PackedDataset.
        weighting: ``"token"`` (default) or ``"sequence"`` (see :func:`packed_loss`).
        balance: ``"flops"`` (default), ``"tokens"`` or ``None`` (see PackedSampler).
        cost: a :class:`fastpack.CostModel` (default: built from ``model.config``, or
            the older ``hidden_size`` estimate when the config is not one it reads).
        hidden_size: the older estimate's ``h``; given, it is used instead of the config.
        verify_packing: ``True`` (default: :attr:`VERIFY_SAMPLES` samples), a number of
            samples, or ``False`` to skip the check of the first micro-batch.
    """

    #: Samples of the first micro-batch that :func:`~fastpack.torch.verify_packing`
    #: runs alone by default.
    VERIFY_SAMPLES = 4

    def __init__(
        self,
        *args: Any,
        group_tokens: int | None = None,
        packs_per_batch: int | None = None,
        weighting: str = "token",
        balance: str | None = "flops",
        hidden_size: int | None = None,
        cost: Any = None,
        verify_packing: bool | int = True,
        **kwargs: Any,
    ) -> None:
        if isinstance(verify_packing, bool):
            self._fastpack_verify = self.VERIFY_SAMPLES if verify_packing else 0
        elif isinstance(verify_packing, int) and verify_packing >= 1:
            self._fastpack_verify = verify_packing
        else:
            raise FastpackError(
                f"verify_packing: expected True, False or a number of samples >= 1, got "
                f"{verify_packing!r}"
            )
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
            "balance": balance, "hidden_size": hidden_size, "cost": cost,
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
        if any(token_mixers(self.model)):  # type: ignore[attr-defined]
            prepare_model(self.model)  # type: ignore[attr-defined]  # mixers exact when packed
        if not self.args.average_tokens_across_devices:  # type: ignore[attr-defined]
            raise FastpackError(
                "average_tokens_across_devices: must be True with PackedTrainerMixin: the "
                "normaliser counts the tokens of every rank, so the loss is multiplied by the "
                "world size to undo the gradient averaging of DDP / FSDP"
            )
        self.loss_is_scaled_for_ga = True  # each micro-step carries its step's normaliser
        self._fastpack_checked: set[Any] = set()
        self._fastpack_cp = self._context_parallel()
        self.data_parallel_size, self.data_parallel_rank = self._data_parallel()

    def _parallel_size(self, method: str) -> int:
        get = getattr(self, method, None)
        return int(get()) if callable(get) else 1

    def _context_parallel(self) -> tuple[Any, str, int, int] | None:
        """``(group, mode, size, rank)`` when the model's attention is a context-parallel
        one (``register_hf_attention(context_parallel_group=...)``), else ``None``."""
        impl = getattr(_config_of(self.model), "_attn_implementation", None)  # type: ignore[attr-defined]
        if impl not in _CONTEXT_PARALLEL:
            return None
        group, mode = _CONTEXT_PARALLEL[impl]
        return group, mode, int(group.size()), int(group.rank())

    @property
    def context_parallel_size(self) -> int:
        """Ranks that share each step (1 without context parallelism)."""
        return 1 if self._fastpack_cp is None else self._fastpack_cp[2]

    def _data_parallel(self) -> tuple[int, int]:
        """``(size, rank)`` of this process's data-parallel group. Tensor-parallel ranks
        share a batch: accelerate's canonical mesh (dp_replicate, dp_shard, cp, sp, tp)
        puts tp innermost, so the ``tp_size`` consecutive processes form one replica;
        fastpack's context parallelism (the model's attention) puts cp around it, so
        ``cp · tp`` consecutive processes share each step."""
        args: Any = self.args  # type: ignore[attr-defined]
        for method, setting in (("get_cp_size", "cp_size"), ("get_sp_size", "sp_size")):
            size = self._parallel_size(method)
            if size > 1:
                raise FastpackError(
                    f"{setting}: {size}; PackedTrainerMixin does not support accelerate's "
                    f"context or sequence parallelism (it would split packed rows across ranks "
                    f"without their sequence boundaries); set parallelism_config's {setting} "
                    f"to 1 and use fastpack's: register_hf_attention(context_parallel_group=...)"
                )
        if hasattr(self, "get_tp_size"):
            tp = self._parallel_size("get_tp_size")
        else:  # a Trainer without get_tp_size: refuse a tensor-parallel model outright
            tp = int(getattr(getattr(self, "model", None), "_tp_size", None) or 1)
            if tp > 1:
                raise FastpackError(
                    f"tp_size: {tp}; this transformers has no Trainer.get_tp_size, so "
                    f"PackedTrainerMixin cannot map ranks to data-parallel replicas"
                )
        world = int(args.world_size)
        if tp < 1 or world % tp:
            raise FastpackError(
                f"tp_size: {tp} does not divide the world size {world}; expected a divisor"
            )
        cp = self.context_parallel_size
        if world % (tp * cp):
            raise FastpackError(
                f"context_parallel_group: {cp} ranks (times tp_size {tp}) do not divide the "
                f"world size {world}"
            )
        index = int(args.process_index)
        if self._fastpack_cp is not None and cp > 1:
            group, _, _, cp_rank = self._fastpack_cp
            first = index // (cp * tp) * cp * tp + index % tp
            want = [first + c * tp for c in range(cp)]
            have = sorted(torch.distributed.get_process_group_ranks(group))
            if have != want or want[cp_rank] != index:
                raise FastpackError(
                    f"context_parallel_group: process {index} is in the group of ranks "
                    f"{have}; PackedTrainerMixin expects ranks {want} (the cp · tp = {cp * tp} "
                    f"consecutive processes of one data-parallel rank, tp innermost)"
                )
        return world // (tp * cp), index // (tp * cp)

    # ------------------------------------------------------------------- data
    @property
    def packed_dataset(self) -> PackedDataset:
        """The packed training set (built from ``train_dataset`` on first use)."""
        if self._fastpack_dataset is None:
            self._fastpack_dataset = self._build_packed_dataset()
            self._check_context_parallel(self._fastpack_dataset)
        return self._fastpack_dataset

    #: The file each checkpoint holds the sampler's state in (settings, plan, position):
    #: a resume checks it against this run's sampler before skipping any step.
    SAMPLER_STATE_NAME = "fastpack_sampler.json"

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any,
              **kwargs: Any) -> Any:
        """The Trainer's ``train``; a resume is refused first when the checkpoint's schedule
        is not this run's (see :meth:`check_resume`)."""
        if resume_from_checkpoint:
            checkpoint = resume_from_checkpoint
            if checkpoint is True:
                from transformers.trainer_utils import get_last_checkpoint

                checkpoint = get_last_checkpoint(self.args.output_dir)  # type: ignore[attr-defined]
            if isinstance(checkpoint, (str, os.PathLike)):
                self.check_resume(checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]

    def check_resume(self, checkpoint: str | os.PathLike[str]) -> None:
        """Raise when ``checkpoint`` was saved on another schedule than this run's.

        The Trainer resumes by skipping as many steps as the checkpoint counted, by index:
        on another number of data-parallel ranks, other accumulation steps, another seed
        or another packed dataset those indices are other steps, and samples would be
        trained twice or never. A checkpoint saved by fastpack holds the sampler's state
        (:attr:`SAMPLER_STATE_NAME`); one without it (saved by another trainer, or before
        fastpack saved it) is checked on its number of processes, which the Trainer's RNG
        files give. To resume on another world size, drive a :class:`PackedSampler`
        yourself: its state re-plans the rest of the epoch for the new ranks."""
        folder = os.fspath(checkpoint)
        if not os.path.isdir(folder):
            return  # the Trainer's own load names the missing checkpoint
        sampler = self.packed_sampler
        how = ("resume with the data-parallel ranks and gradient_accumulation_steps it was "
               "saved with, or drive a PackedSampler with a StatefulDataLoader, whose state "
               "resumes on another world size")
        path = os.path.join(folder, self.SAMPLER_STATE_NAME)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                saved = json.load(f)
            mine = sampler.state_dict()
            for key in (*PackedSampler._SETTINGS, "num_steps", "plan"):
                if key in saved and saved[key] != mine[key]:
                    what = ("packed dataset (its plan)" if key == "plan"
                            else "packed dataset (its steps)" if key == "num_steps" else key)
                    values = ("" if key == "plan"
                              else f" ({saved[key]!r} there, {mine[key]!r} here)")
                    raise FastpackError(
                        f"resume_from_checkpoint: {folder} was saved on another {what}"
                        f"{values}: the Trainer resumes by skipping the steps it counted, "
                        f"which are other steps of this run's schedule, so samples would be "
                        f"trained twice or never; {how}"
                    )
            return
        saved_ranks = len([n for n in os.listdir(folder)
                           if n.startswith("rng_state_") and n.endswith(".pth")])
        if saved_ranks == 0 and os.path.isfile(os.path.join(folder, "rng_state.pth")):
            saved_ranks = 1
        world = int(self.args.world_size)  # type: ignore[attr-defined]
        if saved_ranks and saved_ranks != world:
            raise FastpackError(
                f"resume_from_checkpoint: {folder} was saved by {saved_ranks} process(es) and "
                f"this run has {world}: the Trainer resumes by skipping the steps it counted, "
                f"which are other steps of this run's schedule, so samples would be trained "
                f"twice or never; {how}"
            )

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)  # type: ignore[misc]
        sampler = self._fastpack_sampler
        args: Any = self.args  # type: ignore[attr-defined]
        if sampler is None or not args.should_save:
            return
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        step = self.state.global_step  # type: ignore[attr-defined]
        folder = os.path.join(self._get_output_dir(trial=trial),  # type: ignore[attr-defined]
                              f"{PREFIX_CHECKPOINT_DIR}-{step}")
        if os.path.isdir(folder):
            with open(os.path.join(folder, self.SAMPLER_STATE_NAME), "w", encoding="utf-8") as f:
                json.dump(sampler.state_dict(), f)

    @property
    def packed_sampler(self) -> PackedSampler:
        """This rank's :class:`PackedSampler` over :attr:`packed_dataset`."""
        if self._fastpack_sampler is None:
            args: Any = self.args  # type: ignore[attr-defined]
            options = self._fastpack_options
            hidden, cost = options["hidden_size"], options["cost"]
            config = getattr(self.model, "config", None)  # type: ignore[attr-defined]
            if hidden is None and cost is None and config is not None:
                try:
                    cost = CostModel.from_config(config)
                except (FastpackError, TypeError, ValueError) as error:
                    # A config it does not read (a new layer kind): balance on the
                    # hidden_size estimate rather than fail the run.
                    _warn_cost_fallback(error)
                    cost = None
            if hidden is None:
                hidden = getattr(config, "hidden_size", None) or 4096
            seed = args.data_seed if args.data_seed is not None else args.seed
            self._fastpack_sampler = PackedSampler(
                self.packed_dataset, num_replicas=self.data_parallel_size,
                rank=self.data_parallel_rank,
                shuffle=True, seed=seed, drop_last=bool(args.dataloader_drop_last),
                balance=options["balance"], hidden_size=int(hidden), cost=cost,
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

    def _check_context_parallel(self, dataset: PackedDataset) -> None:
        """The packing options must be the model's CP group's (every pack fits max_len once
        padded for it) — or no CP at all when the model's attention is not a CP one."""
        cp = self._fastpack_cp
        have = (dataset.options.cp_size, dataset.options.cp_mode)
        want = (None, "zigzag") if cp is None else (cp[2], cp[1])
        if have != want and not (cp is None and have[0] is None):
            if cp is None:
                model, fix = "not context-parallel", "leave cp_size out"
            else:
                model = f"context-parallel over {want[0]} ranks, mode {want[1]!r}"
                fix = f"build it with PackedCollator(..., cp_size={want[0]}, cp_mode={want[1]!r})"
            raise FastpackError(
                f"data_collator: packs for cp_size={have[0]}, cp_mode={have[1]!r}, but the "
                f"model's attention is {model}; {fix}"
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
        if self._fastpack_cp is not None:  # this rank's share of the step's row
            self._refuse_own_loss("context parallelism")
            _, mode, size, rank = self._fastpack_cp
            inputs = shard_for_context_parallel(
                inputs, size, rank, mode,
                pad_multiple=self.packed_dataset.options.pad_multiple)
        steps = {k: inputs[k] for k in STEP_KEYS if k in inputs}
        inputs = {k: v for k, v in inputs.items() if k not in STEP_KEYS}
        self._check_format(model, inputs)
        self._verify_first(model, inputs)
        parent: Any = super()
        accepts = bool(getattr(self, "model_accepts_loss_kwargs", False))
        # A tree batch has no labels (a shared token has several next tokens): its loss is
        # packed_loss over its target map.
        tree = is_tree_batch(inputs)
        if not tree and (not steps or (self.fastpack_weighting == "token" and accepts)):
            if steps and num_items_in_batch is None:
                num_items_in_batch = steps["num_items_in_batch"]
            return parent.compute_loss(model, inputs, return_outputs=return_outputs,
                                       num_items_in_batch=num_items_in_batch)
        self._refuse_own_loss("packed_loss")
        outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
        loss = packed_loss(outputs.logits, {**inputs, **steps},
                           weighting=self.fastpack_weighting)  # type: ignore[arg-type]
        # DDP / FSDP average gradients over every process but the tensor-parallel copies
        # (the data-parallel replicas and their CP ranks, whose gradients add up to the
        # step's); the normaliser counts all of them (the Trainer's own loss scales by
        # num_processes // tp_size, the same number).
        loss = loss * self.data_parallel_size * self.context_parallel_size
        return (loss, outputs) if return_outputs else loss

    def _verify_first(self, model: torch.nn.Module, inputs: dict[str, Any]) -> None:
        """:func:`~fastpack.torch.verify_packing` on the first training micro-batch (each
        rank its own; no collective), its cost printed once."""
        if not self._fastpack_verify or not model.training or "sample_ids" not in inputs:
            return
        count, self._fastpack_verify = self._fastpack_verify, 0
        show = getattr(self, "is_local_process_zero", lambda: True)()
        if self._fastpack_cp is not None:
            if show:
                print("fastpack: verify_packing skipped (context parallelism: each rank "
                      "holds a shard of the row, not whole samples)")
            return
        from .verify import verify_packing

        inner = model.module if isinstance(
            model, torch.nn.parallel.DistributedDataParallel) else model
        report = verify_packing(inner, inputs, samples=count)
        if show:
            print(f"fastpack: {report} (first micro-batch; off with verify_packing=False)")

    def _refuse_own_loss(self, path: str) -> None:
        """Hugging Face's label smoother and a ``compute_loss_func`` take ``labels`` and
        shift them themselves: on a context-parallel shard (not contiguous) that pairs
        tokens across chunk boundaries, and on the ``packed_loss`` path they would not run
        at all. Refused before the forward, by the option's name."""
        why = ("a context-parallel shard's labels are one rank's chunks glued together, "
               "so shifting them pairs tokens across chunk boundaries (the shard's "
               "shift_labels hold the right targets)" if path == "context parallelism" else
               "this step's loss is fastpack's packed_loss (weighting='sequence', a tree "
               "batch or a model without loss kwargs), which would skip it")
        if getattr(self, "label_smoother", None) is not None:
            factor = getattr(self.args, "label_smoothing_factor", None)  # type: ignore[attr-defined]
            raise FastpackError(
                f"label_smoothing_factor: {factor} is not supported with PackedTrainerMixin "
                f"here: {why}; set it to 0"
            )
        if getattr(self, "compute_loss_func", None) is not None:
            raise FastpackError(
                f"compute_loss_func: is not supported with PackedTrainerMixin here: {why}; "
                f"leave it out (or override compute_loss and read the batch's shift_labels)"
            )

    def _check_format(self, model: torch.nn.Module, inputs: dict[str, Any]) -> None:
        """:func:`check_model_batch` once per batch format (its keys and mask kind), so a
        wrong format/attention pair raises before the first forward, at no cost after."""
        mask = inputs.get("attention_mask")
        if isinstance(mask, ShardMask):  # a guard that raises on every read
            mask = None
        key = (tuple(sorted(inputs)), type(mask).__name__, getattr(mask, "ndim", None),
               getattr(mask, "dtype", None))
        if key not in self._fastpack_checked:
            check_model_batch(model, inputs)
            self._fastpack_checked.add(key)


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
