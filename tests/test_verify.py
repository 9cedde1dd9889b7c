"""verify_packing: passes where a packed batch computes each sample alone, and on each leak
built here on purpose raises naming the module, the sample and the size.

The leaks are built explicitly (a mask, positions, a raw model, a module written here), so
they keep leaking whatever fastpack's own preparation of a model learns."""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from fastpack import FastpackError, FastpackTypeError  # noqa: E402
from fastpack.torch import (  # noqa: E402
    PackedCollator,
    VerifyReport,
    register_hf_attention,
    shard_for_context_parallel,
    verify_packing,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vlm_models  # noqa: E402

warnings.filterwarnings("ignore")
transformers.logging.set_verbosity_error()

FASTPACK = register_hf_attention()
COMMON = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=8)
LENGTHS = (5, 9, 3, 7, 4, 11)
WINDOW = 4


def samples() -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(1, 64, (n,), generator=gen).tolist()} for n in LENGTHS]


def tiny(family: str, impl: str = "sdpa", dtype: Any = None) -> Any:
    torch.manual_seed(0)
    if family == "llama":
        cfg = transformers.LlamaConfig(**COMMON)
    elif family == "mistral":
        cfg = transformers.MistralConfig(sliding_window=WINDOW, **COMMON)
    elif family == "gemma2":
        cfg = transformers.Gemma2Config(sliding_window=WINDOW, attn_implementation="eager",
                                        **COMMON)
    else:
        raise ValueError(family)
    m = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype or torch.float32).eval()
    m.set_attn_implementation(FASTPACK if impl == "fastpack" else impl)
    return m


def rows(**kw: Any) -> dict[str, Any]:
    return PackedCollator(max_len=16, backend="sdpa", **kw)(samples())


@pytest.mark.parametrize(("family", "impl", "backend"), [
    ("llama", "fastpack", "flash"), ("llama", "sdpa", "sdpa"), ("mistral", "fastpack", "flash"),
    ("mistral", "sdpa", "sdpa"), ("gemma2", "fastpack", "flash"), ("gemma2", "eager", "eager"),
    ("mistral", "sdpa", "padded"),
])
def test_correct_paths_pass(family: str, impl: str, backend: str) -> None:
    m = tiny(family, impl)
    batch = PackedCollator(max_len=16, backend=backend)(samples())
    report = verify_packing(m, batch)
    assert isinstance(report, VerifyReport)
    assert report.samples == tuple(range(len(LENGTHS)))
    assert report.atol == 1e-4 and report.worst < 1e-5 and report.seconds > 0
    assert "6 sample(s) equal alone and packed" in str(report)


def test_tree_batch_passes_with_gradients() -> None:
    m = tiny("mistral", "fastpack")
    tree = [{"input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9], "prompt_id": 0},
            {"input_ids": [1, 2, 3, 4, 5, 6, 10, 11], "prompt_id": 0},
            {"input_ids": [20, 21, 22], "prompt_id": 1}]
    batch = PackedCollator(max_len=32, backend="flash", share_prefix=True)(tree)
    report = verify_packing(m, batch, grads=True)
    assert report.samples == (0, 1, 2)
    assert report.grads_worst is not None and report.grads_worst < 1e-4


@pytest.mark.parametrize("backend", ["flash", "sdpa"])
def test_vision_language_batch_passes(backend: str) -> None:
    m = vlm_models.model("qwen2_vl", torch.float64)
    m.set_attn_implementation(FASTPACK if backend == "flash" else "sdpa")
    try:
        docs = vlm_models.documents("qwen2_vl", torch.float64)
        batch = PackedCollator(max_len=96, backend=backend, model_config=m.config)(docs)
        assert batch["input_ids"].shape[0] == 1 or backend == "sdpa"
        report = verify_packing(m, batch)
        # Each sample ran alone with its own images (another's would not fit its
        # placeholders) and positions of the model's own.
        assert len(report.samples) == 4 and report.worst < 1e-10 and report.atol == 1e-6
    finally:
        m.set_attn_implementation("sdpa")


def test_all_ones_mask_with_sdpa_leaks() -> None:
    m = tiny("llama", "sdpa")
    batch = rows()
    leak = dict(batch, attention_mask=torch.ones_like(batch["input_ids"]))
    with pytest.raises(FastpackError) as err:
        verify_packing(m, leak)
    text = str(err.value)
    assert "model.layers.0.self_attn (LlamaAttention) mixes tokens across sequences" in text
    assert "self_attn.o_proj" in text  # where it was first seen
    # Samples are listed in input order (ids 0, 1, ...); the leak shows in one that is not
    # the first of its row.
    assert re.search(r"sample \d+ differs", text) and "atol 0.0001" in text


def test_positions_not_reset_leak() -> None:
    m = tiny("llama", "sdpa")
    batch = rows()
    width = batch["input_ids"].shape[1]
    leak = dict(batch, position_ids=torch.arange(width).expand_as(batch["input_ids"]).clone())
    with pytest.raises(FastpackError) as err:
        verify_packing(m, leak)
    text = str(err.value)
    assert "passes other positions or ids" in text
    assert "input 'position_ids' of model.rotary_emb (LlamaRotaryEmbedding)" in text


def test_dropped_window_leaks() -> None:
    # An explicit 4-D mask is used as it is by Hugging Face: the window is dropped
    # (check_model_batch refuses it; here it reaches the model).
    m = tiny("mistral", "sdpa")
    batch = rows(mask="explicit")
    with pytest.raises(FastpackError,
                       match=r"model\.layers\.0\.self_attn \(MistralAttention\) mixes tokens"):
        verify_packing(m, batch)
    # The same model and samples with the positions' mask: exact.
    verify_packing(m, rows())


def test_dropped_window_of_another_attention_leaks() -> None:
    # An attention that ignores the window (passed as a keyword, as Mistral does): the
    # alone runs use Hugging Face's own attention, so the dropped window shows.
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def windowless(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                   **kwargs: Any) -> Any:
        kwargs.pop("sliding_window", None)
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True,
                                      **kwargs)

    AttentionInterface.register("test_windowless", windowless)
    m = tiny("mistral", "sdpa")
    m.set_attn_implementation("test_windowless")
    batch = PackedCollator(max_len=16, backend="padded")(samples())
    with pytest.raises(FastpackError,
                       match=r"model\.layers\.0\.self_attn \(MistralAttention\) mixes tokens"):
        verify_packing(m, batch)
    assert m.config._attn_implementation == "test_windowless"  # restored


def test_mamba2_without_boundaries_leaks() -> None:
    cfg = transformers.Mamba2Config(vocab_size=64, hidden_size=16, num_hidden_layers=2,
                                    num_heads=4, head_dim=8, state_size=8, chunk_size=4,
                                    n_groups=1, expand=2)
    torch.manual_seed(0)
    m = transformers.Mamba2ForCausalLM(cfg).eval()
    batch = PackedCollator(max_len=64, backend="flash")(samples())
    # The raw model's call: no sequence boundaries reach the mixer.
    raw = {k: v for k, v in batch.items() if k in ("input_ids", "sample_ids", "sample_tokens",
                                                     "sample_offsets")}
    with pytest.raises(FastpackError,
                       match=r"backbone\.layers\.0\.mixer \(Mamba2Mixer\) mixes tokens across "
                             r"sequences: sample 1 differs"):
        verify_packing(m, raw, samples=[1])


class Cumsum(torch.nn.Module):
    """A token mixer without sequence boundaries (a running mean over the row)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(1, hidden.shape[1] + 1, dtype=hidden.dtype)[:, None]
        return self.inner(hidden) + hidden.cumsum(1) / steps


class LeakyBackward(torch.autograd.Function):
    """The identity forward; a backward that mixes tokens along the row."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad + 0.5 * grad.roll(-1, dims=1)


def test_a_leaking_module_is_named_and_samples_chosen() -> None:
    m = tiny("llama", "fastpack")
    m.model.layers[1].mlp = Cumsum(m.model.layers[1].mlp)
    batch = PackedCollator(max_len=64, backend="flash")(samples())
    with pytest.raises(FastpackError) as err:
        verify_packing(m, batch, samples=2)
    assert str(err.value).startswith(
        "verify_packing: model.layers.1.mlp (Cumsum) mixes tokens across sequences: sample ")
    # The first sample of the row sees no other: it passes alone.
    assert verify_packing(m, batch, samples=[0]).samples == (0,)


def test_gradients_compared() -> None:
    m = tiny("llama", "fastpack")
    batch = PackedCollator(max_len=64, backend="flash")(samples())
    m.model.layers[0].mlp.register_forward_hook(lambda mod, a, out: LeakyBackward.apply(out))
    assert verify_packing(m, batch).grads_worst is None  # the forward is exact
    with pytest.raises(FastpackError) as err:
        verify_packing(m, batch, grads=True)
    text = str(err.value)
    assert "the gradients differ: parameter 'model." in text
    # The backward pass first differs below the hooked module's output.
    assert "first differs at 'model.layers.0.mlp.down_proj.weight'" in text


def test_state_restored_and_bad_arguments() -> None:
    m = tiny("llama", "fastpack")
    m.train()
    m.model.layers[0].mlp.eval()
    marker = torch.full_like(m.lm_head.weight, 7.0)
    m.lm_head.weight.grad = marker
    batch = PackedCollator(max_len=64, backend="flash")(samples())
    report = verify_packing(m, batch, samples=3, grads=True, atol=1e-3)
    assert len(report.samples) == 3 and 0 not in report.samples  # prefers later samples
    assert report.atol == 1e-3
    assert m.training and not m.model.layers[0].mlp.training
    assert m.lm_head.weight.grad is marker
    assert m.config._attn_implementation == FASTPACK
    with pytest.raises(FastpackError, match="samples: 9 is not a sample position"):
        verify_packing(m, batch, samples=[9])
    with pytest.raises(FastpackError, match="samples: an empty list"):
        verify_packing(m, batch, samples=[])
    with pytest.raises(FastpackError, match="samples: expected a count >= 1"):
        verify_packing(m, batch, samples=0)
    with pytest.raises(FastpackError, match="atol: expected a number"):
        verify_packing(m, batch, atol=-1.0)
    with pytest.raises(FastpackTypeError, match="model: expected a torch.nn.Module"):
        verify_packing("model", batch)  # type: ignore[arg-type]
    with pytest.raises(FastpackError, match="batch: no 'sample_ids'"):
        verify_packing(m, {"input_ids": batch["input_ids"]})
    shard = shard_for_context_parallel(
        PackedCollator(max_len=64, backend="flash", cp_size=2)(samples()), 2, 0)
    with pytest.raises(FastpackError, match="context-parallel shard"):
        verify_packing(m, shard)


class Plain(torch.nn.Module):
    """Not a Hugging Face model: ``forward(input_ids)`` only, a causal running mean."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 8)
        self.head = torch.nn.Linear(8, 64)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids)
        steps = torch.arange(1, hidden.shape[1] + 1, dtype=hidden.dtype)[:, None]
        return self.head(hidden.cumsum(1) / steps)


def test_a_plain_module() -> None:
    torch.manual_seed(0)
    m = Plain()
    batch = PackedCollator(max_len=16, backend="padded")(samples())
    assert verify_packing(m, batch, grads=True).worst < 1e-6  # one sample per row
    packed = PackedCollator(max_len=64, backend="flash")(samples())
    with pytest.raises(FastpackError, match=r"verify_packing: the model \(Plain\) mixes tokens"):
        verify_packing(m, packed)


def test_llava_batch_passes() -> None:
    """A plain-position family: each sample alone with its own images (one row each)."""
    torch.manual_seed(0)
    cfg = transformers.LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, image_size=8,
                           patch_size=2),
        text_config=dict(model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1),
        image_token_id=60, image_seq_length=16, vision_feature_select_strategy="default",
        vision_feature_layer=-1)
    cfg._attn_implementation = "sdpa"
    m = transformers.LlavaForConditionalGeneration(cfg).double().eval()
    gen = torch.Generator().manual_seed(1)
    docs = []
    for marker, images, text in ((50, 1, 4), (51, 0, 6), (52, 2, 3)):
        ids = [marker] + [5 + i for i in range(text)] + ([62] + [60] * 16 + [63]) * images
        docs.append({"input_ids": ids} | ({"pixel_values": torch.randn(
            images, 3, 8, 8, generator=gen, dtype=torch.float64)} if images else {}))
    batch = PackedCollator(48, backend="sdpa", model_config=m.config)(docs)
    report = verify_packing(m, batch)
    assert report.samples == (0, 1, 2) and report.worst < 1e-10
    # fastpack's attention on a flash batch: the CLIP tower gets the text row's
    # cu_seq_lens_q too, and attends over its own images, not the row (it raised before).
    m.set_attn_implementation(FASTPACK)
    flat = PackedCollator(64, backend="flash", model_config=m.config)(docs)
    report = verify_packing(m, flat)
    assert report.samples == (0, 1, 2) and report.worst < 1e-10
