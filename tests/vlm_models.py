"""Tiny random vision-language models built from configs (no download) and documents for
them: shared by test_vlm.py and the conformance matrix.

Every model has 2 text layers of width 32, a 1-layer vision tower of width 32, patches of
2x2 pixels (x2 frames) merged 2x2, so an image of grid (1, h, w) is h*w/4 placeholders.
Token ids: text 1..49, document markers 50..59 (each document starts with its own, so it
is found in any batch), placeholders and vision markers 60..63.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import transformers

IMAGE, VIDEO, START, END = 60, 61, 62, 63
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
#: Rows of pixel_values: channels (3) x temporal patch (2) x patch (2 x 2).
PATCH_DIM = 24
TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)
VISION = dict(depth=1, hidden_size=32, num_heads=2, patch_size=2, spatial_merge_size=2,
              temporal_patch_size=2, in_channels=3)


def config(family: str) -> Any:
    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
               vision_end_token_id=END)
    mrope = {"type": "mrope", "mrope_section": [1, 1, 2]}
    if family == "qwen2_vl":
        return transformers.Qwen2VLConfig(
            text_config=dict(TEXT, rope_scaling=mrope), vision_config=dict(VISION, embed_dim=32),
            **ids)
    if family == "qwen2_5_vl":
        vision = dict(VISION, intermediate_size=64, out_hidden_size=32, tokens_per_second=2,
                      window_size=8, fullatt_block_indexes=[0])
        return transformers.Qwen2_5_VLConfig(text_config=dict(TEXT, rope_scaling=mrope),
                                             vision_config=vision, **ids)
    if family == "qwen3_vl":
        text = dict(TEXT, head_dim=8, rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2],
                                                    "mrope_interleaved": True})
        vision = dict(VISION, intermediate_size=64, out_hidden_size=32,
                      num_position_embeddings=16, deepstack_visual_indexes=[0])
        return transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **ids)
    raise ValueError(family)


_MODELS: dict[tuple[str, torch.dtype], Any] = {}


def model(family: str, dtype: torch.dtype = torch.float64) -> Any:
    """One tiny random model per family and dtype (seed 0), in eval mode, sdpa."""
    if (family, dtype) not in _MODELS:
        torch.manual_seed(0)
        cfg = config(family)
        cfg._attn_implementation = "sdpa"
        cls = {"qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
               "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
               "qwen3_vl": transformers.Qwen3VLForConditionalGeneration}[family]
        _MODELS[family, dtype] = cls(cfg).to(dtype).eval()
    return _MODELS[family, dtype]


def document(
    family: str,
    marker: int,
    pieces: Sequence[tuple[str, Any]],
    *,
    seed: int = 0,
    seconds: Sequence[float] | None = None,
    dtype: torch.dtype = torch.float64,
) -> dict[str, Any]:
    """A sample as the processor gives it: ``pieces`` are ``("text", n)``,
    ``("image", (t, h, w))`` or ``("video", (t, h, w))``, each medium between vision
    markers; a Qwen3-VL video is one run per frame with a timestamp token between."""
    rng = np.random.default_rng(seed * 1000 + marker)
    ids: list[int] = [marker]
    images: list[tuple[int, int, int]] = []
    videos: list[tuple[int, int, int]] = []
    for kind, value in pieces:
        if kind == "text":
            ids += rng.integers(1, 50, value).tolist()
            continue
        t, h, w = value
        token = IMAGE if kind == "image" else VIDEO
        frames = t if (kind == "video" and family == "qwen3_vl") else 1
        per_run = (t // frames) * h * w // 4
        for f in range(frames):
            if f:
                ids.append(int(rng.integers(1, 50)))  # the frame's timestamp
            ids += [START] + [token] * per_run + [END]
        (images if kind == "image" else videos).append(value)
    sample: dict[str, Any] = {"input_ids": ids}
    gen = torch.Generator().manual_seed(seed * 1000 + marker)
    for key, grids in (("image", images), ("video", videos)):
        if grids:
            g = torch.tensor(grids)
            sample[f"{key}_grid_thw"] = g
            pixels = "pixel_values" if key == "image" else "pixel_values_videos"
            sample[pixels] = torch.randn(int(g.prod(1).sum()), PATCH_DIM, generator=gen,
                                         dtype=dtype)
    if videos and family == "qwen2_5_vl":
        sample["second_per_grid_ts"] = torch.tensor(
            list(seconds) if seconds is not None else [0.5] * len(videos), dtype=torch.float32)
    return sample


def documents(family: str, dtype: torch.dtype = torch.float64) -> list[dict[str, Any]]:
    """Documents with 0, 1 and several images and videos, an image first and one last."""
    return [
        document(family, 50, [("text", 6), ("image", (1, 4, 4)), ("text", 3)], dtype=dtype),
        document(family, 51, [("text", 5)], dtype=dtype),
        document(family, 52, [("image", (1, 2, 4)), ("text", 2), ("video", (2, 4, 4)),
                              ("text", 2), ("image", (1, 4, 2)), ("text", 1)],
                 seconds=[0.75], dtype=dtype),
        document(family, 53, [("text", 2), ("video", (2, 2, 4)), ("image", (1, 2, 2))],
                 seconds=[1.25], dtype=dtype),
    ]


def type_ids(input_ids: Sequence[int]) -> torch.Tensor:
    ids = torch.tensor([list(input_ids)])
    return ((ids == IMAGE).int() + 2 * (ids == VIDEO).int())


def alone(m: Any, sample: dict[str, Any], **extra: Any) -> Any:
    """The model's output for one sample as the processor gives it (the model computes
    its positions itself, with its own ``get_rope_index``)."""
    inputs = {k: v for k, v in sample.items() if k != "input_ids"}
    return m(input_ids=torch.tensor([sample["input_ids"]]),
             mm_token_type_ids=type_ids(sample["input_ids"]), **inputs, **extra)


def find(batch: dict[str, Any], sample: dict[str, Any]) -> tuple[int, int]:
    """Where ``sample`` sits in the batch's flattened rows: (first token, tokens)."""
    ids = batch["input_ids"].reshape(-1).tolist()
    n = len(sample["input_ids"])
    start = ids.index(sample["input_ids"][0])
    assert ids[start:start + n] == sample["input_ids"]
    return start, n


def per_document(batch: dict[str, Any], logits: torch.Tensor,
                 samples: Sequence[dict[str, Any]]) -> list[torch.Tensor]:
    flat = logits.reshape(-1, logits.shape[-1])
    out = []
    for s in samples:
        start, n = find(batch, s)
        out.append(flat[start:start + n])
    return out


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in batch.items() if k != "labels"}
