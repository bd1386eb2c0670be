"""The output layer's padding ids (ids past the tokenizer's vocabulary) are left out the same way
by training, sampling and the MTP losses (one helper, ``vocabulary.py``)."""

from __future__ import annotations

import pytest
import torch

from nemo_rl_mtp.training.vocabulary import fill_ids_past_vocabulary_, first_padding_column, mask_ids_past_vocabulary

pytestmark = pytest.mark.usefixtures("megatron_world")  # tensor-parallel rank 0 of 1


def test_ids_past_the_vocabulary_get_minus_infinity_and_the_rest_is_untouched():
    logits = torch.randn(2, 3, 40)
    masked = mask_ids_past_vocabulary(logits, vocab_size=32)
    assert torch.equal(masked[..., :32], logits[..., :32])
    assert torch.isneginf(masked[..., 32:]).all()
    assert torch.equal(mask_ids_past_vocabulary(logits, 32, padded_vocab_size=40), masked)  # the whole vocabulary
    assert torch.isfinite(logits).all()  # a copy: the input keeps its padding columns


def test_the_in_place_fill_masks_as_the_copy_does_and_gradients_skip_the_padding_ids():
    logits = torch.randn(2, 3, 40)
    reference = torch.where(torch.arange(40) >= 32, float("-inf"), logits)  # independent of both helpers
    filled = logits.clone()
    assert fill_ids_past_vocabulary_(filled, vocab_size=32) is filled and torch.equal(filled, reference)
    leaf = logits.clone().requires_grad_()
    torch.log_softmax(mask_ids_past_vocabulary(leaf, vocab_size=32), dim=-1)[..., 0].sum().backward()
    assert (leaf.grad[..., 32:] == 0).all() and (leaf.grad[..., :32] != 0).all()


def test_logits_without_padding_ids_come_back_as_they_are():
    logits = torch.randn(2, 32)
    assert mask_ids_past_vocabulary(logits, vocab_size=32) is logits
    assert first_padding_column(32, 32) is None and first_padding_column(40, 32) == 32
