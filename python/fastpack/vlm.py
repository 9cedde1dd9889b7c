"""Vision-language models: 3-D rotary positions and media sizes, without a model.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL rotate every token by three positions (temporal,
height, width: *mRoPE*). Packed, each document needs its own positions from 0 and the
model needs a fourth row, the plain text position, to see where documents start:
``position_ids`` of shape ``[4, B, T]``. :func:`rope_index` computes the three mRoPE
rows of one document (or of many laid end to end) the way the model's
``get_rope_index`` does, in Rust, from the token ids and the media grids alone;
:func:`position_ids` adds the text row. :func:`media_tokens` gives each image's (or
video's) placeholder tokens and vision patches from its height and width by the
processor's resize rule, so a dataset is planned (``fastpack.pack(..., limits=...)``)
without decoding a pixel.

>>> import transformers, fastpack.vlm as vlm
>>> config = transformers.Qwen2VLConfig(image_token_id=9, video_token_id=8)
>>> vlm.rope_index(config, [1, 9, 9, 9, 9, 2], image_grid_thw=[[1, 4, 4]])
array([[0, 1, 1, 1, 1, 3],
       [0, 1, 1, 2, 2, 3],
       [0, 1, 2, 1, 2, 3]])

See docs/vision_language.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from . import _core
from ._checks import _threads
from ._errors import FastpackError, FastpackTypeError
from ._plan import as_lengths

__all__ = [
    "IMAGE_KEYS",
    "MEDIA_BUDGETS",
    "MEDIA_KEYS",
    "MROPE_FAMILIES",
    "MediaTokens",
    "VIDEO_KEYS",
    "VlmConfig",
    "media_budgets",
    "media_tokens",
    "mm_token_type_ids",
    "position_ids",
    "rope_index",
    "vision_cost",
    "vision_terms",
]

# Below this many tokens one thread computes the positions (2 shared cores: 64 documents
# of 1.7k tokens, 2.3 ms on one thread, 3.9 ms on two).
_SMALL_INPUT = 1 << 18
#: ``model_type`` values whose mRoPE rule fastpack computes.
MROPE_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
#: ``model_type`` values with plain (1-D) positions whose media fastpack concatenates:
#: ``pixel_values`` (and ``image_sizes``) in document order.
PLAIN_FAMILIES = ("llava", "llava_next", "llava_onevision", "vipllava")
#: The processor's per-sample keys for images, videos, and the per-token type ids a
#: collator rebuilds (``mm_token_type_ids``).
IMAGE_KEYS = ("pixel_values", "image_grid_thw", "image_sizes")
VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
MEDIA_KEYS = (*IMAGE_KEYS, *VIDEO_KEYS, "mm_token_type_ids")


def _get(config: Any, key: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


@dataclass(frozen=True)
class VlmConfig:
    """What fastpack reads of a vision-language model's Hugging Face config: its family,
    its placeholder token ids and what its positions and vision cost depend on. Built by
    :meth:`of` from the config object (``model.config``) or its dict."""

    model_type: str
    image_token_id: int
    video_token_id: int | None
    spatial_merge_size: int = 1
    tokens_per_second: float = 1.0
    #: Vision encoder width and depth (the sampler's cost of a patch).
    vision_hidden_size: int = 0
    vision_layers: int = 0
    #: Text model depth.
    text_layers: int = 0
    #: Placeholders per image of a plain-position model with a fixed count (LLaVA's
    #: ``image_seq_length``); None where it varies (LLaVA-Next tiles) or for mRoPE.
    tokens_per_image: int | None = None
    #: Values per row of an mRoPE model's ``pixel_values`` (one patch: channels x
    #: temporal patch x patch²), or None where the config does not say.
    patch_values: int | None = None

    @property
    def mrope(self) -> bool:
        """Whether the model takes 3-D (mRoPE) positions: ``position_ids`` ``[4, B, T]``."""
        return self.model_type in MROPE_FAMILIES

    @classmethod
    def of(cls, config: Any) -> VlmConfig:
        """The config of a model (``transformers.PretrainedConfig``), its ``to_dict()``, or
        a :class:`VlmConfig`. An unknown family raises, naming the families known."""
        if isinstance(config, VlmConfig):
            return config
        if config is None or isinstance(config, (str, bytes, int, float)):
            raise FastpackTypeError(
                f"config: expected a Hugging Face model config (model.config) or its dict, "
                f"got {type(config).__name__} {config!r}"
            )
        model_type = _get(config, "model_type")
        if model_type not in MROPE_FAMILIES + PLAIN_FAMILIES:
            raise FastpackError(
                f"config: model_type {model_type!r} is not a vision-language family fastpack "
                f"packs; expected one of {', '.join(map(repr, MROPE_FAMILIES + PLAIN_FAMILIES))}"
            )
        vision = _get(config, "vision_config") or {}
        text = _get(config, "text_config") or config
        image = _get(config, "image_token_id")
        if image is None:
            image = _get(config, "image_token_index")  # LLaVA's name
        if not isinstance(image, int):
            raise FastpackError(
                f"config: {model_type} config has no image_token_id (got {image!r}); pass the "
                f"model's config"
            )
        video = _get(config, "video_token_id")
        if model_type in MROPE_FAMILIES:
            merge = _get(vision, "spatial_merge_size")
            if not isinstance(merge, int) or merge < 1:
                raise FastpackError(
                    f"config: vision_config.spatial_merge_size is {merge!r}; expected a "
                    f"positive integer"
                )
        else:
            merge = 1
        per_second = _get(vision, "tokens_per_second")
        channels = _get(vision, "in_channels") or _get(vision, "in_chans")
        sizes = (channels, _get(vision, "temporal_patch_size"), _get(vision, "patch_size"))
        patch_values = (int(sizes[0]) * int(sizes[1]) * int(sizes[2]) ** 2
                        if model_type in MROPE_FAMILIES and all(
                            isinstance(v, int) and v > 0 for v in sizes) else None)
        width = _get(vision, "embed_dim") or _get(vision, "hidden_size") or 0
        depth = _get(vision, "depth") or _get(vision, "num_hidden_layers") or 0
        return cls(
            model_type=str(model_type), image_token_id=int(image),
            video_token_id=None if video is None else int(video), spatial_merge_size=int(merge),
            tokens_per_second=float(1.0 if per_second is None else per_second),
            vision_hidden_size=int(width), vision_layers=int(depth),
            text_layers=int(_get(text, "num_hidden_layers") or 0),
            tokens_per_image=(int(_get(config, "image_seq_length"))
                              if model_type == "llava" and _get(config, "image_seq_length")
                              else None),
            patch_values=patch_values,
        )


def _ids(input_ids: Any, name: str = "input_ids") -> np.ndarray:
    array = _array(input_ids)
    if array.ndim == 2 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise FastpackError(
            f"{name}: expected 1-D integer token ids, got {array.dtype} of shape {array.shape}"
        )
    return np.ascontiguousarray(array, dtype=np.int64)


def _array(value: Any) -> np.ndarray:
    if type(value).__module__.startswith("torch"):
        return value.detach().cpu().numpy()  # type: ignore[no-any-return]
    return np.asarray(value)


def _grids(value: Any, name: str) -> np.ndarray | None:
    if value is None:
        return None
    array = _array(value)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 2 or array.shape[1] != 3 or array.dtype.kind not in "iu":
        raise FastpackError(
            f"{name}: expected integers of shape (n, 3), one (t, h, w) per grid, got "
            f"{array.dtype} of shape {array.shape}"
        )
    return np.ascontiguousarray(array.reshape(-1), dtype=np.int64)


#: The dtypes of a ``second_per_grid_ts`` tensor whose products Hugging Face computes in
#: that dtype; every other form (numpy arrays and scalars, lists, other tensors) goes
#: through a numpy or Python scalar, which torch multiplies in float32.
_TIME_DTYPES = ("float16", "bfloat16", "float64")


def _seconds(value: Any) -> tuple[np.ndarray | None, str]:
    """``second_per_grid_ts`` as float64 and the dtype Hugging Face multiplies it in.

    ``get_rope_index`` iterates it: a tensor gives 0-d tensors of its dtype, so a float16,
    bfloat16 or float64 tensor multiplies in that dtype; a numpy array gives numpy scalars
    and a list Python floats, which torch multiplies with ``arange`` in float32."""
    if value is None:
        return None, "float32"
    dtype = getattr(value, "dtype", None)
    math = "float32"
    if type(value).__module__.startswith("torch"):
        name = str(dtype).rpartition(".")[2]
        if name in _TIME_DTYPES:
            math = name
        if value.is_floating_point() and name != "float64":
            value = value.float()  # numpy has no bfloat16; float32 holds both halves exactly
    array = _array(value)
    if array.ndim != 1 or array.dtype.kind not in "fiu":
        raise FastpackError(
            f"second_per_grid_ts: expected one number per video (1-D), got {array.dtype} of "
            f"shape {array.shape}"
        )
    return np.ascontiguousarray(array, dtype=np.float64), math


def rope_index(
    config: Any,
    input_ids: Any,
    *,
    image_grid_thw: Any = None,
    video_grid_thw: Any = None,
    second_per_grid_ts: Any = None,
    cu_seqlens: Any = None,
    threads: int | None = None,
) -> np.ndarray:
    """The mRoPE positions ``(3, T)`` int64 of one document, as the model's
    ``get_rope_index`` gives them (temporal, height, width rows).

    Args:
        config: the model's Hugging Face config (or its dict): ``model_type`` one of
            :data:`MROPE_FAMILIES`, ``image_token_id``, ``video_token_id``,
            ``vision_config.spatial_merge_size`` (and ``tokens_per_second`` for
            Qwen2.5-VL).
        input_ids: the document's token ids, placeholders expanded (1-D, or ``(1, T)``).
        image_grid_thw, video_grid_thw: ``(n, 3)`` grids in placeholder order, as the
            processor gives them.
        second_per_grid_ts: seconds per temporal grid of each video (Qwen2.5-VL),
            multiplied as the model's ``get_rope_index`` multiplies it: a float16,
            bfloat16 or float64 tensor in its dtype, anything else (the processor's
            float32 tensor, a numpy array of any float dtype, a list) in float32.
        cu_seqlens: many documents laid end to end: document ``d`` is
            ``input_ids[cu_seqlens[d]:cu_seqlens[d+1]]``, from position 0, with the next
            grids in placeholder order (computed in parallel, the same on any thread
            count).

    A placeholder count that disagrees with the grids raises, naming the document and the
    image or video.
    """
    return _positions(config, input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts,
                      cu_seqlens, False, threads)


def _positions(config: Any, input_ids: Any, image_grid_thw: Any, video_grid_thw: Any,
               second_per_grid_ts: Any, cu_seqlens: Any, text_row: bool,
               threads: int | None) -> np.ndarray:
    cfg = VlmConfig.of(config)
    if not cfg.mrope:
        raise FastpackError(
            f"config: {cfg.model_type} takes plain positions, not mRoPE; rope_index applies to "
            f"{', '.join(MROPE_FAMILIES)}"
        )
    ids = _ids(input_ids)
    images = _grids(image_grid_thw, "image_grid_thw")
    videos = _grids(video_grid_thw, "video_grid_thw")
    seconds, math = _seconds(second_per_grid_ts)
    cu = None
    if cu_seqlens is not None:
        cu = np.ascontiguousarray(_array(cu_seqlens), dtype=np.int64)
    threads = _threads(threads)
    if threads is None and len(ids) < _SMALL_INPUT:
        threads = 1  # a batch's worth: waking the pool costs more than it saves
    flat = _core.rope_index(
        ids, cu, cfg.model_type, cfg.image_token_id,
        -1 if cfg.video_token_id is None else cfg.video_token_id, cfg.spatial_merge_size,
        cfg.tokens_per_second, images, videos, seconds, math, text_row, threads,
    )
    return flat.reshape(4 if text_row else 3, len(ids))


def position_ids(
    config: Any,
    input_ids: Any,
    cu_seqlens: Any,
    *,
    image_grid_thw: Any = None,
    video_grid_thw: Any = None,
    second_per_grid_ts: Any = None,
    threads: int | None = None,
) -> np.ndarray:
    """``(4, T)`` int64 positions of documents laid end to end (``cu_seqlens``): row 0 the
    text position, restarting at 0 in every document (what packed attention reads the
    boundaries from), rows 1-3 each document's :func:`rope_index`. One Rust call, the
    documents in parallel."""
    if cu_seqlens is None:
        raise FastpackTypeError("cu_seqlens: expected the documents' offsets, got None")
    return _positions(config, input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts,
                      cu_seqlens, True, threads)


def mm_token_type_ids(config: Any, input_ids: Any) -> np.ndarray:
    """0 for text, 1 for an image placeholder, 2 for a video one (int32, the shape of
    ``input_ids``): the processor's ``mm_token_type_ids``."""
    cfg = VlmConfig.of(config)
    ids = _array(input_ids)
    out = (ids == cfg.image_token_id).astype(np.int32)
    if cfg.video_token_id is not None:
        out[ids == cfg.video_token_id] = 2
    return out


class MediaTokens(NamedTuple):
    """Per image (or video): its placeholder ``tokens`` after the merge, its vision
    ``patches`` (rows of ``pixel_values``: ``t·h·w``) and its ``grid_thw`` ``(n, 3)``,
    all int64."""

    tokens: np.ndarray
    patches: np.ndarray
    grid_thw: np.ndarray


def _resize_rule(config: Any, video: bool) -> dict[str, Any]:
    """The processor settings the resize rule reads, from a processor, an image or video
    processor, or a dict of one (``preprocessor_config.json``)."""
    if config is None or isinstance(config, (str, bytes, int, float)):
        raise FastpackTypeError(
            f"config: expected a processor, an image or video processor, or its dict, got "
            f"{type(config).__name__} {config!r}"
        )
    sub = "video_processor" if video else "image_processor"
    if _get(config, sub) is not None and not isinstance(_get(config, sub), str):
        config = _get(config, sub)
    kind = _get(config, "video_processor_type" if video else "image_processor_type")
    kind = str(kind or type(config).__name__)
    size = _get(config, "size") or {}
    read = (lambda k: size.get(k)) if isinstance(size, Mapping) else (lambda k: getattr(size, k,
                                                                                         None))
    min_pixels = _get(config, "min_pixels") or read("shortest_edge") or read("min_pixels")
    max_pixels = _get(config, "max_pixels") or read("longest_edge") or read("max_pixels")
    rule = {
        "patch_size": _get(config, "patch_size"), "merge_size": _get(config, "merge_size"),
        "temporal_patch_size": _get(config, "temporal_patch_size") or 1,
        "min_pixels": min_pixels, "max_pixels": max_pixels,
    }
    missing = [k for k, v in rule.items() if not isinstance(v, int)]
    if missing:
        raise FastpackError(
            f"config: {kind} has no integer {', '.join(missing)}; pass the model's "
            f"{'video' if video else 'image'} processor (or its dict)"
        )
    if video and _get(config, "cap_pixels_per_frame"):
        raise FastpackError(
            "config: cap_pixels_per_frame (a per-video token cap) is not modelled by "
            "media_tokens; pass a video processor without it"
        )
    rule["temporal"] = video and "Qwen3VL" in kind.replace("_", "")
    return rule


def media_tokens(
    heights: Any,
    widths: Any,
    config: Any,
    *,
    frames: Any = None,
    threads: int | None = None,
) -> MediaTokens:
    """Each image's placeholder tokens, vision patches and grid from its size alone, by the
    Qwen-VL processors' resize rule (``smart_resize``: sides rounded to multiples of
    ``patch_size · merge_size``, the area kept within ``min_pixels..max_pixels``).

    ``config`` is the model's processor (``AutoProcessor``), its image processor, or the
    dict of either; with ``frames`` (frames per video, after sampling) the video
    processor's rule (Qwen3-VL's counts the frames in the pixel budget). Sides must be
    in ``1..2**20``; an aspect ratio over 200 raises, as the processor does.
    """
    rule = _resize_rule(config, video=frames is not None)
    h = np.ascontiguousarray(as_lengths(heights, name="heights"), dtype=np.int64)
    w = np.ascontiguousarray(as_lengths(widths, name="widths"), dtype=np.int64)
    f = None if frames is None else np.ascontiguousarray(as_lengths(frames, name="frames"),
                                                          dtype=np.int64)
    grid = _core.media_grids(
        h, w, f, rule["patch_size"], rule["merge_size"], rule["temporal_patch_size"],
        rule["min_pixels"], rule["max_pixels"], rule["temporal"], _threads(threads),
    ).reshape(-1, 3)
    patches = grid.prod(axis=1)
    return MediaTokens(tokens=patches // (rule["merge_size"] ** 2), patches=patches,
                       grid_thw=grid)


#: The budgets a collator or dataset counts from each sample's media, for ``limits``:
#: vision patches (rows of ``pixel_values`` and ``pixel_values_videos``: ``t·h·w`` of every
#: grid), images, videos.
MEDIA_BUDGETS = ("patches", "images", "videos")


def media_budgets(
    samples: Any, names: Sequence[str], *, mrope: bool = True
) -> dict[str, np.ndarray]:
    """Each sample's use of each budget of ``names`` (int64 arrays, one value per sample),
    counted from its grids (``mrope``: Qwen-VL families) or its ``pixel_values`` (plain
    families: ``images`` only). ``samples`` is a sequence of sample dicts, or a
    ``datasets.Dataset`` (its grid columns read from Arrow at once)."""
    unknown = [n for n in names if n not in MEDIA_BUDGETS]
    if unknown:
        raise FastpackError(
            f"limits: {unknown[0]!r} is not counted from a sample's media; the budgets are "
            f"{', '.join(map(repr, MEDIA_BUDGETS))} (pack the lengths with fastpack.pack("
            f"lengths, limits={{name: (values, cap)}}) for any other)"
        )
    if not mrope and set(names) - {"images"}:
        raise FastpackError(
            "limits: a model with plain positions has no grids to count patches or videos "
            "from; its budget is 'images'"
        )
    grids = {kind: _grids_of(samples, kind, mrope) for kind in ("image", "video")}
    out = {}
    for name in names:
        if name == "patches":
            out[name] = np.sum([_per_sample(o, g.prod(axis=1)) for o, g in grids.values()],
                               axis=0).astype(np.int64)
        else:
            offsets, _ = grids["image" if name == "images" else "video"]
            out[name] = np.diff(offsets)
    return out


def vision_cost(samples: Any, width: int) -> np.ndarray:
    """Each sample's vision encoder cost (float64), in the units of the sampler's cost of
    a text layer: per encoder layer ``6·width·p + p²`` for every frame of ``p = h·w``
    patches (its projections, then attention within the frame: Qwen-VL encoders attend
    within each frame; Qwen2.5-VL's windowed layers do less, so this is an upper bound);
    ``width`` is the encoder's hidden size."""
    return vision_cost_of(vision_terms(samples), width)


def vision_cost_of(terms: np.ndarray, width: int) -> np.ndarray:
    """:func:`vision_cost` from samples' :func:`vision_terms` (the one statement of the
    formula)."""
    return 6.0 * width * terms[:, 0] + terms[:, 1]


def vision_terms(samples: Any) -> np.ndarray:
    """Each sample's ``Σ t·p`` and ``Σ t·p²`` over its grids (float64 [N, 2]): the
    patches, and the squares of its frames' patches (``p = h·w`` per frame, ``t``
    frames), from which any cost linear and quadratic in a frame's patches follows
    (:meth:`fastpack.CostModel.image_flops`)."""
    total = np.zeros((len(samples), 2), dtype=np.float64)
    for kind in ("image", "video"):
        offsets, g = _grids_of(samples, kind, True)
        frame = (g[:, 1] * g[:, 2]).astype(np.float64)
        total[:, 0] += _per_sample(offsets, g[:, 0] * frame)
        total[:, 1] += _per_sample(offsets, g[:, 0] * frame * frame)
    return total


def _per_sample(offsets: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Sums of ``values`` (one per grid) per sample, samples ``offsets`` (CSR over grids)."""
    cumulative = np.concatenate(([0], np.cumsum(values)))
    return cumulative[offsets[1:]] - cumulative[offsets[:-1]]


def _grids_of(samples: Any, kind: str, mrope: bool) -> tuple[np.ndarray, np.ndarray]:
    """Every sample's grids of ``kind`` (``"image"`` or ``"video"``): CSR offsets over the
    samples and the grids ``(G, 3)`` int64. Plain families: one ``(1, 0, 0)`` per image
    (their pixel rows are images, not patches)."""
    key = f"{kind}_grid_thw" if mrope else ("pixel_values" if kind == "image" else None)
    n = len(samples)
    if key is None:
        return np.zeros(n + 1, dtype=np.int64), np.zeros((0, 3), dtype=np.int64)
    arrow = _arrow_grids(samples, key)
    if arrow is not None:
        offsets, grids = arrow
    else:
        counts = np.zeros(n, dtype=np.int64)
        parts = []
        for i, sample in enumerate(samples):
            value = sample.get(key)
            if value is None:
                continue
            array = np.asarray(value.detach().cpu() if hasattr(value, "detach") else value)
            counts[i] = len(array)
            if mrope and array.size:
                parts.append(array.reshape(-1, 3).astype(np.int64))
        offsets = np.concatenate(([0], np.cumsum(counts)))
        grids = np.concatenate(parts) if parts else np.zeros((0, 3), dtype=np.int64)
    if not mrope:
        grids = np.tile(np.array([[1, 0, 0]], dtype=np.int64), (int(offsets[-1]), 1))
    return offsets, grids


def _arrow_grids(samples: Any, key: str) -> tuple[np.ndarray, np.ndarray] | None:
    """``_grids_of`` read in place from a ``datasets.Dataset``'s list column ``key``
    (``None``: not a Dataset; no grids: no such column)."""
    data = getattr(samples, "data", None)
    table = getattr(data, "table", data)
    if table is None or not hasattr(table, "column_names"):
        return None
    n = len(samples)
    if key not in table.column_names:
        return np.zeros(n + 1, dtype=np.int64), np.zeros((0, 3), dtype=np.int64)
    import pyarrow as pa

    column = table.column(key).combine_chunks()
    indices = getattr(samples, "_indices", None)
    if indices is not None:
        column = column.take(pa.array(indices.column(0).to_numpy()))
    offsets = np.asarray(column.offsets, dtype=np.int64)
    offsets = offsets - offsets[0]
    if key == "pixel_values":
        return offsets, np.zeros((int(offsets[-1]), 3), dtype=np.int64)
    values = np.asarray(column.flatten().flatten(), dtype=np.int64)
    return offsets, values.reshape(-1, 3)
