"""Synthetic RL batches for tests, benchmarks and the release matrix: prompt tokens, then
response tokens (``token_mask`` 1), then padding, with random advantages. A test helper, not part
of the product package; benchmarks and scripts import it as
``tests.support.synthetic``, run as modules from the repository root (``python -m benchmarks.<name>``)."""

from __future__ import annotations

import torch


def synthetic_rl_batch(
    response_lengths: list[int],
    vocab_size: int,
    prompt_length: int = 5,
    seq_length: int = 16,
    sample_mask: list[float] | None = None,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    num_samples = len(response_lengths)
    input_ids = torch.randint(1, vocab_size, (num_samples, seq_length), generator=generator)
    token_mask = torch.zeros(num_samples, seq_length)
    lengths = []
    for row, response_length in enumerate(response_lengths):
        end = prompt_length + response_length
        if end > seq_length:
            raise ValueError(f"prompt {prompt_length} + response {response_length} > seq_length {seq_length}")
        token_mask[row, prompt_length:end] = 1.0
        input_ids[row, end:] = 0
        lengths.append(end)
    advantages = torch.randn(num_samples, 1, generator=generator).expand(num_samples, seq_length).clone()
    return {
        "input_ids": input_ids,
        "input_lengths": torch.tensor(lengths),
        "token_mask": token_mask,
        "sample_mask": torch.tensor(sample_mask if sample_mask is not None else [1.0] * num_samples),
        "advantages": advantages,
        "prev_logprobs": torch.full((num_samples, seq_length), -3.0),
    }
