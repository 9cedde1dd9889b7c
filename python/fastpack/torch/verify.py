"""A proof on the user's own model: :func:`verify_packing` runs samples of a packed batch
alone through the model and compares them with the packed forward, naming the first
module whose output differs.

The packed forward is run once and kept (its logits); each checked sample then runs
alone (its tokens as one unpadded row, positions left to the model, its own media) and
its slice of the packed logits is compared with the alone logits. Only when a sample
differs are module outputs captured, to name the culprit: forward hooks on every
module record the alone run's per-token inputs and outputs (a bounded number of bytes at
a time), and a second packed forward compares each module's slice for that sample in
execution order, stopping at the first difference. A module whose *input* differs
before any output did names the module that called it (the difference came from its
own code: an attention function, a scan, a mask): ``model.layers.0.self_attn`` rather
than its ``o_proj``.

A difference is an element with ``|packed - alone| > atol + rtol * |alone|``
(:data:`TOLERANCES`, by the model's dtype, both set by ``atol``).
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._errors import FastpackError, FastpackTypeError
from .tree import SAMPLE_KEYS, targets

__all__ = ["TOLERANCES", "VerifyReport", "verify_packing"]

#: Default ``atol`` (and ``rtol``) per parameter dtype, from the differences measured
#: between packed and alone on the CPU (benches/bench_verify.py, tiny Llama / Mistral /
#: Gemma2): fp64 ~2e-16 (1e-7 where the reference is Hugging Face's eager attention, whose
#: softmax is float32), fp32 ~3e-7, fp16 ~5e-4, bf16 ~4e-3 in the logits (another batch
#: shape sums in another order). The defaults sit 10x above, far below the leaks measured
#: (6e-4 to 3 logits in fp32); a leak smaller than the bf16 default needs an fp32 check.
TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-6,
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 5e-2,
}
#: Keys of a batch that carry the loss's normalisers or labels: not model inputs here.
_NOT_INPUTS = ("labels", "num_items_in_batch", "num_sequences_in_batch")
#: Per-token keys sliced into an alone run (the token ids themselves aside).
_PER_TOKEN = ("mm_token_type_ids", "token_type_ids")
#: Bytes of the alone run's module values held at once while naming the culprit.
_STORE_BYTES = 1 << 30


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify_packing` checked: ``samples`` (batch positions), the largest
    difference of the logits (``worst``, at ``worst_sample``), the largest of the
    gradients (``grads_worst``, None without ``grads=True``), ``atol`` and ``seconds``."""

    samples: tuple[int, ...]
    worst: float
    worst_sample: int
    atol: float
    seconds: float
    grads_worst: float | None = None

    def __str__(self) -> str:
        grads = "" if self.grads_worst is None else f", gradients within {self.grads_worst:.2g}"
        return (f"verify_packing: {len(self.samples)} sample(s) equal alone and packed "
                f"(worst {self.worst:.2g} at sample {self.worst_sample}, atol {self.atol:g}"
                f"{grads}) in {self.seconds:.2f} s")


class _Found(Exception):
    """Raised inside a hook to stop the packed forward at the first difference."""

    def __init__(self, culprit: str, where: str, diff: float, integers: bool = False) -> None:
        super().__init__(culprit)
        self.culprit, self.where, self.diff = culprit, where, diff
        #: Whether the first difference is in integers (positions, ids), not values.
        self.integers = integers


class _Done(Exception):
    """Raised inside a hook to stop a forward past the events of interest."""


def verify_packing(
    model: torch.nn.Module,
    batch: Mapping[str, Any],
    *,
    samples: int | Sequence[int] | None = None,
    atol: float | None = None,
    grads: bool = False,
) -> VerifyReport:
    """Checks that ``model(**batch)`` computes, for each sample of the packed ``batch``,
    what the model computes for that sample alone; raises a
    :class:`~fastpack.FastpackError` naming the first module that differs, the sample and
    the size of the difference; returns a :class:`VerifyReport`.

    Args:
        model: a Hugging Face model (or any module taking ``input_ids`` and returning
            logits), with the attention implementation it trains with.
        batch: a batch of :class:`~fastpack.torch.PackedCollator` or
            :class:`~fastpack.torch.PackedDataset`: any format, tree batches, and
            vision-language batches (each sample runs alone with its own media).
            Context-parallel shards hold one rank's tokens and raise: check the batch
            before :func:`~fastpack.torch.shard_for_context_parallel`, with a
            non-parallel attention.
        samples: which samples (positions in the batch's ``sample_ids``) to check; an int
            checks that many, preferring samples that do not start their row (a leak
            from an earlier sequence shows there); ``None`` checks all.
        atol: the tolerance (also the relative one); default by the model's dtype,
            :data:`TOLERANCES`.
        grads: also compare the gradients of the summed token loss (the batch's targets)
            of the packed forward with the sum over the samples alone, naming the
            parameter that differs most.

    The model runs in eval mode (no dropout) and without gradients unless ``grads``; its
    modes (and any ``.grad`` already there) are restored.
    """
    if not isinstance(model, torch.nn.Module):
        raise FastpackTypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(batch, Mapping):
        raise FastpackTypeError(f"batch: expected a dict, got {type(batch).__name__}")
    if "cp_size" in batch:
        raise FastpackError(
            f"batch: a context-parallel shard (cp_size={batch.get('cp_size')}, "
            f"cp_mode={batch.get('cp_mode')!r}) holds one rank's tokens, so no sample can be "
            f"compared alone; verify the batch before shard_for_context_parallel, with an "
            f"attention that is not context-parallel"
        )
    missing = [key for key in SAMPLE_KEYS + ("input_ids",) if key not in batch]
    if missing:
        raise FastpackError(
            f"batch: no {missing[0]!r}; verify_packing reads the samples a batch lists "
            f"(PackedCollator and PackedDataset batches do)"
        )
    if not isinstance(grads, bool):
        raise FastpackTypeError(f"grads: expected a bool, got {type(grads).__name__}")
    start = time.perf_counter()
    device = _device(model)
    packed = _Packed(batch, device)
    packed.inputs = {k: v for k, v in packed.inputs.items() if _takes(model, k)}
    chosen = packed.choose(samples)
    dtype = _dtype(model)
    if atol is None:
        tol = TOLERANCES.get(dtype, 1e-4)
    elif isinstance(atol, (int, float)) and not isinstance(atol, bool) and atol >= 0:
        tol = float(atol)
    else:
        raise FastpackError(f"atol: expected a number >= 0, got {atol!r}")
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            logits = _primary(model(**packed.inputs))
            worst, worst_sample = 0.0, chosen[0] if chosen else -1
            for k in chosen:
                with _reference(model):
                    alone = _primary(model(**packed.alone(k, model)))
                pair = packed.align(logits, alone, k)
                if pair is None:
                    raise FastpackError(
                        f"model: its output {tuple(logits.shape)} for the batch and "
                        f"{tuple(alone.shape)} for sample {k} alone are not one value per token"
                    )
                diff, bad = _differs(*pair, tol)
                if bad:
                    del logits, alone, pair
                    raise FastpackError(_locate(model, packed, k, tol, diff))
                if diff > worst:
                    worst, worst_sample = diff, k
            del logits
        grads_worst = _check_grads(model, packed, chosen, tol) if grads else None
    finally:
        for m, mode in modes.items():
            m.training = mode
    return VerifyReport(tuple(chosen), worst, worst_sample, tol,
                        time.perf_counter() - start, grads_worst)


# ------------------------------------------------------------------------ the batch


class _Packed:
    """A packed batch as verify_packing reads it: the model's inputs, and per sample its
    tokens' flattened row positions and what it needs to run alone."""

    def __init__(self, batch: Mapping[str, Any], device: torch.device) -> None:
        self.batch = batch
        ids = torch.as_tensor(batch["input_ids"])
        if ids.ndim != 2:
            raise FastpackError(f"input_ids: expected [rows, T], got {tuple(ids.shape)}")
        self.rows, self.width = int(ids.shape[0]), int(ids.shape[1])
        self.ids = ids.reshape(-1).to(device)
        self.tokens = torch.as_tensor(batch["sample_tokens"]).to(device, torch.int64)
        self.offsets = torch.as_tensor(batch["sample_offsets"]).to(torch.int64).tolist()
        self.sample_ids = torch.as_tensor(batch["sample_ids"]).tolist()
        self.device = device
        self.inputs = {k: _to(v, device) for k, v in batch.items() if k not in _NOT_INPUTS}
        self._media: _Media | None = None

    @property
    def count(self) -> int:
        return len(self.offsets) - 1

    def index(self, k: int) -> torch.Tensor:
        return self.tokens[self.offsets[k]:self.offsets[k + 1]]

    def choose(self, samples: int | Sequence[int] | None) -> list[int]:
        count = self.count
        if samples is None:
            return list(range(count))
        if isinstance(samples, (int, np.integer)) and not isinstance(samples, bool):
            n = int(samples)
            if n < 1:
                raise FastpackError(f"samples: expected a count >= 1, got {n}")
            # A sample that does not start its row shows a leak from its neighbours.
            starts = [self.offsets[k] for k in range(count)]
            first = self.tokens[torch.as_tensor(starts, dtype=torch.int64,
                                                device=self.device)] % self.width == 0 \
                if count else torch.zeros(0, dtype=torch.bool)
            inner = [k for k in range(count) if not bool(first[k])]
            outer = [k for k in range(count) if bool(first[k])]
            picked = _spread(inner, n) + _spread(outer, max(0, n - len(inner)))
            return sorted(picked)
        if isinstance(samples, (str, bytes)) or not isinstance(samples, Sequence):
            raise FastpackTypeError(
                f"samples: expected None, a count or a list of sample positions, got "
                f"{type(samples).__name__}"
            )
        out = []
        for k in samples:
            if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or not \
                    0 <= int(k) < count:
                raise FastpackError(
                    f"samples: {k!r} is not a sample position of the batch (0..{count - 1})"
                )
            out.append(int(k))
        if not out:
            raise FastpackError("samples: an empty list checks nothing; pass None for all")
        return sorted(set(out))

    def alone(self, k: int, model: torch.nn.Module) -> dict[str, Any]:
        index = self.index(k)
        inputs: dict[str, Any] = {"input_ids": self.ids.index_select(0, index)[None]}
        if _takes(model, "use_cache"):
            inputs["use_cache"] = False
        for key in _PER_TOKEN:
            value = self.batch.get(key)
            if isinstance(value, torch.Tensor) and value.numel() == self.rows * self.width:
                inputs[key] = value.to(self.device).reshape(-1).index_select(0, index)[None]
        if _has_media(self.batch):
            if self._media is None:
                self._media = _Media(self, model)
            inputs.update(self._media.of(k))
        return inputs

    def align(self, packed: torch.Tensor, alone: torch.Tensor, k: int
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Sample ``k``'s values of ``packed`` and of ``alone``, token by token (``[L,
        ...]`` each), or None when they are not one value per token."""
        index = self.index(k)
        length = len(index)
        rows, width = self.rows, self.width
        if packed.ndim != alone.ndim or packed.ndim == 0:
            return None
        if packed.ndim >= 2 and packed.shape[0] == rows and alone.shape[0] == 1:
            for d in range(1, packed.ndim):
                if packed.shape[d] != width or alone.shape[d] != length:
                    continue
                if any(packed.shape[e] != alone.shape[e] for e in range(1, packed.ndim)
                       if e != d):
                    continue
                moved = packed.movedim(d, 1)
                flat = moved.reshape(rows * width, *moved.shape[2:])
                return flat.index_select(0, index.to(packed.device)), alone.movedim(d, 1)[0]
        if (packed.shape[0] == rows * width and alone.shape[0] == length
                and packed.shape[1:] == alone.shape[1:]):
            return packed.index_select(0, index.to(packed.device)), alone
        return None


def _takes(model: torch.nn.Module, name: str) -> bool:
    """Whether ``model.forward`` takes the keyword ``name`` (or any keyword)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _spread(items: list[int], n: int) -> list[int]:
    if n >= len(items):
        return list(items)
    if n <= 0:
        return []
    picks = np.linspace(0, len(items) - 1, n).round().astype(int)
    return [items[i] for i in sorted(set(picks.tolist()))]


def _has_media(batch: Mapping[str, Any]) -> bool:
    return any(batch.get(k) is not None for k in ("pixel_values", "pixel_values_videos"))


class _Media:
    """Each sample's media of a vision-language batch: its images and videos are the
    next ones in placeholder order (the batch concatenates them so); pixel rows per
    image are its grid's patches (mRoPE) or one (LLaVA)."""

    def __init__(self, packed: _Packed, model: torch.nn.Module) -> None:
        from ..vlm import VlmConfig

        config = getattr(model, "config", None)
        cfg = VlmConfig.of(config)
        self.cfg = cfg
        batch = packed.batch
        self.parts: list[tuple[list[str], list[int], list[int], list[int], list[int]]] = []
        self.values = {k: _to(v, packed.device) for k, v in packed.batch.items()}
        flat_ids = packed.ids
        for kind, token, pixels, grids, extra in (
                ("image", cfg.image_token_id, "pixel_values", "image_grid_thw", "image_sizes"),
                ("video", cfg.video_token_id, "pixel_values_videos", "video_grid_thw",
                 "second_per_grid_ts")):
            if token is None or batch.get(pixels) is None:
                continue
            if cfg.mrope:
                grid = torch.as_tensor(batch[grids]).to(torch.int64)
                rows = grid.prod(dim=1)
                placeholders = rows // (cfg.spatial_merge_size ** 2)
            elif kind == "image" and cfg.tokens_per_image is not None:
                count = int(torch.as_tensor(batch[pixels]).shape[0])
                rows = torch.ones(count, dtype=torch.int64)
                placeholders = torch.full((count,), cfg.tokens_per_image, dtype=torch.int64)
            else:
                raise FastpackError(
                    f"batch: {cfg.model_type} {kind}s take a varying number of placeholders "
                    f"per {kind}; verify_packing cannot give each sample its own {kind}s"
                )
            # Placeholders before each sample's first token, in batch order.
            is_token = (flat_ids == token).to(torch.int64)
            before = torch.cumsum(is_token, 0) - is_token
            firsts = [packed.offsets[k] for k in range(packed.count)]
            starts = before[packed.tokens[firsts]] if firsts else before[:0]
            cum = torch.cumsum(placeholders, 0)
            begin = torch.searchsorted(cum, starts.cpu(), right=True).tolist()
            counts = [int(is_token[packed.index(k)].sum()) for k in range(packed.count)]
            row_cum = [0, *torch.cumsum(rows, 0).tolist()]
            keys = [key for key in (pixels, grids, extra) if batch.get(key) is not None]
            self.parts.append((keys, placeholders.tolist(), row_cum, begin, counts))

    def of(self, k: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for keys, placeholders, row_cum, begin, counts in self.parts:
            first = last = begin[k]
            seen = 0
            while seen < counts[k] and last < len(placeholders):
                seen += placeholders[last]
                last += 1
            if last == first:
                continue
            for key in keys:
                value = self.values[key]
                if key.startswith("pixel_values"):
                    out[key] = value[row_cum[first]:row_cum[last]]
                else:
                    out[key] = value[first:last]
        return out


# ------------------------------------------------------------------ the reference


#: Hugging Face's own attention implementations, in order of preference, for the
#: reference run of a model whose attention is another (fastpack's, a flash kernel, a
#: user's).
_REFERENCE_IMPLS = ("sdpa", "eager")
#: The implementations whose alone run is their own reference.
_HF_IMPLS = ("sdpa", "eager", "flex_attention")


@contextlib.contextmanager
def _reference(model: torch.nn.Module) -> Iterator[None]:
    """The model with Hugging Face's own attention (``sdpa``, else ``eager``) while a
    sample runs alone, when its attention is another (fastpack's registered one, a flash
    kernel, a user's): compared with itself, an attention that drops a window (or a sink,
    a softcap) would agree with itself. Every config's implementation is restored after."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    setter = getattr(model, "set_attn_implementation", None)
    if not isinstance(impl, str) or setter is None or impl in _HF_IMPLS:
        yield
        return
    configs = _configs(model)
    saved = [(c, c.__dict__.get("_attn_implementation_internal")) for c in configs]
    for name in _REFERENCE_IMPLS:
        try:
            setter(name)
            break
        except (ValueError, ImportError):
            continue
    try:
        yield
    finally:
        for c, value in saved:
            c._attn_implementation_internal = value


def _configs(model: torch.nn.Module) -> list[Any]:
    """Every config object of the model's modules and their sub-configs."""
    seen: dict[int, Any] = {}
    todo = [getattr(m, "config", None) for m in model.modules()]
    while todo:
        c = todo.pop()
        if c is None or id(c) in seen or not hasattr(c, "_attn_implementation_internal"):
            continue
        seen[id(c)] = c
        for key in getattr(c, "sub_configs", {}) or {}:
            todo.append(getattr(c, key, None))
    return list(seen.values())


# ------------------------------------------------------------------ comparisons


def _device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _dtype(model: torch.nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _primary(output: Any) -> torch.Tensor:
    """The model's per-token output: its logits, else its first tensor."""
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    for _, leaf in _leaves(output):
        if leaf.is_floating_point():
            return leaf
    raise FastpackError(f"model: its output ({type(output).__name__}) holds no tensor")


def _leaves(value: Any, path: str = "", depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a module's output or inputs (tensors, tuples, dicts, ModelOutput),
    with their paths."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif depth > 3:
        return
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _leaves(item, f"{path}.{key}" if path else str(key), depth + 1)
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{path}[{i}]", depth + 1)


def _differs(packed: torch.Tensor, alone: torch.Tensor, tol: float) -> tuple[float, bool]:
    """The largest ``|packed - alone|`` and whether some element exceeds
    ``tol + tol * |alone|`` (integers: whether any differs)."""
    if packed.shape != alone.shape:
        return float("inf"), True
    if not packed.is_floating_point():
        diff = (packed.to(torch.int64) - alone.to(torch.int64)).abs()
        worst = float(diff.max()) if diff.numel() else 0.0
        return worst, worst > 0
    a = alone.to(packed.device)
    if packed.dtype in (torch.float16, torch.bfloat16):
        packed, a = packed.float(), a.float()
    gap = (packed - a.to(packed.dtype)).abs()
    if not gap.numel():
        return 0.0, False
    worst = float(gap.max())
    if worst != worst:  # NaN
        return worst, True
    return worst, bool((gap - tol * a.abs() > tol).any())


# ------------------------------------------------------------------ the culprit


def _locate(model: torch.nn.Module, packed: _Packed, k: int, tol: float, diff: float) -> str:
    """The message naming the first module whose values for sample ``k`` differ."""
    names = {m: (name or "the model") for name, m in model.named_modules()}
    found = _search(model, names, packed, k, tol)
    head = (f"sample {k}" if packed.sample_ids[k] == k
            else f"sample {k} (id {packed.sample_ids[k]})")
    tail = (f"{head} differs from the sample run alone by {diff:.2g} in the logits "
            f"(atol {tol:g})")
    if found is None:
        return (f"verify_packing: the packed batch mixes tokens across sequences: {tail}; no "
                f"module's per-token output differs first (the difference is in the model's "
                f"last step or in values that are not one per token)")
    if found.integers:
        return (f"verify_packing: {found.culprit} passes other positions or ids than the "
                f"sample alone (not restarted at each sequence?): {tail} (first at "
                f"{found.where}, by {found.diff:.2g})")
    return (f"verify_packing: {found.culprit} mixes tokens across sequences: {tail} "
            f"(first at {found.where}, by {found.diff:.2g})")


#: A module event: (module name, its call number in the forward, "input" or "output").
_Key = tuple[str, int, str]
_Stored = dict[_Key, list[tuple[str, torch.Tensor]]]


def _search(model: torch.nn.Module, names: dict[torch.nn.Module, str], packed: _Packed,
            k: int, tol: float) -> _Found | None:
    """Events (module inputs and outputs) of the alone run recorded a bounded number of
    bytes at a time, from event ``lo`` in the alone run's order, each window compared in
    a packed run in its own execution order. Events match by module, call number and
    kind, not by position: a packed batch may call other modules (MoE experts)."""
    lo = 0
    while True:
        stored: _Stored = {}
        stop, total = _run_alone(model, names, packed, k, lo, stored)
        if stored:
            found = _run_packed(model, names, packed, k, tol, stored)
            if found is not None:
                return found
        stored.clear()
        if stop >= total:
            return None
        lo = stop


class _Events:
    """Numbers every module input and output of a forward in execution order, and keeps
    the stack of modules running."""

    def __init__(self, names: dict[torch.nn.Module, str]) -> None:
        self.count = 0
        self.stack: list[torch.nn.Module] = []
        self.calls: dict[torch.nn.Module, int] = {}
        self.names = names
        self.handles: list[Any] = []
        for m in names:
            self.handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(m.register_forward_hook(self._post, with_kwargs=True))

    def on(self, index: int, key: _Key, module: torch.nn.Module, value: Any) -> None:
        raise NotImplementedError

    def _pre(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        call = self.calls[module] = self.calls.get(module, -1) + 1
        index = self.count
        self.count += 1
        self.on(index, (self.names[module], call, "input"), module, {"args": args, **kwargs})
        self.stack.append(module)

    def _post(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self.stack and self.stack[-1] is module:
            self.stack.pop()
        index = self.count
        self.count += 1
        self.on(index, (self.names[module], self.calls.get(module, 0), "output"), module,
                output)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _run_alone(model: torch.nn.Module, names: dict[torch.nn.Module, str], packed: _Packed,
               k: int, lo: int, stored: _Stored) -> tuple[int, int]:
    """Records the per-token values of events ``lo`` on, until ``_STORE_BYTES``; returns
    the first event not recorded and the number of events."""
    length = len(packed.index(k))

    class Record(_Events):
        bytes = 0
        stop = -1

        def on(self, index: int, key: _Key, module: torch.nn.Module, value: Any) -> None:
            if index < lo or self.stop >= 0:
                return
            leaves = [(p, t.detach().clone()) for p, t in _leaves(value)
                      if t.ndim >= 1 and length in t.shape]
            size = sum(t.numel() * t.element_size() for _, t in leaves)
            if stored and self.bytes + size > _STORE_BYTES:
                self.stop = index
                return
            self.bytes += size
            if leaves:
                stored[key] = leaves

    events = Record(names)
    try:
        with _reference(model):
            model(**packed.alone(k, model))
    finally:
        events.remove()
    return (events.stop if events.stop >= 0 else events.count), events.count


def _run_packed(model: torch.nn.Module, names: dict[torch.nn.Module, str], packed: _Packed,
                k: int, tol: float, stored: _Stored) -> _Found | None:
    class Compare(_Events):
        matched = 0

        def on(self, index: int, key: _Key, module: torch.nn.Module, value: Any) -> None:
            alone = stored.get(key)
            if alone is None:
                return
            mine = dict(_leaves(value))
            for path, a in alone:
                p = mine.get(path)
                if p is None:
                    continue
                pair = packed.align(p.detach(), a, k)
                if pair is None:
                    continue
                diff, bad = _differs(*pair, tol)
                if not bad:
                    continue
                name = f"{self.names[module]} ({type(module).__name__})"
                if key[2] == "output":
                    raise _Found(name, f"its output{_path(path)}", diff)
                parent = self.stack[-1] if self.stack else module
                culprit = f"{self.names[parent]} ({type(parent).__name__})"
                raise _Found(culprit, f"the input{_path(path)} of {name}", diff,
                             integers=not p.is_floating_point())
            self.matched += 1
            if self.matched == len(stored):
                raise _Done  # every recorded event compared

    events = Compare(names)
    try:
        model(**packed.inputs)
    except _Found as found:
        return found
    except _Done:
        return None
    finally:
        events.remove()
    return None


def _path(path: str) -> str:
    """`` 'position_ids'`` or `` (argument 0)``, for the message."""
    if path.startswith("args["):
        head, _, rest = path[5:].partition("]")
        return f" (argument {head}{rest})"
    return f" {path!r}" if path else ""


# ------------------------------------------------------------------ gradients


def _check_grads(model: torch.nn.Module, packed: _Packed, chosen: list[int], tol: float
                 ) -> float:
    """The largest gradient difference of the summed token loss over ``chosen``, packed
    vs alone; raises naming the parameter that differs most."""
    if "labels" not in packed.batch and "target_index" not in packed.batch:
        raise FastpackError("grads: the batch has no 'labels' (nor a target map); "
                            "grads=True compares the gradients of the loss of its targets")
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    saved = [p.grad for _, p in params]
    index, labels, offsets = targets(packed.batch, packed.device)
    bounds = offsets.tolist()
    try:
        for _, p in params:
            p.grad = None
        order: dict[str, int] = {}
        named = dict(model.named_modules())

        def seen(module: torch.nn.Module, args: Any) -> None:
            order.setdefault(names[module], len(order))

        names = {m: n for n, m in named.items()}
        handles = [m.register_forward_pre_hook(seen) for m in named.values()]
        try:
            with torch.enable_grad():
                logits = _primary(model(**packed.inputs))
        finally:
            for handle in handles:
                handle.remove()
        with torch.enable_grad():
            flat = logits.reshape(-1, logits.shape[-1])
            take = torch.cat([torch.arange(bounds[k], bounds[k + 1], device=packed.device)
                              for k in chosen]) if chosen else index[:0]
            _nll(flat, index[take], labels[take]).backward()
            del logits, flat
        packed_grads = [p.grad for _, p in params]
        for _, p in params:
            p.grad = None
        with torch.enable_grad(), _reference(model):
            for k in chosen:
                logits = _primary(model(**packed.alone(k, model)))[0]
                rows = packed.index(k)
                mine = index[bounds[k]:bounds[k + 1]]
                local = torch.searchsorted(rows, mine)
                _nll(logits, local, labels[bounds[k]:bounds[k + 1]]).backward()
                del logits
        worst, where, excess, last = 0.0, "", 0.0, ""
        for (name, p), g in zip(params, packed_grads):
            a = p.grad
            if g is None and a is None:
                continue
            g = torch.zeros_like(p) if g is None else g
            a = torch.zeros_like(p) if a is None else a
            diff, bad = _differs(g, a, tol)
            worst = max(worst, diff)
            if not bad:
                continue
            if order.get(name.rpartition(".")[0], -1) >= order.get(last.rpartition(".")[0], -1):
                last = name
            over = float(((g.double() - a.double()).abs() - tol * a.double().abs()).max())
            if over > excess:
                where, excess = name, over
        if where:
            # The backward pass starts to differ at the last module, in execution order,
            # whose parameters' gradients differ.
            raise FastpackError(
                f"verify_packing: the gradients differ: parameter {where!r} differs most, by "
                f"{worst:.2g} (atol {tol:g}), between the packed batch's loss and the sum of "
                f"its {len(chosen)} sample(s) alone; the backward pass first differs at {last!r}"
            )
        return worst
    finally:
        for (_, p), g in zip(params, saved):
            p.grad = g


def _nll(logits: torch.Tensor, rows: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    picked = logits.index_select(0, rows)
    return -(picked.log_softmax(-1).gather(1, labels[:, None])).sum()

