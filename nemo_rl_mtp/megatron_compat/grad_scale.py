"""``config.mtp_grad_scale_func`` for releases before megatron-core 0.19.

0.19's schedule seeds the MTP loss backward (``MTPLossAutoScaler``) with ``mtp_grad_scale_func()``
when it is set (divided by the number of microbatches unless ``calculate_per_token_loss``); earlier
releases only know ``grad_scale_func``, so the MTP gradient would ignore our 1 / G normalisation.
Shim: wrap ``schedules.forward_step_calc_loss`` to set the seed from ``mtp_grad_scale_func``
after the original has set its own.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.pipeline_parallel import schedules
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

from nemo_rl_mtp.megatron_compat._marks import is_shim, mark_shim


def probe() -> tuple[bool, str]:
    if is_shim(schedules.forward_step_calc_loss):
        return True, "installed earlier in this process"
    if "mtp_grad_scale_func" in {field.name for field in dataclasses.fields(ModelParallelConfig)}:
        return False, "ModelParallelConfig.mtp_grad_scale_func is honoured by the schedule (upstream)"
    return True, "the schedule ignores mtp_grad_scale_func (no such config field)"


def is_applied() -> bool:
    return is_shim(schedules.forward_step_calc_loss)


def apply() -> str:
    original = schedules.forward_step_calc_loss
    if is_shim(original):
        return "already installed (idempotent)"
    schedules.forward_step_calc_loss = mark_shim(honour_mtp_grad_scale_func(original), original)
    return "schedules.forward_step_calc_loss: seeds MTPLossAutoScaler from config.mtp_grad_scale_func"


def honour_mtp_grad_scale_func(original):
    signature = inspect.signature(original)

    def forward_step_calc_loss(*args, **kwargs):
        result = original(*args, **kwargs)
        arguments = signature.bind(*args, **kwargs).arguments
        config = arguments["config"]
        scale_func = getattr(config, "mtp_grad_scale_func", None)
        if scale_func is not None and getattr(config, "mtp_num_layers", None) is not None:
            output = result[0]
            device = next(iter(output.values())).device if isinstance(output, dict) else output.device
            scale = torch.as_tensor(scale_func(), device=device).reshape(1)
            if not config.calculate_per_token_loss:
                scale = scale / arguments["num_microbatches"]
            MTPLossAutoScaler.set_loss_scale(scale)
        return result

    return forward_step_calc_loss
