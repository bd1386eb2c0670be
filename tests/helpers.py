"""Shared test helpers: a single-process megatron world, tiny policies and synthetic RL batches."""

from __future__ import annotations

import socket

import torch

from nemo_rl_mtp.data.synthetic import synthetic_rl_batch
from nemo_rl_mtp.utils.config import load_config

VOCAB_SIZE = 32


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tiny_config(**policy_overrides):
    """The exemplar config with ``policy.<key>=<value>`` overrides (dots in keys as ``__``)."""
    overrides = [f"policy.{key.replace('__', '.')}={_yaml(value)}" for key, value in policy_overrides.items()]
    return load_config(overrides=overrides)


def _yaml(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def make_policy(**policy_overrides):
    """A freshly initialised policy in the already-initialised single-process megatron world."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nemo_rl_mtp.models.megatron.setup import setup_megatron_policy

    cfg = tiny_config(**policy_overrides)
    model_parallel_cuda_manual_seed(cfg.policy.megatron_cfg.seed)
    torch.manual_seed(cfg.policy.megatron_cfg.seed)
    return setup_megatron_policy(cfg.policy, VOCAB_SIZE), cfg.policy


def make_batch(
    response_lengths: list[int],
    prompt_length: int = 5,
    seq_length: int = 16,
    sample_mask: list[float] | None = None,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A right-padded RL batch: prompt tokens, then response tokens (token_mask 1), then padding."""
    return synthetic_rl_batch(response_lengths, VOCAB_SIZE, prompt_length, seq_length, sample_mask, seed)


def gradients(policy) -> dict[str, torch.Tensor]:
    """Every parameter's accumulated gradient (DDP main_grad), by name."""
    return {name: param.main_grad.detach().clone() for name, param in policy.model.module.named_parameters()}


def mtp_parameter_names(policy) -> list[str]:
    return [name for name, _ in policy.model.module.named_parameters() if name.startswith("mtp.")]


def response_mask(rollouts: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, S] True on the response tokens of rollouts (after the prompt, before the end)."""
    positions = torch.arange(rollouts["tokens"].shape[1])[None, :]
    return (positions >= rollouts["prompt_lengths"][:, None]) & (positions < rollouts["lengths"][:, None])


def greedy_reference(policy, prompts: list[list[int]], max_new_tokens: int, eos_id: int) -> list[list[int]]:
    """Greedy decoding the slow, obvious way, as an oracle for the engine: for every new token, a
    full forward of the whole sequence (no KV cache, no speculation), argmax over the real vocabulary."""
    from nemo_rl_mtp.models.megatron import cpu_runtime
    from nemo_rl_mtp.models.megatron.data import causal_attention_mask

    model = policy.model.module
    model.eval()
    sequences = []
    try:
        with torch.no_grad(), cpu_runtime.device_scope():
            for prompt in prompts:
                tokens = list(prompt)
                for _ in range(max_new_tokens):
                    logits = model(
                        input_ids=torch.tensor([tokens]),
                        position_ids=torch.arange(len(tokens))[None, :],
                        attention_mask=causal_attention_mask(len(tokens)),
                    )
                    tokens.append(int(logits[0, -1, : policy.vocab_size].argmax()))
                    if tokens[-1] == eos_id:
                        break
                sequences.append(tokens)
    finally:
        model.train()
    return sequences
