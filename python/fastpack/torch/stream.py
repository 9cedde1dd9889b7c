"""Streams: packed batches from any iterable of samples, resumable mid-window."""

from __future__ import annotations

import itertools
import logging
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._checks import _choice, _int_arg
from .._errors import FastpackError, FastpackTypeError
from .._materialize import Ragged, _from_rows, _to_numpy
from .._options import PackArgs, PackOptions, WithOptions, layered
from .._stream import (
    DEFAULT_BUFFER_SIZE,
    LENGTH_COLUMN,
    STREAM_REFUSES,
    StreamPacker,
    StreamStats,
    _stream_seed,
)
from .collator import LOSS_MASK_KEYS, PackedCollator, as_collator

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["SHARDINGS", "PackedIterableDataset"]

#: How a stream is split across DataLoader workers and distributed ranks.
SHARDINGS = ("auto", "stride", "hf", "source")

_STATE_KIND = "fastpack.PackedIterableDataset"
_CHUNK = 256  # samples read before their rows become arrays
_STATE_VERSION = 1

logger = logging.getLogger("fastpack")


class PackedIterableDataset(
    torch.utils.data.IterableDataset, WithOptions  # type: ignore[type-arg]
):
    """Ready batches from a stream of samples, packed a window at a time.

    ``source`` is any iterable of samples — a ``datasets.IterableDataset``, a torch
    ``IterableDataset``, a list, a generator function (called once per pass) or a
    generator — each sample a dict with ``input_ids`` (and optionally ``labels`` and a
    loss mask, read as :class:`PackedCollator` reads them) or a bare sequence of ids.
    Samples are packed by a :class:`fastpack.StreamPacker` (best fit inside a window of
    ``buffer_size`` samples, in Rust; under-filled packs wait for later samples) and
    each item is a batch of ``packs_per_batch`` packs formatted by ``collator``:

    >>> ds = PackedIterableDataset(stream, PackedCollator(max_len=4096, backend="flash"))
    >>> loader = torchdata.stateful_dataloader.StatefulDataLoader(ds, batch_size=None,
    ...                                                          num_workers=2)

    Sharding (``sharding``), so that each sample is packed exactly once:

    - ``"stride"``: sample ``i`` of the source goes to shard ``i mod (world_size *
      num_workers)``, shard ``rank * num_workers + worker``. Every worker reads the
      whole source and skips the others' samples (cheap for a generator; for expensive
      sources prefer a source that splits itself).
    - ``"hf"`` (a ``datasets.IterableDataset``): ranks via
      ``datasets.distributed.split_dataset_by_node`` (unless already split), workers via
      the dataset's own shards (give it ``num_shards`` a multiple of ``num_workers``:
      workers beyond its shards get nothing).
    - ``"source"``: the source already yields each worker and rank its own samples.
    - ``"auto"``: ``"hf"`` for a ``datasets.IterableDataset``, else ``"stride"``.

    ``rank``/``world_size`` default to ``torch.distributed``'s (1 process if it is not
    initialized).

    Resuming: :meth:`state_dict` holds the samples waiting in the window (its rows, its
    plan, how many of its packs were yielded) and the position in the source — the
    source's own ``state_dict()`` when it has one (``datasets.IterableDataset``), else
    the count of samples read, skipped on resume. Through torchdata's
    ``StatefulDataLoader`` (any ``num_workers``) a resumed run yields exactly the batches
    the uninterrupted run would have. Resume with the same options, workers and ranks.
    The state holds about ``buffer_size`` samples' tokens; within a window it does not
    change but for a few counters, so ``StatefulDataLoader``'s per-step snapshots send
    only those (or set ``snapshot_every_n_steps`` to your checkpoint interval).

    Args:
        source: the samples (see above).
        collator: the :class:`PackedCollator` giving ``max_len``, the backend,
            ``overlong``, separators and the batch format.
        buffer_size: samples per window (memory: about this many samples' tokens).
        packs_per_batch: packs (rows) per item; each window emits a multiple of it, so
            only the stream's last batch may have fewer.
        sharding, rank, world_size: see above.
        options, **kwargs: the options of the plan (:class:`fastpack.PackOptions`):
            ``shuffle`` the packs each window emits (``seed``, the epoch and the shard),
            ``long_max_len`` (``group_tokens`` raises: groups need the whole plan). The
            per-batch options are the collator's (``PackedCollator(strategy=...)``:
            ``"bfd"`` by default, ``"ffd"``, ``"next_fit"`` — keeps the order: the same
            packs as the offline next fit —, ``"wrapped"`` or ``"one_per_pack"``); given
            here, they must equal them.

    Keys: whether the batches have ``labels`` and which loss mask they read are fixed
    once per pass — from the source's ``features`` (a ``datasets.IterableDataset``) when
    it has them, else from the first sample — and a sample that lacks a chosen key, or
    carries ``labels`` or a loss-mask key that was not chosen, raises (as
    :class:`PackedCollator` raises for a batch that mixes them).

    Counts: :attr:`stats` holds this process's counts; with DataLoader workers each
    worker packs (and counts) its own samples, so the main process's are zeros — read
    :meth:`stats_of` of a ``StatefulDataLoader``'s ``state_dict()``. A worker logs its
    dropped and truncated tokens (logger ``"fastpack"``) when its pass ends.

    With the Hugging Face ``Trainer``: ``train_dataset=ds``,
    ``data_collator=fastpack.torch.first_item``, ``per_device_train_batch_size=1``.
    """

    def __init__(
        self,
        source: Any,
        collator: PackedCollator,
        *,
        buffer_size: int = DEFAULT_BUFFER_SIZE,
        packs_per_batch: int = 1,
        sharding: str = "auto",
        rank: int | None = None,
        world_size: int | None = None,
        options: PackOptions | None = None,
        **kwargs: Unpack[PackArgs],
    ) -> None:
        as_collator(collator)
        if collator.backend == "padded":
            raise FastpackError("collator: backend='padded' does not pack; use a plain "
                                "DataLoader with the collator as collate_fn")
        if isinstance(source, (str, bytes, Mapping)) or not (
            hasattr(source, "__iter__") or callable(source)
        ):
            raise FastpackTypeError(
                f"source: expected an iterable of samples or a function returning one, got "
                f"{type(source).__name__}"
            )
        self.source = source
        self.collator = collator
        #: The packing options: the collator's per-batch ones and the plan options given.
        self.options, _ = layered(PackedIterableDataset, collator.options, options, kwargs,
                                  refuse=STREAM_REFUSES)
        self.buffer_size = _int_arg("buffer_size", buffer_size, minimum=1)
        self.packs_per_batch = _int_arg("packs_per_batch", packs_per_batch, minimum=1)
        sharding = _choice("sharding", sharding, SHARDINGS)
        if sharding == "auto":
            sharding = "hf" if _is_hf_stream(source) else "stride"
        if sharding == "hf" and not _is_hf_stream(source):
            raise FastpackError(f"sharding: 'hf' needs a datasets.IterableDataset source, got "
                                f"{type(source).__name__}")
        self.sharding = sharding
        if (rank is None) != (world_size is None):
            raise FastpackError("rank, world_size: pass both or neither")
        if world_size is not None:
            world_size = _int_arg("world_size", world_size, minimum=1)
            rank = _int_arg("rank", rank, minimum=0, maximum=world_size - 1)
        self.rank, self.world_size = rank, world_size
        # Keys fixed from the source's features, checked here so a mistake fails now.
        self._feature_keys: _Keys | None = None
        features = getattr(source, "features", None) if _is_hf_stream(source) else None
        if features is not None:
            self._feature_keys = _Keys.choose(collator, list(features), "the source's features")
        self.epoch = 0
        self._pending: dict[str, Any] | None = None
        self._live: _Pass | None = None
        self._consumed = False  # a one-shot iterator source was iterated
        self._hf_split: tuple[tuple[int, int], Any] | None = None
        self._tensors: dict[int, tuple[np.ndarray, torch.Tensor]] = {}

    # ------------------------------------------------------------------ options
    def _packer(self, shard: tuple[int, int]) -> StreamPacker:
        seed = _stream_seed(self.options.seed, self.epoch, *shard)
        return StreamPacker(
            options=self.options.replace(seed=seed), buffer_size=self.buffer_size,
            packs_multiple=self.packs_per_batch, threads=self.collator.threads,
        )

    def set_epoch(self, epoch: int) -> None:
        """Seed the next passes' shuffles with ``epoch`` (and pass it to the source's own
        ``set_epoch``, as ``datasets.IterableDataset`` has)."""
        self.epoch = _int_arg("epoch", epoch, minimum=0)
        if hasattr(self.source, "set_epoch"):
            self.source.set_epoch(epoch)

    @property
    def stats(self) -> StreamStats:
        """This process's counts for the current pass: with DataLoader workers, the
        main process packs nothing (zeros); see :meth:`stats_of`."""
        return self._live.packer.stats if self._live is not None else StreamStats()

    @staticmethod
    def stats_of(state: Any) -> StreamStats:
        """The counts summed over every pass in ``state``: a :meth:`state_dict`, or a
        torchdata ``StatefulDataLoader``'s ``state_dict()`` (each worker's last snapshot,
        so as fresh as ``snapshot_every_n_steps``), or a list of them (one per rank)."""
        total = StreamStats()
        for found in _states_in(state):
            counts = found["packer"]["stats"]
            for f in fields(StreamStats):
                setattr(total, f.name, getattr(total, f.name) + int(counts[f.name]))
        return total

    def _placement(self) -> tuple[int, int, int, int]:
        """``(rank, world_size, worker, num_workers)`` of this iteration."""
        if self.world_size is not None:
            rank, world = self.rank, self.world_size
        elif torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        else:
            rank, world = 0, 1
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        assert rank is not None
        return rank, world, worker, workers

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[dict[str, Any]]:
        # The state is taken now, not at the first next(): StatefulDataLoader loads the
        # state, then calls iter(), and may drop that iterator unused (a finished epoch).
        state, self._pending = self._pending, None
        run = _Pass(self, state)
        self._live = run
        return run.batches()

    def state_dict(self) -> dict[str, Any]:
        """The state to resume from: the live pass's, else the loaded one, else the start
        of a pass. numpy arrays become tensors (no copy) so ``torch.save`` and
        ``torch.load(weights_only=True)`` take it."""
        if self._live is not None:
            state = self._live.state_dict()
        elif self._pending is not None:
            state = self._pending
        else:
            state = {"kind": _STATE_KIND, "version": _STATE_VERSION, "epoch": self.epoch,
                     "started": False}
        return self._to_torch(state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` at the next ``iter()``."""
        if not isinstance(state, Mapping) or state.get("kind") != _STATE_KIND:
            raise FastpackError(f"state: not a PackedIterableDataset state (got "
                                f"{type(state).__name__})")
        if state.get("version") != _STATE_VERSION:
            raise FastpackError(f"state: version {state.get('version')!r}; this fastpack "
                                f"reads version {_STATE_VERSION}")
        self._live = None
        if _pass_finished(state) and self.epoch > int(state["epoch"]):
            # StatefulDataLoader loads the state inside iter(), after the loop's
            # set_epoch: a state saved at the end of epoch e, loaded into a later epoch,
            # starts that epoch from its first sample (as PackedSampler does).
            self._pending = None
            return
        self.epoch = int(state["epoch"])
        self._pending = _state_to_numpy(dict(state)) if state.get("started") else None

    def _to_torch(self, state: Any) -> Any:
        # The same tensor for the same array: StatefulDataLoader compares each snapshot
        # with the last one, and an identical tensor compares in O(1).
        cache: dict[int, tuple[np.ndarray, torch.Tensor]] = {}

        def convert(value: Any) -> Any:
            if isinstance(value, dict):
                return {k: convert(v) for k, v in value.items()}
            if isinstance(value, np.ndarray):
                hit = self._tensors.get(id(value))
                if hit is not None and hit[0] is value:
                    tensor = hit[1]
                else:
                    with warnings.catch_warnings():  # read-only plan arrays: never written
                        warnings.simplefilter("ignore", UserWarning)
                        tensor = torch.from_numpy(value)
                cache[id(value)] = (value, tensor)
                return tensor
            return value

        out = convert(state)
        self._tensors = cache
        return out


def _state_to_numpy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _state_to_numpy(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return value


def _is_hf_stream(source: Any) -> bool:
    return type(source).__module__.startswith("datasets") and type(source).__name__ == (
        "IterableDataset"
    )


class _Pass:
    """One pass over the source in one process: reads windows, yields batches."""

    def __init__(self, ds: PackedIterableDataset, state: dict[str, Any] | None) -> None:
        self.ds = ds
        rank, world, worker, workers = ds._placement()
        self.placement = [rank, world, worker, workers]
        if ds.sharding == "stride":
            self.shard, self.num_shards = rank * workers + worker, world * workers
        else:
            self.shard, self.num_shards = 0, 1
        self.packer = ds._packer((rank, worker))
        self.keys: _Keys | None = ds._feature_keys
        self.position = 0  # items read from this pass's source iterator
        self.source = self._source(rank, world)
        self.stateful = _has_state(self.source)
        self.source_state: Any = None
        self.resumed = state
        if state is not None:
            self._check(state)
            self.packer.load_state_dict(state["packer"])
            if state["keys"] is not None:
                self.keys = _Keys.restore(ds.collator, state["keys"], state.get("present"))
            self.position = int(state["position"])
            self.source_state = state["source"]

    def _check(self, state: Mapping[str, Any]) -> None:
        saved = [int(x) for x in np.asarray(state["placement"]).tolist()]
        if saved != self.placement or state["sharding"] != self.ds.sharding:
            raise FastpackError(
                f"state: saved by (rank, world_size, worker, num_workers) = {tuple(saved)} "
                f"with sharding {state['sharding']!r}; this is {tuple(self.placement)} with "
                f"{self.ds.sharding!r}. Resume with the same ranks, workers and sharding"
            )

    def _source(self, rank: int, world: int) -> Any:
        ds = self.ds
        source = ds.source
        if ds.sharding == "hf" and world > 1 and getattr(source, "_distributed", None) is None:
            if ds._hf_split is None or ds._hf_split[0] != (rank, world):
                from datasets.distributed import split_dataset_by_node

                ds._hf_split = ((rank, world), split_dataset_by_node(source, rank, world))
            source = ds._hf_split[1]
        return source

    def _open(self) -> Iterator[Any]:
        """The source's iterator, positioned after the items already read."""
        ds, source = self.ds, self.source
        if self.stateful and (self.source_state is not None or _is_hf_stream(source)):
            # A datasets stream keeps a loaded state until it is replaced: give it None on a
            # fresh pass, so it does not resume an old position.
            source.load_state_dict(self.source_state)
        if ds.sharding == "stride" and _is_hf_stream(source):
            # Not iter(): in a worker, datasets would split by worker on its own as well.
            it: Iterator[Any] = _unbatch(source.iter(batch_size=1))
        elif hasattr(source, "__iter__"):
            it = iter(source)
            if it is source:
                if ds._consumed:
                    raise FastpackError(
                        "source: this iterator was already consumed by an earlier pass; pass "
                        "a generator function or a re-iterable (a list, a dataset)"
                    )
                ds._consumed = True
        else:
            it = iter(source())
        if not self.stateful and self.position:
            skipped = sum(1 for _ in itertools.islice(it, self.position))
            if skipped < self.position:
                raise FastpackError(
                    f"source: the state is at sample {self.position}, but the source ends "
                    f"after {skipped}; resume over the same source"
                )
        return it

    def _items(self, it: Iterator[Any]) -> Iterator[tuple[int, Any]]:
        """``(index, sample)`` of this shard's samples, from the current position."""
        start, n = self.position, self.num_shards
        first = start + (self.shard - start) % n
        for k, item in enumerate(itertools.islice(it, first - start, None, n)):
            yield first + k * n, item

    def batches(self) -> Iterator[dict[str, Any]]:
        packer, m = self.packer, self.ds.packs_per_batch
        if packer.finished:
            return
        items: Iterator[tuple[int, Any]] | None = None
        while True:
            rnd = packer.current
            if rnd is None or not rnd.remaining:
                if rnd is not None and rnd.final:
                    self._report()
                    return
                if items is None:
                    items = self._items(self._open())
                columns, origins, final = self._read(items, packer.room)
                rnd = packer.push(columns, final=final, origins=origins)
                if not rnd.remaining:
                    continue
            packs = rnd.take(m)
            yield self._batch(rnd, packs)

    def _report(self) -> None:
        """Log the pass's lost tokens: with workers, the main process sees no counts."""
        s = self.packer.stats
        if s.dropped_tokens or s.truncated_tokens:
            rank, world, worker, workers = self.placement
            logger.warning(
                "fastpack: PackedIterableDataset (rank %d/%d, worker %d/%d): %d sequences "
                "dropped (%d tokens), %d truncated (%d tokens)", rank, world, worker, workers,
                s.dropped_sequences, s.dropped_tokens, s.truncated_sequences,
                s.truncated_tokens,
            )

    def _read(self, items: Iterator[tuple[int, Any]], room: int) -> tuple[
            dict[str, tuple[np.ndarray, np.ndarray]], np.ndarray, bool]:
        """Up to ``room`` samples as columns, their stream indices, and whether the source
        ended. Rows become arrays every ``_CHUNK`` samples: a window of Python lists would
        hold millions of objects for the garbage collector to walk (twice the read time)."""
        keys = self.keys
        names = keys.columns if keys is not None else []
        chunks: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {k: [] for k in names}
        rows: dict[str, list[Any]] = {k: [] for k in names}
        origins: list[int] = []
        while True:
            start = len(origins)
            for index, sample in itertools.islice(items, min(_CHUNK, room - start)):
                if not isinstance(sample, Mapping):
                    sample = {LENGTH_COLUMN: sample}
                if keys is None:
                    keys = self.keys = _Keys.choose(
                        self.ds.collator, list(sample), f"sample {index} of the stream"
                    )
                    rows = {k: [] for k in keys.columns}
                    chunks = {k: [] for k in keys.columns}
                keys.check(sample, index)
                for k, column in rows.items():
                    column.append(sample[k])
                origins.append(index)
                self.position = index + 1
            got = len(origins) - start
            if got:
                at = np.asarray(origins[start:], dtype=np.int64)
                mask = self._mask_key()
                for k, column in rows.items():
                    chunks[k].append(_column(k, column, at, mask=k == mask))
                    column.clear()
            if got < min(_CHUNK, room - start) or len(origins) == room:
                break
        if self.stateful:
            self.source_state = self.source.state_dict()
        final = len(origins) < room
        names = keys.columns if keys is not None else [LENGTH_COLUMN]
        columns = {k: _join(chunks.get(k, [])) for k in names}
        return columns, np.asarray(origins, dtype=np.int64), final

    def _mask_key(self) -> str | None:
        return self.keys.mask if self.keys is not None else None

    def _batch(self, rnd: Any, packs: np.ndarray) -> dict[str, Any]:
        def ragged(key: str | None, mask: bool = False) -> Ragged | None:
            if key is None or key not in rnd.columns:
                return None
            values, offsets = rnd.columns[key]
            return Ragged(values, offsets, mask=mask)

        tokens = ragged(LENGTH_COLUMN)
        assert tokens is not None
        return self.ds.collator.batch(
            rnd.plan, tokens, packs, labels=ragged("labels"),
            loss_mask=ragged(self._mask_key(), mask=True), sample_ids=rnd.origins,
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": _STATE_KIND, "version": _STATE_VERSION, "epoch": self.ds.epoch,
            "started": True, "placement": np.asarray(self.placement, dtype=np.int64),
            "sharding": self.ds.sharding,
            "keys": None if self.keys is None else list(self.keys.columns),
            "present": None if self.keys is None else list(self.keys.present),
            "position": self.position,
            "source": self.source_state, "packer": self.packer.state_dict(),
        }


def _pass_finished(state: Mapping[str, Any]) -> bool:
    """Whether ``state`` is of a pass whose final round was emitted to its last pack."""
    if not state.get("started"):
        return False
    rnd = state["packer"]["round"]
    return bool(rnd is not None and rnd["final"] and int(rnd["cursor"]) >= len(rnd["emit"]))


class _Keys:
    """The per-sample keys of a pass: ``columns`` are read (``input_ids``, then
    ``labels`` and the loss mask when chosen); ``present`` are the labels and loss-mask
    keys the choice was made from, which every sample must carry, and no others."""

    __slots__ = ("candidates", "collator", "columns", "mask", "origin", "present", "seen")

    def __init__(self, collator: PackedCollator, present: list[str], origin: str) -> None:
        self.candidates = _candidates(collator)
        self.present = [k for k in self.candidates if k in present]
        self.mask = next((k for k in self.present if k != "labels"), None)
        self.columns = [LENGTH_COLUMN] + [k for k in ("labels", self.mask) if k in self.present]
        self.origin = origin
        self.collator = collator
        self.seen: frozenset[Any] = frozenset()  # the keys of the last sample that passed

    @classmethod
    def choose(cls, collator: PackedCollator, names: list[str], origin: str) -> _Keys:
        """The keys from the first sample's (or the features') ``names``."""
        has = "have" if origin.endswith("features") else "has"
        if LENGTH_COLUMN not in names:
            raise FastpackError(
                f"input_ids: {origin} {has} no 'input_ids' (it has {', '.join(map(str, names))})"
            )
        key = collator.loss_mask_key
        if isinstance(key, str) and key not in names:
            raise FastpackError(
                f"loss_mask_key: {origin} {has} no {key!r} (it has "
                f"{', '.join(map(str, names))}); expected every sample to have it"
            )
        return cls(collator, names, origin)

    @classmethod
    def restore(cls, collator: PackedCollator, columns: list[str],
                present: list[str] | None) -> _Keys:
        keys = cls(collator, list(columns[1:] if present is None else present),
                   "the resumed pass's first sample")
        if keys.columns != list(columns):
            raise FastpackError(f"state: read keys {list(columns)}; this collator reads "
                                f"{keys.columns} (resume with the same collator)")
        return keys

    def check(self, sample: Mapping[str, Any], index: int) -> None:
        """A sample carries exactly the chosen labels and mask keys (and input_ids)."""
        names = sample.keys()
        if names == self.seen:  # the usual case, one set comparison: the same keys again
            return
        if LENGTH_COLUMN in sample and [k for k in self.candidates if k in sample] == self.present:
            # A new key set: a misspelt per-token key (`assistant_mask`, `label`) raises
            # here, as in the collator, instead of being dropped.
            tokens = sample[LENGTH_COLUMN]
            self.collator.check_keys(sample, index, len(tokens) if hasattr(tokens, "__len__")
                                     else 0)
            self.seen = frozenset(names)
            return
        has = "have" if self.origin.endswith("features") else "has"
        it_has = ", ".join(map(str, sample))
        for k in [LENGTH_COLUMN, *self.present]:
            if k not in sample:
                raise FastpackError(
                    f"{k}: sample {index} of the stream has no {k!r} (it has {it_has}); "
                    f"expected every sample of the stream to have {k!r} or none, and "
                    f"{self.origin} {has} it"
                )
        k = next(k for k in self.candidates if k in sample and k not in self.present)
        hint = "" if k == "labels" else " (loss_mask_key=False ignores loss masks)"
        raise FastpackError(
            f"{k}: sample {index} of the stream has {k!r}, which {self.origin} {has} not; "
            f"expected every sample of the stream to have {k!r} or none{hint}"
        )


def _candidates(collator: PackedCollator) -> tuple[str, ...]:
    """The keys that change what a batch trains on: labels and the loss masks that the
    collator reads."""
    key = collator.loss_mask_key
    if key is False:
        return ("labels",)
    return ("labels", key) if isinstance(key, str) else ("labels", *LOSS_MASK_KEYS)


def _states_in(value: Any) -> Iterator[Mapping[str, Any]]:
    """Every started PackedIterableDataset state nested in ``value``."""
    if isinstance(value, Mapping):
        if value.get("kind") == _STATE_KIND:
            if value.get("started"):
                yield value
            return
        for v in value.values():
            yield from _states_in(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _states_in(v)


def _has_state(source: Any) -> bool:
    return callable(getattr(source, "state_dict", None)) and callable(
        getattr(source, "load_state_dict", None)
    ) and not isinstance(source, torch.nn.Module)


def _unbatch(batches: Iterable[Mapping[str, list[Any]]]) -> Iterator[dict[str, Any]]:
    for batch in batches:
        yield {k: v[0] for k, v in batch.items()}


def _column(key: str, rows: list[Any], origins: np.ndarray, *, mask: bool) -> tuple[
        np.ndarray, np.ndarray]:
    """Rows of one key as ``(values, offsets)``; a bad row raises, naming the key and the
    sample."""
    try:
        ragged = _from_rows(rows, mask)
    except (TypeError, ValueError) as e:
        for i, row in enumerate(rows):
            problem = _row_problem(row)
            if problem:
                raise FastpackTypeError(
                    f"{key}: sample {int(origins[i])} of the stream {problem}"
                ) from None
        raise FastpackTypeError(f"{key}: cannot read the samples as token lists ({e})") from None
    return ragged.values, ragged.offsets


def _join(chunks: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Columns read chunk by chunk (offsets from 0) as one column."""
    if not chunks:
        return np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64)
    if len(chunks) == 1:
        return chunks[0]
    values = np.concatenate([v for v, _ in chunks])
    ends = np.cumsum([len(v) for v, _ in chunks])
    offsets = np.concatenate(
        [[0]] + [o[1:] + (ends[i - 1] if i else 0) for i, (_, o) in enumerate(chunks)]
    ).astype(np.int64)
    return values, offsets


def _row_problem(row: Any) -> str | None:
    if row is None:
        return "is None (null)"
    if isinstance(row, (str, bytes, Mapping)) or np.isscalar(row):
        return f"is {type(row).__name__} {row!r:.40}; expected a list of integers"
    try:
        array = _to_numpy(row) if type(row).__module__.startswith("torch") else np.asarray(row)
    except (TypeError, ValueError):
        return "is a ragged nested list; expected a flat list of integers"
    if array.ndim != 1:
        return f"has shape {array.shape}; expected a flat list of integers"
    if array.size and array.dtype.kind not in "iub":
        return f"holds {array.dtype} values; expected integers"
    return None

