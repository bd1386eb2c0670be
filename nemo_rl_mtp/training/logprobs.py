"""Forward-only passes through megatron's schedule: the logprobs of a batch (previous-policy and
reference logprobs for the GRPO loss). They need the policy's logits only, so the MTP block is
skipped: it would cost a forward of every MTP layer for nothing."""

from __future__ import annotations

import contextlib

import torch
from megatron.core import parallel_state

from nemo_rl_mtp.megatron_compat.cpu import training_runtime as cpu_runtime
from nemo_rl_mtp.training.aux_losses import broadcast_from_last_pipeline_stage
from nemo_rl_mtp.training.batches import Microbatch, microbatches_for_this_rank
from nemo_rl_mtp.training.module_modes import eval_mode
from nemo_rl_mtp.training.model import MegatronPolicyModel
from nemo_rl_mtp.training.step import model_forward, run_schedule, token_logprobs


def forward_only(model, microbatches: list[Microbatch], outputs_of_logits) -> list[dict]:
    """Run the microbatches forward in eval mode; ``outputs_of_logits(microbatch, logits)`` picks what
    to keep. Returns one dict per microbatch on the last pipeline stage, [] elsewhere."""

    def forward_step(data_iterator, model):
        microbatch = next(data_iterator)
        logits = model_forward(model, microbatch)
        return logits, lambda output: (torch.zeros((), device=output.device), outputs_of_logits(microbatch, output))

    with eval_mode(model), torch.no_grad(), cpu_runtime.device_scope(), mtp_block_skipped(model.module):
        return run_schedule(model, microbatches, forward_step, forward_only=True)


@contextlib.contextmanager
def mtp_block_skipped(gpt_model):
    """Run forwards without the MTP block: the model's forward decides whether to run it from
    ``mtp_process`` and whether to split off MTP hidden states from ``config.mtp_num_layers``
    (None: no MTP). Forwards are not re-entrant, so the brief change is safe."""
    if not getattr(gpt_model, "mtp_process", False):
        yield
        return
    config = gpt_model.config
    num_layers = config.mtp_num_layers
    gpt_model.mtp_process, config.mtp_num_layers = False, None
    try:
        yield
    finally:
        gpt_model.mtp_process, config.mtp_num_layers = True, num_layers


def compute_logprobs(policy: MegatronPolicyModel, batch: dict[str, torch.Tensor], policy_cfg) -> torch.Tensor:
    """Token-aligned logprobs ``[B, S]`` of the batch's tokens under the current weights and the
    sampling temperature: entry t is log p(token t | tokens before t); entry 0 is 0."""
    cp_size = parallel_state.get_context_parallel_world_size()
    microbatches = microbatches_for_this_rank(batch, policy_cfg, cpu_runtime.compute_device())

    def keep_logprobs(microbatch, logits):
        target_ids = microbatch.loss_inputs["target_ids"]
        return {"logprobs": token_logprobs(logits, target_ids, policy_cfg.generation.temperature, policy.vocab_size)}

    outputs = forward_only(policy.model, microbatches, keep_logprobs)
    rows = None
    if outputs:
        rows = torch.cat(
            [_to_rows(microbatch, output["logprobs"], cp_size) for microbatch, output in zip(microbatches, outputs)]
        )
    rows = broadcast_from_last_pipeline_stage(rows)
    # Position p predicts token p + 1: shift to token alignment and back to the batch's width.
    token_aligned = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
    width = min(rows.shape[1] - 1, token_aligned.shape[1] - 1)
    token_aligned[:, 1 : width + 1] = rows[:, :width].cpu()
    return token_aligned


def _to_rows(microbatch: Microbatch, values: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Per-position values of a microbatch as ``[b, s]`` rows (undoing packing and the CP split)."""
    if microbatch.source_index is None:
        return values
    values, source_index = values.reshape(-1), microbatch.source_index
    if cp_size > 1:
        group = parallel_state.get_context_parallel_group()
        gathered_values = [torch.empty_like(values) for _ in range(cp_size)]
        gathered_index = [torch.empty_like(source_index) for _ in range(cp_size)]
        torch.distributed.all_gather(gathered_values, values, group=group)
        torch.distributed.all_gather(gathered_index, source_index, group=group)
        values, source_index = torch.cat(gathered_values), torch.cat(gathered_index)
    num_rows, seq_length = microbatch.rows_shape
    rows = torch.zeros(num_rows * seq_length, dtype=values.dtype, device=values.device)
    valid = source_index >= 0
    rows[source_index[valid]] = values[valid]
    return rows.reshape(num_rows, seq_length)
