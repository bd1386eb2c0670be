"""Trainer-side forecast of rollout acceptance: per MTP depth, the acceptance rejection sampling
would reach on the step's own sequences, logged as ``mtp/mtp_{i}_expected_acceptance``.

Rejection sampling accepts a draft x drawn from the head's q with probability min(1, p(x)/q(x)),
so a draft is accepted with probability sum_x min(p(x), q(x)) (p: the policy). The training step
already has both distributions for every target token t of the MTP loss: depth k (0-based)
predicts t from position t - 2 - k, the policy from position t - 1. The forecast averages the
overlap over the masked targets, at the sampling temperature (padding ids excluded, as in
sampling), and sums like the other step metrics (over microbatches and data-parallel ranks).

The MTP logits are megatron's own: the output layer's calls on the MTP block's hidden states are
recorded during the forward (each depth's hidden states are a chunk of the block's output, which
tells the depth). Targets and positions are aligned with megatron's ``roll_tensor``, as its MTP
loss aligns them, so packed sequences are handled as the loss handles them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
from megatron.core import parallel_state
from megatron.core.transformer.multi_token_prediction import roll_tensor

_SUM, _COUNT = "mtp/mtp_{}_expected_acceptance_sum", "mtp/mtp_{}_expected_acceptance_count"


@dataclasses.dataclass
class ForecastTargets:
    """Per MTP depth (0-based), the flat positions ([b * s] rows) of the masked targets' drafts
    and of the policy's predictions of the same tokens, each [M_k]."""

    draft_positions: list[torch.Tensor]
    policy_positions: list[torch.Tensor]


def forecast_targets(mtp_loss_mask: torch.Tensor | None, packed_seq_params, num_layers: int) -> ForecastTargets | None:
    """Where each depth's targets sit, from the token-aligned MTP loss mask [b, s] megatron gets:
    depth k predicts the token at t from position t - 2 - k, the policy from t - 1. None without
    MTP, and under context parallelism (an aligned position may sit on another rank)."""
    if mtp_loss_mask is None or not num_layers or parallel_state.get_context_parallel_world_size() > 1:
        return None
    roll = functools.partial(roll_tensor, shifts=-1, dims=-1, packed_seq_params=packed_seq_params)
    policy_position = torch.arange(mtp_loss_mask.numel(), device=mtp_loss_mask.device).view(mtp_loss_mask.shape)
    target_mask = roll(mtp_loss_mask)[0]
    targets = ForecastTargets([], [])
    for _ in range(num_layers):
        policy_position, target_mask = roll(policy_position)[0], roll(target_mask)[0]
        selected = target_mask.reshape(-1) > 0
        targets.draft_positions.append(selected.nonzero().squeeze(1))
        targets.policy_positions.append(policy_position.reshape(-1)[selected])
    return targets


@contextlib.contextmanager
def recording_mtp_logits(gpt_model, targets: ForecastTargets | None):
    """Yields a dict that fills, during one forward of ``gpt_model``, with each MTP depth's logits
    at its targets' draft positions ([M_k, v/tp], copied: megatron's cross entropy later works
    in place on its logits). Stays empty without targets and on stages without MTP."""
    recorded: dict[int, torch.Tensor] = {}
    mtp, output_layer = getattr(gpt_model, "mtp", None), getattr(gpt_model, "output_layer", None)
    if targets is None or mtp is None or output_layer is None or not gpt_model.post_process:
        yield recorded
        return
    block_output = {}

    def keep_block_output(module, inputs, output):
        block_output["hidden"] = output

    def keep_mtp_logits(module, inputs, output):
        # The depth count from the targets: megatron-core 0.16's RL-labels shim blanks the
        # config's mtp_num_layers during the forward.
        depth = _mtp_depth_of(inputs[0], block_output.get("hidden"), len(targets.draft_positions))
        if depth is not None:
            rows = output[0].detach().transpose(0, 1).reshape(-1, output[0].shape[-1])
            recorded[depth] = rows[targets.draft_positions[depth]].clone()

    handles = [mtp.register_forward_hook(keep_block_output), output_layer.register_forward_hook(keep_mtp_logits)]
    try:
        yield recorded
    finally:
        for handle in handles:
            handle.remove()


def _mtp_depth_of(hidden: torch.Tensor, block_output: torch.Tensor | None, num_layers: int) -> int | None:
    """Which MTP depth's chunk of the block output ``hidden`` is; None for the main chunk or
    anything else."""
    if block_output is None or hidden.untyped_storage().data_ptr() != block_output.untyped_storage().data_ptr():
        return None
    chunk = block_output.numel() // (1 + num_layers)
    depth = (hidden.storage_offset() - block_output.storage_offset()) // chunk - 1
    return depth if 0 <= depth < num_layers else None


def expected_acceptance_sums(
    logits: torch.Tensor, mtp_logits: dict[int, torch.Tensor], targets: ForecastTargets | None, temperature: float, vocab_size: int
) -> dict[str, torch.Tensor]:
    """Per depth, the summed overlap sum_x min(p, q) over the targets and their count.

    logits: the policy's [b, s, v/tp]; mtp_logits: depth -> [M_k, v/tp] from
    :func:`recording_mtp_logits`."""
    if not mtp_logits:
        return {}
    policy_rows = logits.reshape(-1, logits.shape[-1])
    sums = {}
    for depth, draft_rows in sorted(mtp_logits.items()):
        overlap = _overlap(policy_rows[targets.policy_positions[depth]], draft_rows, temperature, vocab_size)
        sums[_SUM.format(depth + 1)] = overlap.sum()
        sums[_COUNT.format(depth + 1)] = torch.tensor(float(overlap.numel()), device=overlap.device)
    return sums


def _overlap(policy_logits: torch.Tensor, draft_logits: torch.Tensor, temperature: float, vocab_size: int) -> torch.Tensor:
    """sum_x min(p(x), q(x)) per row of (vocab-parallel) logits [n, v/tp]."""
    from nemo_rl_mtp.models.megatron.train import mask_padding_ids

    p, q = (_vocab_parallel_softmax(mask_padding_ids(rows.float(), vocab_size) / temperature) for rows in (policy_logits, draft_logits))
    return _sum_over_tensor_parallel(torch.minimum(p, q).sum(dim=-1))


def _vocab_parallel_softmax(logits: torch.Tensor) -> torch.Tensor:
    group = parallel_state.get_tensor_model_parallel_group()
    peak = logits.max(dim=-1, keepdim=True).values
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX, group=group)
    weights = (logits - peak).exp()
    return weights / _sum_over_tensor_parallel(weights.sum(dim=-1, keepdim=True))


def _sum_over_tensor_parallel(values: torch.Tensor) -> torch.Tensor:
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(values, group=parallel_state.get_tensor_model_parallel_group())
    return values


def with_expected_acceptance(metrics: dict[str, float]) -> dict[str, float]:
    """The step's global sums replaced by ``mtp/mtp_{i}_expected_acceptance`` in percent."""
    depth = 1
    while _SUM.format(depth) in metrics:
        total, count = metrics.pop(_SUM.format(depth)), metrics.pop(_COUNT.format(depth))
        metrics[f"mtp/mtp_{depth}_expected_acceptance"] = 100.0 * total / max(count, 1.0)
        depth += 1
    return metrics
