"""Every Python example in docs/integrations.md runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("datasets")

DOC = Path(__file__).resolve().parent.parent / "docs" / "integrations.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S) if DOC.exists() else []


@pytest.mark.skipif(not BLOCKS, reason="docs/integrations.md not found")
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_example_runs(index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code = BLOCKS[index].replace("/tmp/fastpack-trainer", str(tmp_path / "out"))
    exec(compile(code, f"{DOC.name}[{index}]", "exec"), {"__name__": "__doc_example__"})
