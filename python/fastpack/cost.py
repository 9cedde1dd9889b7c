"""A training cost model read from a model's config: FLOPs per sequence, per image.

A sequence of ``l`` tokens costs, summed over the model's layers, its matrix products
(projections, dense or MoE MLPs, state-space / linear-attention mixers and their causal
convolutions, the LM head: linear in ``l``) plus attention's (query, key) pairs: ``l(l+1)/2``
for full causal attention, fewer for a sliding window of ``w`` (each query sees at most
``w`` keys). Training is counted as three forward passes (the backward pass computes two
products per forward product: the input's gradient and the weight's), the usual
``6·N·D`` convention. Only matrix products and convolutions count (as
``torch.utils.flop_counter.FlopCounterMode`` counts): norms, activations and softmax are
a few FLOPs per element and memory-bound.

The result is a polynomial with window corrections, exposed for vectorised sums::

    sequence_flops(l) = linear·l + quadratic·l² − Σ_w c_w·m_w·(m_w + 1),  m_w = max(l − w, 0)

so a batch's cost is ``linear·Σl + quadratic·Σl²`` whenever no sequence is longer than its
smallest window. A vision encoder's cost per frame of ``p`` patches is
``vision_linear·p + vision_quadratic·p²`` (attention within the frame, not causal).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._errors import FastpackError, FastpackTypeError

__all__ = ["CostModel"]

#: Training FLOPs per forward FLOP: forward, then the backward's two products per product.
TRAINING = 3.0

# Families whose MLP is a plain up/down pair (no gate); everything else is gated (SwiGLU).
_PLAIN_MLP = ("gpt2", "gpt_neox", "gptj", "opt", "phi", "bloom", "falcon", "starcoder2")


def _get(config: Any, key: str, default: Any = None) -> Any:
    value = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
    return default if value is None else value


def _need(config: Any, key: str, where: str) -> int:
    value = _get(config, key)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise FastpackError(
            f"config: {where}{key} is {value!r}; expected a positive integer (pass the "
            f"model's config: model.config)"
        )
    return int(value)


@dataclass(frozen=True, repr=False)
class CostModel:
    """Training FLOPs of a sequence (and of an image's frames) for one model.

    Build it with :meth:`from_config` (a Hugging Face config or its dict) or
    :meth:`from_hidden_size` (the older ``6·h·l + l²`` estimate, in its own units).
    ``linear``, ``quadratic`` and ``windows`` are the coefficients of the module docs;
    ``layers`` counts the layers by kind, for the repr.
    """

    linear: float
    quadratic: float
    #: ``(w, c_w)``: sliding-window layers of window ``w`` (sorted by ``w``).
    windows: tuple[tuple[int, float], ...] = ()
    vision_linear: float = 0.0
    vision_quadratic: float = 0.0
    name: str = "model"
    layers: tuple[tuple[str, int], ...] = field(default=())

    def __post_init__(self) -> None:
        for key in ("linear", "quadratic", "vision_linear", "vision_quadratic"):
            value = getattr(self, key)
            if not np.isfinite(value) or value < 0:
                raise FastpackError(f"{key}: expected a finite non-negative number, got {value!r}")

    # ---------------------------------------------------------------- build
    @classmethod
    def from_hidden_size(cls, hidden_size: int) -> CostModel:
        """The estimate ``6·h·l + l²`` of a transformer of width ``h`` (a layer's forward
        FLOPs over ``4h``: ``24h²`` per token in its products, ``4h·l`` in attention), in
        those units. What ``PackedSampler(hidden_size=h)`` balances."""
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, (int, np.integer)) \
                or hidden_size < 1:
            raise FastpackError(f"hidden_size: expected a positive integer, got {hidden_size!r}")
        return cls(linear=6.0 * int(hidden_size), quadratic=1.0,
                   name=f"hidden_size={int(hidden_size)}")

    @classmethod
    def from_config(cls, config: Any) -> CostModel:
        """The cost model of ``config`` (``model.config``, or its ``to_dict()``). Reads
        the text model (``text_config`` when there is one) layer by layer
        (``layer_types``, ``sliding_window``, MoE and hybrid settings) and, when the config
        has a ``vision_config``, the vision encoder (Qwen2-VL family). A config missing a
        width or depth raises, naming the key."""
        if isinstance(config, CostModel):
            return config
        if config is None or isinstance(config, (str, bytes, int, float)):
            raise FastpackTypeError(
                f"config: expected a Hugging Face model config (model.config) or its dict, "
                f"got {type(config).__name__}"
            )
        text = _get(config, "text_config") or config
        model_type = str(_get(config, "model_type", "model"))
        forward_linear, pair_cost, kinds = _text(text, model_type)
        # Attention pairs: l(l+1)/2 = l²/2 + l/2 per full layer; a window w removes
        # the pairs of the first max(l − w, 0) queries' older keys: m(m+1)/2.
        full_pairs = sum(c for w, c in pair_cost)
        by_window: dict[int, float] = {}
        for w, c in pair_cost:
            if w:
                by_window[w] = by_window.get(w, 0.0) + c
        vision = _get(config, "vision_config")
        v_lin = v_quad = 0.0
        if vision is not None:
            v_lin, v_quad = _vision(vision)
        return cls(
            linear=TRAINING * (forward_linear + full_pairs / 2),
            quadratic=TRAINING * full_pairs / 2,
            windows=tuple((w, TRAINING * c / 2) for w, c in sorted(by_window.items())),
            vision_linear=TRAINING * v_lin, vision_quadratic=TRAINING * v_quad,
            name=model_type, layers=tuple(sorted(kinds.items())),
        )

    # ---------------------------------------------------------------- costs
    def sequence_flops(self, lengths: Any) -> np.ndarray:
        """Training FLOPs of each sequence of ``lengths`` (float64, same shape)."""
        x = np.asarray(lengths, dtype=np.float64)
        return self._less_windows(x, self.polynomial(x, x * x))

    def window_flops(self, lengths: Any) -> np.ndarray:
        """The window corrections alone (``≤ 0``, float64): ``sequence_flops`` minus its
        polynomial part; zeros for sequences no longer than the smallest window."""
        x = np.asarray(lengths, dtype=np.float64)
        return self._less_windows(x, np.zeros(x.shape, dtype=np.float64))

    def polynomial(self, tokens: Any, squared: Any) -> np.ndarray:
        """``linear·tokens + quadratic·squared`` (float64): the cost of sequences (or of
        steps: ``tokens`` their Σl, ``squared`` their Σl²) without the window corrections."""
        return self.linear * np.asarray(tokens, dtype=np.float64) + self.quadratic * np.asarray(
            squared, dtype=np.float64)

    def _less_windows(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``out`` minus the window corrections of sequences of lengths ``x``, in place."""
        for w, c in self.windows:
            m = np.maximum(x - w, 0.0)
            out -= c * m * (m + 1.0)
        return out

    def image_flops(self, patches: Any) -> np.ndarray:
        """Training FLOPs of the vision encoder for frames of ``patches`` patches each
        (an image is one frame of ``h·w`` patches of its ``grid_thw``; a video ``t``
        frames). Zeros for a model without a vision encoder."""
        p = np.asarray(patches, dtype=np.float64)
        return self.vision_linear * p + self.vision_quadratic * (p * p)

    @property
    def key(self) -> str:
        """A short digest of the coefficients: equal keys, equal costs."""
        text = repr((self.linear, self.quadratic, self.windows, self.vision_linear,
                     self.vision_quadratic))
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    def __repr__(self) -> str:
        parts = [f"{self.linear:.4g}·l", f"{self.quadratic:.4g}·l²"]
        parts += [f"− {c:.4g}·m(m+1) [m = l − {w}]" for w, c in self.windows]
        text = f"CostModel({self.name}: " + " + ".join(parts[:2]) + "".join(
            " " + p for p in parts[2:])
        if self.vision_linear or self.vision_quadratic:
            text += f"; per frame {self.vision_linear:.4g}·p + {self.vision_quadratic:.4g}·p²"
        if self.layers:
            text += "; layers " + ", ".join(f"{n} {k}" for k, n in self.layers)
        return text + ")"


#: ``layer_types`` values of transformers' configs and the mixer each names: ``conv`` is
#: LFM2's short convolution; ``chunked`` Llama 4's attention within chunks of
#: ``attention_chunk_size`` (counted as a window of that size: an upper bound, at most
#: twice the pairs); ``hybrid`` attention and a Mamba2 mixer side by side (Falcon-H1).
LAYER_KINDS = {"full_attention": "full", "attention": "full", "sliding_attention": "sliding",
               "linear_attention": "delta", "mamba": "mamba", "mamba2": "mamba",
               "conv": "conv", "chunked_attention": "chunked", "hybrid": "hybrid"}


def _layer_kinds(text: Any, n: int) -> list[str]:
    """Each layer's token mixer: ``full``, ``sliding``, ``chunked``, ``mamba``, ``delta``,
    ``conv`` or ``hybrid`` (see :data:`LAYER_KINDS`)."""
    types = _get(text, "layer_types")
    if types is None:
        types = _get(text, "layers_block_type")  # Falcon-H1: every layer "hybrid"
    if types is not None and len(types) == n:
        names = LAYER_KINDS
        out = []
        for t in types:
            if t not in names:
                raise FastpackError(f"config: layer_types holds {t!r}, a kind fastpack's cost "
                                    f"model does not know; expected one of {sorted(names)}")
            out.append(names[t])
        if _get(text, "model_type") in ("bamba", "nemotron_h", "falcon_h1", "granitemoehybrid"):
            out = ["mamba" if k == "delta" else k for k in out]
        return out
    attn = _get(text, "attn_layer_indices")
    if _get(text, "mamba_n_heads") is not None or attn is not None:  # Bamba-style hybrids
        attn = set(attn or ())
        return ["full" if i in attn else "mamba" for i in range(n)]
    window = _get(text, "sliding_window")
    sliding = window is not None and _get(text, "use_sliding_window", True)
    return ["sliding" if sliding else "full"] * n


@dataclass(frozen=True)
class _Moe:
    """A text config's mixture of experts: how many, how many a token visits, their width,
    the shared experts' width (0: none) and which layers have them."""

    experts: int
    top_k: int
    inter: int
    shared: int
    step: int
    dense_only: frozenset[int]
    first_dense: int

    @classmethod
    def of(cls, text: Any, inter: int) -> _Moe:
        experts = int(_get(text, "num_experts", 0) or _get(text, "num_local_experts", 0)
                      or _get(text, "n_routed_experts", 0))
        moe_inter = int(_get(text, "moe_intermediate_size", inter))
        shared = int(_get(text, "shared_expert_intermediate_size", 0))
        if _get(text, "n_shared_experts"):
            shared = int(_get(text, "n_shared_experts")) * moe_inter
        return cls(experts, int(_get(text, "num_experts_per_tok", 0)), moe_inter, shared,
                   max(int(_get(text, "decoder_sparse_step", 1)), 1),
                   frozenset(_get(text, "mlp_only_layers", ()) or ()),
                   int(_get(text, "first_k_dense_replace", 0)))

    def is_moe(self, layer: int) -> bool:
        return (self.experts > 0 and self.top_k > 0 and layer not in self.dense_only
                and layer >= self.first_dense and (layer + 1) % self.step == 0)


def _text(text: Any, model_type: str) -> tuple[float, list[tuple[int, float]], dict[str, int]]:
    """Forward FLOPs per token of the products, each attention layer's ``(window or 0,
    FLOPs per (query, key) pair)``, and the layer counts."""
    h = _need(text, "hidden_size", "")
    n = _need(text, "num_hidden_layers", "")
    heads = _need(text, "num_attention_heads", "")
    kv = int(_get(text, "num_key_value_heads", heads))
    d = int(_get(text, "head_dim", h // heads))
    inter = int(_get(text, "intermediate_size", 4 * h))
    if _get(text, "block_auto_adjust_ff_dim", False):
        # LFM2's MLP: 2/3 of intermediate_size, times a multiplier, rounded up.
        inter = int(2 * inter / 3)
        if _get(text, "block_ffn_dim_multiplier") is not None:
            multiple = int(_get(text, "block_multiple_of", 256))
            inter = int(float(_get(text, "block_ffn_dim_multiplier")) * inter)
            inter = multiple * (-(-inter // multiple))
    vocab = int(_get(text, "vocab_size", 0))
    mlp_type = str(_get(text, "model_type", model_type))
    gated = 3 if mlp_type not in _PLAIN_MLP else 2
    # Qwen3-Next's attention projects a gate of the same width as the queries.
    q_width = heads * d * (2 if mlp_type == "qwen3_next" else 1)
    attention = 2 * h * (q_width + 2 * kv * d) + 2 * heads * d * h

    m = _Moe.of(text, inter)
    experts, top_k, moe_inter, shared = m.experts, m.top_k, m.inter, m.shared
    moe = (2 * h * experts                      # router
           + top_k * gated * 2 * h * moe_inter  # the routed experts a token visits
           + (gated * 2 * h * shared + 2 * h if shared else 0))  # shared expert, its gate
    dense = gated * 2 * h * inter

    window = int(_get(text, "sliding_window") or 0)
    chunk = int(_get(text, "attention_chunk_size") or 0)
    kinds = _layer_kinds(text, n)
    counts: dict[str, int] = {}
    per_token = 2.0 * h * vocab  # the LM head (the embedding is a lookup)
    pairs: list[tuple[int, float]] = []
    for i, kind in enumerate(kinds):
        is_moe = m.is_moe(i)
        per_token += moe if is_moe else dense
        if kind in ("full", "sliding", "chunked", "hybrid"):
            per_token += attention
            span = {"sliding": window, "chunked": chunk}.get(kind, 0)
            pairs.append((span, 4.0 * heads * d))
        if kind in ("mamba", "hybrid"):
            per_token += _mamba(text, h)
        elif kind == "conv":
            per_token += _short_conv(text, h)
        elif kind == "delta":
            per_token += _delta(text, h)
        label = f"{kind}{'+moe' if is_moe else ''}"
        counts[label] = counts.get(label, 0) + 1
    return per_token, pairs, counts


def _mamba(text: Any, h: int) -> float:
    """A Mamba2 mixer's forward FLOPs per token: projections, the depthwise causal
    convolution, and the chunked scan (SSD: within a chunk of ``Q`` an attention-like
    ``C·Bᵀ`` and its product with ``x``; each chunk's state and its read-out)."""
    heads = _need(text, "mamba_n_heads", "")
    p = _need(text, "mamba_d_head", "")
    n_state = _need(text, "mamba_d_state", "")
    groups = int(_get(text, "mamba_n_groups", 1))
    conv_k = int(_get(text, "mamba_d_conv", 4))
    chunk = int(_get(text, "mamba_chunk_size", 256))
    inner = int(_get(text, "mamba_d_ssm") or _get(text, "mamba_expand", 2) * h)
    conv = inner + 2 * groups * n_state
    projections = 2 * h * (inner + conv + heads) + 2 * inner * h
    scan = 2 * heads * chunk * (n_state + p) + 4 * heads * p * n_state
    return float(projections + 2 * conv_k * conv + scan)


def _short_conv(text: Any, h: int) -> float:
    """LFM2's short convolution's forward FLOPs per token: ``in_proj`` (``h`` to ``3h``:
    two gates and the input), a depthwise causal convolution of ``conv_L_cache`` taps
    over ``h`` channels, ``out_proj`` (``h`` to ``h``)."""
    taps = int(_get(text, "conv_L_cache", 3))
    return float(2 * h * 3 * h + 2 * taps * h + 2 * h * h)


def _delta(text: Any, h: int) -> float:
    """A gated delta net's forward FLOPs per token (chunked form, chunk 64 as in fla):
    projections, the causal convolution, and per value head within a chunk ``K·Kᵀ``,
    ``Q·Kᵀ``, the two triangular solves, the state reads and update."""
    kh = _need(text, "linear_num_key_heads", "")
    vh = _need(text, "linear_num_value_heads", "")
    dk = _need(text, "linear_key_head_dim", "")
    dv = _need(text, "linear_value_head_dim", "")
    conv_k = int(_get(text, "linear_conv_kernel_dim", 4))
    chunk = 64
    key, value = kh * dk, vh * dv
    conv = 2 * key + value
    projections = 2 * h * (2 * key + 2 * value) + 2 * h * 2 * vh + 2 * value * h
    scan = vh * (4 * chunk * dk + chunk * (dk + dv) + 2 * chunk * dv + 6 * dk * dv)
    return float(projections + 2 * conv_k * conv + scan)


def _vision(vision: Any) -> tuple[float, float]:
    """Forward FLOPs per patch and per patch² of a frame, Qwen2-VL's encoder: the patch
    embedding, ``depth`` blocks (qkv, projection, MLP of ``mlp_ratio``; attention within
    the frame), and the merger of ``spatial_merge_size²`` patches."""
    width = _get(vision, "embed_dim") or _get(vision, "hidden_size")
    if not width:
        raise FastpackError("config: vision_config has no embed_dim or hidden_size")
    e = int(width)
    depth = int(_get(vision, "depth") or _get(vision, "num_hidden_layers") or 0)
    if depth < 1:
        raise FastpackError("config: vision_config has no depth or num_hidden_layers")
    ratio = float(_get(vision, "mlp_ratio", 4))
    mlp = int(_get(vision, "intermediate_size") or e * ratio)
    # Qwen2.5-VL's encoder MLP is gated (gate, up, down); Qwen2-VL's is fc1, fc2. Its
    # windowed layers are counted as full attention within the frame: an upper bound.
    gated = 3 if _get(vision, "intermediate_size") else 2
    patch = int(_get(vision, "patch_size", 14))
    temporal = int(_get(vision, "temporal_patch_size", 1))
    channels = int(_get(vision, "in_channels", 3))
    merge = int(_get(vision, "spatial_merge_size", 1))
    out = int(_get(vision, "out_hidden_size")
              or (_get(vision, "hidden_size", e) if _get(vision, "embed_dim") else e))
    embed = 2 * channels * temporal * patch * patch * e
    block = 2 * e * 3 * e + 2 * e * e + gated * 2 * e * mlp
    merger = 2 * e * merge * merge * e + 2 * e * out  # per patch: (e·m²)² / m² + e·m²·out / m²
    return float(embed + depth * block + merger), float(depth * 4 * e)
