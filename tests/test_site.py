"""The documentation site and the README stay honest: every public name has an entry in the
API reference (docs/reference/*.md), every page is in the site's nav, and every command the
README tells a newcomer to run exists (the console scripts, the files, ``.ci/run``).

Names are read from each module's ``__all__`` with ``ast``, not by importing it, so the
check runs in the base install too (no torch, transformers or ray)."""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest

import fastpack

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(fastpack.__file__).resolve().parent
REFERENCE = ROOT / "docs" / "reference"
# Modules whose public face is the command (docs/cli.md), not a Python API.
COMMAND_MODULES = {"fastpack.cli", "fastpack.demo"}


def exported(path: Path) -> list[str] | None:
    """The module's ``__all__`` (None when it has none), read from its source."""
    for node in ast.parse(path.read_text()).body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            assert node.value is not None
            return [ast.literal_eval(e) for e in node.value.elts]  # type: ignore[attr-defined]
    return None


def public_modules() -> dict[str, list[str]]:
    """Every public module of the package and its ``__all__``: ``fastpack`` itself, and every
    module or subpackage directly under it whose name has no leading underscore and which
    declares ``__all__`` (the subpackage ``fastpack.torch`` by its ``__init__``; its own
    modules are implementation, re-exported by it)."""
    found = {"fastpack": exported(PACKAGE / "__init__.py") or []}
    for path in sorted(PACKAGE.iterdir()):
        name = path.stem if path.suffix == ".py" else path.name
        source = path / "__init__.py" if path.is_dir() else path
        if name.startswith("_") or not source.is_file() or source.suffix != ".py":
            continue
        names = exported(source)
        if names is not None and f"fastpack.{name}" not in COMMAND_MODULES:
            found[f"fastpack.{name}"] = names
    return found


def reference_entries(folder: Path = REFERENCE) -> set[str]:
    """The objects the reference pages render: every ``::: dotted.name`` line."""
    return {match for page in folder.glob("*.md")
            for match in re.findall(r"^::: ([\w.]+)\s*$", page.read_text(), flags=re.M)}


def missing_from_reference(modules: dict[str, list[str]], entries: set[str]) -> list[str]:
    return [f"{module}.{name}" for module, names in modules.items() for name in names
            if f"{module}.{name}" not in entries and module not in entries]


def test_every_public_name_is_in_the_api_reference() -> None:
    modules = public_modules()
    # The modules a user imports: a rename or a lost __all__ would silently shrink this.
    assert {"fastpack", "fastpack.torch", "fastpack.hf", "fastpack.vlm", "fastpack.ray",
            "fastpack.trl", "fastpack.transformers", "fastpack.cost"} <= set(modules)
    assert len(modules["fastpack"]) >= 25 and len(modules["fastpack.torch"]) >= 25
    missing = missing_from_reference(modules, reference_entries())
    assert missing == [], (
        f"public names without an entry in docs/reference/*.md: {missing}; add a line "
        "'::: <name>' to the module's page")


def test_every_reference_entry_names_a_public_object() -> None:
    modules = public_modules()
    stale = []
    for entry in sorted(reference_entries()):
        module, _, name = entry.rpartition(".")
        if entry in modules or entry == "fastpack._core":
            continue
        if name not in modules.get(module, []):
            stale.append(entry)
    assert stale == [], f"reference entries that no module exports: {stale}"


def test_the_reference_check_catches_a_missing_name(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# a\n\n::: fastpack.pack\n\n::: fastpack.hf\n")
    entries = reference_entries(tmp_path)
    modules = {"fastpack": ["pack", "Plan"], "fastpack.hf": ["pack_dataset"]}
    assert missing_from_reference(modules, entries) == ["fastpack.Plan"]


def nav_pages() -> list[str]:
    """The docs/ pages mkdocs.yml's nav lists (``name: page.md`` or ``- page.md``)."""
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text[text.index("\nnav:"):]
    return re.findall(r"^\s+- (?:[^\n]*?: )?([\w/.-]+\.md)\s*$", nav, flags=re.M)


def test_every_page_is_in_the_nav_and_every_nav_entry_exists() -> None:
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    listed = nav_pages()
    assert sorted(set(listed) - pages) == []
    assert sorted(pages - set(listed)) == []


# ---------------------------------------------------------------------------------------
# the README's commands


def readme_commands() -> list[str]:
    """Every command of the README's ```bash blocks, comments and blank lines dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [line.split("#")[0].strip() for block in blocks for line in block.splitlines()
            if line.split("#")[0].strip()]


def scripts() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([\w-]+) = ", section, flags=re.M))


KNOWN_TOOLS = {"pip", "python", "python3", "bash", "mkdocs", "cargo", "maturin", "cd", "git"}
# A file a command names: a script, a requirements file, an example, the CI script.
FILE_WORD = re.compile(r"[\w./-]+\.(py|txt|toml|yml|sh)|\.ci/[\w.-]+|examples/[\w./-]+")


def command_problems(commands: list[str], root: Path = ROOT) -> list[str]:
    """What in these shell commands would fail on a fresh clone: a program nothing
    installs (not a console script of pyproject.toml, not a usual tool), a ``fastpack``
    subcommand the command lacks, a file that is not in the tree."""
    from fastpack.cli import main

    known = scripts() | KNOWN_TOOLS
    problems = []
    for command in commands:
        for part in re.split(r"&&|\|\||;", command):
            words = shlex.split(part)
            if not words:
                continue
            if words[0] not in known:
                problems.append(f"{command!r}: {words[0]!r} is not installed by anything")
            if words[0] == "fastpack" and len(words) > 1 and words[1] not in main.commands:
                problems.append(f"{command!r}: the command has no subcommand {words[1]!r}")
            problems += [f"{command!r}: no file {word}" for word in words[1:]
                         if FILE_WORD.fullmatch(word) and not (root / word).exists()]
    return problems


def test_the_readme_commands_exist() -> None:
    commands = readme_commands()
    assert any(c.startswith("bash .ci/run") for c in commands)
    assert any("fastpack demo" in c for c in commands)
    assert command_problems(commands) == []


def test_the_command_check_catches_each_mistake() -> None:
    assert command_problems(["pip install -v . && fastpack demo", "bash .ci/run"]) == []
    bad = {
        "fastpack-train --max-len 8": "not installed by anything",
        "fastpack pakc data/": "no subcommand 'pakc'",
        "bash .ci/nope": "no file .ci/nope",
        "python benches/bench_nope.py": "no file benches/bench_nope.py",
        "pip install -r requirements-nope.txt": "no file requirements-nope.txt",
    }
    for command, problem in bad.items():
        found = command_problems([command])
        assert len(found) == 1 and problem in found[0], (command, found)


@pytest.mark.parametrize("page", ["README.md"])
def test_the_readme_is_a_five_minute_read(page: str) -> None:
    lines = (ROOT / page).read_text().splitlines()
    assert len(lines) <= 200, f"{page} has {len(lines)} lines; move detail to docs/"
