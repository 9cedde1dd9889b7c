"""Hugging Face ``datasets``: :func:`pack_dataset`, a drop-in for TRL's ``pack_dataset``.

The rows' lengths are read from the Arrow offsets, the whole dataset is planned at once
(best fit over every row, not 1,000-row windows), and the token data moves once, in Rust,
from the input's Arrow buffers — every chunk in place, a ``shuffle``/``select``/``filter``
indices mapping read through — into the packed table, in record batches of bounded size.
Nothing is lost silently: over-long rows follow ``overlong`` and every truncated or
dropped token is counted, logged and written into the result's ``info.description``.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _core
from ._arrow import dataset_parts, list_columns, per_token_columns
from ._errors import FastpackError, FastpackTypeError
from ._gather import DEFAULT_BATCH_TOKENS, prepare
from ._plan import OVERLONG_POLICIES, STRATEGIES, Plan, _choice, pack

__all__ = ["pack_dataset"]

logger = logging.getLogger("fastpack")

#: TRL's strategy names that fastpack spells differently.
TRL_STRATEGIES = {"bfd_split": ("bfd", "split")}
#: Columns pack_dataset writes itself.
WRITTEN = ("seq_lengths", "position_ids")


def _kind(dataset: Any) -> str:
    name = type(dataset).__name__
    if type(dataset).__module__.startswith("datasets"):
        return name
    return ""


def pack_dataset(
    dataset: Any,
    max_len: int,
    *,
    strategy: str = "bfd",
    overlong: str = "error",
    reserve: int = 0,
    separator_id: int | None = None,
    shuffle: bool = False,
    seed: int = 0,
    group_tokens: int | None = None,
    long_max_len: int | None = None,
    columns: Sequence[str] | None = None,
    threads: int | None = None,
    keep_in_memory: bool = False,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    buffer_size: int | None = None,
) -> Any:
    """Pack a Hugging Face dataset: one row per pack of at most ``max_len`` tokens.

    A drop-in for TRL's ``pack_dataset(dataset, seq_length, strategy)``: the result has
    the packed per-token columns and TRL's ``seq_lengths``, which TRL's collators and
    ``SFTTrainer`` read as they read TRL's own output; plus ``position_ids`` restarting at
    0 in every packed sequence. Unlike TRL, rows are packed best-fit over the whole
    dataset, and over-long rows raise unless ``overlong`` says what to do with them.

    Args:
        dataset: a ``datasets.Dataset`` (a ``DatasetDict`` packs every split; a
            ``datasets.IterableDataset`` is packed as a stream in bounded windows).
        max_len: tokens per pack.
        strategy: ``"bfd"`` (best fit decreasing, the fewest packs), ``"ffd"``,
            ``"next_fit"`` (keeps row order), ``"wrapped"`` (concatenate and cut every
            ``max_len`` tokens), or TRL's ``"bfd_split"`` (= ``"bfd"`` with
            ``overlong="split"``).
        overlong: rows longer than ``max_len - reserve``: ``"error"`` (raise, naming the
            first such row), ``"truncate"`` (TRL ``bfd``), ``"split"`` into pieces packed
            on their own (TRL ``bfd_split``), or ``"drop"``. Lost tokens are counted.
        reserve, separator_id: slots after every row, filled with ``separator_id`` in
            ``input_ids`` (-100 in ``labels``, 1 in ``attention_mask``, 0 elsewhere).
        shuffle, seed: shuffle the packs (``bfd`` packs otherwise come sorted by fill).
        group_tokens: two-level packing: packs are ordered in groups of at most this many
            tokens (a step or micro-batch); the result gets a ``group`` column.
        long_max_len: a second bucket: rows over ``max_len`` go to packs of this cap.
        columns: the per-token columns to pack (default: every column holding a list of
            numbers per row, except ``seq_lengths``/``position_ids``; other columns are
            left out). Each must have one value per token of ``input_ids``.
        threads: worker threads (default: ``RAYON_NUM_THREADS`` or all cores); the
            result does not depend on it.
        keep_in_memory: for a dataset backed by cache files, keep the result in memory
            instead of writing it (memory-mapped) next to the input's cache files.
        batch_tokens: tokens per written record batch: bounds the memory in flight.
        buffer_size: for an ``IterableDataset``, the rows packed together in one window
            (default: the stream packer's).

    Returns:
        A ``datasets.Dataset`` (or ``DatasetDict`` / ``IterableDataset``) in the input's
        format, with the packing summary in ``info.description`` and in the log
        (logger ``"fastpack"``: a warning when tokens were truncated or dropped).
    """
    kind = _kind(dataset)
    strategy, overlong = _strategy(strategy, overlong)  # TRL's names become fastpack's
    options: dict[str, Any] = dict(
        strategy=strategy, overlong=overlong, reserve=reserve, separator_id=separator_id,
        shuffle=shuffle, seed=seed, group_tokens=group_tokens, long_max_len=long_max_len,
        columns=columns, threads=threads,
    )
    if kind in ("IterableDataset", "IterableDatasetDict"):
        from ._stream import pack_iterable_dataset

        if buffer_size is not None:
            options["buffer_size"] = buffer_size
        if kind == "IterableDatasetDict":
            import datasets

            return datasets.IterableDatasetDict({
                split: pack_iterable_dataset(ds, max_len, **options)
                for split, ds in dataset.items()
            })
        return pack_iterable_dataset(dataset, max_len, **options)
    if buffer_size is not None:
        raise FastpackError(
            "buffer_size: applies to a streamed datasets.IterableDataset; a Dataset is "
            "packed whole"
        )
    if kind == "DatasetDict":
        import datasets

        return datasets.DatasetDict({
            split: _pack_one(ds, max_len, keep_in_memory=keep_in_memory,
                             batch_tokens=batch_tokens, split=str(split), **options)
            for split, ds in dataset.items()
        })
    if kind != "Dataset":
        raise FastpackTypeError(
            f"dataset: expected a datasets.Dataset, DatasetDict or IterableDataset, got "
            f"{type(dataset).__name__}"
        )
    return _pack_one(dataset, max_len, keep_in_memory=keep_in_memory,
                     batch_tokens=batch_tokens, split=None, **options)


def _strategy(strategy: str, overlong: str) -> tuple[str, str]:
    if isinstance(strategy, str) and strategy in TRL_STRATEGIES:
        fp_strategy, policy = TRL_STRATEGIES[strategy]
        if overlong not in ("error", policy):
            raise FastpackError(
                f"overlong: {overlong!r} contradicts strategy={strategy!r} (which splits "
                f"over-long rows); pass strategy='bfd' with overlong={overlong!r}"
            )
        return fp_strategy, policy
    _choice("strategy", strategy, (*STRATEGIES, *TRL_STRATEGIES))
    _choice("overlong", overlong, OVERLONG_POLICIES)
    return strategy, overlong


def _choose_columns(dataset: Any, columns: Sequence[str] | None) -> list[str] | None:
    if columns is None:
        table, _ = dataset_parts(dataset)
        chosen = [c for c in per_token_columns(table) if c not in WRITTEN]
        if not chosen:
            raise FastpackError(
                "columns: no column holds a list of numbers per row; the dataset has "
                + ", ".join(f"{f.name} ({f.type})" for f in table.schema)
            )
        return chosen
    if isinstance(columns, str):
        raise FastpackTypeError("columns: expected a list of column names, got a string")
    written = [c for c in columns if c in WRITTEN]
    if written:
        raise FastpackError(
            f"columns: {written[0]!r} is written by pack_dataset from the plan; leave it out"
        )
    return list(columns)


def _pack_one(
    dataset: Any, max_len: int, *, strategy: str, overlong: str, reserve: int,
    separator_id: int | None, shuffle: bool, seed: int, group_tokens: int | None,
    long_max_len: int | None, columns: Sequence[str] | None, threads: int | None,
    keep_in_memory: bool, batch_tokens: int, split: str | None,
) -> Any:
    import datasets
    import pyarrow as pa

    strategy, overlong = _strategy(strategy, overlong)
    chosen = _choose_columns(dataset, columns)
    handles, types, skipped = list_columns(dataset, chosen)
    names = [h.name for h in handles]
    # Lengths come from input_ids (or the first column); every other column must match.
    first = names.index("input_ids") if "input_ids" in names else 0
    order = [first] + [k for k in range(len(handles)) if k != first]
    lengths = _core.column_lengths([handles[k] for k in order], threads)
    try:
        plan = pack(
            lengths, max_len, strategy=strategy, overlong=overlong, reserve=reserve,
            shuffle=shuffle, seed=seed, threads=threads, long_max_len=long_max_len,
            group_tokens=group_tokens,
        )
    except FastpackError as e:
        message = str(e)
        if message.startswith("lengths: "):  # rows of the dataset, named as such
            message = (f"column {names[first]!r}: "
                       + message[len("lengths: "):].replace("sequence(s)", "row(s)")
                       .replace("at index", "at row"))
        raise FastpackError(message) from None
    if reserve and separator_id is None:
        raise FastpackError(
            f"separator_id: reserve={reserve} keeps slots after every row; pass the "
            f"separator token id to write into {names[first]!r}"
        )
    fill = None if separator_id is None else {names[first]: separator_id}
    schema, batches = prepare(
        plan, handles, types, None, separator_id=None, fill=fill, position_ids=True,
        batch_tokens=batch_tokens, threads=threads,
    )
    group = _group_of_packs(plan)
    if group is not None:
        schema = schema.append(pa.field("group", pa.int64()))
        batches = _with_groups(batches, group)
    summary = _summary(plan, names[first], dataset, skipped, columns is None)
    features = datasets.Features.from_arrow_schema(schema)
    schema = pa.schema(schema, metadata=features.arrow_schema.metadata)
    info = dataset.info.copy()
    info.features = features
    info.description = ((info.description + "\n\n") if info.description else "") + summary
    from datasets.fingerprint import Hasher

    from . import __version__

    fingerprint = Hasher.hash([
        "fastpack.hf.pack_dataset", __version__, dataset._fingerprint, max_len, strategy,
        overlong, reserve, separator_id, shuffle, seed, group_tokens, long_max_len, names,
    ])
    cache_dir = _cache_dir(dataset) if not keep_in_memory else None
    if cache_dir is None:
        table = pa.Table.from_batches(list(batches), schema=schema)
        packed = datasets.Dataset(
            datasets.table.InMemoryTable(table), info=info, split=dataset.split,
            fingerprint=fingerprint,
        )
    else:
        path = os.path.join(cache_dir, f"fastpack-packed-{fingerprint}.arrow")
        _write(path, schema, batches)
        packed = datasets.Dataset.from_file(path, info=info, split=dataset.split)
        packed._fingerprint = fingerprint
    _restore_format(packed, dataset, names)
    lost = plan.truncated_tokens or plan.dropped_tokens
    where = f" ({split})" if split else ""
    (logger.warning if lost else logger.info)("pack_dataset%s: %s", where,
                                              summary.replace("\n", "; "))
    return packed


def _group_of_packs(plan: Plan) -> np.ndarray | None:
    if plan.group_offsets is None:
        return None
    return np.repeat(np.arange(plan.num_groups, dtype=np.int64), np.diff(plan.group_offsets))


def _with_groups(batches: Any, group: np.ndarray) -> Any:
    import pyarrow as pa

    at = 0
    for batch in batches:
        n = batch.num_rows
        yield batch.append_column("group", pa.array(group[at:at + n]))
        at += n


def _summary(plan: Plan, column: str, dataset: Any, skipped: list[str], default: bool) -> str:
    lines = [f"Packed by fastpack from column {column!r}: " + plan.summary()]
    if skipped:
        table, _ = dataset_parts(dataset)
        per_token = set(per_token_columns(table))

        def why(name: str) -> str:
            if name in WRITTEN:
                return "rewritten from the plan"
            if name not in per_token:
                return "not one number per token"
            return "left out by default" if default else "not in columns"

        lines.append("columns not packed: " + ", ".join(f"{n} ({why(n)})" for n in skipped))
    return "\n".join(lines)


def _cache_dir(dataset: Any) -> str | None:
    files = [f.get("filename") for f in getattr(dataset, "cache_files", [])]
    files = [f for f in files if f]
    if not files:
        return None
    directory = os.path.dirname(os.path.abspath(files[0]))
    return directory if os.access(directory, os.W_OK) else None


def _write(path: str, schema: Any, batches: Any) -> None:
    """Streams the batches into an Arrow file (as ``datasets`` writes its cache files),
    atomically: a reader never sees a partial file."""
    import pyarrow as pa

    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".fastpack-", suffix=".arrow")
    try:
        with os.fdopen(fd, "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            for batch in batches:
                writer.write_batch(batch)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _restore_format(packed: Any, dataset: Any, names: list[str]) -> None:
    fmt = dataset.format
    if fmt.get("type") is None and fmt.get("columns") in (None, dataset.column_names):
        return
    shown = fmt.get("columns")
    if shown is not None and set(dataset.column_names) <= set(shown):
        shown = None
    if shown is not None:
        shown = [c for c in shown if c in names] + [
            c for c in packed.column_names if c not in names
        ]
    packed.set_format(
        type=fmt.get("type"), columns=shown,
        output_all_columns=fmt.get("output_all_columns", False),
        **fmt.get("format_kwargs", {}),
    )
