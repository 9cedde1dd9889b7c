"""fastpack.CostModel: coefficients, vectorised costs, errors, and agreement with
torch's FlopCounterMode on tiny models of each family (forward products counted by
torch, ×3 for training; one family also counted through its backward)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastpack
from fastpack import CostModel, FastpackError, FastpackTypeError

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
         "vocab_size": 256}


def _pairs(lens: np.ndarray, w: int | None) -> np.ndarray:
    """(query, key) pairs of causal attention over ``l`` tokens, at most ``w`` keys each."""
    out = np.zeros(len(lens))
    for j, n in enumerate(lens.tolist()):
        i = np.arange(n)
        out[j] = np.minimum(i + 1, w if w else n + 1).sum()
    return out


def test_dense_coefficients_by_hand() -> None:
    cost = CostModel.from_config(LLAMA)
    h, n, d = 64, 2, 16
    per_token = n * (2 * h * (4 * d + 2 * 2 * d) + 2 * 4 * d * h + 3 * 2 * h * 128) + 2 * h * 256
    pair = n * 4 * 4 * d
    lens = np.array([1, 7, 100, 4096])
    expected = 3.0 * (per_token * lens + pair * _pairs(lens, None))
    np.testing.assert_allclose(cost.sequence_flops(lens), expected, rtol=1e-12)
    assert cost.windows == ()
    assert cost.quadratic == pytest.approx(3.0 * pair / 2)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=20), st.integers(1, 1000))
def test_window_equals_counted_pairs(lengths: list[int], window: int) -> None:
    """The closed form (polynomial minus window terms) equals the pairs counted query by
    query, for any lengths and window; lengths within the window pay full attention."""
    base = CostModel.from_config(LLAMA)
    cost = CostModel.from_config({**LLAMA, "model_type": "mistral", "sliding_window": window})
    lens = np.array(lengths)
    pair = 3.0 * 2 * 4 * 4 * 16
    linear_only = base.sequence_flops(lens) - pair * _pairs(lens, None)
    np.testing.assert_allclose(cost.sequence_flops(lens), linear_only + pair * _pairs(lens, window),
                               rtol=1e-9, atol=1e-6)
    short = lens <= window
    np.testing.assert_array_equal(cost.window_flops(lens)[short], 0.0)
    assert (cost.sequence_flops(lens) <= base.sequence_flops(lens) + 1e-6).all()


def test_layer_types_mix_windows_and_full() -> None:
    config = {**LLAMA, "num_hidden_layers": 4, "sliding_window": 8,
              "layer_types": ["sliding_attention", "full_attention"] * 2}
    cost = CostModel.from_config(config)
    assert cost.windows == ((8, pytest.approx(3.0 * 2 * 4 * 4 * 16 / 2)),)
    assert dict(cost.layers) == {"full": 2, "sliding": 2}
    assert "sliding" in repr(cost) and "m = l − 8" in repr(cost)


def test_short_convolution_and_chunked_layers_by_hand() -> None:
    h = 64
    conv = CostModel.from_config({**LLAMA, "model_type": "lfm2", "conv_L_cache": 3,
                                  "layer_types": ["conv", "full_attention"]})
    attention_only = CostModel.from_config({**LLAMA, "num_hidden_layers": 1})
    mlp = 3 * 2 * h * 128
    # in_proj (h → 3h), 3 depthwise taps over h channels, out_proj (h → h); an MLP each.
    assert conv.linear - attention_only.linear == pytest.approx(
        3.0 * (2 * h * 3 * h + 2 * 3 * h + 2 * h * h + mlp))
    assert conv.quadratic == attention_only.quadratic
    assert dict(conv.layers) == {"conv": 1, "full": 1}
    chunked = CostModel.from_config({**LLAMA, "model_type": "llama4_text",
                                     "attention_chunk_size": 8,
                                     "layer_types": ["chunked_attention", "full_attention"]})
    assert [w for w, _ in chunked.windows] == [8]  # within a chunk: at most 8 keys


def test_moe_counts_active_experts_only() -> None:
    moe = {**LLAMA, "model_type": "qwen3_moe", "num_experts": 64, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32}
    dense = CostModel.from_config(LLAMA)
    cost = CostModel.from_config(moe)
    h = 64
    delta = 2 * (2 * h * 64 + 2 * 3 * 2 * h * 32 - 3 * 2 * h * 128)
    assert cost.linear - dense.linear == pytest.approx(3.0 * delta)
    # 64 experts or 640: only the router grows.
    bigger = CostModel.from_config({**moe, "num_experts": 640})
    assert bigger.linear - cost.linear == pytest.approx(3.0 * 2 * 2 * h * 576)
    assert dict(cost.layers) == {"full+moe": 2}


def test_vectorised_and_image() -> None:
    cost = CostModel.from_config(LLAMA)
    lens = np.arange(10**6, dtype=np.int32).reshape(1000, 1000)
    out = cost.sequence_flops(lens)
    assert out.dtype == np.float64 and out.shape == lens.shape
    np.testing.assert_array_equal(cost.image_flops([0, 5]), [0.0, 0.0])  # no vision tower


def test_from_hidden_size_is_the_old_estimate() -> None:
    cost = CostModel.from_hidden_size(512)
    np.testing.assert_allclose(cost.sequence_flops([3, 10]), [6 * 512 * 3 + 9, 6 * 512 * 10 + 100])
    assert "hidden_size=512" in repr(cost)
    assert fastpack.CostModel is CostModel


def test_errors_name_the_key() -> None:
    with pytest.raises(FastpackTypeError, match="config"):
        CostModel.from_config("llama")
    with pytest.raises(FastpackError, match="num_hidden_layers"):
        CostModel.from_config({"hidden_size": 8, "num_attention_heads": 2})
    with pytest.raises(FastpackError, match="layer_types"):
        CostModel.from_config({**LLAMA, "layer_types": ["full_attention", "retention"]})
    with pytest.raises(FastpackError, match="hidden_size"):
        CostModel.from_hidden_size(0)


# --------------------------------------------------------------- against FlopCounterMode
def _exact_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     sliding_window=None, **kwargs):  # type: ignore[no-untyped-def]
    """Attention that multiplies exactly the (query, key) pairs a causal (windowed) kernel
    computes, one query at a time, so FlopCounterMode counts those pairs."""
    import torch

    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    window = sliding_window or getattr(module, "sliding_window", None)
    out = []
    for i in range(query.shape[2]):
        lo = max(0, i + 1 - window) if window else 0
        scores = (query[:, :, i : i + 1] @ key[:, :, lo : i + 1].transpose(-1, -2)) * scaling
        out.append(scores.softmax(-1) @ value[:, :, lo : i + 1])
    return torch.cat(out, dim=2).transpose(1, 2).contiguous(), None


def _counted(model, inputs, backward=False, extra=None):  # type: ignore[no-untyped-def]
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False, custom_mapping=extra or {})
    with counter:
        out = model(**inputs)
        if backward:
            out.logits.float().sum().backward()
    return counter.get_total_flops()


@pytest.fixture(scope="module")
def exact() -> str:
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.AttentionInterface.register("fastpack_exact", _exact_attention)
    return "fastpack_exact"


def _causal_lm(config, attention: str):  # type: ignore[no-untyped-def]
    import torch
    import transformers

    torch.manual_seed(0)
    config._attn_implementation = attention
    # The loop over experts (FlopCounterMode does not count grouped_mm).
    config._experts_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model.eval()


TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, vocab_size=64)


def _families():  # type: ignore[no-untyped-def]
    import transformers as t

    return {
        "llama": t.LlamaConfig(**TINY),
        "mistral": t.MistralConfig(**TINY, sliding_window=6),
        "qwen3_moe": t.Qwen3MoeConfig(**TINY, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=16, head_dim=8),
        "bamba": t.BambaConfig(**{**TINY, "num_hidden_layers": 3}, attn_layer_indices=[1],
                               mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
                               mamba_chunk_size=8, mamba_n_groups=1),
        "qwen3_next": t.Qwen3NextConfig(
            **TINY, head_dim=8, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
            layer_types=["linear_attention", "full_attention"]),
        # LFM2: short convolutions (in_proj, 3 causal taps, out_proj) and attention.
        "lfm2": t.Lfm2Config(**{**TINY, "num_hidden_layers": 3},
                             layer_types=["conv", "full_attention", "conv"]),
        # Falcon-H1: attention and a Mamba2 mixer side by side in every layer.
        "falcon_h1": t.FalconH1Config(**TINY, mamba_d_ssm=64, mamba_n_heads=4,
                                      mamba_d_state=8, mamba_chunk_size=8),
    }


def _solve_flops(a_shape, b_shape, *args, **kwargs) -> int:  # type: ignore[no-untyped-def]
    # A triangular solve with an (n, n) matrix and k right-hand sides: n²·k products-sums.
    n, k = a_shape[-1], b_shape[-1]
    batch = int(np.prod(b_shape[:-2]))
    return batch * n * n * k


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3_moe", "bamba", "qwen3_next",
                                    "lfm2", "falcon_h1"])
def test_against_flop_counter(family: str, exact: str) -> None:
    import torch

    config = _families()[family]
    # The exact pairs where windows or the pair count are what is checked; elsewhere
    # (attention one layer among others) sdpa, which torch counts as the full l² square.
    dense = family not in ("llama", "mistral")
    model = _causal_lm(config, "sdpa" if dense else exact)
    # Qwen3-Next's torch delta rule pads to chunks of 64: a whole chunk.
    length = 64 if family == "qwen3_next" else 16
    ids = torch.randint(0, 64, (1, length))
    extra = {torch.ops.aten.linalg_solve_triangular: _solve_flops}
    counted = _counted(model, {"input_ids": ids, "use_cache": False}, extra=extra)
    cost = CostModel.from_config(config)
    expected = cost.sequence_flops([length])[0] / 3.0
    if dense:  # the masked half of the square too: per pair, 2·quadratic/3 FLOPs forward
        expected += 2 * cost.quadratic / 3 * (length**2 - length * (length + 1) / 2)
    assert counted > 0
    assert abs(expected / counted - 1) < 0.05, (family, expected, counted)


def test_backward_is_twice_the_forward(exact: str) -> None:
    import torch

    model = _causal_lm(_families()["llama"], exact).train()
    ids = torch.randint(0, 64, (1, 8))
    counted = _counted(model, {"input_ids": ids, "use_cache": False}, backward=True)
    expected = CostModel.from_config(model.config).sequence_flops([8])[0]
    assert abs(expected / counted - 1) < 0.05, (expected, counted)


def test_vision_tower_against_flop_counter() -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
    )

    vision = Qwen2VLVisionConfig(depth=2, embed_dim=64, hidden_size=96, num_heads=4,
                                 patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    vision._attn_implementation = "sdpa"
    torch.manual_seed(0)
    tower = Qwen2VisionTransformerPretrainedModel._from_config(vision).eval()
    grids = torch.tensor([[1, 8, 12], [2, 4, 4]])  # an image of 96 patches, a 2-frame video
    patches = int((grids.prod(-1)).sum())
    pixels = torch.randn(patches, 3 * 2 * 14 * 14)
    with torch.no_grad():
        counted = _counted(tower, {"hidden_states": pixels, "grid_thw": grids})
    cost = CostModel.from_config({"model_type": "qwen2_vl", "vision_config": vision.to_dict(),
                                  "text_config": {**TINY, "model_type": "qwen2_vl_text"}})
    frames = np.array([96, 16, 16])
    expected = cost.image_flops(frames).sum() / 3.0
    assert abs(expected / counted - 1) < 0.05, (expected, counted)


# --------------------------------------------------------------- in the sampler
def _dataset(seed: int = 0):  # type: ignore[no-untyped-def]
    pytest.importorskip("torch")
    from fastpack.torch import PackedCollator, PackedDataset

    rng = np.random.default_rng(seed)
    rows = [np.arange(1, int(n) + 1) for n in rng.integers(1, 200, size=300)]
    return PackedDataset(rows, PackedCollator(max_len=256, backend="flash"), group_tokens=512)


def test_sampler_balances_the_cost_model() -> None:
    """The schedule's cost of every micro-step is the cost model's FLOPs of its segments,
    sliding windows included; a state saved under one cost model does not load under
    another."""
    pytest.importorskip("torch")
    from fastpack.torch import PackedSampler

    ds = _dataset()
    cost = CostModel.from_config({**LLAMA, "model_type": "mistral", "sliding_window": 50})
    sampler = PackedSampler(ds, num_replicas=3, rank=0, cost=cost)
    schedule = sampler.schedule(0)
    per_segment = np.concatenate(([0.0], np.cumsum(cost.sequence_flops(ds.plan.seqlens))))
    expected = per_segment[schedule.micro_hi] - per_segment[schedule.micro_lo]
    np.testing.assert_allclose(schedule.micro_cost, expected, rtol=1e-12)
    assert (cost.window_flops(ds.plan.seqlens) < 0).any()  # the windows matter here
    # The global steps pair costs that are close: sorted by cost before being cut in 3s.
    spread = np.ptp(schedule.micro_cost[schedule.layout], axis=1)
    assert spread.mean() < 0.2 * np.ptp(schedule.micro_cost)

    state = sampler.state_dict()
    other = PackedSampler(ds, num_replicas=3, rank=0, cost=CostModel.from_config(LLAMA))
    with pytest.raises(FastpackError, match="cost_key"):
        other.load_state_dict(state)
    PackedSampler(ds, num_replicas=3, rank=0, cost=cost).load_state_dict(state)


def test_sampler_hidden_size_unchanged() -> None:
    """``hidden_size=h`` and ``cost=CostModel.from_hidden_size(h)`` give the same schedule,
    the older ``6·h·Σl + Σl²``."""
    pytest.importorskip("torch")
    from fastpack.torch import PackedSampler

    ds = _dataset(1)
    a = PackedSampler(ds, num_replicas=2, rank=0, hidden_size=128).schedule(0)
    b = PackedSampler(ds, num_replicas=2, rank=0,
                      cost=CostModel.from_hidden_size(128)).schedule(0)
    np.testing.assert_array_equal(a.layout, b.layout)
    lengths = np.asarray(ds.plan.seqlens, dtype=np.float64)
    old = np.concatenate(([0.0], np.cumsum(6.0 * 128 * lengths + lengths**2)))
    np.testing.assert_allclose(a.micro_cost, old[a.micro_hi] - old[a.micro_lo])
