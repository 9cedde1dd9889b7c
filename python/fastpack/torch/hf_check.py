"""Whether a Hugging Face model computes on a packed batch exactly what it computes
unpacked (:func:`check_model_batch`): read from the model's config, its attention
implementation and its modules' source, before any forward runs."""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections.abc import Callable
from typing import Any

import torch

from .._errors import FastpackError, FastpackTypeError
from ..vlm import MROPE_FAMILIES
from .hf_attention import _CONTEXT_PARALLEL, _REGISTERED
from .mixers import _unwrap
from .tree import is_tree_batch

__all__ = ["check_model_batch"]


#: Hugging Face's attention implementations that take a 4-D tensor mask, by mask dtype.
_TENSOR_MASK_IMPLS = {True: ("sdpa",), False: ("sdpa", "eager")}


def _config_of(model: Any) -> Any:
    inner = _unwrap(model)  # DDP / FSDP wrappers, torch.compile
    config = getattr(inner, "config", None)
    if config is None:
        raise FastpackTypeError(
            f"model: expected a Hugging Face model (with a .config), got {type(model).__name__}"
        )
    return config


def _window(config: Any) -> int | None:
    """The model's sliding window where some layer uses one, else ``None``."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def _check_router_loss(config: Any, batch: dict[str, Any], mask: Any,
                       refuse: Callable[[str, str], None]) -> None:
    """Hugging Face's MoE router loss (``output_router_logits=True``) averages over every
    token of the batch that its ``attention_mask`` does not exclude: packed rows padded to
    the longest carry no mask, so their padding would count as tokens routed."""
    if not getattr(config, "output_router_logits", False) or mask is not None:
        return
    real, ids = batch.get("sample_tokens"), batch.get("input_ids")
    if not isinstance(real, torch.Tensor) or not isinstance(ids, torch.Tensor):
        return
    padding = ids.numel() - real.numel()  # sample_tokens: each sample token's place
    if padding > 0 and "tree_parents" not in batch:
        refuse(f"rows holding {padding} padding token(s) and the router's auxiliary loss "
               f"(output_router_logits=True)",
               "Hugging Face averages that loss over every token of the rows, padding "
               "included, with no attention_mask to leave it out: use backend='flash' (one "
               "row, no padding) or output_router_logits=False")


def check_model_batch(model: Any, batch: dict[str, Any]) -> None:
    """Raises a :class:`~fastpack.FastpackError` when ``model(**batch)`` would not compute
    what the unpacked model computes for this batch format and the model's
    ``attn_implementation``; returns ``None`` when it would.

    Call it on the first batch (it is cheap: shapes and dtypes; the data only for
    ``position_ids`` beside a 2-D ``attention_mask``) in a plain training loop;
    :class:`PackedTrainerMixin` calls it on every batch. What it refuses, each silently
    wrong in Hugging Face (fastpack's own attention refuses or handles these itself):

    * an explicit mask (``mask="explicit"``) for an implementation that reads it
      otherwise: a bool mask for ``"eager"`` (added as 0/1), a tensor mask for
      ``"flex_attention"`` or a flex ``BlockMask`` for anything but ``"flex_attention"``;
    * an explicit mask on a model with sliding-window layers whose window is shorter than
      the row (Hugging Face uses a 4-D mask as is, so the window is dropped) — except
      for fastpack's attention, which adds the window from the positions;
    * packed rows (``position_ids`` restarting inside a row) with an ``attention_mask``,
      or with ``use_cache`` on, on a Hugging Face implementation: it then skips the
      per-sequence mask;
    * rows of packed sequences without ``cu_seq_lens_q`` for ``flash_attention_*``, which
      reads the boundaries from the positions of a single row only;
    * a tree batch (``share_prefix=True``) for anything but fastpack's attention and
      ``"flex_attention"`` (and for flex, on sliding-window layers whose window is shorter
      than a path: the batch's ``BlockMask`` has no window).
    * a context-parallel batch (:func:`~fastpack.torch.shard_for_context_parallel`) for
      anything but a context-parallel attention of its mode
      (``register_hf_attention(context_parallel_group=..., mode=...)``) — every other
      attention would attend within one rank's tokens — and an unsharded batch for one;
    * packed rows with padding for an MoE model that returns its router loss
      (``output_router_logits=True``): Hugging Face would average it over the padding;
    * for mRoPE models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): ``position_ids`` of 3 rows (no
      text row: the model then builds no per-document mask) or 2-D beside media (no
      mRoPE for the images); ``PackedCollator(model_config=...)`` gives ``[4, rows,
      width]``.
    """
    if not isinstance(batch, dict):
        raise FastpackTypeError(f"batch: expected a dict, got {type(batch).__name__}")
    config = _config_of(model)
    impl = getattr(config, "_attn_implementation", None) or "eager"
    ours = impl in _REGISTERED
    mask = batch.get("attention_mask")
    positions = batch.get("position_ids")
    window = _window(config)
    mrope = getattr(config, "model_type", None) in MROPE_FAMILIES

    def refuse(what: str, fix: str) -> None:
        raise FastpackError(f"batch: {what} with attn_implementation={impl!r} "
                            f"({type(config).__name__}) would not compute the unpacked "
                            f"model; {fix}")

    if _packs_sequences(batch):
        _check_mixing(model, config, batch, impl, ours, refuse)
    _check_router_loss(config, batch, mask, refuse)

    sharded = "cp_size" in batch
    if sharded or impl in _CONTEXT_PARALLEL:
        registered = _CONTEXT_PARALLEL.get(impl)
        if not sharded:
            mode = registered[1] if registered else "zigzag"
            refuse("a batch not sharded for context parallelism",
                   f"pass fastpack.torch.shard_for_context_parallel(batch, cp_size, "
                   f"cp_rank, mode={mode!r})")
        elif registered is None:
            refuse(f"a context-parallel batch (cp_mode={batch.get('cp_mode')!r}, one rank's "
                   f"tokens)", "use register_hf_attention(context_parallel_group=group, "
                   f"mode={batch.get('cp_mode')!r}) as the attn_implementation")
        elif registered[1] != batch.get("cp_mode"):
            refuse(f"a context-parallel batch sharded with mode={batch.get('cp_mode')!r}",
                   f"shard with mode={registered[1]!r}, the attention's")
        return

    if is_tree_batch(batch):
        if ours:
            return
        if impl != "flex_attention":
            refuse("a tree batch (share_prefix=True)",
                   "use attn_implementation=register_hf_attention() or 'flex_attention'")
        longest = int(torch.as_tensor(positions).max()) + 1 if positions is not None else 0
        if window is not None and longest > window:
            refuse(f"a tree batch with paths of {longest} tokens on sliding-window layers "
                   f"(sliding_window={window}: Hugging Face's flex attention uses the "
                   f"batch's BlockMask as it is)",
                   "use attn_implementation=register_hf_attention(), which honours the window")
        return

    if isinstance(positions, torch.Tensor) and positions.ndim == 3:
        if positions.shape[0] != 4:
            refuse(f"position_ids of shape {tuple(positions.shape)} (mRoPE rows without the "
                   f"text row, so no per-document mask)",
                   "build the batch with PackedCollator(model_config=model.config): "
                   "[4, rows, width], row 0 the text position")
        positions = positions[0]  # the text row: where documents restart
    elif mrope and isinstance(positions, torch.Tensor) and (
            "image_grid_thw" in batch or "video_grid_thw" in batch):
        refuse("2-D position_ids beside images or videos (no mRoPE for them)",
               "build the batch with PackedCollator(model_config=model.config)")
    if mask is not None and getattr(mask, "ndim", len(getattr(mask, "shape", ()))) == 4:
        from torch.nn.attention.flex_attention import BlockMask

        if isinstance(mask, BlockMask):
            if impl != "flex_attention":
                refuse("a flex BlockMask (mask='explicit', backend='flex')",
                       "use attn_implementation='flex_attention', or mask='position_ids'")
        elif ours:
            return
        elif impl not in _TENSOR_MASK_IMPLS[mask.dtype == torch.bool]:
            kind = "bool" if mask.dtype == torch.bool else "additive float"
            refuse(f"an explicit {kind} 4-D mask",
                   "use the collator backend that matches the model's attn_implementation")
        width = int(mask.shape[-1])
        if window is not None and width > window:
            refuse(f"an explicit mask over rows of {width} tokens on sliding-window layers "
                   f"(sliding_window={window})",
                   "use mask='position_ids' (the default) or backend='flash'")
        return
    blind = None if ours or not _packs_sequences(batch) else _mask_builder(model, "omitted")
    if blind is not None:
        refuse(f"packed rows on a model that builds its attention mask without position_ids "
               f"({blind}: every token would see the whole row)",
               "use attn_implementation=register_hf_attention() with prepare_model(model), "
               "or an explicit mask (mask='explicit')")
    if ours or "cu_seq_lens_q" in batch or positions is None:
        return
    if not isinstance(positions, torch.Tensor):
        return
    rows = positions.reshape(-1, positions.shape[-1])
    starts = rows[:, 1:] - rows[:, :-1] != 1
    if mask is not None:
        real = torch.as_tensor(mask).to(torch.bool).reshape(rows.shape)
        starts &= real[:, 1:] & real[:, :-1]
        if bool(starts.any()):
            refuse("packed rows (position_ids restart inside a row) with a 2-D "
                   "attention_mask", "pass no attention_mask (PackedCollator does not)")
        return
    if not bool(starts.any()):
        return
    cache = batch.get("use_cache", getattr(config, "use_cache", False))
    if cache or batch.get("past_key_values") is not None:
        refuse("packed rows with use_cache on", "pass use_cache=False (PackedCollator does)")
    if impl.startswith("flash_attention") and rows.shape[0] > 1:
        refuse(f"{rows.shape[0]} packed rows without cu_seq_lens_q",
               "use PackedCollator(backend='flash')")


def _packs_sequences(batch: dict[str, Any]) -> bool:
    """Whether a row of the batch holds more than one sequence (or a tree, or a piece of
    one shared by context-parallel ranks): where a layer that mixes tokens along the row
    must keep them apart."""
    if is_tree_batch(batch) or "cp_size" in batch:
        return True
    cu = batch.get("cu_seq_lens_q")
    if cu is not None:
        return len(cu) > 2
    mask = batch.get("attention_mask")
    if mask is not None and getattr(mask, "ndim", 2) == 4:
        return True  # an explicit mask: block-diagonal rows
    positions = batch.get("position_ids")
    if not isinstance(positions, torch.Tensor):
        return False
    if positions.ndim == 3:
        positions = positions[0]
    rows = positions.reshape(-1, positions.shape[-1])
    starts = rows[:, 1:] - rows[:, :-1] != 1
    if isinstance(mask, torch.Tensor) and mask.ndim == 2:
        real = mask.to(torch.bool).reshape(rows.shape)
        starts &= real[:, 1:] & real[:, :-1]
    return bool(starts.any())


#: Module classes, by name, that mix tokens along the sequence beyond softmax attention
#: and that fastpack does not keep apart (a new architecture is refused until proven).
_MIXING_NAMES = re.compile(
    r"Mamba|Mixer|ShortConv|DeltaNet|DeltaAttention|LinearAttention|Lightning|Recurrent|"
    r"Rwkv|RWKV|Retention|Hyena|SSM|Rglru|RgLru|Xlstm|xLSTM|TimeMix", re.ASCII)
#: Classes that hold layers rather than mix tokens themselves (their layers are checked).
_CONTAINERS = re.compile(r"(Model|For[A-Z]\w*|Block|DecoderLayer|MLP|Experts|Norm|Output)$")
#: Softmax attention (through the attention interface) whose class name reads like a mixer.
_SOFTMAX_ATTENTION = ("KimiLinearAttention",)
#: Parameters of a recurrent state (Mamba's decay and step, RWKV's decay).
_STATE_PARAMETERS = ("A_log", "dt_bias", "time_decay", "time_first", "recurrent_param")
#: Submodules that run on the media of a vision-language or audio batch, not on its row.
_MEDIA_TOWERS = re.compile(r"(^|\.)(visual|vision_tower|vision_model|vision_encoder|"
                           r"audio_tower|audio_model|audio_encoder|audio_embed|"
                           r"embed_tokens_extend|multi_modal_projector)(\.|$)")
#: Hugging Face's mask builders: given ``position_ids`` they keep packed sequences apart.
_MASK_BUILDERS = re.compile(r"create_\w*causal_mask$", re.ASCII)
#: Model types that cannot keep packed sequences apart, and why (found by the sweep of
#: every causal LM transformers registers: silently different on packed rows).
_NOT_PACKABLE = {
    "openai-gpt": "its attention adds its own causal bias over the whole row",
    "xglm": "its sinusoidal positions are offset from the row's padding",
    "xlm": "its attention masks and positions run over the whole row",
    "xlnet": "its relative attention runs over the whole row",
    "cpmant": "its position bias runs over the whole row",
    "reformer": "its LSH / axial attention and positions run over the whole row",
    "prophetnet": "its n-gram attention runs over the whole row",
    "big_bird": "its bidirectional attention is its own, not the attention interface: every "
                "token sees the whole row",
    "megatron-bert": "its bidirectional attention is its own, not the attention interface: "
                     "every token sees the whole row",
    "rembert": "its bidirectional attention is its own, not the attention interface: every "
               "token sees the whole row",
}
#: Model types that keep a text-only packed row apart (Hugging Face's attentions) but not one
#: beside images, and why.
_NOT_PACKABLE_WITH_MEDIA = {
    "git": "its image tokens are one prefix of the row, which every sequence of the row sees",
}
#: Token-mixing classes that keep packed sequences apart themselves (checked by the sweep).
_KEEPS_APART = {
    "InklingShortConvolution": "masks its window with the model's conv_mask",
}
#: Sparse-attention indexers that select keys per document from Hugging Face's 4-D mask
#: (read in their source; exact in the sweep with budgets smaller than its samples). The
#: others take ``torch.topk`` over the row, whose ties (ReLU scores are often exactly 0)
#: fall on other keys once the sequence sits elsewhere in the row: AXK2 and HY-V4 are
#: exact in the sweep with ``index_topk=4`` by luck, 0.06 / 4e-3 off with 2.
_INDEXES_PER_DOCUMENT = {
    "Kolibri1_1Indexer": "groups queries by their first visible key and breaks ties "
                         "towards that document's earlier keys",
}
#: Model types whose attention adds ALiBi biases outside the attention interface.
_ALIBI_TYPES = ("bloom", "mpt")


#: What :func:`_mask_positions` and :func:`_own_mask` read from each class's source.
_SOURCE_FACTS: dict[type, tuple[str | None, bool, bool]] = {}


def _source_facts(cls: type) -> tuple[str | None, bool, bool]:
    """:func:`_mask_positions`, :func:`_own_mask` and :func:`_own_softmax` of ``cls``,
    parsed once per class."""
    facts = _SOURCE_FACTS.get(cls)
    if facts is None:
        facts = _SOURCE_FACTS[cls] = (_mask_positions(cls), _own_mask(cls),
                                      _own_softmax(cls))
    return facts


def _own_softmax(cls: type) -> bool:
    """Whether ``cls.forward`` takes a softmax itself and calls no attention interface
    (GIT's text attention: the registered attention never runs there)."""
    tree = _forward_tree(cls)
    if tree is None:
        return False
    calls = {_call_name(node) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    return "softmax" in calls and "attention_interface" not in calls


def _forward_tree(cls: type) -> ast.FunctionDef | None:
    """The syntax tree of a module class's ``forward``, its own or inherited (``None``
    where its source is not readable: compiled or built at run time)."""
    forward = getattr(cls, "forward", None)  # inherited: the parent's runs
    if forward is None:
        return None
    try:
        node = ast.parse(textwrap.dedent(inspect.getsource(forward))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    return node if isinstance(node, ast.FunctionDef) else None


def _call_name(node: ast.Call) -> str:
    func = node.func
    return func.id if isinstance(func, ast.Name) else (
        func.attr if isinstance(func, ast.Attribute) else "")


def _mask_positions(cls: type) -> str | None:
    """How ``cls.forward`` gives Hugging Face's mask builders the positions: ``"omitted"``
    where no builder call gets any (the mask then spans the whole row), ``"none"`` where
    one gets ``position_ids=None`` on purpose (a mask over a sequence of the model's own,
    e.g. BLT's patches of the row's bytes), else ``None`` (positions given, or no mask
    built)."""
    tree = _forward_tree(cls)
    if tree is None:
        return None
    literals = {}  # mask_kwargs = {...}: the keys of dicts the calls unpack
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and (
                len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            literals[node.targets[0].id] = {
                k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    calls = given = 0
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and _MASK_BUILDERS.match(_call_name(node))):
            continue
        calls += 1
        for kw in node.keywords:
            if kw.arg == "position_ids":
                if isinstance(kw.value, ast.Constant) and kw.value.value is None:
                    return "none"
                given += 1
            elif kw.arg is None and not (isinstance(kw.value, ast.Name) and (
                    "position_ids" not in literals.get(kw.value.id, {"position_ids"}))):
                given += 1  # **kwargs that hold, or may hold, the positions
    return "omitted" if calls and not given else None


def _mask_builder(model: Any, how: str) -> str | None:
    """The first module (``"path (Class)"``) whose forward builds its attention mask with
    positions ``how`` (see :func:`_mask_positions`), else ``None``."""
    inner = _unwrap(model)
    if not isinstance(inner, torch.nn.Module):
        return None
    for path, module in inner.named_modules():
        if not _MEDIA_TOWERS.search(path) and _source_facts(type(module))[0] == how:
            return f"{path or 'the model'} ({type(module).__name__})"
    return None


def _own_mask(cls: type) -> bool:
    """Whether ``cls.forward`` hands its attention a mask it computes itself (Doge's
    dynamic mask: a bias per key and a top-k over the keys), not the one it was given."""
    tree = _forward_tree(cls)
    if tree is None:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _call_name(node) == "attention_interface":
            for kw in node.keywords:
                if kw.arg == "attention_mask" and not (
                        isinstance(kw.value, ast.Constant) and kw.value.value is None) and not (
                        isinstance(kw.value, ast.Name) and kw.value.id == "attention_mask"):
                    return True
    return False


def _takes_positions(model: torch.nn.Module) -> bool:
    """Whether ``model(position_ids=...)`` reaches its layers: a ``position_ids``
    parameter, or ``**kwargs`` passed on to a stack of layers (a module holding a
    ``ModuleList``) that takes them (Whisper's decoder, a multimodal model's language
    model)."""
    params = inspect.signature(model.forward).parameters
    if "position_ids" in params:
        return True
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return False
    for path, module in model.named_modules():
        if not path or _MEDIA_TOWERS.search(path):
            continue
        if any(isinstance(c, torch.nn.ModuleList) for c in module.children()) and (
                "position_ids" in inspect.signature(module.forward).parameters):
            return True
    return False


def _mixing_reason(module: torch.nn.Module) -> str | None:
    """Why ``module`` mixes tokens along the sequence (by its class and what it holds),
    or ``None``."""
    cls = type(module).__name__
    for child in module.children():
        if isinstance(child, torch.nn.Conv1d) and child.kernel_size[0] > 1:
            return (f"it convolves over the sequence (Conv1d, kernel {child.kernel_size[0]}): "
                    f"the window reads the previous sequence's tokens")
    for name, _ in module.named_parameters(recurse=False):
        if name in _STATE_PARAMETERS:
            return f"it carries a recurrent state along the sequence (parameter {name})"
    if _MIXING_NAMES.search(cls) and not _CONTAINERS.search(cls) and (
            cls not in _SOFTMAX_ATTENTION):
        return "its class is a token mixer fastpack does not know"
    return None


def _check_mixing(model: Any, config: Any, batch: dict[str, Any], impl: str, ours: bool,
                  refuse: Callable[[str, str], None]) -> None:
    """Refuses a packed batch for a model with a layer that would mix its sequences: a
    known token mixer :func:`~fastpack.torch.prepare_model` has not prepared (or one it
    cannot keep apart on this batch), any other module that mixes tokens, ALiBi, attention
    a mask over a sequence of the model's own or computed in a layer, and bidirectional
    attention."""
    from .mixers import MIXERS, is_prepared

    kind = getattr(config, "model_type", None)
    if kind in _ALIBI_TYPES or getattr(config, "alibi", False):
        refuse(f"packed rows on a model with ALiBi position biases ({kind})",
               "fastpack does not add ALiBi per sequence (the biases run across the row); "
               "use PackedCollator(backend='padded')")
    if kind in _NOT_PACKABLE:
        refuse(f"packed rows on {kind} ({_NOT_PACKABLE[kind]})",
               "use PackedCollator(backend='padded') for this model")
    if kind in _NOT_PACKABLE_WITH_MEDIA and "pixel_values" in batch:
        refuse(f"packed rows with pixel_values on {kind} ({_NOT_PACKABLE_WITH_MEDIA[kind]})",
               "pack text only, or use PackedCollator(backend='padded') for this model")
    if ours and getattr(config, "attention_chunk_size", None):
        refuse(f"packed rows on a model with chunked attention (attention_chunk_size="
               f"{config.attention_chunk_size}: fastpack's attention does not add the chunks)",
               "use attn_implementation='sdpa' or 'eager' with PackedCollator(backend='sdpa')")
    inner = _unwrap(model)
    if not isinstance(inner, torch.nn.Module):
        return
    prepared = is_prepared(inner)
    forward = getattr(inner, "forward", None)
    attends = any("Attention" in type(m).__name__ for m in inner.modules())
    if attends and forward is not None and not _takes_positions(inner):
        refuse(f"packed rows on a model that takes no position_ids ({type(inner).__name__}: "
               f"its positions count along the row, so they do not restart per sequence)",
               "use PackedCollator(backend='padded') for this model")
    known: list[str] = []
    for path, module in inner.named_modules():
        if any(path == k or path.startswith(k + ".") for k in known) or _MEDIA_TOWERS.search(path):
            continue
        cls = type(module).__name__
        builds, owns, softmax = _source_facts(type(module))
        if softmax and ours and "Attention" in cls:
            raise FastpackError(
                f"{path} ({cls}) computes its attention itself (a softmax in its forward, not "
                f"the attention interface): not supported with attn_implementation={impl!r} "
                f"on packed rows because fastpack's attention never runs there and the layer "
                f"gets no mask that keeps the sequences apart; use attn_implementation="
                f"'eager' (its mask then comes from position_ids) or "
                f"PackedCollator(backend='padded')")
        if builds == "none":
            raise FastpackError(
                f"{path or 'the model'} ({cls}) builds an attention mask over a sequence of "
                f"its own (position_ids=None: not the row's tokens, e.g. patches of them): "
                f"not supported on packed rows because that sequence runs across the packed "
                f"sequences; use PackedCollator(backend='padded') for this model")
        if owns:
            # Doge's: a bias per key and, on rows longer than keep_window_size, a top-k of
            # the row's keys (the sweep's rows are shorter and come out exact; with
            # keep_window_size=3 they are 0.28 off): nothing proves it per sequence.
            why = ("fastpack's attention adds no mask to a packed row" if ours else
                   "its terms and any selection of keys are computed over the whole row")
            raise FastpackError(
                f"{path} ({cls}) hands its attention a mask it computes itself (attention_"
                f"mask=... built in the layer: a bias or a selection of keys): not supported "
                f"on packed rows with attn_implementation={impl!r} because {why}; use "
                f"PackedCollator(backend='padded') for this model")
        if hasattr(module, "create_position_ids_from_input_ids"):
            raise FastpackError(
                f"{path} ({cls}) numbers positions from the padding index along the row: "
                f"not supported on packed rows because position_ids restarting at 0 are not "
                f"its positions; use PackedCollator(backend='padded') for this model")
        if cls in _KEEPS_APART:
            known.append(path)
            continue
        if cls in _INDEXES_PER_DOCUMENT and not ours:
            known.append(path)
            continue
        if cls in _INDEXES_PER_DOCUMENT:
            raise FastpackError(
                f"{path} ({cls}) selects keys from the model's 4-D mask (it "
                f"{_INDEXES_PER_DOCUMENT[cls]}): not supported with attn_implementation="
                f"{impl!r} because fastpack's attention leaves it no mask; use "
                f"attn_implementation='sdpa' or 'eager' with PackedCollator(backend='sdpa')")
        if "Indexer" in cls:
            raise FastpackError(
                f"{path} ({cls}) selects keys for sparse attention over the whole row: "
                f"not supported on packed rows because its scores and top-k run across "
                f"sequences; use PackedCollator(backend='padded') for this model")
        if cls in MIXERS:
            known.append(path)
            if not prepared:
                raise FastpackError(
                    f"{path} ({cls}) mixes tokens across sequences: call "
                    f"fastpack.torch.prepare_model(model) before training on packed batches "
                    f"(it restarts the layer's state at every sequence), or use "
                    f"PackedCollator(backend='padded')")
            if is_tree_batch(batch) or "cp_size" in batch:
                what = "a tree batch" if is_tree_batch(batch) else "a context-parallel batch"
                raise FastpackError(
                    f"{path} ({cls}) mixes tokens across sequences: not supported on {what} "
                    f"because its recurrent state runs along the row (a shared prefix or a "
                    f"rank's piece is not a whole sequence); use share_prefix=False / no "
                    f"context parallelism for this model")
            continue
        reason = _mixing_reason(module)
        if reason is not None:
            known.append(path)
            raise FastpackError(
                f"{path} ({cls}) mixes tokens across sequences: not supported because "
                f"{reason}, so its packed rows would leak between sequences; use "
                f"PackedCollator(backend='padded') for this model")
