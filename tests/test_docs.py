"""Every Python example in README.md and docs/*.md runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = [
    (doc.name, block)
    for doc in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
    # docs/cli.md needs a Ray cluster and files on disk: tests/test_ray.py runs its examples.
    if doc.name != "cli.md"
    for block in re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)
]


@pytest.mark.skipif(not BLOCKS, reason="no documentation files found")
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_example_runs(index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    name, code = BLOCKS[index]
    code = code.replace("/tmp/fastpack-trainer", str(tmp_path / "out"))
    exec(compile(code, f"{name}[{index}]", "exec"), {"__name__": "__doc_example__"})
