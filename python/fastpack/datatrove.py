"""A datatrove pipeline step that packs what datatrove's tokenizer wrote.

datatrove's ``DocumentTokenizer`` leaves, per task, a ``.ds`` file of token ids (uint16,
or uint32 for vocabularies over 65,536 ids) and a ``.ds.index`` of the documents' ends
(uint64, in tokens); its ``.ds.metadata`` names the token size. :class:`PackTokenized`
reads those files and runs ``fastpack pack`` on them (the same plan, shards and report as
the command, in any of its formats)::

    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.tokens import DocumentTokenizer
    from fastpack.datatrove import PackTokenized

    tokenize = LocalPipelineExecutor([reader, DocumentTokenizer("tok/", "tokenizer.json")],
                                     tasks=8)
    LocalPipelineExecutor([PackTokenized("tok/", "packed/", max_len=4096,
                                         format="megatron")],
                          tasks=1, depends=tokenize).run()

With one task the plan is global (every ``.ds`` file of ``input_folder``); with N tasks
task ``r`` packs the files ``r, r + N, ...`` (in name order) into ``output_folder/r`` (a
plan per task). Folders are local paths.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ._errors import FastpackError

try:
    from datatrove.pipeline.base import PipelineStep
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("fastpack.datatrove needs datatrove: "
                      "pip install 'fastpack-seq[datatrove]'") from e

__all__ = ["PackTokenized", "tokenized_files"]

# Documents per Arrow record batch of the converted input: bounds the command's read.
_BATCH_TOKENS = 1 << 24


def tokenized_files(folder: str | Path) -> list[Path]:
    """The ``.ds`` files under ``folder`` that have their ``.ds.index``, in name order."""
    root = Path(folder)
    if not root.is_dir():
        raise FastpackError(f"input_folder: {folder} is not a local directory")
    files = sorted(p for p in root.rglob("*.ds") if p.with_name(p.name + ".index").exists())
    if not files:
        raise FastpackError(f"input_folder: {folder} holds no .ds file with its .ds.index "
                            "(datatrove's DocumentTokenizer output, save_index=True)")
    return files


def _token_dtype(path: Path, token_size: int | None) -> np.dtype:
    meta = path.with_name(path.name + ".metadata")
    if token_size is None and meta.exists():
        first = meta.read_text().splitlines()[0]
        token_size = int(first.rsplit("|", 1)[1])
    if token_size not in (2, 4):
        raise FastpackError(f"token_size: {path} has no .metadata naming its token size; "
                            "pass token_size=2 (uint16) or 4 (uint32)" if token_size is None
                            else f"token_size: got {token_size}; expected 2 or 4")
    return np.dtype("<u2" if token_size == 2 else "<u4")


def _to_arrow(path: Path, dtype: np.dtype, column: str, target: Path) -> None:
    """One ``.ds`` file as an Arrow stream of large lists (batches of about
    ``_BATCH_TOKENS`` tokens): the command reads it as any Arrow input."""
    import pyarrow as pa

    tokens = np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else \
        np.zeros(0, dtype=dtype)
    ends = np.fromfile(path.with_name(path.name + ".index"), dtype="<u8").astype(np.int64)
    if len(ends) and (ends[-1] != len(tokens) or (np.diff(ends) < 0).any() or ends[0] < 0):
        raise FastpackError(f"{path}: its .ds.index does not cut its {len(tokens):,} tokens "
                            f"into documents (last end {int(ends[-1]):,})")
    starts = np.concatenate([[0], ends])
    schema = pa.schema([(column, pa.large_list(pa.from_numpy_dtype(dtype)))])
    cuts = np.searchsorted(starts, np.arange(0, int(starts[-1]) + 1, _BATCH_TOKENS)[1:])
    bounds = np.unique(np.concatenate([[0], cuts, [len(ends)]]))
    with pa.OSFile(str(target), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for a, b in zip(bounds[:-1], bounds[1:]):
            offsets = starts[a:b + 1] - starts[a]
            values = np.asarray(tokens[starts[a]:starts[b]])
            writer.write_batch(pa.record_batch(
                [pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))],
                schema=schema))


class PackTokenized(PipelineStep):  # type: ignore[misc]
    """Packs datatrove-tokenized documents (``input_folder``'s ``.ds`` files) into
    ``output_folder`` with ``fastpack pack``'s passes: ``max_len`` tokens per pack,
    ``format`` parquet, megatron or mds, and any other setting of
    :class:`fastpack._offline.settings.PackSettings` (``overlong``, ``strategy``,
    ``seed``, ...) as keywords. ``token_size`` (2 or 4 bytes) where the ``.ds`` files
    have no ``.metadata``. Documents flowing through the step are passed on unchanged.
    """

    name = "fastpack pack"
    type = "🔢 - TOKENIZER"

    def __init__(self, input_folder: str | Path, output_folder: str | Path, max_len: int,
                 *, format: str = "parquet", token_size: int | None = None,
                 column: str = "input_ids", memory: int | None = None,
                 **settings: Any) -> None:
        super().__init__()
        from ._offline.settings import PackSettings

        # Checked here, so a bad option fails when the pipeline is built, not in a task.
        self.settings = PackSettings(max_len, column=column, format=format, **settings)
        self.input_folder, self.output_folder = Path(input_folder), Path(output_folder)
        self.token_size, self.memory = token_size, memory

    def run(self, data: Any = None, rank: int = 0, world_size: int = 1) -> Iterator[Any]:
        from ._offline.driver import pack_corpus

        if data is not None:
            yield from data
        files = tokenized_files(self.input_folder)[rank::world_size]
        out = self.output_folder if world_size == 1 else self.output_folder / f"{rank:05d}"
        if not files:
            return
        with tempfile.TemporaryDirectory(prefix="fastpack-datatrove-") as work:
            inputs = []
            for k, path in enumerate(files):
                target = Path(work) / f"{k:05d}.arrow"
                _to_arrow(path, _token_dtype(path, self.token_size), self.settings.column,
                          target)
                inputs.append(str(target))
            with self.track_time():
                report = pack_corpus(inputs, out, self.settings, memory=self.memory,
                                     overwrite=True, quiet=True, plot=False)
        self.stat_update("packs", value=int(report["packs"]))
        self.stat_update("documents", value=int(report["documents"]))
