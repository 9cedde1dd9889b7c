"""The kernel path of ``prepare_model`` (``strategy="kernels"`` / ``"auto"`` on CUDA): each
mixer once over the whole packed batch, its CUDA kernels given their own sequence
boundaries (causal-conv1d's and mamba_ssm's ``seq_idx``, flash-linear-attention's
``cu_seqlens``).

CI has no GPU: the kernels are stood in for by small torch references of their documented
contracts (the state and the convolution window restart where ``seq_idx`` changes / at
every ``cu_seqlens`` boundary), installed in ``sys.modules`` under the kernels' module
names, and the device check is patched so that the CUDA branch runs on the CPU."""

from __future__ import annotations

import copy
import sys
import types
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402

from fastpack import FastpackError  # noqa: E402
from fastpack.torch import (  # noqa: E402
    PackedCollator,
    mixer_paths,
    prepare_model,
    register_hf_attention,  # noqa: E402
)
from fastpack.torch import mixers as mixers_mod  # noqa: E402

LENGTHS = (9, 1, 14, 6, 17)
CALLS: list[tuple[str, torch.Tensor | None]] = []


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread beats two busy ones
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def samples() -> list[list[int]]:
    out, start = [], 1
    for n in LENGTHS:
        out.append(list(range(start, start + n)))
        start += n
    return out


# -- stand-ins of the kernels' contracts --------------------------------------------------

def conv_standin(x: Any, weight: Any, bias: Any = None, seq_idx: Any = None,
                 initial_states: Any = None, return_final_states: bool = False,
                 final_states_out: Any = None, activation: Any = None) -> Any:
    """causal_conv1d_fn: depthwise causal convolution of ``x`` ``[B, C, L]``; a tap reads
    zero where ``seq_idx`` ``[B, L]`` differs from the output token's."""
    CALLS.append(("causal_conv1d_fn", seq_idx))
    width, length = weight.shape[-1], x.shape[-1]
    xf = x.to(weight.dtype)
    out = xf * weight[:, width - 1, None]
    for lag in range(1, width):
        shifted = F.pad(xf[..., :-lag], (lag, 0))[..., :length]
        if seq_idx is not None:
            before = F.pad(seq_idx[:, :-lag], (lag, 0), value=-1)[:, :length]
            shifted = shifted * (before == seq_idx)[:, None, :]
        out = out + shifted * weight[:, width - 1 - lag, None]
    if bias is not None:
        out = out + bias[:, None]
    if activation in ("silu", "swish"):
        out = F.silu(out)
    return out.to(x.dtype)


def conv_without_seq_idx(x: Any, weight: Any, bias: Any = None, initial_states: Any = None,
                         activation: Any = None) -> Any:
    """An old causal-conv1d: no ``seq_idx``."""
    return conv_standin(x, weight, bias, activation=activation)


def scan_standin(x: Any, dt: Any, A: Any, B: Any, C: Any, chunk_size: int, D: Any = None,
                 z: Any = None, dt_bias: Any = None, initial_states: Any = None,
                 seq_idx: Any = None, cu_seqlens: Any = None, dt_softplus: bool = False,
                 dt_limit: tuple[float, float] = (0.0, float("inf")),
                 return_final_states: bool = False, return_varlen_states: bool = False) -> Any:
    """mamba_chunk_scan_combined as its recurrence: ``x`` ``[B, L, H, P]``, the state
    ``[B, H, P, N]`` zeroed where ``seq_idx`` changes."""
    CALLS.append(("mamba_chunk_scan_combined", seq_idx))
    heads = x.shape[2]
    dt = dt.float() + (dt_bias.float() if dt_bias is not None else 0)
    dt = F.softplus(dt) if dt_softplus else dt
    dt = dt.clamp(dt_limit[0], dt_limit[1])
    Bh = B.float().repeat_interleave(heads // B.shape[2], dim=2)
    Ch = C.float().repeat_interleave(heads // C.shape[2], dim=2)
    xf = x.float()
    state = xf.new_zeros(x.shape[0], heads, x.shape[3], B.shape[3])
    out = []
    for t in range(x.shape[1]):
        if seq_idx is not None and t > 0:
            keep = (seq_idx[:, t] == seq_idx[:, t - 1]).float()
            state = state * keep[:, None, None, None]
        decay = torch.exp(A.float() * dt[:, t])[..., None, None]
        state = state * decay + (dt[:, t, :, None] * xf[:, t])[..., None] * Bh[:, t, :, None, :]
        out.append((state * Ch[:, t, :, None, :]).sum(-1))
    y = torch.stack(out, 1)
    if D is not None:
        y = y + xf * (D.float()[:, None] if D.dim() == 1 else D.float())
    return y


def gdn_standin(q: Any, k: Any, v: Any, g: Any, beta: Any, scale: Any = None,
                initial_state: Any = None, output_final_state: bool = False,
                use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Any = None) -> Any:
    """chunk_gated_delta_rule as its recurrence: ``q``, ``k`` ``[B, T, H, K]``, ``v``
    ``[B, T, H, V]``; the state ``[B, H, K, V]`` zeroed at every ``cu_seqlens`` start."""
    CALLS.append(("chunk_gated_delta_rule", cu_seqlens))
    qf, kf, vf = q.float(), k.float(), v.float()
    if use_qk_l2norm_in_kernel:
        qf = qf * torch.rsqrt((qf * qf).sum(-1, keepdim=True) + 1e-6)
        kf = kf * torch.rsqrt((kf * kf).sum(-1, keepdim=True) + 1e-6)
    qf = qf * (scale if scale is not None else q.shape[-1] ** -0.5)
    starts = set(cu_seqlens.tolist()[:-1]) if cu_seqlens is not None else {0}
    state = qf.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    out = []
    for t in range(q.shape[1]):
        if t in starts:
            state = state.zero_()
        state = state * g[:, t].float().exp()[..., None, None]
        delta = (vf[:, t] - (state * kf[:, t, ..., None]).sum(-2)) * beta[:, t].float()[..., None]
        state = state + kf[:, t, ..., None] * delta[..., None, :]
        out.append((state * qf[:, t, ..., None]).sum(-2))
    return torch.stack(out, 1).to(v.dtype), (state if output_final_state else None)


def install(monkeypatch: pytest.MonkeyPatch, conv: Any = conv_standin) -> None:
    """The stand-ins under the kernels' module names; the device check says CUDA."""
    for name, attrs in (("causal_conv1d", {"causal_conv1d_fn": conv}),
                        ("mamba_ssm.ops.triton.ssd_combined",
                         {"mamba_chunk_scan_combined": scan_standin}),
                        ("fla.ops.gated_delta_rule", {"chunk_gated_delta_rule": gdn_standin})):
        module = types.ModuleType(name)
        for key, value in attrs.items():
            setattr(module, key, value)
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(mixers_mod, "_on_cuda", lambda tensor: True)
    CALLS.clear()


_BUILT: dict[str, tuple[Any, list[Any]]] = {}


def build(family: str) -> Any:
    """A fresh copy of the family's tiny model (built once, with its samples alone)."""
    if family not in _BUILT:
        base = _build(family).eval()
        _BUILT[family] = (base, alone(base))
    return copy.deepcopy(_BUILT[family][0])


def reference(family: str) -> list[Any]:
    build(family)
    return _BUILT[family][1]


def _build(family: str) -> Any:
    attn = dict(vocab_size=96, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2,
                attn_implementation=register_hf_attention())
    if family == "bamba":
        config = transformers.BambaConfig(
            mamba_expand=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16,
            mamba_d_state=8, mamba_chunk_size=8, **attn)
    else:
        config = transformers.Qwen3NextConfig(
            head_dim=8, linear_num_value_heads=2, linear_num_key_heads=2,
            linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
            layer_types=["linear_attention", "full_attention"], **attn)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def alone(model: Any) -> list[Any]:
    """Each sample alone (one sequence per row: the mixers run Hugging Face's torch path)."""
    with torch.no_grad():
        return [model(input_ids=torch.tensor([s])).logits[0] for s in samples()]


def packed(model: Any, backend: str) -> list[Any]:
    batch = PackedCollator(max_len=32, backend=backend)([{"input_ids": s} for s in samples()])
    batch.pop("labels", None)
    with torch.no_grad():
        logits = model(**batch).logits
    ids = batch["input_ids"].reshape(-1)
    flat = logits.reshape(ids.shape[0], -1)
    firsts = {s[0]: len(s) for s in samples()}
    starts = batch["position_ids"].reshape(-1) == 0
    found = {int(ids[i]): flat[i:i + firsts[int(ids[i])]]
             for i in torch.nonzero(starts)[:, 0].tolist() if int(ids[i]) in firsts}
    return [found[s[0]] for s in samples()]


def expected_seq_idx(backend: str) -> torch.Tensor:
    batch = PackedCollator(max_len=32, backend=backend)([{"input_ids": s} for s in samples()])
    rows, width = batch["input_ids"].shape
    starts = (batch["position_ids"] == 0).reshape(-1).clone()
    starts[::width] = True  # every row starts a sequence (its trailing padding one more)
    return (torch.cumsum(starts.long(), 0) - 1).to(torch.int32)[None]


@pytest.mark.parametrize(("family", "backend"), [("bamba", "flash"), ("bamba", "sdpa"),
                                                 ("qwen3_next", "flash")])
def test_kernel_path_equals_each_sample_alone(monkeypatch: pytest.MonkeyPatch, family: str,
                                              backend: str) -> None:
    model = build(family)
    model.train(family == "bamba")  # Bamba in training: the fused shortcut is absent here
    install(monkeypatch)
    prepare_model(model, strategy="kernels")
    got = packed(model, backend)
    for one, ref in zip(got, reference(family), strict=True):
        torch.testing.assert_close(one, ref, atol=2e-5, rtol=0)
    seq_idx = expected_seq_idx(backend)
    names = {name for name, _ in CALLS}
    scan = "mamba_chunk_scan_combined" if family == "bamba" else "chunk_gated_delta_rule"
    assert names == {"causal_conv1d_fn", scan}
    for name, bound in CALLS:  # the kernels got the batch's boundaries, laid end to end
        assert bound is not None, name
        if name == "chunk_gated_delta_rule":
            cu = torch.cat([torch.nonzero(torch.diff(seq_idx[0], prepend=seq_idx[0, :1] - 1))[:, 0],
                            torch.tensor([seq_idx.shape[1]])])
            assert bound.dtype == torch.int64 and bound.tolist() == cu.tolist()
        else:
            assert bound.dtype == torch.int32 and torch.equal(bound, seq_idx)
    paths = mixer_paths(model)
    assert paths and all(p.startswith("kernels: causal_conv1d_fn(seq_idx), ") for p in
                         paths.values()), paths


def test_kernel_boundaries_matter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-ins are sensitive: without the boundaries the packed row leaks."""
    model = build("bamba")
    install(monkeypatch)
    prepare_model(model, strategy="kernels")
    monkeypatch.setattr(mixers_mod, "_boundaries", lambda layout, device: (None, None))
    got = packed(model, "flash")
    assert max(float((a - b).abs().max()) for a, b in zip(got, reference("bamba"), strict=True)) > 1e-3


def test_kernel_without_boundary_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    """A causal-conv1d without ``seq_idx``: refused by name when asked for, the batched
    path (exact) under ``"auto"``."""
    model = build("bamba")
    install(monkeypatch, conv=conv_without_seq_idx)
    with pytest.raises(FastpackError, match=r"model\.layers\.0\.mamba \(BambaMixer\).*"
                                            r"causal_conv1d\.causal_conv1d_fn takes no seq_idx"):
        prepare_model(model, strategy="kernels")
    prepare_model(model, strategy="auto")
    got = packed(model, "flash")
    for one, ref in zip(got, reference("bamba"), strict=True):
        torch.testing.assert_close(one, ref, atol=2e-5, rtol=0)
    assert not CALLS  # no kernel ran
    assert all(p.startswith("batched: causal_conv1d.causal_conv1d_fn takes no seq_idx")
               for p in mixer_paths(model).values()), mixer_paths(model)


def test_kernel_missing_or_off_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build("qwen3_next")
    install(monkeypatch)
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", None)  # not installed
    with pytest.raises(FastpackError, match=r"Qwen3NextGatedDeltaNet\).*flash-linear-attention "
                                            r"is not installed"):
        prepare_model(model, strategy="kernels")
    install(monkeypatch)
    monkeypatch.setattr(mixers_mod, "_on_cuda", lambda tensor: False)
    prepare_model(model, strategy="kernels")  # installed: accepted, then CPU tensors refused
    with pytest.raises(FastpackError, match=r"strategy='kernels'.*cpu tensors"):
        packed(model, "flash")
    prepare_model(model, strategy="auto")
    packed(model, "flash")
    assert all(p == "batched: cpu tensors (the kernels run on CUDA)"
               for p in mixer_paths(model).values())


def test_step_outside_the_kernels_is_never_silent(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixer whose scan does not go through a kernel that took the boundaries: refused
    under ``"kernels"``, the batched path under ``"auto"``."""
    model = build("bamba")
    modeling = sys.modules[type(model.model.layers[0].mamba).__module__]
    install(monkeypatch)

    def scan_in_torch(module: Any, hidden: Any, B: Any, C: Any, dt: Any, cache: Any,
                      **kwargs: Any) -> Any:  # a scan along the whole row, no kernel
        return torch.cumsum(hidden, dim=1)

    monkeypatch.setattr(modeling, "mamba2_scan_forward", scan_in_torch)
    prepare_model(model, strategy="kernels")
    with pytest.raises(FastpackError, match=r"BambaMixer\): its scan ran outside the kernels"):
        packed(model, "flash")
    prepare_model(model, strategy="auto")
    packed(model, "flash")
    assert all("its scan ran outside the kernels" in p and p.startswith("batched: ")
               for p in mixer_paths(model).values())


def test_kernel_problem_names_the_version_without_boundaries(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``fastpack doctor`` says about each kernel."""
    install(monkeypatch, conv=conv_without_seq_idx)
    assert mixers_mod.kernel_problem("mamba_chunk_scan_combined") is None
    assert mixers_mod.kernel_problem("chunk_gated_delta_rule") is None
    assert "causal_conv1d_fn takes no seq_idx" in str(mixers_mod.kernel_problem(
        "causal_conv1d_fn"))
    monkeypatch.setitem(sys.modules, "fla.ops.kda", None)
    assert "flash-linear-attention is not installed" in str(mixers_mod.kernel_problem(
        "chunk_kda"))


def test_mamba1_has_no_kernel_path() -> None:
    config = transformers.MambaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                      state_size=4, expand=2)
    model = transformers.MambaForCausalLM(config)
    why = mixers_mod.kernel_support(model.backbone.layers[0].mixer)
    assert isinstance(why, str) and "for its scan" in why and "mamba_selective_scan" in why
    with pytest.raises(FastpackError, match=r"MambaMixer\).*takes sequence boundaries"):
        prepare_model(model, strategy="kernels")


def test_gpu_check_hybrid_section_runs_the_kernel_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """benches/gpu_check.py's hybrid section runs ``strategy="kernels"`` where the kernels
    are there (stand-ins), reports the path each mixer ran, and passes."""
    import importlib.util
    import warnings
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benches" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check_kernels", path)
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    cfg = gpu_check.make_config(cpu_smoke=True)
    cfg["iters"], cfg["warmup"] = 1, 0
    cfg["hybrid"].update(families=["bamba"], lengths=[9, 1, 12], hidden=32)
    install(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = gpu_check.check_hybrid(torch, cfg, torch.device("cpu"), torch.float32)
    (row,) = report["rows"]
    assert row["ok"], row
    assert row["kernels"]["paths"] == ["kernels: causal_conv1d_fn(seq_idx), "
                                       "mamba_chunk_scan_combined(seq_idx)"], row
    assert row["batched"]["paths"] == ["batched: strategy='batched'"], row


def test_kernel_path_gradients_equal_the_batched_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Training through the kernel path: the loss and every gradient equal the batched
    path's (itself equal to each sample alone: tests/test_conformance_hybrid.py)."""
    batch = PackedCollator(max_len=32, backend="flash")([{"input_ids": s} for s in samples()])
    install(monkeypatch)
    grads = {}
    for strategy in ("batched", "kernels"):
        model = build("bamba").train()
        prepare_model(model, strategy=strategy)
        model(**batch).loss.backward()
        grads[strategy] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads["kernels"].keys() == grads["batched"].keys()
    for name, grad in grads["kernels"].items():
        torch.testing.assert_close(grad, grads["batched"][name], atol=2e-5, rtol=1e-4, msg=name)
