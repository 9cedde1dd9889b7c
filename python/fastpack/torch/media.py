"""The media of a packed batch: what a vision-language model needs beside the tokens.

For every sample of a pack, in the order its placeholders appear in the packed rows, the
processor's own keys are concatenated: ``pixel_values`` / ``image_grid_thw`` (images),
``pixel_values_videos`` / ``video_grid_thw`` / ``second_per_grid_ts`` (videos),
``image_sizes`` (LLaVA-Next). Each sample is checked first — its placeholder tokens
against its grids, its grids against its pixel rows — and a disagreement raises, naming
the sample and the key, before the model could silently misplace an image.

For mRoPE models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) the batch gets ``position_ids``
``[4, rows, width]`` — row 0 the text position restarting in every document, rows 1-3 each
document's :func:`fastpack.vlm.rope_index` — and ``mm_token_type_ids``. Plain-position
models (LLaVA) keep the text positions. Labels are -100 on every placeholder.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .._errors import FastpackError
from .._materialize import IGNORE_INDEX
from ..vlm import (
    IMAGE_KEYS,
    MEDIA_BUDGETS,
    MEDIA_KEYS,
    VIDEO_KEYS,
    VlmConfig,
    media_budgets,
    mm_token_type_ids,
    position_ids,
    vision_cost,
)

__all__ = [
    "IMAGE_KEYS", "MEDIA_BUDGETS", "MEDIA_KEYS", "VIDEO_KEYS", "media_batch", "media_budgets",
    "sample_media", "vision_cost",
]


def _numpy(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:  # numpy has no bfloat16; float32 holds it exactly
            value = value.float()
        return value.numpy()
    return np.asarray(value)


def _tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    return torch.as_tensor(np.asarray(value))


def sample_media(cfg: VlmConfig, sample: Mapping[str, Any], index: int,
                 input_ids: np.ndarray) -> dict[str, Any]:
    """The media keys of sample ``index`` (token ids ``input_ids``), checked: a grid
    without pixel values (or the reverse), a placeholder count other than its grids'
    tokens, pixel rows other than its grids' patches, or media the family does not take
    raise, naming the sample and the key."""
    present = {k: sample[k] for k in IMAGE_KEYS + VIDEO_KEYS if sample.get(k) is not None}

    def fail(key: str, why: str) -> FastpackError:
        return FastpackError(f"features: sample {index} {key!r}: {why}")

    image_tokens = int(np.count_nonzero(input_ids == cfg.image_token_id))
    video_tokens = (0 if cfg.video_token_id is None
                    else int(np.count_nonzero(input_ids == cfg.video_token_id)))
    if not cfg.mrope:
        for key in VIDEO_KEYS + ("image_grid_thw",):
            if key in present:
                raise fail(key, f"{cfg.model_type} takes images as pixel_values (and "
                                f"image_sizes), not {key}")
        if image_tokens and "pixel_values" not in present:
            raise fail("pixel_values", f"missing, but the sample has {image_tokens} image "
                                       f"placeholder token(s)")
        images = len(_numpy(present["pixel_values"])) if "pixel_values" in present else 0
        if cfg.tokens_per_image is not None and images * cfg.tokens_per_image != image_tokens:
            raise fail("pixel_values", f"{images} image(s) need {images * cfg.tokens_per_image} "
                                       f"placeholder tokens ({cfg.tokens_per_image} each), the "
                                       f"sample's input_ids hold {image_tokens}")
        if "image_sizes" in present and "pixel_values" in present and \
                len(_numpy(present["image_sizes"])) != len(_numpy(present["pixel_values"])):
            raise fail("image_sizes", f"{len(_numpy(present['image_sizes']))} sizes for "
                                      f"{len(_numpy(present['pixel_values']))} images")
        return present
    if "image_sizes" in present:
        raise fail("image_sizes", f"{cfg.model_type} reads image_grid_thw, not image_sizes")
    if "second_per_grid_ts" in present and cfg.model_type != "qwen2_5_vl":
        raise fail("second_per_grid_ts", f"applies to qwen2_5_vl, not {cfg.model_type}")
    merge = cfg.spatial_merge_size ** 2
    for kind, tokens, pixels, grids in (("image", image_tokens, "pixel_values", "image_grid_thw"),
                                        ("video", video_tokens, "pixel_values_videos",
                                         "video_grid_thw")):
        if grids in present and pixels not in present:
            raise fail(grids, f"{kind} grids without {pixels}; pass both (the processor's "
                              f"output) or neither")
        if pixels in present and grids not in present:
            raise fail(pixels, f"{kind} pixel values without {grids}; the model cannot place "
                               f"them")
        if grids not in present:
            if tokens:
                raise fail(grids, f"missing, but the sample has {tokens} {kind} placeholder "
                                  f"token(s)")
            continue
        grid = _numpy(present[grids])
        if grid.ndim != 2 or grid.shape[1] != 3:
            raise fail(grids, f"expected shape (n, 3), got {grid.shape}")
        patches = int(grid.prod(axis=1).sum())
        if tokens != patches // merge:
            raise fail(grids, f"its grids need {patches // merge} {kind} placeholder token(s) "
                              f"(t*h*w / {merge}), the sample's input_ids hold {tokens}")
        shape = tuple(present[pixels].shape) if isinstance(present[pixels], torch.Tensor) \
            else _numpy(present[pixels]).shape
        rows = shape[0] if shape else 0
        if rows != patches:
            raise fail(pixels, f"{rows} rows, but its grids hold {patches} patches")
        if cfg.patch_values is not None and shape[1:] != (cfg.patch_values,):
            raise fail(pixels, f"shape {shape}: the model's patches have {cfg.patch_values} "
                               f"values each (vision_config's channels x temporal_patch_size "
                               f"x patch_size²), expected ({rows}, {cfg.patch_values})")
    if "second_per_grid_ts" in present:
        videos = len(_numpy(present.get("video_grid_thw", np.zeros((0, 3)))))
        seconds = _numpy(present["second_per_grid_ts"]).reshape(-1)
        if len(seconds) != videos:
            raise fail("second_per_grid_ts", f"{len(seconds)} values for {videos} video(s)")
    return present


def _concat(key: str, values: list[Any]) -> torch.Tensor:
    if key == "second_per_grid_ts":
        # The processor's dtype (float32), which the model's positions multiply in; a
        # float64 tensor stays float64.
        keep = all(isinstance(v, torch.Tensor) and v.dtype == torch.float64 for v in values)
        return torch.cat([_tensor(v).reshape(-1).to(torch.float64 if keep else torch.float32)
                          for v in values])
    return torch.cat([_tensor(v) for v in values], dim=0)


def media_batch(
    cfg: VlmConfig,
    media: Sequence[Mapping[str, Any]],
    rows: dict[str, Any],
    *,
    padded: bool,
    return_tensors: str,
    threads: int | None = None,
) -> dict[str, Any]:
    """The model's media inputs for the samples of a batch, ``media`` in placeholder order
    (the order of their segments in ``rows``, the materialized rows): concatenated media
    keys, ``mm_token_type_ids`` and, for mRoPE families, ``position_ids`` ``[4, rows,
    width]`` (not for ``padded``, where the model computes them from its
    ``attention_mask``). Sets ``rows["labels"]`` to -100 on every placeholder, and
    lowers ``rows["num_targets"]`` by the targets that removes."""
    ids = rows["input_ids"]
    placeholder = ids == cfg.image_token_id
    if cfg.video_token_id is not None:
        placeholder |= ids == cfg.video_token_id
    labels = rows["labels"]
    unmasked = int(np.count_nonzero(labels[placeholder] != IGNORE_INDEX))
    labels[placeholder] = IGNORE_INDEX
    rows["num_targets"] = int(rows["num_targets"]) - unmasked
    out: dict[str, Any] = {}
    for key in IMAGE_KEYS + VIDEO_KEYS:
        values = [m[key] for m in media if key in m]
        if values:
            out[key] = _concat(key, values)
    if cfg.mrope:
        out["mm_token_type_ids"] = torch.from_numpy(mm_token_type_ids(cfg, ids))
        if not padded:
            width = ids.shape[-1]
            seconds = out.get("second_per_grid_ts")
            four = position_ids(
                cfg, ids.reshape(-1), rows["cu_seqlens"],
                image_grid_thw=out.get("image_grid_thw"),
                video_grid_thw=out.get("video_grid_thw"),
                second_per_grid_ts=seconds, threads=threads,
            )
            # Row 0 is the text position materialize wrote: the same restarts.
            out["position_ids"] = torch.from_numpy(four.reshape(4, -1, width))
    if return_tensors == "np":
        out = {k: v.numpy() for k, v in out.items()}
    return out
