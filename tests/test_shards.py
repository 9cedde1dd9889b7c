"""The same bytes whoever writes them: ``fastpack pack --shard i/N`` jobs (a Slurm array)
each write their part of one plan, ``--finalize`` writes the report and manifest, and the
directory is byte for byte the output of one job -- whatever the jobs' order, their
thread counts, or a job killed and resumed. (Local vs ``--ray``: tests/test_ray.py.)"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from corpus import assert_same_output, check_output, cli, corpus
from crashing import crash_after

from fastpack.cli import main

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def files(outdir: Path) -> dict[str, bytes]:
    """Every file of an output directory (hidden ones too), by name."""
    return {p.name: p.read_bytes() for p in sorted(outdir.iterdir()) if p.is_file()}


@pytest.fixture
def inputs(tmp_path):
    rng = np.random.default_rng(7)
    lengths = [rng.integers(0, 500, 200).tolist(), rng.integers(1, 300, 250).tolist(),
               rng.integers(1, 900, 60).tolist()]
    return corpus(tmp_path, lengths, ["a.parquet", "b.jsonl", "c.jsonl.zst"], labels=True)


def test_shard_jobs_write_one_jobs_output(tmp_path, inputs):
    paths, docs = inputs
    args = [*paths, "--max-len", "512", "--columns", "labels", "--overlong", "split",
            "--seed", "11", "--shard-rows", "7", "--group-tokens", "2048", "-q"]
    code, output = invoke("pack", *args, "-o", str(tmp_path / "one"))
    assert code == 0, output
    split = tmp_path / "split"
    written = []
    for i in (2, 0):  # any order
        code, output = invoke("pack", *args, "-o", str(split), "--shard", f"{i}/3")
        assert code == 0 and f"job {i}/3: " in output and "complete in" in output, output
        written.append(set(files(split)))
    assert not (split / "manifest.json").exists()
    # The last job is missing: finalize names it, and writes nothing.
    code, output = invoke("pack", "-o", str(split), "--finalize")
    assert code == 2 and "1 of 3 jobs are not complete (--shard 1/3)" in output
    code, output = invoke("pack", *args, "-o", str(split), "--shard", "1/3")
    assert code == 0, output
    code, output = invoke("pack", "-o", str(split), "--finalize")
    assert code == 0 and "written by 3 --shard jobs" in output, output
    assert_same_output(split, tmp_path / "one")  # report.json too, byte for byte
    # How it went is apart, in run.json: the jobs' passes and times, one job's.
    run = json.loads((split / "run.json").read_text())
    assert run["parts"] == 3 and [j["part"] for j in run["jobs"]] == [[0, 3], [1, 3], [2, 3]]
    assert run["passes"] == max(j["passes"] for j in run["jobs"]) == 1
    assert set(run["seconds"]) == {"lengths", "plan", "gather"}
    assert "parts" not in json.loads((tmp_path / "one" / "run.json").read_text())
    assert "run.json" not in (split / "manifest.json").read_text()  # no checksum covers it
    # Each job wrote its own consecutive shards, none twice.
    one = json.loads((tmp_path / "one" / "manifest.json").read_text())
    assert len(one["shards"]) > 10 and len(written[0]) > 1
    assert (split / "group_offsets.npy").exists()
    if HAS_MATPLOTLIB:
        assert (split / "report.png").read_bytes()[:4] == b"\x89PNG"
    check_output(split, docs, max_len=512, overlong="split", labels=True)
    # Done means done: no job can write into a complete output, no second finalize.
    code, output = invoke("pack", *args, "-o", str(split), "--shard", "0/3")
    assert code == 2 and "already holds a complete packed dataset" in output
    code, output = invoke("pack", "-o", str(split), "--finalize")
    assert code == 2 and "already complete" in output


@pytest.mark.parametrize("fmt", ["megatron", "mds"])
def test_shard_jobs_write_one_jobs_output_in_every_format(tmp_path, inputs, fmt):
    """The trainers' formats too: each job writes its shards' files (.bin/.idx per token
    column, .mds), --finalize what needs every shard (MDS's index.json) and the report."""
    paths, _ = inputs
    args = [*paths, "--max-len", "512", "--overlong", "split", "--seed", "3",
            "--shard-rows", "40", "--format", fmt, "-q", "--no-plot"]
    code, output = invoke("pack", *args, "-o", str(tmp_path / "one"))
    assert code == 0, output
    split = tmp_path / "split"
    for i in (1, 2, 0):
        before = set(files(split)) if split.exists() else set()
        code, output = invoke("pack", *args, "-o", str(split), "--shard", f"{i}/3")
        assert code == 0, output
        assert any(name.startswith("shard-") for name in set(files(split)) - before)
    code, output = invoke("pack", "-o", str(split), "--finalize", "--no-plot")
    assert code == 0 and "written by 3 --shard jobs" in output, output
    assert_same_output(split, tmp_path / "one")
    n = len(json.loads((split / "manifest.json").read_text())["shards"])
    last, names = f"shard-{n - 1:05d}-of-{n:05d}", set(files(split))
    if fmt == "megatron":  # labels is a packed token column: files of its own
        assert {f"{last}.bin", f"{last}.idx", f"{last}.labels.bin"} <= names
    else:
        assert {"index.json", f"{last}.mds"} <= names


def test_a_killed_mix_job_resumes_and_threads_do_not_matter(tmp_path, inputs):
    """A mixture written by 3 jobs with 1, 2 and 3 threads, the middle one killed halfway
    through a shard and resumed: the same bytes as one run."""
    paths, _ = inputs
    mix = tmp_path / "mix.yaml"
    mix.write_text(f"""step_tokens: 4000
sources:
  - {{name: ab, paths: [{paths[0]}, {paths[1]}], weight: 3}}
  - {{name: c, paths: {paths[2]}, epochs: 1.5}}
""")
    args = ["--mix", str(mix), "--max-len", "512", "--overlong", "split", "--shard-rows", "5",
            "--seed", "4",
            "--no-plot"]
    code, output = invoke("pack", *args, "-q", "-o", str(tmp_path / "one"))
    assert code == 0, output
    split = tmp_path / "split"
    crashed = crash_after(2, "pack", *args, "-o", str(split), "--shard", "1/3")
    assert crashed.returncode == -9, crashed.stderr
    kept = {p.name: p.stat().st_mtime_ns for p in split.glob("shard-*.parquet")}
    assert len(kept) == 2 and list(split.glob(".shard-*.tmp"))
    again = cli("pack", *args, "-o", str(split), "--shard", "1/3")
    assert again.returncode == 2 and "interrupted run of job 1/3 (2 shards complete)" in \
        again.stderr, again.stderr
    # The other jobs run meanwhile, and leave the killed job's files alone.
    for i, threads in ((0, "3"), (2, "2")):
        done = cli("pack", *args, "-q", "-o", str(split), "--shard", f"{i}/3",
                   env={"RAYON_NUM_THREADS": threads})
        assert done.returncode == 0, done.stderr
    resumed = cli("pack", *args, "-o", str(split), "--shard", "1/3", "--resume",
                  env={"RAYON_NUM_THREADS": "1"})
    assert resumed.returncode == 0 and "resume: 2 of" in resumed.stderr, resumed.stderr
    assert {p: split.joinpath(p).stat().st_mtime_ns for p in kept} == kept
    code, output = invoke("pack", "-o", str(split), "--finalize", "--no-plot")
    assert code == 0 and "mix of 2 sources" in output, output
    assert_same_output(split, tmp_path / "one")


@pytest.mark.parametrize(("args", "message"), [
    (["--shard", "3/3"], "expected i/N with 0 <= i < N"),
    (["--shard", "1"], "expected i/N"),
    (["--shard", "0/2", "--ray"], "pick one"),
    (["--finalize"], "--finalize takes only -o"),
])
def test_shard_and_finalize_refusals(tmp_path, inputs, args, message):
    paths, _ = inputs
    code, output = invoke("pack", paths[0], "-o", str(tmp_path / "o"), "--max-len", "512",
                          *args)
    assert code == 2 and message in output, output


def test_finalize_needs_jobs(tmp_path):
    code, output = invoke("pack", "-o", str(tmp_path), "--finalize")
    assert code == 2 and "holds no --shard job's output" in output
