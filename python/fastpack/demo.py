"""`python -m fastpack.demo`: pack the lengths of a real corpus shipped with fastpack and
compare with padding.

The corpus is CPython's standard library: every top-level function and class is one
document (``"functions"``, SFT-like: many short, a long tail), every module one document
(``"modules"``, pretraining-like). Lengths are GPT-2-style pre-token counts; see
``benches/make_example_lengths.py``.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from ._examples import EXAMPLES, example_lengths
from ._plan import pack

__all__ = ["main"]

def _padded_efficiency(pieces: np.ndarray, max_len: int, batch: int, seed: int) -> float:
    """Each batch of ``batch`` random sequences padded to its longest one."""
    order = np.random.default_rng(seed).permutation(len(pieces))
    shuffled = pieces[order]
    n_batches = -(-len(shuffled) // batch)
    padded = np.resize(shuffled, n_batches * batch)
    padded[len(shuffled):] = 0
    longest = padded.reshape(n_batches, batch).max(axis=1)
    return float(pieces.sum() / (longest.sum() * batch))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastpack.demo", description=__doc__)
    parser.add_argument("--example", choices=EXAMPLES, default="functions")
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=32, help="rows per padded batch")
    args = parser.parse_args(argv)
    lengths = example_lengths(args.example)
    max_len = args.max_len
    # Padding needs the same over-long handling as packing: cut into pieces of max_len.
    full, rest = np.divmod(lengths.astype(np.int64), max_len)
    pieces = np.concatenate([np.full(int(full.sum()), max_len), rest[rest > 0]])
    tokens = int(lengths.sum())

    print(f"fastpack demo: {len(lengths):,} documents ({args.example} of CPython's standard "
          f"library), {tokens:,} tokens, max_len {max_len:,}")
    print(f"  lengths: median {int(np.median(lengths)):,}, mean {lengths.mean():,.0f}, "
          f"max {int(lengths.max()):,}; {int((lengths > max_len).sum()):,} longer than max_len "
          f"(split into pieces)")
    print()
    print(f"  {'method':38} {'rows':>9} {'efficiency':>11} {'time':>9}")
    row = "  {:38} {:>9,} {:>10.2%} {:>9}"
    print(row.format("pad every sequence to max_len", len(pieces),
                     tokens / (len(pieces) * max_len), ""))
    print(row.format(f"pad batches of {args.batch} to their longest", len(pieces),
                     _padded_efficiency(pieces, max_len, args.batch, seed=0), ""))
    plans = {}
    for strategy in ("next_fit", "wrapped", "ffd", "bfd"):
        start = time.perf_counter()
        plan = pack(lengths, max_len, strategy=strategy, overlong="split", shuffle=True)
        elapsed = time.perf_counter() - start
        plans[strategy] = plan
        print(row.format(f"fastpack.pack(strategy={strategy!r})", plan.num_packs,
                         plan.efficiency, f"{elapsed * 1e3:.1f} ms"))
    bfd = plans["bfd"]
    print()
    print(f"  bfd: {bfd.num_packs:,} packs for a lower bound of {bfd.lower_bound:,} "
          f"(+{bfd.num_packs - bfd.lower_bound}); {bfd.split_sequences:,} sequences split, "
          f"0 tokens lost")
    ids, starts, seqlens = bfd.segments(0)
    print(f"  pack 0: {len(ids)} segments from sequences {ids[:6].tolist()}"
          f"{' ...' if len(ids) > 6 else ''}")
    print(f"          cu_seqlens {bfd.cu_seqlens(0)[:7].tolist()}{' ...' if len(ids) > 6 else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
