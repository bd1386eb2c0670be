"""Policy losses. Each returns a loss already normalised by the global valid-token count G
(response tokens of valid samples, summed over all microbatches and data-parallel ranks), so
summing the per-microbatch losses over the global batch gives the per-token mean.

A sequence-level loss (``loss_fn.token_level_loss: false``) is the same sum with each sample's
tokens weighted 1 / (its token count), folded into ``sample_mask`` (:func:`loss_sample_weights`):
G then counts samples, and the loss is the mean over samples of each sample's token mean. The MTP
loss mask is built from the same ``sample_mask``, so the MTP loss follows the same rule."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_rl_mtp.metrics import CLIP_FRACTION, KL, LOSS, PROBS_RATIO


@dataclass(frozen=True)
class ClippedPGLossFn:
    """GRPO's clipped policy-gradient loss with an optional k3 KL penalty to a reference policy.

    Inputs are position-aligned (see ``training/batches.py``): ``loss_mask``, ``advantages``,
    ``prev_logprobs`` and, when the KL penalty is on, ``reference_logprobs``.
    """

    ratio_clip_min: float
    ratio_clip_max: float
    reference_policy_kl_penalty: float

    @classmethod
    def from_config(cls, loss_cfg) -> "ClippedPGLossFn":
        """The loss ``loss_fn:`` configures."""
        return cls(loss_cfg.ratio_clip_min, loss_cfg.ratio_clip_max, loss_cfg.reference_policy_kl_penalty)

    def __call__(
        self, logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], global_valid_tokens: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = inputs["loss_mask"]
        advantages = inputs["advantages"]
        ratio = torch.exp(logprobs - inputs["prev_logprobs"])
        unclipped = -advantages * ratio
        clipped = -advantages * ratio.clamp(1.0 - self.ratio_clip_min, 1.0 + self.ratio_clip_max)
        per_token = torch.maximum(unclipped, clipped)
        metrics = {CLIP_FRACTION: _token_mean((clipped > unclipped).float(), mask, global_valid_tokens)}
        if self.reference_policy_kl_penalty > 0:
            kl = k3_kl(logprobs, inputs["reference_logprobs"])
            per_token = per_token + self.reference_policy_kl_penalty * kl
            metrics[KL] = _token_mean(kl.detach(), mask, global_valid_tokens)
        loss = _token_mean(per_token, mask, global_valid_tokens)
        metrics[LOSS] = loss.detach()
        metrics[PROBS_RATIO] = _token_mean(ratio.detach(), mask, global_valid_tokens)
        return loss, metrics


def _token_mean(values: torch.Tensor, mask: torch.Tensor, global_valid_tokens: torch.Tensor) -> torch.Tensor:
    """This microbatch's share of the global per-token mean."""
    return (values * mask).sum() / global_valid_tokens.clamp(min=1)


def k3_kl(logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(policy || reference): exp(r) - r - 1, r = ref - policy."""
    log_ratio = reference_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0


def loss_sample_weights(token_mask: torch.Tensor, sample_mask: torch.Tensor, token_level_loss: bool) -> torch.Tensor:
    """``sample_mask`` [B] with each sample's tokens weighted for the loss: unchanged for a
    token-level mean; divided by the sample's loss tokens (response tokens after the first
    position, as G counts them) for a sequence-level mean. Samples without loss tokens weigh 0."""
    if token_level_loss:
        return sample_mask
    tokens = token_mask[:, 1:].float().sum(dim=1)
    return sample_mask.float() * (tokens > 0).float() / tokens.clamp(min=1)
