"""Imitation steps: raise the likelihood of demonstrated answers with the policy's own training
step (GRPO loss at advantage 1, on-policy, so the ratio is 1 and the clip never binds), MTP loss
included. It gives the policy and its MTP heads a deterministic task to agree on, which tests and
benchmarks of speculative rollouts need, in a few dozen steps on a CPU."""

from __future__ import annotations

import torch

from nemo_rl_mtp.algorithms.loss_functions import ClippedPGLossFn
from nemo_rl_mtp.data.tokenizer import DigitTokenizer
from nemo_rl_mtp.environments.digit_tasks import expected_answer
from nemo_rl_mtp.models.megatron.common import get_mtp_metrics
from nemo_rl_mtp.models.megatron.inference import compute_logprobs
from nemo_rl_mtp.models.megatron.setup import MegatronPolicyModel
from nemo_rl_mtp.models.megatron.train import train_global_batch
from nemo_rl_mtp.utils.config_schema import PolicyConfig

_IMITATION_LOSS = ClippedPGLossFn(ratio_clip_min=0.2, ratio_clip_max=0.2, reference_policy_kl_penalty=0.0)


def demonstration_batch(prompts: list[list[int]], answers: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """A training batch of prompts followed by their answers (token ids; ``[B, S]`` right-padded),
    every answer token trained with advantage 1."""
    width = max(len(prompt) + len(answer) for prompt, answer in zip(prompts, answers))
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    token_mask = torch.zeros(len(prompts), width)
    for row, (prompt, answer) in enumerate(zip(prompts, answers)):
        input_ids[row, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        token_mask[row, len(prompt) : len(prompt) + len(answer)] = 1.0
    return {
        "input_ids": input_ids,
        "input_lengths": torch.tensor([len(prompt) + len(answer) for prompt, answer in zip(prompts, answers)]),
        "token_mask": token_mask,
        "sample_mask": torch.ones(len(prompts)),
        "advantages": token_mask.clone(),
    }


def task_demonstrations(task: str, digit_prompts: list[list[int]], tokenizer: DigitTokenizer) -> dict[str, torch.Tensor]:
    """``demonstration_batch`` of a digit task: its prompts and correct answers."""
    prompts = [tokenizer.encode_prompt(digits) for digits in digit_prompts]
    answers = [tokenizer.encode_answer(expected_answer(task, digits)) for digits in digit_prompts]
    return demonstration_batch(prompts, answers, tokenizer.pad_id)


def imitation_step(policy: MegatronPolicyModel, batch: dict[str, torch.Tensor], policy_cfg: PolicyConfig) -> dict[str, float]:
    """One optimizer step towards the batch's answers; returns the training metrics, MTP loss and
    acceptance per layer included (``mtp_{i}_...``; the tracker is emptied)."""
    batch = {**batch, "prev_logprobs": compute_logprobs(policy, batch, policy_cfg)}
    metrics, num_microbatches = train_global_batch(policy, batch, _IMITATION_LOSS, policy_cfg)
    metrics.update(get_mtp_metrics(num_microbatches))
    return metrics
