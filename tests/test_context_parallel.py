"""Context parallelism: the layout against TransformerEngine's and ring-flash-attn's
contracts (their test vectors and property tests), the shards, and the attention and
Hugging Face models on gloo worlds of 2 and 4 CPU processes equal to one process computing
the whole row (outputs and q/k/v gradients: fp64 within 1e-10, fp32 within 1e-5)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import cp_world  # noqa: E402

import fastpack  # noqa: E402
from fastpack import FastpackError  # noqa: E402
from fastpack.torch import (  # noqa: E402
    PackedCollator,
    context_parallel_attention,
    packed_loss,
    shard_for_context_parallel,
    varlen_attention,
)

MODES = fastpack.CP_MODES


def cu_of(lengths: list[int] | tuple[int, ...]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


# ----------------------------------------------------- the contracts, transcribed


def te_padded(cu: np.ndarray, factor: int) -> np.ndarray:
    """TransformerEngine's ``pad_thd_sequences_for_cp``: every length up to a multiple of
    ``factor``; its ``cu_seqlens_padded``."""
    lengths = np.diff(cu)
    return cu_of(list(-(-lengths // factor) * factor))


def te_indices(padded: np.ndarray, cp: int, rank: int) -> list[int]:
    """TE's ``get_batch_on_this_cp_rank`` / ``thd_get_partitioned_indices``: slices ``rank``
    and ``2·cp−1−rank`` of every padded sequence."""
    out: list[int] = []
    for s, e in zip(padded[:-1], padded[1:]):
        c = (e - s) // (2 * cp)
        out += range(s + rank * c, s + (rank + 1) * c)
        out += range(s + (2 * cp - 1 - rank) * c, s + (2 * cp - rank) * c)
    return out


def te_positions(padded: np.ndarray) -> np.ndarray:
    """TE's ``generate_positional_ids_for_cp``: 0.. through every padded sequence."""
    return np.concatenate([np.arange(e - s) for s, e in zip(padded[:-1], padded[1:])] or
                          [np.zeros(0, dtype=np.int64)])


def llama3(cu: np.ndarray, rank: int, world: int) -> tuple[Any, ...]:
    """ring-flash-attn's ``llama3_flash_attn_prepare_cu_seqlens(cu, causal=True, ...)``."""
    total = int(cu[-1])
    length = total // world
    left = int(np.searchsorted(cu, rank * length))
    if left == len(cu) or cu[left] != rank * length:
        left -= 1
    right = int(np.searchsorted(cu, (rank + 1) * length))
    q = cu[left : right + 1].astype(np.int64) - rank * length
    q[0], q[-1] = 0, length
    k = cu[left : right + 1].astype(np.int64)
    k[-1] = (rank + 1) * length
    k -= cu[left]
    return q, k, int(np.diff(q).max()), int(np.diff(k).max()), slice(int(cu[left]),
                                                                       (rank + 1) * length)


def test_transformer_engine_vectors() -> None:
    layout = fastpack.cp_layout([0, 8, 16], 2)
    assert layout.indices(0).tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert layout.indices(1).tolist() == [2, 3, 4, 5, 10, 11, 12, 13]
    assert layout.indices(0).dtype == np.int64
    # pad_thd_sequences_for_cp's example: 7, 11 and 5 tokens with cp=2 (TE #1930: the
    # length-7 sequence is padded to 8, never read as 6).
    layout = fastpack.cp_layout(np.array([0, 7, 18, 23]), 2)
    assert layout.cu_seqlens_padded.tolist() == [0, 8, 20, 28]
    assert layout.cu_seqlens_padded.dtype == layout.cu_seqlens.dtype == np.int32
    assert (layout.pad_tokens, layout.padded_total, layout.max_seqlen_padded) == (5, 28, 12)
    rank0 = layout.indices(0)
    assert rank0.tolist() == te_indices(layout.cu_seqlens_padded, 2, 0)
    assert layout.positions(0).tolist() == te_positions(layout.cu_seqlens_padded)[rank0].tolist()
    assert layout.pad_mask(0).tolist()[:4] == [False, False, False, True]  # token 7: a pad


def test_ring_flash_attn_vector() -> None:
    # ring-flash-attn's test_llama3_prepare_cu_seqlens: cu_seqlens [0, 7, 14, 16], world 8.
    for mode in ("contiguous", "ulysses"):
        layout = fastpack.cp_layout([0, 7, 14, 16], 8, mode=mode)
        for rank in range(8):
            q, k, mq, mk, k_slice = llama3(layout.cu_seqlens_padded, rank, 8)
            local = layout.local(rank)
            assert local.cu_seqlens_q.tolist() == q.tolist()
            assert local.cu_seqlens_k.tolist() == k.tolist()
            assert (local.max_seqlen_q, local.max_seqlen_k, local.local_k_slice) == (mq, mk,
                                                                                     k_slice)
            assert local.cu_seqlens_q.dtype == local.cu_seqlens_k.dtype == np.int32
    # prime-rl #2392: a rank's local cu_seqlens start at 0 on every rank.
    local = fastpack.cp_layout([0, 1024, 4096], 2, mode="contiguous").local(1)
    assert local.cu_seqlens_q.tolist() == [0, 2048]
    assert local.seq_idx.tolist() == [0] * 2048


lengths_st = st.lists(st.integers(0, 40), min_size=0, max_size=10)


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_st, cp=st.integers(1, 5), multiple=st.integers(1, 3),
       mode=st.sampled_from(MODES))
def test_layout_properties(lengths: list[int], cp: int, multiple: int, mode: str) -> None:
    """Each rank's indices partition every padded sequence exactly once, ranks hold as
    many tokens, zigzag is TE's and the contiguous modes' runs llama3's arrays, the two
    cu_seqlens agree, pads are the positions past a sequence's end, positions are
    global (taken on the padded row before slicing)."""
    cu = cu_of(lengths)
    layout = fastpack.cp_layout(cu, cp, mode=mode, pad_multiple=multiple)
    padded, lengths_a = layout.cu_seqlens_padded, np.diff(cu)
    plen = np.diff(padded)
    assert layout.cu_seqlens.tolist() == cu.tolist()
    assert (plen >= lengths_a).all() and layout.padded_total % (cp * multiple) == 0
    chunked = mode == "zigzag" and cp > 1
    if mode == "zigzag":
        factor = (2 * cp if cp > 1 else 1) * multiple  # nothing is cut on one rank
        assert layout.divisor == factor
        assert padded.tolist() == te_padded(cu, factor).tolist()
    elif len(lengths):
        assert (plen[:-1] == lengths_a[:-1]).all()  # only the last absorbs the row's pad
        assert layout.padded_total == -(-int(cu[-1]) // (cp * multiple)) * cp * multiple
    positions = te_positions(padded)
    seen = np.zeros(layout.padded_total, dtype=np.int64)
    for rank in range(cp):
        idx = layout.indices(rank)
        assert len(idx) == layout.local_tokens
        np.add.at(seen, idx, 1)
        if chunked:
            assert idx.tolist() == te_indices(padded, cp, rank)
        else:
            assert idx.tolist() == list(range(rank * len(idx), (rank + 1) * len(idx)))
            if layout.padded_total:
                q, k, mq, mk, k_slice = llama3(padded, rank, cp)
                local = layout.local(rank)
                assert local.cu_seqlens_q.tolist() == q.tolist()
                assert local.cu_seqlens_k.tolist() == k.tolist()
                assert (local.max_seqlen_q, local.max_seqlen_k) == (mq, mk)
                assert local.local_k_slice == k_slice
        assert layout.positions(rank).tolist() == positions[idx].tolist()
        seq = np.searchsorted(padded, idx, side="right") - 1
        pad = positions[idx] >= lengths_a[seq] if len(idx) else np.zeros(0, dtype=bool)
        assert layout.pad_mask(rank).tolist() == pad.tolist()
        sources = layout.sources(rank)
        assert (sources[~pad] == cu[seq[~pad]] + positions[idx][~pad]).all()
    assert (seen == 1).all()


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=8), cp=st.integers(1, 4),
       mode=st.sampled_from(MODES))
def test_shards_reassemble_the_row(lengths: list[int], cp: int, mode: str) -> None:
    """The ranks' shards hold every real token once, at its place: ids, labels, global
    positions; pads are labelled -100; ``shift_labels`` are the row's labels shifted within
    each sequence before slicing; ``seq_idx`` follows the rank-local runs."""
    rng = np.random.default_rng(sum(lengths) * 31 + cp)
    collator = PackedCollator(max_len=64, backend="flash", overlong="split",
                              return_num_items=True)
    samples = [{"input_ids": rng.integers(1, 99, n).tolist(),
                "loss_mask": rng.integers(0, 2, n).tolist()} for n in lengths]
    batch = collator(samples)
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    cu = batch["cu_seq_lens_q"].long()
    shifted = torch.full_like(labels, -100)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        shifted[a : b - 1] = labels[a + 1 : b]
    # A row whose labels are the tokens themselves (no -100 at sequence starts): the shift
    # still stops at every sequence's end.
    own = shard_for_context_parallel({**batch, "labels": ids[None].clone()}, cp, 0, mode)
    own_layout = fastpack.cp_layout(batch["cu_seq_lens_q"], cp, mode=mode)
    src = torch.from_numpy(own_layout.sources(0).copy())
    ends = torch.zeros_like(ids, dtype=torch.bool)
    ends[cu[1:] - 1] = True
    want = torch.where(ends, -100, torch.roll(ids, -1))[src.clamp(min=0)]
    want[src < 0] = -100
    assert torch.equal(own["shift_labels"][0], want)
    got = {k: torch.full_like(ids, -7) for k in ("input_ids", "labels", "shift_labels",
                                               "position_ids")}
    for rank in range(cp):
        local = shard_for_context_parallel(batch, cp, rank, mode)
        layout = fastpack.cp_layout(batch["cu_seq_lens_q"], cp, mode=mode)
        src = torch.from_numpy(layout.sources(rank).copy())
        real = src >= 0
        for key in got:
            assert local[key].shape == (1, layout.local_tokens)
            got[key][src[real]] = local[key][0, real]
        assert (local["labels"][0, ~real] == -100).all()
        assert (local["shift_labels"][0, ~real] == -100).all()
        assert torch.equal(local["loss_mask"], local["shift_labels"] != -100)
        cu_q = local["cp_cu_seqlens_q"].long()
        assert torch.equal(local["seq_idx"][0].long(), torch.repeat_interleave(
            torch.arange(len(cu_q) - 1), cu_q.diff()))
        assert torch.equal(local["position_ids"][0], torch.from_numpy(
            layout.positions(rank).copy()))
        assert int(local["num_items_in_batch"]) == int(batch["num_items_in_batch"])
        assert (local["cp_size"], local["cp_rank"], local["cp_mode"]) == (cp, rank, mode)
        assert local["cp_cu_seqlens"].dtype == local["cp_cu_seqlens_padded"].dtype == \
            torch.int32
    assert torch.equal(got["input_ids"], ids)
    assert torch.equal(got["labels"], labels)
    assert torch.equal(got["shift_labels"], shifted)
    assert torch.equal(got["position_ids"], batch["position_ids"][0])


def test_numpy_batches_give_numpy_shards() -> None:
    batch = PackedCollator(max_len=16, backend="flash", return_tensors="np")(
        [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    local = shard_for_context_parallel(batch, 2, 1)
    as_torch = shard_for_context_parallel({k: torch.as_tensor(v) for k, v in batch.items()},
                                          2, 1)
    for key, value in as_torch.items():
        if isinstance(value, torch.Tensor):
            assert isinstance(local[key], np.ndarray), key
            assert local[key].tolist() == value.tolist(), key
    # rank 1 holds chunks 1 and 2 of [1|2|3|_] and of [4|5|_|_]
    assert local["input_ids"].tolist() == [[2, 3, 5, 0]]


def test_cp_size_one_is_the_plain_attention() -> None:
    """A group of one: the same numbers as varlen_attention, gradients included."""
    lengths = (5, 1, 9, 3)
    cu = cu_of(lengths)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(18, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    batch = {"input_ids": torch.zeros(1, 18, dtype=torch.long),
             "cu_seq_lens_q": torch.from_numpy(cu)}
    want_q, want_k, want_v = (t.clone().requires_grad_() for t in (q, k, v))
    want = varlen_attention(want_q, want_k, want_v, cu, 9, kernel="sdpa")
    want.sum().backward()
    for mode in MODES:
        local = shard_for_context_parallel(batch, 1, 0, mode)
        got_q, got_k, got_v = (t.clone().requires_grad_() for t in (q, k, v))
        got = context_parallel_attention(got_q, got_k, got_v, local)
        got.sum().backward()
        assert torch.allclose(got, want, rtol=0, atol=1e-12), mode
        for a, b in ((got_q, want_q), (got_k, want_k), (got_v, want_v)):
            assert torch.allclose(a.grad, b.grad, rtol=0, atol=1e-12), mode


def test_zigzag_balances_attention_work() -> None:
    """One 131,072-token sequence: zigzag gives every rank within 2% of 1/cp of the
    work (it is exact up to a chunk's rounding), contiguous gives the last rank most."""
    for cp in (2, 4, 8):
        zigzag = fastpack.cp_layout([0, 131_071], cp)
        share = zigzag.work / zigzag.work.sum()
        assert np.abs(share * cp - 1).max() < 0.02, share
        contiguous = fastpack.cp_layout([0, 131_071], cp, mode="contiguous")
        # The last slice's queries see the whole row: (2cp - 1) / cp of the mean.
        assert abs(contiguous.imbalance() - (2 * cp - 1) / cp) < 0.01
        assert contiguous.work.sum() == zigzag.work.sum() == 131_071 * 131_072 // 2


def test_sequence_weighting_needs_the_row_normaliser() -> None:
    batch = PackedCollator(max_len=16, backend="flash")([{"input_ids": [1, 2, 3, 4]}])
    local = shard_for_context_parallel(batch, 2, 0)
    logits = torch.zeros(1, local["input_ids"].shape[1], 8)
    for weighting in ("token", "sequence"):
        with pytest.raises(FastpackError, match="a context-parallel batch holds one rank"):
            packed_loss(logits, local, weighting=weighting)  # type: ignore[arg-type]


# --------------------------------------------------------------------- gloo worlds


@pytest.mark.parametrize("size", [2, 4])
def test_attention_equals_one_process(size: int) -> None:
    """Every case on every rank: the assembled outputs and q/k/v gradients of the real
    tokens equal the whole row's on one process; pads leak nothing (their K/V gradients
    are exactly 0, so no real query attended to one)."""
    ranks = cp_world.world(size)
    worst: dict[str, float] = {}
    for case in cp_world.CASES:
        want = cp_world.reference(case)
        pieces = [r["attention"][case.name] for r in ranks]
        for key, like in (("out", want["out"]), ("dq", want["dq"]), ("dk", want["dk"]),
                          ("dv", want["dv"])):
            full, pads = cp_world.assemble(pieces, key, like)
            diff = float((full - like).abs().max())
            worst[case.dtype] = max(worst.get(case.dtype, 0.0), diff)
            assert diff <= cp_world.TOLERANCE[case.dtype], (case, key, diff)
            if key in ("dk", "dv"):
                assert not pads.any(), (case, key)
    print(f"cp={size}: worst |cp - cp=1| {worst}")


@pytest.mark.parametrize(("mode", "family"), cp_world.GRAD_CELLS)
@pytest.mark.parametrize("weighting", cp_world.WEIGHTINGS)
def test_model_loss_and_gradients(mode: str, family: str, weighting: str) -> None:
    """A Hugging Face model (fp64) on 2 ranks: the ranks' losses add up to the whole
    row's and their parameter gradients to its gradients, within 1e-6 of the largest —
    ``packed_loss`` (a split sequence weighs by its whole target count) and the model's
    own loss (it reads ``shift_labels``). Not 1e-10: Hugging Face's RMSNorm (and its loss)
    run in fp32 whatever the model's dtype, so a last-bit difference in attention's sum
    order can round an fp32 value the other way (the attention itself is within 1e-10,
    above). A wrong shift, normaliser or gradient reduction is off by far more."""
    ranks = cp_world.world(2)
    want = cp_world.model_reference(family, weighting)
    got = [r["models"][f"grads-{mode}-{family}-{weighting}"] for r in ranks]
    tolerance = 1e-6
    loss = sum(g["loss"] for g in got)
    assert abs(float(loss - want["loss"])) <= tolerance * abs(float(want["loss"]))
    for name, grad in want["grads"].items():
        total = sum(g["grads"][name] for g in got)
        scale = max(float(grad.abs().max()), 1e-3)
        assert float((total - grad).abs().max()) <= tolerance * scale, name


# ------------------------------------------------------------------ CP-aware plans


@settings(max_examples=120, deadline=None)
@given(lengths=st.lists(st.integers(0, 70), max_size=30), max_len=st.integers(6, 64),
       cp=st.integers(1, 4), multiple=st.integers(1, 2), mode=st.sampled_from(MODES),
       overlong=st.sampled_from(["split", "truncate", "drop"]),
       strategy=st.sampled_from(fastpack.STRATEGIES), reserve=st.integers(0, 1))
def test_plans_fit_max_len_once_padded(lengths: list[int], max_len: int, cp: int,
                                       multiple: int, mode: str, overlong: str,
                                       strategy: str, reserve: int) -> None:
    """No pack exceeds ``max_len`` once padded as its row's layout pads it; the plan's
    segments are real tokens (every token once, or counted as dropped / truncated) and
    ``pad_tokens`` is the layouts' padding."""
    d = fastpack.cp_layout([0], cp, mode=mode, pad_multiple=multiple).divisor
    kwargs = dict(strategy=strategy, overlong=overlong, reserve=reserve, cp_size=cp,
                  cp_mode=mode, pad_multiple=multiple)
    if max_len // d * d <= reserve:
        with pytest.raises(FastpackError, match="^pad_multiple: with cp_size="):
            fastpack.pack(lengths, max_len, **kwargs)  # type: ignore[arg-type]
        return
    plan = fastpack.pack(lengths, max_len, **kwargs)  # type: ignore[arg-type]
    assert (plan.cp_size, plan.cp_mode, plan.pad_multiple, plan.max_len) == (cp, mode, multiple,
                                                                             max_len)
    pads = 0
    for p in range(plan.num_packs):
        layout = fastpack.cp_layout(plan.cu_seqlens(p), cp, mode=mode, pad_multiple=multiple)
        assert layout.padded_total <= max_len
        pads += layout.pad_tokens
    assert pads == plan.pad_tokens
    ext = [n + reserve for n in lengths if n]
    assert sum(ext) == (plan.total_tokens + plan.truncated_tokens + plan.dropped_tokens
                        + reserve * plan.dropped_sequences)
    assert plan.total_tokens == int(plan.seqlens.sum())
    pieces: dict[int, list[tuple[int, int]]] = {}
    for i, a, n in zip(plan.sample_ids.tolist(), plan.starts.tolist(), plan.seqlens.tolist()):
        assert n > 0
        pieces.setdefault(i, []).append((a, n))
    for i, parts in pieces.items():
        parts.sort()
        assert parts[0][0] == 0
        assert all(a + n == b for (a, n), (b, _) in zip(parts, parts[1:]))
        assert parts[-1][0] + parts[-1][1] <= lengths[i] + reserve


def test_gpu_check_context_parallel_section_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """benches/gpu_check.py's CP section on the CPU, its flash-attn path on a stand-in of
    flash_attn_varlen_func's contract (bottom-right causal over each run's keys): every
    emulated rank of cp = 2 and 4, both kernels, within the section's own bound."""
    import importlib.util
    from pathlib import Path

    import fastpack.torch.context_parallel as cpm

    path = Path(__file__).resolve().parents[1] / "benches" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    monkeypatch.setattr(cpm, "_flash", lambda: cp_world.flash_on_cpu)
    monkeypatch.setattr(cpm, "_kernel_reason", lambda kernel, q: None if kernel != "ring"
                        else "not on the CPU")
    cfg = gpu_check.make_config(cpu_smoke=True)
    cfg["check_heads"] = [(4, 2)]
    cfg["iters"], cfg["warmup"], cfg["cp_long"] = 1, 0, [30, 7, 1]
    report = gpu_check.check_context_parallel(torch, gpu_check.load_attention_module(), cfg,
                                              torch.device("cpu"), torch.float32)
    assert report["ok"], report
    assert {r["kernel"] for r in report["kernels"]} == {"flash", "sdpa"}
    assert len(report["kernels"]) == 8


@pytest.mark.parametrize("mode", ["zigzag", "contiguous"])
def test_the_sampler_balances_the_busiest_cp_rank(mode: str) -> None:
    """With a plan made for CP, every micro-step's cost is its busiest CP rank's
    (``6·h·padded/cp + 2·max_r work_r``, from the layout of the step's row) and
    ``Schedule.cp_imbalance`` is that row's layout's; the data-parallel ranks that run
    together are balanced in that cost."""
    from fastpack.torch import PackedDataset, PackedSampler

    rng = np.random.default_rng(1)
    rows = [rng.integers(1, 50, int(n)) for n in rng.integers(1, 700, 300)]
    collator = PackedCollator(max_len=1024, backend="flash", cp_size=4, cp_mode=mode)
    ds = PackedDataset(rows, collator, group_tokens=2048)
    schedule = PackedSampler(ds, num_replicas=3, rank=0, hidden_size=64).schedule(0)
    cost, imbalance = schedule.cost, schedule.cp_imbalance()
    for g in range(len(schedule)):
        for r in range(3):
            lo, hi = int(schedule.lo[g, r]), int(schedule.hi[g, r])
            cu = np.concatenate(([0], np.cumsum(ds.plan.seqlens[lo:hi])))
            layout = fastpack.cp_layout(cu, 4, mode=mode)
            want = 6 * 64 * layout.padded_total / 4 + 2 * int(layout.work.max())
            assert cost[g, r] == pytest.approx(want)
            assert imbalance[g, r] == pytest.approx(layout.imbalance())
    # The steps that run together are neighbours in that cost: no other step's cost lies
    # strictly between a global step's cheapest and dearest.
    micro = schedule.micro_cost
    for row in schedule.layout:
        lo, hi = micro[row].min(), micro[row].max()
        inside = np.flatnonzero((micro > lo) & (micro < hi))
        assert set(inside.tolist()) <= set(row.tolist())
    spread = cost.max(axis=1) / cost.mean(axis=1)
    unbalanced = PackedSampler(ds, num_replicas=3, rank=0, hidden_size=64,
                               balance=None).schedule(0)
    assert np.median(spread) < np.median(unbalanced.cost.max(axis=1)
                                         / unbalanced.cost.mean(axis=1))
    # Zigzag leaves only a short sequence's pad chunk uneven; contiguous, whole documents.
    if mode == "contiguous":
        assert np.median(imbalance) > 1.05 and imbalance.max() > 1.3
    else:
        assert np.median(imbalance) < 1.05
