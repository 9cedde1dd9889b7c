"""Tree batches: samples that share a prefix, each shared token computed once.

A tree batch (``PackedCollator(..., share_prefix=True)``, or a ``PackedDataset`` of it)
is one flat row ``[1, T]`` of *segments*: a shared prefix is one segment, each
continuation a segment whose positions continue from its parent's end. The tree travels
as ``tree_cu_seqlens`` (the segments' bounds in the row) and ``tree_parents`` (each
segment's parent, ``-1`` for a root), never as a ``T x T`` mask: laid out in preorder, a
query ``q`` sees key ``k`` exactly when ``k <= q < end(k)``, where ``end(k)`` is the end
of the subtree of ``k``'s segment — its ancestors' tokens and its own causal past. Three
lowerings compute exactly that:

- fastpack's attention (:func:`fastpack.torch.register_hf_attention`): on the CPU one
  SDPA call per segment over its path (a prefix's own causal attention once, each
  continuation's queries over the path's keys, gathered); on CUDA flash-attn varlen with
  each segment's path keys and values gathered (``cu_seqlens_k`` over the paths, causal
  aligned bottom-right), or compiled flex attention with the tree's ``BlockMask``. The
  gathered keys and values cost memory: every segment's whole path, about ``G · P`` rows
  for ``G`` rollouts of a ``P``-token prompt (:attr:`TreeLayout.gathered_rows`), kept by
  flash-attn for the backward pass in every layer — the K/V memory of unpacked rollouts,
  where the row itself holds ``P + G · R``. ``kernel="auto"`` therefore takes flex when
  that exceeds :data:`FLASH_GATHER_LIMIT` times the row (and flex runs: CUDA, triton);
  flex reads the row in place, but compiles on its first call and for new shapes;
- Hugging Face's ``flex_attention``: the batch's ``attention_mask`` is a flex
  ``BlockMask`` built from the tree directly (block tables from the segments' bounds,
  O((T/128)^2), and a ``mask_mod`` reading one subtree end per token);
- nothing else: any other implementation reads that ``BlockMask`` as a tensor and fails,
  and :func:`fastpack.torch.check_model_batch` says why first.

The batch has no ``labels``: a shared token has as many next tokens as children. Its
*target map* lists every target of every sample instead — ``target_index`` (the row
position of the predicting logit), ``target_labels`` and ``target_offsets`` (per sample) —
which :func:`fastpack.torch.packed_loss` and :func:`token_logprobs` read; every batch
(tree or not) lists its samples (``sample_ids``, ``sample_tokens``, ``sample_offsets``),
which :func:`per_sample` reads.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np
import torch

from .._errors import FastpackError, FastpackTypeError
from .._materialize import IGNORE_INDEX
from . import attention as _attention
from .attention import (
    _FLEX_BLOCK_SIZE,
    _attend,
    _from_kv_blocks,
    _kv_blocks,
    _sdpa_gqa,
    _softcap_score_mod,
)

__all__ = [
    "FLASH_GATHER_LIMIT", "SAMPLE_KEYS", "TARGET_KEYS", "TREE_KERNELS", "TREE_KEYS", "TreeLayout",
    "available_kernels",
    "is_tree_batch",
    "per_sample", "token_logprobs", "tree_attention", "tree_batch", "tree_block_mask",
    "tree_layout",
]

#: The keys that describe a batch's tree, its target map and its samples.
TREE_KEYS = ("tree_cu_seqlens", "tree_parents")
TARGET_KEYS = ("target_index", "target_labels", "target_offsets")
SAMPLE_KEYS = ("sample_ids", "sample_tokens", "sample_offsets")
#: The kernels of :func:`tree_attention` (``"auto"``: flash, flex, then sdpa; flex before
#: flash for trees whose gathered K/V would exceed :data:`FLASH_GATHER_LIMIT` rows).
TREE_KERNELS = ("auto", "flash", "flex", "sdpa")


def is_tree_batch(batch: Mapping[str, Any]) -> bool:
    return "tree_parents" in batch


def flex_available() -> str | None:
    """Why a tree batch's ``BlockMask`` cannot be built here, or None."""
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except Exception:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention"
    if not hasattr(BlockMask, "from_kv_blocks"):
        return f"torch {torch.__version__} has no BlockMask.from_kv_blocks"
    return None


# ------------------------------------------------------------------------ the layout


class TreeLayout:
    """A tree batch's segments as the attention needs them, read on the host once and
    checked: bounds, parents in preorder, each segment's path and subtree end."""

    def __init__(self, bounds: list[int], parents: list[int]) -> None:
        self.bounds = bounds
        self.parents = parents
        count = len(parents)
        #: Per segment: its ancestors' segments, from the root.
        self.ancestors: list[tuple[int, ...]] = []
        for p in parents:
            self.ancestors.append(() if p < 0 else (*self.ancestors[p], p))
        #: Per segment: the row position where its subtree ends.
        self.ends = list(bounds[1:])
        for s in range(count - 1, -1, -1):
            p = parents[s]
            if p >= 0 and self.ends[s] > self.ends[p]:
                self.ends[p] = self.ends[s]
        self._device: dict[Any, Any] = {}

    @property
    def total(self) -> int:
        return self.bounds[-1]

    def path_tokens(self, s: int) -> int:
        """Tokens before segment ``s`` on its path (its first token's position)."""
        return sum(self.bounds[a + 1] - self.bounds[a] for a in self.ancestors[s])

    def key_index(self, s: int, device: torch.device) -> torch.Tensor | None:
        """Row positions of segment ``s``'s path and its own tokens (None for a root)."""
        key = ("key", s, device)
        if key not in self._device:
            if not self.ancestors[s]:
                self._device[key] = None
            else:
                ranges = [range(self.bounds[a], self.bounds[a + 1]) for a in self.ancestors[s]]
                ranges.append(range(self.bounds[s], self.bounds[s + 1]))
                index = np.concatenate([np.arange(r.start, r.stop) for r in ranges])
                self._device[key] = torch.from_numpy(index).to(device)
        value: torch.Tensor | None = self._device[key]
        return value

    def token_ends(self, device: torch.device) -> torch.Tensor:
        """int32 [T]: the subtree end of every token's segment."""
        key = ("ends", device)
        if key not in self._device:
            lengths = np.diff(np.asarray(self.bounds, dtype=np.int64)).astype(np.int64)
            ends = np.repeat(np.asarray(self.ends, dtype=np.int32), lengths)
            self._device[key] = torch.from_numpy(ends).to(device)
        value: torch.Tensor = self._device[key]
        return value

    def _pieces(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every segment's key run as row ranges — its ancestors' segments from the root,
        then itself: ``(starts, lengths, per_segment)`` (the ranges end to end, and how many
        ranges each segment's run has)."""
        segments = [a for s in range(len(self.parents)) for a in (*self.ancestors[s], s)]
        bounds = np.asarray(self.bounds, dtype=np.int64)
        ids = np.asarray(segments, dtype=np.int64)
        counts = np.fromiter((len(a) + 1 for a in self.ancestors), dtype=np.int64,
                             count=len(self.parents))
        return bounds[ids], bounds[ids + 1] - bounds[ids], counts

    @functools.cached_property
    def gathered_rows(self) -> int:
        """Rows of K and V the ``"flash"`` kernel gathers: every segment's path and itself,
        so about ``G · P`` for ``G`` rollouts of a ``P``-token prompt (the row holds
        ``P + G · R``)."""
        return int(self._pieces()[1].sum())

    def gathered(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """For a varlen kernel: the row positions of every segment's keys (its path then
        itself) end to end, their ``cu_seqlens`` (int32) and the longest query and key
        runs."""
        key = ("gathered", device)
        if key not in self._device:
            starts, lengths, counts = self._pieces()
            total = int(lengths.sum())
            # Each range's rows: its start plus 0, 1, ... (one arange over all of them).
            first = np.cumsum(lengths) - lengths
            index = np.repeat(starts - first, lengths) + np.arange(total, dtype=np.int64)
            per_segment = np.add.reduceat(lengths, np.cumsum(counts) - counts) \
                if len(counts) else np.zeros(0, np.int64)
            cu_k = np.zeros(len(counts) + 1, dtype=np.int32)
            np.cumsum(per_segment, out=cu_k[1:])
            longest_q = int(np.diff(np.asarray(self.bounds)).max()) if len(counts) else 0
            self._device[key] = (
                torch.from_numpy(index).to(device), torch.from_numpy(cu_k).to(device),
                longest_q, int(per_segment.max()) if len(counts) else 0,
            )
        value: tuple[torch.Tensor, torch.Tensor, int, int] = self._device[key]
        return value


def _host(value: Any, name: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().to("cpu")
        if value.is_floating_point() or value.dtype == torch.bool:
            raise FastpackTypeError(f"{name}: expected integers, got {value.dtype}")
        return value.to(torch.int64).numpy().reshape(-1)
    array = np.asarray(value)
    if array.size and array.dtype.kind not in "iu":
        raise FastpackTypeError(f"{name}: expected integers, got dtype {array.dtype}")
    return array.astype(np.int64).reshape(-1)


def check_tree(cu: Any, parents: Any, total: int, positions: Any = None) -> TreeLayout:
    """The :class:`TreeLayout` of a tree batch's ``tree_cu_seqlens`` / ``tree_parents``
    over a row of ``total`` tokens, after checking them (and the positions, when given):
    bounds from 0 to ``total``, each parent an earlier segment, the segments in preorder
    (a subtree contiguous), positions counting up inside a segment and continuing from the
    parent's last one (from 0 at a root)."""
    bounds = _host(cu, "tree_cu_seqlens")
    par = _host(parents, "tree_parents")
    if len(bounds) != len(par) + 1:
        raise FastpackError(
            f"tree_parents: {len(par)} segments, but tree_cu_seqlens has {len(bounds)} entries; "
            f"expected one more bound than segments"
        )
    if len(bounds) == 0 or bounds[0] != 0 or bounds[-1] != total or np.any(np.diff(bounds) < 0):
        raise FastpackError(
            f"tree_cu_seqlens: expected bounds rising from 0 to the row's {total} tokens, got "
            f"{bounds[:6].tolist()}{' ...' if len(bounds) > 6 else ''}"
        )
    index = np.arange(len(par))
    bad = (par < -1) | (par >= index)
    if bad.any():
        s = int(np.argmax(bad))
        raise FastpackError(
            f"tree_parents: segment {s} has parent {int(par[s])}; expected -1 or an earlier "
            f"segment"
        )
    layout = TreeLayout(bounds.tolist(), par.tolist())
    for s in range(1, len(par)):
        p = int(par[s])
        if p < 0:
            continue
        prev = s - 1  # in preorder, the parent or a descendant of it
        while prev != p and prev >= 0 and prev > p:
            prev = layout.parents[prev]
        if prev != p:
            raise FastpackError(
                f"tree_parents: segment {s}'s parent {p} is not the segment before it or one "
                f"of its ancestors; a tree's segments must be in preorder (each subtree "
                f"contiguous)"
            )
    if positions is not None:
        pos = _host(positions, "position_ids")
        if len(pos) != total:
            raise FastpackError(
                f"position_ids: {len(pos)} positions for a row of {total} tokens"
            )
        starts = np.zeros(total, dtype=bool)
        starts[bounds[:-1][bounds[:-1] < total]] = True
        steps = np.diff(pos) != 1
        if np.any(steps & ~starts[1:]):
            t = int(np.argmax(steps & ~starts[1:])) + 1
            raise FastpackError(
                f"position_ids: position {int(pos[t])} at row position {t} does not follow "
                f"{int(pos[t - 1])} inside its segment"
            )
        for s, p in enumerate(layout.parents):
            lo, hi = layout.bounds[s], layout.bounds[s + 1]
            if lo == hi:
                continue
            want = 0 if p < 0 else int(pos[layout.bounds[p + 1] - 1]) + 1
            if int(pos[lo]) != want:
                raise FastpackError(
                    f"position_ids: segment {s} starts at position {int(pos[lo])}; expected "
                    f"{want} ({'a root' if p < 0 else f'continuing its parent {p}'})"
                )
    return layout


class _Cache:
    """The layout of the last tree batch seen (by the identity and in-place version of its
    ``tree_parents`` tensor), so a forward reads and checks its tree once, not per layer."""

    def __init__(self) -> None:
        self._ref: weakref.ref[torch.Tensor] | None = None
        self._key: Any = None
        self.layout: TreeLayout | None = None

    def get(self, parents: Any, key: Any) -> TreeLayout | None:
        if (isinstance(parents, torch.Tensor) and self._ref is not None
                and self._ref() is parents and self._key == (key, parents._version)):
            return self.layout
        return None

    def put(self, parents: Any, key: Any, layout: TreeLayout) -> None:
        if isinstance(parents, torch.Tensor):
            self._ref, self._key = weakref.ref(parents), (key, parents._version)
            self.layout = layout


_LAYOUTS = _Cache()


def tree_layout(cu: Any, parents: Any, total: int, positions: Any = None) -> TreeLayout:
    """:func:`check_tree`, once per batch (cached on the ``tree_parents`` tensor)."""
    key = (total, id(cu), id(positions))
    layout = _LAYOUTS.get(parents, key)
    if layout is None:
        layout = check_tree(cu, parents, total, positions)
        _LAYOUTS.put(parents, key, layout)
    return layout


# ---------------------------------------------------------------------- block mask


def _tree_block_tables(
    ends: torch.Tensor, total: int, block: int, windowed: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``BlockMask.from_kv_blocks`` tables of the tree mask ``k <= q < ends[k]`` (no
    ``T x T`` tensor): a block pair is listed when some pair in it may be allowed, as
    *full* when every pair is (then the ``mask_mod`` is skipped). ``ends`` is padded with
    -1 past ``total``. With a window no block is full (the window is in positions, which a
    row position does not bound)."""
    device = ends.device
    nb = -(-total // block)
    padded = torch.full((nb * block,), -1, dtype=torch.int64, device=device)
    padded[:total] = ends.to(torch.int64)
    per_block = padded.view(nb, block)
    most, least = per_block.max(dim=1).values, per_block.min(dim=1).values
    starts = torch.arange(nb, device=device, dtype=torch.int64) * block
    lasts = torch.clamp(starts + block, max=total) - 1
    complete = lasts - starts + 1 == block
    # Rows: query blocks i; columns: key blocks j.
    touch = (starts[None, :] <= lasts[:, None]) & (starts[:, None] < most[None, :])
    full = (lasts[None, :] <= starts[:, None]) & (lasts[:, None] < least[None, :])
    full &= complete[:, None] & complete[None, :]
    if windowed:
        full &= False
    return (padded, *_kv_blocks(touch & ~full), *_kv_blocks(full))


def _tree_mask(ends: torch.Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> torch.Tensor:
    return (kv_idx <= q_idx) & (q_idx < ends[kv_idx])


def _windowed_tree_mask(ends: torch.Tensor, positions: torch.Tensor, window: int, b: Any,
                        h: Any, q_idx: Any, kv_idx: Any) -> torch.Tensor:
    seen = (kv_idx <= q_idx) & (q_idx < ends[kv_idx])
    return seen & (positions[q_idx] - positions[kv_idx] < window)


def _tree_mask_mod(
    ends: torch.Tensor, positions: torch.Tensor | None, window: int | None
) -> Callable[..., torch.Tensor]:
    # Partials of module functions, not closures: a batch's BlockMask pickles, so a
    # DataLoader worker can send it.
    if window is not None:
        assert positions is not None
        return functools.partial(_windowed_tree_mask, ends, positions, window)
    return functools.partial(_tree_mask, ends)


def tree_block_mask(
    layout: TreeLayout,
    device: torch.device | str = "cpu",
    *,
    sliding_window: int | None = None,
    positions: torch.Tensor | None = None,
) -> Any:
    """The flex ``BlockMask`` of a tree batch, built from its segments directly: block
    tables of size ``(T/128)^2`` and a ``mask_mod`` over one subtree end per token. With
    ``sliding_window`` (which needs ``positions``), a key is also within the window of
    the query's position."""
    device = torch.device(device)
    total = layout.total
    ends, *tables = _tree_block_tables(
        layout.token_ends(device), total, _FLEX_BLOCK_SIZE, sliding_window is not None
    )
    pos = None
    if sliding_window is not None:
        if positions is None:
            raise FastpackError("tree_block_mask: a sliding window needs the positions")
        pos = torch.zeros(len(ends), dtype=torch.int64, device=device)
        pos[:total] = positions.reshape(-1).to(device=device, dtype=torch.int64)
    return _from_kv_blocks(tables, total, _tree_mask_mod(ends, pos, sliding_window))


# ------------------------------------------------------------------------- the batch


def tree_batch(rows: Mapping[str, Any], *, return_num_items: bool = False) -> dict[str, Any]:
    """A tree batch for ``model(**batch)`` from :func:`fastpack._tree.tree_rows`'s rows:
    torch tensors (no copy), the tree's ``BlockMask`` as ``attention_mask`` and
    ``use_cache=False`` (see the module docs)."""
    out: dict[str, Any] = {
        key: torch.from_numpy(np.ascontiguousarray(rows[key]))
        for key in ("input_ids", "position_ids", *TREE_KEYS, *TARGET_KEYS, *SAMPLE_KEYS)
    }
    total = int(out["input_ids"].shape[-1])
    layout = check_tree(out["tree_cu_seqlens"], out["tree_parents"], total)
    out["attention_mask"] = _guarded(tree_block_mask(layout))
    out["use_cache"] = False
    if return_num_items:
        out["num_items_in_batch"] = torch.tensor(int(rows["num_targets"]))
    return out


_PLAIN_ATTENTION = (
    "attention_mask: this is a tree batch (share_prefix=True): its mask is a flex "
    "BlockMask over shared prefixes, which only flex attention reads, and {what} used it as "
    "a tensor mask; load the model with attn_implementation=register_hf_attention() (any "
    "backend) or attn_implementation='flex_attention'"
)


try:
    from torch.nn.attention.flex_attention import BlockMask as _BlockMask
except Exception:  # a torch without flex attention builds no tree batch (flex_available)
    _BlockMask = object  # type: ignore[assignment,misc]


class TreeBlockMask(_BlockMask):  # type: ignore[misc,valid-type]
    """A tree batch's ``BlockMask``: flex attention reads it as any other, and an attention
    that takes tensor masks (Hugging Face's sdpa and eager) raises a :class:`FastpackError`
    where it uses it — as an argument of a torch function or in ``scores + mask`` —
    instead of torch's TypeError. Module-level, so a batch pickles for loader workers."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", str(func))
        raise FastpackError(_PLAIN_ATTENTION.format(what=f"torch's {name}"))

    def __radd__(self, other: Any) -> Any:
        raise FastpackError(_PLAIN_ATTENTION.format(what="an attention adding it to its "
                                                    "scores"))

    __add__ = __radd__


def _guarded(mask: Any) -> Any:
    mask.__class__ = TreeBlockMask
    return mask


# --------------------------------------------------------------------- attention


def available_kernels(q: torch.Tensor) -> list[str]:
    """The kernels :func:`tree_attention` could use for inputs like ``q``, in ``"auto"``'s
    order (``"sdpa"`` is always last and always there): the CUDA kernels need what they
    need for :func:`~fastpack.torch.varlen_attention`."""
    return [k for k in TREE_KERNELS[1:-1] if _attention._unavailable_reason(k, q) is None] + [
        "sdpa"]


#: ``"auto"`` takes flex over flash when flash would gather more than this many times
#: the row's rows of K and V (see :meth:`TreeLayout.gathered_rows`): flash-attn keeps
#: them for the backward pass, every layer, while flex reads the row where it lies.
FLASH_GATHER_LIMIT = 2.0


def _tree_kernel(kernel: str, q: torch.Tensor, layout: TreeLayout | None = None) -> str:
    if kernel == "auto":
        return _auto_kernel(available_kernels(q), layout)
    if kernel not in TREE_KERNELS:
        raise FastpackError(
            f"kernel: {kernel!r} cannot compute a tree batch; expected one of "
            f"{', '.join(map(repr, TREE_KERNELS))}"
        )
    reason = _attention._unavailable_reason(kernel, q)
    if reason is not None:
        raise FastpackError(f"kernel={kernel!r} is not available: {reason}")
    return kernel


def _auto_kernel(available: list[str], layout: TreeLayout | None) -> str:
    """``"auto"``'s kernel among ``available`` (in order): flash, unless its gathered
    K/V would exceed :data:`FLASH_GATHER_LIMIT` times the row's and flex is there (high
    fan-out trees: many rollouts of a long prompt)."""
    chosen = available[0]
    if (chosen == "flash" and "flex" in available and layout is not None
            and layout.gathered_rows > FLASH_GATHER_LIMIT * max(layout.total, 1)):
        return "flex"
    return chosen


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: TreeLayout,
    *,
    softmax_scale: float | None = None,
    kernel: str = "auto",
    sliding_window: int | None = None,
    softcap: float | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a tree batch: every token attends to its path's tokens and its
    own segment's past, nothing else. ``q``: ``(T, Hq, D)``, ``k``/``v``: ``(T, Hkv, D)``;
    returns ``(T, Hq, D)``. ``sliding_window`` (Hugging Face's: a query sees keys whose
    position is less than ``w`` before its own) needs ``positions`` for the flex kernel."""
    # flex needs the positions for a window: without them "auto" keeps flash.
    chosen = _tree_kernel(kernel, q, layout if sliding_window is None or positions is not None
                          else None)
    if chosen == "flash":
        return _tree_flash(q, k, v, layout, softmax_scale, sliding_window, softcap)
    if chosen == "flex":
        return _tree_flex(q, k, v, layout, softmax_scale, sliding_window, softcap, positions)
    return _tree_sdpa(q, k, v, layout, softmax_scale, sliding_window, softcap)


def _allowed(path: int, length: int, window: int | None, device: torch.device
             ) -> torch.Tensor | None:
    """``[length, path + length]`` bool for queries at positions ``path ..`` over keys at
    positions ``0 ..``: causal, within the window; None when that is plain causal
    attention over keys as long as the queries."""
    total = path + length
    if path == 0 and (window is None or length <= window):
        return None
    query = torch.arange(path, total, device=device)[:, None]
    key = torch.arange(total, device=device)[None, :]
    allowed = key <= query
    if window is not None:
        allowed &= query - key < window
    return allowed


def _tree_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TreeLayout,
    scale: float | None, window: int | None, softcap: float | None,
) -> torch.Tensor:
    k, v, gqa = _sdpa_gqa(q, k, v, softcap)
    outs = []
    bounds = layout.bounds
    for s in range(len(layout.parents)):
        lo, hi = bounds[s], bounds[s + 1]
        if lo == hi:
            continue
        index = layout.key_index(s, q.device)
        qs = q[lo:hi].transpose(0, 1).unsqueeze(0)
        if index is None:
            ks, vs = (t[lo:hi].transpose(0, 1).unsqueeze(0) for t in (k, v))
        else:
            ks, vs = (t.index_select(0, index).transpose(0, 1).unsqueeze(0) for t in (k, v))
        allowed = _allowed(ks.shape[2] - (hi - lo), hi - lo, window, q.device)
        out = _attend(qs, ks, vs, allowed, True, scale, softcap, gqa)
        outs.append(out.transpose(1, 2))
    if not outs:
        return q[:0]
    return torch.cat(outs, dim=1)[0]


def _tree_flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TreeLayout,
    scale: float | None, window: int | None, softcap: float | None,
) -> torch.Tensor:
    """flash-attn varlen over the gathered paths: query run ``s`` is segment ``s``'s
    tokens (the row as it is), key run ``s`` its path's keys then its own; flash-attn
    aligns a causal mask bottom-right when a key run is longer than its query run, so each
    query sees the path and its own past."""
    fn = _attention._flash_varlen_func()
    assert fn is not None
    index, cu_k, longest_q, longest_k = layout.gathered(q.device)
    cu_q = torch.as_tensor(layout.bounds, dtype=torch.int32).to(q.device)
    kwargs = _attention._flash_options(fn, window, softcap)
    kg, vg = (t.index_select(0, index).contiguous() for t in (k, v))
    out: torch.Tensor = fn(
        q.contiguous(), kg, vg, cu_q, cu_k, longest_q, longest_k, dropout_p=0.0,
        softmax_scale=scale, causal=True, **kwargs,
    )
    return out


def _tree_flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TreeLayout,
    scale: float | None, window: int | None, softcap: float | None,
    positions: torch.Tensor | None,
) -> torch.Tensor:
    block_mask = tree_block_mask(layout, q.device, sliding_window=window, positions=positions)
    kwargs: dict[str, Any] = {}
    if q.shape[1] != k.shape[1]:
        kwargs["enable_gqa"] = True
    if softcap is not None:
        kwargs["score_mod"] = _softcap_score_mod(softcap)
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out: torch.Tensor = _attention._compiled_flex_attention()(
        q4, k4, v4, block_mask=block_mask, scale=scale, **kwargs
    )
    return out[0].transpose(0, 1)


# ----------------------------------------------------------------------- samples


def _tensor(batch: Mapping[str, Any], key: str, device: torch.device) -> torch.Tensor:
    if key not in batch:
        raise FastpackError(
            f"batch: no {key!r}; per_sample and token_logprobs read the samples a batch "
            f"lists (PackedCollator and PackedDataset batches do)"
        )
    value = batch[key]
    tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    return tensor.to(device=device, dtype=torch.int64)


def _flat(values: torch.Tensor, batch: Mapping[str, Any], what: str) -> torch.Tensor:
    """``values`` per token of the batch, as ``[rows * W, ...]``."""
    ids = batch.get("input_ids")
    shape = tuple(ids.shape) if ids is not None else None
    if shape is not None and tuple(values.shape[: len(shape)]) == shape:
        return values.reshape(-1, *values.shape[len(shape):])
    tokens = int(np.prod(shape)) if shape is not None else None
    if tokens is not None and values.ndim >= 1 and values.shape[0] == tokens:
        return values
    raise FastpackError(
        f"{what}: shape {tuple(values.shape)} does not match the batch's tokens "
        f"{shape}; expected one value per token, [rows, T, ...] or [rows * T, ...]"
    )


def targets(batch: Mapping[str, Any], device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(index, labels, offsets)``: the batch's target map — every target's predicting
    row position (flattened), its label, and per sample the range of its targets. A tree
    batch carries it; a plain one's follows from its ``labels`` and samples."""
    if "target_index" in batch:
        return tuple(_tensor(batch, key, device) for key in TARGET_KEYS)  # type: ignore[return-value]
    tokens = _tensor(batch, "sample_tokens", device)
    offsets = _tensor(batch, "sample_offsets", device)
    if "labels" not in batch:
        raise FastpackError("batch: no 'labels' and no target map ('target_index')")
    labels = torch.as_tensor(batch["labels"]).to(device=device, dtype=torch.int64).reshape(-1)
    follows = torch.ones(len(tokens), dtype=torch.bool, device=device)
    follows[offsets[:-1][offsets[:-1] < len(tokens)]] = False  # a sample's first token
    next_label = labels[tokens]
    keep = follows & (next_label != IGNORE_INDEX)
    keep_prev = torch.zeros_like(keep)
    keep_prev[:-1] = keep[1:]
    index = tokens[keep_prev]
    kept_labels = next_label[keep]
    counts = torch.zeros(len(offsets) - 1, dtype=torch.int64, device=device)
    sample = torch.repeat_interleave(
        torch.arange(len(offsets) - 1, device=device), offsets.diff(), output_size=len(tokens)
    )
    counts.index_add_(0, sample[keep], torch.ones_like(kept_labels))
    out_offsets = torch.zeros(len(offsets), dtype=torch.int64, device=device)
    torch.cumsum(counts, 0, out=out_offsets[1:])
    return index, kept_labels, out_offsets


def _split(values: torch.Tensor, offsets: torch.Tensor, reduction: str | None
           ) -> list[torch.Tensor] | torch.Tensor:
    if reduction is None:
        return list(values.split(offsets.diff().tolist()))
    count = len(offsets) - 1
    sample = torch.repeat_interleave(
        torch.arange(count, device=values.device), offsets.diff(), output_size=len(values)
    )
    sums = values.new_zeros((count, *values.shape[1:])).index_add_(0, sample, values)
    if reduction == "sum":
        return sums
    n = offsets.diff().clamp(min=1).to(values.dtype)
    return sums / n.reshape(-1, *([1] * (values.ndim - 1)))


def per_sample(
    values: torch.Tensor,
    batch: Mapping[str, Any],
    *,
    of: Literal["tokens", "targets"] = "tokens",
    reduction: Literal["sum", "mean"] | None = None,
) -> list[torch.Tensor] | torch.Tensor:
    """Values of every sample of ``batch``, in the batch's sample order (its
    ``sample_ids``), for plain and tree batches alike — differentiable. That order is the
    input order on every backend (ascending ``sample_ids``, even where bin packing put the
    samples in other rows), so per-sample results zip with per-input values (rewards,
    advantages) as they are.

    ``of="tokens"``: ``values`` has one entry per token of the batch (``[rows, T, ...]``
    as the logits or hidden states come, or flattened); sample ``k`` gets the values at
    its tokens, in order (``[L_k, ...]``) — a shared prefix's values once per sample
    sharing it. ``of="targets"``: ``values`` has one entry per target of the batch's
    target map (as :func:`token_logprobs` returns them); sample ``k`` gets its targets'.
    ``reduction="sum"`` / ``"mean"`` gives one row per sample (``[N, ...]``) instead of a
    list: ``per_sample(token_logprobs(logits, batch), batch, of="targets",
    reduction="sum")`` is every sample's sequence log-probability (DPO, reward models)."""
    if not isinstance(values, torch.Tensor):
        raise FastpackTypeError(f"values: expected a torch.Tensor, got {type(values).__name__}")
    if of not in ("tokens", "targets"):
        raise FastpackError(f"of: unknown value {of!r}; expected 'tokens' or 'targets'")
    if reduction not in (None, "sum", "mean"):
        raise FastpackError(f"reduction: unknown value {reduction!r}; expected None, 'sum' or "
                            f"'mean'")
    if of == "targets":
        _, _, offsets = targets(batch, values.device)
        if values.ndim == 0 or values.shape[0] != int(offsets[-1]):
            raise FastpackError(
                f"values: shape {tuple(values.shape)}; expected one value per target of the "
                f"batch ({int(offsets[-1])})"
            )
        return _split(values, offsets, reduction)
    flat = _flat(values, batch, "values")
    index = _tensor(batch, "sample_tokens", values.device)
    offsets = _tensor(batch, "sample_offsets", values.device)
    return _split(flat.index_select(0, index), offsets, reduction)


def token_logprobs(logits: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor:
    """The log-probability the model gives every target of ``batch`` (``[M]``, in the
    target map's order: sample by sample, position by position): ``log_softmax`` of the
    predicting logit at the target's label (half precision upcast to float32). The
    normaliser is computed per target, so a shared prefix's last token, which predicts
    the first token of each of its continuations, counts once per continuation: that
    costs a few rows, where finding the distinct rows would make the host wait for the
    device. On the CPU the labels are checked against the vocabulary; on an accelerator
    (where the check would wait for the device too) an id outside it is the kernel's
    index error."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise FastpackTypeError("logits: expected a floating-point torch.Tensor")
    flat = _flat(logits, batch, "logits")
    if flat.ndim != 2:
        raise FastpackError(f"logits: expected [rows, T, vocab], got {tuple(logits.shape)}")
    if flat.dtype not in (torch.float32, torch.float64):
        flat = flat.float()
    index, labels, _ = targets(batch, flat.device)
    if flat.device.type == "cpu" and labels.numel() and not (
            0 <= int(labels.min()) <= int(labels.max()) < flat.shape[-1]):
        bad = int(labels.min()) if int(labels.min()) < 0 else int(labels.max())
        raise FastpackError(
            f"labels: token id {bad} is outside the vocabulary 0..{flat.shape[-1] - 1}"
        )
    picked = flat.index_select(0, index)
    return picked.gather(1, labels[:, None])[:, 0] - torch.logsumexp(picked, dim=-1)
