"""Token mixers other than softmax attention on packed batches: Mamba / Mamba2 state-space
layers, gated delta nets and other linear attention, short causal convolutions.

Softmax attention reads a packed row's sequence boundaries from the batch
(:func:`~fastpack.torch.register_hf_attention`); these layers carry a recurrent state and a
convolution window along the row instead, so the previous sequence's tokens leak into the
next one. :func:`prepare_model` makes each known mixer of a Hugging Face model restart its
state and its window at every sequence start: a forward pre-hook on the model reads the
boundaries of the current batch once per forward (``cu_seq_lens_q``, else where
``position_ids`` restart), and every mixer runs on them:

``"auto"`` (default)
    ``"kernels"`` for a mixer whose kernels are installed and take sequence boundaries,
    on CUDA tensors; ``"batched"`` otherwise (:func:`mixer_paths` says which ran).
``"kernels"``
    The mixer run once over the whole packed batch (its rows laid end to end: no padding)
    with the CUDA kernels' own sequence boundaries: causal-conv1d's and mamba_ssm's
    ``seq_idx``, flash-linear-attention's ``cu_seqlens``. fastpack calls the kernels
    itself in place of Hugging Face's wrappers for the duration of the call (they drop a
    keyword the installed kernel lacks), after checking each kernel's signature takes its
    boundary argument, and raises when a step of the mixer ran without them. Refused by
    name where a kernel is missing or too old (no ``seq_idx`` / ``cu_seqlens``), for
    Mamba-1 mixers (``selective_scan_fn`` takes no boundaries) and off CUDA.
``"batched"``
    The row's sequences gathered into one right-padded batch (grouped by length so that
    padding stays under half the tokens) and the mixer run once per group. The mixers are
    causal, so the padding after a sequence changes none of its outputs: each sequence
    gets exactly what it gets alone. Short causal convolutions (LFM2) need no padding: the
    window is masked at every sequence start (a varlen convolution).
``"loop"``
    The mixer run on every sequence alone: the reference (slow for many short sequences).

:data:`MIXERS` lists the mixer classes it knows; :func:`~fastpack.torch.check_model_batch`
refuses a packed batch for a model with a known mixer that :func:`prepare_model` has not
prepared, and for any other module that mixes tokens along the sequence (a convolution
over it, a recurrent state).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._checks import _choice
from .._errors import FastpackError, FastpackTypeError
from .formats import position_starts

__all__ = ["MIXERS", "MIXER_KERNELS", "STRATEGIES", "current_layout", "is_prepared",
           "kernel_problem", "kernel_support", "mixer_paths", "prepare_model", "token_mixers"]

#: The token mixers :func:`prepare_model` keeps apart, by class name: ``"ssm"`` (a
#: state-space scan after a short convolution), ``"linear_attention"`` (a gated delta
#: rule or another recurrent attention after a short convolution), ``"short_conv"`` (LFM2's
#: gated short causal convolution: a varlen convolution), ``"conv"`` (another short
#: convolution block, run as the others). Every one is called as ``forward(hidden_states,
#: cache=None, attention_mask=None, **kwargs)`` and mixes only along ``hidden_states``.
MIXERS: dict[str, str] = {
    "MambaMixer": "ssm",
    "FalconMambaMixer": "ssm",
    "Mamba2Mixer": "ssm",
    "BambaMixer": "ssm",
    "FalconH1Mixer": "ssm",
    "NemotronHMamba2Mixer": "ssm",
    "GraniteMoeHybridMambaLayer": "ssm",
    "Zamba2MambaMixer": "ssm",
    "JambaMambaMixer": "ssm",
    "Qwen3NextGatedDeltaNet": "linear_attention",
    "Qwen3_5GatedDeltaNet": "linear_attention",
    "Qwen3_5MoeGatedDeltaNet": "linear_attention",
    "OlmoHybridGatedDeltaNet": "linear_attention",
    "KimiLinearDeltaAttention": "linear_attention",
    "ZambaMambaMixer": "ssm",
    "LaraMiniGatedDeltaNet": "linear_attention",
    "Qwen4ExpTextGatedDeltaNet": "linear_attention",
    "Glm5NextTextLinearAttention": "linear_attention",
    "BailingHybridDeltaAttention": "linear_attention",
    "Lfm2ShortConv": "short_conv",
    "Lfm2MoeShortConv": "short_conv",
    "Lfm3ShortConv": "conv",
}

#: How :func:`prepare_model` runs a mixer on a packed row (see the module docs).
STRATEGIES = ("auto", "kernels", "batched", "loop")

#: Batch keys of the packed formats the mixers do not take (their boundaries are ours).
_PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
                  "position_ids", "seq_idx")
_CACHE_KWARGS = ("cache", "cache_params", "past_key_values", "past_key_value")


def token_mixers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, str]]:
    """``(path, module, kind)`` of every module of ``model`` whose class is in
    :data:`MIXERS`."""
    for path, module in model.named_modules():
        kind = MIXERS.get(type(module).__name__)
        if kind is not None:
            yield path, module, kind


def _unwrap(model: Any) -> Any:
    """The model a DDP / FSDP wrapper (``.module``) or ``torch.compile`` (``._orig_mod``)
    holds, else ``model``."""
    inner = model
    for attr in ("module", "_orig_mod"):
        inner = getattr(inner, attr, inner)
    return inner


@dataclass
class _Layout:
    """The sequences of one packed batch of ``rows`` rows of ``width`` tokens, laid end to
    end (flat token index): where each begins, its length, each token's place in its
    sequence, and the gathers of the ``"batched"`` strategy (built once per forward)."""

    rows: int
    width: int
    begins: torch.Tensor  # int64 [N], host
    lengths: torch.Tensor  # int64 [N], host
    offsets: torch.Tensor  # int64 [rows * width], host: token index inside its sequence
    groups: list[tuple[torch.Tensor, torch.Tensor, int, int]]
    device_cache: dict[Any, Any]

    @property
    def packed(self) -> bool:
        return len(self.lengths) > self.rows

    def cu_seqlens(self) -> torch.Tensor:
        """int64 ``[N + 1]`` on the host: where each sequence begins, then the token count."""
        return torch.cat([self.begins, torch.tensor([self.rows * self.width])])


def _layout(starts: torch.Tensor) -> _Layout:
    """The layout of a batch whose sequence starts are ``starts`` (bool ``[rows, width]``
    on the host, ``True`` at every row start)."""
    rows, width = starts.shape
    flat = starts.reshape(-1).clone()
    flat[::width] = True
    begins = torch.nonzero(flat)[:, 0]
    ends = torch.cat([begins[1:], torch.tensor([rows * width])])
    lengths = ends - begins
    token = torch.arange(rows * width)
    offsets = token - torch.repeat_interleave(begins, lengths)
    return _Layout(rows, width, begins, lengths, offsets, _groups(begins, lengths, rows * width),
                   {})


def _groups(begins: torch.Tensor, lengths: torch.Tensor,
            total: int) -> list[tuple[torch.Tensor, torch.Tensor, int, int]]:
    """The ``"batched"`` groups: sequences by decreasing length, a group closed when its
    padding would pass half its tokens. Each is ``(gather, valid, count, longest)``: the
    flat token index of every slot of a ``[count, longest]`` batch (``total`` — a zero row
    — on padding) and the slots that hold a token."""
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    lens = lengths.tolist()
    groups: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i in order:  # once per forward, over sequences (not per layer)
        if current and (len(current) + 1) * lens[current[0]] > 2 * (tokens + lens[i]):
            groups.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += lens[i]
    if current:
        groups.append(current)
    out = []
    for members in groups:
        idx = torch.tensor(members)
        longest = int(lengths[idx[0]])
        slot = torch.arange(longest)
        valid = slot[None, :] < lengths[idx][:, None]
        gather = torch.where(valid, begins[idx][:, None] + slot[None, :],
                             torch.full_like(valid, total, dtype=torch.int64))
        out.append((gather.reshape(-1), valid.reshape(-1), len(members), longest))
    return out


#: The batches of the prepared models' forwards in progress (innermost last): the layout
#: of a packed one, ``None`` for rows of one sequence each. Softmax attention that gets no
#: boundaries of its own reads them (:func:`current_layout`).
_ACTIVE: list[_Layout | None] = []
#: A batch whose rows the attention must read from its mask (padding, a cache).
_UNKNOWN = _Layout(0, 0, torch.zeros(0), torch.zeros(0), torch.zeros(0), [], {})


#: The batch of the last prepared forward: what a layer recomputed during the backward
#: (gradient checkpointing) ran on.
_LAST: list[_Layout | None] = [_UNKNOWN]


def _in_backward() -> bool:
    """Whether autograd is running a backward (a checkpointed layer recomputing)."""
    return bool(torch._C._current_graph_task_id() != -1)


def current_layout(rows: int, width: int) -> tuple[torch.Tensor, int] | None:
    """``(cu_seqlens, longest)`` (int64 on the host) of the batch a prepared model is
    running (each row one sequence when it is not packed; in a backward, the last forward's
    batch), for ``rows`` rows of ``width`` tokens; ``None`` outside a prepared model's
    forward or for other shapes."""
    stack = _ACTIVE if _ACTIVE else (_LAST if _in_backward() else [])
    if not stack or stack[-1] is _UNKNOWN:
        return None
    layout = stack[-1]
    if layout is None:
        return torch.arange(rows + 1) * width, width
    if (layout.rows, layout.width) != (rows, width):
        return None
    return layout.cu_seqlens(), int(layout.lengths.max())


class _Prepared:
    """What a prepared model holds: the layout of the batch of the forward in progress."""

    def __init__(self, strategy: str) -> None:
        self.strategy = strategy
        self.layout: _Layout | None = None
        self.refusal: str | None = None
        #: the last forward's (layout, refusal), for layers recomputed in the backward
        self.last: tuple[_Layout | None, str | None] = (None, None)
        self.depth = 0
        #: the kernel path's plan (or why there is none) per mixer class
        self.plans: dict[type, _Plan | str] = {}
        #: which path each mixer ran on its last packed batch (:func:`mixer_paths`)
        self.paths: dict[str, str] = {}

    def plan(self, mixer: torch.nn.Module) -> _Plan | str:
        if type(mixer) not in self.plans:
            self.plans[type(mixer)] = kernel_support(mixer)
        return self.plans[type(mixer)]


def _batch_layout(kwargs: dict[str, Any]) -> tuple[_Layout | None, str | None]:
    """The layout of a model call's batch (``None`` when its rows hold one sequence each),
    or why its mixers cannot be kept apart."""
    if kwargs.get("tree_parents") is not None:
        return None, ("a tree batch (share_prefix=True): a token's past is its path, not the "
                      "tokens before it in the row, and a recurrent state runs along the row")
    if "cp_size" in kwargs:
        return None, ("a context-parallel batch (each rank holds a piece of every sequence; "
                      "the recurrent state would have to pass between ranks)")
    ids = kwargs.get("input_ids")
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    if not isinstance(ids, torch.Tensor) or ids.ndim < 2:
        return None, None
    rows, width = int(ids.shape[0]), int(ids.shape[1])
    cu = kwargs.get("cu_seq_lens_q")
    if isinstance(cu, torch.Tensor):
        host = cu.detach().to("cpu", torch.int64)
        if rows != 1 or int(host[-1]) != width:
            return None, (f"cu_seq_lens_q ends at {int(host[-1])} for {rows} rows of {width} "
                          f"tokens (expected one row it covers)")
        starts = torch.zeros(1, width, dtype=torch.bool)
        starts[0, host[:-1][host[:-1] < width]] = True
        layout = _layout(starts)
    else:
        positions = kwargs.get("position_ids")
        if not isinstance(positions, torch.Tensor):
            return None, None
        layout = _layout(position_starts(positions, rows, width))
    if not layout.packed:
        return None, None
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.ndim == 2 and not bool(mask.all()):
        return None, ("packed rows (position_ids restarting inside a row) beside a padding "
                      "attention_mask")
    cache = kwargs.get("past_key_values")
    if cache is not None or kwargs.get("use_cache"):
        return None, "packed rows with a cache (use_cache=True or past_key_values)"
    return layout, None


def prepare_model(model: torch.nn.Module, *, strategy: str = "auto") -> torch.nn.Module:
    """Makes every token mixer of ``model`` that :data:`MIXERS` knows exact on packed
    batches: each restarts its recurrent state and its convolution window at every
    sequence start of the batch the model is called with. Returns ``model`` (prepared in
    place; preparing again only changes ``strategy``).

    The boundaries come from the batch: ``cu_seq_lens_q`` (``backend="flash"``), else
    where ``position_ids`` restart (``"sdpa"``, ``"eager"``, ``"flex"``; an explicit mask's
    batch carries them too); read once per forward. A batch with one sequence per row
    (``backend="padded"``, generation with a cache) runs the mixers unchanged. A packed
    batch the mixers cannot keep apart raises a :class:`~fastpack.FastpackError` at the
    first mixer: a tree batch (``share_prefix=True``), a context-parallel batch, packed
    rows with a padding mask or a cache.

    ``strategy``: ``"auto"`` (default: ``"kernels"`` for a mixer on CUDA tensors whose
    kernels take sequence boundaries, else ``"batched"``), ``"kernels"`` (the whole
    packed batch through the CUDA kernels with their own boundaries, ``seq_idx`` /
    ``cu_seqlens``: no padding; a mixer without such kernels, a kernel version without the
    argument, or CPU tensors raise a :class:`~fastpack.FastpackError` naming the mixer and
    the kernel), ``"batched"`` (the row's sequences as one right-padded batch per group of
    similar lengths) or ``"loop"`` (each sequence alone; the reference). Short
    convolutions run as a varlen convolution on every strategy but ``"loop"``. All are
    exact; see ``benches/bench_hybrid.py`` for their speed and :func:`mixer_paths` for
    which ran. Softmax attention is not touched: load
    the model with ``attn_implementation=register_hf_attention()`` for it.
    """
    if not isinstance(model, torch.nn.Module):
        raise FastpackTypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    strategy = _choice("strategy", strategy, STRATEGIES)
    inner = _unwrap(model)
    existing: _Prepared | None = getattr(inner, "_fastpack_prepared", None)
    fresh = existing is None
    state = existing if existing is not None else _Prepared(strategy)
    if strategy == "kernels":
        for path, module, kind in token_mixers(inner):
            plan = state.plan(module)
            if isinstance(plan, str) and kind != "short_conv":
                raise FastpackError(f"strategy='kernels': {path} ({type(module).__name__}) "
                                    f"cannot run on the kernels' sequence boundaries: {plan}")
    state.strategy = strategy
    if not fresh:
        return model

    def before(module: torch.nn.Module, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> None:
        state.depth += 1
        if state.depth > 1:  # a nested call of the same model keeps the outer batch
            return
        call = dict(kwargs)
        if args and "input_ids" not in call:
            call["input_ids"] = args[0]
        state.layout, state.refusal = _batch_layout(call)
        padding = call.get("attention_mask") is not None or call.get("past_key_values") is not None
        _ACTIVE.append(state.layout if state.layout is not None or not padding else _UNKNOWN)

    def after(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
              output: Any) -> None:
        state.depth -= 1
        if state.depth == 0:
            state.last = (state.layout, state.refusal)
            state.layout, state.refusal = None, None
            if _ACTIVE:
                _LAST[0] = _ACTIVE.pop()

    inner.register_forward_pre_hook(before, with_kwargs=True)
    inner.register_forward_hook(after, with_kwargs=True, always_call=True)
    for path, module, kind in token_mixers(inner):
        _wrap(module, path, kind, state)
    setattr(inner, "_fastpack_prepared", state)  # noqa: B010 (not a submodule)
    return model


def is_prepared(model: Any) -> bool:
    """Whether :func:`prepare_model` prepared ``model`` (or the model a wrapper holds)."""
    inner = _unwrap(model)
    return getattr(inner, "_fastpack_prepared", None) is not None


def mixer_paths(model: Any) -> dict[str, str]:
    """Which path each token mixer of a prepared ``model`` ran on its last packed batch,
    by module path: ``"kernels: causal_conv1d_fn(seq_idx), ..."``, ``"batched: <why not
    the kernels>"``, ``"varlen convolution"`` or ``"loop"``. Empty before a packed
    forward."""
    inner = _unwrap(model)
    state: _Prepared | None = getattr(inner, "_fastpack_prepared", None)
    return dict(state.paths) if state is not None else {}


def _wrap(module: torch.nn.Module, path: str, kind: str, state: _Prepared) -> None:
    original: Callable[..., Any] = module.forward
    name = f"{path} ({type(module).__name__})"

    def forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args: Any,
                **kwargs: Any) -> Any:
        layout, refusal = state.layout, state.refusal
        if state.depth == 0 and _in_backward():  # recomputed (gradient checkpointing)
            layout, refusal = state.last
        if refusal is not None:
            raise FastpackError(f"{name} mixes tokens along the row and cannot be kept apart "
                                f"on {refusal}")
        if layout is None:
            return original(hidden_states, *args, **kwargs)
        if tuple(hidden_states.shape[:2]) != (layout.rows, layout.width):
            raise FastpackError(
                f"{name}: got hidden states of shape {tuple(hidden_states.shape)} in a "
                f"packed forward of {layout.rows} rows of {layout.width} tokens; the "
                f"sequence boundaries do not apply to them"
            )
        if args or any(kwargs.get(k) is not None for k in _CACHE_KWARGS):
            raise FastpackError(f"{name}: a packed row takes no cache; pass use_cache=False")
        rest = {k: v for k, v in kwargs.items()
                if k not in _PACKED_KWARGS and k not in _CACHE_KWARGS and k != "attention_mask"}
        if state.strategy == "loop":
            state.paths[path] = "loop"
            return _loop(original, hidden_states, layout, rest)
        if kind == "short_conv":
            state.paths[path] = "varlen convolution"
            return _short_conv(self, hidden_states, layout)
        why = "strategy='batched'"
        if state.strategy in ("auto", "kernels"):
            plan = state.plan(self)
            if isinstance(plan, str):
                why = plan
            elif not _on_cuda(hidden_states):
                why = f"{hidden_states.device.type} tensors (the kernels run on CUDA)"
            else:
                try:
                    out = _kernels(original, plan, hidden_states, layout, rest, name)
                except FastpackError as e:
                    if state.strategy == "kernels":
                        raise
                    state.plans[type(self)] = why = str(e)  # auto: exact without them
                else:
                    state.paths[path] = "kernels: " + ", ".join(
                        f"{k.function}({k.boundary})" for k, fn in plan.kernels if fn is not None)
                    return out
            if state.strategy == "kernels":
                raise FastpackError(f"strategy='kernels': {name} cannot run on the kernels' "
                                    f"sequence boundaries: {why}")
        state.paths[path] = f"batched: {why}"
        return _batched(original, hidden_states, layout, rest)

    module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]


@dataclass(frozen=True)
class _Kernel:
    """A CUDA kernel that Hugging Face's modeling module of a mixer calls through the
    wrapper named ``hf_name``: where the kernel lives, the argument that takes the
    sequence boundaries, and the token-mixing steps it performs."""

    hf_name: str
    package: str
    module: str
    function: str
    boundary: str  # "seq_idx" (int32 [1, T]) or "cu_seqlens" (int64 [N + 1])
    steps: frozenset[str]
    fused: bool = False  # a shortcut: the mixer runs its unfused steps when it is absent


_CONV, _SCAN = frozenset({"conv"}), frozenset({"scan"})

#: The kernels the kernel path calls, by the name of Hugging Face's wrapper in a mixer's
#: modeling module (transformers 5.25: the same names in every family).
MIXER_KERNELS: tuple[_Kernel, ...] = (
    _Kernel("causal_conv1d_fn", "causal-conv1d", "causal_conv1d", "causal_conv1d_fn",
            "seq_idx", _CONV),
    _Kernel("mamba2_chunk_scan", "mamba-ssm", "mamba_ssm.ops.triton.ssd_combined",
            "mamba_chunk_scan_combined", "seq_idx", _SCAN),
    _Kernel("mamba2_split_conv1d_scan_combined", "mamba-ssm",
            "mamba_ssm.ops.triton.ssd_combined", "mamba_split_conv1d_scan_combined", "seq_idx",
            _CONV | _SCAN, fused=True),
    _Kernel("torch_chunk_gated_delta_rule", "flash-linear-attention", "fla.ops.gated_delta_rule",
            "chunk_gated_delta_rule", "cu_seqlens", _SCAN),
    _Kernel("chunk_kimi_delta_attention", "flash-linear-attention", "fla.ops.kda", "chunk_kda",
            "cu_seqlens", _SCAN),
)
#: Wrappers of one-token steps on a cache (decoding) or of kernels without sequence
#: boundaries (Mamba-1's selective scan): none may run on a packed row.
_NO_BOUNDARIES = ("causal_conv1d_update", "mamba2_selective_state_update",
                  "mamba_selective_state_update", "torch_recurrent_gated_delta_rule",
                  "recurrent_kimi_delta_attention", "mamba_selective_scan", "mamba_inner_fn")


def _on_cuda(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives where the kernels run (a function: tests stand in for it)."""
    return tensor.device.type == "cuda"


@dataclass
class _Plan:
    """How the kernel path runs one mixer class: its modeling module, and the kernel
    behind each of its wrappers (``None`` for a fused shortcut that is absent or lacks
    its boundary argument)."""

    module: types.ModuleType
    kernels: list[tuple[_Kernel, Callable[..., Any] | None]]


@functools.lru_cache(maxsize=64)
def _parameters(fn: Callable[..., Any]) -> Mapping[str, inspect.Parameter]:
    """A kernel's parameters, read once (not in every forward); none where Python cannot
    read its signature."""
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}


def _resolve(k: _Kernel) -> tuple[Callable[..., Any] | None, str | None]:
    """The kernel itself, or why the kernel path cannot use it: not installed, missing,
    or a version whose signature takes no sequence boundaries."""
    try:
        fn = getattr(importlib.import_module(k.module), k.function, None)
    except Exception as e:  # noqa: BLE001 (a broken install is a missing kernel)
        return None, f"{k.package} is not installed ({k.module}: {type(e).__name__}: {e})"
    if fn is None:
        return None, f"{k.module}.{k.function} is missing (this {k.package} is too old)"
    if k.boundary not in _parameters(fn):
        return None, (f"{k.module}.{k.function} takes no {k.boundary} (this {k.package} "
                      f"cannot keep packed sequences apart; install a version that takes it)")
    return fn, None


def kernel_problem(function: str) -> str | None:
    """Why the kernel path cannot call the kernel named ``function`` (one of
    :data:`MIXER_KERNELS`), or ``None`` when it can (installed, and its signature takes
    its sequence boundaries)."""
    for k in MIXER_KERNELS:
        if k.function == function:
            return _resolve(k)[1]
    raise FastpackError(f"function: no mixer kernel named {function!r}")


def kernel_support(mixer: torch.nn.Module) -> _Plan | str:
    """The kernel path's plan for ``mixer`` (a module whose class is in :data:`MIXERS`),
    or why it has none: a kernel not installed, or one whose signature takes no sequence
    boundaries (a version that cannot keep packed sequences apart), or a mixer whose
    modeling module calls no kernel that takes them."""
    kind = MIXERS.get(type(mixer).__name__)
    if kind is None or kind in ("short_conv", "conv"):
        return (f"{type(mixer).__name__} is no mixer with kernels (a short convolution runs "
                f"as fastpack's varlen convolution: no padding either way)")
    module = sys.modules.get(type(mixer).__module__)
    if module is None:
        return f"the modeling module of {type(mixer).__name__} is not imported"
    wrappers = [k for k in MIXER_KERNELS if hasattr(module, k.hf_name)]
    steps: set[str] = set()
    for k in wrappers:
        if not k.fused:
            steps |= k.steps
    if not {"conv", "scan"} <= steps:
        blind = [n for n in _NO_BOUNDARIES if hasattr(module, n) and "state_update" not in n
                 and "recurrent" not in n]
        why = f" (it calls {', '.join(blind)}: no sequence boundaries)" if blind else ""
        return (f"{type(mixer).__name__} calls no kernel that takes sequence boundaries for "
                f"its {' and '.join(sorted({'conv', 'scan'} - steps))}{why}")
    kernels: list[tuple[_Kernel, Callable[..., Any] | None]] = []
    for k in wrappers:
        fn, problem = _resolve(k)
        if problem is not None and not k.fused:
            return problem
        kernels.append((k, fn))  # a fused shortcut without: the mixer's unfused steps
    return _Plan(module, kernels)


def _boundaries(layout: _Layout, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``seq_idx`` (int32 ``[1, T]``: each token's sequence) and ``cu_seqlens`` (int64
    ``[N + 1]``) of the batch laid end to end as one row of ``T`` tokens."""
    key = ("boundaries", device)
    if key not in layout.device_cache:
        count = len(layout.lengths)
        seq_idx = torch.repeat_interleave(torch.arange(count, dtype=torch.int32),
                                          layout.lengths)[None]
        layout.device_cache[key] = (seq_idx.to(device), layout.cu_seqlens().to(device))
    return layout.device_cache[key]  # type: ignore[no-any-return]


def _kernels(original: Callable[..., Any], plan: _Plan, hidden: torch.Tensor, layout: _Layout,
             kwargs: dict[str, Any], name: str) -> torch.Tensor:
    """The mixer once over the batch laid end to end, every kernel it calls given the
    sequence boundaries: Hugging Face's wrappers replaced for the call by fastpack's, which
    pass ``seq_idx`` / ``cu_seqlens`` to the kernel itself. Raises when a step of the mixer
    (its convolution, its scan) ran without them."""
    total = layout.rows * layout.width
    seq_idx, cu = _boundaries(layout, hidden.device)
    ran: set[str] = set()

    def call(k: _Kernel, fn: Callable[..., Any] | None) -> Callable[..., Any]:
        params = _parameters(fn) if fn is not None else {}

        def kernel(*args: Any, **kw: Any) -> Any:
            if fn is None:  # Hugging Face's own shortcut contract: None runs the steps
                return None
            x = args[0]
            tokens = x.shape[-1] if k.steps == _CONV else x.shape[1]
            if x.shape[0] != 1 or tokens != total:
                raise FastpackError(f"{name}: {k.function} got a batch of {tuple(x.shape)}; "
                                    f"the packed row has {total} tokens")
            for state in ("initial_states", "initial_state"):
                if kw.get(state) is not None:
                    raise FastpackError(f"{name}: {k.function} got {state} on a packed row")
            if k.steps == _CONV and x.stride(1) != 1:  # causal-conv1d's seq_idx: channel-last
                x = x.transpose(1, 2).contiguous().transpose(1, 2)
                args = (x, *args[1:])
            # what Hugging Face's wrapper passes on: the keywords the kernel takes
            kw = {key: v for key, v in kw.items() if key in params and key != k.boundary}
            kw[k.boundary] = seq_idx if k.boundary == "seq_idx" else cu
            ran.update(k.steps)
            return fn(*args, **kw)

        return kernel

    def refuse(wrapper: str) -> Callable[..., Any]:
        def kernel(*args: Any, **kw: Any) -> Any:
            raise FastpackError(f"{name}: {wrapper} runs without sequence boundaries on a "
                                f"packed row; use strategy='batched'")
        return kernel

    patched = {k.hf_name: call(k, fn) for k, fn in plan.kernels}
    patched.update({n: refuse(n) for n in _NO_BOUNDARIES if hasattr(plan.module, n)})
    saved = {n: getattr(plan.module, n) for n in patched}
    flat = hidden.reshape(1, total, *hidden.shape[2:])
    try:
        for n, fn in patched.items():
            setattr(plan.module, n, fn)
        out = original(flat, **kwargs)
    finally:
        for n, fn in saved.items():
            setattr(plan.module, n, fn)
    if not {"conv", "scan"} <= ran:
        missing = " and ".join(sorted({"conv", "scan"} - ran))
        raise FastpackError(f"{name}: its {missing} ran outside the kernels that take sequence "
                            f"boundaries; use strategy='batched'")
    result: torch.Tensor = out[0] if isinstance(out, tuple) else out
    return result.reshape(layout.rows, layout.width, *result.shape[2:])


def _loop(original: Callable[..., Any], hidden: torch.Tensor, layout: _Layout,
          kwargs: dict[str, Any]) -> torch.Tensor:
    """Each sequence through the mixer alone."""
    flat = hidden.reshape(layout.rows * layout.width, *hidden.shape[2:])
    pieces = [original(flat[b:b + n][None], **kwargs)[0]
              for b, n in zip(layout.begins.tolist(), layout.lengths.tolist(), strict=True)]
    return torch.cat(pieces).reshape(*hidden.shape[:2], *pieces[0].shape[1:])


def _on_device(layout: _Layout, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    key = ("groups", device)
    if key not in layout.device_cache:
        layout.device_cache[key] = [
            (gather.to(device), torch.nonzero(valid)[:, 0].to(device))
            for gather, valid, _, _ in layout.groups
        ]
    return layout.device_cache[key]  # type: ignore[no-any-return]


def _batched(original: Callable[..., Any], hidden: torch.Tensor, layout: _Layout,
             kwargs: dict[str, Any]) -> torch.Tensor:
    """Every group of sequences as one right-padded batch through the mixer."""
    total = layout.rows * layout.width
    flat = hidden.reshape(total, -1)
    source = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])  # row ``total``: padding
    out: torch.Tensor | None = None
    for (gather, slots), (_, _, count, longest) in zip(_on_device(layout, hidden.device),
                                                       layout.groups, strict=True):
        batch = source[gather].reshape(count, longest, -1)
        result = original(batch, **kwargs)
        result = result.reshape(count * longest, -1)[slots]
        if out is None:
            out = result.new_empty(total, result.shape[-1])
        out[gather[slots]] = result
    assert out is not None
    return out.reshape(layout.rows, layout.width, -1)


def _short_conv(module: torch.nn.Module, hidden: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """LFM2's gated short convolution, its window masked at every sequence start: what
    the module computes on each sequence alone (zeros before the first token)."""
    projected = module.in_proj(hidden).transpose(-1, -2)  # type: ignore[operator]
    b, c, x = projected.chunk(3, dim=-2)
    bx = b * x  # [rows, channels, width]
    conv: torch.nn.Conv1d = module.conv  # type: ignore[assignment]
    weight = conv.weight[:, 0]  # [channels, kernel]
    kernel = weight.shape[-1]
    key = ("offsets", hidden.device)
    if key not in layout.device_cache:
        layout.device_cache[key] = layout.offsets.reshape(layout.rows, 1, layout.width).to(
            hidden.device)
    offsets = layout.device_cache[key]
    out = bx * weight[:, kernel - 1, None]
    for lag in range(1, kernel):  # the token ``lag`` back, where it is in the same sequence
        shifted = torch.nn.functional.pad(bx[..., :-lag], (lag, 0))
        out = out + (shifted * weight[:, kernel - 1 - lag, None]).masked_fill(offsets < lag, 0)
    if conv.bias is not None:
        out = out + conv.bias[:, None]
    y = (c * out).transpose(-1, -2).contiguous()
    return module.out_proj(y)  # type: ignore[operator,no-any-return]
