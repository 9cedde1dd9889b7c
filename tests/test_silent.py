"""Silent wrong results closed (issue 24, items 1-6 and 9): each test here fails on the
code before the fix, where the user's training silently changed (or a mistake passed
without a word).

- A vision-language batch's ``num_items_in_batch`` counts the targets its labels hold,
  placeholders excluded, from the collator and from a dataset's sampler steps.
- Context parallelism: the Trainer refuses a label smoother or ``compute_loss_func``
  (they shift a shard's non-contiguous labels), and a shard given to Hugging Face's own
  attention raises before the first layer.
- ``fastpack.hf.pack_dataset`` keeps rows with media whole.
- ``per_sample`` lists samples in input order on every backend.
- ``second_per_grid_ts`` is multiplied in the dtype Hugging Face multiplies it in.
- Quiet misuse raises, naming the argument, or warns with the count.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from vlm_models import IMAGE, VIDEO, document, documents, model, type_ids  # noqa: E402
from vlm_models import config as vlm_config  # noqa: E402

import fastpack.vlm as vlm  # noqa: E402
from fastpack import FastpackError  # noqa: E402
from fastpack.torch import (  # noqa: E402
    PackedCollator,
    PackedDataset,
    PackedSampler,
    packed_loss,
    per_sample,
    register_hf_attention,
    shard_for_context_parallel,
    token_logprobs,
)


@pytest.fixture(scope="module", autouse=True)
def quiet() -> Iterator[None]:
    transformers.logging.set_verbosity_error()
    yield


def targets(batch: dict[str, Any]) -> int:
    return int((batch["labels"][..., 1:] != -100).sum())


# ----------------------------------------------------------- 1. the VLM normaliser
@pytest.mark.parametrize("backend", ["flash", "sdpa"])
def test_vlm_num_items_counts_the_targets_the_labels_hold(backend: str) -> None:
    """Placeholders get label -100 in the batch, so they are not in its normaliser (on
    the code before, num_items_in_batch counted them too)."""
    docs = documents("qwen2_5_vl")
    collator = PackedCollator(max_len=128, backend=backend, model_config=vlm_config(
        "qwen2_5_vl"), return_num_items=True)
    batch = collator(docs)
    placeholders = int(((batch["input_ids"] == IMAGE) | (batch["input_ids"] == VIDEO)).sum())
    assert placeholders > 0 and targets(batch) > 0
    assert int(batch["num_items_in_batch"]) == targets(batch)
    logits = torch.randn(*batch["labels"].shape, 64, dtype=torch.float64)
    mean = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 64), batch["labels"][:, 1:].reshape(-1), ignore_index=-100)
    assert torch.allclose(packed_loss(logits, batch), mean)


def test_vlm_dataset_steps_count_the_targets_their_batches_hold() -> None:
    """The sampler's normaliser (known before any batch is built, from the plan) equals
    the targets of the batches it serves, with labels, a loss mask and neither."""
    docs = [document("qwen2_vl", 50 + k, [("text", 3 + k % 4), ("image", (1, 4, 2 + 2 * (k % 2))),
                                          ("text", 2), ("video", (2, 2, 2))], seed=k)
            for k in range(10)]
    tokens = [d["input_ids"] for d in docs]
    collator = PackedCollator(max_len=64, backend="flash", model_config=vlm_config("qwen2_vl"))
    masks = [[k % 3 != 0 for k in range(len(t))] for t in tokens]
    labels = [[-100 if k % 5 == 0 else x for k, x in enumerate(t)] for t in tokens]
    for extra in ({}, {"loss_mask": masks}, {"labels": labels}):
        ds = PackedDataset(tokens, collator, media=docs, packs_per_batch=1, **extra)
        steps = list(PackedSampler(ds, num_replicas=1, rank=0, shuffle=False))
        assert len(steps) == len(ds) > 1
        for step in steps:
            batch = ds[step]
            assert int(batch["num_items_in_batch"]) == targets(batch), extra


# ------------------------------------------------------- 2-3. context parallelism
def _cp_one() -> str:
    group = torch.distributed.ProcessGroup(torch.distributed.HashStore(), 0, 1)
    return register_hf_attention("fastpack_cp_silent", context_parallel_group=group)


def _llama(impl: str) -> Any:
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=8)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).double().eval()
    m.set_attn_implementation(impl)
    return m


def _row() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    samples = [{"input_ids": torch.randint(1, 64, (n,), generator=g).tolist()} for n in (9, 14)]
    return PackedCollator(max_len=64, backend="flash", return_num_items=True)(samples)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_a_shard_raises_in_hugging_faces_own_attention(impl: str) -> None:
    """Before, each rank silently attended to its own tokens only (logits off by 0.1)."""
    shard = shard_for_context_parallel(_row(), 2, 0, "zigzag")
    with pytest.raises(FastpackError, match=r"^attention_mask: this batch is one rank's "
                                            r"share of a context-parallel row"):
        _llama(impl)(**shard)


def test_a_shard_runs_in_fastpacks_context_parallel_attention() -> None:
    """The guard is never read there: a group of one gives the row's logits and loss."""
    row = _row()
    want = _llama(register_hf_attention())(**row)
    shard = shard_for_context_parallel(row, 1, 0, "zigzag")
    got = _llama(_cp_one())(**shard)
    assert torch.allclose(got.logits, want.logits, atol=1e-12)
    assert torch.allclose(got.loss, want.loss, atol=1e-12)
    # The normaliser of "sequence" weighting comes with the collator's (L1).
    assert int(shard["num_sequences_in_batch"]) == 2
    packed_loss(got.logits, shard, weighting="sequence")


@pytest.mark.parametrize("option", ["label_smoothing_factor", "compute_loss_func"])
def test_the_trainer_refuses_losses_that_shift_a_shards_labels(tmp_path: Path,
                                                               option: str) -> None:
    from fastpack.torch import PackedTrainerMixin, first_item

    class Trainer(PackedTrainerMixin, transformers.Trainer):  # type: ignore[misc]
        pass

    rows = [{"input_ids": list(range(1, n))} for n in (7, 12, 9, 5)]
    data = pytest.importorskip("datasets").Dataset.from_list(rows)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=1, report_to=[],
        use_cpu=True, label_smoothing_factor=0.1 if option == "label_smoothing_factor" else 0.0)
    extra = {"compute_loss_func": lambda *a, **k: 0} if option == "compute_loss_func" else {}
    trainer = Trainer(model=_llama(_cp_one()).float(), args=args, train_dataset=data,
                      data_collator=PackedCollator(max_len=32, backend="flash", cp_size=1),
                      **extra)
    assert first_item  # the mixin builds its own loader
    with pytest.raises(FastpackError, match=rf"^{option}: .*context-parallel shard's labels"):
        trainer.train()


# ------------------------------------------------------ 4. pack_dataset with media
@pytest.mark.parametrize("option", [{"overlong": "split"}, {"overlong": "truncate"},
                                    {"strategy": "wrapped"}])
def test_pack_dataset_keeps_rows_with_media_whole(option: dict[str, str]) -> None:
    datasets = pytest.importorskip("datasets")
    import fastpack.hf

    rows = [{"input_ids": [1] * 10 + [IMAGE] * 4 + [2] * 10, "image_grid_thw": [[1, 4, 4]],
             "pixel_values": np.zeros((16, 24), np.float32).tolist()} for _ in range(3)]
    name = next(iter(option))
    with pytest.raises(FastpackError, match=rf"^{name}: '{option[name]}' would cut rows with "
                                            r"media \(pixel_values, image_grid_thw\)"):
        fastpack.hf.pack_dataset(datasets.Dataset.from_list(rows), 32, **option)


# ------------------------------------------------------------ 5. per-sample order
@pytest.mark.parametrize("backend", ["sdpa", "eager", "flash", "padded"])
def test_per_sample_lists_the_samples_in_input_order(backend: str) -> None:
    """GRPO zips per-sample log-probabilities with per-input advantages: before, the sdpa
    and eager batches listed their samples longest first (bin-packing order)."""
    rng = np.random.default_rng(0)
    samples = [{"input_ids": rng.integers(1, 50, n).tolist()} for n in (3, 9, 6, 17, 4, 11)]
    batch = PackedCollator(max_len=20, backend=backend)(samples)
    assert batch["sample_ids"].tolist() == list(range(len(samples)))
    got = per_sample(batch["input_ids"], batch)
    assert [g.tolist() for g in got] == [s["input_ids"] for s in samples]
    logits = torch.randn(*batch["input_ids"].shape, 50, dtype=torch.float64)
    sums = per_sample(token_logprobs(logits, batch), batch, of="targets", reduction="sum")
    flat = logits.reshape(-1, 50).log_softmax(-1)
    for k, s in enumerate(samples):
        rows = per_sample(torch.arange(batch["input_ids"].numel()), batch)[k]
        want = flat[rows[:-1], torch.tensor(s["input_ids"][1:])].sum()
        assert torch.allclose(sums[k], want), (backend, k)


def test_a_dataset_step_lists_its_samples_in_input_order() -> None:
    rng = np.random.default_rng(1)
    tokens = [rng.integers(1, 50, n).tolist() for n in rng.integers(1, 30, 40)]
    tokens[5] = rng.integers(1, 50, 150).tolist()  # split into pieces over several steps
    ds = PackedDataset(tokens, PackedCollator(max_len=64, backend="sdpa", overlong="split"),
                       packs_per_batch=3)
    pieces: dict[int, list[int]] = {}
    for i in range(len(ds)):
        batch = ds[i]
        ids = batch["sample_ids"].tolist()
        assert ids == sorted(ids) and ids == sorted(ds.samples(i).tolist())
        for sid, values in zip(ids, per_sample(batch["input_ids"], batch)):
            pieces.setdefault(sid, []).extend(values.tolist())
    assert sorted(len(v) for v in pieces.values()) == sorted(len(t) for t in tokens)
    assert all(sorted(pieces[k]) == sorted(t) for k, t in enumerate(tokens))


# ------------------------------------------------------ 6. second_per_grid_ts dtypes
def _hf_rope(ids: list[int], grid: torch.Tensor, seconds: Any) -> np.ndarray:
    pos, _ = model("qwen2_5_vl").model.get_rope_index(
        torch.tensor([ids]), type_ids(ids), video_grid_thw=grid, second_per_grid_ts=seconds)
    return pos[:, 0].numpy()  # type: ignore[no-any-return]


@pytest.mark.parametrize("form", ["numpy float64", "float16", "bfloat16", "numpy float16"])
def test_second_per_grid_ts_is_multiplied_in_the_models_dtype(form: str) -> None:
    """Numpy arrays go through numpy scalars (float32 in torch), half-precision tensors
    multiply in their dtype: positions equal get_rope_index for every fps tried (before,
    numpy float64 differed at fps 49, float16 at fps 24 and bfloat16 raised TypeError)."""
    cfg = model("qwen2_5_vl").config
    for fps in (24, 25, 29.97, 49, 60):
        t = 60
        ids = [1, 2] + [VIDEO] * (t * 2 * 2 // 4) + [3]
        grid = torch.tensor([[t, 2, 2]])
        value = 2 / fps
        seconds: Any = {
            "numpy float64": np.array([value]), "numpy float16": np.array([value], np.float16),
            "float16": torch.tensor([value], dtype=torch.float16),
            "bfloat16": torch.tensor([value], dtype=torch.bfloat16),
        }[form]
        want = _hf_rope(ids, grid, seconds)
        got = vlm.rope_index(cfg, ids, video_grid_thw=grid, second_per_grid_ts=seconds)
        np.testing.assert_array_equal(got, want, err_msg=f"{form} fps {fps}")


def test_a_huge_time_step_raises_naming_its_argument() -> None:
    """Before: positions of -2^63 (a saturated float, then a wrapped add)."""
    cfg = model("qwen2_5_vl").config.to_dict()
    ids = [1] + [VIDEO] * 2 + [2]
    grid = [[2, 2, 2]]
    with pytest.raises(FastpackError, match=r"^second_per_grid_ts: video 0: its last "
                                            r"temporal position .* beyond 2\^53"):
        vlm.rope_index(cfg, ids, video_grid_thw=grid, second_per_grid_ts=[1e300])
    cfg["vision_config"]["tokens_per_second"] = 1e30
    with pytest.raises(FastpackError, match=r"^tokens_per_second: video 0"):
        vlm.rope_index(cfg, ids, video_grid_thw=grid, second_per_grid_ts=[1e-3])
    cfg["vision_config"]["tokens_per_second"] = float("inf")
    with pytest.raises(FastpackError, match=r"^tokens_per_second: is inf"):
        vlm.rope_index(cfg, ids, video_grid_thw=grid)


# --------------------------------------------------------------- 9. quiet misuse
def test_pre_shifted_labels_warn() -> None:
    collator = PackedCollator(max_len=16, backend="flash")
    with pytest.warns(UserWarning, match=r"^labels: every label equals the next token"):
        collator([{"input_ids": [1, 2, 3], "labels": [2, 3, -100]},
                  {"input_ids": [4, 5], "labels": [5, -100]}])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        collator([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}])  # aligned: fine
        collator([{"input_ids": [5, 5, 5], "labels": [5, 5, 5]}])  # both readings: fine


def test_a_prompt_key_needs_share_prefix() -> None:
    samples = [{"input_ids": [1, 2, 3], "prompt_id": 0}, {"input_ids": [1, 2, 4], "prompt_id": 0}]
    with pytest.raises(FastpackError, match=r"^features: sample 0 has 'prompt_id', .* pass "
                                            r"share_prefix=True"):
        PackedCollator(max_len=16, backend="flash")(samples)
    PackedCollator(max_len=16, backend="flash", ignore_keys=("prompt_id",))(samples)


def test_share_prefix_that_shares_nothing_warns_with_the_count() -> None:
    collator = PackedCollator(max_len=16, backend="flash", share_prefix=True)
    with pytest.warns(UserWarning, match=r"^share_prefix: True, but the 2 samples of this "
                                         r"batch share no prefix \(6 tokens computed"):
        collator([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6]}])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        collator([{"input_ids": [1, 2, 3]}, {"input_ids": [1, 2, 6]}])


def test_preference_pairs_need_share_prefix() -> None:
    with pytest.raises(FastpackError, match=r"^features: sample 0 is a preference pair "
                                            r".*pass share_prefix=True"):
        PackedCollator(max_len=16, backend="flash")(
            [{"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4]}])


def test_negative_token_ids_raise() -> None:
    with pytest.raises(FastpackError, match=r"^input_ids: sample 1 holds the negative token "
                                            r"id -2 \(token 1\)"):
        PackedCollator(max_len=16, backend="flash")([{"input_ids": [1, 2]},
                                                     {"input_ids": [1, -2, 3]}])


def test_pixel_values_of_the_wrong_width_raise() -> None:
    sample = document("qwen2_vl", 50, [("text", 2), ("image", (1, 4, 4))])
    sample["pixel_values"] = sample["pixel_values"][:, :23]
    with pytest.raises(FastpackError, match=r"^features: sample 0 'pixel_values': shape "
                                            r"\(16, 23\): the model's patches have 24"):
        PackedCollator(max_len=64, backend="flash", model_config=vlm_config("qwen2_vl"))(
            [sample])


def test_the_command_refuses_a_mismatched_labels_column_and_negative_ids(
        tmp_path: Path) -> None:
    from click.testing import CliRunner

    from fastpack.cli import main

    def run(rows: list[dict[str, Any]], name: str) -> tuple[int, str]:
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        result = CliRunner().invoke(main, ["pack", str(path), "-o", str(tmp_path / name),
                                           "--max-len", "16", "--quiet"])
        return result.exit_code, result.output

    code, out = run([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]},
                     {"input_ids": [4, 5], "labels": [5]}], "labels")
    assert code == 2 and "'labels'" in out and "has 1 values where 'input_ids' has 2" in out
    code, out = run([{"input_ids": [1, 2, 3]}, {"input_ids": [4, -5]}], "negative")
    assert code == 2 and "row 1" in out and "negative token id -5" in out, out


# -- 9f: a tree batch given to an attention that takes tensor masks


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("backend", ["flash", "flex"])
def test_a_tree_batch_raises_in_an_attention_of_tensor_masks(impl: str, backend: str) -> None:
    """A tree batch's mask is a flex BlockMask; Hugging Face's sdpa and eager used to fail
    inside torch with a TypeError that names no fix. Now the forward raises a
    FastpackError naming attention_mask and the attention to load."""
    from fastpack.torch import register_hf_attention

    samples = [{"input_ids": [1, 2, 3, 4, 5, 6], "prompt_id": 0},
               {"input_ids": [1, 2, 3, 4, 9, 9, 9], "prompt_id": 0}]
    batch = PackedCollator(max_len=64, backend=backend, share_prefix=True)(samples)
    m = _llama(impl)
    with torch.no_grad(), pytest.raises(FastpackError, match="^attention_mask: this is a "
                                        "tree batch.*register_hf_attention"):
        m(**batch)
    # fastpack's attention computes the same batch: the guard never reaches it.
    m.set_attn_implementation(register_hf_attention())
    with torch.no_grad():
        out = m(**batch).logits
    assert out.shape[1] == batch["input_ids"].shape[1]
