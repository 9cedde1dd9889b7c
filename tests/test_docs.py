"""Every Python example in README.md, docs/integrations.md and docs/core.md runs."""

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
    for doc in (ROOT / "README.md", ROOT / "docs" / "integrations.md", ROOT / "docs" / "core.md")
    if doc.exists()
    for block in re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)
]


@pytest.mark.skipif(not BLOCKS, reason="README.md and docs/integrations.md not found")
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_example_runs(index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    name, code = BLOCKS[index]
    code = code.replace("/tmp/fastpack-trainer", str(tmp_path / "out"))
    exec(compile(code, f"{name}[{index}]", "exec"), {"__name__": "__doc_example__"})
