"""MkDocs hooks (mkdocs.yml ``hooks:``): the benchmark tables live with the benchmarks, in
benches/results/*.md, written by the bench scripts; the site shows each as a page under
``benchmarks/`` without a copy in docs/ (which would drift), listed in the nav under the
"Benchmarks" section, with the pictures beside them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benches" / "results"


def _title(text: str, stem: str) -> str:
    match = re.search(r"^# (.+)$", text, flags=re.M)
    return match.group(1).strip() if match else stem


def _results() -> list[Path]:
    return sorted(RESULTS.glob("*.md"))


def on_config(config: Any) -> Any:
    """Every results table as a nav entry under "Benchmarks" (after its overview page)."""
    entries = [{_title(path.read_text(), path.stem): f"benchmarks/{path.name}"}
               for path in _results()]
    for index, item in enumerate(config["nav"]):
        if isinstance(item, dict) and "Benchmarks" in item:
            overview = item["Benchmarks"]
            config["nav"][index] = {"Benchmarks": [overview, *entries]}
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """A page's link to a results file (``../benches/results/X.md``, right on GitHub) goes
    to that file's page on the site."""
    depth = page.file.src_uri.count("/")
    return markdown.replace("](" + "../" * (depth + 1) + "benches/results/",
                            "](" + "../" * depth + "benchmarks/")


# Our docstrings cross-reference in Sphinx's roles (``:class:`fastpack.Plan```), which
# Markdown renders as ":class:" before the code. mkdocstrings does not read roles: make each
# one an optional autorefs link (a name the reference renders becomes a link, any other
# stays code).
ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):<code>(~?)([\w.]+)(\(\))?</code>")
# A role whose code the Markdown did not close on one name (a line break inside it).
BARE_ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):(?=<code>)")


def _link(match: re.Match[str]) -> str:
    short, name, call = match.group(1), match.group(2), match.group(3) or ""
    shown = name.rpartition(".")[2] if short else name  # Sphinx's "~": the last part
    return f'<autoref identifier="{name}" optional><code>{shown}{call}</code></autoref>'


def on_page_content(content: str, page: Any, config: Any, files: Files) -> str:
    return BARE_ROLE.sub("", ROLE.sub(_link, content))


def on_files(files: Files, config: Any) -> Files:
    for path in _results():
        files.append(File.generated(config, f"benchmarks/{path.name}", abs_src_path=str(path)))
    for picture in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"benchmarks/{picture.name}",
                                    abs_src_path=str(picture)))
    return files
