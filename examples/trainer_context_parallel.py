"""The Hugging Face Trainer with fastpack's context parallelism: every packed row split
across a context-parallel (CP) group, data-parallel replicas around the groups, and each
optimizer step exactly that of one unpacked batch of the same samples.

    torchrun --nproc-per-node 4 examples/trainer_context_parallel.py --cp 2 --out /tmp/fp-cp

Four processes are dp = 2 replicas × cp = 2 ranks (ranks 0-1 share one step, 2-3 the
other). It trains one step per run — a tiny Llama with zigzag, a tiny Qwen2 with the
contiguous layout, a tiny Llama with Ulysses (the model's own loss), a tiny Qwen2 with
zigzag and every sequence weighing the same (``packed_loss``) — on the CPU (gloo); on GPUs drop
``use_cpu`` and ``ddp_backend`` and keep the rest (fastpack's CP attention uses
ring-flash-attn or flash-attn there when installed). tests/test_trainer_context_parallel.py
runs it and checks the weights against one process's unpacked step.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_ddp import COMMON, VOCAB, sft_data  # noqa: E402

from fastpack.torch import (  # noqa: E402
    PackedCollator,
    PackedTrainerMixin,
    register_hf_attention,
)

#: run name: (model family, CP mode, loss weighting: the model's own token loss, or
#: fastpack's packed_loss weighing every sequence the same)
RUNS = {"llama-zigzag": ("llama", "zigzag", "token"),
        "qwen2-contiguous": ("qwen2", "contiguous", "token"),
        "llama-ulysses": ("llama", "ulysses", "token"),
        "qwen2-zigzag-sequence": ("qwen2", "zigzag", "sequence")}
MAX_LEN = 64
GROUP_TOKENS = 128  # two packs per step: one row of up to 128 tokens, split over the CP group


def tiny_model(family: str, attn_implementation: str) -> Any:
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  attn_implementation=attn_implementation)
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))


class PackedTrainer(PackedTrainerMixin, Trainer):
    pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cp", type=int, default=2, help="ranks per context-parallel group")
    ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated: " + ", ".join(RUNS))
    ap.add_argument("--out", default="/tmp/fastpack-cp")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)

    groups: list[Any] = []
    for run in a.runs.split(","):
        family, mode, weighting = RUNS[run]
        args = TrainingArguments(output_dir=str(Path(a.out) / run), **COMMON)
        world, rank = args.world_size, args.process_index  # starts torch.distributed
        if not groups:  # every process makes every group, in one order
            groups = [torch.distributed.new_group(list(range(first, first + a.cp)))
                      for first in range(0, world, a.cp)]
        name = register_hf_attention(context_parallel_group=groups[rank // a.cp], mode=mode)
        trainer = PackedTrainer(
            model=tiny_model(family, name), args=args, train_dataset=sft_data(),
            # Packs planned for the group: each fits MAX_LEN once padded for it.
            data_collator=PackedCollator(max_len=MAX_LEN, backend="flash", cp_size=a.cp,
                                         cp_mode=mode),
            group_tokens=GROUP_TOKENS, weighting=weighting,
        )
        result = trainer.train()
        sampler = trainer.packed_sampler
        if rank == 0:
            print(f"{run}: dp={sampler.num_replicas} x cp={trainer.context_parallel_size}, "
                  f"{len(sampler)} steps per rank per epoch, loss {result.training_loss:.6f}")
            (Path(a.out) / run).mkdir(parents=True, exist_ok=True)
            torch.save(trainer.model.state_dict(), Path(a.out) / run / "weights.pt")
    if torch.distributed.is_initialized():
        # Leave together: a rank that exits while another still uses gloo's connections
        # can abort at interpreter exit after its work is done.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
