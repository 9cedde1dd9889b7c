"""The conformance matrix of the hybrid families: models whose layers mix tokens beyond
softmax attention (Mamba / Mamba2 state-space mixers, gated delta nets, short causal
convolutions) and a model whose sliding window lives only in its mask (Qwen2-MoE).

Every family × every batch format PackedCollator makes (plus tree and context-parallel
batches) × fastpack / sdpa / eager attention × fp32 / fp64, on a tiny random model
prepared with :func:`fastpack.torch.prepare_model`: each cell's packed logits equal every
sequence run alone (eager, unpacked) within the dtype's tolerance, or the cell raises
before the forward — a ``FastpackError`` from ``check_model_batch`` / the forward, or
Hugging Face's own error. :func:`expected` is the matrix in words (docs/hybrid_models.md).
One test per family and dtype runs its cells (the model and its references built once).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from fastpack import FastpackError  # noqa: E402
from fastpack.torch import (  # noqa: E402
    PackedCollator,
    check_model_batch,
    prepare_model,
    register_hf_attention,
    shard_for_context_parallel,
)

FASTPACK = register_hf_attention()
IMPLS = ("fastpack", "sdpa", "eager")
FORMATS: dict[str, dict[str, Any]] = {
    "flash": {"backend": "flash"},
    "rows": {"backend": "sdpa"},
    "sdpa_explicit": {"backend": "sdpa", "mask": "explicit"},
    "eager_explicit": {"backend": "eager", "mask": "explicit"},
    "flex_explicit": {"backend": "flex", "mask": "explicit"},
    "padded": {"backend": "padded"},
    "tree": {"backend": "flash", "share_prefix": True},
    "cp": {"backend": "flash"},
}
FAMILIES = ("qwen3_next", "bamba", "mamba2", "lfm2", "falcon_h1", "granitemoehybrid",
            "qwen2_moe", "gpt_oss")
DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
#: The Mamba2 scans compute in fp32 inside an fp64 model (A = -exp(A_log.float())), so
#: fp64 holds them to fp32's rounding.
ATOL = {"fp32": 2e-5, "fp64": 1e-6}
WINDOW = 4
MAX_LEN = 24
LENGTHS = (1, 9, 14, 6, 11, 3, 17)
VOCAB = 96


def samples() -> list[list[int]]:
    """Distinct token ids (from 1; the collator pads with 0), so each sequence is found in
    any batch by its first token."""
    out, start = [], 1
    for n in LENGTHS:
        out.append(list(range(start, start + n)))
        start += n
    return out


def config(family: str) -> Any:
    attn = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
    mamba = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8)
    if family == "qwen3_next":
        return transformers.Qwen3NextConfig(
            head_dim=8, linear_num_value_heads=2, linear_num_key_heads=2,
            linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
            layer_types=["linear_attention", "full_attention"], **attn)
    if family == "bamba":
        return transformers.BambaConfig(mamba_expand=2, attn_layer_indices=[1], **mamba,
                                        **attn)
    if family == "mamba2":
        return transformers.Mamba2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                         num_heads=4, head_dim=16, state_size=8, chunk_size=8,
                                         n_groups=1, expand=2)
    if family == "lfm2":
        return transformers.Lfm2Config(layer_types=["conv", "full_attention"], **attn)
    if family == "falcon_h1":
        return transformers.FalconH1Config(head_dim=8, mamba_d_ssm=64, **mamba, **attn)
    if family == "granitemoehybrid":
        return transformers.GraniteMoeHybridConfig(
            num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=16,
            layer_types=["mamba", "attention"], **mamba, **attn)
    if family == "gpt_oss":  # attention sinks (s_aux), sliding and full layers
        return transformers.GptOssConfig(
            head_dim=8, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"], **attn)
    # Qwen2-MoE: its window is in the layer and its mask only (no sliding_window keyword).
    return transformers.Qwen2MoeConfig(
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2, head_dim=8,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, **attn)


def expected(impl: str, fmt: str, family: str) -> str:
    """``"equal"``, ``"raises"`` (a FastpackError or Hugging Face's own error), or
    ``"skip"`` (covered elsewhere)."""
    mixers = family != "qwen2_moe"
    if fmt == "cp":
        return "raises"  # a rank's share of a row: only a context-parallel attention
    if fmt == "tree":
        # A recurrent state runs along the row, not a path (tree batches of attention-only
        # models: test_conformance.py's tree cells).
        return "raises" if mixers else "skip"
    if fmt == "flex_explicit":
        return "raises"  # a BlockMask: flex_attention only, and these are not under test
    if family in ("mamba2", "gpt_oss") and impl == "sdpa":
        return "raises"  # Hugging Face has no sdpa for them (no attention layer / sinks)
    if family == "gpt_oss" and impl == "eager" and fmt != "padded":
        return "raises"  # sinks on packed rows: fastpack's attention honours them
    if family == "granitemoehybrid" and impl != "fastpack" and fmt in ("flash", "rows"):
        # Its model builds the mask without position_ids: Hugging Face's attention would
        # see the whole row (refused); fastpack's reads the prepared model's boundaries.
        return "raises"
    if family == "qwen2_moe" and (impl, fmt) == ("eager", "padded"):
        # Hugging Face's own fp64 eager defect on windowed padding rows (NaN): the
        # HF_DEFECTS of test_conformance.py.
        return "skip"
    if fmt in ("sdpa_explicit", "eager_explicit"):
        if impl == "fastpack":
            return "equal"  # the window added from the positions
        if family == "qwen2_moe" or (fmt == "sdpa_explicit" and impl == "eager"):
            return "raises"  # the window would be dropped / a bool mask added as 0/1
    return "equal"


_MODELS: dict[tuple[str, str], Any] = {}
_REFERENCE: dict[tuple[str, str], list[torch.Tensor]] = {}


def model(family: str, dtype: str) -> Any:
    if (family, dtype) not in _MODELS:
        torch.manual_seed(0)
        m = transformers.AutoModelForCausalLM.from_config(config(family))
        m = m.to(DTYPES[dtype]).eval()
        if dtype == "fp64" and hasattr(m, "set_experts_implementation") and any(
                "Experts" in type(x).__name__ for x in m.modules()):
            m.set_experts_implementation("eager")  # grouped_mm has no fp64
        prepare_model(m)
        with torch.no_grad():
            _REFERENCE[family, dtype] = [m(input_ids=torch.tensor([s])).logits[0]
                                         for s in samples()]
        _MODELS[family, dtype] = m
    return _MODELS[family, dtype]


def batch_for(fmt: str, dtype: str) -> dict[str, Any]:
    options = dict(FORMATS[fmt])
    if fmt == "eager_explicit":
        options["mask_dtype"] = DTYPES[dtype]
    batch = PackedCollator(max_len=MAX_LEN, **options)([{"input_ids": s} for s in samples()])
    if fmt == "cp":
        batch = shard_for_context_parallel(batch, 2, 0, "zigzag")
        batch.pop("shift_labels")
    batch.pop("labels", None)
    return batch


def run_cell(impl: str, fmt: str, family: str, dtype: str) -> list[torch.Tensor]:
    m = model(family, dtype)
    m.set_attn_implementation(FASTPACK if impl == "fastpack" else impl)
    try:
        batch = batch_for(fmt, dtype)
        check_model_batch(m, batch)
        with torch.no_grad():
            logits = m(**batch).logits
    finally:
        m.set_attn_implementation("eager")
    flat_ids = batch["input_ids"].reshape(-1).tolist()
    flat = logits.reshape(-1, logits.shape[-1])
    out = []
    for s in samples():
        start = flat_ids.index(s[0])
        assert flat_ids[start:start + len(s)] == s
        out.append(flat[start:start + len(s)])
    return out


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("family", FAMILIES)
def test_family(family: str, dtype: str) -> None:
    """Every cell of one family and dtype: equal to each sequence alone, or refused."""
    failures = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is faster on busy CI cores
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(family, dtype)
            for impl in IMPLS:
                for fmt in FORMATS:
                    cell = f"{impl}-{fmt}"
                    want = expected(impl, fmt, family)
                    if want == "skip":
                        continue
                    try:
                        got = run_cell(impl, fmt, family, dtype)
                    except ValueError as error:  # FastpackError, or Hugging Face's
                        if want != "raises":
                            failures.append(f"{cell}: raised {type(error).__name__}: "
                                            f"{str(error)[:200]}")
                        continue
                    if want == "raises":
                        failures.append(f"{cell}: computed, expected a refusal")
                        continue
                    worst = max((p - r).abs().max().item()
                                for p, r in zip(got, _REFERENCE[family, dtype], strict=True))
                    if not worst <= ATOL[dtype]:
                        failures.append(f"{cell}: |Δlogit| {worst:.3g}")
    finally:
        torch.set_num_threads(threads)
    assert not failures, f"{family} {dtype}:\n" + "\n".join(failures)


@pytest.mark.parametrize("family", ["bamba", "lfm2", "qwen3_next"])
def test_unprepared_model_is_refused_by_name(family: str) -> None:
    """Without prepare_model a packed batch is refused, naming the mixer; a padded one is
    accepted (a sequence per row: the mixers see no other sequence)."""
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(config(family)).eval()
    m.set_attn_implementation(FASTPACK)
    batch = batch_for("flash", "fp32")
    with pytest.raises(FastpackError, match=r"model\.layers\.0\.\w+ \(\w+\) mixes tokens "
                                            r"across sequences: call fastpack\.torch"):
        check_model_batch(m, batch)
    check_model_batch(m, batch_for("padded", "fp32"))


def test_unprepared_mixer_leaks() -> None:
    """What the refusal prevents: an unprepared Bamba's packed logits differ from each
    sequence alone; prepared, they are equal."""
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(config("bamba")).eval()
    m.set_attn_implementation(FASTPACK)
    batch = batch_for("flash", "fp32")
    seq = samples()[2]
    start = batch["input_ids"][0].tolist().index(seq[0])
    with torch.no_grad():
        alone = m(input_ids=torch.tensor([seq])).logits[0]
        leaky = m(**batch).logits[0, start:start + len(seq)]
        prepare_model(m)
        exact = m(**batch).logits[0, start:start + len(seq)]
    assert (leaky - alone).abs().max().item() > 1e-3
    assert (exact - alone).abs().max().item() <= 2e-5


class _UnknownMixer(torch.nn.Module):
    """A token mixer fastpack has never seen: a causal convolution over the sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(8, 8, kernel_size=3, groups=8, padding=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)


def test_unknown_mixer_is_refused_by_what_it_reads() -> None:
    """A module that convolves along the sequence, or carries a recurrent state, is
    refused by name even though its class is unknown: never silently accepted."""
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(config("qwen2_moe")).eval()
    m.set_attn_implementation(FASTPACK)
    batch = batch_for("flash", "fp32")
    check_model_batch(m, batch)
    m.model.layers[1].mixer = _UnknownMixer()
    with pytest.raises(FastpackError, match=r"model\.layers\.1\.mixer \(_UnknownMixer\) mixes "
                                            r"tokens across sequences: not supported because "
                                            r"it convolves over the sequence"):
        check_model_batch(m, batch)
    m.model.layers[1].mixer = torch.nn.Module()
    m.model.layers[1].mixer.register_parameter("A_log", torch.nn.Parameter(torch.zeros(2)))
    with pytest.raises(FastpackError, match=r"recurrent state .* \(parameter A_log\)"):
        check_model_batch(m, batch)


def test_loop_and_batched_strategies_agree() -> None:
    """The reference (each sequence alone through the mixer) and the batched path give the
    same logits on a packed row."""
    got = {}
    for strategy in ("loop", "batched"):
        torch.manual_seed(0)
        m = transformers.AutoModelForCausalLM.from_config(config("lfm2")).double().eval()
        m.set_attn_implementation(FASTPACK)
        prepare_model(m, strategy=strategy)
        with torch.no_grad():
            got[strategy] = m(**batch_for("rows", "fp64")).logits
    assert (got["loop"] - got["batched"]).abs().max().item() <= 1e-12


def test_moe_aux_loss_packed_equals_unpacked() -> None:
    """Hugging Face's router loss is per token over the batch's real tokens: a packed
    batch without padding (backend="flash") gives the padded batch's value."""
    torch.manual_seed(0)
    cfg = config("qwen3_next")
    cfg.output_router_logits = True
    cfg.router_aux_loss_coef = 0.1
    m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    m.set_attn_implementation(FASTPACK)
    prepare_model(m)
    packed = PackedCollator(max_len=MAX_LEN, backend="flash")([{"input_ids": s}
                                                               for s in samples()])
    padded = PackedCollator(max_len=MAX_LEN, backend="padded")([{"input_ids": s}
                                                                for s in samples()])
    with torch.no_grad():
        a = m(**{k: v for k, v in packed.items() if k != "labels"}).aux_loss
        b = m(**{k: v for k, v in padded.items() if k != "labels"}).aux_loss
    assert abs(a.item() - b.item()) <= 1e-6 * max(1.0, abs(b.item()))


def test_moe_aux_loss_over_padded_rows_is_refused() -> None:
    """Rows padded to the longest carry no attention_mask, so Hugging Face's router loss
    would average over their padding: check_model_batch refuses them, names the fix, and
    the padding really changes the loss."""
    torch.manual_seed(0)
    cfg = config("qwen3_next")
    cfg.output_router_logits = True
    cfg.router_aux_loss_coef = 0.1
    m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    m.set_attn_implementation(FASTPACK)
    prepare_model(m)
    lengths = (9, 14, 6, 20)
    rows = PackedCollator(max_len=24, backend="sdpa")(
        [{"input_ids": list(range(1, n + 1))} for n in lengths])
    assert rows["sample_tokens"].numel() < rows["input_ids"].numel()
    with pytest.raises(FastpackError, match=r"padding token.*router's auxiliary loss.*"
                                            r"backend='flash'"):
        check_model_batch(m, rows)
    flat = PackedCollator(max_len=64, backend="flash")(
        [{"input_ids": list(range(1, n + 1))} for n in lengths])
    check_model_batch(m, flat)
    padded = PackedCollator(max_len=24, backend="padded")(
        [{"input_ids": list(range(1, n + 1))} for n in lengths])
    with torch.no_grad():
        a = m(**{k: v for k, v in rows.items() if k != "labels"}).aux_loss
        b = m(**{k: v for k, v in padded.items() if k != "labels"}).aux_loss
    assert abs(a.item() - b.item()) > 1e-6


def test_gpu_check_hybrid_section_on_cpu() -> None:
    """benches/gpu_check.py's hybrid section runs (tiny, fp32 on the CPU) and passes."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benches" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    cfg = gpu_check.make_config(cpu_smoke=True)
    cfg["iters"], cfg["warmup"] = 1, 0
    cfg["hybrid"]["families"] = ["lfm2", "bamba"]  # Qwen3-Next: the matrix above
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = gpu_check.check_hybrid(torch, cfg, torch.device("cpu"), torch.float32)
    assert [r["family"] for r in report["rows"]] == ["lfm2", "bamba"]
    assert all(r["ok"] for r in report["rows"]), report["rows"]


#: Architectures that packed rows would silently break, and the words of their refusal.
REFUSED = {
    "bloom": (transformers.BloomConfig, dict(n_layer=1, n_head=2), r"ALiBi"),
    "roberta": (transformers.RobertaConfig, dict(num_hidden_layers=1, num_attention_heads=2,
                                                 intermediate_size=32, is_decoder=True),
                r"embeddings \(RobertaEmbeddings\) numbers positions from the padding index"),
    "bart": (transformers.BartConfig, dict(decoder_layers=1, encoder_layers=1,
                                           decoder_attention_heads=2, encoder_attention_heads=2,
                                           decoder_ffn_dim=32, encoder_ffn_dim=32),
             r"takes no position_ids"),
    "minimax": (transformers.MiniMaxConfig,
                dict(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                     head_dim=16, intermediate_size=32, num_local_experts=2,
                     layer_types=["linear_attention", "full_attention"]),
                r"model\.layers\.0\.self_attn \(MiniMaxLightningAttention\) mixes tokens "
                r"across sequences: not supported because its class is a token mixer"),
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_architectures_packing_would_break_are_refused(kind: str) -> None:
    """Models whose packed rows differ silently (ALiBi, positions from the row or the
    padding index, an unknown linear attention) are refused before the forward, by name."""
    cls, options, words = REFUSED[kind]
    cfg = cls(vocab_size=VOCAB, hidden_size=32, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(FastpackError, match=words):
        check_model_batch(m, batch_for("rows", "fp32"))


@pytest.mark.parametrize("family", ["granitemoehybrid"])  # a Mamba2 mixer + attention
def test_gradients_with_gradient_checkpointing(family: str) -> None:
    """Training: the packed batch's gradients equal the padded batch's, also when the
    layers are recomputed in the backward (gradient checkpointing: the mixers and
    Granite's attention recompute on the forward's boundaries)."""
    samples_ = [{"input_ids": s} for s in samples()]
    packed = PackedCollator(max_len=MAX_LEN, backend="flash")(samples_)
    padded = PackedCollator(max_len=MAX_LEN, backend="padded")(samples_)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(config(family)).double().train()
    if any("Experts" in type(x).__name__ for x in m.modules()):
        m.set_experts_implementation("eager")
    prepare_model(m)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    grads = []
    for impl, batch in ((FASTPACK, packed), ("eager", padded)):
        m.set_attn_implementation(impl)
        m.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m(**{k: v for k, v in batch.items() if not k.startswith("sample_")}).loss.backward()
        grads.append({k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None})
    worst = max((grads[0][k] - g).abs().max().item() for k, g in grads[1].items())
    # the loss is taken in fp32 (Hugging Face upcasts the logits), the Mamba scans too
    assert worst <= 1e-6, worst
