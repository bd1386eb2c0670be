"""Each MTP depth's logits next to the policy's, in the training forward: for the trainer-side
forecast of rollout acceptance (``mtp/mtp_{i}_expected_acceptance``) and for the MTP losses on the
policy's distribution (``policy.megatron_cfg.mtp_loss_type``).

Rejection sampling accepts a draft x drawn from the head's q with probability min(1, p(x)/q(x)),
so a draft is accepted with probability sum_x min(p(x), q(x)) (p: the policy). The training step
has both distributions for every target token t of the MTP loss: depth k (0-based) predicts t from
position t - 2 - k, the policy from position t - 1. The forecast averages the overlap over the
targets a rollout can draft, at the sampling temperature (padding ids excluded, as in sampling),
and sums like the other step metrics (over microbatches and data-parallel ranks). A rollout
drafts depth k's token t after verifying token t - 1 - k, which is a response token: the
policy samples the first k + 1 response tokens itself (at prefill, then in verification), so the
MTP loss's targets among them are trained but never drafted, and the forecast leaves them out.

The MTP logits are megatron's own: megatron hands each depth's logits to its MTP loss inside the
forward (``compat.mtp_loss_callable``), where :class:`DraftLogits` takes them. Targets and
positions are aligned with megatron's ``roll_tensor``, as its MTP loss aligns them, so packed
sequences are handled as the loss handles them.

- ``cross_entropy`` (megatron's loss): megatron's cross entropy overwrites the logits, so each
  depth's logits at its draftable targets are copied first ([targets, vocab/tp] in the model's
  dtype, the forecast's one copy), and megatron's loss is returned unchanged.
- the losses on the policy's distribution: megatron gets a zero loss; the depth's logits are kept
  with their graph, and the loss and the forecast are computed in one pass once the policy's logits
  exist (``draft_distributions.draft_terms``, no copy), then injected into the backward pass
  through megatron's ``MTPLossAutoScaler`` (``train.mtp_draft_terms``).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from megatron.core.transformer.multi_token_prediction import roll_tensor

from nemo_rl_mtp.metrics import MTP, MTP_EXPECTED_ACCEPTANCE, MTP_EXPECTED_ACCEPTANCE_COUNT, MTP_EXPECTED_ACCEPTANCE_SUM

_SUM, _COUNT = MTP_EXPECTED_ACCEPTANCE_SUM.under(MTP), MTP_EXPECTED_ACCEPTANCE_COUNT.under(MTP)


@dataclasses.dataclass
class MTPTargets:
    """Per MTP depth k (0-based), over the rows of megatron's depth-k logits ([s, b] flattened,
    position-major): ``policy_index`` [s * b], the row of the policy's [b, s] logits (flattened)
    that predicts the same token; ``mask`` [s * b], megatron's loss mask rolled to the depth (the
    target's weight, 0 where there is none); ``draftable`` [s * b], 1 at the targets a rollout can
    draft (the token verified before the draft is a response token), and ``draft_rows`` [M_k]
    those rows' indices, ``draft_policy_index`` [M_k] their policy rows; ``num_tokens``, the
    mask's sum N_k; and ``first_num_tokens``, N_0, the mask after megatron's first roll (megatron
    weighs depth k by N_0 / N_k). Built on the host with the microbatch (``data.py``), so the step
    reads no device value to pick rows."""

    policy_index: list[torch.Tensor]
    mask: list[torch.Tensor]
    draftable: list[torch.Tensor]
    draft_rows: list[torch.Tensor]
    draft_policy_index: list[torch.Tensor]
    num_tokens: list[torch.Tensor]
    first_num_tokens: torch.Tensor

    def __len__(self) -> int:
        return len(self.mask)

    def to(self, device: torch.device) -> "MTPTargets":
        def move(value):
            return [tensor.to(device, non_blocking=True) for tensor in value] if isinstance(value, list) else value.to(device, non_blocking=True)

        return MTPTargets(**{field.name: move(getattr(self, field.name)) for field in dataclasses.fields(self)})


def mtp_targets(mtp_loss_mask: torch.Tensor | None, packed_seq_params, num_layers: int) -> MTPTargets | None:
    """Where each depth's targets sit, from the token-aligned MTP loss mask [b, s] megatron gets
    (``packed_seq_params``: a packed microbatch's): depth k predicts the token at t from position
    t - 2 - k, the policy from t - 1. None without MTP. Not for context parallelism (an aligned
    position may sit on another rank)."""
    if mtp_loss_mask is None or not num_layers:
        return None
    roll = functools.partial(roll_tensor, shifts=-1, dims=-1, packed_seq_params=packed_seq_params)
    policy_position = torch.arange(mtp_loss_mask.numel(), device=mtp_loss_mask.device).view(mtp_loss_mask.shape)
    target_mask, first_num_tokens = roll(mtp_loss_mask)
    # Depth k's draft position i predicts token i + 2 + k after the rollout verified token i + 1:
    # the mask after the first roll marks where that token is a response token.
    verified_is_response = (target_mask > 0).t().reshape(-1)
    targets = MTPTargets([], [], [], [], [], [], first_num_tokens)
    for _ in range(num_layers):
        policy_position = roll(policy_position)[0]
        target_mask, num_tokens = roll(target_mask)
        mask, policy_index = target_mask.t().reshape(-1), policy_position.t().reshape(-1)
        draftable = (mask > 0) & verified_is_response
        draft_rows = draftable.nonzero().squeeze(1)
        targets.policy_index.append(policy_index)
        targets.mask.append(mask)
        targets.draftable.append(draftable.float())
        targets.draft_rows.append(draft_rows)
        targets.draft_policy_index.append(policy_index[draft_rows])
        targets.num_tokens.append(num_tokens)
    return targets


class DraftLogits:
    """Takes each MTP depth's logits from megatron's MTP loss call (``__call__`` is the callable
    ``compat.mtp_loss_callable.substituted_mtp_loss`` expects); depths arrive in order.

    ``keep_graph`` (a loss on the policy's distribution): ``logits[k]`` is depth k's [s, b, v/tp]
    logits themselves, with their graph, and megatron gets a zero loss. Otherwise (megatron's cross
    entropy): ``logits[k]`` is a copy of the rows at the depth's draftable targets ([M_k, v/tp],
    the forecast's), taken before megatron's loss, which is returned unchanged."""

    def __init__(self, targets: MTPTargets, keep_graph: bool):
        self.targets = targets
        self.keep_graph = keep_graph
        self.logits: list[torch.Tensor] = []

    def __call__(self, labels: torch.Tensor, logits: torch.Tensor, megatron_loss):
        depth = len(self.logits)
        if depth >= len(self.targets):
            return megatron_loss(labels, logits)
        if self.keep_graph:
            self.logits.append(logits)
            return torch.zeros(labels.shape, dtype=logits.dtype, device=logits.device)
        rows = self.targets.draft_rows[depth]
        self.logits.append(logits.detach().reshape(-1, logits.shape[-1]).index_select(0, rows))
        return megatron_loss(labels, logits)


def with_expected_acceptance(metrics: dict[str, float]) -> dict[str, float]:
    """The step's global sums replaced by ``mtp/mtp_{i}_expected_acceptance`` in percent."""
    depth = 1
    while _SUM.key(depth) in metrics:
        total, count = metrics.pop(_SUM.key(depth)), metrics.pop(_COUNT.key(depth))
        metrics[MTP_EXPECTED_ACCEPTANCE.under(MTP).key(depth)] = 100.0 * total / max(count, 1.0)
        depth += 1
    return metrics


def forecast_sums(depth: int, overlap_sum: torch.Tensor, count: int) -> dict[str, torch.Tensor]:
    """One microbatch's share of depth ``depth``'s (0-based) forecast."""
    return {_SUM.key(depth + 1): overlap_sum, _COUNT.key(depth + 1): torch.full((), float(count), device=overlap_sum.device)}
