"""check_model_batch's rules that read a model's structure and source rather than its
name: each on a module written here that has exactly one such trait, refused (or accepted)
on a packed batch before any forward runs — the forwards below are never called, only
read.

The architectures these rules were written for (BLT, Doge, GPT-OSS, GIT, Whisper, ...) are
in tests/test_architectures.py's sweep."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from fastpack import FastpackError  # noqa: E402
from fastpack.torch import (  # noqa: E402
    PackedCollator,
    check_model_batch,
    register_hf_attention,
)

FASTPACK = register_hf_attention()


def rows() -> dict[str, Any]:
    """Three sequences in one row, restarting position_ids, no attention_mask."""
    return PackedCollator(max_len=32, backend="sdpa")(
        [{"input_ids": list(range(3, 3 + n))} for n in (5, 7, 4)])


def create_causal_mask(**kwargs: Any) -> None:  # read by the rules, never called
    raise AssertionError("the forwards here are read, not run")


def attention_interface(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("the forwards here are read, not run")


class Layers(torch.nn.Module):
    """A stack of layers (a ModuleList) that takes the positions."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4)])

    def forward(self, input_ids: Any, position_ids: Any = None, **kwargs: Any) -> Any:
        return create_causal_mask(inputs_embeds=input_ids, position_ids=position_ids)


class Toy(torch.nn.Module):
    """A causal LM whose ``forward`` passes the batch on to ``body``."""

    def __init__(self, body: torch.nn.Module, impl: str) -> None:
        super().__init__()
        self.config = SimpleNamespace(_attn_implementation=impl, model_type="toy",
                                      use_cache=False)
        self.body = body

    def forward(self, input_ids: Any, position_ids: Any = None, **kwargs: Any) -> Any:
        return self.body(input_ids, position_ids=position_ids, **kwargs)


class MaskWithoutPositions(Layers):
    def forward(self, input_ids: Any, position_ids: Any = None, **kwargs: Any) -> Any:
        mask_kwargs = {"inputs_embeds": input_ids, "attention_mask": None}
        return create_causal_mask(**mask_kwargs)


class MaskWithPositions(Layers):
    def forward(self, input_ids: Any, position_ids: Any = None, **kwargs: Any) -> Any:
        mask_kwargs = {"inputs_embeds": input_ids, "position_ids": position_ids}
        return create_causal_mask(**mask_kwargs)


class MaskOverItsOwnSequence(Layers):
    """BLT's global transformer: a mask over patches, built with ``position_ids=None``."""

    def forward(self, input_ids: Any, position_ids: Any = None, **kwargs: Any) -> Any:
        create_causal_mask(inputs_embeds=input_ids, position_ids=position_ids)
        return create_causal_mask(inputs_embeds=input_ids[:, ::4], position_ids=None)


class DynamicMaskAttention(torch.nn.Module):
    """Doge's: hands the attention a mask it computes from the row."""

    def forward(self, hidden: Any, attention_mask: Any = None, **kwargs: Any) -> Any:
        own = attention_mask + hidden.sum(-1)
        return attention_interface(self, hidden, hidden, hidden, attention_mask=own)


class PassingAttention(torch.nn.Module):
    def forward(self, hidden: Any, attention_mask: Any = None, **kwargs: Any) -> Any:
        return attention_interface(self, hidden, hidden, hidden, attention_mask=attention_mask)


class SoftmaxSelfAttention(torch.nn.Module):
    """GIT's text attention: its own softmax over the mask it is given."""

    def forward(self, hidden: Any, attention_mask: Any = None) -> Any:
        scores = hidden @ hidden.transpose(-1, -2) + attention_mask
        return torch.nn.functional.softmax(scores, dim=-1) @ hidden


def with_layer(layer: torch.nn.Module) -> torch.nn.Module:
    body = Layers()
    body.layers.append(layer)
    return body


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_a_mask_built_without_position_ids_is_refused_on_hugging_face_attention(
        impl: str) -> None:
    with pytest.raises(FastpackError, match=r"without position_ids \(body \(MaskWithout"):
        check_model_batch(Toy(MaskWithoutPositions(), impl), rows())
    check_model_batch(Toy(MaskWithPositions(), impl), rows())  # given: accepted
    # fastpack's attention ignores the mask: it reads the rows' boundaries itself
    check_model_batch(Toy(MaskWithoutPositions(), FASTPACK), rows())


@pytest.mark.parametrize("impl", ["sdpa", FASTPACK])
def test_a_mask_over_a_sequence_of_the_models_own_is_refused(impl: str) -> None:
    with pytest.raises(FastpackError, match=r"body \(MaskOverItsOwnSequence\) builds an "
                                            r"attention mask over a sequence of its own"):
        check_model_batch(Toy(MaskOverItsOwnSequence(), impl), rows())


@pytest.mark.parametrize("impl", ["sdpa", FASTPACK])
def test_a_layer_that_builds_its_attentions_mask_is_refused(impl: str) -> None:
    with pytest.raises(FastpackError, match=r"body\.layers\.1 \(DynamicMaskAttention\) "
                                            r"hands its attention a mask it computes"):
        check_model_batch(Toy(with_layer(DynamicMaskAttention()), impl), rows())
    check_model_batch(Toy(with_layer(PassingAttention()), impl), rows())


def test_an_attention_with_its_own_softmax_is_refused_under_fastpacks_attention() -> None:
    model = Toy(with_layer(SoftmaxSelfAttention()), FASTPACK)
    with pytest.raises(FastpackError, match=r"\(SoftmaxSelfAttention\) computes its "
                                            r"attention itself"):
        check_model_batch(model, rows())
    # Hugging Face's eager: it gets the model's mask, built from position_ids
    check_model_batch(Toy(with_layer(SoftmaxSelfAttention()), "eager"), rows())


class KwargsOnly(torch.nn.Module):
    """Whisper's causal LM: no position_ids parameter, **kwargs on to its decoder."""

    def __init__(self, decoder: torch.nn.Module, impl: str) -> None:
        super().__init__()
        self.config = SimpleNamespace(_attn_implementation=impl, model_type="toy",
                                      use_cache=False)
        self.decoder = decoder
        self.attention = PassingAttention()

    def forward(self, input_ids: Any, **kwargs: Any) -> Any:
        return self.decoder(input_ids, **kwargs)


class DecoderWithoutPositions(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4)])

    def forward(self, input_ids: Any, **kwargs: Any) -> Any:
        return input_ids


@pytest.mark.parametrize("impl", ["sdpa", FASTPACK])
def test_position_ids_through_kwargs_to_the_layers_are_taken(impl: str) -> None:
    check_model_batch(KwargsOnly(Layers(), impl), rows())
    with pytest.raises(FastpackError, match=r"takes no position_ids \(KwargsOnly"):
        check_model_batch(KwargsOnly(DecoderWithoutPositions(), impl), rows())
