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
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import _core
from ._arrow import dataset_parts, list_columns, per_token_columns
from ._errors import FastpackError, FastpackTypeError
from ._gather import DEFAULT_BATCH_TOKENS, prepare
from ._plan import OVERLONG_POLICIES, STRATEGIES, Plan, _choice, _int_arg, pack

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
    max_len: int | None = None,
    strategy: str = "bfd",
    *,
    seq_length: int | None = None,
    map_kwargs: Mapping[str, Any] | None = None,
    overlong: str = "error",
    reserve: int | None = None,
    separator_id: int | None = None,
    shuffle: bool = True,
    seed: int = 0,
    group_tokens: int | None = None,
    long_max_len: int | None = None,
    columns: Sequence[str] | None = None,
    position_ids: bool = False,
    threads: int | None = None,
    keep_in_memory: bool = False,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    buffer_size: int | None = None,
) -> Any:
    """Pack a Hugging Face dataset: one row per pack of at most ``max_len`` tokens.

    A drop-in for TRL's ``pack_dataset(dataset, seq_length, strategy, map_kwargs)``: the
    result has TRL's columns — every packed per-token column, in the input's order, then
    ``seq_lengths`` (``list<int32>``) — which TRL's collators and ``SFTTrainer`` read as
    they read TRL's own output. Unlike TRL, rows are packed best-fit over the whole
    dataset, over-long rows raise unless ``overlong`` says what to do with them, and the
    packs are shuffled (``seed`` 0) unless ``shuffle=False``.

    Args:
        dataset: a ``datasets.Dataset`` (a ``DatasetDict`` packs every split; a
            ``datasets.IterableDataset`` is packed as a stream in bounded windows, with
            the same rows as the Dataset for a window that holds the whole stream).
        max_len: tokens per pack (TRL's ``seq_length``, also accepted by that name).
        strategy: ``"bfd"`` (best fit decreasing, the fewest packs), ``"ffd"``,
            ``"next_fit"`` (keeps row order), ``"wrapped"`` (concatenate and cut every
            ``max_len`` tokens), or TRL's ``"bfd_split"`` (= ``"bfd"`` with
            ``overlong="split"``).
        map_kwargs: TRL's ``Dataset.map`` arguments, where they mean something without a
            ``map``: ``keep_in_memory``, ``cache_file_name`` (where the result is
            written), ``num_proc`` (the thread count, if ``threads`` is not given),
            ``load_from_cache_file``, ``desc`` (no effect: the result is always made, no
            progress bar is shown). Any other key raises: ``batch_size``, say, would
            set TRL's packing window, and fastpack plans the whole dataset at once.
        overlong: rows longer than ``max_len - reserve``: ``"error"`` (raise, naming the
            first such row), ``"truncate"`` (TRL ``bfd``), ``"split"`` into pieces packed
            on their own (TRL ``bfd_split``), or ``"drop"``. Lost tokens are counted.
        reserve, separator_id: slots after every row, filled with ``separator_id`` in
            ``input_ids`` (-100 in ``labels``, 1 in ``attention_mask``, 0 elsewhere).
            ``separator_id`` alone reserves one slot; ``reserve=0`` with a separator, or
            ``reserve`` without one, raises.
        shuffle, seed: shuffle the packs (the default; ``bfd`` packs otherwise come
            sorted by fill).
        group_tokens: two-level packing: packs are ordered in groups of at most this many
            tokens (a step or micro-batch); the result gets a ``group`` column.
        long_max_len: a second bucket: rows over ``max_len`` go to packs of this cap.
        columns: the per-token columns to pack (default: every column holding a list of
            numbers per row, except ``seq_lengths``/``position_ids``; other columns are
            left out). Each must have one value per token of ``input_ids``.
        position_ids: also write ``position_ids`` (``list<int32>``, restarting at 0 in
            every packed sequence). Off by default, as in TRL: its collator builds them
            from ``seq_lengths``, and they would add half the bytes of two int32 columns.
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
    max_len = _max_len(max_len, seq_length)
    strategy, overlong = _strategy(strategy, overlong)  # TRL's names become fastpack's
    reserve = _reserve(reserve, separator_id)
    cache_file_name = None
    if map_kwargs is not None:
        keep_in_memory, cache_file_name, threads = _map_kwargs(
            map_kwargs, keep_in_memory, threads
        )
    options: dict[str, Any] = dict(
        strategy=strategy, overlong=overlong, reserve=reserve, separator_id=separator_id,
        shuffle=shuffle, seed=seed, group_tokens=group_tokens, long_max_len=long_max_len,
        columns=columns, threads=threads,
    )
    if kind in ("IterableDataset", "IterableDatasetDict"):
        if cache_file_name is not None:
            raise FastpackError("map_kwargs: 'cache_file_name' applies to a Dataset; a "
                                "stream is packed as it is read, into no file")
        if kind == "IterableDatasetDict":
            import datasets

            return datasets.IterableDatasetDict({
                split: _pack_stream(ds, max_len, position_ids, buffer_size, options)
                for split, ds in dataset.items()
            })
        return _pack_stream(dataset, max_len, position_ids, buffer_size, options)
    if buffer_size is not None:
        raise FastpackError(
            "buffer_size: applies to a streamed datasets.IterableDataset; a Dataset is "
            "packed whole"
        )
    if kind == "DatasetDict":
        import datasets

        if cache_file_name is not None:
            raise FastpackError("map_kwargs: 'cache_file_name' names one file; a "
                                "DatasetDict has a result per split")
        return datasets.DatasetDict({
            split: _pack_one(ds, max_len, keep_in_memory=keep_in_memory,
                             batch_tokens=batch_tokens, split=str(split),
                             position_ids=position_ids, cache_file_name=None, **options)
            for split, ds in dataset.items()
        })
    if kind != "Dataset":
        raise FastpackTypeError(
            f"dataset: expected a datasets.Dataset, DatasetDict or IterableDataset, got "
            f"{type(dataset).__name__}"
        )
    return _pack_one(dataset, max_len, keep_in_memory=keep_in_memory,
                     batch_tokens=batch_tokens, split=None, position_ids=position_ids,
                     cache_file_name=cache_file_name, **options)


def _max_len(max_len: int | None, seq_length: int | None) -> int:
    if max_len is not None and seq_length is not None:
        raise FastpackError(
            f"seq_length: got max_len={max_len!r} and seq_length={seq_length!r}; "
            "seq_length is TRL's name for max_len: pass one"
        )
    value = max_len if max_len is not None else seq_length
    if value is None:
        raise FastpackTypeError("max_len: missing (the tokens per pack; TRL: seq_length)")
    return value


def _reserve(reserve: int | None, separator_id: int | None) -> int:
    """The team rule: a separator needs a slot, and slots need a separator."""
    if reserve is not None:
        reserve = _int_arg("reserve", reserve, minimum=0)
    if separator_id is None:
        if reserve:
            raise FastpackError(
                f"separator_id: reserve={reserve} keeps slots after every row; pass the "
                "separator token id to write into them"
            )
        return 0
    if reserve == 0:
        raise FastpackError(
            f"reserve: 0 with separator_id={separator_id!r}; a separator needs a slot "
            "after every row: leave reserve out (one slot) or pass reserve >= 1"
        )
    return 1 if reserve is None else reserve


#: TRL's map_kwargs that mean something here; see pack_dataset.
MAP_KWARGS = ("keep_in_memory", "cache_file_name", "num_proc", "load_from_cache_file",
              "desc")


def _map_kwargs(map_kwargs: Mapping[str, Any], keep_in_memory: bool,
                threads: int | None) -> tuple[bool, str | None, int | None]:
    if not isinstance(map_kwargs, Mapping):
        raise FastpackTypeError(
            f"map_kwargs: expected a dict, got {type(map_kwargs).__name__}"
        )
    unknown = [k for k in map_kwargs if k not in MAP_KWARGS]
    if unknown:
        raise FastpackError(
            f"map_kwargs: {unknown[0]!r} has no meaning here (fastpack plans the whole "
            f"dataset at once, without Dataset.map); accepted: {', '.join(MAP_KWARGS)}"
        )
    keep_in_memory = bool(map_kwargs.get("keep_in_memory", keep_in_memory))
    cache_file_name = map_kwargs.get("cache_file_name")
    if cache_file_name is not None:
        cache_file_name = os.fspath(cache_file_name)
    num_proc = map_kwargs.get("num_proc")
    if threads is None and num_proc is not None:
        threads = _int_arg("map_kwargs['num_proc']", num_proc, minimum=1, maximum=4096)
    return keep_in_memory, cache_file_name, threads


def _pack_stream(dataset: Any, max_len: int, position_ids: bool, buffer_size: int | None,
                 options: dict[str, Any]) -> Any:
    import inspect

    from ._stream import pack_iterable_dataset

    options = dict(options)
    if buffer_size is not None:
        options["buffer_size"] = buffer_size
    # The stream packer may not take `position_ids` (it then always writes them).
    takes = "position_ids" in inspect.signature(pack_iterable_dataset).parameters
    if takes:
        options["position_ids"] = position_ids
    packed = pack_iterable_dataset(dataset, max_len, **options)
    if takes or position_ids:
        return packed
    return packed.remove_columns(["position_ids"])


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
    keep_in_memory: bool, batch_tokens: int, split: str | None, position_ids: bool,
    cache_file_name: str | None,
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
    fill = None if separator_id is None else {names[first]: separator_id}
    schema, batches = prepare(
        plan, handles, types, None, separator_id=None, fill=fill, position_ids=position_ids,
        batch_tokens=batch_tokens, threads=threads,
    )
    group = _group_of_packs(plan)
    if group is not None:
        schema = schema.append(pa.field("group", pa.int64()))
        batches = _with_groups(batches, group)
    summary = _summary(plan, names[first], dataset, skipped, columns is None, position_ids)
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
        position_ids,
    ])
    if cache_file_name is not None:
        path: str | None = os.path.abspath(cache_file_name)
    elif keep_in_memory:
        path = None
    else:
        cache_dir = _cache_dir(dataset)
        path = cache_dir and os.path.join(cache_dir, f"fastpack-packed-{fingerprint}.arrow")
    if path is None:
        table = pa.Table.from_batches(list(batches), schema=schema)
        packed = datasets.Dataset(
            datasets.table.InMemoryTable(table), info=info, split=dataset.split,
            fingerprint=fingerprint,
        )
    else:
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


def _summary(plan: Plan, column: str, dataset: Any, skipped: list[str], default: bool,
             position_ids: bool) -> str:
    lines = [f"Packed by fastpack from column {column!r}: " + plan.summary()]
    if skipped:
        table, _ = dataset_parts(dataset)
        per_token = set(per_token_columns(table))

        def why(name: str) -> str:
            if name == "seq_lengths" or (name == "position_ids" and position_ids):
                return "rewritten from the plan"
            if name == "position_ids":
                return "position_ids=True writes them from the plan"
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
    atomically: a reader never sees a partial file. The file gets the mode any file of
    this process gets (0666 less the umask, as ``datasets``' own cache files), and is
    written once, by Arrow's own file writer (no Python file object in between)."""
    import pyarrow as pa

    tmp = os.path.join(os.path.dirname(path),
                       f".fastpack-{os.getpid()}-{os.urandom(6).hex()}.arrow")
    # O_EXCL: the name is ours alone; 0o666 & ~umask is applied by open(2).
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
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
