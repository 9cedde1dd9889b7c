"""The ``fastpack`` command (also ``python -m fastpack``): demo, stats and pack; see
docs/cli.md."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import click
import numpy as np

from . import DISTRIBUTION
from ._errors import FastpackError
from ._offline.formats import FORMATS, TOKEN_DTYPES
from ._options import OVERLONG_POLICIES, STRATEGIES, PackOptions

__all__ = ["main"]


def _fail(error: BaseException, status: int = 2) -> NoReturn:
    """Bad input or options: status 2 (as click's usage errors); other failures (a full
    disk) 1."""
    click.echo(f"fastpack: error: {error}", err=True)
    sys.exit(status)


def _caps(_ctx: click.Context, _param: click.Parameter, value: str) -> list[int]:
    try:
        caps = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected integers separated by commas, "
                                 "e.g. 2048,4096,8192") from None
    if not caps or min(caps) < 1:
        raise click.BadParameter(f"{value!r}: expected positive integers")
    return caps


def _columns(_ctx: click.Context, _param: click.Parameter,
             value: str | None) -> tuple[str, ...] | None:
    if value is None:
        return None  # every per-token column
    return tuple(c.strip() for c in value.split(",") if c.strip())


def _need_plot(plot: bool | None) -> None:
    """--plot where no picture can be drawn: one line and status 2, before any work."""
    from ._offline.stats import check_plot

    try:
        check_plot(plot, "--plot")
    except FastpackError as e:
        _fail(FastpackError(f"{e}; or leave --plot out"))


def _flagged(error: FastpackError) -> FastpackError:
    """A packing option's error (``"seed: got ..."``, worded as every entry point words it)
    with the flag it came from first: ``"--seed: seed: got ..."``."""
    name = str(error).split(":", 1)[0]
    return FastpackError(f"--{name.replace('_', '-')}: {error}")


def _check_caps(caps: Sequence[int]) -> None:
    """Each cap as fastpack.pack accepts it, before any input is read."""
    for cap in caps:
        try:
            PackOptions(cap)
        except FastpackError as e:
            _fail(_flagged(e))


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name=DISTRIBUTION, prog_name="fastpack")
def main() -> None:
    """fastpack: pack token sequences into rows of at most max-len tokens for LLM training
    (best fit over the whole corpus, in bounded memory), or see what packing would gain.

    \b
      fastpack demo                       pack a corpus shipped with fastpack: padding vs packing
      fastpack stats data/*.parquet       lengths, and rows and efficiency of every method
      fastpack pack data/ -o packed/ --max-len 4096
                                          packed parquet shards for training (TRL columns)
      fastpack doctor                     versions, kernels, and which paths run here

    Inputs: parquet files, JSON lines (.jsonl, .jsonl.gz, .jsonl.zst), Arrow files and
    directories written by datasets.save_to_disk. Bad input exits with status 2 and a
    message naming the file, the row and the column.
    """


@main.command(short_help="Padding vs packing on a corpus shipped with fastpack (no data "
              "needed).")
@click.option("--example", type=click.Choice(["functions", "modules"]), default="functions",
              show_default=True, help="functions: SFT-like (many short); modules: "
              "pre-training-like (long documents).")
@click.option("--max-len", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Tokens per row.")
@click.option("--batch", type=click.IntRange(min=1), default=32, show_default=True,
              help="Rows per padded batch.")
@click.option("--plot", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Also save the length histogram and the efficiency of each method "
              "(PNG).")
def demo(example: str, max_len: int, batch: int, plot: str | None) -> None:
    """Pack a real corpus shipped with fastpack (CPython's standard library, one document
    per function or module) and compare with padding. Needs no data."""
    from . import demo as demo_module

    _need_plot(plot is not None)

    code = demo_module.main(["--example", example, "--max-len", str(max_len),
                             "--batch", str(batch)])
    if plot:
        from ._examples import example_lengths
        from ._offline.stats import compare, plot_stats

        lengths = example_lengths(example).astype(np.int64)
        plot_stats(lengths, compare(lengths, [max_len], batch_size=batch), plot)
        click.echo(f"plot: {plot}")
    sys.exit(code)


def _input_options(f: Any) -> Any:
    f = click.option("--column", default="input_ids", show_default=True,
                     help="The column of token ids (lists of integers) whose lengths are "
                     "packed.")(f)
    f = click.option("--quiet", "-q", is_flag=True,
                     help="No progress; only the result (and errors).")(f)
    return f


@main.command(short_help="Lengths, and per cap the rows and efficiency of padding, "
              "bucketing and packing.")
@click.argument("inputs", nargs=-1, required=True, metavar="INPUT...")
@click.option("--max-len", "caps", default="2048,4096,8192", show_default=True,
              callback=_caps, help="Caps (tokens per row) to compare, comma-separated.")
@_input_options
@click.option("--batch-size", type=click.IntRange(min=1), default=32, show_default=True,
              help="Rows per batch for the padding and bucketing methods.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="Save a PNG: length histogram with the caps marked, efficiency per "
              "method and cap.")
def stats(inputs: Sequence[str], caps: list[int], column: str, quiet: bool, batch_size: int,
          as_json: bool, plot: str | None) -> None:
    """Length distribution of a corpus and, for each cap, the rows and efficiency of
    padding to the cap, padding per batch, length bucketing, next-fit and best-fit-
    decreasing packing, and the lower bound. Reads only the token column's lengths.

    \b
    Example:
      fastpack stats data/train-*.parquet --max-len 2048,4096 --plot stats.png
    """
    from ._offline.scan import scan_lengths
    from ._offline.sources import expand_inputs
    from ._offline.stats import compare, length_summary, plot_stats, table_lines

    _need_plot(plot is not None)
    _check_caps(caps)
    try:
        sources = expand_inputs(inputs)
        scan = scan_lengths(sources, [column], quiet=quiet)
        summary = length_summary(scan.lengths)
        results = compare(scan.lengths, caps, batch_size=batch_size) if scan.lengths.size \
            else []
    except FastpackError as e:
        _fail(e)
    if as_json:
        click.echo(json.dumps({"inputs": [s.path for s in sources], "lengths": summary,
                               "batch_size": batch_size, "caps": results}, indent=1))
    else:
        for line in table_lines(summary, results, batch_size):
            click.echo(line)
    if plot:
        plot_stats(scan.lengths, results, plot)
        if not as_json:
            click.echo(f"plot: {plot}")


@main.command(short_help="Pack files into TRL-ready parquet shards in bounded memory (or on "
              "Ray).")
@click.argument("inputs", nargs=-1, required=False, metavar="INPUT...")
@click.option("-o", "--output", "outdir", required=True, type=click.Path(file_okay=False),
              help="Output directory: shard-*.parquet, manifest.json, report.json, "
              "report.png; run.json: how the run went (times, passes).")
@click.option("--max-len", type=int, default=None,
              help="Tokens per packed row (required, but with --finalize).")
@_input_options
@click.option("--columns", "columns", callback=_columns, default=None,
              help="The other per-token columns to pack, comma-separated (e.g. "
              "labels,attention_mask; '' for none); each must have one value per token "
              "[default: every column holding one integer per token; the summary names "
              "the columns left out and why].")
@click.option("--text-column", default=None,
              help="Tokenize this text column (with --tokenizer) instead of reading "
              "--column; the ids are written as --column.")
@click.option("--tokenizer", type=click.Path(), default=None,
              help="A Hugging Face tokenizer saved locally (save_pretrained directory); no "
              "network.")
# The packing options are checked by fastpack.PackOptions (every entry point's messages),
# not by click: their metavars list what is accepted.
@click.option("--strategy", default="bfd", show_default=True,
              metavar="[" + "|".join(STRATEGIES) + "]",
              help="bfd: best-fit decreasing (fewest packs); ffd; next_fit (keeps input "
              "order); wrapped (concatenate and cut); one_per_pack (a document per row).")
@click.option("--overlong", default="error", show_default=True,
              metavar="[" + "|".join(OVERLONG_POLICIES) + "]",
              help="A document longer than the cap: stop with an error naming it, "
              "truncate it, split it into pieces, or drop it. Every token lost is reported.")
@click.option("--long-max-len", type=int, default=None,
              help="A second bucket: documents longer than --max-len go into packs of this "
              "many tokens.")
@click.option("--group-tokens", type=int, default=None,
              help="Two-level packing: order packs in groups of at most this many tokens "
              "(a step or micro-batch); group_offsets.npy gives the groups.")
@click.option("--shuffle/--no-shuffle", default=True, show_default=True,
              help="Shuffle the pack order (--no-shuffle: packs come sorted by size).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the shuffle (0 to 2^64-1).")
@click.option("--format", "out_format", type=click.Choice(FORMATS), default="parquet",
              show_default=True,
              help="parquet: TRL's columns; megatron: Megatron-LM/NeMo indexed datasets "
              "(.bin/.idx, a pack per document); mds: MosaicML streaming shards and "
              "index.json. The same packs in the same order in every format "
              "(docs/cli.md, Formats trainers read).")
@click.option("--token-dtype", type=click.Choice(TOKEN_DTYPES), default="auto",
              show_default=True,
              help="The dtype of --format megatron's tokens. auto: as Megatron's own "
              "preprocessing, uint16 for a vocabulary (the --tokenizer's, else the largest "
              "id + 1) under 65,500, else int32 (int64 for larger ids), per column; an "
              "explicit dtype refuses a value it cannot hold.")
@click.option("--shard-rows", type=click.IntRange(min=1), default=None,
              help="Packed rows per parquet shard [default: 2^25 tokens' worth, e.g. 8192 "
              "at --max-len 4096].")
@click.option("--plan-shards", type=click.IntRange(min=1), default=1, show_default=True,
              help="Plan in this many independent shards (for corpora whose lengths outgrow "
              "one machine; costs about half a pack per shard).")
@click.option("--affinity-column", metavar="NAME", default=None,
              help="Pack documents with the same value of column NAME together (an integer "
              "or string key per document: a cluster id, a URL domain), at most 0.1% below "
              "plain best fit's efficiency; report.json says how related the packs are.")
@click.option("--memory", default="auto", show_default=True,
              help="Budget for one gather pass's tokens (e.g. 4G); more data than this is "
              "packed in several passes. auto: half the available memory.")
@click.option("--spill/--no-spill", default=True, show_default=True,
              help="With more than one pass: read the inputs once more and spill each "
              "pass's tokens to OUTDIR/.fastpack (temporary disk as large as the tokens), "
              "or read the inputs again for every pass.")
@click.option("--resume", is_flag=True,
              help="Finish an interrupted run in OUTDIR, keeping its complete shards.")
@click.option("--overwrite", is_flag=True, help="Replace fastpack output already in OUTDIR.")
@click.option("--ray", "ray_address", is_flag=False, flag_value="auto", default=None,
              metavar="[ADDRESS]",
              help="Run on a Ray cluster (Ray Data): the plan made once by planner actors, "
              "the shards gathered on the workers. ADDRESS as for ray.init (default: a "
              "running cluster, else a local one); write --ray=ADDRESS, or --ray last.")
@click.option("--plot/--no-plot", default=None,
              help="Draw report.png (needs matplotlib, the cli extra) [default: where "
              "matplotlib is installed; elsewhere the summary says it was skipped].")
@click.option("--mix", "mix_file", type=click.Path(dir_okay=False), default=None,
              help="A mixture (YAML): sources (files, directories, globs) each with a token "
              "weight or epochs, instead of INPUT...; every step carries each source's "
              "share within one document. See docs/corpora.md.")
@click.option("--shard", "part", default=None, metavar="i/N",
              help="Job i of N (a Slurm array): plan everything, write only this job's "
              "shards; then --finalize. The union is byte for byte one job's output.")
@click.option("--finalize", is_flag=True,
              help="After every --shard job: write report.json and manifest.json in OUTDIR "
              "(needs only -o).")
def pack(inputs: Sequence[str], outdir: str, max_len: int | None, column: str, quiet: bool,
         columns: tuple[str, ...] | None, text_column: str | None, tokenizer: str | None,
         strategy: str, overlong: str, long_max_len: int | None, group_tokens: int | None,
         shuffle: bool, seed: int, out_format: str, token_dtype: str,
         shard_rows: int | None, plan_shards: int, affinity_column: str | None, memory: str,
         spill: bool, resume: bool, overwrite: bool, ray_address: str | None,
         plot: bool | None, mix_file: str | None, part: str | None, finalize: bool) -> None:
    """Pack the documents of INPUT... (files or directories) into parquet shards of packed
    rows with the columns of fastpack.hf.pack_dataset(..., position_ids=True): every packed
    token column, seq_lengths (what TRL's SFTTrainer reads) and position_ids.

    Memory stays bounded: lengths first (a few bytes per document), one global plan, then
    the shards gathered in as many passes as --memory requires. Shards are written
    atomically, listed with checksums in manifest.json; the same inputs and options give
    byte-identical shards.

    \b
    Examples:
      fastpack pack data/*.jsonl.zst -o packed/ --max-len 4096 --overlong split
      fastpack pack --mix mix.yaml -o packed/ --max-len 4096      (a mixture by tokens)
      fastpack pack data/ -o packed/ --max-len 4096 --shard 2/8   (job 2 of 8), then:
      fastpack pack -o packed/ --finalize
    """
    from ._offline.driver import pack_corpus
    from ._offline.report import summary_lines
    from ._offline.settings import PackSettings, parse_size

    _need_plot(plot)
    if finalize:
        _finalize(inputs, outdir, quiet, plot, mix_file, part, ray_address)
        return
    if max_len is None:
        _fail(FastpackError("--max-len: required (tokens per packed row)"))
    mix = _mix_of(inputs, mix_file)
    job = _job(part, ray_address, mix)
    if (text_column is None) != (tokenizer is None):
        _fail(FastpackError("--text-column and --tokenizer go together: the text is "
                            "tokenized with the tokenizer"))
    if resume and overwrite:
        _fail(FastpackError("--resume and --overwrite exclude each other"))
    try:
        settings = PackSettings(
            max_len, column=column, columns=columns, text_column=text_column,
            tokenizer=str(Path(tokenizer).resolve()) if tokenizer else None,
            strategy=strategy, overlong=overlong, long_max_len=long_max_len,
            group_tokens=group_tokens, shuffle=shuffle, seed=seed, shard_rows=shard_rows,
            plan_shards=plan_shards, format=out_format, token_dtype=token_dtype, mix=mix,
            affinity_column=affinity_column)
    except FastpackError as e:
        _fail(_flagged(e))
    try:
        budget = None if memory == "auto" else parse_size(memory)
        if ray_address is not None:
            from .ray import pack_files

            report = pack_files(inputs, outdir, settings, address=ray_address, resume=resume,
                                overwrite=overwrite, quiet=quiet, plot=plot)
        else:
            report = pack_corpus(inputs, outdir, settings, memory=budget, spill=spill,
                                 resume=resume, overwrite=overwrite, quiet=quiet, plot=plot,
                                 part=job)
    except KeyboardInterrupt:
        click.echo(f"fastpack: interrupted; complete shards are kept: rerun with --resume "
                   f"to finish {outdir}", err=True)
        sys.exit(130)
    except FastpackError as e:
        _fail(e)
    except OSError as e:
        _fail(e, 1)
    if job is not None:
        i, n = job
        count = len(report["shards"])
        click.echo(f"job {i}/{n}: {count} shard{'s' if count != 1 else ''} "
                   f"({report['rows']:,} packs, {report['tokens']:,} tokens) complete in "
                   f"{outdir}; when all {n} jobs are "
                   f"done: fastpack pack -o {outdir} --finalize")
        return
    for line in summary_lines(report, outdir):
        click.echo(line)


def _mix_of(inputs: Sequence[str], mix_file: str | None) -> dict[str, Any] | None:
    """``--mix``'s mixture as the settings hold it (INPUT... or --mix, not both)."""
    if mix_file is None:
        if not inputs:
            _fail(FastpackError("INPUT: no input given; expected files or directories (or "
                                "--mix mix.yaml)"))
        return None
    if inputs:
        _fail(FastpackError("--mix names the inputs (each source's paths); give no INPUT"))
    from ._mix import Mixture

    try:
        return Mixture.from_yaml(mix_file).to_json()
    except FastpackError as e:
        _fail(e)


def _job(part: str | None, ray_address: str | None,
         mix: dict[str, Any] | None) -> tuple[int, int] | None:
    if ray_address is not None and mix is not None:
        _fail(FastpackError("--mix runs on one machine (or as --shard jobs); leave --ray out"))
    if part is None:
        return None
    from ._offline.parts import parse_part

    if ray_address is not None:
        _fail(FastpackError("--shard splits the writing among jobs; --ray among a cluster's "
                            "workers: pick one"))
    try:
        return parse_part(part)
    except FastpackError as e:
        _fail(e)


def _finalize(inputs: Sequence[str], outdir: str, quiet: bool, plot: bool | None,
              mix_file: str | None, part: str | None, ray_address: str | None) -> None:
    """``--finalize``: the jobs recorded their settings and inputs; it takes only -o."""
    from ._offline.parts import finalize
    from ._offline.report import summary_lines

    if inputs or mix_file or part or ray_address:
        _fail(FastpackError("--finalize takes only -o (and --plot, -q): the jobs recorded "
                            "their inputs and settings"))
    try:
        report = finalize(outdir, quiet=quiet, plot=plot)
    except FastpackError as e:
        _fail(e)
    except OSError as e:
        _fail(e, 1)
    for line in summary_lines(report, outdir):
        click.echo(line)


@main.command(short_help="Versions, optional kernels, and which paths are exact and fast "
              "here.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def doctor(as_json: bool) -> None:
    """What this machine has (fastpack, torch, transformers, the optional kernels:
    flash-attn, flash-linear-attention, mamba_ssm, causal-conv1d, ring-flash-attn, flex
    attention's compiler) and which packed-training paths run here, with which kernel."""
    from .doctor import report

    found = report()
    click.echo(json.dumps(found.as_dict(), indent=2) if as_json else found.format())

if __name__ == "__main__":  # pragma: no cover
    main()
