"""Tests for fastpack.torch.attention.varlen_attention (CPU; GPU paths are in benches/gpu_check.py)."""

from __future__ import annotations

import itertools
import math
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest

pytest.importorskip("torch")

import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fastpack import FastpackError, FastpackTypeError  # noqa: E402
from fastpack.torch import attention as attn_mod  # noqa: E402
from fastpack.torch.attention import varlen_attention  # noqa: E402

try:
    from torch.nn.attention.flex_attention import BlockMask

    HAVE_FLEX = hasattr(BlockMask, "from_kv_blocks")
except ImportError:  # torch < 2.5
    HAVE_FLEX = False
needs_flex = pytest.mark.skipif(not HAVE_FLEX, reason="torch has no flex_attention")

Tensor = torch.Tensor
ATOL = 1e-5


# ---------------------------------------------------------------------------- helpers


def cu_from_lengths(lengths: Sequence[int], dtype: Any = None) -> Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=dtype or torch.int32)


def make_qkv(
    lengths: Sequence[int],
    hq: int = 4,
    hkv: int = 4,
    d: int = 16,
    *,
    seed: int = 0,
    dtype: Any = None,
    requires_grad: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    dtype = dtype or torch.float32
    q = torch.randn(total, hq, d, generator=gen, dtype=dtype)
    k = torch.randn(total, hkv, d, generator=gen, dtype=dtype)
    v = torch.randn(total, hkv, d, generator=gen, dtype=dtype)
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    return q, k, v


def reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lengths: Sequence[int],
    causal: bool,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Per-sequence attention written out (matmul + softmax), in float64; a window keeps
    the keys with ``0 <= q - k < sliding_window``, softcap caps the scores with tanh."""
    groups = q.shape[1] // k.shape[1]
    sc = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    outs = []
    start = 0
    for n in lengths:
        if n == 0:
            continue
        qi = q[start : start + n].double().transpose(0, 1)  # (H, L, D)
        ki = k[start : start + n].double().transpose(0, 1).repeat_interleave(groups, 0)
        vi = v[start : start + n].double().transpose(0, 1).repeat_interleave(groups, 0)
        scores = qi @ ki.transpose(-1, -2) * sc
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        if causal:
            future = torch.ones(n, n, dtype=torch.bool).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        if sliding_window is not None:
            far = torch.ones(n, n, dtype=torch.bool).tril(-sliding_window)
            scores = scores.masked_fill(far, float("-inf"))
        outs.append((scores.softmax(-1) @ vi).transpose(0, 1))
        start += n
    if not outs:
        return torch.zeros(0, q.shape[1], q.shape[2], dtype=torch.float64)
    return torch.cat(outs)


def max_diff(a: Tensor, b: Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.numel() == 0:
        return 0.0
    return float((a.double() - b.double()).abs().max())


LENGTHS = [5, 0, 17, 1, 0, 9, 3]


# ----------------------------------------------------------------------- correctness


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (6, 1)])
def test_matches_per_sequence_reference(causal: bool, hq: int, hkv: int) -> None:
    q, k, v = make_qkv(LENGTHS, hq, hkv)
    out = varlen_attention(q, k, v, cu_from_lengths(LENGTHS), max(LENGTHS), causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert max_diff(out, reference(q, k, v, LENGTHS, causal)) <= ATOL


def test_single_sequence() -> None:
    q, k, v = make_qkv([23], 8, 2)
    out = varlen_attention(q, k, v, cu_from_lengths([23]), 23)
    assert max_diff(out, reference(q, k, v, [23], True)) <= ATOL
    # one sequence, causal, equals plain causal SDPA over the whole batch
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(4, 1).transpose(0, 1),
        v.repeat_interleave(4, 1).transpose(0, 1),
        is_causal=True,
    ).transpose(0, 1)
    assert max_diff(out, dense) <= ATOL


@pytest.mark.parametrize("lengths", [[0, 0, 4, 0, 3, 0], [0, 6], [6, 0], [1, 1, 1, 0, 1]])
def test_zero_length_sequences(lengths: list[int]) -> None:
    q, k, v = make_qkv(lengths, 4, 2)
    out = varlen_attention(q, k, v, cu_from_lengths(lengths), max(lengths), causal=True)
    assert max_diff(out, reference(q, k, v, lengths, True)) <= ATOL


@pytest.mark.parametrize("cu", [[0], [0, 0, 0]])
def test_empty_batch(cu: list[int]) -> None:
    q, k, v = make_qkv([], 4, 2)
    out = varlen_attention(q, k, v, torch.tensor(cu), 0)
    assert out.shape == (0, 4, 16)


def test_softmax_scale() -> None:
    q, k, v = make_qkv(LENGTHS, 4, 2)
    for causal in (True, False):
        out = varlen_attention(
            q, k, v, cu_from_lengths(LENGTHS), 17, causal=causal, softmax_scale=0.07
        )
        assert max_diff(out, reference(q, k, v, LENGTHS, causal, 0.07)) <= ATOL


def test_max_seqlen_upper_bound_accepted() -> None:
    q, k, v = make_qkv(LENGTHS)
    out = varlen_attention(q, k, v, cu_from_lengths(LENGTHS), 1000)
    assert max_diff(out, reference(q, k, v, LENGTHS, True)) <= ATOL


@pytest.mark.parametrize(
    "make_cu",
    [
        lambda ls: cu_from_lengths(ls, torch.int32),
        lambda ls: cu_from_lengths(ls, torch.int64),
        lambda ls: cu_from_lengths(ls, torch.int64).numpy(),
        lambda ls: cu_from_lengths(ls, torch.int64).numpy().astype("int32"),
        lambda ls: [0, *itertools.accumulate(ls)],
    ],
    ids=["int32", "int64", "numpy-int64", "numpy-int32", "list"],
)
def test_cu_seqlens_input_types(make_cu: Callable[[list[int]], Any]) -> None:
    q, k, v = make_qkv(LENGTHS, 4, 2)
    out = varlen_attention(q, k, v, make_cu(LENGTHS), max(LENGTHS))
    assert max_diff(out, reference(q, k, v, LENGTHS, True)) <= ATOL


def test_fp64_and_bf16_inputs() -> None:
    q, k, v = make_qkv(LENGTHS, 4, 2, dtype=torch.float64)
    out = varlen_attention(q, k, v, cu_from_lengths(LENGTHS), 17)
    assert out.dtype == torch.float64
    assert max_diff(out, reference(q, k, v, LENGTHS, True)) <= 1e-12
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    outb = varlen_attention(qb, kb, vb, cu_from_lengths(LENGTHS), 17)
    assert outb.dtype == torch.bfloat16
    refb = reference(qb, kb, vb, LENGTHS, True)
    eps = torch.finfo(torch.bfloat16).eps
    assert max_diff(outb, refb) <= 2 * eps * max(1.0, float(refb.abs().max()))


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 24), min_size=1, max_size=7),
    heads=st.sampled_from([(1, 1), (2, 2), (4, 1), (6, 3), (8, 2)]),
    d=st.sampled_from([4, 8, 16]),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_seqlens(
    lengths: list[int], heads: tuple[int, int], d: int, causal: bool, seed: int
) -> None:
    q, k, v = make_qkv(lengths, *heads, d, seed=seed)
    out = varlen_attention(q, k, v, cu_from_lengths(lengths), max(lengths), causal=causal)
    assert max_diff(out, reference(q, k, v, lengths, causal)) <= ATOL


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_gradients_match_reference(causal: bool, hq: int, hkv: int) -> None:
    q, k, v = make_qkv(LENGTHS, hq, hkv, requires_grad=True)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    out = varlen_attention(q, k, v, cu_from_lengths(LENGTHS), 17, causal=causal)
    (out * grad_out).sum().backward()

    q2, k2, v2 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref = reference(q2, k2, v2, LENGTHS, causal)
    (ref * grad_out.double()).sum().backward()
    for got, want in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        assert got is not None and want is not None
        assert max_diff(got, want) <= ATOL


def test_no_cross_sequence_gradient() -> None:
    lengths = [4, 6]
    q, k, v = make_qkv(lengths, requires_grad=True)
    out = varlen_attention(q, k, v, cu_from_lengths(lengths), 6)
    out[:4].sum().backward()  # loss on the first sequence only
    for t in (q, k, v):
        assert t.grad is not None
        assert torch.count_nonzero(t.grad[4:]) == 0


# ----------------------------------------------------------- no O(T^2) on the CPU path


def test_cpu_path_is_per_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    lengths = [7, 0, 30, 2, 11, 0, 19]
    max_len = max(lengths)
    real_sdpa = torch.nn.functional.scaled_dot_product_attention
    calls: list[tuple[int, int]] = []

    def spy(query: Tensor, key: Tensor, value: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        calls.append((query.shape[-2], key.shape[-2]))
        assert key.shape[-2] <= max_len and query.shape[-2] <= max_len
        assert kwargs.get("attn_mask") is None and not args
        return real_sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    q, k, v = make_qkv(lengths, 8, 2)
    out = varlen_attention(q, k, v, cu_from_lengths(lengths), max_len, kernel="auto")
    assert calls == [(n, n) for n in lengths if n > 0]
    assert max_diff(out, reference(q, k, v, lengths, True)) <= ATOL


def test_auto_on_cpu_is_sdpa() -> None:
    q, _, _ = make_qkv([3])
    assert attn_mod.available_kernels(q) == ["sdpa"]
    assert attn_mod._resolve_kernel("auto", q) == "sdpa"


# ------------------------------------------------------------------------ validation


def _valid_args() -> dict[str, Any]:
    lengths = [3, 0, 5]
    q, k, v = make_qkv(lengths, 4, 2)
    return {"q": q, "k": k, "v": v, "cu_seqlens": cu_from_lengths(lengths), "max_seqlen": 5}


def _call(args: dict[str, Any], **kwargs: Any) -> Tensor:
    return varlen_attention(
        args["q"], args["k"], args["v"], args["cu_seqlens"], args["max_seqlen"], **kwargs
    )


def test_validate_false_skips_value_checks() -> None:
    args = _valid_args()
    out = _call(args, validate=False)
    assert out.shape == args["q"].shape


@pytest.mark.parametrize("kernel", ["flash", "varlen", "flex"])
def test_forcing_unavailable_kernel_raises(kernel: str) -> None:
    with pytest.raises(ValueError, match=rf"kernel='{kernel}' is not available: .*CUDA"):
        _call(_valid_args(), kernel=kernel)


def test_forced_sdpa_kernel() -> None:
    args = _valid_args()
    out = _call(args, kernel="sdpa")
    assert max_diff(out, reference(args["q"], args["k"], args["v"], [3, 0, 5], True)) <= ATOL


# ------------------------------------------------- GPU backends' plumbing, run on CPU


def test_torch_varlen_signature_adaptation() -> None:
    """Drive the varlen_attn call with fakes of the 2.10 / 2.11 / 2.12+ signatures."""
    lengths = [5, 0, 9, 2]
    cu = cu_from_lengths(lengths)
    q, k, v = make_qkv(lengths, 8, 2)
    seen: dict[str, Any] = {}

    def run(
        causal: bool,
        enable_gqa: bool,
        window: Any,
        scale: Any,
        qq: Tensor,
        kk: Tensor,
        vv: Tensor,
        cu_q: Tensor,
        cu_k: Tensor,
        max_q: int,
        max_k: int,
    ) -> Tensor:
        seen.update(causal=causal, window=window, cu_same=cu_q is cu_k, max=(max_q, max_k))
        assert cu_q.dtype == torch.int32
        if not enable_gqa:
            assert kk.shape[1] == qq.shape[1]  # heads were repeated for us
        ref = reference(qq, kk, vv, lengths, causal, scale)
        return ref.to(qq.dtype)

    def v210(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        cu_seq_q: Tensor,
        cu_seq_k: Tensor,
        max_q: int,
        max_k: int,
        is_causal: bool = False,
        return_aux: Any = None,
    ) -> Tensor:
        return run(
            is_causal, False, None, None, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k
        )

    def v211(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        cu_seq_q: Tensor,
        cu_seq_k: Tensor,
        max_q: int,
        max_k: int,
        *,
        return_aux: Any = None,
        scale: float | None = None,
        window_size: tuple[int, int] = (-1, -1),
    ) -> Tensor:
        causal = window_size == (-1, 0)  # what torch 2.11 does: a list would be non-causal
        return run(
            causal, False, window_size, scale, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k
        )

    def v212(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        cu_seq_q: Tensor,
        cu_seq_k: Tensor,
        max_q: int,
        max_k: int,
        *,
        return_aux: Any = None,
        scale: float | None = None,
        window_size: tuple[int, int] = (-1, -1),
        enable_gqa: bool = False,
    ) -> Tensor:
        assert enable_gqa == (query.shape[1] != key.shape[1])
        causal = window_size == (-1, 0)
        return run(
            causal,
            enable_gqa,
            window_size,
            scale,
            query,
            key,
            value,
            cu_seq_q,
            cu_seq_k,
            max_q,
            max_k,
        )

    for fake in (v210, v211, v212):
        for causal in (True, False):
            for scale in (None, 0.11):
                seen.clear()
                out = attn_mod._torch_varlen_forward(fake, q, k, v, cu, 9, causal, scale)
                assert seen["causal"] == causal and seen["cu_same"] and seen["max"] == (9, 9)
                if fake is not v210:
                    assert isinstance(seen["window"], tuple)
                    assert seen["window"] == ((-1, 0) if causal else (-1, -1))
                # on 2.10 a requested scale is folded into q
                assert max_diff(out, reference(q, k, v, lengths, causal, scale)) <= ATOL


def test_flash_call_arguments() -> None:
    lengths = [4, 0, 6]
    cu = cu_from_lengths(lengths)
    q, k, v = make_qkv(lengths, 8, 2)
    got: dict[str, Any] = {}

    def fake_flash(*args: Any, **kwargs: Any) -> Tensor:
        got["args"], got["kwargs"] = args, kwargs
        return args[0]

    attn_mod._flash_forward(fake_flash, q, k, v, cu, 6, True, None)
    assert got["args"][3] is cu and got["args"][4] is cu and got["args"][5:7] == (6, 6)
    assert got["args"][1].shape[1] == 2  # GQA passed through natively
    assert got["kwargs"] == {"dropout_p": 0.0, "softmax_scale": None, "causal": True}


def _token_mask(lengths: Sequence[int], causal: bool) -> Tensor:
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = doc[:, None] == doc[None, :]
    if causal:
        mask &= torch.ones_like(mask).tril()
    return mask


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 13), min_size=1, max_size=8).filter(lambda ls: sum(ls) > 0),
    block=st.sampled_from([1, 3, 4, 8]),
    causal=st.booleans(),
)
def test_document_block_tables_are_exact(lengths: list[int], block: int, causal: bool) -> None:
    total = sum(lengths)
    doc_id, kv_num, kv_idx, full_num, full_idx = attn_mod._document_block_tables(
        cu_from_lengths(lengths), total, block, causal
    )
    nb = -(-total // block)
    assert kv_idx.shape == full_idx.shape == (1, 1, nb, nb) and kv_idx.dtype == torch.int32
    assert doc_id.shape == (nb * block,) and bool((doc_id[total:] == -1).all())

    def listed(num: Tensor, idx: Tensor) -> Tensor:
        out = torch.zeros(nb, nb, dtype=torch.bool)
        for i in range(nb):
            out[i, idx[0, 0, i, : int(num[0, 0, i])].long()] = True
        return out

    partial, full = listed(kv_num, kv_idx), listed(full_num, full_idx)
    assert not bool((partial & full).any())
    mask = torch.zeros(nb * block, nb * block, dtype=torch.bool)
    mask[:total, :total] = _token_mask(lengths, causal)
    blocks = mask.reshape(nb, block, nb, block).permute(0, 2, 1, 3).reshape(nb, nb, -1)
    assert torch.equal(partial | full, blocks.any(-1))  # every needed block, nothing else
    assert bool(blocks[full].all())  # full blocks really are full


@needs_flex
def test_document_block_mask_dense_view() -> None:
    lengths = [100, 0, 200, 1, 90]  # 391 tokens: 4 blocks of 128
    total = sum(lengths)
    bm = attn_mod._document_block_mask(cu_from_lengths(lengths), total, True)
    dense = bm.to_dense()[0, 0].bool()
    mask = torch.zeros(512, 512, dtype=torch.bool)
    mask[:total, :total] = _token_mask(lengths, True)
    assert torch.equal(dense, mask.reshape(4, 128, 4, 128).any(3).any(1))


@needs_flex
@pytest.mark.parametrize("causal", [True, False])
def test_flex_plumbing_eager_cpu(causal: bool) -> None:
    """The flex path's layout, GQA, scale and mask_mod, through flex's eager CPU forward."""
    lengths = [30, 0, 140, 1, 60]  # crosses 128-token blocks
    q, k, v = make_qkv(lengths, 8, 2, d=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            out = attn_mod._flex_forward(
                q, k, v, cu_from_lengths(lengths), causal, 0.2, compile=False
            )
    assert out.shape == q.shape and out.is_contiguous()
    assert max_diff(out, reference(q, k, v, lengths, causal, 0.2)) <= ATOL


@needs_flex
@pytest.mark.skipif(
    not os.environ.get("FASTPACK_SLOW_TESTS"),
    reason="compiles flex for CPU (~30 s); FASTPACK_SLOW_TESTS=1",
)
def test_flex_compiled_cpu() -> None:
    lengths = [100, 0, 250, 1, 170]
    q, k, v = make_qkv(lengths, 8, 2, d=16)
    with torch.no_grad():
        out = attn_mod._flex_forward(q, k, v, cu_from_lengths(lengths), True, None)
    assert max_diff(out, reference(q, k, v, lengths, True)) <= ATOL


# ------------------------------------------------------- sliding window, soft-capping

WINDOW_CASES = [(3, None), (1, None), (None, 2.0), (3, 2.0), (40, 0.5)]


@pytest.mark.parametrize(("window", "cap"), WINDOW_CASES)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_window_and_softcap_match_reference(
    window: int | None, cap: float | None, hq: int, hkv: int
) -> None:
    lengths = [5, 0, 17, 1, 2, 9, 3]  # longer and shorter than the windows, and length 1
    q, k, v = make_qkv(lengths, hq, hkv, dtype=torch.float64)
    out = varlen_attention(q, k, v, cu_from_lengths(lengths), 17, sliding_window=window,
                           softcap=cap)
    assert max_diff(out, reference(q, k, v, lengths, True, sliding_window=window,
                                   softcap=cap)) <= 1e-12
    # and the options change the result (the cases would pass vacuously otherwise)
    if window is not None and window < 17 or cap is not None:
        assert max_diff(out, reference(q, k, v, lengths, True)) > 1e-3


def test_window_and_softcap_gradients() -> None:
    lengths = [6, 1, 11]
    q, k, v = make_qkv(lengths, 4, 2, dtype=torch.float64, requires_grad=True)
    cu = cu_from_lengths(lengths)
    got = torch.autograd.grad(
        varlen_attention(q, k, v, cu, 11, sliding_window=4, softcap=1.5).sum(), (q, k, v))
    want = torch.autograd.grad(
        reference(q, k, v, lengths, True, sliding_window=4, softcap=1.5).sum(), (q, k, v))
    for a, b in zip(got, want):
        assert max_diff(a, b) <= 1e-10


def test_window_mask_is_per_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    """The window mask is built per sequence (O(l^2)), never for the whole batch."""
    sizes: list[int] = []
    real = attn_mod._window_mask

    def spy(length: int, window: int, device: Any) -> Tensor:
        sizes.append(length)
        return real(length, window, device)

    monkeypatch.setattr(attn_mod, "_window_mask", spy)
    lengths = [9, 2, 12]
    q, k, v = make_qkv(lengths)
    varlen_attention(q, k, v, cu_from_lengths(lengths), 12, sliding_window=3)
    assert sizes == [9, 12]  # the 2-token sequence fits the window: plain causal


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sliding_window": 0}, FastpackError, r"^sliding_window must be >= 1"),
        ({"sliding_window": "4"}, FastpackTypeError, r"^sliding_window must be an int or None"),
        ({"sliding_window": True}, FastpackTypeError, r"^sliding_window must be an int"),
        ({"sliding_window": 4, "causal": False}, FastpackError, r"needs causal=True"),
        ({"softcap": -1.0}, FastpackError, r"^softcap must be a positive finite number"),
        ({"softcap": "2"}, FastpackTypeError, r"^softcap must be a number or None"),
    ],
)
def test_window_and_softcap_options_are_checked(
    kwargs: dict[str, Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        _call(_valid_args(), **kwargs)


def test_flash_window_and_softcap_arguments() -> None:
    lengths = [4, 0, 6]
    cu = cu_from_lengths(lengths)
    q, k, v = make_qkv(lengths, 8, 2)
    got: dict[str, Any] = {}

    def fake_flash(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, mq: int,
                   mk: int, dropout_p: float = 0.0, softmax_scale: Any = None,
                   causal: bool = False, window_size: Any = (-1, -1),
                   softcap: float = 0.0) -> Tensor:
        got.update(window_size=window_size, softcap=softcap, causal=causal)
        return q

    attn_mod._flash_forward(fake_flash, q, k, v, cu, 6, True, None, 5, 30.0)
    # flash-attn's window is inclusive: 4 keys to the left and the query itself.
    assert got == {"window_size": (4, 0), "softcap": 30.0, "causal": True}

    def old_flash(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, mq: int,
                  mk: int, dropout_p: float = 0.0, softmax_scale: Any = None,
                  causal: bool = False) -> Tensor:
        return q

    with pytest.raises(FastpackError, match="no softcap"):
        attn_mod._flash_forward(old_flash, q, k, v, cu, 6, True, None, None, 30.0)
    with pytest.raises(FastpackError, match="no window_size"):
        attn_mod._flash_forward(old_flash, q, k, v, cu, 6, True, None, 5, None)


def test_torch_varlen_window_and_no_softcap() -> None:
    lengths = [4, 6]
    cu = cu_from_lengths(lengths)
    q, k, v = make_qkv(lengths)
    got: dict[str, Any] = {}

    def fake(q: Tensor, k: Tensor, v: Tensor, cq: Tensor, ck: Tensor, mq: int, mk: int, *,
             scale: Any = None, window_size: tuple[int, int] = (-1, -1),
             enable_gqa: bool = False) -> Tensor:
        got["window_size"] = window_size
        return q

    attn_mod._torch_varlen_forward(fake, q, k, v, cu, 6, True, None, 3, None)
    assert got["window_size"] == (2, 0) and isinstance(got["window_size"], tuple)
    with pytest.raises(FastpackError, match="kernel='varlen'.*no soft-capping"):
        attn_mod._torch_varlen_forward(fake, q, k, v, cu, 6, True, None, None, 2.0)

    def torch_2_10(q: Tensor, k: Tensor, v: Tensor, cq: Tensor, ck: Tensor, mq: int, mk: int,
                   *, is_causal: bool = False) -> Tensor:
        return q

    with pytest.raises(FastpackError, match="no window_size"):
        attn_mod._torch_varlen_forward(torch_2_10, q, k, v, cu, 6, True, None, 3, None)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 13), min_size=1, max_size=8).filter(lambda ls: sum(ls) > 0),
    block=st.sampled_from([1, 3, 4, 8]),
    window=st.integers(1, 10),
)
def test_document_block_tables_with_window(lengths: list[int], block: int, window: int) -> None:
    """Every block holding an allowed pair is listed, and a full block (no mask_mod) holds
    allowed pairs only."""
    total = sum(lengths)
    _, kv_num, kv_idx, full_num, full_idx = attn_mod._document_block_tables(
        cu_from_lengths(lengths), total, block, True, window
    )
    nb = -(-total // block)

    def listed(num: Tensor, idx: Tensor) -> Tensor:
        out = torch.zeros(nb, nb, dtype=torch.bool)
        for i in range(nb):
            out[i, idx[0, 0, i, : int(num[0, 0, i])].long()] = True
        return out

    partial, full = listed(kv_num, kv_idx), listed(full_num, full_idx)
    mask = torch.zeros(nb * block, nb * block, dtype=torch.bool)
    mask[:total, :total] = _token_mask(lengths, True) & ~torch.ones(
        total, total, dtype=torch.bool).tril(-window)
    blocks = mask.reshape(nb, block, nb, block).permute(0, 2, 1, 3).reshape(nb, nb, -1)
    assert bool((partial | full)[blocks.any(-1)].all())
    assert bool(blocks[full].all())


@needs_flex
def test_flex_window_and_softcap_eager_cpu() -> None:
    lengths = [30, 0, 200, 1, 20]  # a window across 128-token blocks
    q, k, v = make_qkv(lengths, 8, 2, d=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            out = attn_mod._flex_forward(q, k, v, cu_from_lengths(lengths), True, 0.2, 140, 1.5,
                                         compile=False)
    want = reference(q, k, v, lengths, True, 0.2, sliding_window=140, softcap=1.5)
    assert max_diff(out, want) <= ATOL


# ------------------------------------------------------------ register_hf_attention


def _tiny(family: str = "llama", impl: str = "eager", **extra: Any) -> Any:
    transformers = pytest.importorskip("transformers")
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig}[family]
    config = cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 attn_implementation=impl, **extra)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_hf_attention_validates_once_per_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastpack.torch import PackedCollator, register_hf_attention

    calls: list[int] = []
    real = attn_mod._check_cu_values

    def counting(*args: Any) -> None:
        calls.append(1)
        real(*args)

    monkeypatch.setattr(attn_mod, "_check_cu_values", counting)
    model = _tiny(impl=register_hf_attention())
    collator = PackedCollator(max_len=16, backend="flash")
    with torch.no_grad():
        for n in range(2):
            batch = collator([{"input_ids": list(range(1, 8))}, {"input_ids": [9, 10, 11]}])
            batch.pop("labels")
            model(**batch)
            assert len(calls) == n + 1  # once per forward over 2 layers, not once per layer


def test_hf_attention_still_validates_a_bad_batch() -> None:
    from fastpack.torch import register_hf_attention

    model = _tiny(impl=register_hf_attention())
    cu = torch.tensor([0, 3, 9], dtype=torch.int32)  # ends past the 8 tokens
    with pytest.raises(FastpackError, match=r"cu_seqlens\[-1\] must equal total_tokens"):
        model(input_ids=torch.arange(1, 9)[None], position_ids=torch.arange(8)[None],
              cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6, max_length_k=6,
              use_cache=False)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_hf_attention_generation_matches_sdpa(family: str) -> None:
    """One sequence a row, a padding mask (left padding) and a KV cache: the plain calls
    compute what Hugging Face's SDPA computes, window included."""
    from fastpack.torch import register_hf_attention

    extra = {"sliding_window": 3} if family == "mistral" else {}
    ours = _tiny(family, register_hf_attention(), **extra)
    sdpa = _tiny(family, "sdpa", **extra)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask).logits
        b = sdpa(input_ids=ids, attention_mask=mask).logits
        assert max_diff(a[mask.bool()], b[mask.bool()]) <= ATOL
        a = ours.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)
        b = sdpa.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits):
        assert max_diff(x, y) <= ATOL


def test_hf_attention_refuses_packed_rows_under_a_padding_mask() -> None:
    from fastpack.torch import check_model_batch, register_hf_attention

    model = _tiny(impl=register_hf_attention())
    # A padded row of two sequences: the padding mask alone would join them.
    batch = {"input_ids": torch.arange(1, 9)[None], "use_cache": False,
             "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]),
             "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0]])}
    with pytest.raises(FastpackError, match="position_ids restart inside a row"):
        model(**batch)
    sdpa = _tiny(impl="sdpa")
    with pytest.raises(FastpackError, match="packed rows .* with a 2-D attention_mask"):
        check_model_batch(sdpa, batch)


def test_hf_attention_refuses_dropout_and_a_kernel_typo() -> None:
    from fastpack.torch import PackedCollator, register_hf_attention

    model = _tiny(impl=register_hf_attention(), attention_dropout=0.1).train()
    batch = PackedCollator(max_len=16)([{"input_ids": list(range(1, 8))}])
    batch.pop("labels")
    with pytest.raises(FastpackError, match="attention dropout 0.1 is not supported"):
        model(**batch)
    with pytest.raises(FastpackError, match="^kernel: expected one of"):
        register_hf_attention("x", kernel="fast")  # type: ignore[arg-type]


def test_check_model_batch_refuses_packed_rows_with_a_cache() -> None:
    from fastpack.torch import PackedCollator, check_model_batch

    model = _tiny(impl="sdpa")
    batch = PackedCollator(max_len=16)([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    check_model_batch(model, batch)
    batch["use_cache"] = True
    with pytest.raises(FastpackError, match="use_cache"):
        check_model_batch(model, batch)


# ------------------------------------------------------------ benches/gpu_check.py


def _flash_on_cpu(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                  max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                  softmax_scale: float | None = None, causal: bool = False,
                  window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0) -> Tensor:
    """flash_attn_varlen_func's contract, written out on the CPU in float64."""
    assert cu_seqlens_q is cu_seqlens_k and cu_seqlens_q.dtype == torch.int32
    assert dropout_p == 0.0
    left, right = window_size
    bounds = cu_seqlens_q.tolist()
    groups = q.shape[1] // k.shape[1]
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        n = end - start
        if not n:
            continue
        qi = q[start:end].double().transpose(0, 1)
        ki = k[start:end].double().transpose(0, 1).repeat_interleave(groups, 0)
        vi = v[start:end].double().transpose(0, 1).repeat_interleave(groups, 0)
        scores = qi @ ki.transpose(-1, -2) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        i = torch.arange(n)[:, None]
        j = torch.arange(n)[None, :]
        keep = torch.ones(n, n, dtype=torch.bool)
        if causal:
            keep &= j <= i
        if left >= 0:
            keep &= j >= i - left
        if right >= 0:
            keep &= j <= i + right
        scores = scores.masked_fill(~keep, float("-inf"))
        outs.append((scores.softmax(-1) @ vi).transpose(0, 1))
    return torch.cat(outs).to(q.dtype)


def _torch_varlen_on_cpu(query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor,
                         cu_seq_k: Tensor, max_q: int, max_k: int, *, return_aux: Any = None,
                         scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                         enable_gqa: bool = False) -> Tensor:
    """torch.nn.attention.varlen.varlen_attn's (2.12+) contract: causal is a window."""
    assert isinstance(window_size, tuple)
    causal = window_size[1] == 0
    left = window_size[0]
    return _flash_on_cpu(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                         softmax_scale=scale, causal=causal, window_size=(left, -1))


def _flex_on_cpu(query: Tensor, key: Tensor, value: Tensor, block_mask: Any = None,
                 scale: float | None = None, enable_gqa: bool = False,
                 score_mod: Any = None) -> Tensor:
    """flex_attention's contract, written out (differentiable; CPU flex has no backward):
    a key is seen in a full block, or in a partial block where the mask_mod allows it."""
    _, heads, total, _ = query.shape
    q_block, kv_block = block_mask.BLOCK_SIZE
    assert q_block == kv_block

    def listed(num: Tensor, idx: Tensor) -> Tensor:
        nb = num.shape[-1]
        out = torch.zeros(nb, nb, dtype=torch.bool)
        for i in range(nb):
            out[i, idx[0, 0, i, : int(num[0, 0, i])].long()] = True
        tokens = out.repeat_interleave(q_block, 0).repeat_interleave(kv_block, 1)
        return tokens[:total, :total]

    q_idx = torch.arange(total)[:, None]
    kv_idx = torch.arange(total)[None, :]
    full = listed(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    partial = listed(block_mask.kv_num_blocks, block_mask.kv_indices)
    keep = full | (partial & block_mask.mask_mod(0, 0, q_idx, kv_idx))
    groups = heads // key.shape[1]
    k = key.double().repeat_interleave(groups, 1)
    v = value.double().repeat_interleave(groups, 1)
    sc = scale if scale is not None else query.shape[-1] ** -0.5
    scores = query.double() @ k.transpose(-1, -2) * sc
    if score_mod is not None:
        scores = score_mod(scores, 0, 0, q_idx, kv_idx)
    scores = scores.masked_fill(~keep, float("-inf"))
    return (scores.softmax(-1) @ v).to(query.dtype)


def _load_gpu_check() -> Any:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benches" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_flex
def test_gpu_check_harness_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """benches/gpu_check.py's correctness and model sections, on the CPU: flash-attn and
    torch's varlen and compiled flex replaced by CPU stand-ins of their contracts. Every
    kernel path of varlen_attention and the shipped register_hf_attention run."""
    pytest.importorskip("transformers")
    gpu_check = _load_gpu_check()
    am = gpu_check.load_attention_module()
    assert am is attn_mod
    monkeypatch.setattr(am, "_unavailable_reason", lambda kernel, q: None)
    monkeypatch.setattr(am, "_flash_varlen_func", lambda: _flash_on_cpu)
    monkeypatch.setattr(am, "_torch_varlen_attn", lambda: _torch_varlen_on_cpu)
    monkeypatch.setattr(am, "_compiled_flex_attention", lambda: _flex_on_cpu)
    cfg = gpu_check.make_config(cpu_smoke=True)
    cfg["check_heads"] = [(4, 2)]
    cfg["iters"], cfg["warmup"] = 1, 0
    device, dtype = torch.device("cpu"), torch.float32
    assert am.available_kernels(torch.empty(1)) == ["flash", "varlen", "flex", "sdpa"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = gpu_check.check_correctness(torch, am, cfg, device, dtype)
        model = gpu_check.bench_model(torch, am, cfg, device, dtype)
    bad = [r for r in rows if not r.get("ok")]
    assert not bad, bad
    kernels = {r["kernel"] for r in rows if "sliding_window" in r or "softcap" in r}
    assert kernels == {"flash", "varlen", "flex", "sdpa"}
    assert any(r["kernel"] == "varlen" and "refused" in r for r in rows)
    packed = [r for r in model["rows"] if r["layout"] == "packed"]
    assert [r["attn"] for r in packed] == ["flash", "varlen", "flex", "sdpa"]
    assert all(r.get("ok") for r in packed), packed


def test_hf_attention_revalidates_a_reused_cu_seqlens() -> None:
    """Validation is skipped only for the same tensor over the same tokens: a cu_seqlens
    reused for a longer row (or changed in place) is checked again."""
    import transformers

    from fastpack.torch import register_hf_attention

    forward = transformers.AttentionInterface()[register_hf_attention()]
    module = torch.nn.Linear(1, 1).eval()
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q = torch.randn(1, 4, 8, 16)
    forward(module, q, q, q, None, cu_seq_lens_q=cu, max_length_q=5)
    longer = torch.randn(1, 4, 9, 16)
    with pytest.raises(FastpackError, match=r"cu_seqlens\[-1\] must equal total_tokens"):
        forward(module, longer, longer, longer, None, cu_seq_lens_q=cu, max_length_q=5)
    forward(module, q, q, q, None, cu_seq_lens_q=cu, max_length_q=5)
    cu[1] = 9  # in place: a new version, checked again
    with pytest.raises(FastpackError, match="non-decreasing"):
        forward(module, q, q, q, None, cu_seq_lens_q=cu, max_length_q=5)
