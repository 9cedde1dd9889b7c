"""Every causal-LM architecture the installed transformers registers, built tiny and run on
a packed batch: the sweep behind tests/test_architectures.py.

:func:`tiny_config` shrinks each architecture's *default* config (its own defaults, so the
sweep follows transformers as it grows) with one generic rule per kind of size — width,
depth, heads, head dims, vocabulary, experts, windows, state sizes, per-layer lists — and
a few per-family overrides where a family ties its sizes together in its own way.
:func:`run` packs three samples of different lengths with
:class:`~fastpack.torch.PackedCollator` and says what fastpack makes of it: each sample's
logits equal to the sample run alone (``EXACT``), refused before the forward by a
:class:`~fastpack.FastpackError` (``REFUSED``), or different (``SILENT``, a bug).

Run it on its own for the whole table (markdown)::

    PYTHONPATH=python python3 tests/architectures.py [name ...]
"""

from __future__ import annotations

import contextlib
import io
import math
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import CONFIG_MAPPING, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import fastpack.torch
from fastpack import FastpackError
from fastpack.torch import PackedCollator, check_model_batch, register_hf_attention

FASTPACK = register_hf_attention()

#: Every ``model_type`` the installed transformers maps to a causal-LM class.
ARCHITECTURES: tuple[str, ...] = tuple(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))

#: Three samples, each longer than :data:`WINDOW` and of a different length, token ids
#: below :data:`VOCAB` and above the special tokens the shrunk configs keep.
LENGTHS = (6, 11, 8)
VOCAB = 128
WINDOW = 4
HIDDEN = 32
HEADS = 2
HEAD_DIM = 16
FFN = 64
EXPERTS = 4
#: fp32 logits: a packed sample equals the sample alone to this (a leak across a
#: sequence boundary moves them by 1e-4 or far more even in these tiny models).
ATOL = 1e-5

#: Batch formats the sweep runs, by the PackedCollator backend that makes them, and the
#: attention implementation each runs under (fastpack's for ``flash``, Hugging Face's own
#: sdpa for the rows of restarting ``position_ids``).
FORMATS = {"flash": FASTPACK, "sdpa": "sdpa"}


def samples() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(8, 100, (n,), generator=gen).tolist() for n in LENGTHS]


# --- the tiny config ---------------------------------------------------------------------

_HIDDEN_KEYS = {"hidden_size", "d_model", "n_embd", "dim", "embed_dim", "hidden_dim",
                "word_embed_proj_dim", "embedding_size", "embedding_dim", "lru_width",
                "attention_hidden_size", "input_embedding_size", "output_embedding_size",
                "backbone_hidden_size", "emb_dim", "hidden_size_global", "adapter_in_dim", "adapter_input_size",
                "adapter_out_dim"}
_LAYER_KEYS = {"num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers",
               "encoder_layers", "num_decoder_layers", "num_encoder_layers", "num_blocks"}
_HEAD_KEYS = {"num_attention_heads", "n_head", "n_heads", "num_heads",
              "decoder_attention_heads", "encoder_attention_heads", "attention_heads",
              "swa_num_attention_heads", "num_decoder_attention_heads",
              "num_encoder_attention_heads", "index_n_heads", "index_num_heads",
              "linear_num_heads", "linear_num_key_heads", "linear_num_value_heads",
              "heads_per_ngram"}
#: Mamba2 heads: heads x head dim must be the inner width (expand x hidden).
_MAMBA_HEAD_KEYS = {"mamba_n_heads", "mamba_num_heads", "n_mamba_heads"}
_KV_HEAD_KEYS = {"num_key_value_heads", "num_kv_heads", "n_kv_heads",
                 "swa_num_key_value_heads", "num_query_groups"}
_HEAD_DIM_KEYS = {"head_dim", "swa_head_dim", "attention_head_dim", "linear_key_head_dim",
                  "linear_value_head_dim", "linear_head_dim", "d_head", "dim_head",
                  "kv_channels", "attention_head_size", "mamba_d_head", "mamba_head_dim",
                  "mamba_headdim", "index_head_dim", "v_head_dim", "qk_head_dim"}
_RANK_KEYS = {"q_lora_rank", "kv_lora_rank", "o_lora_rank", "adapter_rank", "laurel_rank",
              "loop_gate_rank", "gated_norm_rank", "hc_lowrank", "mamba_dt_rank",
              "time_step_rank", "router_hidden_size"}
_EXPERT_KEYS = {"num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"}
_TOPK_KEYS = {"num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k"}
_WINDOW_KEYS = {"sliding_window", "sliding_window_size", "window_size",
                "attention_window_size", "local_attention_window_len",
                "attention_chunk_size"}
_STATE_KEYS = {"mamba_d_state", "state_size", "ssm_state_size", "d_state"}
_CHUNK_KEYS = {"chunk_size", "mamba_chunk_size", "block_size"}
_POSITION_KEYS = {"max_position_embeddings", "n_positions", "n_ctx", "max_seq_len",
                  "context_length", "max_target_positions", "max_source_positions",
                  "model_max_length"}
#: Per-layer lists that name each layer's kind: the layers kept keep every kind.
_KIND_LISTS = ("layer_types", "mlp_layer_types", "layers_block_type", "block_types")
#: Lists of layer indices.
_INDEX_LISTS = ("full_attn_idxs", "hybrid_layer_ids", "attn_layer_indices",
                "mlp_only_layers", "no_rope_layers", "index_layers", "ple_layer_ids")
#: Sizes a default config may leave unset although the model needs them.
_NEEDED = {**dict.fromkeys(_TOPK_KEYS, 2), **dict.fromkeys(_EXPERT_KEYS, EXPERTS),
           **dict.fromkeys(_KV_HEAD_KEYS, HEADS), "head_dim": HEAD_DIM,
           "n_shared_experts": 1}


def _shrink_value(key: str, value: Any, original: dict[str, Any]) -> Any:
    if value is None and key in _NEEDED:
        return _NEEDED[key]
    if isinstance(value, bool) or not isinstance(value, int):
        return value
    if key in _HIDDEN_KEYS:
        return HIDDEN
    if key in _LAYER_KEYS:
        return 2
    if key in _HEAD_KEYS:
        return HEADS
    if key in _MAMBA_HEAD_KEYS:
        return 2 * HIDDEN // HEAD_DIM
    if key in ("n_groups", "mamba_n_groups", "ngroups", "num_groups"):
        return 1
    if key == "mamba_d_ssm":
        return 2 * HIDDEN
    if key in ("moe_layer_end_index", "num_dense_layers", "first_k_dense_replace"):
        return min(value, 1)
    if key in _KV_HEAD_KEYS:
        heads = next((original[k] for k in ("num_attention_heads", "n_head", "num_heads")
                      if isinstance(original.get(k), int)), None)
        return HEADS if value == heads else 1
    if key in _HEAD_DIM_KEYS:
        return HEAD_DIM
    if key in _RANK_KEYS:
        return 16
    if key in ("qk_rope_head_dim", "qk_nope_head_dim", "rotary_dim", "rotary_emb_base_dim"):
        return 8
    if key in _EXPERT_KEYS:
        return EXPERTS
    if key in _TOPK_KEYS:
        return 2
    if key in ("n_group", "topk_group", "num_expert_group", "topk_groups"):
        return 1
    if key in _WINDOW_KEYS:
        return WINDOW
    if key in _STATE_KEYS:
        return 8
    if key in _CHUNK_KEYS:
        return 4
    if key in _POSITION_KEYS:
        return min(value, 256)
    if key == "index_topk":
        return WINDOW
    if "vocab_size" in key or key.endswith("_vocab"):
        return min(value, VOCAB)
    if "intermediate" in key or "ffn" in key or key in ("n_inner", "dff", "dim_ff",
                                                          "feed_forward_size", "d_inner"):
        return FFN // 2 if "moe" in key or "expert" in key or "shared" in key else FFN
    if (key.endswith("_token_id") or key.endswith("_token_index")) and value >= VOCAB:
        return VOCAB - 1 - (value % 16)
    return value


def _layers_kept(d: dict[str, Any]) -> list[int] | None:
    """Indices of the layers to keep: the first of each kind in every per-layer list, at
    least two."""
    lists = [d[k] for k in _KIND_LISTS if isinstance(d.get(k), list) and d[k]]
    if not lists:
        return None
    n = min(len(x) for x in lists)
    keep: list[int] = []
    for lst in lists:
        seen: set[str] = set()
        for i in range(n):
            if str(lst[i]) not in seen:
                seen.add(str(lst[i]))
                if i not in keep:
                    keep.append(i)
    for i in range(n):
        if len(keep) >= 2:
            break
        if i not in keep:
            keep.append(i)
    return sorted(keep)


def _depth(d: dict[str, Any]) -> int | None:
    return next((d[k] for k in sorted(_LAYER_KEYS) if isinstance(d.get(k), int)
                 and not isinstance(d[k], bool)), None)


def shrink(d: dict[str, Any]) -> dict[str, Any]:
    """The generic rule on one config's dict (recursing into sub-configs)."""
    out: dict[str, Any] = {}
    depth = _depth(d)
    keep = _layers_kept(d)
    if keep is None and depth is not None:
        keep = list(range(min(depth, 2)))
    for key, value in d.items():
        if key == "per_layer_config" and isinstance(value, dict) and keep is not None:
            out[key] = {str(keep.index(int(i))): shrink(v) for i, v in value.items()
                        if int(i) in keep}
        elif isinstance(value, dict) and key not in ("id2label", "label2id"):
            out[key] = shrink(value) if _looks_like_config(value) else value
        elif isinstance(value, list) and key in _INDEX_LISTS and keep is not None:
            out[key] = [keep.index(i) for i in value if i in keep]
        elif isinstance(value, list) and keep is not None and (
                key in _KIND_LISTS or (depth is not None and depth > 1 and len(value) == depth)):
            # One entry per layer: those of the layers kept, each shrunk as its key says.
            base = key.replace("_per_layer", "").replace("_list", "")
            out[key] = [_shrink_value(base, value[i], d) for i in keep if i < len(value)]
        elif isinstance(value, list) and (key.endswith("_token_id")):
            out[key] = [_shrink_value(key, v, d) for v in value]
        else:
            out[key] = _shrink_value(key, value, d)
    if keep is not None:
        for key in _LAYER_KEYS & out.keys():
            out[key] = len(keep)
    # Multi-head latent attention: rope dims are the head dim where the family says so.
    if isinstance(d.get("qk_rope_head_dim"), int):
        if d.get("head_dim") == d["qk_rope_head_dim"]:
            out["head_dim"] = out["qk_rope_head_dim"]
        if isinstance(d.get("qk_nope_head_dim"), int) and "qk_head_dim" in d:
            out["qk_head_dim"] = out["qk_rope_head_dim"] + out["qk_nope_head_dim"]
    return out


def _looks_like_config(d: dict[str, Any]) -> bool:
    return any(k in d for k in ("hidden_size", "vocab_size", "d_model", "model_type"))


#: Per-family changes on top of :func:`shrink` (the shrunk dict, changed in place), where
#: a family ties sizes together its own way.
OVERRIDES: dict[str, Callable[[dict[str, Any]], None]] = {}


def _override(*names: str) -> Callable[[Callable[[dict[str, Any]], None]],
                                       Callable[[dict[str, Any]], None]]:
    def add(fn: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
        for name in names:
            OVERRIDES[name] = fn
        return fn
    return add


def _set(**values: Any) -> Callable[[dict[str, Any]], None]:
    return lambda d: d.update(values)


# Hybrids whose default config has no attention layer in its first layers (or none at
# all): one of each kind.
OVERRIDES["bamba"] = _set(attn_layer_indices=[1])
OVERRIDES["granitemoehybrid"] = _set(layer_types=["mamba", "attention"])
OVERRIDES["lfm2_moe"] = _set(layer_types=["conv", "full_attention"])
# A default without the sparse (indexed) layer kind: one of each.
OVERRIDES["minimax_m3_vl_text"] = _set(layer_types=["full_attention", "minimax_m3_sparse"],
                                       index_block_size=2, index_topk_blocks=2)
OVERRIDES["lfm2"] = _set(layer_types=["conv", "full_attention"], full_attn_idxs=[1])
OVERRIDES["jamba"] = _set(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                          expert_layer_offset=1)
# Mamba2: heads x head dim = expand x hidden.
OVERRIDES["mamba2"] = _set(num_heads=2 * HIDDEN // HEAD_DIM)
# Derived in __post_init__ from the hidden size (the attention block reads
# [hidden, embeddings] concatenated).
OVERRIDES["zamba2"] = _set(attention_hidden_size=2 * HIDDEN, attention_head_dim=2 * HIDDEN // HEADS,
                           mamba_headdim=HEAD_DIM, kv_channels=HIDDEN // HEADS)
OVERRIDES["zamba"] = _set(layers_block_type=["mamba", "hybrid", "hybrid"],
                          num_hidden_layers=3, attention_hidden_size=2 * HIDDEN,
                          attention_head_dim=2 * HIDDEN // HEADS)
OVERRIDES["dory"] = _set(layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                         num_hidden_layers=3, n_input_layers=1, n_recurrent_layers=1,
                         n_output_layers=1)
OVERRIDES["hrm_text"] = _set(num_layers_per_stack=None, num_hidden_layers=1)
OVERRIDES["cohere_compass_text"] = _set(
    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}})
OVERRIDES["qwen4_exp_text"] = _set(indexer_n_heads=HEADS, indexer_kv_heads=1,
                                   indexer_head_dim=HEAD_DIM, indexer_budget=WINDOW,
                                   indexer_compress_ratio=2)
# Per-layer indices of layers: derived again from the layers kept.
# Its indexer's budgets below the samples' lengths (the defaults select every key).
OVERRIDES["kolibri1_1"] = _set(index_layers=None, kv_source_layers=None, index_topk=2,
                               index_pool_size=4, index_compression=2,
                               index_num_local_tokens=1, index_num_sink_tokens=1)
OVERRIDES["gemma3n_text"] = _set(num_kv_shared_layers=0)
OVERRIDES["zaya"] = _set(num_experts_per_tok=1)
#: Defaults that do not build as they are (transformers' validator refuses them).
DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0,
                                         "vocab_size_per_layer_input": 0}}}


@_override("gemma3n")
def _gemma3n(d: dict[str, Any]) -> None:
    d["text_config"]["num_kv_shared_layers"] = 0


OVERRIDES["reformer"] = _set(is_decoder=True, axial_pos_shape=[8, 8],
                             axial_pos_embds_dim=[HIDDEN // 2, HIDDEN // 2],
                             local_attn_chunk_length=8, lsh_attn_chunk_length=8,
                             max_position_embeddings=64, attention_head_size=HEAD_DIM)
# xLSTM's cache rounds its qk and v widths up to multiples of 64, its layers do not: the
# smallest width where both agree.
OVERRIDES["xlstm"] = _set(hidden_size=128, embedding_dim=128)


@_override("dbrx")
def _dbrx(d: dict[str, Any]) -> None:
    d["attn_config"].update(rope_theta=10000.0, clip_qkv=8.0)
    d["ffn_config"]["hidden_size"] = HIDDEN


@_override("qwen4_exp")
def _qwen4_exp(d: dict[str, Any]) -> None:
    OVERRIDES["qwen4_exp_text"](d["text_config"])


@_override("gpt_neo")
def _gpt_neo(d: dict[str, Any]) -> None:
    d["attention_types"] = [[["global", "local"], 1]]
    d.pop("attention_layers", None)


def tiny_config(name: str) -> Any:
    cls = CONFIG_MAPPING[name]
    d = shrink(cls(**DEFAULTS.get(name, {})).to_dict())
    if name in OVERRIDES:
        OVERRIDES[name](d)
    for key in ("transformers_version", "architectures", "_name_or_path", "model_type"):
        d.pop(key, None)
    return cls(**d)


#: Architectures the sweep cannot build tiny or run a sample alone on, and why. Reviewed:
#: each is a limit of the sweep's input, not a packing result.
SKIPS: dict[str, str] = {
    "musicgen": "input_ids are audio codebooks ([batch x codebooks, T]), not a text sample",
    "musicgen_melody": "input_ids are audio codebooks ([batch x codebooks, T]), not a text "
                       "sample",
    "gemma4_assistant": "a drafting head: its layers share the K/V cache of the main model "
                        "(num_kv_shared_layers = all), nothing runs alone",
    "gemma4_unified_assistant": "a drafting head: its layers share the K/V cache of the "
                                "main model (num_kv_shared_layers = all), nothing runs alone",
    "gemma3n": "its vision tower needs timm (not installed); gemma3n_text is the same text "
               "model",
}


def tiny_model(name: str) -> Any:
    torch.manual_seed(0)
    with quiet():
        model = AutoModelForCausalLM.from_config(tiny_config(name), attn_implementation="eager")
    if name == "xmod":  # adapters per language: one must be chosen
        model.set_default_language(model.config.languages[0])
    return model.float().eval()


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """transformers' warnings about the tiny configs and the packed inputs silenced, and one
    thread: tiny matrices on many threads spend their time waiting for each other (15x
    slower on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    verbosity = transformers.logging.get_verbosity()
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)
            transformers.logging.set_verbosity(verbosity)


# --- the run -------------------------------------------------------------------------------

#: Keys of a batch that only say which tokens are whose (not model inputs).
_BOOKKEEPING = ("labels", "sample_ids", "sample_tokens", "sample_offsets")

#: fastpack's preparation of a model's mixers for packed batches, where this fastpack has
#: one (``prepare_model``), and its proof on a batch (``verify_packing``).
PREPARE: Callable[[Any], Any] | None = getattr(fastpack.torch, "prepare_model", None)
VERIFY: Callable[..., Any] | None = getattr(fastpack.torch, "verify_packing", None)


@dataclass
class Outcome:
    """``EXACT``; ``REFUSED`` (by fastpack, or by transformers: a ``ValueError`` it raises
    on purpose); ``SILENT`` (a packed sample differs from it alone by ``diff``); ``CRASH``
    (any other exception in the forward). ``verified``: where the model computed the batch
    and this fastpack has ``verify_packing``, ``""`` if it passed, else its message."""

    status: str
    detail: str = ""
    diff: float = 0.0
    verified: str | None = None

    def __str__(self) -> str:
        if self.status == "SILENT":
            return f"SILENT({self.diff:.2e}; {self.detail})"
        return f"{self.status}({self.detail})" if self.detail else self.status


def mixers(model: Any) -> str:
    """The classes of the modules that mix tokens along the sequence (attention,
    recurrences, convolutions), for the table."""
    words = ("attention", "attn", "mixer", "mamba", "conv", "recurren", "rwkv", "lstm",
             "ssm", "delta", "rglru")
    names: list[str] = []
    for module in model.modules():
        cls = type(module).__name__
        low = cls.lower()
        if any(w in low for w in words) and cls not in names and not low.endswith(
                ("model", "forcausallm", "lmheadmodel", "decoderlayer", "block", "norm",
                 "mlp", "embedding", "gate", "residual", "gated")):
            names.append(cls)
    return ", ".join(names)


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


def build(name: str) -> tuple[Any, list[torch.Tensor]]:
    """The tiny model (prepared for packed batches where fastpack can) and each sample's
    logits run alone through it with Hugging Face's eager attention."""
    model = tiny_model(name)
    if PREPARE is not None:
        PREPARE(model)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        # No cache, as in training (and as the packed batches ask).
        alone = [model(input_ids=torch.tensor([s]), use_cache=False).logits[0]
                 for s in samples()]
    return model, alone


def _set_attention(model: Any, impl: str) -> str:
    """``impl``, or eager where transformers has no ``impl`` for the model (a user of that
    model feeds the batch to its eager attention)."""
    try:
        model.set_attn_implementation(impl)
        return impl
    except (ValueError, ImportError):
        model.set_attn_implementation("eager")
        return "eager"


def run(model: Any, fmt: str, alone: list[torch.Tensor]) -> Outcome:
    """One batch format on one model: what fastpack makes of it."""
    batch = PackedCollator(max_len=64, backend=fmt)([{"input_ids": s} for s in samples()])
    impl = _set_attention(model, FORMATS[fmt])
    via = "" if impl == FORMATS[fmt] else " (eager: transformers has no " + FORMATS[fmt] + ")"
    try:
        check_model_batch(model, batch)
    except FastpackError as e:
        return Outcome("REFUSED", str(e) + via)
    inputs = {k: v for k, v in batch.items() if k not in _BOOKKEEPING}
    try:
        with torch.no_grad():
            logits = model(**inputs).logits
            packed = logits.reshape(-1, logits.shape[-1])
    except FastpackError as e:
        return Outcome("REFUSED", f"in the forward: {e}{via}")
    except ValueError as e:  # transformers refuses the packed inputs on purpose
        return Outcome("REFUSED", f"transformers, in the forward: {_first_line(e)}{via}")
    except Exception as e:  # noqa: BLE001 - a crash is a finding, reported as one
        return Outcome("CRASH", _first_line(e) + via)
    worst = 0.0
    offsets = batch["sample_offsets"].tolist()
    tokens = batch["sample_tokens"]
    for j, sid in enumerate(batch["sample_ids"].tolist()):
        ref = alone[sid]
        got = packed[tokens[offsets[j]:offsets[j + 1]]]  # the sample's row positions
        worst = max(worst, (got - ref).abs().max().item())
    scale = max(1.0, max(a.abs().max().item() for a in alone))
    verified = None
    if VERIFY is not None:
        try:
            VERIFY(model, batch)
            verified = ""
        except FastpackError as e:
            verified = str(e)
    if math.isfinite(worst) and worst <= ATOL * scale:
        return Outcome("EXACT", via.strip(), worst, verified)
    # verify_packing names the module; without it (or where it misses), the candidates.
    named = verified.removeprefix("verify_packing: ").split(": sample")[0][:120] \
        if verified else mixers(model)
    return Outcome("SILENT", named + via, worst, verified)


def check(name: str) -> dict[str, Outcome]:
    """Every format on one architecture (``{"build": CRASH}`` where it does not build)."""
    try:
        model, alone = build(name)
    except Exception as e:  # noqa: BLE001 - reported; SKIPS says which are expected
        return {"build": Outcome("CRASH", _first_line(e))}
    return {fmt: run(model, fmt, alone) for fmt in FORMATS}


def table(names: tuple[str, ...] = ARCHITECTURES) -> Iterator[str]:
    """The sweep as markdown rows: architecture, one cell per format, seconds."""
    yield "| architecture | " + " | ".join(FORMATS) + " | s |"
    yield "|---" * (len(FORMATS) + 2) + "|"
    for name in names:
        if name in SKIPS:
            yield f"| {name} | SKIPPED({SKIPS[name]}) |" + " |" * len(FORMATS)
            continue
        start = time.perf_counter()
        with quiet():
            out = check(name)
        cells = " | ".join(str(o).replace("|", "/").replace("\n", " ") for o in out.values())
        yield f"| {name} | {cells} | {time.perf_counter() - start:.2f} |"


def known(names: tuple[str, ...] = ARCHITECTURES) -> Iterator[str]:
    """The cells that fail (SILENT, CRASH), as entries of test_architectures.KNOWN."""
    for name in names:
        if name in SKIPS:
            continue
        with quiet():
            out = check(name)
        for fmt, o in out.items():
            if o.status == "SILENT":
                why = f"silently different: {o.detail} ({o.diff:.1e})"
            elif o.status == "CRASH":
                why = f"crashes: {o.detail}"
            else:
                continue
            yield f"    ({name!r}, {fmt!r}): {why[:150]!r},"


if __name__ == "__main__":
    args = tuple(a for a in sys.argv[1:] if a != "--known")
    for row in (known if "--known" in sys.argv else table)(args or ARCHITECTURES):
        print(row, flush=True)
