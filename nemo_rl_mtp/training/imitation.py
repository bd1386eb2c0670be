"""Imitation steps: raise the likelihood of demonstrated answers with the policy's own training
step (GRPO loss at advantage 1, on-policy, so the ratio is 1 and the clip never binds), MTP loss
included (the heads learn with megatron's cross entropy, whatever ``mtp_loss_type`` GRPO uses). It
gives the policy and its MTP heads a deterministic task to agree on, which tests and
benchmarks of speculative rollouts need, in a few dozen steps on a CPU."""

from __future__ import annotations

import torch

from nemo_rl_mtp.training.losses import ClippedPGLossFn
from nemo_rl_mtp.training.logprobs import compute_logprobs
from nemo_rl_mtp.training.model import MegatronPolicyModel
from nemo_rl_mtp.training.step import IMITATION, train_global_batch
from nemo_rl_mtp.config.schema import PolicyConfig

IMITATION_LOSS = ClippedPGLossFn(ratio_clip_min=0.2, ratio_clip_max=0.2, reference_policy_kl_penalty=0.0)


def imitation_step(policy: MegatronPolicyModel, batch: dict[str, torch.Tensor], policy_cfg: PolicyConfig) -> dict[str, float]:
    """One optimizer step towards the batch's answers through the training step GRPO uses
    (``train_global_batch``): the same metrics, MTP loss and acceptance per layer as
    ``mtp/mtp_{i}_...``, and the same per-step MTP guard."""
    batch = {**batch, "prev_logprobs": compute_logprobs(policy, batch, policy_cfg)}
    return train_global_batch(policy, batch, IMITATION_LOSS, policy_cfg, IMITATION)
