"""Every Python example in README.md and docs/*.md runs as shown (what it prints too),
and every install line there names the distribution and extras that pyproject.toml
defines."""

from __future__ import annotations

import glob
import re
import shlex
import tempfile
from pathlib import Path

import docblocks
import pytest
from docblocks import DOCS, ROOT

# The blocks that name no other test (tests/docblocks.py says how a block names one).
BLOCKS = docblocks.blocks()


@pytest.mark.skipif(not BLOCKS, reason="no documentation files found")
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_example_runs(index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for module in ("torch", "transformers", "datasets"):
        pytest.importorskip(module)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # a block's mkdtemp goes here
    name, code = BLOCKS[index]
    code = code.replace("/tmp/fastpack-trainer", str(tmp_path / "out"))
    docblocks.run(f"{name}[{index}]", code)


def test_every_block_that_names_its_test_is_run_there() -> None:
    # A runner misspelt, or a test that stopped asking for its blocks, would leave a block
    # that no test runs.
    for runner in docblocks.runners():
        assert (ROOT / runner).is_file(), runner
        assert f'blocks("{runner}")' in (ROOT / runner).read_text(), runner
    assert docblocks.runners() == {"tests/test_ray.py", "tests/test_formats.py"}


def test_every_python_example_of_the_command_runs() -> None:
    # docs/cli.md's examples need files on disk, a Ray cluster or a trainer's reader:
    # each is a ```python block that some test runs, none a ```py one that none does.
    text = (ROOT / "docs" / "cli.md").read_text()
    assert "```py\n" not in text
    assert len(re.findall(r"```python\n", text)) == 6


def test_no_page_has_a_python_example_that_no_test_runs() -> None:
    # A ```py fence shows Python that test_example_runs skips: the README's promise that
    # every example runs would be false for it.
    assert [p.name for p in DOCS if "```py\n" in p.read_text()] == []


def test_shown_output_is_the_comments_after_a_print() -> None:
    code = ("x = 1\nprint(x, 2)  # a remark\n# 1 2\nprint(' indented')\n#  indented\n\n"
            "# a comment\ny = 2\n# another\nprint()\n#\n")
    assert docblocks.shown_output(code) == "1 2\n indented\n\n"
    assert docblocks.shown_output("print(1)\n\n# not output\n") is None
    docblocks.run("shown", code)
    with pytest.raises(AssertionError, match=r"prints '3\\n' but shows '4\\n'"):
        docblocks.run("wrong", "print(3)\n# 4\n")


# ---------------------------------------------------------------------------------------
# install lines


def _normal(name: str) -> str:
    """A distribution name as the index compares names (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _project() -> tuple[str, set[str]]:
    """(distribution name, extras) from pyproject.toml, read without a TOML library (the
    3.9 runs have none): the ``name`` of ``[project]`` and the keys of
    ``[project.optional-dependencies]``."""
    text = (ROOT / "pyproject.toml").read_text()
    sections = dict(re.findall(r"^\[([^\]]+)\]\n(.*?)(?=^\[|\Z)", text, flags=re.M | re.S))
    (name,) = re.findall(r'^name = "([^"]+)"', sections["project"], flags=re.M)
    extras = set(re.findall(r"^([A-Za-z0-9_-]+) = \[", sections["project.optional-dependencies"],
                            flags=re.M))
    return name, extras


def install_lines() -> list[tuple[str, int, str]]:
    """Every ``pip install ...`` of README.md and docs/*.md: (file, line number, text),
    in code blocks and inline code alike."""
    found = []
    for doc in DOCS:
        for number, line in enumerate(doc.read_text().splitlines(), start=1):
            for match in re.finditer(r"pip install [^`\n]*", line):
                found.append((str(doc.relative_to(ROOT)), number, match.group(0)))
    return found


#: Whether fastpack-seq is on the public index: until it is, an install line must name the
#: source tree or a built wheel, not the distribution.
PUBLISHED = False


def check_install_line(text: str, name: str, extras: set[str], root: Path = ROOT) -> list[str]:
    """What is wrong with one install line (empty when nothing): a fastpack requirement
    under another name than the distribution's, an extra that does not exist, a path that
    does not exist, a wheel or sdist of another name; extras named in the comment
    (``extras: a, b``) must exist too."""
    command, _, comment = text.partition("#")
    command = re.split(r"&&|\|\||[|;]", command)[0]
    problems = []
    ours = _normal(name)
    wheel_stem = ours.replace("-", "_")
    words = shlex.split(command)[2:]
    for word in words:
        if word.startswith("-"):
            continue
        # A path may carry extras: `.[hf]`, `dist/fastpack_seq-*.whl[hf]`.
        path, extra_list = re.fullmatch(r"(.*?)(?:\[([^\]]*)\])?", word).groups()  # type: ignore[union-attr]
        if "/" in path or path == "." or path.endswith((".whl", ".tar.gz")):
            word = path
            for extra in (extra_list or "").split(","):
                if extra.strip() and extra.strip() not in extras:
                    problems.append(f"{word}[{extra_list}]: no extra {extra.strip()!r}")
            file = Path(word).name
            if file.endswith((".whl", ".tar.gz")):
                if not file.startswith(f"{wheel_stem}-"):
                    problems.append(f"{word}: not the {name} wheel/sdist ({wheel_stem}-*)")
                continue  # built by the step before; its folder is the build's output
            if not glob.glob(str(root / word)):
                problems.append(f"{word}: no such path")
            continue
        requirement = re.match(r"^([A-Za-z0-9_.-]+)(?:\[([^\]]*)\])?", word)
        if requirement is None:
            problems.append(f"{word}: not a requirement")
            continue
        dist, wanted = requirement.group(1), requirement.group(2)
        if _normal(dist).startswith("fastpack"):
            if _normal(dist) != ours:
                problems.append(f"{word}: the distribution is {name!r}, not {dist!r}")
            elif not PUBLISHED:
                problems.append(f"{word}: {name} is not on the public index yet; install "
                                "from the source tree ('.[extra]') or a built wheel")
            for extra in (wanted or "").split(","):
                if extra.strip() and extra.strip() not in extras:
                    problems.append(f"{word}: no extra {extra.strip()!r}")
    named = re.search(r"extras?: ([A-Za-z0-9_, -]+)", comment)
    for extra in (named.group(1).split(",") if named else []):
        if extra.strip() and extra.strip() not in extras:
            problems.append(f"comment: no extra {extra.strip()!r}")
    return problems


def test_every_install_line_names_the_distribution_and_its_extras():
    name, extras = _project()
    lines = install_lines()
    assert len(lines) >= 5  # README, docs/cli.md and docs/core.md all have some
    assert any(_normal(name) in _normal(text) for _, _, text in lines)
    problems = [f"{doc}:{number}: {problem}" for doc, number, text in lines
                for problem in check_install_line(text, name, extras)]
    assert problems == []


def test_the_install_line_check_catches_each_mistake():
    name, extras = _project()
    assert check_install_line("pip install '.[cli,ray]'", name, extras) == []
    assert check_install_line("pip install 'dist/fastpack_seq-0.1.0-cp39-abi3-x.whl[hf]'",
                              name, extras) == []
    bad = {
        "pip install fastpack": "not 'fastpack'",
        "pip install 'fastpack[cli]'": "not 'fastpack'",
        "pip install '.[nope]'": "no extra 'nope'",
        "pip install dist/fastpack-*-abi3-*.whl": "not the fastpack-seq wheel",
        "pip install no/such/dir": "no such path",
        "pip install dist/fastpack_seq-*.whl   # extras: torch, hf2": "no extra 'hf2'",
        "pip install 'dist/fastpack_seq-0.1.0-cp39-abi3-linux_x86_64.whl[hf2]'": "no extra 'hf2'",
        # Not published yet: install lines name the source tree or a built wheel.
        "pip install 'fastpack-seq[hf]'": "not on the public index",
    }
    for line, problem in bad.items():
        found = check_install_line(line, name, extras)
        assert len(found) == 1 and problem in found[0], (line, found)


def test_the_extras_the_docs_promise_exist():
    name, extras = _project()
    assert _normal(name) != "fastpack"  # the index's "fastpack" is another project
    assert {"torch", "hf", "cli", "ray"} <= extras


# A line that is one upper-case name (the README once shipped a bare `HF_TABLE` where a
# table belonged), or a marker of unfinished text.
PLACEHOLDER = re.compile(r"^\s*[A-Z][A-Z0-9]*_[A-Z0-9_]+\s*$|\b(TODO|TBD|FIXME|XXX)\b")


def placeholders(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of every placeholder outside code blocks."""
    found, in_code = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif not in_code and PLACEHOLDER.search(line):
            found.append((number, line))
    return found


def test_no_doc_holds_a_placeholder() -> None:
    found = {str(doc.relative_to(ROOT)): placeholders(doc.read_text()) for doc in DOCS}
    assert not {name: lines for name, lines in found.items() if lines}


def test_the_placeholder_check_catches_one() -> None:
    assert placeholders("A table:\n\nHF_TABLE\n\nmore") == [(3, "HF_TABLE")]
    assert placeholders("numbers: TODO") == [(1, "numbers: TODO")]
    assert placeholders("```\nMAX_LEN\n```\n`MAX_LEN` is a constant") == []
