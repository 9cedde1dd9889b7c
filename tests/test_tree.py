"""Shared prefixes computed once (``share_prefix=True``): exact by construction.

Three things are proven here, on the CPU:

* **the plan** (``fastpack.pack_trees``, property-tested): every kept sample is exactly one
  path, whose segments spell its tokens at positions 0, 1, ...; no pack holds more than
  ``max_len`` distinct tokens; groups share exactly their longest common prefix and a trie
  stores every shared token once; an oversized tree is split with its prefix repeated; the
  plan is the same on 1 and 2 threads;
* **the batch**: the tree mask ``k <= q < end(k)`` equals the brute-force ancestor
  relation, the ``BlockMask`` tables built from the tree list exactly the blocks that
  relation touches (full ones full), and the target map reconstructs every original
  (sample, position) exactly once with its own label;
* **the model**: tiny random Llama and Qwen2 models (fp64 and fp32) give every sample of a
  tree batch — GRPO-like rollouts (G = 4..16, prompts of 200..2,000 tokens, responses of
  20..1,000), branching multi-turn conversations, DPO pairs — the logits it gets alone
  (fp64 within 1e-10, fp32 within 1e-5), and the gradients of the loss (token mean, a
  per-sample policy-gradient weight, the DPO loss) equal the unpacked computation's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import fastpack  # noqa: E402
from fastpack import FastpackError  # noqa: E402
from fastpack.torch import (  # noqa: E402
    PackedCollator,
    PackedDataset,
    PackedSampler,
    check_model_batch,
    packed_loss,
    per_sample,
    register_hf_attention,
    token_logprobs,
)
from fastpack.torch.tree import _tree_block_tables, check_tree  # noqa: E402

FASTPACK = register_hf_attention()
VOCAB = 96
SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------- the plan


token_rows = st.lists(st.lists(st.integers(1, 3), min_size=0, max_size=12), max_size=30)


@SETTINGS
@given(rows=token_rows, grouped=st.booleans(), max_len=st.integers(1, 30),
       overlong=st.sampled_from(["truncate", "drop"]), groups=st.data())
def test_every_kept_sample_is_one_path_spelling_its_tokens(
    rows: list[list[int]], grouped: bool, max_len: int, overlong: str, groups: Any
) -> None:
    ids = groups.draw(st.lists(st.integers(0, 3), min_size=len(rows), max_size=len(rows)))
    kwargs = {"prompt_ids": ids if grouped else None, "overlong": overlong, "max_len": max_len}
    plan = fastpack.pack_trees(rows, threads=1, **kwargs)
    assert plan.efficiency == fastpack.pack_trees(rows, threads=2, **kwargs).efficiency
    again = fastpack.pack_trees(rows, threads=2, **kwargs)
    for name in ("sample_ids", "starts", "seqlens", "pack_offsets", "parents", "path_ends"):
        assert np.array_equal(getattr(plan, name), getattr(again, name)), name
    assert (plan.pack_fills <= max_len).all()
    keep = [i for i, r in enumerate(rows) if r and (overlong == "truncate" or len(r) <= max_len)]
    assert sorted(plan.path_sample_ids.tolist()) == keep
    assert plan.sample_tokens == sum(min(len(rows[i]), max_len) for i in keep)
    # Nothing lost silently: every token is kept, truncated or dropped, and counted.
    assert plan.dropped_tokens + plan.truncated_tokens + plan.sample_tokens == sum(map(len, rows))
    for j, i in enumerate(plan.path_sample_ids.tolist()):
        path, s = [], int(plan.path_ends[j])
        while s >= 0:
            path.append(s)
            s = int(plan.parents[s])
        spelled: list[int] = []
        for s in reversed(path):
            assert plan.starts[s] == len(spelled)  # positions continue from the parent
            src = rows[int(plan.sample_ids[s])]
            spelled += src[int(plan.starts[s]):int(plan.starts[s]) + int(plan.seqlens[s])]
        assert spelled == rows[i][:max_len]


def test_prompts_share_their_longest_common_prefix_and_a_trie_every_prefix() -> None:
    rows = [[5, 6, 7, 1, 2], [5, 6, 7, 1, 3], [5, 6, 9], [8, 8]]
    grouped = fastpack.pack_trees(rows, 64, prompt_ids=["a", "a", "a", "b"], shuffle=False)
    # Prompt "a"'s prefix [5, 6] once; its three remainders below it; "b" alone.
    assert grouped.seqlens.tolist() == [2, 3, 3, 1, 2]
    assert grouped.parents.tolist() == [-1, 0, 0, 0, -1]
    trie = fastpack.pack_trees(rows, 64, shuffle=False)
    # [5, 6] -> {[7, 1] -> {[2], [3]}, [9]}; [8, 8]: every shared token once.
    assert trie.total_tokens == 9 and trie.sample_tokens == 15
    assert sorted(trie.seqlens.tolist()) == [1, 1, 1, 2, 2, 2]
    nothing = fastpack.pack_trees([[1, 2], [3, 4]], 64, prompt_ids=[0, 0])
    assert nothing.parents.tolist() == [-1, -1]  # a prompt's samples sharing nothing: fine


def test_groups_and_the_group_key_are_the_old_names_of_prompt_ids() -> None:
    """The rollout key was once called *group*, the word of packs under group_tokens: the
    old names still work, warn, and give what the new ones give."""
    rows = [[5, 6, 7, 1], [5, 6, 7, 2], [5, 6, 9], [8, 8]]
    prompts = [0, 0, 1, 1]
    new = fastpack.pack_trees(rows, 64, prompt_ids=prompts, shuffle=False)
    with pytest.warns(DeprecationWarning, match=r"^groups= is deprecated: pass prompt_ids="):
        old = fastpack.pack_trees(rows, 64, groups=prompts, shuffle=False)
    for name in ("sample_ids", "starts", "seqlens", "parents", "pack_offsets"):
        assert np.array_equal(getattr(old, name), getattr(new, name)), name
    with pytest.raises(FastpackError, match=r"^groups: the old name of prompt_ids; pass "
                                            r"prompt_ids alone"):
        fastpack.pack_trees(rows, 64, prompt_ids=prompts, groups=prompts)
    collator = PackedCollator(max_len=64, backend="flash", share_prefix=True)
    with pytest.warns(DeprecationWarning, match=r"^groups= is deprecated"):
        dataset = PackedDataset(rows, collator, groups=prompts, packs_per_batch=1, shuffle=False)
    assert np.array_equal(dataset.plan.parents, new.parents)
    by_key = collator([{"input_ids": r, "prompt_id": p} for r, p in zip(rows, prompts)])
    with pytest.warns(DeprecationWarning, match=r"^the samples' 'group' key is deprecated"):
        by_old_key = collator([{"input_ids": r, "group": p} for r, p in zip(rows, prompts)])
    for key, value in by_key.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(by_old_key[key], value), key
    assert by_key["input_ids"].shape[1] == 10  # prompt 0's [5, 6, 7] once: 13 - 3
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({"input_ids": rows, "group": prompts})
    with pytest.warns(DeprecationWarning, match=r"^the samples' 'group' key is deprecated"):
        from_column = PackedDataset(table, collator, packs_per_batch=1, shuffle=False)
    assert np.array_equal(from_column.plan.parents, new.parents)


def test_an_oversized_group_is_split_with_its_prefix_charged_again() -> None:
    prompt = list(range(1, 11))
    rows = [prompt + [20 + k] * 6 for k in range(5)]  # 10 + 5 * 6 = 40 distinct tokens
    plan = fastpack.pack_trees(rows, 22, prompt_ids=[0] * 5, shuffle=False)
    assert plan.num_packs == 3  # the prompt + 2 responses, twice; + 1
    assert plan.total_tokens == 3 * 10 + 5 * 6
    assert sorted(plan.path_sample_ids.tolist()) == list(range(5))
    with pytest.raises(FastpackError, match="must stay in one pack"):
        fastpack.pack_trees(rows, 22, prompt_ids=[0] * 5, split=False)


def test_a_part_of_a_tree_plan_holds_whole_trees_and_counts_its_paths() -> None:
    """sub_plan (a step's batch, one way for every path) of a plan of trees: its trees'
    arrays re-based, its sequences its paths, its metrics its own; a cut inside a tree
    raises."""
    from fastpack._plan import sub_plan

    rows = [[5, 6, 7, 1, 2], [5, 6, 7, 1, 3], [5, 6, 9], [8, 8, 4], [8, 8, 3, 3]]
    plan = fastpack.pack_trees(rows, 8, prompt_ids=[0, 0, 0, 1, 1], shuffle=False)
    # Group 0 (9 distinct tokens) is split, [5, 6] repeated: pack 0 holds [5, 6] -> {[7, 1,
    # 2], [7, 1, 3]}; pack 1 group 1's tree [8, 8] -> {[4], [3, 3]} and [5, 6] -> [9].
    assert plan.pack_offsets.tolist() == [0, 3, 8]
    part = sub_plan(plan, 1, 2)
    assert part.parents.tolist() == [-1, 0, 0, -1, 3]
    assert part.path_ends.tolist() == [1, 2, 4]
    assert part.path_sample_ids.tolist() == [3, 4, 2]
    assert part.num_sequences == 3 and part.buckets[0].num_sequences == 3  # its paths
    assert part.num_segments == 5
    assert part.total_tokens == 8 and part.efficiency == 1.0
    assert part.sample_tokens == len(rows[3]) + len(rows[4]) + len(rows[2])
    with pytest.raises(FastpackError, match="cuts through a tree"):
        sub_plan(plan, 1, 2, 4, 8)  # [3, 3] without its parent [8, 8]


# --------------------------------------------------------------------------- the batch


def _ancestor_relation(layout: Any) -> np.ndarray:
    """Brute force: q sees k when k's segment is q's (and k <= q) or an ancestor of it."""
    total = layout.total
    seg = np.repeat(np.arange(len(layout.parents)), np.diff(layout.bounds))
    dense = np.zeros((total, total), dtype=bool)
    for q in range(total):
        chain = {int(seg[q]), *layout.ancestors[int(seg[q])]}
        for k in range(total):
            dense[q, k] = int(seg[k]) in chain and (seg[k] != seg[q] or k <= q)
    return dense


@SETTINGS
@given(rows=st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=9), min_size=1,
                     max_size=12), grouped=st.booleans(), block=st.sampled_from([1, 2, 4, 8]),
       pad=st.sampled_from([None, 8]))
def test_the_tree_mask_is_the_ancestor_relation(
    rows: list[list[int]], grouped: bool, block: int, pad: int | None
) -> None:
    features = [{"input_ids": r, **({"prompt_id": i % 3} if grouped else {})}
                for i, r in enumerate(rows)]
    batch = PackedCollator(128, backend="flash", share_prefix=True,
                           pad_to_multiple_of=pad)(features)
    total = batch["input_ids"].shape[1]
    layout = check_tree(batch["tree_cu_seqlens"], batch["tree_parents"], total,
                        batch["position_ids"])
    dense = _ancestor_relation(layout)
    ends = layout.token_ends(torch.device("cpu")).numpy()
    q, k = np.arange(total)[:, None], np.arange(total)[None, :]
    assert np.array_equal((k <= q) & (q < ends[None, :]), dense)
    # The block tables: every block pair holding an allowed pair is listed, a full one is
    # all allowed, and none other is listed.
    _, kv_num, kv_idx, full_num, full_idx = _tree_block_tables(
        torch.from_numpy(ends), total, block, windowed=False)
    nb = -(-total // block)
    padded = np.zeros((nb * block, nb * block), dtype=bool)
    padded[:total, :total] = dense
    blocks = padded.reshape(nb, block, nb, block)
    any_allowed, all_allowed = blocks.any(axis=(1, 3)), blocks.all(axis=(1, 3))
    for i in range(nb):
        partial = set(kv_idx[0, 0, i, : int(kv_num[0, 0, i])].tolist())
        full = set(full_idx[0, 0, i, : int(full_num[0, 0, i])].tolist())
        assert not partial & full
        assert {j for j in range(nb) if any_allowed[i, j]} <= partial | full
        assert all(all_allowed[i, j] for j in full)
        assert all(any_allowed[i, j] for j in partial | full)
    # The BlockMask in the batch is the same relation.
    mask = batch["attention_mask"]
    got = mask.mask_mod(0, 0, torch.arange(total)[:, None], torch.arange(total)[None, :])
    assert np.array_equal(got.numpy(), dense)


@SETTINGS
@given(rows=st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=10), min_size=1,
                     max_size=10), masks=st.data(), grouped=st.booleans(),
       labelled=st.booleans())
def test_the_target_map_gives_every_sample_position_once(
    rows: list[list[int]], masks: Any, grouped: bool, labelled: bool
) -> None:
    features = []
    for i, r in enumerate(rows):
        f: dict[str, Any] = {"input_ids": r}
        f["completion_mask"] = masks.draw(st.lists(st.integers(0, 1), min_size=len(r),
                                                   max_size=len(r)))
        if labelled:
            f["labels"] = [t if (t + i) % 3 else -100 for t in r]
        if grouped:
            f["prompt_id"] = i % 2
        features.append(f)
    batch = PackedCollator(64, backend="flex", share_prefix=True)(features)
    ids, pos = batch["input_ids"][0], batch["position_ids"][0]
    offsets, tokens = batch["sample_offsets"], batch["sample_tokens"]
    target_offsets = batch["target_offsets"]
    assert batch["sample_ids"].tolist() == list(range(len(rows)))
    for k, f in enumerate(features):
        index = tokens[offsets[k]:offsets[k + 1]]
        assert ids[index].tolist() == f["input_ids"]
        assert pos[index].tolist() == list(range(len(f["input_ids"])))
        labels = f.get("labels", f["input_ids"])
        want = [(int(index[t - 1]), labels[t]) for t in range(1, len(labels))
                if labels[t] != -100 and f["completion_mask"][t]]
        lo, hi = int(target_offsets[k]), int(target_offsets[k + 1])
        got = list(zip(batch["target_index"][lo:hi].tolist(),
                       batch["target_labels"][lo:hi].tolist()))
        assert got == want
    assert len(batch["target_index"]) == sum(
        int(target_offsets[k + 1] - target_offsets[k]) for k in range(len(rows)))


# --------------------------------------------------------------------------- the model


def _norm_in_input_dtype(self: Any, hidden: torch.Tensor) -> torch.Tensor:
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


def tiny(family: str, dtype: torch.dtype) -> Any:
    common = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                  max_position_embeddings=4096, attn_implementation="sdpa")
    config = (transformers.LlamaConfig(**common) if family == "llama"
              else transformers.Qwen2Config(**common))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    if dtype == torch.float64:
        # Hugging Face's RMSNorm computes in float32 whatever the input: an fp64 gradient
        # summed over a shared prefix then rounds at ~1e-8 where the unpacked sum of G
        # separate ones rounds elsewhere. The same norm in the input's dtype makes the fp64
        # comparison the proof of fastpack's arithmetic, not of that float32 step.
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.forward = _norm_in_input_dtype.__get__(module)
    return model


def grpo(groups: int, size: int, prompt: tuple[int, int], response: tuple[int, int],
         seed: int) -> list[dict[str, Any]]:
    """RL rollouts: ``size`` responses per prompt, the loss on the responses only."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        p = rng.integers(1, VOCAB, int(rng.integers(*prompt))).tolist()
        for _ in range(size):
            r = rng.integers(1, VOCAB, int(rng.integers(*response))).tolist()
            out.append({"input_ids": p + r, "completion_mask": [0] * len(p) + [1] * len(r),
                        "prompt_id": f"prompt-{g}"})
    return out


def conversations(seed: int) -> list[dict[str, Any]]:
    """Branching multi-turn chats: a system prompt, user turns, two answers to each; every
    history that ends with an answer is a sample (some are prefixes of others), the loss on
    the answers only."""
    rng = np.random.default_rng(seed)

    def turn(lo: int, hi: int, role: int) -> tuple[list[int], list[int]]:
        tokens = rng.integers(1, VOCAB, int(rng.integers(lo, hi))).tolist()
        return tokens, [role] * len(tokens)

    out: list[dict[str, Any]] = []

    def grow(tokens: list[int], mask: list[int], depth: int) -> None:
        user, user_mask = turn(10, 60, 0)
        for _ in range(2):
            answer, answer_mask = turn(5, 50, 1)
            history, history_mask = tokens + user + answer, mask + user_mask + answer_mask
            out.append({"input_ids": history, "assistant_masks": history_mask})
            if depth:
                grow(history, history_mask, depth - 1)

    system, system_mask = turn(80, 120, 0)
    grow(system, system_mask, 2)
    return out


def alone(model: Any, sample: dict[str, Any]) -> torch.Tensor:
    model.set_attn_implementation("sdpa")
    return model(input_ids=torch.tensor([sample["input_ids"]])).logits[0]


def packed(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    model.set_attn_implementation(FASTPACK)
    check_model_batch(model, batch)
    return model(**batch).logits


MASK_KEYS = ("completion_mask", "assistant_masks")


def unpacked_loss(model: Any, samples: list[dict[str, Any]], weights: torch.Tensor
                  ) -> torch.Tensor:
    """Σ_i w_i Σ_t -log p(x_t | x_<t) over sample i's targets, divided by all targets."""
    total, count = 0.0, 0
    for w, s in zip(weights, samples):
        logits = alone(model, s)[:-1]
        target = torch.tensor(s["input_ids"][1:])
        mask = next((torch.tensor(s[k][1:], dtype=torch.bool) for k in MASK_KEYS if k in s),
                    torch.ones(len(target), dtype=torch.bool))
        nll = torch.nn.functional.cross_entropy(logits, target, reduction="none")[mask]
        total = total + w * nll.sum()
        count += int(mask.sum())
    return total / count


def tree_loss(model: Any, batch: dict[str, Any], weights: torch.Tensor) -> torch.Tensor:
    logps = token_logprobs(packed(model, batch), batch)
    per = per_sample(-logps, batch, of="targets", reduction="sum")
    assert isinstance(per, torch.Tensor)
    return (weights * per).sum() / len(logps)


def grads(model: Any) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return out


CASES = {
    # G = 16 rollouts of a prompt of up to 2,000 tokens, responses of 20..1,000.
    "grpo-16": (lambda: grpo(1, 16, (1500, 2001), (20, 1001), 0), 8192, "llama"),
    "grpo-4": (lambda: grpo(3, 4, (200, 400), (20, 120), 1), 2048, "qwen2"),
    "conversations": (lambda: conversations(2), 2048, "qwen2"),
    "conversations-llama": (lambda: conversations(3), 2048, "llama"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tree_logits_and_gradients_equal_unpacked_fp64(case: str) -> None:
    make, max_len, family = CASES[case]
    samples = make()
    model = tiny(family, torch.float64)
    batch = PackedCollator(max_len, backend="flash", share_prefix=True)(samples)
    assert batch["input_ids"].shape[1] < sum(len(s["input_ids"]) for s in samples)
    # A weight per sample (an advantage): each target counted once with its own.
    weights = torch.linspace(-1.0, 2.0, len(samples), dtype=torch.float64)
    logits = packed(model, batch)
    logps = token_logprobs(logits, batch)
    per = per_sample(-logps, batch, of="targets", reduction="sum")
    assert isinstance(per, torch.Tensor)
    loss = (weights * per).sum() / len(logps)
    loss.backward()
    got = grads(model)
    reference = []
    want_loss, count = torch.zeros((), dtype=torch.float64), 0
    for w, s in zip(weights, samples):
        mine = alone(model, s)
        reference.append(mine.detach())
        target = torch.tensor(s["input_ids"][1:])
        mask = next(torch.tensor(s[k][1:], dtype=torch.bool) for k in MASK_KEYS if k in s)
        nll = torch.nn.functional.cross_entropy(mine[:-1], target, reduction="none")[mask]
        want_loss = want_loss + w * nll.sum()
        count += int(mask.sum())
    (want_loss / count).backward()
    for mine, alone_logits in zip(per_sample(logits.detach(), batch), reference):
        assert (mine - alone_logits).abs().max().item() <= 1e-10
    assert abs(loss.item() - want_loss.item() / count) <= 1e-10
    for a, b in zip(got, grads(model)):
        assert (a - b).abs().max().item() <= 1e-10 * max(1.0, b.abs().max().item())
    # packed_loss over the target map is the unpacked batch's token mean.
    mean = sum(
        torch.nn.functional.cross_entropy(
            r[:-1], torch.tensor(s["input_ids"][1:]), reduction="none"
        )[next(torch.tensor(s[k][1:], dtype=torch.bool) for k in MASK_KEYS if k in s)].sum()
        for r, s in zip(reference, samples)
    ) / count
    assert abs(packed_loss(logits.detach(), batch).item() - float(mean)) <= 1e-10


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tree_logits_equal_unpacked_fp32(family: str) -> None:
    model = tiny(family, torch.float32)
    for samples in (grpo(2, 8, (200, 600), (20, 300), 3), conversations(4)):
        batch = PackedCollator(4096, backend="flash", share_prefix=True)(samples)
        with torch.no_grad():
            logits = per_sample(packed(model, batch), batch)
            for s, mine in zip(samples, logits):
                assert (mine - alone(model, s)).abs().max().item() <= 1e-5


def dpo_pairs(form: str, seed: int) -> list[dict[str, Any]]:
    """Preference pairs in TRL's forms: tokenized columns, a prompt with completions, or
    whole sequences whose common prefix is the prompt."""
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(5):
        prompt = rng.integers(1, VOCAB, int(rng.integers(50, 300))).tolist()
        chosen, rejected = (rng.integers(1, VOCAB, int(rng.integers(20, 200))).tolist()
                            for _ in range(2))
        rejected[0] = chosen[0] % (VOCAB - 1) + 1  # completions differ from their start
        if form == "tokenized":
            pairs.append({"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected})
        elif form == "prompt":
            pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
        else:
            pairs.append({"chosen": prompt + chosen, "rejected": prompt + rejected})
    return pairs


def _sequences(pair: dict[str, Any]) -> tuple[list[int], list[int], int]:
    for p, c, r in (("prompt_ids", "chosen_ids", "rejected_ids"),
                    ("prompt", "chosen", "rejected")):
        if p in pair:
            return pair[p] + pair[c], pair[p] + pair[r], len(pair[p])
    c, r = pair["chosen"], pair["rejected"]
    shared = next(i for i, (a, b) in enumerate(zip(c, r)) if a != b)
    return c, r, shared


@pytest.mark.parametrize(("form", "dtype"), [("tokenized", torch.float64),
                                             ("implicit", torch.float64),
                                             ("prompt", torch.float32)])
def test_dpo_loss_and_gradients_equal_the_unpacked_pairs(form: str, dtype: torch.dtype) -> None:
    pairs = dpo_pairs(form, 5)
    model = tiny("llama", dtype)
    beta = 0.1
    reference = torch.linspace(-3.0, 3.0, 2 * len(pairs), dtype=dtype)  # fixed ref log-probs
    batch = PackedCollator(1024, backend="flash", share_prefix=True)(pairs)
    # Pair k is samples 2k (chosen) and 2k + 1 (rejected), prompt shared, one pack each.
    assert batch["sample_ids"].tolist() == list(range(2 * len(pairs)))
    logps = per_sample(token_logprobs(packed(model, batch), batch), batch, of="targets",
                       reduction="sum")
    assert isinstance(logps, torch.Tensor)
    margin = (logps[0::2] - reference[0::2]) - (logps[1::2] - reference[1::2])
    loss = -torch.nn.functional.logsigmoid(beta * margin).mean()
    loss.backward()
    got = grads(model)
    sums = []
    for pair in pairs:
        for seq, shared in ((s, _sequences(pair)[2]) for s in _sequences(pair)[:2]):
            logits = alone(model, {"input_ids": seq})[shared - 1:-1]
            lp = logits.log_softmax(-1).gather(-1, torch.tensor(seq[shared:])[:, None])
            sums.append(lp.sum())
    want = torch.stack(sums)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    assert (logps - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())
    margin = (want[0::2] - reference[0::2]) - (want[1::2] - reference[1::2])
    want_loss = -torch.nn.functional.logsigmoid(beta * margin).mean()
    want_loss.backward()
    assert abs(loss.item() - want_loss.item()) <= tol
    gtol = 1e-10 if dtype == torch.float64 else 1e-5
    for a, b in zip(got, grads(model)):
        assert (a - b).abs().max().item() <= gtol * max(1.0, b.abs().max().item())


def test_per_sample_on_plain_batches() -> None:
    """per_sample reads a plain batch's samples too (rows, flat, padded; padding in no
    sample), in the batch's order, which ``sample_ids`` names."""
    rows = [list(range(1, 1 + n)) for n in (5, 9, 3, 7)]
    model = tiny("llama", torch.float64).eval()
    with torch.no_grad():
        want = [alone(model, {"input_ids": r}) for r in rows]
        for backend in ("flash", "sdpa", "padded"):
            batch = PackedCollator(16, backend=backend, pad_to_multiple_of=8)(
                [{"input_ids": r} for r in rows])
            model.set_attn_implementation(FASTPACK)
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
            got = per_sample(logits, batch)
            sums = per_sample(token_logprobs(logits, batch), batch, of="targets",
                              reduction="sum")
            assert isinstance(sums, torch.Tensor)
            for k, i in enumerate(batch["sample_ids"].tolist()):
                assert (got[k] - want[i]).abs().max().item() <= 1e-10, backend
                lp = want[i][:-1].log_softmax(-1).gather(
                    -1, torch.tensor(rows[i][1:])[:, None]).sum()
                assert abs(sums[k].item() - lp.item()) <= 1e-10, backend


def test_tree_batches_through_dataset_sampler_and_steps() -> None:
    """A PackedDataset of trees over 2 ranks and accumulation over the epoch: every sample
    once, and the gradients of every micro-step's ``packed_loss`` (times the ranks, which
    DDP divides by) add up to the unpacked full batch's, per token and per sequence."""
    samples = grpo(10, 4, (30, 80), (5, 30), 7)
    rows = [s["input_ids"] for s in samples]
    masks = [s["completion_mask"] for s in samples]
    collator = PackedCollator(300, backend="flash", share_prefix=True)
    ds = PackedDataset(rows, collator, loss_mask=masks,
                       prompt_ids=[s["prompt_id"] for s in samples],
                       packs_per_batch=1)
    assert ds.plan.parents is not None and len(ds) % 2  # so a step is cut for 2 ranks
    accumulation = len(PackedSampler(ds, num_replicas=2, rank=0))
    model = tiny("qwen2", torch.float64)
    ones = torch.ones(len(samples), dtype=torch.float64)
    for weighting in ("token", "sequence"):
        seen = []
        for rank in range(2):
            sampler = PackedSampler(ds, num_replicas=2, rank=rank, hidden_size=16,
                                    accumulation_steps=accumulation)
            for step in sampler:
                batch = ds[step]
                assert sorted(batch["sample_ids"].tolist()) == ds.samples(step).tolist()
                seen += batch["sample_ids"].tolist()
                loss = packed_loss(packed(model, batch), batch, weighting=weighting) * 2
                (loss / 2).backward()
        assert sorted(seen) == list(range(len(samples)))
        got = grads(model)
        if weighting == "token":
            want = unpacked_loss(model, samples, ones)
        else:
            want = torch.stack([unpacked_loss(model, [s], ones[:1]) for s in samples]).mean()
        want.backward()
        for a, b in zip(got, grads(model)):
            assert (a - b).abs().max().item() <= 1e-10 * max(1.0, b.abs().max().item())


def test_a_tree_batch_refuses_what_cannot_express_it() -> None:
    samples = grpo(1, 3, (8, 10), (3, 5), 9)
    batch = PackedCollator(64, backend="flash", share_prefix=True)(samples)
    model = tiny("llama", torch.float32)
    for impl in ("sdpa", "eager"):
        model.set_attn_implementation(impl)
        with pytest.raises(FastpackError, match="tree batch"):
            check_model_batch(model, batch)
        # Unchecked, Hugging Face's own implementations fail on the tree's BlockMask.
        with pytest.raises((TypeError, RuntimeError, AttributeError, ValueError)):
            model(**batch)
    for backend in ("sdpa", "eager", "padded"):
        with pytest.raises(FastpackError, match="cannot express a tree"):
            PackedCollator(64, backend=backend, share_prefix=True)


def test_a_tree_batch_pickles_for_dataloader_workers() -> None:
    """A worker sends its batch through a pipe: the tree's BlockMask must pickle (its
    mask_mod is a partial of a module function, not a closure)."""
    import pickle

    batch = PackedCollator(64, backend="flex", share_prefix=True)(grpo(2, 3, (5, 9), (2, 5), 3))
    again = pickle.loads(pickle.dumps(batch))
    total = batch["input_ids"].shape[1]
    q, k = torch.arange(total)[:, None], torch.arange(total)[None, :]
    assert torch.equal(again["attention_mask"].mask_mod(0, 0, q, k),
                       batch["attention_mask"].mask_mod(0, 0, q, k))
    for key in ("input_ids", "tree_parents", "target_index", "sample_tokens"):
        assert torch.equal(again[key], batch[key])


def test_gpu_check_tree_sections_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """benches/gpu_check.py's tree sections, on the CPU: flash-attn (separate query and key
    runs, causal aligned bottom-right) and compiled flex replaced by CPU stand-ins of their
    contracts, so the gathered-path and BlockMask lowerings run and are checked against
    the per-segment SDPA kernel, with a window and soft-capping."""
    import importlib.util
    from pathlib import Path

    from cp_world import flash_on_cpu
    from test_attention import _flex_on_cpu

    from fastpack.torch import attention, tree

    path = Path(__file__).resolve().parents[1] / "benches" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    monkeypatch.setattr(attention, "_unavailable_reason", lambda kernel, q: None)
    monkeypatch.setattr(attention, "_flash_varlen_func", lambda: flash_on_cpu)
    monkeypatch.setattr(attention, "_compiled_flex_attention", lambda: _flex_on_cpu)
    cfg = gpu_check.make_config(cpu_smoke=True)
    cfg["iters"], cfg["warmup"] = 1, 0
    device, dtype = torch.device("cpu"), torch.float32
    rows = gpu_check.check_tree(torch, tree, cfg, device, dtype)
    assert {r["kernel"] for r in rows} == {"flash", "flex"}
    assert len(rows) == 2 * 2 * 3  # two trees, two kernels, plain / window / cap
    bad = [r for r in rows if not r.get("ok")]
    assert not bad, bad
    model = gpu_check.bench_tree_model(torch, tree, cfg, device, dtype)
    assert [r["kernel"] for r in model["rows"]] == ["flash", "flex", "sdpa"]
    assert all(r.get("ok") for r in model["rows"]), model["rows"]


def test_the_sampler_balances_a_trees_attention_work() -> None:
    """A step's cost counts each shared token once (Σl) and attention's work as the
    unpacked model does it: a prompt of P tokens and responses Rᵢ cost P² + Σ(Rᵢ² + 2·P·Rᵢ);
    its targets and sequences are the samples'."""
    prompt, responses = list(range(1, 11)), [[20] * 3, [30] * 5, [40]]
    rows = [prompt + r for r in responses]
    masks = [[0] * 10 + [1] * len(r) for r in responses]
    ds = PackedDataset(rows, PackedCollator(64, backend="flash", share_prefix=True),
                       loss_mask=masks, prompt_ids=[0, 0, 0])
    table = ds.steps
    assert table.tokens.tolist() == [10 + 3 + 5 + 1]
    assert table.squared_tokens.tolist() == [10**2 + sum(r * r + 2 * 10 * r for r in (3, 5, 1))]
    assert table.targets.tolist() == [3 + 5 + 1] and table.sequences.tolist() == [3]
    plain = PackedDataset(rows, PackedCollator(64, backend="flash"), loss_mask=masks)
    # Unpacked, the prompt's own attention is computed G times: (G - 1)·P² more.
    assert plain.steps.squared_tokens.tolist() == [sum((10 + r) ** 2 for r in (3, 5, 1))]
    assert plain.steps.squared_tokens[0] - table.squared_tokens[0] == 2 * 10**2


def test_a_step_is_never_cut_inside_a_tree() -> None:
    """Three steps of one tree each do not divide among 2 ranks, and a tree cannot be cut
    (its responses need their prompt): the sampler says so, or drops the remainder."""
    samples = grpo(3, 3, (20, 30), (5, 9), 11)
    ds = PackedDataset([s["input_ids"] for s in samples],
                       PackedCollator(64, backend="flash", share_prefix=True),
                       prompt_ids=[s["prompt_id"] for s in samples], packs_per_batch=1)
    assert len(ds) == 3 and (ds.plan.parents < 0).sum() == 3
    assert ds.plan.num_segments == 3 * 4  # segments enough to cut, were trees not whole
    with pytest.raises(FastpackError, match=r"hold only 3 trees, too few to cut"):
        PackedSampler(ds, num_replicas=2, rank=0).schedule(0)
    kept = [ds[step]["sample_ids"].tolist()
            for r in range(2) for step in PackedSampler(ds, num_replicas=2, rank=r,
                                                        drop_last=True)]
    assert len(kept) == 2 and all(len(ids) == 3 for ids in kept)


def test_a_state_saved_over_other_trees_does_not_load() -> None:
    """A sampler's state records the trees (their parents and paths): resuming it over the
    same samples shared another way (two prompts' rollouts in one group, which share
    nothing, or no sharing at all) raises, naming what differs."""
    samples = grpo(4, 3, (6, 12), (2, 6), 13)
    rows = [s["input_ids"] for s in samples]
    groups = [s["prompt_id"] for s in samples]
    collator = PackedCollator(64, backend="flash", share_prefix=True)
    one_step = {"packs_per_batch": 100}  # every plan one step: the plans are compared
    sampler = PackedSampler(PackedDataset(rows, collator, prompt_ids=groups, **one_step))
    next(iter(sampler))
    state = sampler.state_dict()
    PackedSampler(PackedDataset(rows, collator, prompt_ids=groups, **one_step)).load_state_dict(
        state)
    merged = [int(g.split("-")[1]) // 2 for g in groups]
    plain = PackedCollator(64, backend="flash")
    for other, message in (
        (PackedDataset(rows, collator, prompt_ids=merged, **one_step),
         r"another plan.*the trees: which"),
        (PackedDataset(rows, plain, **one_step), r"another plan"),
    ):
        with pytest.raises(FastpackError, match=message):
            PackedSampler(other).load_state_dict(state)
