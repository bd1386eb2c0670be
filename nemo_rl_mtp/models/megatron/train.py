"""One policy training step on megatron-core, the way an RL policy worker drives it.

The MTP path, step by step:
  1. ``compute_mtp_loss_mask``   - response tokens of valid samples (data.py), once per global batch
  2. ``build_microbatches``      - the mask is laid out exactly like ``input_ids`` (data.py)
  3. ``forward_step``            - the mask goes in as megatron's ``loss_mask``, ``labels=None``
  4. ``mtp_grad_scale``          - MTP gradient normalised like the policy loss, for this step only
  5. ``get_mtp_metrics``         - per-layer loss and acceptance after the step (common.py)
  6. ``expected_acceptance_sums`` - per depth, the acceptance rejection sampling would reach
                                  (acceptance_forecast.py)

Normalisation. The policy loss of a microbatch is its token sum divided by G, the number of valid
tokens in the whole global batch (all microbatches, all data-parallel ranks); DDP sums gradients
(``calculate_per_token_loss``), so the step's gradient is that of the global per-token mean.
megatron injects the MTP loss of depth k (0-based) on a microbatch as

    (mtp_loss_scaling_factor / mtp_num_layers) * sum_i CE_k(i) * N_0 / N_k

where the sum runs over positions i whose target token i + 2 + k is a response token of a valid
sample, N_0 counts the loss mask after megatron's first roll and N_k after its (k + 2)-th. We seed
its backward with ``loss_scale / G``, so MTP gradients are per-token means over the global batch
as well. N_0 = N_k whenever no response token sits among the first k + 2 tokens of a sequence,
i.e. every prompt is at least mtp_num_layers + 1 tokens long (always so in RL); otherwise megatron
re-weights each microbatch by N_0 / N_k.
"""

from __future__ import annotations

import contextlib
import logging
from functools import partial
from typing import Callable, Iterator

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

from nemo_rl_mtp.models.megatron import cpu_runtime, moe
from nemo_rl_mtp.models.megatron.acceptance_forecast import (
    expected_acceptance_sums,
    forecast_targets,
    recording_mtp_logits,
    with_expected_acceptance,
)
from nemo_rl_mtp.models.megatron.common import backward_seed_over, broadcast_from_last_pipeline_stage, sum_over_data_parallel
from nemo_rl_mtp.models.megatron.data import (
    Microbatch,
    compute_mtp_loss_mask,
    local_valid_tokens,
    microbatches_for_this_rank,
)
from nemo_rl_mtp.models.megatron.setup import MegatronPolicyModel, mtp_enabled

logger = logging.getLogger(__name__)

PolicyLossFn = Callable[[torch.Tensor, dict, torch.Tensor], tuple[torch.Tensor, dict]]


def train_global_batch(
    policy: MegatronPolicyModel, batch: dict[str, torch.Tensor], loss_fn: PolicyLossFn, policy_cfg
) -> tuple[dict[str, float], int]:
    """Forward/backward over this rank's share of one global batch, then one optimizer step.

    Returns the step's metrics (global over data-parallel ranks) and the number of microbatches.
    """
    metrics, num_microbatches = forward_backward_global_batch(policy, batch, loss_fn, policy_cfg)
    metrics.update(optimizer_step(policy))
    return metrics, num_microbatches


def forward_backward_global_batch(
    policy: MegatronPolicyModel, batch: dict[str, torch.Tensor], loss_fn: PolicyLossFn, policy_cfg
) -> tuple[dict[str, float], int]:
    """Gradients of the global batch's loss (policy + MTP) in the DDP grad buffers, finalised
    (all-reduced over data parallel) by megatron's schedule."""
    model, config = policy.model, policy.config
    device = cpu_runtime.compute_device()
    global_tokens = count_global_valid_tokens(batch, device)
    mtp_tokens = global_tokens
    if mtp_enabled(config):
        warn_if_mtp_depths_are_reweighted(batch, config.mtp_num_layers)
        mtp_mask = compute_mtp_loss_mask(batch["token_mask"], batch["sample_mask"], batch["advantages"], policy_cfg.mtp_loss_mask_policy)
        batch = {**batch, "mtp_loss_mask": mtp_mask}
        mtp_tokens = count_global_mtp_tokens(mtp_mask, device)
    router_tokens = moe.count_global_router_tokens(batch, device) if moe.moe_enabled(config) else None
    microbatches = microbatches_for_this_rank(batch, policy_cfg, device)
    model.zero_grad_buffer()
    policy.optimizer.zero_grad()
    with (
        cpu_runtime.device_scope(),
        mtp_grad_scale(config, mtp_tokens),
        moe.moe_grad_scale(config, router_tokens),
        global_moe_load_statistics(model, microbatches, policy_cfg.megatron_cfg, router_tokens),
    ):
        microbatch_metrics = run_schedule(
            model,
            microbatches,
            partial(
                forward_step,
                loss_fn=loss_fn,
                global_valid_tokens=global_tokens,
                temperature=policy_cfg.generation.temperature,
                vocab_size=policy.vocab_size,
            ),
            forward_only=False,
        )
    metrics = with_expected_acceptance(sum_over_global_batch(microbatch_metrics, device))
    metrics.update(moe.get_moe_metrics(config, len(microbatches), moe.uses_global_load_statistics(policy_cfg.megatron_cfg)))
    metrics["global_valid_tokens"] = float(global_tokens)
    if mtp_enabled(config):
        metrics["mtp/grad_norm"] = mtp_gradient_norm(model)
        metrics["mtp/global_valid_tokens"] = float(mtp_tokens)
    return metrics, len(microbatches)


@contextlib.contextmanager
def global_moe_load_statistics(model, microbatches: list[Microbatch], megatron_cfg, router_tokens):
    """With ``moe_router_load_balancing_type: global_batch_aux_loss``, route every microbatch once
    (forward only, eval mode, MTP layers included), then train with each router's load-balancing
    loss on the global batch's token counts (``moe.global_load_statistics``)."""
    if not moe.uses_global_load_statistics(megatron_cfg):
        yield
        return
    with moe.counting_routed_tokens(moe.routers_of(model.module)) as counts:
        _routing_pass(model, microbatches)
    with moe.global_load_statistics(moe.sum_over_ranks(counts), router_tokens):
        yield


def _routing_pass(model, microbatches: list[Microbatch]) -> None:
    def forward_step(data_iterator, model):
        logits = model_forward(model, next(data_iterator))
        return logits, lambda output: (torch.zeros((), device=output.device), {})

    model.eval()
    try:
        with torch.no_grad():
            run_schedule(model, microbatches, forward_step, forward_only=True)
    finally:
        model.train()


def run_schedule(model, microbatches: list[Microbatch], forward_step_func, forward_only: bool) -> list:
    """megatron's forward(-backward) schedule over the microbatches (pipelined when PP > 1)."""
    return get_forward_backward_func()(
        forward_step_func=forward_step_func,
        data_iterator=iter(microbatches),
        model=[model],
        num_microbatches=len(microbatches),
        seq_length=microbatches[0].input_ids.shape[1],
        micro_batch_size=microbatches[0].input_ids.shape[0],
        forward_only=forward_only,
    )


def optimizer_step(policy: MegatronPolicyModel) -> dict[str, float]:
    with cpu_runtime.device_scope():
        update_successful, grad_norm, _ = policy.optimizer.step()
    return {"grad_norm": float(grad_norm or 0.0), "update_successful": float(update_successful)}


def count_global_valid_tokens(batch: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """G: policy-loss tokens summed over the global batch (one all-reduce over data parallel)."""
    return sum_over_data_parallel(local_valid_tokens(batch), device)


_warned_about_reweighting = False


def warn_if_mtp_depths_are_reweighted(batch: dict[str, torch.Tensor], mtp_num_layers: int) -> None:
    """Warn once when a valid sample's response starts within its first mtp_num_layers + 1 tokens:
    megatron then re-weights each microbatch's depth-k loss by N_0 / N_k (module docstring), so
    deeper depths are not exact global per-token means. Exact again with longer prompts."""
    global _warned_about_reweighting
    valid = batch["sample_mask"] > 0
    first_response = batch["token_mask"].float().argmax(dim=1)
    short = int((valid & (first_response < mtp_num_layers + 1) & (batch["token_mask"].sum(dim=1) > 0)).sum())
    if short and not _warned_about_reweighting:
        _warned_about_reweighting = True
        logger.warning(
            "MTP: %d sample(s) have prompts shorter than mtp_num_layers + 1 = %d tokens; megatron re-weights each "
            "microbatch's deeper MTP losses by N_0/N_k there, so they are not exact per-token means (warned once)",
            short,
            mtp_num_layers + 1,
        )


def count_global_mtp_tokens(mtp_loss_mask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The MTP loss's G: its mask after megatron's first roll (what megatron counts as N_0),
    summed over the global batch. Equal to the policy's G unless ``mtp_loss_mask_policy`` gates."""
    return sum_over_data_parallel(mtp_loss_mask[:, 1:].sum(), device)


@contextlib.contextmanager
def mtp_grad_scale(config, global_valid_tokens: torch.Tensor):
    """Set ``config.mtp_grad_scale_func`` for one step so the MTP backward is seeded with
    ``loss_scale / G`` like the policy loss, and clear it afterwards so it never lands in a saved
    config. ``loss_scale`` is the fp16 loss scale (1 otherwise), the value megatron falls back to
    when no MTP scale function is set."""
    with backward_seed_over(config, "mtp_grad_scale_func", global_valid_tokens, enabled=mtp_enabled(config)):
        yield


def forward_step(
    data_iterator: Iterator[Microbatch],
    model,
    *,
    loss_fn: PolicyLossFn,
    global_valid_tokens: torch.Tensor,
    temperature: float,
    vocab_size: int,
):
    """megatron's ``forward_step_func`` for training; the MTP logits are recorded for the
    acceptance forecast."""
    microbatch = next(data_iterator)
    targets = forecast_targets(microbatch.mtp_loss_mask, microbatch.packed_seq_params, model.module.config.mtp_num_layers)
    with recording_mtp_logits(model.module, targets) as mtp_logits:
        logits = model_forward(model, microbatch)
    forecast = partial(expected_acceptance_sums, mtp_logits=mtp_logits, targets=targets, temperature=temperature, vocab_size=vocab_size)
    return logits, partial(policy_loss, microbatch, loss_fn, global_valid_tokens, temperature, vocab_size, forecast)


def model_forward(model, microbatch: Microbatch) -> torch.Tensor:
    """Logits ``[b, s, v/tp]``; the MTP mask goes in as megatron's ``loss_mask`` with no labels
    (RL mode: megatron derives the MTP labels by rolling ``input_ids``); MoE routers get the
    padding mask."""
    moe_inputs = {"padding_mask": microbatch.padding_mask} if moe.moe_enabled(model.module.config) else {}
    return model(
        input_ids=microbatch.input_ids,
        position_ids=microbatch.position_ids,
        attention_mask=microbatch.attention_mask,
        packed_seq_params=microbatch.packed_seq_params,
        labels=None,
        loss_mask=microbatch.mtp_loss_mask,
        **moe_inputs,
    )


def policy_loss(
    microbatch: Microbatch,
    loss_fn: PolicyLossFn,
    global_valid_tokens: torch.Tensor,
    temperature: float,
    vocab_size: int,
    forecast: Callable[[torch.Tensor], dict[str, torch.Tensor]],
    logits,
):
    """The policy loss of one microbatch and its metrics, with the sums of the MTP acceptance
    forecast (``acceptance_forecast``; computed first: the loss may not leave the logits as is)."""
    with torch.no_grad():
        forecast_sums = forecast(logits)
    logprobs = token_logprobs(logits, microbatch.loss_inputs["target_ids"], temperature, vocab_size)
    loss, metrics = loss_fn(logprobs, microbatch.loss_inputs, global_valid_tokens)
    metrics.update(forecast_sums)
    num_tokens = microbatch.loss_inputs["loss_mask"].sum().to(torch.int)
    # Three values: under calculate_per_token_loss megatron leaves the (pre-normalised) loss as is.
    return loss, num_tokens, metrics


def token_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, temperature: float, vocab_size: int) -> torch.Tensor:
    """log p(target) per position under the sampling temperature, from (vocab-parallel) logits
    ``[b, s, v/tp]``, over the real vocabulary (padding ids excluded, as in sampling)."""
    return -vocab_parallel_cross_entropy(mask_padding_ids(logits.float(), vocab_size) / temperature, target_ids)


def mask_padding_ids(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """-inf on the output-layer ids beyond the tokenizer's vocabulary, on this TP rank's shard."""
    shard_size = logits.shape[-1]
    first_id = parallel_state.get_tensor_model_parallel_rank() * shard_size
    if first_id + shard_size <= vocab_size:
        return logits
    ids = torch.arange(first_id, first_id + shard_size, device=logits.device)
    return logits.masked_fill(ids >= vocab_size, float("-inf"))


def sum_over_global_batch(microbatch_metrics: list[dict[str, torch.Tensor]], device) -> dict[str, float]:
    """Each microbatch metric is already its share of a global mean: sum over microbatches and
    data-parallel ranks on the last pipeline stage, then share with every stage. One host sync."""
    metrics = None
    if parallel_state.is_pipeline_last_stage():
        keys = sorted(microbatch_metrics[0])
        if not keys:
            return broadcast_from_last_pipeline_stage({})
        totals = torch.stack([torch.stack([m[key] for m in microbatch_metrics]).sum() for key in keys])
        totals = totals.to(device=device, dtype=torch.float32)
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        torch.distributed.all_reduce(totals, group=group)
        metrics = dict(zip(keys, totals.tolist()))
    return broadcast_from_last_pipeline_stage(metrics)


def mtp_gradient_norm(model) -> float:
    """L2 norm of the MTP block's gradients (after the DP all-reduce, before clipping)."""
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    mtp_block = getattr(model.module, "mtp", None)
    grads = []
    if mtp_block is not None:
        grads = [
            param.main_grad
            for param in mtp_block.parameters()
            if param.requires_grad and param_is_not_tensor_parallel_duplicate(param)
        ]
    with cpu_runtime.device_scope():
        norm = get_grad_norm_fp32(grads, grad_stats_parallel_group=parallel_state.get_model_parallel_group())
    return float(norm)
