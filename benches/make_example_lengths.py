"""Regenerates the built-in example corpus lengths shipped in `python/fastpack/data/`.

The corpus is CPython's own standard library (real text that every machine has): every
top-level function and class is one "SFT-like" document, every module one "pretraining"
document. Lengths are GPT-2-style pre-token counts (words, runs of punctuation, runs of
whitespace): a close, tokenizer-free stand-in for BPE token counts.

    python benches/make_example_lengths.py
"""

from __future__ import annotations

import ast
import re
import sysconfig
from pathlib import Path

import numpy as np

PRETOKEN = re.compile(r"'(?:s|t|re|ve|m|ll|d)| ?[^\W\d_]+| ?\d+| ?[^\s\w]+|\s+(?!\S)|\s+")


def count(text: str) -> int:
    return sum(1 for _ in PRETOKEN.finditer(text))


def main() -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)
    functions: list[int] = []
    modules: list[int] = []
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        modules.append(count(source))
        lines = source.splitlines(keepends=True)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                end = node.end_lineno or node.lineno
                functions.append(count("".join(lines[node.lineno - 1 : end])))
    out = Path(__file__).resolve().parents[1] / "python" / "fastpack" / "data"
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "stdlib_functions.npy", np.array(functions, dtype=np.uint32))
    np.save(out / "stdlib_modules.npy", np.array(modules, dtype=np.uint32))
    for name, values in (("functions", functions), ("modules", modules)):
        v = np.array(values)
        print(f"{name}: n={len(v)} mean={v.mean():.0f} median={np.median(v):.0f} max={v.max()}")


if __name__ == "__main__":
    main()
