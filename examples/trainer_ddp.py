"""The Hugging Face Trainer (or TRL's SFTTrainer) on several data-parallel processes with
fastpack: one global plan, steps balanced across the ranks, every sample once, and the
loss of every optimizer step exactly that of one unpacked batch of the same samples.

    torchrun --nproc-per-node 2 examples/trainer_ddp.py --out /tmp/fastpack-ddp
    torchrun --nproc-per-node 2 examples/trainer_ddp.py --trainer trl --weighting sequence

Runs on the CPU (gloo) with a tiny random Llama; on GPUs drop ``use_cpu`` and
``ddp_backend``, load a real model with ``attn_implementation="flash_attention_2"`` (or
fastpack's ``register_hf_attention()``) and keep everything else. tests/test_trainer.py
runs it on 2 processes and checks the weights after one step against an unpacked
reference.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import datasets
import numpy as np
import torch
import transformers
from transformers import (
    Lfm2Config,
    Lfm2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)

from fastpack.torch import PackedCollator, PackedTrainerMixin, register_hf_attention

VOCAB = 61


def sft_data(n: int = 64, seed: int = 0) -> datasets.Dataset:
    """Tokenized prompt + answer pairs: ``input_ids`` and a 0/1 ``completion_mask``
    (the answer), the columns TRL's SFTTrainer produces for prompt-completion data."""
    rng = np.random.default_rng(seed)
    ids, masks = [], []
    for _ in range(n):
        prompt, answer = int(rng.integers(1, 30)), int(rng.integers(1, 30))
        ids.append(rng.integers(1, VOCAB, prompt + answer).tolist())
        masks.append([0] * prompt + [1] * answer)
    return datasets.Dataset.from_dict({"input_ids": ids, "completion_mask": masks})


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        attn_implementation=register_hf_attention(),  # per-sequence attention, no mask
    ))


def tiny_lfm2() -> Lfm2ForCausalLM:
    """A hybrid: a short causal convolution layer, then attention. PackedTrainerMixin
    prepares it (fastpack.torch.prepare_model): the convolution's window restarts at
    every packed sequence."""
    torch.manual_seed(0)
    return Lfm2ForCausalLM(Lfm2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        layer_types=["conv", "full_attention"], attn_implementation=register_hf_attention(),
    ))


MODELS = {"llama": tiny_llama, "lfm2": tiny_lfm2}


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """SFTTrainer wants a tokenizer (for its pad and EOS tokens); the data is tokenized."""
    from tokenizers import Tokenizer, models

    vocab = {str(i): i for i in range(VOCAB)}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="0")),
        pad_token="0", eos_token="1",
    )


COMMON = dict(  # one plain SGD step: the weights then show the gradient exactly
    per_device_train_batch_size=1, gradient_accumulation_steps=3, max_steps=1,
    learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
    max_grad_norm=0.0, seed=0, bf16=False, use_cpu=True, ddp_backend="gloo", report_to=[],
    save_strategy="no", logging_steps=1, disable_tqdm=True, ddp_find_unused_parameters=False,
)
GROUP_TOKENS = 192  # tokens per step (one step per rank per micro-step)
MAX_LEN = 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trainer", choices=("transformers", "trl"), default="transformers")
    ap.add_argument("--weighting", choices=("token", "sequence"), default="token")
    ap.add_argument("--model", choices=tuple(MODELS), default="llama")
    ap.add_argument("--out", default="/tmp/fastpack-ddp")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)

    collator = PackedCollator(max_len=MAX_LEN, backend="flash")
    if a.trainer == "trl":
        from trl import SFTConfig, SFTTrainer

        class PackedSFTTrainer(PackedTrainerMixin, SFTTrainer):
            pass

        args = SFTConfig(output_dir=a.out, max_length=None, **COMMON)
        trainer: Trainer = PackedSFTTrainer(
            model=MODELS[a.model](), args=args, train_dataset=sft_data(), data_collator=collator,
            processing_class=tiny_tokenizer(), group_tokens=GROUP_TOKENS, weighting=a.weighting,
        )
    else:

        class PackedTrainer(PackedTrainerMixin, Trainer):
            pass

        args = TrainingArguments(output_dir=a.out, **COMMON)
        trainer = PackedTrainer(
            model=MODELS[a.model](), args=args, train_dataset=sft_data(), data_collator=collator,
            group_tokens=GROUP_TOKENS, weighting=a.weighting,
        )
    result = trainer.train()
    sampler = trainer.packed_sampler  # type: ignore[attr-defined]
    if trainer.args.process_index == 0:
        print(f"{a.trainer} ({a.weighting}): {sampler.num_replicas} ranks, "
              f"{len(sampler)} steps per rank per epoch, loss {result.training_loss:.6f}")
        Path(a.out).mkdir(parents=True, exist_ok=True)
        torch.save(trainer.model.state_dict(), Path(a.out) / "weights.pt")
    if torch.distributed.is_initialized():
        # Leave together: a rank that exits while another still uses gloo's connections
        # can abort at interpreter exit after its work is done.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
