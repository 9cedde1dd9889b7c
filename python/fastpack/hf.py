"""Hugging Face ``datasets``: :func:`pack_dataset`, TRL's columns from one global plan
(the drop-in with TRL's rows and defaults is :mod:`fastpack.trl`).

The rows' lengths are read from the Arrow offsets, the whole dataset is planned at once
(best fit over every row, not 1,000-row windows), and the token data moves once, in Rust,
from the input's Arrow buffers — every chunk in place, a ``shuffle``/``select``/``filter``
indices mapping read through — into the packed table, in record batches of bounded size.
Nothing is lost silently: over-long rows follow ``overlong`` and every truncated or
dropped token is counted, logged and written into the result's ``info.description``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _core
from ._arrow import dataset_parts, list_columns, per_token_columns
from ._checks import _threads
from ._errors import FastpackError, FastpackTypeError
from ._gather import DEFAULT_BATCH_TOKENS, WRITTEN, check_packable, prepare
from ._options import PackOptions, _Args, with_separator
from ._plan import Plan, pack
from .vlm import IMAGE_KEYS, VIDEO_KEYS, media_budgets

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["pack_dataset"]

logger = logging.getLogger("fastpack")

#: TRL's strategy names that fastpack spells differently.
TRL_STRATEGIES = {"bfd_split": ("bfd", "split")}


def _kind(dataset: Any) -> str:
    name = type(dataset).__name__
    if type(dataset).__module__.startswith("datasets"):
        return name
    return ""


def pack_dataset(
    dataset: Any,
    max_len: int | None = None,
    strategy: str | None = None,
    *,
    seq_length: int | None = None,
    map_kwargs: Mapping[str, Any] | None = None,
    options: PackOptions | None = None,
    separator_id: int | None = None,
    columns: Sequence[str] | None = None,
    position_ids: bool = False,
    seq_lengths: bool | None = None,
    threads: int | None = None,
    keep_in_memory: bool = False,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    buffer_size: int | None = None,
    **kwargs: Unpack[_Args],
) -> Any:
    """Pack a Hugging Face dataset: one row per pack of at most ``max_len`` tokens.

    Takes TRL's ``pack_dataset(dataset, seq_length, strategy, map_kwargs)`` arguments; the
    result has TRL's columns — every packed per-token column, in the input's order, then
    ``seq_lengths`` (``list<int32>``; not for ``"wrapped"``, as in TRL) — which TRL's
    collators and ``SFTTrainer`` read as they read TRL's own output. Unlike TRL, rows are
    packed best-fit over the whole dataset, over-long rows raise unless ``overlong`` says
    what to do with them, and the packs are shuffled (``seed`` 0) unless
    ``shuffle=False``. The drop-in with TRL's defaults and TRL's rows, window by window,
    is :func:`fastpack.trl.pack_dataset`.

    Args:
        dataset: a ``datasets.Dataset`` (a ``DatasetDict`` packs every split; a
            ``datasets.IterableDataset`` is packed as a stream in bounded windows, with
            the same rows as the Dataset for a window that holds the whole stream).
        max_len: tokens per pack (TRL's ``seq_length``, also accepted by that name).
        strategy: ``"bfd"`` (best fit decreasing, the fewest packs; the default),
            ``"ffd"``, ``"next_fit"`` (keeps row order), ``"wrapped"`` (concatenate and cut
            every ``max_len`` tokens), ``"one_per_pack"`` (a row per sequence), or TRL's
            ``"bfd_split"`` (= ``"bfd"`` with ``overlong="split"``).
        map_kwargs: TRL's ``Dataset.map`` arguments, where they mean something without a
            ``map``: ``keep_in_memory``, ``cache_file_name`` (where the result is
            written), ``num_proc`` (the thread count, if ``threads`` is not given),
            ``load_from_cache_file``, ``desc`` (no effect: the result is always made, no
            progress bar is shown). Any other key raises: ``batch_size``, say, would
            set TRL's packing window, and fastpack plans the whole dataset at once.
        options: a :class:`fastpack.PackOptions`, instead of (or agreeing with)
            ``max_len``, ``strategy`` and the keywords.
        separator_id: written into the slots ``reserve`` keeps after every row (-100 in
            ``labels``, 1 in ``attention_mask``, 0 elsewhere). ``separator_id`` alone
            reserves one slot; ``reserve=0`` with a separator, or ``reserve`` without one,
            raises.
        columns: the per-token columns to pack (default: every column holding a list of
            numbers per row, except ``seq_lengths``/``position_ids``; other columns are
            left out). Each must have one value per token of ``input_ids``.
        position_ids: also write ``position_ids`` (``list<int64>``, restarting at 0 in
            every packed sequence). Off by default, as in TRL: its collator builds them
            from ``seq_lengths``, and they would add the bytes of two int32 columns.
        seq_lengths: write ``seq_lengths`` (each packed sequence's tokens, per row: where
            TRL's collator restarts positions and stops attention). Default: for every
            strategy but ``"wrapped"``, whose rows are cut with no regard to documents, as
            TRL's are (its collator then attends across the cuts). ``seq_lengths=True``
            with ``"wrapped"`` keeps each document's boundaries in the rows instead.
        threads: worker threads (default: ``RAYON_NUM_THREADS`` or all cores); the
            result does not depend on it.
        keep_in_memory: for a dataset backed by cache files, keep the result in memory
            instead of writing it (memory-mapped) next to the input's cache files.
        batch_tokens: tokens per written record batch: bounds the memory in flight.
        buffer_size: for an ``IterableDataset``, the rows packed together in one window
            (default: the stream packer's).
        **kwargs: the other packing options (:class:`fastpack.PackOptions`), as in
            :func:`fastpack.pack`: ``overlong`` (rows longer than ``max_len - reserve``:
            ``"error"``, raising and naming the first such row; ``"truncate"``, TRL
            ``bfd``; ``"split"``, TRL ``bfd_split``; or ``"drop"``; lost tokens are
            counted), ``reserve``, ``shuffle`` and ``seed`` (shuffle the packs: the
            default; ``bfd`` packs otherwise come sorted by fill), ``group_tokens``
            (packs ordered in groups of at most this many tokens, with a ``group``
            column), ``long_max_len`` (rows over ``max_len`` go to packs of this cap),
            ``limits`` (budgets besides tokens, ``{name: cap}`` with ``name`` one of
            ``"patches"``, ``"images"``, ``"videos"``, counted from each row's
            ``image_grid_thw`` / ``video_grid_thw``, or its ``pixel_values`` rows for
            ``"images"`` of plain-position models: no pack holds more).

    A vision-language dataset's media columns (``pixel_values``, ``image_grid_thw``,
    ``pixel_values_videos``, ``video_grid_thw``, ``second_per_grid_ts``, ``image_sizes``)
    are not per-token: each packed row gets its rows' media concatenated in the order of
    their tokens (placeholder order), ready for ``PackedCollator(model_config=...)``'s
    batch format or the model.

    Returns:
        A ``datasets.Dataset`` (or ``DatasetDict`` / ``IterableDataset``) in the input's
        format, with the packing summary in ``info.description`` and in the log
        (logger ``"fastpack"``: a warning when tokens were truncated or dropped).
    """
    kind = _kind(dataset)
    if options is None or max_len is not None or seq_length is not None:
        max_len = _max_len(max_len, seq_length)
    options, given = _trl_strategy(strategy, options, dict(kwargs))
    opts = with_separator(pack_dataset, options, max_len, given, separator_id, refuse={
        "share_prefix": "its rows are packs of whole sequences, which cannot hold trees; "
                        "train with PackedDataset(..., PackedCollator(share_prefix=True))",
    })
    if seq_lengths is None:
        seq_lengths = opts.strategy != "wrapped"
    elif not isinstance(seq_lengths, bool):
        raise FastpackTypeError(
            f"seq_lengths: expected True, False or None, got {type(seq_lengths).__name__}")
    if position_ids and not seq_lengths and opts.strategy == "wrapped":
        raise FastpackError(
            "position_ids: they restart at every document, which rows wrapped without "
            "boundaries (seq_lengths=False) do not have; pass seq_lengths=True for rows "
            "that keep each document's boundaries")
    cache_file_name = None
    if map_kwargs is not None:
        keep_in_memory, cache_file_name, threads = _map_kwargs(
            map_kwargs, keep_in_memory, threads
        )
    threads = _threads(threads)
    if kind in ("IterableDataset", "IterableDatasetDict"):
        media = _media_columns(dataset)
        if media:
            raise FastpackError(
                f"dataset: a streamed dataset's media columns ({', '.join(media)}) are not "
                f"packed (a stream packs per-token columns); use a datasets.Dataset, or "
                f"remove_columns({media!r}) to pack the text alone"
            )
        if cache_file_name is not None:
            raise FastpackError("map_kwargs: 'cache_file_name' applies to a Dataset; a "
                                "stream is packed as it is read, into no file")
        stream = functools.partial(
            _pack_stream, options=opts, separator_id=separator_id, columns=columns,
            threads=threads, position_ids=position_ids, buffer_size=buffer_size,
            seq_lengths=seq_lengths,
        )
        if kind == "IterableDatasetDict":
            import datasets

            return datasets.IterableDatasetDict({
                split: stream(ds) for split, ds in dataset.items()
            })
        return stream(dataset)
    if buffer_size is not None:
        raise FastpackError(
            "buffer_size: applies to a streamed datasets.IterableDataset; a Dataset is "
            "packed whole"
        )
    one = functools.partial(
        _pack_one, options=opts, separator_id=separator_id, columns=columns, threads=threads,
        keep_in_memory=keep_in_memory, batch_tokens=batch_tokens, position_ids=position_ids,
        seq_lengths=seq_lengths,
    )
    if kind == "DatasetDict":
        import datasets

        if cache_file_name is not None:
            raise FastpackError("map_kwargs: 'cache_file_name' names one file; a "
                                "DatasetDict has a result per split")
        return datasets.DatasetDict({
            split: one(ds, split=str(split), cache_file_name=None)
            for split, ds in dataset.items()
        })
    if kind != "Dataset":
        raise FastpackTypeError(
            f"dataset: expected a datasets.Dataset, DatasetDict or IterableDataset, got "
            f"{type(dataset).__name__}"
        )
    return one(dataset, split=None, cache_file_name=cache_file_name)


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
        threads = _threads(num_proc, "map_kwargs['num_proc']")
    return keep_in_memory, cache_file_name, threads


def _pack_stream(dataset: Any, *, options: PackOptions, separator_id: int | None,
                 columns: Sequence[str] | None, threads: int | None, position_ids: bool,
                 buffer_size: int | None, seq_lengths: bool) -> Any:
    from ._stream import DEFAULT_BUFFER_SIZE, pack_iterable_dataset

    packed = pack_iterable_dataset(
        dataset, options=options, separator_id=separator_id, columns=columns, threads=threads,
        buffer_size=DEFAULT_BUFFER_SIZE if buffer_size is None else buffer_size,
    )
    # The stream always writes position_ids and seq_lengths.
    unwanted = [name for name, wanted in (("position_ids", position_ids),
                                          ("seq_lengths", seq_lengths)) if not wanted]
    if unwanted:
        packed = packed.remove_columns(unwanted)
    # The input's format (numpy, torch ...), as the Dataset path restores it.
    formatting = getattr(dataset, "_formatting", None)
    if formatting is not None and formatting.format_type is not None:
        packed = packed.with_format(formatting.format_type)
    return packed


def _trl_strategy(strategy: Any, options: PackOptions | None,
                  kwargs: dict[str, Any]) -> tuple[PackOptions | None, dict[str, Any]]:
    """TRL's strategy names as fastpack's options: ``"bfd_split"`` is ``"bfd"`` with
    ``overlong="split"``; any other name is checked as every strategy is."""
    if strategy is None:
        return options, kwargs
    if isinstance(strategy, str) and strategy in TRL_STRATEGIES:
        fp_strategy, policy = TRL_STRATEGIES[strategy]
        overlong = kwargs.get("overlong", "error" if options is None else options.overlong)
        if overlong not in ("error", policy):
            raise FastpackError(
                f"overlong: {overlong!r} contradicts strategy={strategy!r} (which splits "
                f"over-long rows); pass strategy='bfd' with overlong={overlong!r}"
            )
        kwargs["overlong"] = policy
        if options is not None:
            options = options.replace(overlong=policy)
        strategy = fp_strategy
    kwargs["strategy"] = strategy
    return options, kwargs


def _choose_columns(dataset: Any, columns: Sequence[str] | None) -> list[str] | None:
    if columns is None:
        table, _ = dataset_parts(dataset)
        chosen = [c for c in per_token_columns(table)
                  if c not in WRITTEN and c not in IMAGE_KEYS + VIDEO_KEYS]
        if not chosen:
            raise FastpackError(
                "columns: no column holds a list of numbers per row; the dataset has "
                + ", ".join(f"{f.name} ({f.type})" for f in table.schema)
            )
        return chosen
    if isinstance(columns, str):
        raise FastpackTypeError("columns: expected a list of column names, got a string")
    check_packable(columns, "pack_dataset")
    return list(columns)


def _pack_one(
    dataset: Any, *, options: PackOptions, separator_id: int | None,
    columns: Sequence[str] | None, threads: int | None, keep_in_memory: bool,
    batch_tokens: int, split: str | None, position_ids: bool, cache_file_name: str | None,
    seq_lengths: bool,
) -> Any:
    import datasets
    import pyarrow as pa

    chosen = _choose_columns(dataset, columns)
    handles, types, skipped = list_columns(dataset, chosen)
    names = [h.name for h in handles]
    # Lengths come from input_ids (or the first column); every other column must match.
    first = names.index("input_ids") if "input_ids" in names else 0
    order = [first] + [k for k in range(len(handles)) if k != first]
    lengths = _core.column_lengths([handles[k] for k in order], threads)
    media = [c for c in _media_columns(dataset) if c not in names]
    if media:
        _refuse_cut_media(options, media)
    limits = None
    if options.budgets:
        mrope = "image_grid_thw" in media or "video_grid_thw" in media
        values = media_budgets(dataset, [n for n, _ in options.budgets], mrope=mrope)
        limits = {n: (values[n], cap) for n, cap in options.budgets}
    try:
        plan = pack(lengths, options=options, threads=threads, limits=limits)
    except FastpackError as e:
        message = str(e)
        if message.startswith("lengths: "):  # rows of the dataset, named as such
            message = (f"column {names[first]!r}: "
                       + message[len("lengths: "):].replace("sequence(s)", "row(s)")
                       .replace("at index", "at row"))
        raise FastpackError(message) from None
    separators = None if separator_id is None else {names[first]: separator_id}
    schema, batches = prepare(
        plan, handles, types, None, separator_id=None, separator_values=separators,
        position_ids=position_ids, batch_tokens=batch_tokens, threads=threads,
    )
    if not seq_lengths:
        schema, batches = _without(schema, batches, "seq_lengths")
    group = _group_of_packs(plan)
    if group is not None:
        schema = schema.append(pa.field("group", pa.int64()))
        batches = _with_groups(batches, group)
    if media:
        packed_media = {c: _packed_media(dataset, c, plan) for c in media}
        for c, column in packed_media.items():
            schema = schema.append(pa.field(c, column.type))
        batches = _with_columns(batches, packed_media)
    summary = _summary(plan, names[first], dataset, skipped, columns is None, position_ids)
    features = datasets.Features.from_arrow_schema(schema)
    schema = pa.schema(schema, metadata=features.arrow_schema.metadata)
    info = dataset.info.copy()
    info.features = features
    info.description = ((info.description + "\n\n") if info.description else "") + summary
    from datasets.fingerprint import Hasher

    from . import __version__

    fingerprint = Hasher.hash([
        "fastpack.hf.pack_dataset", __version__, dataset._fingerprint,
        dataclasses.astuple(options), separator_id, names, position_ids, seq_lengths,
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


def _refuse_cut_media(options: PackOptions, media: list[str]) -> None:
    """A packed row takes its rows' media whole (every image of a row it holds), so a
    row's tokens must stay whole too, as ``PackedCollator(model_config=...)`` requires."""
    if options.strategy == "wrapped":
        name, value = "strategy", "'wrapped'"
    elif options.overlong in ("truncate", "split"):
        name, value = "overlong", repr(options.overlong)
    else:
        return
    raise FastpackError(
        f"{name}: {value} would cut rows with media ({', '.join(media)}) across packs or "
        f"short, leaving image placeholders apart from their pixels and grids; with media "
        f"columns keep rows whole: overlong='error' or 'drop' and strategy 'bfd', 'ffd', "
        f"'next_fit' or 'one_per_pack'"
    )


def _media_columns(dataset: Any) -> list[str]:
    names = getattr(dataset, "column_names", None) or []
    if isinstance(names, Mapping):  # a DatasetDict: its splits share the columns
        names = next(iter(names.values()), [])
    return [c for c in IMAGE_KEYS + VIDEO_KEYS if c in names]


def _packed_media(dataset: Any, name: str, plan: Plan) -> Any:
    """Column ``name`` (a list per row: images, grids, patches) packed: each pack's rows'
    lists concatenated in segment order (the order of their placeholders)."""
    import pyarrow as pa

    table, indices = dataset_parts(dataset)
    column = table.column(name).combine_chunks()
    if indices is not None:
        column = column.take(pa.array(np.concatenate(indices)))
    offsets = np.asarray(column.offsets, dtype=np.int64)
    sample = np.asarray(plan.sample_ids, dtype=np.int64)
    starts, counts = offsets[sample], np.diff(offsets)[sample]
    # Each segment's items, end to end: one take of the column's values.
    ends = np.cumsum(counts)
    items = np.repeat(starts - (ends - counts), counts) + np.arange(int(ends[-1]) if len(
        ends) else 0)
    values = column.values.take(pa.array(items, type=pa.int64()))
    pack_items = np.concatenate(([0], ends))[np.asarray(plan.pack_offsets, dtype=np.int64)]
    if pack_items[-1] < 2**31:
        return pa.ListArray.from_arrays(pa.array(pack_items, type=pa.int32()), values)
    return pa.LargeListArray.from_arrays(pa.array(pack_items, type=pa.int64()), values)


def _with_columns(batches: Any, columns: dict[str, Any]) -> Any:
    at = 0
    for batch in batches:
        n = batch.num_rows
        for name, column in columns.items():
            batch = batch.append_column(name, column.slice(at, n))
        yield batch
        at += n


def _group_of_packs(plan: Plan) -> np.ndarray | None:
    if plan.group_offsets is None:
        return None
    return np.repeat(np.arange(plan.num_groups, dtype=np.int64), np.diff(plan.group_offsets))


def _without(schema: Any, batches: Any, name: str) -> tuple[Any, Any]:
    at = schema.get_field_index(name)
    return schema.remove(at), (batch.remove_column(at) for batch in batches)


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
    else:  # the columns listed, as TRL lists them, not None ("all")
        shown = list(packed.column_names)
    packed.set_format(
        type=fmt.get("type"), columns=shown,
        output_all_columns=fmt.get("output_all_columns", False),
        **fmt.get("format_kwargs", {}),
    )
