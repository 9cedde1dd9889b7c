"""Packed batches train exactly like unpacked ones: tiny random Hugging Face models, CPU, fp32."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import fastpack  # noqa: E402
from fastpack import FastpackError  # noqa: E402
from fastpack.torch import PackedCollator, PackedDataset, first_item  # noqa: E402

ATOL = 1e-5
VOCAB = 101
LENGTHS = [5, 17, 9, 30, 3, 12, 1, 22]

transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", category=UserWarning)


def llama(impl: str) -> Any:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        attn_implementation=impl,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def gpt2(impl: str) -> Any:
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128,
        attn_implementation=impl, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


MODELS: dict[str, Callable[[str], Any]] = {"llama": llama, "gpt2": gpt2}


def samples(lengths: list[int] = LENGTHS, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(1, VOCAB, n).tolist()} for n in lengths]


def locate(batch: dict[str, Any], n_samples: int) -> list[tuple[int, int, int]]:
    """(row, start, length) of every sample in the batch, in sample order (from the
    collator's own plan, recomputed here from the ids: every sample is unique)."""
    ids = batch["input_ids"]
    pos = batch["position_ids"] if "position_ids" in batch else None
    found = []
    for r in range(ids.shape[0]):
        starts = (pos[r] == 0).nonzero().flatten().tolist() if pos is not None else [0]
        bounds = [*starts, ids.shape[1]]
        for a, b in zip(bounds[:-1], bounds[1:]):
            found.append((r, a, b - a))
    return found


def per_sequence_logits(model: Any, feats: list[dict[str, Any]]) -> list[Any]:
    with torch.no_grad():
        return [model(input_ids=torch.tensor([f["input_ids"]])).logits[0] for f in feats]


def check_logits(
    model: Any, batch: dict[str, Any], feats: list[dict[str, Any]], *,
    drop: tuple[str, ...] = (), extra: dict[str, Any] | None = None,
) -> float:
    """Max |logit diff| of every sample in the packed batch vs the sample run alone; the
    model gets the batch minus ``drop`` keys plus ``extra``."""
    inputs = {k: v for k, v in batch.items() if k != "labels" and k not in drop}
    with torch.no_grad():
        logits = model(**inputs, **(extra or {})).logits
    refs = {tuple(f["input_ids"]): ref for f, ref in zip(feats, per_sequence_logits(model, feats))}
    ids = batch["input_ids"]
    worst, seen = 0.0, 0
    for r, a, n in locate(batch, len(feats)):
        key = tuple(ids[r, a : a + n].tolist())
        if key in refs:
            worst = max(worst, (logits[r, a : a + n] - refs[key]).abs().max().item())
            seen += 1
    assert seen == len(feats)
    return worst


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("mask", ["position_ids", "explicit"])
def test_logits_equal_one_by_one(arch: str, impl: str, mask: str) -> None:
    model = MODELS[arch](impl)
    feats = samples()
    batch = PackedCollator(max_len=40, backend=impl, mask=mask)(feats)
    assert batch["input_ids"].shape[0] < len(feats)  # really packed
    assert check_logits(model, batch, feats) <= ATOL


def test_position_starts_read_once_per_batch() -> None:
    """A prepared model's hook and every attention layer read one batch's position_ids:
    its sequence starts are read from the tensor once, and again once it changed."""
    from fastpack.torch.formats import position_starts

    positions = torch.tensor([[0, 1, 2, 0, 1]])
    first = position_starts(positions, 1, 5)
    assert first.tolist() == [[True, False, False, True, False]]
    assert position_starts(positions, 1, 5) is first
    positions[0, 3] = 3  # changed in place: read again
    again = position_starts(positions, 1, 5)
    assert again is not first and again.tolist() == [[True, False, False, False, True]]
    assert position_starts(positions.clone(), 1, 5) is not again  # another tensor


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("select", ["config", "set_attn_implementation"])
def test_registered_varlen_attention_equals_one_by_one(
    arch: str, select: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fastpack.torch.hf_attention as hf
    from fastpack.torch import register_hf_attention

    name = register_hf_attention()
    if select == "config":  # the attention implementation chosen when building the model
        model = MODELS[arch](name)
    else:  # or switched on a model built (or loaded) with another one
        model = MODELS[arch]("sdpa")
        model.set_attn_implementation(name)
    assert model.config._attn_implementation == name
    feats = samples()
    batch = PackedCollator(max_len=128, backend="flash")(feats)
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
    # The registered function really runs: varlen_attention once per layer and forward...
    calls: list[int] = []
    original_varlen = hf.varlen_attention

    def counting_varlen(q: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(q.shape[0])
        return original_varlen(q, *args, **kwargs)

    monkeypatch.setattr(hf, "varlen_attention", counting_varlen)
    # ... and attends per sequence: no SDPA call sees more than one sequence.
    spy: list[int] = []
    original = torch.nn.functional.scaled_dot_product_attention

    def counting_sdpa(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:
        spy.append(k.shape[-2])
        return original(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting_sdpa)
    worst = check_logits(model, batch, feats)
    layers = model.config.num_hidden_layers
    assert calls[:layers] == [batch["input_ids"].shape[1]] * layers
    assert worst <= ATOL
    assert spy and max(spy[: len(feats)]) <= max(LENGTHS)
    model.train()
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss)


@pytest.mark.parametrize("mask", ["position_ids", "explicit"])
def test_flex_logits_eager(mask: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """CI's form of the flex equivalence: the same batches through Hugging Face's flex
    attention, with flex_attention and the block mask run eagerly (no inductor compile:
    seconds instead of a minute on the CPU). The compiled path: ``test_flex_logits``."""
    flex = pytest.importorskip("transformers.integrations.flex_attention")
    masking = pytest.importorskip("transformers.masking_utils")
    monkeypatch.setattr(flex, "is_torchdynamo_compiling", lambda: True)  # eager flex
    create = masking.create_block_mask
    monkeypatch.setattr(masking, "create_block_mask",
                        lambda *a, **k: create(*a, **{**k, "_compile": False}))
    model = llama("flex_attention")
    feats = samples([5, 17, 9, 3])
    batch = PackedCollator(max_len=40, backend="flex", mask=mask)(feats)
    assert batch["input_ids"].shape[0] < len(feats)  # really packed
    if mask == "explicit":
        assert type(batch["attention_mask"]).__name__ == "BlockMask"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert check_logits(model, batch, feats) <= ATOL


@pytest.mark.skipif(
    not os.environ.get("FASTPACK_SLOW_TESTS"),
    reason="flex attention compiles with inductor on the CPU (~40 s); set FASTPACK_SLOW_TESTS=1",
)
@pytest.mark.parametrize("mask", ["position_ids", "explicit"])
def test_flex_logits(mask: str) -> None:
    model = llama("flex_attention")
    feats = samples([5, 17, 9, 3])
    batch = PackedCollator(max_len=40, backend="flex", mask=mask)(feats)
    if mask == "explicit":
        assert type(batch["attention_mask"]).__name__ == "BlockMask"
    try:
        worst = check_logits(model, batch, feats)
    except Exception as e:  # inductor's CPU codegen needs a working C++ toolchain
        if "Inductor" in type(e).__name__ or "CppCompile" in str(e):
            pytest.skip(f"flex attention does not compile on this CPU setup: {type(e).__name__}")
        raise
    assert worst <= ATOL


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_loss_and_gradients_equal_unpacked(arch: str) -> None:
    feats = samples()
    mask_rng = np.random.default_rng(1)
    for f in feats:  # response-only loss: a random loss mask per token
        f["assistant_masks"] = (mask_rng.random(len(f["input_ids"])) < 0.6).astype(int).tolist()
    model = MODELS[arch]("sdpa").train()
    batch = PackedCollator(max_len=40, backend="sdpa")(feats)
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]

    # Unpacked: sum of every sequence's token losses / number of target tokens.
    model.zero_grad()
    total, count = torch.zeros(()), 0
    for f in feats:
        ids = torch.tensor([f["input_ids"]])
        labels = ids.clone()
        labels[0, torch.tensor(f["assistant_masks"]) == 0] = -100
        labels[0, 0] = -100
        logits = model(input_ids=ids).logits[0, :-1]
        target = labels[0, 1:]
        total = total + torch.nn.functional.cross_entropy(
            logits, target, ignore_index=-100, reduction="sum"
        )
        count += int((target != -100).sum())
    ref = total / count
    ref.backward()
    assert count == int((batch["labels"] != -100).sum())
    assert abs(loss.item() - ref.item()) <= ATOL
    for g, p in zip(packed_grads, model.parameters()):
        assert (g - p.grad).abs().max().item() <= ATOL


def test_batch_contract_prevents_silent_failures() -> None:
    feats = samples()
    for backend in ("sdpa", "eager", "flex"):
        b = PackedCollator(max_len=40, backend=backend)(feats)
        assert "attention_mask" not in b  # never an all-ones mask with packed positions
        assert b["use_cache"] is False
        pos, labels, ids = b["position_ids"], b["labels"], b["input_ids"]
        starts = pos == 0
        assert (labels[starts] == -100).all()  # no sequence predicts the next one's start
        assert starts.sum() > ids.shape[0]  # positions restart inside rows
        assert ids.dtype == pos.dtype == labels.dtype == torch.int64
    flash = PackedCollator(max_len=40, backend="flash", pad_to_multiple_of=16,
                           fixed_cu_seqlens=16, return_seq_idx=True)(feats)
    cu = flash["cu_seq_lens_q"]
    assert flash["input_ids"].shape[0] == 1 and flash["input_ids"].shape[1] % 16 == 0
    assert cu.dtype == torch.int32 and cu.shape == (16,) and cu[-1] == flash["input_ids"].shape[1]
    assert flash["cu_seq_lens_k"] is cu and isinstance(flash["max_length_q"], int)
    assert flash["seq_idx"].dtype == torch.int32
    lengths = torch.diff(cu)
    assert flash["max_length_q"] == int(lengths.max())
    starts = cu[:-1][lengths > 0].long()
    assert (flash["position_ids"][0, starts] == 0).all()
    assert (flash["labels"][0, starts] == -100).all()


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_without_the_contract_models_attend_across_sequences(arch: str) -> None:
    """The guard is meaningful: the same packed rows go wrong the way users report."""
    model = MODELS[arch]("sdpa")
    feats = samples()
    batch = PackedCollator(max_len=40, backend="sdpa")(feats)
    assert check_logits(model, batch, feats) <= ATOL
    # The default use_cache=True, an all-ones attention_mask, or no position_ids.
    assert check_logits(model, batch, feats, drop=("use_cache",)) > 1e-3
    ones = torch.ones_like(batch["input_ids"])
    assert check_logits(model, batch, feats, extra={"attention_mask": ones}) > 1e-3
    assert check_logits(model, batch, feats, drop=("position_ids",)) > 1e-3


def test_padded_baseline_and_numpy() -> None:
    feats = samples()
    model = llama("sdpa")
    b = PackedCollator(max_len=40, backend="padded", pad_to_multiple_of=8)(feats)
    assert b["input_ids"].shape == (len(feats), 32)
    assert b["attention_mask"].sum(1).tolist() == LENGTHS
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    for i, (f, ref) in enumerate(zip(feats, per_sequence_logits(model, feats))):
        assert (logits[i, : len(f["input_ids"])] - ref).abs().max().item() <= ATOL
    npb = PackedCollator(max_len=40, backend="flash", return_tensors="np")(feats)
    assert isinstance(npb["input_ids"], np.ndarray) and npb["cu_seq_lens_q"].dtype == np.int32


def test_separators_labels_and_overlong() -> None:
    feats = [{"input_ids": [1, 2, 3], "labels": [7, 8, 9]}, {"input_ids": [4, 5]}]
    with pytest.raises(FastpackError, match="sample 1 has no 'labels'"):
        PackedCollator(max_len=8)(feats)  # labels on some samples only
    feats[1]["labels"] = [10, 11]
    b = PackedCollator(max_len=8, backend="flash", separator_id=0, train_separators=True,
                       return_num_items=True)(feats)
    assert b["input_ids"].tolist() == [[1, 2, 3, 0, 4, 5, 0]]
    assert b["labels"].tolist() == [[-100, 8, 9, 0, -100, 11, 0]]
    assert int(b["num_items_in_batch"]) == 5
    with pytest.raises(FastpackError, match="overlong"):
        PackedCollator(max_len=2)(feats)
    cut = PackedCollator(max_len=2, overlong="truncate")(feats)
    assert cut["input_ids"].tolist() == [[1, 2], [4, 5]]


def test_packed_dataset_with_dataloader_and_trainer(tmp_path: Any) -> None:
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(0)
    rows = [rng.integers(1, VOCAB, n).tolist() for n in rng.integers(1, 40, 64)]
    ds = datasets.Dataset.from_dict({"input_ids": rows})
    packed = PackedDataset(ds, PackedCollator(max_len=64, backend="sdpa"), packs_per_batch=2)
    assert packed.plan.num_packs <= packed.plan.lower_bound + 1
    loader = torch.utils.data.DataLoader(packed, batch_size=None, shuffle=True)
    seen = []
    for batch in loader:
        ids = batch["input_ids"]
        seen += ids[ids > 0].tolist()
        assert "attention_mask" not in batch and batch["use_cache"] is False
    assert sorted(seen) == sorted(t for r in rows for t in r)

    model = llama("sdpa").train()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=1, max_steps=2, report_to=[],
        use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=packed,
                                   data_collator=first_item)
    assert trainer.train().training_loss > 0
    # And the per-batch collator, straight from the dataset.
    trainer = transformers.Trainer(model=model, args=args, train_dataset=ds,
                                   data_collator=PackedCollator(max_len=64, backend="sdpa"))
    assert trainer.train().training_loss > 0


def test_chat_template_response_only_loss() -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = ["hello how are you", "I am fine thank you", "what is two plus two", "four"] * 5
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=90, special_tokens=["<pad>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>")
    fast.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}<|end|>"
        "{% else %}<|assistant|>{% generation %}{{ m['content'] }}<|end|>{% endgeneration %}"
        "{% endif %}{% endfor %}"
    )
    chats = [
        [{"role": "user", "content": "hello how are you"},
         {"role": "assistant", "content": "I am fine thank you"},
         {"role": "user", "content": "what is two plus two"},
         {"role": "assistant", "content": "four"}],
        [{"role": "user", "content": "what is two plus two"},
         {"role": "assistant", "content": "four"}],
    ]
    feats = [dict(fast.apply_chat_template(c, return_assistant_tokens_mask=True,
                                           return_dict=True, tokenize=True)) for c in chats]
    b = PackedCollator(max_len=128, backend="flash")(feats)
    ids, labels = b["input_ids"][0].tolist(), b["labels"][0].tolist()
    targets = fast.decode([t for t, lab in zip(ids, labels) if lab != -100])
    assert "four" in targets and "fine" in targets
    assert "hello" not in targets and "plus" not in targets and "<|user|>" not in targets
    assert sum(lab != -100 for lab in labels) == sum(
        sum(m) - (m[0] == 1) for m in (f["assistant_masks"] for f in feats)
    )


def test_varlen_attention_on_collated_batch() -> None:
    from fastpack.torch import varlen_attention

    b = PackedCollator(max_len=40, backend="flash")(samples())
    cu, t = b["cu_seq_lens_q"], b["input_ids"].shape[1]
    q, k, v = (torch.randn(t, 4, 8) for _ in range(3))
    out = varlen_attention(q, k, v, cu, b["max_length_q"])
    a, z = int(cu[1]), int(cu[2])
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[a:z].transpose(0, 1), k[a:z].transpose(0, 1), v[a:z].transpose(0, 1), is_causal=True
    ).transpose(0, 1)
    assert (out[a:z] - ref).abs().max().item() <= ATOL


def test_fixed_cu_seqlens_too_small_for_the_batch() -> None:
    # Every other user mistake is a row of tests/test_errors.py; this one needs a batch.
    with pytest.raises(FastpackError, match="fixed_cu_seqlens: the batch has 8 segments"):
        PackedCollator(max_len=40, backend="flash", fixed_cu_seqlens=2)(samples())
    assert fastpack.IGNORE_INDEX == -100


def test_shuffle_never_changes_the_strategy() -> None:
    # SFT-like lengths: next_fit (what shuffle=False used to switch flat layouts to) needs
    # many more packs than bfd.
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.4, 0.8, 2000).astype(np.int64), 1, 1024)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    tokens = fastpack.Ragged(np.ones(int(offsets[-1]), dtype=np.int32), offsets)
    for backend in ("flash", "sdpa"):
        collator = PackedCollator(max_len=1024, backend=backend)
        plans = [PackedDataset(tokens, collator, shuffle=s).plan for s in (True, False)]
        assert [p.strategy for p in plans] == ["bfd", "bfd"]
        assert plans[0].num_packs == plans[1].num_packs
        assert plans[0].num_packs < fastpack.pack(lengths, 1024, strategy="next_fit").num_packs
    # One batch on the flat layout keeps its samples in order.
    feats = samples()
    b = PackedCollator(max_len=64, backend="flash")(feats)
    assert b["input_ids"][0, : len(feats[0]["input_ids"])].tolist() == feats[0]["input_ids"]


def test_padded_backend_honours_shuffle_and_seed() -> None:
    tokens = fastpack.Ragged(np.arange(40, dtype=np.int32), np.arange(0, 41, 4))
    collator = PackedCollator(max_len=8, backend="padded")
    kept = PackedDataset(tokens, collator, shuffle=False).plan.sample_ids.tolist()
    assert kept == list(range(10))
    orders = [PackedDataset(tokens, collator, seed=s).plan.sample_ids.tolist() for s in (0, 0, 1)]
    assert orders[0] == orders[1] != orders[2]
    assert sorted(orders[0]) == kept and orders[0] != kept


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 20), max_size=12), max_len=st.integers(2, 16),
       separator=st.booleans(), overlong=st.sampled_from(["error", "truncate"]),
       shuffle=st.booleans(), seed=st.integers(0, 2**64 - 1))
def test_the_padded_backend_plans_one_sample_per_pack_with_the_core(
        lengths: list[int], max_len: int, separator: bool, overlong: str, shuffle: bool,
        seed: int) -> None:
    # What the padded baseline needs, written out plainly: every non-empty sample in a pack
    # of its own, cut to max_len with its separator slot, in input order or shuffled.
    collator = PackedCollator(max_len=max_len, backend="padded", overlong=overlong,
                              separator_id=0 if separator else None)
    reserve = int(separator)
    extended = np.array(lengths, dtype=np.int64) + reserve
    if overlong == "error" and any(n and n + reserve > max_len for n in lengths):
        with pytest.raises(FastpackError, match=r"^lengths: \d+ sequence\(s\) longer than"):
            collator.plan(lengths, shuffle=shuffle, seed=seed)
        return
    plan = collator.plan(lengths, shuffle=shuffle, seed=seed)
    kept = np.flatnonzero(np.array(lengths, dtype=np.int64) > 0)
    order = fastpack._core.permutation(len(kept), seed) if shuffle else np.arange(len(kept))
    assert plan.sample_ids.tolist() == kept[order].tolist()
    assert plan.seqlens.tolist() == np.minimum(extended, max_len)[kept][order].tolist()
    assert plan.starts.tolist() == [0] * len(kept)
    assert plan.pack_offsets.tolist() == list(range(len(kept) + 1))
    cut = np.maximum(extended[kept] - max_len, 0)
    assert (plan.truncated_sequences, plan.truncated_tokens) == (
        int((cut > 0).sum()), int(cut.sum()))
    assert plan.empty_sequences == len(lengths) - len(kept)
    # The strategy the plan was made with is the collator's: one word, one planner.
    assert plan.strategy == collator.strategy == "one_per_pack"
    assert plan.options == collator.options.replace(shuffle=shuffle, seed=seed)
    assert plan.efficiency == (plan.total_tokens / (len(kept) * max_len) if len(kept) else 1.0)


def test_a_padded_batch_is_one_sample_per_row_planned_by_the_core() -> None:
    features = [{"input_ids": list(range(1, n + 1))} for n in (3, 0, 5, 2)]
    collator = PackedCollator(max_len=8, backend="padded", return_tensors="np")
    batch = collator(features)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0, 0], [1, 2, 3, 4, 5], [1, 2, 0, 0, 0]]
    assert batch["attention_mask"].sum(axis=1).tolist() == [3, 5, 2]
    with pytest.raises(FastpackError, match=r"^strategy: 'ffd' does not apply to "
                                            r"backend='padded'"):
        PackedCollator(max_len=8, backend="padded", strategy="ffd")
    # A plan of several samples per pack would be masked as padding: refused.
    data = PackedDataset([[1, 2], [3]], collator, plan=fastpack.pack([2, 1], 8))
    with pytest.raises(FastpackError, match=r"^plan: made with strategy 'bfd', but "
                                            r"backend='padded' needs one sample per row"):
        data[0]


@pytest.mark.parametrize(("sample", "key"), [
    ({"input_ids": [1, 2, 3], "assistant_mask": [0, 1, 1]}, "assistant_mask"),
    ({"input_ids": [1, 2, 3], "label": [1, 2, 3]}, "label"),
    ({"input_ids": np.array([1, 2]), "loss_masks": np.array([0, 1])}, "loss_masks"),
    ({"input_ids": [1, 2], "foo": torch.tensor([1, 1])}, "foo"),
])
def test_unknown_per_token_keys_raise(sample: dict[str, Any], key: str) -> None:
    with pytest.raises(FastpackError, match=f"sample 0 has the per-token key '{key}'.*"
                                            f"assistant_masks.*ignore_keys"):
        PackedCollator(max_len=8, backend="flash")([sample])
    dropped = PackedCollator(max_len=8, backend="flash", ignore_keys=(key,))([sample])
    assert dropped["input_ids"].tolist() == [list(map(int, sample["input_ids"]))]


def test_metadata_keys_are_ignored_and_bad_samples_raise() -> None:
    # TRL's text columns, ids and tokenizer outputs that fastpack rebuilds itself.
    sample = {"input_ids": [1, 2, 3], "messages": [{"role": "user", "content": "hi"}] * 3,
              "prompt": "hi", "completion": "ho", "id": 7, "attention_mask": [1, 1, 1],
              "position_ids": [0, 1, 2], "assistant_masks": [0, 1, 1]}
    b = PackedCollator(max_len=8, backend="flash")([sample])
    assert b["labels"].tolist() == [[-100, 2, 3]]
    collator = PackedCollator(max_len=8, backend="flash")
    with pytest.raises(FastpackError, match="sample 1 has 'attention_mask' with zeros"):
        collator([sample, {"input_ids": [1, 2], "attention_mask": [1, 0]}])
    with pytest.raises(FastpackError, match="sample 0 has 'position_ids' with values"):
        collator([{"input_ids": [1, 2, 3], "position_ids": [0, 1, 0]}])
    with pytest.raises(FastpackError, match="sample 0 has 'seq_lengths': it is already packed"):
        collator([{"input_ids": [1, 2, 3], "seq_lengths": [2, 1]}])
    for backend in ("flash", "sdpa", "padded"):
        with pytest.raises(FastpackError, match="no tokens: sample.s. 0 have empty"):
            PackedCollator(max_len=8, backend=backend)([{"input_ids": []}])
    # An empty sample beside real ones holds nothing to lose.
    b = collator([{"input_ids": []}, {"input_ids": [4, 5]}])
    assert b["input_ids"].tolist() == [[4, 5]]
