"""The formats ``fastpack pack`` writes (``--format``): the same packs in the same order,
shard by shard, in the layout a trainer's own loader reads. Each writer is numpy over the
gathered record batches (one copy of the token bytes, no Python object per document or
token), and each shard's files are written atomically as a parquet shard is.

- ``parquet``: :func:`fastpack._offline.outdir.write_shard` (TRL's columns).
- ``megatron``: a Megatron-LM / NeMo indexed dataset per shard and token column,
  ``shard-i-of-n.bin`` / ``.idx`` (``shard-i-of-n.<column>.bin`` / ``.idx`` for the other
  token columns): every pack is a *document* and its pieces of input documents are the
  document's *sequences*, so ``IndexedDataset(prefix)[s]`` is one input document (or
  piece) and ``document_indices`` cut the sequences into packs. Tokens are stored as
  Megatron's own preprocessing stores them (``--token-dtype auto``): uint16 when the
  vocabulary (the tokenizer's, else the largest id + 1) is under 65,500, else int32 (int64
  for ids of 2^31 and more); the choice is made once, from the whole input, before any
  shard is written, so every shard (and worker) stores the same dtype.
- ``mds``: MosaicML streaming shards (``shard-i-of-n.mds``, written without compression or
  hashes) and, when the run completes, the ``index.json`` that ``StreamingDataset`` reads;
  a sample is a pack with the parquet output's columns as ``ndarray`` columns
  (``position_ids`` and ``seq_lengths`` as int32).

The layouts were learnt from the readers' source (megatron-core
``datasets/indexed_dataset.py``, mosaicml-streaming ``format/mds``); these writers are
fastpack's own, and the tests read their output back with those libraries.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from .._errors import FastpackError
from .._gather import _value_dtype

if TYPE_CHECKING:  # the command's help is drawn without pyarrow
    import pyarrow as pa

__all__ = [
    "FORMATS",
    "TOKEN_DTYPES",
    "check_format",
    "check_token_dtype",
    "entry_files",
    "finish_format",
    "is_format_file",
    "megatron_dtypes",
    "write_format_shard",
]

FORMATS = ("parquet", "megatron", "mds")

# megatron-core's .idx: a magic, version 1, the token dtype's code, then the counts and
# the arrays (sequence lengths int32, sequence byte pointers int64, document indices int64).
_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_DTYPES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "uint16": 8}

#: ``--token-dtype``: the dtype of the megatron format's tokens (auto: as Megatron picks).
TOKEN_DTYPES = ("auto", "uint16", "int32", "int64")
# megatron-core's DType.optimal_dtype: uint16 below this cardinality (not 2^16: Megatron
# keeps a margin), int32 above.
_UINT16_CARDINALITY = 65_500

# MDS: ndarray column values' dtype codes are part of the encoding string, the shape of a
# 1-d array is written per sample as one byte (ndim << 2 | width code) and the length.
_MDS_DTYPES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64")
_MDS_INDEX = "index.json"
# A sample offset is uint32 in an MDS shard.
_MDS_MAX_BYTES = (1 << 32) - 1


def check_format(value: str) -> str:
    if value not in FORMATS:
        raise FastpackError(f"format: got {value!r}; expected one of {', '.join(FORMATS)}")
    return value


def check_token_dtype(value: str, fmt: str) -> str:
    if value not in TOKEN_DTYPES:
        raise FastpackError(f"token_dtype: got {value!r}; expected one of "
                            f"{', '.join(TOKEN_DTYPES)}")
    if value != "auto" and fmt != "megatron":
        raise FastpackError(f"token_dtype: got {value!r} with format {fmt!r}; it chooses "
                            "the dtype of --format megatron's .bin files only")
    return value


def megatron_dtypes(token_dtype: str, ranges: dict[str, tuple[int, int] | None],
                    vocab_size: int | None = None) -> dict[str, str]:
    """The dtype each token column's .bin stores, from the smallest and largest value of
    the column over the whole input (``ranges``; None for a column without values), in
    the columns' order; ``vocab_size`` (the tokenizer's, when the run tokenizes) sizes
    the first column as Megatron's preprocessing does. ``auto``: per column, uint16 when
    the values are ids below 65,500, else int32, else int64. An explicit dtype is every
    column's, and a value it cannot hold is refused, naming the column."""
    dtypes = {}
    for k, (column, bounds) in enumerate(ranges.items()):
        lo, hi = bounds if bounds is not None else (0, 0)
        if token_dtype == "auto":
            cardinality = hi + 1 if k or vocab_size is None else max(vocab_size, hi + 1)
            if lo >= 0 and cardinality < _UINT16_CARDINALITY:
                dtypes[column] = "uint16"
            else:
                fits = np.iinfo(np.int32)
                dtypes[column] = "int32" if fits.min <= lo and hi <= fits.max else "int64"
            continue
        info = np.iinfo(np.dtype(token_dtype))
        bad = lo if lo < info.min else hi if hi > info.max else None
        if bad is not None:
            raise FastpackError(
                f"token_dtype: column {column!r} holds the value {bad:,}, which {token_dtype} "
                f"cannot hold ({info.min:,} to {info.max:,}); pass a wider --token-dtype "
                "or auto (which chooses per column)")
        dtypes[column] = token_dtype
    return dtypes


def _shard_name(i: int, n: int) -> str:
    from .layout import shard_name

    return shard_name(i, n)


def _base(i: int, n: int) -> str:
    return _shard_name(i, n).removesuffix(".parquet")


def is_format_file(name: str) -> bool:
    """A file (or its hidden temporary) one of the formats writes in an output directory."""
    bare = name.lstrip(".")
    if name in (_MDS_INDEX, f".{_MDS_INDEX}.tmp"):
        return True
    return bare.startswith("shard-") and any(
        ext in bare for ext in (".parquet", ".bin", ".idx", ".mds"))


def entry_files(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """Every file of a shard's journal entry, each with its ``file``, ``bytes`` and
    ``sha256`` (a parquet or MDS shard is one file; an indexed dataset two per column)."""
    return [entry, *entry.get("parts", [])]


# ---------------------------------------------------------------------------------------
# writing one shard, atomically


class _Files:
    """Hidden temporary files of one shard, renamed into place together once all are
    written and flushed; on any error none of them is left behind."""

    def __init__(self, outdir: Path) -> None:
        self.outdir = outdir
        self.open: dict[str, BinaryIO] = {}

    def __call__(self, name: str) -> BinaryIO:
        if name not in self.open:
            self.open[name] = open(self.outdir / f".{name}.tmp", "wb")
        return self.open[name]

    def commit(self) -> list[dict[str, Any]]:
        """Flushes, hashes and renames every file; returns their entries (name order of
        creation)."""
        infos = []
        for f in self.open.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        for name in self.open:
            tmp = self.outdir / f".{name}.tmp"
            infos.append({"file": name, "bytes": tmp.stat().st_size,
                          "sha256": sha256_file(tmp)})
        for name in self.open:
            os.replace(self.outdir / f".{name}.tmp", self.outdir / name)
        fd = os.open(self.outdir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self.open = {}
        return infos

    def discard(self) -> None:
        for name, f in self.open.items():
            f.close()
            (self.outdir / f".{name}.tmp").unlink(missing_ok=True)
        self.open = {}


def sha256_file(path: Path) -> str:
    """The hex SHA-256 of a file's bytes (the manifest's checksum of every file written)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_format_shard(fmt: str, outdir: Path, i: int, n: int, schema: pa.Schema,
                       token_columns: Sequence[str], packs: int,
                       batches: Iterator[pa.RecordBatch],
                       stored: dict[str, str] | None = None) -> dict[str, Any]:
    """Writes output shard ``i`` of ``n`` (the record batches of its ``packs`` packs, in
    the output ``schema``) in format ``fmt``; ``stored``: the dtype of each token column
    in a megatron .bin (:func:`megatron_dtypes`; None: the schema's). Returns the shard's
    journal entry: ``file``, ``rows``,
    ``tokens``, ``bytes``, ``sha256`` (of the main file), and ``parts`` (the other files)
    and ``mds`` (its line of index.json) where the format has them."""
    if fmt == "parquet":
        from .outdir import write_shard

        return write_shard(outdir, _shard_name(i, n), schema, batches)
    files = _Files(outdir)
    try:
        if fmt == "megatron":
            rows, tokens = _write_megatron(files, _base(i, n), schema, token_columns,
                                           batches, stored)
            extra: dict[str, Any] = {}
        else:
            rows, tokens, extra = _write_mds(files, _base(i, n), schema, packs, batches)
        infos = files.commit()
    finally:
        files.discard()
    main, *parts = infos
    entry = {"file": main["file"], "rows": rows, "tokens": tokens, "bytes": main["bytes"],
             "sha256": main["sha256"]}
    if parts:
        entry["parts"] = parts
    return {**entry, **extra}


def _flat(column: pa.Array) -> np.ndarray:
    """The values of a list column (of a record batch, perhaps a slice) as numpy."""
    return np.asarray(column.flatten().to_numpy(zero_copy_only=False))


# ---------------------------------------------------------------------------------------
# megatron-core indexed datasets


def _megatron_dtype(dtype: np.dtype, column: str) -> np.dtype:
    if dtype.name in _IDX_DTYPES:
        return dtype
    raise FastpackError(f"format megatron: column {column!r} holds {dtype.name}, which "
                        f"megatron-core's indexed dataset cannot ({', '.join(_IDX_DTYPES)})")


def _write_megatron(files: _Files, base: str, schema: pa.Schema,
                    token_columns: Sequence[str], batches: Iterator[pa.RecordBatch],
                    stored: dict[str, str] | None) -> tuple[int, int]:
    """Each token column's values go to its .bin as they come (a pack's tokens are
    contiguous in a batch); the .idx, which needs every sequence's length first, is
    written at the end from the seq_lengths column (4 bytes per sequence kept)."""
    names = {c: base if k == 0 else f"{base}.{c}" for k, c in enumerate(token_columns)}
    dtypes = {c: _megatron_dtype(np.dtype(stored[c]) if stored else _value_dtype(
        schema.field(c).type), c) for c in token_columns}
    for c in token_columns:  # .bin before .idx for each column: the main file is first
        files(f"{names[c]}.bin")
    seqlens: list[np.ndarray] = []
    per_pack: list[np.ndarray] = []
    rows = tokens = 0
    for batch in batches:
        lengths = batch.column("seq_lengths")
        seqlens.append(_flat(lengths).astype(np.int32, copy=False))
        per_pack.append(np.diff(np.asarray(lengths.offsets)))
        for c in token_columns:
            values = _flat(batch.column(c)).astype(dtypes[c], copy=False)
            files(f"{names[c]}.bin").write(np.ascontiguousarray(values).data)
        rows += batch.num_rows
        tokens += int(seqlens[-1].sum(dtype=np.int64))
    sequence_lengths = np.concatenate(seqlens) if seqlens else np.zeros(0, np.int32)
    counts = np.concatenate(per_pack) if per_pack else np.zeros(0, np.int64)
    document_indices = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=document_indices[1:])
    for c in token_columns:
        itemsize = dtypes[c].itemsize
        pointers = np.zeros(len(sequence_lengths), dtype=np.int64)
        np.cumsum(sequence_lengths[:-1], out=pointers[1:])
        pointers *= itemsize
        f = files(f"{names[c]}.idx")
        f.write(_IDX_MAGIC)
        f.write(struct.pack("<QB", 1, _IDX_DTYPES[dtypes[c].name]))
        f.write(struct.pack("<QQ", len(sequence_lengths), len(document_indices)))
        f.write(sequence_lengths.astype("<i4", copy=False).data)
        f.write(pointers.astype("<i8", copy=False).data)
        f.write(document_indices.astype("<i8", copy=False).data)
    # The main file first in the entry: reorder so the token column's .bin leads.
    order = [f"{names[c]}.{ext}" for c in token_columns for ext in ("bin", "idx")]
    files.open = {name: files.open[name] for name in order}
    return rows, tokens


# ---------------------------------------------------------------------------------------
# MosaicML streaming (MDS)


def _mds_columns(schema: pa.Schema) -> list[tuple[str, np.dtype]]:
    """The MDS columns (sorted by name, as MDS orders them) and the dtype of each."""
    columns = []
    for field in schema:
        dtype = _value_dtype(field.type)
        if field.name in ("position_ids", "seq_lengths"):
            dtype = np.dtype(np.int32)  # positions and lengths are below max_len
        if dtype.name not in _MDS_DTYPES:
            raise FastpackError(f"format mds: column {field.name!r} holds {dtype.name}, "
                                f"which MDS ndarray columns cannot")
        columns.append((field.name, dtype))
    return sorted(columns)


def _mds_config(columns: Sequence[tuple[str, np.dtype]]) -> dict[str, Any]:
    return {"column_encodings": [f"ndarray:{d.name}" for _, d in columns],
            "column_names": [c for c, _ in columns],
            "column_sizes": [None] * len(columns),
            "compression": None, "format": "mds", "hashes": [], "size_limit": None,
            "version": 2}


def _mds_samples(batch: pa.RecordBatch,
                 columns: Sequence[tuple[str, np.dtype]]) -> tuple[np.ndarray, list[Any]]:
    """The batch's packs as MDS samples: each sample's size (int64 [rows]) and the
    pieces to write in order (bytes and numpy views; per pack and column: the size
    word of the sample, the ndarray shape header, the values)."""
    rows = batch.num_rows
    heads, bodies = [], []
    for name, dtype in columns:
        column = batch.column(name)
        counts = np.diff(np.asarray(column.offsets)).astype(np.int64)
        # The shape's width: the smallest of uint8/16/32 holding the length.
        width = np.where(counts < 1 << 8, 0, np.where(counts < 1 << 16, 1, 2))
        heads.append((counts, width))
        values = _flat(column).astype(dtype, copy=False)
        starts = np.zeros(rows + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        bodies.append((np.ascontiguousarray(values), starts))
    datum = [1 + (1 << w) + c * d.itemsize
             for (c, w), (_, d) in zip(heads, columns)]
    sizes = 4 * len(columns) + np.sum(datum, axis=0)
    pieces: list[Any] = []
    word = np.stack([d.astype("<u4") for d in datum], axis=1)  # [rows, columns]
    for p in range(rows):
        pieces.append(word[p].tobytes())
        for (counts, width), (values, starts) in zip(heads, bodies):
            w = int(width[p])
            pieces.append(bytes([(1 << 2) | w]))
            pieces.append(int(counts[p]).to_bytes(1 << w, "little"))
            pieces.append(values[starts[p]:starts[p + 1]].data)
    return np.asarray(sizes, dtype=np.int64), pieces


def _write_mds(files: _Files, base: str, schema: pa.Schema, packs: int,
               batches: Iterator[pa.RecordBatch]) -> tuple[int, int, dict[str, Any]]:
    """An MDS shard: sample count (uint32), sample offsets (uint32 [n+1], from the start
    of the file), the config JSON, the samples. The shard's pack count is known from the
    plan, so the header's place is kept and its offsets written once the samples are."""
    columns = _mds_columns(schema)
    config = _mds_config(columns)
    config_bytes = json.dumps(config, sort_keys=True).encode()
    name = f"{base}.mds"
    out = files(name)
    head = 4 + 4 * (packs + 1) + len(config_bytes)
    out.write(bytes(head))
    sizes: list[np.ndarray] = []
    rows = tokens = 0
    for batch in batches:
        sample_sizes, pieces = _mds_samples(batch, columns)
        out.writelines(pieces)
        sizes.append(sample_sizes)
        rows += batch.num_rows
        tokens += int(_flat(batch.column("seq_lengths")).sum(dtype=np.int64))
    if rows != packs:
        raise FastpackError(f"format mds: shard {name} got {rows:,} packs, the plan "
                            f"gives it {packs:,}")
    offsets = np.zeros(rows + 1, dtype=np.int64)
    if sizes:
        np.cumsum(np.concatenate(sizes), out=offsets[1:])
    offsets += head
    if offsets[-1] > _MDS_MAX_BYTES:
        raise FastpackError(f"format mds: shard {name} would hold {int(offsets[-1]):,} bytes; "
                            "MDS shards address at most 4 GiB: pass a smaller --shard-rows")
    out.seek(0)
    out.write(struct.pack("<I", rows))
    out.write(offsets.astype("<u4").data)
    out.write(config_bytes)
    info = {"samples": rows, "raw_data": {"basename": name, "bytes": int(offsets[-1]),
                                           "hashes": {}}, "zip_data": None, **config}
    return rows, tokens, {"mds": info}


def finish_format(fmt: str, outdir: Path, entries: Sequence[dict[str, Any]]) -> None:
    """What a format needs once every shard is there: MDS's index.json (each shard's
    line, in shard order), written atomically before the manifest."""
    if fmt != "mds":
        return
    index = {"shards": [e["mds"] for e in entries], "version": 2}
    tmp = outdir / f".{_MDS_INDEX}.tmp"
    with open(tmp, "w") as f:
        json.dump(index, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, outdir / _MDS_INDEX)
