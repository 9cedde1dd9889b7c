"""The Python examples of README.md and docs/*.md, as the tests run them: every ```python
block, exactly as a reader sees it.

tests/test_docs.py runs every block on its own. A block that needs more than that -- a Ray
cluster, files on disk, a trainer's reader from CI's formats phase -- names the test file
that runs it (and makes what it needs) in an HTML comment on the line before its fence,
which neither GitHub nor the site shows:

    <!-- run by tests/test_formats.py -->
    ```python

A block shows what it prints as whole-line comments right after the ``print`` line; when
it shows any, what it prints must be that, line for line:

    print(report["packs"])
    # 2
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Every page of the site, in subfolders too (docs/reference/ holds the API pages).
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"(?:<!-- run by (\S+) -->\n)?```python\n(.*?)```", flags=re.S)


def blocks(runner: str | None = None) -> list[tuple[str, str]]:
    """``(page, code)`` of every block that ``runner`` (a test file, from the repository
    root) runs, in page order; None: the blocks that name no runner (tests/test_docs.py's)."""
    return [(str(doc.relative_to(ROOT)), match.group(2))
            for doc in DOCS for match in BLOCK.finditer(doc.read_text())
            if match.group(1) == runner]


def runners() -> set[str]:
    """Every test file a block names."""
    return {match.group(1) for doc in DOCS for match in BLOCK.finditer(doc.read_text())
            if match.group(1)}


def shown_output(code: str) -> str | None:
    """What the block shows it prints: the whole-line comments right after a line that
    calls ``print`` (and after one another), without their ``# ``; None when it shows
    nothing."""
    shown, after_print = [], False
    for line in code.splitlines():
        text = line.strip()
        if after_print and text.startswith("#"):
            shown.append(text[1:].removeprefix(" "))
        else:
            after_print = "print(" in text
    return "".join(f"{line}\n" for line in shown) if shown else None


def run(page: str, code: str, scope: dict[str, Any] | None = None) -> dict[str, Any]:
    """Executes ``code`` as written in ``scope`` (a fresh one by default) and returns the
    scope; when the block shows what it prints, asserts that it prints exactly that."""
    scope = {"__name__": "__doc_example__"} if scope is None else scope
    expected = shown_output(code)
    printed = io.StringIO()
    # Only a block that shows its output has it taken: the others print as usual.
    capture = contextlib.nullcontext() if expected is None else \
        contextlib.redirect_stdout(printed)
    with capture:
        exec(compile(code, page, "exec"), scope)
    if expected is not None:
        got = printed.getvalue()
        assert got == expected, f"{page}: the block prints {got!r} but shows {expected!r}"
    return scope
