"""`python -m fastpack.demo`: pack the lengths of a real corpus shipped with fastpack and
compare with padding.

The corpus is CPython's standard library: every top-level function and class is one
document (``"functions"``, SFT-like: many short, a long tail), every module one document
(``"modules"``, pretraining-like). Lengths are GPT-2-style pre-token counts; see
``benches/make_example_lengths.py``. Every number printed is computed from the corpus and
the plans on this run.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import numpy as np

from ._examples import EXAMPLES, example_lengths
from ._options import MAX_LEN_LIMIT
from ._plan import Plan, pack

__all__ = ["main"]

STRATEGIES = ("next_fit", "wrapped", "ffd", "bfd")


@dataclass
class Row:
    method: str
    rows: int
    efficiency: float
    seconds: float | None = None


def _rows(lengths: np.ndarray, max_len: int, overlong: str) -> np.ndarray:
    """The rows padding needs under the same over-long policy as the packing: each
    document, split into pieces of at most ``max_len``, truncated, or dropped."""
    lengths = lengths.astype(np.int64)
    if overlong == "truncate":
        return np.minimum(lengths, max_len)
    if overlong == "drop":
        return lengths[lengths <= max_len]
    full, rest = np.divmod(lengths, max_len)
    return np.concatenate([np.full(int(full.sum()), max_len), rest[rest > 0]])


def _padded_batches(pieces: np.ndarray, batch: int, seed: int) -> tuple[int, float]:
    """Rows and efficiency of batches of ``batch`` random pieces padded to their longest."""
    order = np.random.default_rng(seed).permutation(len(pieces))
    shuffled = pieces[order]
    n_batches = -(-len(shuffled) // batch)
    padded = np.resize(shuffled, n_batches * batch)
    padded[len(shuffled):] = 0
    longest = padded.reshape(n_batches, batch).max(axis=1)
    return len(pieces), float(pieces.sum() / (longest.sum() * batch))


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 1 <= value <= MAX_LEN_LIMIT:
        raise argparse.ArgumentTypeError(f"got {value}; expected an integer in 1..={MAX_LEN_LIMIT}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastpack.demo", description=__doc__)
    parser.add_argument("--example", choices=EXAMPLES, default="functions")
    parser.add_argument("--max-len", type=_positive, default=4096)
    parser.add_argument("--batch", type=_positive, default=32, help="rows per padded batch")
    parser.add_argument("--overlong", choices=("split", "truncate", "drop"), default="split",
                        help="what becomes of documents longer than max_len")
    args = parser.parse_args(argv)
    lengths = example_lengths(args.example)
    max_len = args.max_len
    pieces = _rows(lengths, max_len, args.overlong)
    tokens = int(lengths.sum(dtype=np.int64))
    over = int((lengths > max_len).sum())
    verb = {"split": "split into pieces", "truncate": "truncated", "drop": "dropped"}

    print(f"fastpack demo: {len(lengths):,} documents ({args.example} of CPython's standard "
          f"library), {tokens:,} tokens, max_len {max_len:,}")
    print(f"  lengths: median {int(np.median(lengths)):,}, mean {lengths.mean():,.0f}, "
          f"max {int(lengths.max()):,}; {over:,} longer than max_len ({verb[args.overlong]})")
    print()
    kept = int(pieces.sum())
    rows = [
        Row("pad every sequence to max_len", len(pieces), kept / (len(pieces) * max_len)),
        Row(f"pad batches of {args.batch} to their longest",
            *_padded_batches(pieces, args.batch, seed=0)),
    ]
    plans: dict[str, Plan] = {}
    for strategy in STRATEGIES:
        start = time.perf_counter()
        plan = pack(lengths, max_len, strategy=strategy, overlong=args.overlong)
        elapsed = time.perf_counter() - start
        plans[strategy] = plan
        rows.append(Row(f"fastpack.pack(strategy={strategy!r})", plan.num_packs,
                        plan.efficiency, elapsed))
    print(f"  {'method':38} {'rows':>9} {'efficiency':>11} {'time':>9}")
    for row in rows:
        took = "" if row.seconds is None else f"{row.seconds * 1e3:.1f} ms"
        print(f"  {row.method:38} {row.rows:>9,} {row.efficiency:>10.2%} {took:>9}")

    bfd = plans["bfd"]
    packed = int(bfd.seqlens.sum(dtype=np.int64))
    print()
    print(f"  bfd: {bfd.num_packs:,} packs for a lower bound of {bfd.lower_bound:,} "
          f"(+{bfd.num_packs - bfd.lower_bound:,}); {bfd.split_sequences:,} sequences split, "
          f"{tokens - packed:,} tokens lost ({bfd.dropped_tokens:,} dropped, "
          f"{bfd.truncated_tokens:,} truncated)")
    ids, _, seqlens = bfd.segments(0)
    more = " ..." if len(ids) > 6 else ""
    print(f"  pack 0: {len(ids)} segments, {int(seqlens.sum()):,} tokens, from sequences "
          f"{ids[:6].tolist()}{more}")
    print(f"          cu_seqlens {bfd.cu_seqlens(0)[:7].tolist()}{more}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
