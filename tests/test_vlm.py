"""Vision-language packing, proven on tiny random models on the CPU.

- ``fastpack.vlm.rope_index`` equals each family's own ``get_rope_index`` on random
  documents (images and videos of random grids, first, last, several, none), one at a
  time and many at once; ``media_tokens`` equals the processors' resize rule.
- A packed batch from ``PackedCollator(model_config=...)`` gives every document the logits
  it gets alone (fp64 within 1e-10 with sdpa and fastpack's attention; eager within 1e-6,
  as Hugging Face's eager attention takes its softmax in float32 whatever the dtype; fp32
  within 1e-5), and one packed step's gradients equal the sum over the documents.
- What the collator prevents, measured: 1-D positions, 3-row positions and the temporal
  row as row 0 give wrong logits (or raise in fastpack's attention).
- LLaVA through the same collator, and a Hugging Face ``Trainer`` on packed batches.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from vlm_models import (  # noqa: E402
    END,
    FAMILIES,
    IMAGE,
    START,
    VIDEO,
    alone,
    document,
    documents,
    find,
    model,
    model_inputs,
    per_document,
    type_ids,
)

import fastpack  # noqa: E402
import fastpack.vlm as vlm  # noqa: E402
from fastpack import FastpackError  # noqa: E402
from fastpack.torch import PackedCollator, register_hf_attention  # noqa: E402

FASTPACK = register_hf_attention()
DTYPES = {"fp64": torch.float64, "fp32": torch.float32}


@pytest.fixture(scope="module", autouse=True)
def quiet() -> Iterator[None]:
    transformers.logging.set_verbosity_error()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread beats two busy ones
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------ positions
@st.composite
def random_document(draw: Any, family: str) -> dict[str, Any]:
    """Token ids with media runs anywhere (first, last, adjacent media apart by one text
    token), their grids and, for Qwen2.5-VL, seconds per grid in one of three dtypes."""
    media = draw(st.integers(0, 4))
    ids: list[int] = []
    images: list[list[int]] = []
    videos: list[list[int]] = []
    for k in range(media + 1):
        ids += [1 + (j % 40) for j in range(draw(st.integers(0 if k in (0, media) else 1, 4)))]
        if k == media:
            break
        kind = draw(st.sampled_from(["image", "video"]))
        t = 1 if kind == "image" else draw(st.integers(1, 4))
        h, w = 2 * draw(st.integers(1, 4)), 2 * draw(st.integers(1, 4))
        token = IMAGE if kind == "image" else VIDEO
        if kind == "video" and family == "qwen3_vl":
            for f in range(t):  # one run per frame, a timestamp between frames
                ids += ([7] if f else []) + [token] * (h * w // 4)
        else:
            ids += [token] * (t * h * w // 4)
        (images if kind == "image" else videos).append([t, h, w])
    if not ids:
        ids = [3]
    sample: dict[str, Any] = {"input_ids": ids,
                              "image_grid_thw": torch.tensor(images) if images else None,
                              "video_grid_thw": torch.tensor(videos) if videos else None}
    if family == "qwen2_5_vl" and videos:
        seconds = draw(st.lists(st.floats(0.01, 5.0), min_size=len(videos),
                                max_size=len(videos)))
        form = draw(st.sampled_from(["float32", "float64", "list"]))
        sample["second_per_grid_ts"] = (seconds if form == "list" else torch.tensor(
            seconds, dtype=getattr(torch, form)))
    return sample


def hf_positions(family: str, sample: dict[str, Any]) -> np.ndarray:
    m = model(family)
    kwargs = {}
    if "second_per_grid_ts" in sample:
        kwargs["second_per_grid_ts"] = sample["second_per_grid_ts"]
    pos, _ = m.model.get_rope_index(
        torch.tensor([sample["input_ids"]]), type_ids(sample["input_ids"]),
        image_grid_thw=sample["image_grid_thw"], video_grid_thw=sample["video_grid_thw"],
        **kwargs,
    )
    return pos[:, 0].numpy()  # type: ignore[no-any-return]


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_rope_index_equals_the_models_get_rope_index(family: str, data: Any) -> None:
    sample = data.draw(random_document(family))
    got = vlm.rope_index(
        model(family).config, sample["input_ids"], image_grid_thw=sample["image_grid_thw"],
        video_grid_thw=sample["video_grid_thw"],
        second_per_grid_ts=sample.get("second_per_grid_ts"),
    )
    assert got.dtype == np.int64 and got.shape == (3, len(sample["input_ids"]))
    np.testing.assert_array_equal(got, hf_positions(family, sample))


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_many_documents_at_once_equal_each_alone(family: str, data: Any) -> None:
    docs = data.draw(st.lists(random_document(family), min_size=1, max_size=5))
    cfg = model(family).config
    ids = np.concatenate([d["input_ids"] for d in docs])
    cu = np.concatenate(([0], np.cumsum([len(d["input_ids"]) for d in docs])))

    def cat(key: str) -> Any:
        parts = [torch.as_tensor(d[key]) for d in docs if d.get(key) is not None]
        return torch.cat(parts) if parts else None

    seconds = cat("second_per_grid_ts")
    if seconds is not None:
        seconds = seconds.to(torch.float32)
    together = vlm.position_ids(
        cfg, ids, cu, image_grid_thw=cat("image_grid_thw"),
        video_grid_thw=cat("video_grid_thw"), second_per_grid_ts=seconds, threads=2,
    )
    for d, lo, hi in zip(docs, cu[:-1], cu[1:]):
        s = d.get("second_per_grid_ts")
        one = vlm.rope_index(cfg, d["input_ids"], image_grid_thw=d["image_grid_thw"],
                             video_grid_thw=d["video_grid_thw"],
                             second_per_grid_ts=None if s is None else torch.as_tensor(
                                 s, dtype=torch.float32))
        np.testing.assert_array_equal(together[1:, lo:hi], one)
        np.testing.assert_array_equal(together[0, lo:hi], np.arange(hi - lo))


def test_a_videos_temporal_step_is_multiplied_as_the_model_multiplies_it() -> None:
    """Qwen2.5-VL truncates ``i * tokens_per_second * seconds`` computed in float32 for a
    float32 tensor or a list of Python floats, in float64 for a float64 tensor: at 1/49
    seconds (2 frames at 98 fps) the 50th grid lands on 2 or just under it."""
    ids = [1] + [VIDEO] * 50 + [2]
    grid = torch.tensor([[50, 2, 2]])
    cfg = model("qwen2_5_vl").config
    got = {}
    for form in ([1 / 49], torch.tensor([1 / 49], dtype=torch.float32),
                 torch.tensor([1 / 49], dtype=torch.float64)):
        sample = {"input_ids": ids, "image_grid_thw": None, "video_grid_thw": grid,
                  "second_per_grid_ts": form}
        want = hf_positions("qwen2_5_vl", sample)
        mine = vlm.rope_index(cfg, ids, video_grid_thw=grid, second_per_grid_ts=form)
        np.testing.assert_array_equal(mine, want)
        got[type(form).__name__ + str(getattr(form, "dtype", ""))] = int(mine[0, 50])
    assert sorted(got.values()) == [2, 3, 3]  # float64 alone truncates 1.999... to 1


def test_rope_index_reads_a_config_dict_and_refuses_other_families() -> None:
    cfg = model("qwen2_vl").config
    ids = [1, IMAGE, IMAGE, IMAGE, IMAGE, 2]
    grid = [[1, 4, 4]]
    np.testing.assert_array_equal(vlm.rope_index(cfg.to_dict(), ids, image_grid_thw=grid),
                                  vlm.rope_index(cfg, ids, image_grid_thw=grid))
    with pytest.raises(FastpackError, match="model_type 'llama' is not a vision-language"):
        vlm.rope_index(transformers.LlamaConfig(), ids)


# ------------------------------------------------------------------ media sizes
@settings(max_examples=300, deadline=None)
@given(h=st.integers(1, 5000), w=st.integers(1, 5000),
       budget=st.sampled_from([(56 * 56, 28 * 28 * 1280), (3136, 12845056), (10_000, 200_000),
                               (256 * 28 * 28, 1280 * 28 * 28)]),
       patch=st.sampled_from([14, 16]))
def test_media_tokens_follow_the_image_processor(h: int, w: int, budget: tuple[int, int],
                                                 patch: int) -> None:
    proc = transformers.Qwen2VLImageProcessor(
        patch_size=patch, size={"shortest_edge": budget[0], "longest_edge": budget[1]})
    if max(h, w) / min(h, w) > 200:
        with pytest.raises(FastpackError, match="aspect ratio over 200"):
            vlm.media_tokens([h], [w], proc)
        return
    got = vlm.media_tokens([h], [w], proc)
    patches = proc.get_number_of_image_patches(h, w)
    assert int(got.patches[0]) == patches
    assert int(got.tokens[0]) == patches // 4
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
    rh, rw = smart_resize(h, w, factor=2 * patch, min_pixels=budget[0], max_pixels=budget[1])
    assert got.grid_thw[0].tolist() == [1, rh // patch, rw // patch]
    # The processor's dict reads the same.
    assert vlm.media_tokens([h], [w], proc.to_dict()).patches.tolist() == [patches]


@settings(max_examples=200, deadline=None)
@given(frames=st.integers(2, 64), h=st.integers(1, 3000), w=st.integers(1, 3000),
       qwen3=st.booleans())
def test_media_tokens_follow_the_video_processors(frames: int, h: int, w: int,
                                                  qwen3: bool) -> None:
    if qwen3:
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize
        rule = {"video_processor_type": "Qwen3VLVideoProcessor", "patch_size": 16,
                "merge_size": 2, "temporal_patch_size": 2,
                "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}}
        factor, lo, hi = 32, 128 * 32 * 32, 32 * 32 * 768
    else:
        # Qwen2-VL's video processor resizes each frame with the image rule (a copy of
        # this function; its own module needs torchvision).
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
        rule = {"video_processor_type": "Qwen2VLVideoProcessor", "patch_size": 14,
                "merge_size": 2, "temporal_patch_size": 2,
                "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}}
        factor, lo, hi = 28, 128 * 28 * 28, 28 * 28 * 768
    try:
        if qwen3:
            want = smart_resize(frames, h, w, temporal_factor=2, factor=factor, min_pixels=lo,
                                max_pixels=hi)
        else:
            want = smart_resize(h, w, factor=factor, min_pixels=lo, max_pixels=hi)
    except ValueError:
        with pytest.raises(FastpackError):
            vlm.media_tokens([h], [w], rule, frames=[frames])
        return
    got = vlm.media_tokens([h], [w], rule, frames=[frames])
    patch = rule["patch_size"]
    assert got.grid_thw[0].tolist() == [-(-frames // 2), want[0] // patch, want[1] // patch]


def test_media_tokens_of_many_images_name_the_bad_one() -> None:
    proc = transformers.Qwen2VLImageProcessor()
    with pytest.raises(FastpackError, match=r"^heights: item 2: a 10x2500 image has an aspect ratio over 200"):
        vlm.media_tokens([448, 300, 10], [448, 400, 2500], proc)
    with pytest.raises(FastpackError, match="^heights: item 1: got a -3x5 image"):
        vlm.media_tokens([448, -3], [448, 5], proc)


# ------------------------------------------------------------------ the batch
_REFERENCE: dict[tuple[str, str, str], list[torch.Tensor]] = {}


def reference(family: str, dtype: str, impl: str) -> list[torch.Tensor]:
    """Each document alone, its positions from the model's own get_rope_index: with sdpa
    for fastpack's attention (which needs the boundaries a 4-row batch gives), else with
    the cell's implementation."""
    impl = "sdpa" if impl == "fastpack" else impl
    key = (family, dtype, impl)
    if key not in _REFERENCE:
        m = model(family, DTYPES[dtype])
        m.set_attn_implementation(impl)
        try:
            with torch.no_grad():
                _REFERENCE[key] = [alone(m, d).logits[0]
                                   for d in documents(family, DTYPES[dtype])]
        finally:
            m.set_attn_implementation("sdpa")
    return _REFERENCE[key]


def packed_logits(family: str, dtype: str, impl: str, backend: str, max_len: int = 40,
                  **change: Any) -> tuple[dict[str, Any], list[torch.Tensor]]:
    m = model(family, DTYPES[dtype])
    docs = documents(family, DTYPES[dtype])
    batch = PackedCollator(max_len, backend=backend, model_config=m.config)(docs)
    batch.update(change)
    m.set_attn_implementation(FASTPACK if impl == "fastpack" else impl)
    try:
        with torch.no_grad():
            logits = m(**model_inputs(batch)).logits
    finally:
        m.set_attn_implementation("sdpa")
    return batch, per_document(batch, logits, docs)


def tolerance(dtype: str, impl: str) -> float:
    if dtype == "fp32":
        return 1e-5
    return 1e-6 if impl == "eager" else 1e-10


@pytest.mark.parametrize("backend", ["flash", "sdpa"])
@pytest.mark.parametrize("impl", ["sdpa", "eager", "fastpack"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_logits_equal_each_document_alone(family: str, dtype: str, impl: str,
                                                 backend: str) -> None:
    batch, got = packed_logits(family, dtype, impl, backend)
    rows = 1 if backend == "flash" else batch["input_ids"].shape[0]
    assert batch["position_ids"].shape == (4, rows, batch["input_ids"].shape[1])
    assert rows > 1 or backend == "flash"  # "sdpa" packs these documents into 2+ rows
    for d, packed, want in zip(documents(family), got, reference(family, dtype, impl)):
        diff = (packed - want).abs().max().item()
        assert diff <= tolerance(dtype, impl), f"document {d['input_ids'][0]}: {diff:.3g}"


def test_the_batch_says_what_it_holds() -> None:
    """Row 0 restarts in every document; media in placeholder order; labels -100 on every
    placeholder; mm_token_type_ids the placeholder kinds; no attention_mask."""
    m = model("qwen2_5_vl")
    docs = documents("qwen2_5_vl")
    batch = PackedCollator(40, backend="sdpa", model_config=m.config)(docs)
    assert "attention_mask" not in batch and batch["use_cache"] is False
    ids = batch["input_ids"]
    pos = batch["position_ids"]
    order = sorted(docs, key=lambda d: find(batch, d)[0])
    for d in docs:
        start, n = find(batch, d)
        flat0 = pos[0].reshape(-1)
        assert flat0[start:start + n].tolist() == list(range(n))
    placeholders = (ids == IMAGE) | (ids == VIDEO)
    assert (batch["labels"][placeholders] == -100).all()
    assert torch.equal(batch["mm_token_type_ids"],
                       ((ids == IMAGE).int() + 2 * (ids == VIDEO).int()))
    for key in ("image_grid_thw", "pixel_values", "video_grid_thw", "pixel_values_videos",
                "second_per_grid_ts"):
        parts = [torch.as_tensor(d[key]) for d in order if key in d]
        assert torch.equal(batch[key], torch.cat(parts).to(batch[key].dtype))


def test_a_packed_step_has_the_sum_of_the_documents_gradients() -> None:
    for family in FAMILIES:
        m = model(family)
        docs = documents(family)
        batch = PackedCollator(40, backend="flash", model_config=m.config)(docs)

        def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(
                logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="sum")

        m.zero_grad()
        loss(m(**model_inputs(batch)).logits, batch["labels"]).backward()
        packed = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        m.zero_grad()
        for d in docs:
            labels = torch.tensor([d["input_ids"]])
            labels[(labels == IMAGE) | (labels == VIDEO)] = -100
            loss(alone(m, d).logits, labels).backward()
        summed = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
        assert packed.keys() == summed.keys() and any("visual" in n for n in packed)
        worst = max((packed[n] - summed[n]).abs().max().item() for n in packed)
        assert worst <= 1e-10, f"{family}: |Δgrad| {worst:.3g}"
        m.zero_grad()


# ------------------------------------------------------------------ what it prevents
def test_what_the_collator_prevents_is_measured_wrong() -> None:
    """The peers' mistakes, on the same packed batch: positions without the text row or
    without mRoPE give wrong logits under sdpa, silently; fastpack's attention refuses the
    batches whose boundaries it cannot see."""
    errors = {}
    for family in ("qwen2_vl", "qwen3_vl"):
        batch, _ = packed_logits(family, "fp64", "sdpa", "flash")
        pos = batch["position_ids"]
        variants = {
            "4 rows (fastpack)": pos,
            "1-D positions": pos[0],
            "3 rows, no text row": pos[1:],
            "temporal row as row 0": torch.stack([pos[1], pos[1], pos[2], pos[3]]),
        }
        for name, positions in variants.items():
            _, got = packed_logits(family, "fp64", "sdpa", "flash", position_ids=positions)
            errors[family, name] = max((g - r).abs().max().item()
                                       for g, r in zip(got, reference(family, "fp64", "sdpa")))
    for family in ("qwen2_vl", "qwen3_vl"):
        assert errors[family, "4 rows (fastpack)"] <= 1e-10
        for name in ("1-D positions", "3 rows, no text row", "temporal row as row 0"):
            assert errors[family, name] > 1e-3, (family, name, errors[family, name])
    # Rows without cu_seq_lens: fastpack's attention reads the boundaries from the text
    # row; without it (Qwen2-VL then passes no positions to the attention) it raises.
    batch, _ = packed_logits("qwen2_vl", "fp64", "sdpa", "sdpa")
    for positions in (batch["position_ids"][1:], batch["position_ids"][0]):
        with pytest.raises(FastpackError, match="neither cu_seq_lens_q nor position_ids"):
            packed_logits("qwen2_vl", "fp64", "fastpack", "sdpa", position_ids=positions)


def test_check_model_batch_refuses_the_positions_that_are_silently_wrong() -> None:
    from fastpack.torch import check_model_batch

    m = model("qwen2_vl")
    batch = PackedCollator(40, backend="sdpa", model_config=m.config)(documents("qwen2_vl"))
    check_model_batch(m, batch)
    pos = batch["position_ids"]
    with pytest.raises(FastpackError, match=r"position_ids of shape \(3, 2, \d+\) \(mRoPE rows "
                                            r"without the text row"):
        check_model_batch(m, dict(batch, position_ids=pos[1:]))
    with pytest.raises(FastpackError, match="2-D position_ids beside images or videos"):
        check_model_batch(m, dict(batch, position_ids=pos[0]))


def test_fastpack_attention_reads_row_0_of_4_row_positions() -> None:
    from fastpack.torch.hf_attention import _position_bounds

    pos = torch.tensor([[[0, 1, 2, 0, 1]], [[0, 1, 1, 0, 5]], [[0, 1, 2, 0, 6]],
                        [[0, 1, 2, 0, 7]]])
    cu, longest = _position_bounds(pos, 1, 5, torch.device("cpu"))
    assert cu.tolist() == [0, 3, 5] and longest == 3
    with pytest.raises(FastpackError, match="3-D positions without the text row"):
        _position_bounds(pos[1:], 1, 5, torch.device("cpu"))


# ------------------------------------------------------------------ LLaVA
def llava() -> Any:
    torch.manual_seed(0)
    cfg = transformers.LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, image_size=8,
                           patch_size=2),
        text_config=dict(model_type="llama", vocab_size=64, hidden_size=32,
                         intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2),
        image_token_id=IMAGE, image_seq_length=16, projector_hidden_act="gelu",
        vision_feature_select_strategy="default", vision_feature_layer=-1,
    )
    cfg._attn_implementation = "sdpa"
    return transformers.LlavaForConditionalGeneration(cfg).double().eval()


def test_llava_packs_through_the_same_collator() -> None:
    m = llava()
    gen = torch.Generator().manual_seed(1)

    def sample(marker: int, images: int, text: int) -> dict[str, Any]:
        ids = [marker] + [5 + i % 30 for i in range(text)]
        for _ in range(images):
            ids += [START] + [IMAGE] * 16 + [END]
        s: dict[str, Any] = {"input_ids": ids}
        if images:
            s["pixel_values"] = torch.randn(images, 3, 8, 8, generator=gen, dtype=torch.float64)
        return s

    docs = [sample(50, 1, 4), sample(51, 0, 6), sample(52, 2, 3)]
    for backend in ("flash", "sdpa"):
        batch = PackedCollator(48, backend=backend, model_config=m.config)(docs)
        assert batch["position_ids"].ndim == 2 and "mm_token_type_ids" not in batch
        with torch.no_grad():
            got = per_document(batch, m(**model_inputs(batch)).logits, docs)
            for d, g in zip(docs, got):
                inputs = {"input_ids": torch.tensor([d["input_ids"]])}
                if "pixel_values" in d:
                    inputs["pixel_values"] = d["pixel_values"]
                want = m(**inputs).logits[0]
                assert (g - want).abs().max().item() <= 1e-10
    with pytest.raises(FastpackError, match=r"sample 0 'pixel_values': 2 image\(s\) need 32 "
                                            r"placeholder tokens \(16 each\), the sample's "
                                            r"input_ids hold 16"):
        PackedCollator(48, model_config=m.config)([dict(docs[0], pixel_values=torch.randn(
            2, 3, 8, 8, dtype=torch.float64))])


# ------------------------------------------------------------------ the Trainer
def test_a_trainer_trains_a_tiny_qwen2_vl_on_packed_batches(tmp_path: Any) -> None:
    torch.manual_seed(0)
    m = transformers.Qwen2VLForConditionalGeneration(model("qwen2_vl").config).float()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    samples = [document("qwen2_vl", 50 + i % 10, [("text", 3 + i % 5), ("image", (1, 4, 4)),
                                                  ("text", 2)], seed=i, dtype=torch.float32)
               for i in range(16)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3,
        learning_rate=1e-2, report_to=[], use_cpu=True, remove_unused_columns=False,
        logging_steps=1, save_strategy="no", dataloader_num_workers=0,
    )
    collator = PackedCollator(64, backend="flash", model_config=m.config)
    trainer = transformers.Trainer(model=m, args=args, train_dataset=samples,
                                   data_collator=collator)
    out = trainer.train()
    assert out.global_step == 3 and np.isfinite(out.training_loss)
    changed = [n for n, p in m.named_parameters() if not torch.equal(p, before[n])]
    assert any("visual" in n for n in changed) and any("language_model" in n for n in changed)


def test_plans_stay_within_every_budget() -> None:
    """The media budgets of a whole dataset, planned from image sizes alone."""
    rng = np.random.default_rng(0)
    n = 2000
    heights, widths = rng.integers(64, 1500, n), rng.integers(64, 1500, n)
    media = vlm.media_tokens(heights, widths, transformers.Qwen2VLImageProcessor())
    has = rng.random(n) < 0.7
    lengths = rng.integers(10, 400, n) + np.where(has, media.tokens, 0)
    patches = np.where(has, media.patches, 0)
    plan = fastpack.pack(lengths, 4096, limits={"patches": (patches, 8192),
                                                "images": (has.astype(int), 4)})
    for p in range(plan.num_packs):
        ids = plan.segments(p)[0]
        assert patches[ids].sum() <= 8192 and has[ids].sum() <= 4
    assert plan.limits["patches"].lower_bound == -(-int(patches.sum()) // 8192)
    assert plan.num_packs >= max(plan.lower_bound, plan.limits["patches"].lower_bound,
                                 plan.limits["images"].lower_bound)


# ------------------------------------------------------------------ budgets at every entry
def budget_docs(family: str, n: int = 24) -> list[dict[str, Any]]:
    """Documents of 0 to 3 images (and a video every fifth), markers 50..59 repeating."""
    out = []
    for i in range(n):
        pieces: list[tuple[str, Any]] = [("text", 2 + i % 4)]
        for _ in range(i % 4):
            pieces += [("image", (1, 2, 4)), ("text", 1)]
        if i % 5 == 4:
            pieces += [("video", (2, 2, 2)), ("text", 1)]
        out.append(document(family, 50 + i % 10, pieces, seed=i))
    return out


def used(samples: list[dict[str, Any]], ids: Any) -> tuple[int, int]:
    """(images, patches) of the samples ``ids``."""
    images = sum(len(samples[i].get("image_grid_thw", [])) for i in ids)
    patches = sum(int(torch.as_tensor(samples[i][k]).prod(1).sum())
                  for i in ids for k in ("image_grid_thw", "video_grid_thw") if k in samples[i])
    return images, patches


def test_a_collator_keeps_every_pack_of_a_batch_within_its_budgets() -> None:
    m = model("qwen2_vl")
    docs = budget_docs("qwen2_vl", 8)
    collator = PackedCollator(64, backend="sdpa", model_config=m.config,
                              limits={"images": 3, "patches": 24})
    batch = collator(docs)
    rows = batch["input_ids"]
    assert len(rows) >= 3  # 12 images, 3 a pack
    for row in rows:
        assert int((row == IMAGE).sum()) // 2 <= 3  # 2 placeholders per (1, 2, 4) image
        assert int((row == IMAGE).sum()) * 4 + int((row == VIDEO).sum()) * 4 <= 24
    with torch.no_grad():
        got = per_document(batch, m(**model_inputs(batch)).logits, docs)
        for d, g in zip(docs, got):
            assert (g - alone(m, d).logits[0]).abs().max().item() <= 1e-10


def test_a_dataset_plans_within_its_budgets_and_the_sampler_weighs_the_vision_cost() -> None:
    from fastpack.torch import PackedDataset, PackedSampler

    m = model("qwen2_5_vl")
    docs = budget_docs("qwen2_5_vl")
    collator = PackedCollator(48, backend="flash", model_config=m.config,
                              limits={"images": 3, "patches": 40})
    ds = PackedDataset([d["input_ids"] for d in docs], collator, media=docs, group_tokens=96)
    plan = ds.plan
    assert plan.limits["images"].total == sum(len(d.get("image_grid_thw", [])) for d in docs)
    for p in range(plan.num_packs):
        images, patches = used(docs, plan.segments(p)[0])
        assert images <= 3 and patches <= 40
    batch = ds[0]
    with torch.no_grad():
        m(**model_inputs(batch))  # the step's media are the batch's placeholders'
    # The sampler's cost: tokens and attention, plus the vision encoder's cost scaled by
    # (vision layers x width) / (text layers x hidden_size).
    sampler = PackedSampler(ds, num_replicas=2, rank=0, hidden_size=32)
    schedule = sampler.schedule(0)
    cfg = m.config
    ratio = (cfg.vision_config.depth * cfg.vision_config.hidden_size) / (
        cfg.text_config.num_hidden_layers * 32)
    for micro in range(len(schedule.micro_steps)):
        lo, hi = schedule.micro_lo[micro], schedule.micro_hi[micro]
        ids = plan.sample_ids[lo:hi]
        vision = 0.0
        for i in ids:
            for key in ("image_grid_thw", "video_grid_thw"):
                for t, h, w in torch.as_tensor(docs[i].get(key, torch.zeros(0, 3))).tolist():
                    vision += t * (6 * cfg.vision_config.hidden_size * h * w + (h * w) ** 2)
        seqlens = plan.seqlens[lo:hi].astype(np.float64)
        want = 6 * 32 * seqlens.sum() + (seqlens ** 2).sum() + ratio * vision
        assert schedule.micro_cost[micro] == pytest.approx(want, rel=1e-12)
    assert ds.steps.vision.sum() > 0
    # With a cost model read from the config: FLOPs, each frame's from its patches.
    cost = fastpack.CostModel.from_config(cfg)
    assert cost.vision_linear > 0 and cost.vision_quadratic > 0
    schedule = PackedSampler(ds, num_replicas=2, rank=0, cost=cost).schedule(0)
    for micro in range(len(schedule.micro_steps)):
        lo, hi = schedule.micro_lo[micro], schedule.micro_hi[micro]
        want = cost.sequence_flops(plan.seqlens[lo:hi]).sum()
        for i in plan.sample_ids[lo:hi]:
            for key in ("image_grid_thw", "video_grid_thw"):
                for t, h, w in torch.as_tensor(docs[i].get(key, torch.zeros(0, 3))).tolist():
                    want += t * cost.image_flops(h * w)
        assert schedule.micro_cost[micro] == pytest.approx(want, rel=1e-12)


def test_pack_dataset_packs_media_columns_in_placeholder_order() -> None:
    datasets = pytest.importorskip("datasets")
    import fastpack.hf

    m = model("qwen2_vl")
    docs = budget_docs("qwen2_vl")
    rows = [{"input_ids": d["input_ids"],
             "image_grid_thw": d["image_grid_thw"].tolist() if "image_grid_thw" in d else [],
             "pixel_values": (d["pixel_values"].tolist() if "pixel_values" in d else []),
             "video_grid_thw": d["video_grid_thw"].tolist() if "video_grid_thw" in d else [],
             "pixel_values_videos": (d["pixel_values_videos"].tolist()
                                     if "pixel_values_videos" in d else [])}
            for d in docs]
    table = datasets.Dataset.from_list(rows).shuffle(seed=1)  # through an indices mapping
    packed = fastpack.hf.pack_dataset(table, 48, limits={"images": 3, "patches": 40})
    assert packed.num_rows >= -(-sum(len(r["image_grid_thw"]) for r in rows) // 3)
    for row in packed:
        grids = torch.tensor(row["image_grid_thw"]).reshape(-1, 3)
        videos = torch.tensor(row["video_grid_thw"]).reshape(-1, 3)
        assert len(grids) <= 3 and int(grids.prod(1).sum() + videos.prod(1).sum()) <= 40
        assert len(row["pixel_values"]) == int(grids.prod(1).sum())
        cu = np.concatenate(([0], np.cumsum(row["seq_lengths"])))
        # The media follow the placeholders: every document's positions are its own.
        together = vlm.position_ids(m.config, row["input_ids"], cu,
                                    image_grid_thw=grids, video_grid_thw=videos)
        for lo, hi in zip(cu[:-1], cu[1:]):
            doc = next(d for d in docs if d["input_ids"] == row["input_ids"][lo:hi])
            np.testing.assert_array_equal(together[1:, lo:hi], vlm.rope_index(
                m.config, doc["input_ids"], image_grid_thw=doc.get("image_grid_thw"),
                video_grid_thw=doc.get("video_grid_thw")))
            want = torch.as_tensor(doc["pixel_values"]) if "pixel_values" in doc else None
            if want is not None:
                k = sum(int(torch.as_tensor(d.get("image_grid_thw", torch.zeros(0, 3))).prod(
                    1).sum()) for d in docs if any(d["input_ids"] == row["input_ids"][a:b]
                                                   for a, b in zip(cu[:-1], cu[1:]) if a < lo))
                got = torch.tensor(row["pixel_values"][k:k + len(want)], dtype=want.dtype)
                assert torch.equal(got, want)
