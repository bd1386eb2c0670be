"""Batched sampling with the megatron policy itself (CPU or GPU).

Each new token is one forward-only pass of megatron's schedule over the whole prefix: no KV
cache, which is simple and exact for the short sequences of CPU runs.

Sampling draws one uniform number per (sample, new token) from a generator seeded by the
sample's index in the global batch, and inverts the CDF of the (temperature, top-p) distribution:
every tensor-parallel rank picks the same token from the same gathered logits, and a sample's
draws do not depend on how the batch is split over data-parallel ranks.
"""

from __future__ import annotations

import torch

from nemo_rl_mtp.models.megatron import cpu_runtime
from nemo_rl_mtp.models.megatron.inference import last_token_logits


def generate(
    model,
    prompts: list[list[int]],
    generation_cfg,
    vocab_size: int,
    eos_id: int,
    pad_id: int,
    seed: int,
    first_sample_index: int = 0,
) -> dict[str, torch.Tensor]:
    """Sample a response for each prompt (token ids). Returns host tensors:
    ``tokens`` [B, S] (prompt + response, right-padded), ``lengths``, ``prompt_lengths`` and
    ``logprobs`` [B, S] (token-aligned, of each sampled token under the temperature; 0 elsewhere)."""
    device = cpu_runtime.compute_device()
    num_prompts = len(prompts)
    prompt_lengths = torch.tensor([len(prompt) for prompt in prompts])
    width = int(prompt_lengths.max()) + generation_cfg.max_new_tokens
    tokens = torch.full((num_prompts, width), pad_id, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = torch.tensor(prompt)
    tokens = tokens.to(device)
    logprobs = torch.zeros(num_prompts, width, device=device)
    lengths = prompt_lengths.to(device)
    finished = torch.zeros(num_prompts, dtype=torch.bool, device=device)
    uniforms = per_sample_uniforms(num_prompts, generation_cfg.max_new_tokens, seed, first_sample_index).to(device)
    rows = torch.arange(num_prompts, device=device)
    for step in range(generation_cfg.max_new_tokens):
        prefix_length = int(lengths.max())
        logits = last_token_logits(model, tokens[:, :prefix_length], lengths)
        next_tokens, next_logprobs = sample_next_tokens(
            logits, generation_cfg.temperature, generation_cfg.top_p, vocab_size, uniforms[:, step]
        )
        active = ~finished
        tokens[rows[active], lengths[active]] = next_tokens[active]
        logprobs[rows[active], lengths[active]] = next_logprobs[active]
        lengths = lengths + active.long()
        finished = finished | (active & (next_tokens == eos_id))
        if bool(finished.all()):
            break
    return {
        "tokens": tokens.cpu(),
        "lengths": lengths.cpu(),
        "prompt_lengths": prompt_lengths,
        "logprobs": logprobs.cpu(),
    }


def per_sample_uniforms(num_samples: int, num_steps: int, seed: int, first_sample_index: int) -> torch.Tensor:
    """[num_samples, num_steps] uniforms in [0, 1); row i depends only on (seed, first_sample_index + i)."""
    rows = []
    for index in range(first_sample_index, first_sample_index + num_samples):
        generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
        rows.append(torch.rand(num_steps, generator=generator, dtype=torch.float64))
    return torch.stack(rows)


def sample_next_tokens(
    logits: torch.Tensor, temperature: float, top_p: float, vocab_size: int, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature + nucleus sampling over the real vocabulary (padding ids excluded). The logprob
    returned is under the temperature-scaled full distribution, as the training loss computes it."""
    logits = logits.float() / temperature
    logits[:, vocab_size:] = float("-inf")
    logprobs = torch.log_softmax(logits, dim=-1)
    probs = logprobs.exp()
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep a token while the mass before it is below top_p (so the most likely always stays).
        keep_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) < top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
    cdf = probs.double().cumsum(dim=-1)
    thresholds = uniforms.double()[:, None] * cdf[:, -1:]
    next_tokens = torch.searchsorted(cdf, thresholds, right=True).squeeze(-1).clamp(max=vocab_size - 1)
    return next_tokens, logprobs.gather(-1, next_tokens[:, None]).squeeze(-1)
