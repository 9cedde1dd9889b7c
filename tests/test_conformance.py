"""The attention conformance matrix: every attention implementation × every batch format
PackedCollator makes × tiny random models with and without sliding windows and
soft-capping, and vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: documents with
images and videos, ``PackedCollator(model_config=...)``) × fp32/fp64.

A cell passes when every sequence's logits in the packed batch are within 1e-5 of the same
sequence run alone, unpacked, through the same weights (Hugging Face's eager attention; for
the vision-language models its sdpa, with the model's own ``get_rope_index`` positions),
or when the cell is one that must raise — a ``FastpackError`` from
``check_model_batch`` / fastpack's attention, or Hugging Face's own error — and it does.
A cell that computes a wrong result, or raises where it should compute, fails. The
expected outcome of each cell is :func:`expected` below: the matrix in words is in
docs/integrations.md.

Context-parallel rows: the flash batch sharded for 2 ranks in each mode
(``shard_for_context_parallel``). fastpack's context-parallel attention computes them on a
gloo world of 2 processes (tests/cp_world.py, shared with tests/test_context_parallel.py);
every other implementation must refuse a rank's share of a row, and the context-parallel
attention must refuse every unsharded format.

Hugging Face's ``flex_attention`` runs here with the eager (uncompiled) ``flex_attention``
and block-mask builder: same mask and score mods, same math; the compiled CPU kernels take
minutes per shape.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
import vlm_models  # noqa: E402

import fastpack  # noqa: E402
from fastpack import FastpackError  # noqa: E402
from fastpack.torch import (  # noqa: E402
    PackedCollator,
    check_model_batch,
    register_hf_attention,
    shard_for_context_parallel,
)

FASTPACK = register_hf_attention()
IMPLS = ("fastpack", "sdpa", "eager", "flex_attention")
#: Batch formats, by the PackedCollator options that make them. backend="eager" and
#: "flex" with mask="position_ids" make the very batch backend="sdpa" makes ("rows";
#: test_rows_formats_are_one_format checks it).
#: Tree batches (``share_prefix=True``) are their own rows: test_tree_cell below.
FORMATS: dict[str, dict[str, Any]] = {
    "flash": {"backend": "flash"},
    "rows": {"backend": "sdpa"},
    "sdpa_explicit": {"backend": "sdpa", "mask": "explicit"},
    "eager_explicit": {"backend": "eager", "mask": "explicit"},
    "flex_explicit": {"backend": "flex", "mask": "explicit"},
    "padded": {"backend": "padded"},
}
MODELS = ("llama", "mistral", "qwen2", "gemma2")
#: Vision-language families: mRoPE positions [4, rows, width], media in placeholder order.
VLM_MODELS = vlm_models.FAMILIES
DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
WINDOW = 4
MAX_LEN = 16
#: Longer than the window, and one of length 1.
LENGTHS = (1, 7, 10, 5, 12, 3, 9)
VOCAB = 64
ATOL = 1e-5


def samples() -> list[list[int]]:
    """Every token id distinct (from 1; the collator pads with 0), so each sequence is
    found in any batch by its first token."""
    out, start = [], 1
    for n in LENGTHS:
        out.append(list(range(start, start + n)))
        start += n
    return out


def config(family: str) -> Any:
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  attn_implementation="eager")
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "mistral":
        return transformers.MistralConfig(sliding_window=WINDOW, **common)
    if family == "qwen2":  # layer 0 full attention, layer 1 sliding
        return transformers.Qwen2Config(use_sliding_window=True, sliding_window=WINDOW,
                                        max_window_layers=1, **common)
    # Gemma 2: sliding and full layers, scores soft-capped at a cap the tiny random
    # model's scores reach (its default, 50, would change nothing measurable).
    return transformers.Gemma2Config(sliding_window=WINDOW, attn_logit_softcapping=0.5,
                                     query_pre_attn_scalar=8, **common)


_MODELS: dict[tuple[str, str], Any] = {}
_REFERENCE: dict[tuple[str, str], list[torch.Tensor]] = {}


def model(family: str, dtype: str) -> Any:
    if (family, dtype) not in _MODELS:
        torch.manual_seed(0)
        cls = transformers.AutoModelForCausalLM
        m = cls.from_config(config(family)).to(DTYPES[dtype]).eval()
        _MODELS[family, dtype] = m
        with torch.no_grad():
            _REFERENCE[family, dtype] = [
                m(input_ids=torch.tensor([s])).logits[0] for s in samples()
            ]
    return _MODELS[family, dtype]


def expected(impl: str, fmt: str, family: str) -> str:
    """``"equal"``, or ``"raises"``: a FastpackError or Hugging Face's own error."""
    if family in VLM_MODELS and impl == "flex_attention":
        return "raises"  # Hugging Face refuses flex attention for the Qwen-VL models
    windowed = family not in ("llama", *VLM_MODELS)
    if family == "gemma2" and impl == "sdpa":
        return "raises"  # Hugging Face's SDPA refuses soft-capping
    if fmt == "flex_explicit":
        return "equal" if impl == "flex_attention" and not windowed else "raises"
    if fmt in ("sdpa_explicit", "eager_explicit"):
        if impl == "fastpack":
            return "equal"  # fastpack adds the window to the mask from the positions
        if windowed or impl == "flex_attention":
            return "raises"
        if fmt == "sdpa_explicit" and impl == "eager":
            return "raises"  # eager would add the bool mask as 0/1
    return "equal"


def set_impl(m: Any, impl: str) -> None:
    m.set_attn_implementation(FASTPACK if impl == "fastpack" else impl)


@pytest.fixture(scope="module", autouse=True)
def eager_flex() -> Iterator[None]:
    import transformers.integrations.flex_attention as hf_flex
    import transformers.masking_utils as masking
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def flex(query: Any, key: Any, value: Any, training: bool = False, **kwargs: Any) -> Any:
        return flex_attention(query, key, value, **kwargs)

    def block_mask(*args: Any, _compile: bool = False, **kwargs: Any) -> Any:
        return create_block_mask(*args, _compile=False, **kwargs)

    saved = hf_flex.compile_friendly_flex_attention, masking.create_block_mask
    hf_flex.compile_friendly_flex_attention = flex
    masking.create_block_mask = block_mask
    # Tiny matrices: one thread is several times faster than two on busy CI cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.set_num_threads(threads)
        hf_flex.compile_friendly_flex_attention, masking.create_block_mask = saved


def batch_for(fmt: str, dtype: str) -> dict[str, Any]:
    options = dict(FORMATS[fmt])
    if fmt == "eager_explicit":
        options["mask_dtype"] = DTYPES[dtype]
    collator = PackedCollator(max_len=MAX_LEN, **options)
    batch = collator([{"input_ids": s} for s in samples()])
    batch.pop("labels")
    return batch


_VLM_REFERENCE: dict[tuple[str, str], list[torch.Tensor]] = {}


def run_vlm_cell(impl: str, fmt: str, family: str, dtype: str) -> list[torch.Tensor]:
    m = vlm_models.model(family, DTYPES[dtype])
    docs = vlm_models.documents(family, DTYPES[dtype])
    if (family, dtype) not in _VLM_REFERENCE:
        with torch.no_grad():
            _VLM_REFERENCE[family, dtype] = [vlm_models.alone(m, d).logits[0] for d in docs]
    options = dict(FORMATS[fmt])
    if fmt == "eager_explicit":
        options["mask_dtype"] = DTYPES[dtype]
    batch = PackedCollator(max_len=40, model_config=m.config, **options)(docs)
    set_impl(m, impl)
    try:
        check_model_batch(m, batch)
        with torch.no_grad():
            logits = m(**vlm_models.model_inputs(batch)).logits
    finally:
        m.set_attn_implementation("sdpa")
    return vlm_models.per_document(batch, logits, docs)


def run_cell(impl: str, fmt: str, family: str, dtype: str) -> list[torch.Tensor]:
    if family in VLM_MODELS:
        return run_vlm_cell(impl, fmt, family, dtype)
    m = model(family, dtype)
    set_impl(m, impl)
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


#: Hugging Face's own defect, not a packed format's: its eager attention (Mistral, Gemma 2)
#: takes the softmax of fp64 scores in fp32, so a padding query whose window holds only
#: padding (finfo(float64).min everywhere, -inf in fp32) becomes NaN, and the NaN reaches
#: the real tokens through the next layer's values. Strict: it fails once fixed upstream.
HF_DEFECTS = {("eager", "padded", "mistral", "fp64"), ("eager", "padded", "gemma2", "fp64")}


def _cell(impl: str, fmt: str, family: str, dtype: str) -> Any:
    marks = []
    if (impl, fmt, family, dtype) in HF_DEFECTS:
        marks.append(pytest.mark.xfail(strict=True, reason="Hugging Face eager: fp64 "
                                       "fully-masked padding rows softmaxed in fp32 give NaN"))
    return pytest.param(impl, fmt, family, dtype, id=f"{impl}-{fmt}-{family}-{dtype}",
                        marks=marks)


CELLS = [_cell(impl, fmt, family, dtype)
         for impl in IMPLS for fmt in FORMATS for family in (*MODELS, *VLM_MODELS)
         for dtype in DTYPES]


@pytest.mark.parametrize(("impl", "fmt", "family", "dtype"), CELLS)
def test_cell(impl: str, fmt: str, family: str, dtype: str) -> None:
    if expected(impl, fmt, family) == "raises":
        with pytest.raises(ValueError):  # FastpackError, or Hugging Face's ValueError
            run_cell(impl, fmt, family, dtype)
        return
    got = run_cell(impl, fmt, family, dtype)
    reference = (_VLM_REFERENCE if family in VLM_MODELS else _REFERENCE)[family, dtype]
    assert len(got) == len(reference)
    for k, (packed, alone) in enumerate(zip(got, reference)):
        diff = (packed - alone).abs().max().item()
        assert diff <= ATOL, f"sequence {k} of {len(packed)} tokens: |Δlogit| {diff:.3g}"


def test_fastpack_raises_are_fastpack_errors() -> None:
    """Where fastpack refuses, it says so with its own error, before computing."""
    with pytest.raises(FastpackError, match="BlockMask"):
        run_cell("fastpack", "flex_explicit", "llama", "fp32")
    with pytest.raises(FastpackError, match="sliding_window=4"):
        run_cell("sdpa", "sdpa_explicit", "mistral", "fp32")
    with pytest.raises(FastpackError, match="bool"):
        run_cell("eager", "sdpa_explicit", "llama", "fp32")


def test_rows_formats_are_one_format() -> None:
    batches = [PackedCollator(max_len=MAX_LEN, backend=b)([{"input_ids": s} for s in samples()])
               for b in ("sdpa", "eager", "flex")]
    for other in batches[1:]:
        assert other.keys() == batches[0].keys()
        for key, value in batches[0].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other[key])
            else:
                assert value == other[key]


def test_windows_and_softcap_bite() -> None:
    """The matrix means something only if the window and the cap change the logits."""
    model("mistral", "fp32")
    longest = max(range(len(LENGTHS)), key=lambda i: LENGTHS[i])
    for family in ("mistral", "gemma2"):
        m = model(family, "fp32")
        cfg = m.config
        saved = cfg.sliding_window, getattr(cfg, "attn_logit_softcapping", None)
        cfg.sliding_window = 10_000
        if family == "gemma2":
            cfg.attn_logit_softcapping = None
        for layer in m.model.layers:
            attn = layer.self_attn
            if getattr(attn, "sliding_window", None) is not None:
                attn.sliding_window = 10_000
            if hasattr(attn, "attn_logit_softcapping"):
                attn.attn_logit_softcapping = cfg.attn_logit_softcapping
        try:
            with torch.no_grad():
                full = m(input_ids=torch.tensor([samples()[longest]])).logits[0]
        finally:
            cfg.sliding_window = saved[0]
            for layer in m.model.layers:
                attn = layer.self_attn
                if getattr(attn, "sliding_window", None) is not None:
                    attn.sliding_window = saved[0]
                if hasattr(attn, "attn_logit_softcapping"):
                    attn.attn_logit_softcapping = saved[1]
            if family == "gemma2":
                cfg.attn_logit_softcapping = saved[1]
        assert (full - _REFERENCE[family, "fp32"][longest]).abs().max().item() > 1e-3


# ------------------------------------------------------- context-parallel rows

CP_FORMATS = tuple(f"cp_{mode}" for mode in fastpack.CP_MODES)
#: fastpack's context-parallel attention, registered here over a group of one process (it
#: refuses before any collective; the equal cells run in the gloo world).
FASTPACK_CP = register_hf_attention(
    "fastpack_cp_conformance", context_parallel_group=torch.distributed.ProcessGroup(
        torch.distributed.HashStore(), 0, 1), mode="zigzag")


def cp_batch(fmt: str) -> dict[str, Any]:
    flash = PackedCollator(max_len=MAX_LEN, backend="flash")([{"input_ids": s} for s in samples()])
    local = shard_for_context_parallel(flash, 2, 0, fmt[3:])
    local.pop("labels")
    local.pop("shift_labels")
    return local


CP_CELLS = [pytest.param(impl, fmt, family, dtype, id=f"{impl}-{fmt}-{family}-{dtype}")
            for impl in ("fastpack_cp", *IMPLS) for fmt in CP_FORMATS for family in MODELS
            for dtype in DTYPES]


@pytest.mark.parametrize(("impl", "fmt", "family", "dtype"), CP_CELLS)
def test_context_parallel_cell(impl: str, fmt: str, family: str, dtype: str) -> None:
    """A rank's share of the row: fastpack's context-parallel attention gives every token
    the logits of its sequence alone (the ranks' logits assembled); every other
    implementation refuses the batch before computing (it would attend within one rank's
    tokens), in check_model_batch and in the forward."""
    if impl != "fastpack_cp":
        m = model(family, dtype)
        if expected(impl, "flash", family) == "raises":  # Hugging Face refuses the model
            with pytest.raises(ValueError):
                set_impl(m, impl)
            return
        set_impl(m, impl)
        try:
            batch = cp_batch(fmt)
            with pytest.raises(FastpackError, match="context-parallel batch"):
                check_model_batch(m, batch)
            # And the forward itself refuses it, before the first layer: the shard's
            # attention_mask (a ShardMask) raises when the model's mask code reads it.
            with pytest.raises(FastpackError, match=r"^attention_mask: this batch is one "
                                                    r"rank's share of a context-parallel row"), \
                    torch.no_grad():
                m(**batch)
        finally:
            m.set_attn_implementation("eager")
        return
    import cp_world

    model(family, dtype)  # the references
    mode = fmt[3:]
    pieces = [r["models"][f"logits-{mode}-{family}-{dtype}"] for r in cp_world.world(2)]
    flat_ids = cp_world.model_batch()["input_ids"][0]
    like = torch.zeros(len(flat_ids), pieces[0]["logits"].shape[-1],
                       dtype=pieces[0]["logits"].dtype)
    logits, _ = cp_world.assemble(pieces, "logits", like)
    flat = flat_ids.tolist()
    for s, alone in zip(samples(), _REFERENCE[family, dtype]):
        start = flat.index(s[0])
        diff = (logits[start : start + len(s)] - alone).abs().max().item()
        assert diff <= ATOL, f"sequence of length {len(s)}: |Δlogit| {diff:.3g}"


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_context_parallel_attention_refuses_unsharded_formats(fmt: str) -> None:
    m = model("llama", "fp32")
    m.set_attn_implementation(FASTPACK_CP)
    try:
        batch = batch_for(fmt, "fp32")
        with pytest.raises(FastpackError, match="not sharded for context parallelism"):
            check_model_batch(m, batch)
        if fmt in ("flash", "rows"):  # no mask of their own: the attention itself refuses
            with pytest.raises(FastpackError, match="not sharded for context parallelism"), \
                    torch.no_grad():
                m(**batch)
    finally:
        m.set_attn_implementation("eager")


# ----------------------------------------------------------------------- tree batches

#: Rollouts of one prompt (a group) and a branching chat (a trie): a tree batch
#: (share_prefix=True) shares their prefixes. Paths are longer than WINDOW, so the window
#: bites inside them.
TREE_SAMPLES = [
    {"input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9], "prompt_id": 0},
    {"input_ids": [1, 2, 3, 4, 5, 6, 10, 11], "prompt_id": 0},
    {"input_ids": [1, 2, 3, 4, 5, 6, 12, 13, 14, 15, 16], "prompt_id": 0},
    {"input_ids": [20, 21, 22], "prompt_id": 1},
]
TREE_CHATS = [[30, 31, 32, 33, 34], [30, 31, 32, 33, 34, 35, 36, 37], [30, 31, 32, 38, 39]]
_TREE_REFERENCE: dict[tuple[str, str], list[torch.Tensor]] = {}


def tree_batches() -> list[tuple[list[list[int]], dict[str, Any]]]:
    out = []
    for samples in (TREE_SAMPLES, [{"input_ids": c} for c in TREE_CHATS]):
        batch = PackedCollator(max_len=MAX_LEN, backend="flash", share_prefix=True)(samples)
        out.append(([s["input_ids"] for s in samples], batch))
    return out


def expected_tree(impl: str, family: str) -> str:
    if impl == "fastpack":
        return "equal"  # windows and soft-capping honoured, per segment over its path
    if impl == "flex_attention" and family == "llama":
        return "equal"  # the batch's BlockMask is the tree; no window to drop
    return "raises"


TREE_CELLS = [pytest.param(impl, family, dtype, id=f"{impl}-tree-{family}-{dtype}")
              for impl in IMPLS for family in MODELS for dtype in DTYPES]


@pytest.mark.parametrize(("impl", "family", "dtype"), TREE_CELLS)
def test_tree_cell(impl: str, family: str, dtype: str) -> None:
    from fastpack.torch import per_sample

    m = model(family, dtype)
    if (family, dtype) not in _TREE_REFERENCE:
        with torch.no_grad():
            _TREE_REFERENCE[family, dtype] = [
                m(input_ids=torch.tensor([s])).logits[0]
                for rows, _ in tree_batches() for s in rows
            ]
    got: list[torch.Tensor] = []
    try:
        for _, batch in tree_batches():
            if expected_tree(impl, family) == "raises":
                # A FastpackError from check_model_batch, or Hugging Face's own refusal.
                with pytest.raises(ValueError):
                    set_impl(m, impl)
                    check_model_batch(m, batch)
                continue
            set_impl(m, impl)
            check_model_batch(m, batch)
            with torch.no_grad():
                got += per_sample(m(**batch).logits, batch)
    finally:
        m.set_attn_implementation("eager")
    if expected_tree(impl, family) == "raises":
        return
    assert len(got) == len(_TREE_REFERENCE[family, dtype])
    for packed, alone in zip(got, _TREE_REFERENCE[family, dtype]):
        diff = (packed - alone).abs().max().item()
        assert diff <= ATOL, f"|Δlogit| {diff:.3g}"
