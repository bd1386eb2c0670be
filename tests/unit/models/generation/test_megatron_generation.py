"""Sampling with the megatron policy, and agreement with the training-side logprobs."""

from __future__ import annotations

import pytest
import torch

from nemo_rl_mtp.data.tokenizer import DigitTokenizer
from nemo_rl_mtp.models.generation.megatron_generation import generate, per_sample_uniforms, sample_next_tokens
from nemo_rl_mtp.models.megatron.inference import compute_logprobs
from tests.helpers import make_policy


def test_sampling_never_picks_padding_ids_and_respects_top_p():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0, 9.0, 9.0]])  # ids 4, 5 are padding (vocab 4)
    uniforms = torch.linspace(0, 0.999, 200, dtype=torch.float64)
    tokens, logprobs = sample_next_tokens(logits.expand(200, -1).clone(), 1.0, 1.0, 4, uniforms)
    assert tokens.max() < 4
    assert torch.allclose(logprobs, torch.log_softmax(logits[:, :4], -1)[0, tokens])
    nucleus, _ = sample_next_tokens(logits.expand(200, -1).clone(), 1.0, 0.5, 4, uniforms)
    assert nucleus.unique().tolist() == [1]  # the top token alone holds > 50% of the mass


def test_draws_depend_only_on_the_global_sample_index():
    """What makes data-parallel 1 and 2 sample the same tokens."""
    whole = per_sample_uniforms(4, 6, seed=3, first_sample_index=0)
    second_half = per_sample_uniforms(2, 6, seed=3, first_sample_index=2)
    assert torch.equal(whole[2:], second_half)


@pytest.mark.usefixtures("megatron_world")
@pytest.mark.parametrize("packed", [False, True])
def test_generation_logprobs_equal_training_logprobs(packed):
    tokenizer = DigitTokenizer()
    policy, cfg = make_policy(megatron_cfg__mtp_num_layers=1, train_micro_batch_size=2, train_global_batch_size=8, sequence_packing__enabled=packed)
    policy.vocab_size = tokenizer.vocab_size
    prompts = [tokenizer.encode_prompt(digits) for digits in ([1, 2], [3, 4, 5], [6], [7, 8, 9, 0])]
    result = generate(policy.model, prompts, cfg.generation, tokenizer.vocab_size, tokenizer.eos_id, tokenizer.pad_id, seed=7)
    assert torch.equal(result["prompt_lengths"], torch.tensor([4, 5, 3, 6]))
    assert (result["lengths"] - result["prompt_lengths"]).max() <= cfg.generation.max_new_tokens
    response = torch.arange(result["tokens"].shape[1])[None] >= result["prompt_lengths"][:, None]
    response &= torch.arange(result["tokens"].shape[1])[None] < result["lengths"][:, None]
    assert result["tokens"][response].max() < tokenizer.vocab_size
    batch = {
        "input_ids": result["tokens"],
        "input_lengths": result["lengths"],
        "token_mask": response.float(),
        "sample_mask": torch.ones(4),
    }
    training = compute_logprobs(policy, batch, cfg)
    torch.testing.assert_close(training[response], result["logprobs"][response], rtol=1e-5, atol=1e-5)
    again = generate(policy.model, prompts, cfg.generation, tokenizer.vocab_size, tokenizer.eos_id, tokenizer.pad_id, seed=7)
    assert torch.equal(again["tokens"], result["tokens"])
