"""Exactly once, whatever the loader: the resume matrix.

A run of two epochs is interrupted after some micro-steps, its state saved the way each
loader saves it, and a new process-like setup (new dataset objects, sampler, loader)
resumes from that state. Loaders: a plain ``DataLoader`` with 0, 1 and 2 workers (and 2
persistent workers across both epochs), torchdata's ``StatefulDataLoader`` with 0 and 2,
the Hugging Face ``Trainer`` through ``PackedTrainerMixin`` (``dataloader_num_workers`` 0
and 2, resumed from a checkpoint directory) and a ``PackedIterableDataset`` through
``StatefulDataLoader``. Resume points: the start, the middle of epoch 0, before its last
step, and between the epochs. On 1 rank and on 2 (two samplers, ``rank=0`` and ``1``, in
this process). The assertion: the steps' samples before the interruption followed by those
after equal the uninterrupted run's, step for step, on every rank; and over the ranks
every epoch holds every sample piece once.

A dp × cp mesh (2 data-parallel ranks × 2 context-parallel ranks, a plan made for
``cp_size=2``): every CP rank of a data-parallel rank runs the same steps through its own
loader and shards each step (``shard_for_context_parallel``); resumed, its shards still
reassemble the uninterrupted run's steps.

Every token of sample ``i`` is ``i + 1``, so a batch says which samples it holds
(``cu_seq_lens_q`` gives its sequences); the uninterrupted run is the sampler's own
schedule read through :meth:`PackedDataset.samples`.
"""

from __future__ import annotations

import multiprocessing
import pickle
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fastpack  # noqa: E402
from fastpack import FastpackError  # noqa: E402
from fastpack.torch import (  # noqa: E402
    PackedCollator,
    PackedDataset,
    PackedIterableDataset,
    PackedSampler,
    shard_for_context_parallel,
)

EPOCHS = 2
MAX_LEN = 48
ACCUMULATION = 2
HIDDEN = 32
# Workers start by fork where the platform has it (fast: nothing to import again).
CONTEXT = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
POINTS = ("start", "middle", "last", "between")
Run = list[tuple[int, tuple[int, ...]]]  # (epoch, sample id of each sequence) per batch


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Any:
    """One torch thread: the tiny model and the collation are faster so, on busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def lengths() -> np.ndarray:
    """60 samples; the last two are longer than ``MAX_LEN``, so they are split."""
    rng = np.random.default_rng(0)
    return np.concatenate((rng.integers(2, 30, 58), [70, 90]))


#: The mesh's context-parallel ranks and mode.
CP, CP_MODE = 2, "zigzag"


def make_dataset(seed: int = 0, cp: bool = False, kind: str = "text") -> PackedDataset:
    """The matrix's data: ``kind`` "text" (split samples, CP with ``cp``), "vlm" (media
    under an image budget) or "tree" (RL rollouts as shared-prefix trees)."""
    if kind == "vlm":
        return vlm_dataset(seed)
    if kind == "tree":
        return make_tree_dataset(seed)
    rows = [np.full(int(n), i + 1, dtype=np.int64) for i, n in enumerate(lengths())]
    collator = PackedCollator(max_len=MAX_LEN, backend="flash", overlong="split",
                              cp_size=CP if cp else None)
    return PackedDataset(rows, collator, group_tokens=2 * MAX_LEN, seed=seed)


def vlm_dataset(seed: int = 0) -> PackedDataset:
    """60 vision-language samples (Qwen2-VL placeholders, 0-3 images each) under an image
    budget; sample ``i``'s text tokens are ``i + 1``, its placeholders 10^6."""
    transformers = pytest.importorskip("transformers")
    image = 10**6
    config = transformers.Qwen2VLConfig(image_token_id=image, video_token_id=image + 1,
                                        vision_config={"spatial_merge_size": 2, "patch_size": 1,
                                                       "temporal_patch_size": 1})
    samples = []
    for i, n in enumerate(np.minimum(lengths(), 30)):
        images = i % 4
        sample: dict[str, Any] = {"input_ids": [i + 1] * int(n) + [image] * (4 * images)}
        if images:
            sample["image_grid_thw"] = [[1, 4, 4]] * images
            sample["pixel_values"] = np.full((16 * images, 3), i, dtype=np.float32)
        samples.append(sample)
    collator = PackedCollator(max_len=MAX_LEN, backend="flash", model_config=config,
                              limits={"images": 4})
    return PackedDataset([s["input_ids"] for s in samples], collator, media=samples,
                         group_tokens=2 * MAX_LEN, seed=seed)


def make_tree_dataset(seed: int = 0) -> PackedDataset:
    """RL rollouts: 15 prompts, 4 responses each, one tree per prompt (share_prefix)."""
    rng = np.random.default_rng(1)
    rows, groups = [], []
    for g in range(15):
        prompt = rng.integers(1, 64, int(rng.integers(4, 16)))
        for _ in range(4):
            rows.append(np.concatenate([prompt, rng.integers(1, 64, int(rng.integers(1, 6)))]))
            groups.append(g)
    collator = PackedCollator(max_len=MAX_LEN, backend="flash", share_prefix=True)
    return PackedDataset(rows, collator, prompt_ids=groups, group_tokens=MAX_LEN, seed=seed)


def make_sampler(ds: PackedDataset, ranks: int, rank: int, kind: str = "text") -> PackedSampler:
    """``kind`` "micro": every global step split into micro-batches of at most ``MAX_LEN``
    tokens, the same number on every rank."""
    micro = {"micro_batch_tokens": MAX_LEN} if kind == "micro" else {}
    return PackedSampler(ds, num_replicas=ranks, rank=rank, hidden_size=HIDDEN,
                         accumulation_steps=ACCUMULATION, **micro)


def decode(batch: dict[str, Any]) -> tuple[int, ...]:
    """The sample of each sequence of a flash-format batch (of a tree batch: its samples,
    which it lists)."""
    if "tree_parents" in batch:
        return tuple(batch["sample_ids"].tolist())
    if not bool((batch["labels"] != -100).any()):
        return ()  # a filler micro-batch: every sample here has a target, a filler none
    ids = batch["input_ids"].reshape(-1)
    starts = batch["cu_seq_lens_q"][:-1].long()
    return tuple((ids[starts] - 1).tolist())


def record(batch: dict[str, Any], cp_rank: int | None) -> Any:
    """What a rank keeps of a batch: its samples, or (mesh) its CP shard's tokens and the
    row's boundaries."""
    if cp_rank is None:
        return decode(batch)
    local = shard_for_context_parallel(batch, CP, cp_rank, CP_MODE)
    return tuple(local["input_ids"][0].tolist()), tuple(local["cp_cu_seqlens"].tolist())


def reassemble(shards: list[Any]) -> tuple[int, ...]:
    """The samples of a step from its CP ranks' shards (each real token on one rank)."""
    cu = shards[0][1]
    layout = fastpack.cp_layout(list(cu), CP, mode=CP_MODE)
    row = np.zeros(cu[-1], dtype=np.int64)
    for rank, (ids, other) in enumerate(shards):
        assert other == cu  # every CP rank sharded the same step
        sources = layout.sources(rank)
        row[sources[sources >= 0]] = np.asarray(ids)[sources >= 0]
    return tuple((row[list(cu[:-1])] - 1).tolist())


def reference(ranks: int, rank: int, cp: bool = False, kind: str = "text") -> Run:
    """The uninterrupted run: the sampler's steps, read by ``samples()``."""
    ds = make_dataset(cp=cp, kind=kind)
    sampler = make_sampler(ds, ranks, rank, kind)
    out: Run = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        out += [(epoch, tuple(ds.samples(step).tolist())) for step in sampler]
    return out


def stop_at(point: str, per_epoch: int) -> int:
    """Micro-steps consumed before the interruption."""
    return {"start": 0, "middle": per_epoch // 2, "last": per_epoch - 1,
            "between": per_epoch}[point]


def check_every_piece_once(runs: list[Run], cp: bool = False, kind: str = "text") -> None:
    """Over the ranks, each epoch holds every segment of the plan once (every sample of a
    plan of trees)."""
    plan = make_dataset(cp=cp, kind=kind).plan
    want = Counter((plan.path_sample_ids if kind == "tree" else plan.sample_ids).tolist())
    for epoch in range(EPOCHS):
        got = Counter(i for run in runs for e, ids in run if e == epoch for i in ids)
        assert got == want, epoch


def test_the_data_has_a_split_sample_and_a_cut_remainder() -> None:
    ds = make_dataset()
    assert ds.plan.split_sequences == 2
    assert len(ds) % 2 == 1  # so 2 ranks cut the last step into smaller ones
    for ranks in (1, 2):
        runs = [reference(ranks, r) for r in range(ranks)]
        check_every_piece_once(runs)
    cut = make_sampler(ds, 2, 0).schedule(0)
    assert not cut.whole.all()


# ------------------------------------------------------------------ plain DataLoader
def plain(ranks: int, rank: int, workers: int, persistent: bool, stop: int | None,
          state: dict[str, Any] | None = None,
          cp_rank: int | None = None, kind: str = "text"
          ) -> tuple[Run, dict[str, Any] | None]:
    """A training loop over a plain DataLoader, interrupted after ``stop`` micro-steps:
    the state is ``sampler.state_dict(consumed=k)``, ``k`` the batches this epoch's loop
    took (what ``enumerate`` counts). ``cp_rank``: a rank of the dp × cp mesh."""
    ds = make_dataset(cp=cp_rank is not None, kind=kind)
    sampler = make_sampler(ds, ranks, rank, kind)
    if state is not None:
        sampler.load_state_dict(pickle.loads(pickle.dumps(state)))
    loader = torch.utils.data.DataLoader(
        ds, batch_size=None, sampler=sampler, num_workers=workers,
        persistent_workers=persistent, multiprocessing_context=CONTEXT if workers else None,
    )
    out: Run = []
    if stop == 0:
        return out, sampler.state_dict(consumed=0)
    for epoch in range(0 if state is None else state["epoch"], EPOCHS):
        sampler.set_epoch(epoch)
        k = 0
        for k, batch in enumerate(loader, 1):
            out.append((epoch, record(batch, cp_rank)))
            if len(out) == stop and k < len(sampler):
                return out, sampler.state_dict(consumed=k)
        if len(out) == stop:  # between epochs: this epoch's loop has ended
            return out, sampler.state_dict(consumed=k)
    return out, None


PLAIN = [(0, False), (1, False), (2, False), (2, True)]


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize(("workers", "persistent"), PLAIN,
                         ids=["0-workers", "1-worker", "2-workers", "2-persistent"])
def test_plain_dataloader(workers: int, persistent: bool, point: str, ranks: int) -> None:
    runs = []
    for rank in range(ranks):
        want = reference(ranks, rank)
        stop = stop_at(point, len(want) // EPOCHS)
        head, state = plain(ranks, rank, workers, persistent, stop)
        assert state is not None and len(head) == stop
        tail, _ = plain(ranks, rank, workers, persistent, None, state)
        assert head + tail == want
        runs.append(head + tail)
    check_every_piece_once(runs)


def test_consumed_counts_the_batches_since_the_resume() -> None:
    """Two interruptions: the second loop counts its batches from 1 again (``consumed``
    is relative to where the pass resumed)."""
    want = reference(1, 0)
    first, state = plain(1, 0, 2, False, 3)
    second, state = plain(1, 0, 2, False, 4, state)
    assert state is not None and state["position"] == 7
    rest, _ = plain(1, 0, 2, False, None, state)
    assert first + second + rest == want


def test_consumed_beyond_what_was_yielded_raises() -> None:
    ds = make_dataset()
    sampler = make_sampler(ds, 1, 0)
    it = iter(sampler)
    for _ in range(3):
        next(it)
    assert sampler.state_dict(consumed=2)["position"] == 2
    with pytest.raises(FastpackError, match=r"consumed: got 4.*yielded 3 step"):
        sampler.state_dict(consumed=4)
    resumed = make_sampler(ds, 1, 0)
    resumed.load_state_dict(sampler.state_dict())
    next(iter(resumed))
    assert resumed.state_dict(consumed=1)["position"] == 4
    with pytest.raises(FastpackError, match="began at step 3"):
        resumed.state_dict(consumed=2)


def test_every_iterator_before_the_first_step_starts_at_the_resume() -> None:
    """torch's worker loader calls iter(sampler) twice before it reads a step (the
    defect: the first call spent the resume, the second started over)."""
    ds = make_dataset()
    want = list(make_sampler(ds, 1, 0))
    sampler = make_sampler(ds, 1, 0)
    sampler.load_state_dict({**sampler.state_dict(), "position": 4})
    unused, used = iter(sampler), iter(sampler)
    assert list(used) == want[4:]
    del unused
    assert list(sampler) == want  # the position was spent: the next pass is whole


@pytest.mark.parametrize("order", ["load-then-set", "set-then-load"])
@pytest.mark.parametrize("convention", ["same-epoch", "next-epoch"])
def test_a_state_between_epochs_with_either_loop(order: str, convention: str) -> None:
    """A state saved when epoch 0 ended resumes into epoch 1 whether the loop restarts at
    the state's epoch or at the next, and whether ``set_epoch`` comes before or after the
    load."""
    ds = make_dataset()
    want = reference(1, 0)
    run = make_sampler(ds, 1, 0)
    head = list(run)
    state = run.state_dict()
    assert (state["epoch"], state["position"]) == (0, len(head))
    sampler = make_sampler(ds, 1, 0)
    first = 0 if convention == "same-epoch" else 1
    tail: Run = []
    for epoch in range(first, EPOCHS):
        if order == "load-then-set" and epoch == first:
            sampler.load_state_dict(state)
        sampler.set_epoch(epoch)
        if order == "set-then-load" and epoch == first:
            sampler.load_state_dict(state)
        tail += [(epoch, tuple(ds.samples(s).tolist())) for s in sampler]
    assert want[: len(head)] + tail == want


# ------------------------------------------------------------------ StatefulDataLoader
def stateful(ranks: int, rank: int, workers: int, stop: int | None,
             state: dict[str, Any] | None = None,
             cp_rank: int | None = None,
             kind: str = "text") -> tuple[Run, dict[str, Any] | None]:
    """A loop over a StatefulDataLoader: the checkpoint is ``loader.state_dict()`` and the
    loop's own epoch counter (the next epoch once an epoch has ended)."""
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    ds = make_dataset(cp=cp_rank is not None, kind=kind)
    sampler = make_sampler(ds, ranks, rank, kind)
    loader = sdl.StatefulDataLoader(ds, batch_size=None, sampler=sampler,
                                    num_workers=workers,
                                    multiprocessing_context=CONTEXT if workers else None)
    if state is not None:
        loader.load_state_dict(torch.load(_saved(state), weights_only=True))
    out: Run = []
    if stop == 0:
        return out, {"loader": loader.state_dict(), "epoch": 0}
    for epoch in range(0 if state is None else state["epoch"], EPOCHS):
        sampler.set_epoch(epoch)
        for batch in loader:
            out.append((epoch, record(batch, cp_rank)))
            if len(out) == stop and len(out) < len(sampler):
                return out, {"loader": loader.state_dict(), "epoch": epoch}
        if len(out) == stop:
            return out, {"loader": loader.state_dict(), "epoch": epoch + 1}
    return out, None


def _saved(state: dict[str, Any]) -> Any:
    import io

    buffer = io.BytesIO()
    torch.save(state["loader"], buffer)
    buffer.seek(0)
    return buffer


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader(workers: int, point: str, ranks: int) -> None:
    runs = []
    for rank in range(ranks):
        want = reference(ranks, rank)
        stop = stop_at(point, len(want) // EPOCHS)
        head, state = stateful(ranks, rank, workers, stop)
        assert state is not None and len(head) == stop
        tail, _ = stateful(ranks, rank, workers, None, state)
        assert head + tail == want
        runs.append(head + tail)
    check_every_piece_once(runs)


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_vision_language_dataset_resumes_exactly(workers: int, ranks: int) -> None:
    """The same matrix row for a vision-language PackedDataset (media, an image budget, the
    sampler's vision cost in its balance): resumed mid-epoch, every step as uninterrupted;
    each batch's media are its samples'."""
    runs = []
    for rank in range(ranks):
        want = reference(ranks, rank, kind="vlm")
        stop = stop_at("middle", len(want) // EPOCHS)
        head, state = stateful(ranks, rank, workers, stop, kind="vlm")
        assert state is not None and len(head) == stop
        tail, _ = stateful(ranks, rank, workers, None, state, kind="vlm")
        assert head + tail == want
        runs.append(head + tail)
    check_every_piece_once(runs, kind="vlm")
    ds = make_dataset(kind="vlm")
    batch = ds[0]
    ids = decode(batch)
    assert batch["pixel_values"][:, 0].unique().tolist() == sorted(
        {i for i in ids if i % 4})
    assert batch["position_ids"].shape[0] == 4


# ------------------------------------------------------------------ a dp × cp mesh
MESH_LOADERS = {"plain-0": (plain, 0), "stateful-2": (stateful, 2)}


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("loader", list(MESH_LOADERS))
def test_dp_by_cp_mesh(loader: str, point: str) -> None:
    """2 data-parallel × 2 context-parallel ranks: each CP rank resumes its own loader
    from its own state; the CP ranks of a data-parallel rank saved the same position, and
    their shards of every step reassemble the uninterrupted run's step."""
    run, workers = MESH_LOADERS[loader]

    def go(rank: int, cp_rank: int, stop: int | None, state: Any = None) -> Any:
        if run is plain:
            return plain(2, rank, workers, False, stop, state, cp_rank)
        return stateful(2, rank, workers, stop, state, cp_rank)

    runs = []
    for rank in range(2):
        want = reference(2, rank, cp=True)
        stop = stop_at(point, len(want) // EPOCHS)
        per_cp = []
        states = []
        for cp_rank in range(CP):
            head, state = go(rank, cp_rank, stop)
            assert state is not None and len(head) == stop
            tail, _ = go(rank, cp_rank, None, state)
            per_cp.append(head + tail)
            states.append(state)
        if run is plain:
            assert states[0] == states[1]
        got = [(e, reassemble([r[k][1] for r in per_cp]))
               for k, (e, _) in enumerate(per_cp[0])]
        assert got == want
        runs.append(got)
    check_every_piece_once(runs, cp=True)


def test_the_mesh_plan_is_made_for_context_parallelism() -> None:
    ds = make_dataset(cp=True)
    assert (ds.plan.cp_size, ds.plan.cp_mode) == (CP, CP_MODE)
    for p in range(ds.plan.num_packs):  # every pack fits MAX_LEN once padded
        assert fastpack.cp_layout(ds.plan.cu_seqlens(p), CP).padded_total <= MAX_LEN
    assert ds.steps.cp_work is not None and ds.steps.cp_work.shape == (len(ds), CP)


# ------------------------------------------------------------------ trees
def test_the_tree_data_cuts_a_step_between_trees() -> None:
    ds = make_dataset(kind="tree")
    assert ds.plan.parents is not None and len(ds) % 2 == 1
    cut = make_sampler(ds, 2, 0).schedule(0)
    assert not cut.whole.all()  # 2 ranks cut the remainder, between trees only


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("loader", ["plain-0", "plain-2", "stateful-0"])
def test_tree_dataset(loader: str, point: str, ranks: int) -> None:
    """A PackedDataset of shared-prefix trees (share_prefix=True) resumes exactly too: the
    steps' samples before plus after equal the uninterrupted run, every sample once."""
    kind, workers = loader.split("-")
    runs = []
    for rank in range(ranks):
        want = reference(ranks, rank, kind="tree")
        stop = stop_at(point, len(want) // EPOCHS)
        if kind == "plain":
            head, state = plain(ranks, rank, int(workers), False, stop, kind="tree")
            tail, _ = plain(ranks, rank, int(workers), False, None, state, kind="tree")
        else:
            head, state = stateful(ranks, rank, int(workers), stop, kind="tree")
            tail, _ = stateful(ranks, rank, int(workers), None, state, kind="tree")
        assert state is not None and len(head) == stop
        assert head + tail == want
        runs.append(head + tail)
    check_every_piece_once(runs, kind="tree")


# ------------------------------------------------------------------ micro-batches
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("loader", ["plain-0", "plain-2", "stateful-0"])
def test_micro_batch_sampler(loader: str, point: str, ranks: int) -> None:
    """Micro-batches under a token cap (PackedSampler(micro_batch_tokens=)) resume exactly:
    the micro-batches' samples before plus after equal the uninterrupted run, every
    segment once."""
    kind, workers = loader.split("-")
    runs = []
    for rank in range(ranks):
        want = reference(ranks, rank, kind="micro")
        stop = stop_at(point, len(want) // EPOCHS)
        if kind == "plain":
            head, state = plain(ranks, rank, int(workers), False, stop, kind="micro")
            tail, _ = plain(ranks, rank, int(workers), False, None, state, kind="micro")
        else:
            head, state = stateful(ranks, rank, int(workers), stop, kind="micro")
            tail, _ = stateful(ranks, rank, int(workers), None, state, kind="micro")
        assert state is not None and len(head) == stop
        assert head + tail == want
        runs.append(head + tail)
    check_every_piece_once(runs, kind="micro")


# ------------------------------------------------------------------ another plan
def test_a_state_from_another_plan_raises() -> None:
    """The review's reproduction: the same rows planned with another seed have as many
    steps; resuming over them replayed 16 of 80 samples. Now it raises, naming what
    differs."""
    ds = make_dataset(seed=0)
    sampler = make_sampler(ds, 1, 0)
    it = iter(sampler)
    for _ in range(4):
        next(it)
    state = sampler.state_dict()
    other = make_dataset(seed=1)
    assert len(other) == len(ds)
    with pytest.raises(FastpackError, match=r"another plan.*which samples the packs hold"):
        make_sampler(other, 1, 0).load_state_dict(state)
    # Changed data of the same count: one sample longer.
    rows = [np.full(int(n), i + 1) for i, n in enumerate(lengths())]
    rows[3] = np.append(rows[3], 4)
    longer = PackedDataset(rows, PackedCollator(max_len=MAX_LEN, backend="flash",
                                                overlong="split"), group_tokens=2 * MAX_LEN)
    with pytest.raises(FastpackError, match=r"another plan"):
        PackedSampler(longer, hidden_size=HIDDEN,
                      accumulation_steps=ACCUMULATION).load_state_dict(
            {**state, "num_steps": len(longer)})
    # The same plan built again loads (the fingerprint is of the plan, not the object).
    make_sampler(make_dataset(seed=0), 1, 0).load_state_dict(state)
    with pytest.raises(FastpackError, match="missing plan"):
        make_sampler(ds, 1, 0).load_state_dict({"epoch": 0, "position": 1})


# ------------------------------------------------------------------ the Trainer
def trainer_run(tmp: Path, ranks: int, rank: int, workers: int, saves: set[int],
                resume: str | None = None, hybrid: bool = False) -> list[tuple[int, ...]]:
    """Trains on the packed dataset with the Trainer (from the checkpoint ``resume`` if
    given), saving a checkpoint after each optimizer step in ``saves``; returns the
    samples of every micro-step it trained on. ``hybrid``: a tiny LFM2 (a short
    convolution layer, prepared by the mixin) instead of Llama."""
    transformers = pytest.importorskip("transformers")
    from fastpack.torch import PackedTrainerMixin, register_hf_attention

    class Recording(PackedTrainerMixin, transformers.Trainer):  # type: ignore[misc]
        seen: list[tuple[int, ...]]

        @property
        def packed_sampler(self) -> PackedSampler:
            # Rank `rank` of `ranks`, in this one process: the mixin takes the world
            # from the Trainer's arguments, so build the same sampler with another rank.
            if ranks == 1:
                return super().packed_sampler
            if self._fastpack_sampler is None:
                self._fastpack_sampler = PackedSampler(
                    self.packed_dataset, num_replicas=ranks, rank=rank, seed=self.args.seed,
                    hidden_size=HIDDEN, accumulation_steps=self.args.gradient_accumulation_steps,
                )
            return self._fastpack_sampler

        def compute_loss(self, model: Any, inputs: dict[str, Any], *args: Any,
                         **kwargs: Any) -> Any:
            self.seen.append(decode(inputs))
            return super().compute_loss(model, inputs, *args, **kwargs)

    class Save(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            control.should_save = state.global_step in saves
            return control

    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=HIDDEN, intermediate_size=32,
                  num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=MAX_LEN, attn_implementation=register_hf_attention())
    if hybrid:
        model: Any = transformers.Lfm2ForCausalLM(transformers.Lfm2Config(
            num_hidden_layers=2, layer_types=["conv", "full_attention"], **common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=1, **common))
    args = transformers.TrainingArguments(
        output_dir=str(tmp), per_device_train_batch_size=1, num_train_epochs=EPOCHS,
        gradient_accumulation_steps=ACCUMULATION, learning_rate=1e-3, optim="sgd", seed=0,
        use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
        logging_strategy="no", dataloader_num_workers=workers,
    )
    trainer = Recording(model=model, args=args, train_dataset=make_dataset(),
                        data_collator=PackedCollator(max_len=MAX_LEN, backend="flash",
                                                     overlong="split"),
                        callbacks=[Save()])
    trainer.seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(resume_from_checkpoint=resume)
    return trainer.seen


def optimizer_stops(ranks: int) -> dict[str, int]:
    """Each resume point as the optimizer steps done before it."""
    per_epoch = -(-len(make_sampler(make_dataset(), ranks, 0)) // ACCUMULATION)
    return {point: stop_at(point, per_epoch) for point in POINTS}


_TRAINED: dict[tuple[int, int, int], tuple[Path, list[tuple[int, ...]]]] = {}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The uninterrupted Trainer run of each (ranks, rank, workers), with a checkpoint at
    every resume point: trained once, resumed by each cell."""

    def get(ranks: int, rank: int, workers: int) -> tuple[Path, list[tuple[int, ...]]]:
        key = (ranks, rank, workers)
        if key not in _TRAINED:
            out = tmp_path_factory.mktemp(f"trainer-{ranks}-{rank}-{workers}")
            saves = {k for k in optimizer_stops(ranks).values() if k}
            _TRAINED[key] = out, trainer_run(out, ranks, rank, workers, saves)
        return _TRAINED[key]

    return get


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("workers", [0, 2])
def test_trainer(trained: Any, tmp_path: Path, workers: int, point: str, ranks: int) -> None:
    """Resumed from the checkpoint directory (``resume_from_checkpoint=``) after 0 (a
    fresh run), half, all but one, and all optimizer steps of epoch 0."""
    pytest.importorskip("transformers")
    stop = optimizer_stops(ranks)[point]
    for rank in range(ranks):
        want = [ids for _, ids in reference(ranks, rank)]
        out, full = trained(ranks, rank, workers)
        assert full == want
        if stop == 0:
            continue  # the uninterrupted run is the run resumed at the start
        tail = trainer_run(tmp_path / f"rank{rank}", ranks, rank, workers, set(),
                           str(out / f"checkpoint-{stop}"))
        done = min(stop * ACCUMULATION, len(want) // EPOCHS)  # the last step may be short
        assert want[:done] + tail == want


def test_trainer_resumes_a_hybrid_model(tmp_path: Path) -> None:
    """A hybrid model (LFM2: the mixin prepares it, else check_model_batch refuses its
    packed batches) resumes from its checkpoint mid-epoch with the uninterrupted run's
    steps."""
    pytest.importorskip("transformers")
    stop = optimizer_stops(1)["middle"]
    full = trainer_run(tmp_path / "full", 1, 0, 0, {stop}, hybrid=True)
    assert full == [ids for _, ids in reference(1, 0)]
    tail = trainer_run(tmp_path / "tail", 1, 0, 0, set(),
                       str(tmp_path / "full" / f"checkpoint-{stop}"), hybrid=True)
    assert full[:stop * ACCUMULATION] + tail == full


# ------------------------------------------------------------------ streams
def stream_run(ranks: int, rank: int, workers: int, stop: int | None,
               state: dict[str, Any] | None = None) -> tuple[Run, dict[str, Any] | None]:
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    source = [{"input_ids": np.full(int(n), i + 1)} for i, n in enumerate(lengths())]
    ds = PackedIterableDataset(
        source, PackedCollator(max_len=MAX_LEN, backend="flash", overlong="split"),
        buffer_size=16, rank=rank, world_size=ranks,
    )
    loader = sdl.StatefulDataLoader(ds, batch_size=None, num_workers=workers,
                                    multiprocessing_context=CONTEXT if workers else None)
    if state is not None:
        loader.load_state_dict(torch.load(_saved(state), weights_only=True))
    out: Run = []
    if stop == 0:
        return out, {"loader": loader.state_dict(), "epoch": 0}
    for epoch in range(0 if state is None else state["epoch"], EPOCHS):
        ds.set_epoch(epoch)
        count = 0
        for batch in loader:
            out.append((epoch, decode(batch)))
            count += 1
            if len(out) == stop and stop != stream_epoch_length(ranks, rank, workers):
                return out, {"loader": loader.state_dict(), "epoch": epoch}
        if len(out) == stop:
            return out, {"loader": loader.state_dict(), "epoch": epoch + 1}
    return out, None


_STREAM_LENGTHS: dict[tuple[int, int, int], Run] = {}


def stream_reference(ranks: int, rank: int, workers: int) -> Run:
    key = (ranks, rank, workers)
    if key not in _STREAM_LENGTHS:
        _STREAM_LENGTHS[key] = stream_run(ranks, rank, workers, None)[0]
    return _STREAM_LENGTHS[key]


def stream_epoch_length(ranks: int, rank: int, workers: int) -> int:
    run = stream_reference(ranks, rank, workers)
    return sum(1 for e, _ in run if e == 0)


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("point", [
    *POINTS,
])
@pytest.mark.parametrize("workers", [0])
def test_stream_in_process(workers: int, point: str, ranks: int) -> None:
    stream_cell(workers, point, ranks)


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("workers", [2])
def test_stream(workers: int, point: str, ranks: int) -> None:
    stream_cell(workers, point, ranks)


def stream_cell(workers: int, point: str, ranks: int) -> None:
    runs = []
    for rank in range(ranks):
        want = stream_reference(ranks, rank, workers)
        stop = stop_at(point, stream_epoch_length(ranks, rank, workers))
        head, state = stream_run(ranks, rank, workers, stop)
        assert state is not None and len(head) == stop
        tail, _ = stream_run(ranks, rank, workers, None, state)
        assert head + tail == want
        runs.append(head + tail)
    # The stream splits the same way the plan does: every piece once per epoch.
    check_every_piece_once(runs)
