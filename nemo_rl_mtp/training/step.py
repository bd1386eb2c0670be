"""One policy training step on megatron-core, the way an RL policy worker drives it.

The MTP path, step by step:
  1. ``compute_mtp_loss_mask``   - response tokens of valid samples (data.py), once per global batch
  2. ``build_microbatches``      - the mask is laid out exactly like ``input_ids`` (data.py)
  3. ``forward_step``            - the mask goes in as megatron's ``loss_mask``, ``labels=None``
  4. ``mtp_grad_scale``          - MTP gradient normalised like the policy loss, for this step only
  5. ``mtp_draft_terms``         - per depth, once the policy's logits exist: the acceptance
                                  forecast and, with ``mtp_loss_type`` other than megatron's cross
                                  entropy, the loss on the policy's distribution
                                  (acceptance_forecast.py, draft_distributions.py)
  6. ``mtp_step_metrics``        - per-layer loss and acceptance from megatron's class-level
                                  tracker, drained where the step ends; the per-step guard
                                  (``compat.assert_mtp_trained``) fails a step whose MTP did not train

``train_global_batch`` is the one training step: GRPO's (the policy worker's ``train``) and the
imitation warm start's (``algorithms/imitation.py``) differ only in the loss and in
``MTPTraining``; both return the same metrics, MTP ones as ``mtp/...`` keys.

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
re-weights each microbatch by N_0 / N_k. The losses on the policy's distribution replace CE_k(i)
by their own per-target loss and keep everything else, the seed included.

Frozen heads (``MTPTraining.frozen``, GRPO steps with ``policy.mtp_frozen_during_rl``): the MTP
backward is seeded with 0, the MTP layers run without autograd, and the optimizer step leaves the
MTP parameters out; the forward, its metrics and the forecast are unchanged.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

from nemo_rl_mtp.megatron_compat.cpu import training_runtime as cpu_runtime
from nemo_rl_mtp.training import moe
from nemo_rl_mtp.training.forecast import (
    DraftLogits,
    MTPTargets,
    forecast_sums,
    with_expected_acceptance,
)
from nemo_rl_mtp.megatron_compat.mtp_loss_callable import substituted_mtp_loss
from nemo_rl_mtp.training.draft_distributions import draft_terms, entropy_sum, overlap_sum
from nemo_rl_mtp.training.aux_losses import (
    backward_seed_over,
    broadcast_from_last_pipeline_stage,
    get_mtp_metrics,
    sum_over_data_parallel,
)
from nemo_rl_mtp.megatron_compat.shims import assert_mtp_trained
from nemo_rl_mtp.training.batches import (
    Microbatch,
    compute_mtp_loss_mask,
    local_valid_tokens,
    microbatches_for_this_rank,
)
from nemo_rl_mtp.training.module_modes import eval_mode
from nemo_rl_mtp.training.model import MegatronPolicyModel, mtp_enabled
from nemo_rl_mtp.training.vocabulary import mask_ids_past_vocabulary
from nemo_rl_mtp.metrics import (
    ENTROPY,
    GLOBAL_VALID_TOKENS,
    GRAD_NORM,
    MTP,
    MTP_GLOBAL_VALID_TOKENS,
    MTP_GRAD_NORM,
    UPDATE_SUCCESSFUL,
    all_in_scope,
)

logger = logging.getLogger(__name__)

PolicyLossFn = Callable[[torch.Tensor, dict, torch.Tensor], tuple[torch.Tensor, dict]]


@dataclass(frozen=True)
class MTPTraining:
    """How a step trains the MTP heads: ``loss_type`` (``policy.megatron_cfg.mtp_loss_type``) and
    ``frozen`` (no MTP gradient reaches anything and the MTP parameters sit out the optimizer step;
    the MTP forward still runs, for its metrics)."""

    loss_type: str
    frozen: bool

    @classmethod
    def during_rl(cls, policy_cfg) -> "MTPTraining":
        """GRPO steps: the configured loss; frozen with ``policy.mtp_frozen_during_rl``."""
        return cls(policy_cfg.megatron_cfg.mtp_loss_type, policy_cfg.mtp_frozen_during_rl)


# The imitation warm start (a stand-in for SFT): the heads learn the demonstrations' tokens with
# megatron's cross entropy, whatever the RL loss, so every RL variant starts from the same heads.
IMITATION = MTPTraining("cross_entropy", frozen=False)


def train_global_batch(
    policy: MegatronPolicyModel, batch: dict[str, torch.Tensor], loss_fn: PolicyLossFn, policy_cfg, mtp: MTPTraining | None = None
) -> dict[str, float]:
    """The training step (GRPO and imitation alike): forward/backward over this rank's share of
    one global batch, then one optimizer step; ``mtp``: how the MTP heads train (None: as
    configured for GRPO steps).

    Returns the step's metrics, global over data-parallel ranks and the same on every pipeline
    stage (``forward_backward_global_batch``), with ``grad_norm`` and ``update_successful``.
    """
    mtp = mtp or MTPTraining.during_rl(policy_cfg)
    metrics = forward_backward_global_batch(policy, batch, loss_fn, policy_cfg, mtp)
    metrics.update(optimizer_step(policy, frozen_mtp=mtp.frozen))
    return metrics


def forward_backward_global_batch(
    policy: MegatronPolicyModel, batch: dict[str, torch.Tensor], loss_fn: PolicyLossFn, policy_cfg, mtp: MTPTraining | None = None
) -> dict[str, float]:
    """Gradients of the global batch's loss (policy + MTP) in the DDP grad buffers, finalised
    (all-reduced over data parallel) by megatron's schedule.

    Returns the step's metrics: the loss function's, ``entropy``, ``global_valid_tokens``, MoE's,
    and with MTP ``mtp/mtp_{i}_loss``, ``mtp/mtp_{i}_acceptance_rate``,
    ``mtp/mtp_{i}_target_tokens``, ``mtp/mtp_{i}_expected_acceptance``, ``mtp/grad_norm`` and
    ``mtp/global_valid_tokens``. megatron's MTP tracker is empty afterwards, raised or not; a step
    whose MTP computed no loss or no gradient raises (``compat.assert_mtp_trained``)."""
    mtp = mtp or MTPTraining.during_rl(policy_cfg)
    with mtp_tracker_emptied():
        metrics, num_microbatches = _forward_backward(policy, batch, loss_fn, policy_cfg, mtp)
        if mtp_enabled(policy.config):
            metrics.update(mtp_step_metrics(policy, num_microbatches, metrics, mtp.frozen))
    return metrics


def _forward_backward(
    policy: MegatronPolicyModel, batch: dict[str, torch.Tensor], loss_fn: PolicyLossFn, policy_cfg, mtp: MTPTraining
) -> tuple[dict[str, float], int]:
    model, config = policy.model, policy.config
    device = cpu_runtime.compute_device()
    global_tokens = count_global_valid_tokens(batch, device)
    mtp_tokens = global_tokens
    if mtp_enabled(config):
        warn_if_mtp_depths_are_reweighted(batch, config.mtp_num_layers, policy.warned)
        mtp_mask = compute_mtp_loss_mask(batch["token_mask"], batch["sample_mask"], batch["advantages"], policy_cfg.mtp_loss_mask_policy)
        batch = {**batch, "mtp_loss_mask": mtp_mask}
        mtp_tokens = count_global_mtp_tokens(mtp_mask, device)
    router_tokens = moe.count_global_router_tokens(batch, device) if moe.moe_enabled(config) else None
    microbatches = microbatches_for_this_rank(batch, policy_cfg, device)
    model.zero_grad_buffer()
    policy.optimizer.zero_grad()
    with (
        cpu_runtime.device_scope(),
        mtp_grad_scale(config, mtp_tokens, frozen=mtp.frozen),
        mtp_layers_without_gradient(model.module, enabled=mtp.frozen),
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
                mtp_loss_type=mtp.loss_type,
            ),
            forward_only=False,
        )
    metrics = with_expected_acceptance(sum_over_global_batch(microbatch_metrics, device))
    metrics.update(moe.get_moe_metrics(config, len(microbatches), moe.uses_global_load_statistics(policy_cfg.megatron_cfg)))
    metrics[GLOBAL_VALID_TOKENS] = float(global_tokens)
    if mtp_enabled(config):
        metrics[MTP_GRAD_NORM] = mtp_gradient_norm(model)
        metrics[MTP_GLOBAL_VALID_TOKENS] = float(mtp_tokens)
    return metrics, len(microbatches)


@contextlib.contextmanager
def mtp_tracker_emptied():
    """megatron's ``MTPLossLoggingHelper.tracker`` is class-level: what one step leaves in it
    (a step that raised half-way included) would be added into the next step's metrics. Emptied
    when the step ends."""
    try:
        yield
    finally:
        MTPLossLoggingHelper.tracker.clear()


def mtp_step_metrics(policy: MegatronPolicyModel, num_microbatches: int, step_metrics: dict[str, float], frozen: bool) -> dict[str, float]:
    """Per MTP layer, loss, acceptance and target count from megatron's tracker (filled on the
    last pipeline stage, shared with every stage), as ``mtp/...`` keys, after the per-step guard:
    a step that computed no MTP loss, or no MTP gradient where one was due, raises."""
    tracked = get_mtp_metrics(num_microbatches) if parallel_state.is_pipeline_last_stage() else None
    tracked = broadcast_from_last_pipeline_stage(tracked)
    assert_mtp_trained(
        policy.config, tracked, step_metrics[MTP_GRAD_NORM], step_metrics[MTP_GLOBAL_VALID_TOKENS], frozen, policy.warned
    )
    return all_in_scope(MTP, tracked)


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

    with eval_mode(model), torch.no_grad():
        run_schedule(model, microbatches, forward_step, forward_only=True)


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


def optimizer_step(policy: MegatronPolicyModel, frozen_mtp: bool = False) -> dict[str, float]:
    """One optimizer step; with ``frozen_mtp`` the MTP block's parameters sit it out
    (``optimizer_skipping``), so they do not move even where the optimizer has momentum."""
    skipped = mtp_parameters(policy.model.module) if frozen_mtp else []
    with cpu_runtime.device_scope(), optimizer_skipping(policy.optimizer, skipped):
        update_successful, grad_norm, _ = policy.optimizer.step()
    return {GRAD_NORM: float(grad_norm or 0.0), UPDATE_SUCCESSFUL: float(update_successful)}


def mtp_parameters(gpt_model) -> list[torch.nn.Parameter]:
    mtp_block = getattr(gpt_model, "mtp", None)
    return list(mtp_block.parameters()) if mtp_block is not None else []


@contextlib.contextmanager
def optimizer_skipping(optimizer, parameters: list[torch.nn.Parameter]):
    """Within the block, the torch optimizers under megatron's leave ``parameters`` alone: a step
    pre-hook (torch's) clears the gradient of each tensor they would update for one of them, and
    torch's optimizers skip a tensor without gradient (no update, no weight decay, no moment
    change). That tensor is the parameter itself, or its fp32 main copy under megatron's
    mixed-precision optimizer (``float16_groups`` -> ``fp32_from_float16_groups``). A step
    post-hook then advances the skipped tensors' step counters with the others': megatron's
    checkpoint keeps one step count for all parameters and refuses to save counts that differ."""
    if not parameters:
        yield
        return
    handles = []
    try:
        for wrapper in getattr(optimizer, "chained_optimizers", [optimizer]):
            updated = _tensors_updated_for(wrapper, parameters)
            if updated:
                handles.append(wrapper.optimizer.register_step_pre_hook(partial(_clear_gradients, updated)))
                handles.append(wrapper.optimizer.register_step_post_hook(partial(_advance_step_counts, updated)))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _tensors_updated_for(wrapper, parameters: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    wanted = {id(parameter) for parameter in parameters}
    updated = [tensor for group in wrapper.optimizer.param_groups for tensor in group["params"] if id(tensor) in wanted]
    for model_group, main_group in zip(getattr(wrapper, "float16_groups", []), getattr(wrapper, "fp32_from_float16_groups", [])):
        updated += [main for model, main in zip(model_group, main_group) if id(model) in wanted]
    return updated


def _clear_gradients(tensors: list[torch.Tensor], _optimizer, _args, _kwargs) -> None:
    for tensor in tensors:
        tensor.grad = None


def _advance_step_counts(tensors: list[torch.Tensor], optimizer, _args, _kwargs) -> None:
    """Count the step the skipped ``tensors`` sat out, as torch's optimizers count it for the
    tensors they updated (those without state yet, never stepped, stay without)."""
    for tensor in tensors:
        state = optimizer.state.get(tensor)
        if state and "step" in state:
            state["step"] = state["step"] + 1



def count_global_valid_tokens(batch: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """G: policy-loss tokens summed over the global batch (one all-reduce over data parallel)."""
    return sum_over_data_parallel(local_valid_tokens(batch), device)


def warn_if_mtp_depths_are_reweighted(batch: dict[str, torch.Tensor], mtp_num_layers: int, warned: set[str]) -> None:
    """Warn once per policy (``warned``: the warnings it has given) when a valid sample's response
    starts within its first mtp_num_layers + 1 tokens: megatron then re-weights each microbatch's
    depth-k loss by N_0 / N_k (module docstring), so deeper depths are not exact global per-token
    means. Exact again with longer prompts."""
    valid = batch["sample_mask"] > 0
    first_response = batch["token_mask"].float().argmax(dim=1)
    short = int((valid & (first_response < mtp_num_layers + 1) & (batch["token_mask"].sum(dim=1) > 0)).sum())
    if short and "mtp_depths_reweighted" not in warned:
        warned.add("mtp_depths_reweighted")
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
def mtp_grad_scale(config, global_valid_tokens: torch.Tensor, frozen: bool = False):
    """Set ``config.mtp_grad_scale_func`` for one step so the MTP backward is seeded with
    ``loss_scale / G`` like the policy loss (0 for ``frozen`` heads: no MTP gradient reaches
    anything), and clear it afterwards so it never lands in a saved config. ``loss_scale`` is the
    fp16 loss scale (1 otherwise), the value megatron falls back to when no MTP scale function is
    set."""
    count = torch.full_like(global_valid_tokens, float("inf")) if frozen else global_valid_tokens
    with backward_seed_over(config, "mtp_grad_scale_func", count, enabled=mtp_enabled(config)):
        yield


@contextlib.contextmanager
def mtp_layers_without_gradient(gpt_model, enabled: bool):
    """Run the MTP layers without autograd (frozen heads): their outputs carry no graph, so the
    backward pass skips them (their gradient would be zero anyway, see ``mtp_grad_scale``); the
    MTP block's first chunk, the trunk's hidden states, keeps its graph. Grad mode is switched off
    by a pre-hook on each layer call and restored by its post-hook, and here on exit (a forward
    that raised in between)."""
    mtp_block = getattr(gpt_model, "mtp", None)
    if not enabled or mtp_block is None:
        yield
        return
    outer = torch.is_grad_enabled()

    def without_grad(module, args) -> None:
        torch.set_grad_enabled(False)

    def restore_grad(module, args, output) -> None:
        torch.set_grad_enabled(outer)

    handles = []
    try:
        for layer in mtp_block.layers:
            handles += [layer.register_forward_pre_hook(without_grad), layer.register_forward_hook(restore_grad)]
        yield
    finally:
        for handle in handles:
            handle.remove()
        torch.set_grad_enabled(outer)


def forward_step(
    data_iterator: Iterator[Microbatch],
    model,
    *,
    loss_fn: PolicyLossFn,
    global_valid_tokens: torch.Tensor,
    temperature: float,
    vocab_size: int,
    mtp_loss_type: str,
):
    """megatron's ``forward_step_func`` for training. Each MTP depth's logits are taken from
    megatron's MTP loss call during the forward (``acceptance_forecast.DraftLogits``): for the
    forecast and, with a loss on the policy's distribution, for that loss."""
    microbatch = next(data_iterator)
    gpt_model = model.module
    scaling_factor = gpt_model.config.mtp_loss_scaling_factor
    targets = microbatch.mtp_targets
    draft_logits = None
    if targets is not None and getattr(gpt_model, "mtp_process", False) and gpt_model.post_process:
        draft_logits = DraftLogits(targets, keep_graph=mtp_loss_type != "cross_entropy")
    with substituted_mtp_loss(draft_logits):
        logits = model_forward(model, microbatch)
    mtp_terms = partial(
        mtp_draft_terms,
        draft_logits=draft_logits,
        loss_type=mtp_loss_type,
        scaling_factor=scaling_factor,
        temperature=temperature,
        vocab_size=vocab_size,
    )
    return logits, partial(policy_loss, microbatch, loss_fn, global_valid_tokens, temperature, vocab_size, mtp_terms)


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


def mtp_draft_terms(
    logits: torch.Tensor,
    *,
    draft_logits: DraftLogits | None,
    loss_type: str,
    scaling_factor: float,
    temperature: float,
    vocab_size: int,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The MTP terms that need the policy's logits [b, s, v/tp]: per depth, the forecast sums and,
    for a loss on the policy's distribution, the loss. Returns the logits the policy loss must use
    (they carry the MTP loss into the backward pass, megatron's way: ``MTPLossAutoScaler``, seeded
    from ``mtp_grad_scale_func``) and the forecast sums.

    Normalised as megatron normalises its cross entropy: depth k of L weighs
    (mtp_loss_scaling_factor / L) * N_0 / N_k per microbatch and each target its mask value, and
    megatron's tracker logs the depth's loss as the microbatch's mask-weighted mean."""
    if draft_logits is None or not (draft_logits.logits or draft_logits.keep_graph):
        return logits, {}
    targets: MTPTargets = draft_logits.targets
    if len(draft_logits.logits) != len(targets):  # the model class's MTP loss call was not wrapped
        raise RuntimeError(
            f"{len(draft_logits.logits)} of {len(targets)} MTP depths reached the MTP loss substitute in this forward, so "
            f"mtp_loss_type={loss_type} would train nothing; check the mtp_loss_callable compat shim's log line at model setup"
        )
    num_layers = len(draft_logits.logits)
    sums, total_loss = {}, None
    for depth, depth_logits in enumerate(draft_logits.logits):
        count = targets.draft_rows[depth].numel()
        if not draft_logits.keep_graph:  # megatron's cross entropy: the forecast only
            overlap = overlap_sum(depth_logits, logits, targets.draft_policy_index[depth], temperature, vocab_size)
            sums.update(forecast_sums(depth, overlap, count))
            continue
        mask, num_tokens = targets.mask[depth], targets.num_tokens[depth]
        scale = scaling_factor / num_layers * targets.first_num_tokens / num_tokens.clamp(min=1)
        loss, value, overlap = draft_terms(
            depth_logits, logits, targets.policy_index[depth], mask, targets.draftable[depth], loss_type, scale, temperature, vocab_size
        )
        total_loss = loss if total_loss is None else total_loss + loss
        sums.update(forecast_sums(depth, overlap, count))
        _log_mtp_loss(value * (num_tokens > 0) / num_tokens.clamp(min=1), depth, num_layers)
    if total_loss is not None:
        logits = MTPLossAutoScaler.apply(logits, total_loss)
    return logits, sums


def _log_mtp_loss(loss: torch.Tensor, depth: int, num_layers: int) -> None:
    """Add a depth's loss to megatron's MTP tracker (``mtp_{i}_loss``), which holds the depth's
    acceptance counts and the zero loss megatron was handed for this microbatch."""
    zero = torch.zeros((), device=loss.device)
    MTPLossLoggingHelper.save_metrics_to_tracker(
        loss, zero, zero, depth, num_layers, avg_group=parallel_state.get_data_parallel_group(with_context_parallel=True)
    )


def policy_loss(
    microbatch: Microbatch,
    loss_fn: PolicyLossFn,
    global_valid_tokens: torch.Tensor,
    temperature: float,
    vocab_size: int,
    mtp_terms: Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]],
    logits,
):
    """The policy loss of one microbatch and its metrics: first the MTP terms that need the
    policy's logits (they read the logits as the forward left them), the policy's entropy at the
    sampling temperature (a per-token mean like the loss), then the loss."""
    logits, mtp_metrics = mtp_terms(logits)
    loss_mask = microbatch.loss_inputs["loss_mask"]
    entropy = entropy_sum(logits.detach(), loss_mask, temperature, vocab_size) / global_valid_tokens.clamp(min=1)
    logprobs = token_logprobs(logits, microbatch.loss_inputs["target_ids"], temperature, vocab_size)
    loss, metrics = loss_fn(logprobs, microbatch.loss_inputs, global_valid_tokens)
    metrics.update(mtp_metrics)
    metrics[ENTROPY] = entropy
    num_tokens = loss_mask.sum().to(torch.int)
    # Three values: under calculate_per_token_loss megatron leaves the (pre-normalised) loss as is.
    return loss, num_tokens, metrics



def token_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, temperature: float, vocab_size: int) -> torch.Tensor:
    """log p(target) per position under the sampling temperature, from (vocab-parallel) logits
    ``[b, s, v/tp]``, over the real vocabulary (padding ids excluded, as in sampling)."""
    return -vocab_parallel_cross_entropy(mask_ids_past_vocabulary(logits.float(), vocab_size) / temperature, target_ids)


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
    """L2 norm of the MTP block's gradients (after the DP all-reduce, before clipping): torch's
    foreach norm over this rank's MTP gradients (tensor-parallel duplicates left out), squared and
    summed over the model-parallel group (the MTP block sits on the last pipeline stage), as
    megatron's ``get_grad_norm_fp32`` sums it. One host read."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    mtp_block = getattr(model.module, "mtp", None)
    grads = []
    if mtp_block is not None:
        grads = [
            param.main_grad
            for param in mtp_block.parameters()
            if param.requires_grad and param_is_not_tensor_parallel_duplicate(param)
        ]
    squared = (torch.nn.utils.get_total_norm(grads) ** 2).to(cpu_runtime.compute_device(), torch.float32).reshape(1)
    if parallel_state.get_model_parallel_group().size() > 1:
        torch.distributed.all_reduce(squared, group=parallel_state.get_model_parallel_group())
    return float(squared.sqrt())
