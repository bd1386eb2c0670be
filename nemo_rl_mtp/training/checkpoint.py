"""Policy checkpoints with megatron-core's ``dist_checkpointing``: the model (MTP block included)
and its optimizer as sharded tensors, so a checkpoint saved at one parallel layout loads at
another; plus each rank's random-number-generator states, restored when the rank exists again.

Collective: every policy worker calls save/load with the same directory (on a file system all
nodes see). Completeness (the directory becoming the latest checkpoint) is the driver's business.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from nemo_rl_mtp.megatron_compat.cpu import training_runtime as cpu_runtime
from nemo_rl_mtp.megatron_compat.dist_checkpointing import write_results_collected_in_process
from nemo_rl_mtp.training.model import MegatronPolicyModel

logger = logging.getLogger(__name__)


def save_policy(policy: MegatronPolicyModel, directory: Path) -> None:
    """Model and optimizer shards into ``directory/policy``, RNG states into ``rng/rank_<r>.pt``."""
    from megatron.core import dist_checkpointing

    (directory / "policy").mkdir(parents=True, exist_ok=True)
    (directory / "rng").mkdir(exist_ok=True)
    with cpu_runtime.device_scope(), write_results_collected_in_process():
        dist_checkpointing.save(_sharded_state_dict(policy), str(directory / "policy"))
    torch.save(_rng_states(), directory / "rng" / f"rank_{torch.distributed.get_rank()}.pt")


def load_policy(policy: MegatronPolicyModel, directory: Path) -> None:
    """Restore what :func:`save_policy` wrote, at this run's parallel layout."""
    from megatron.core import dist_checkpointing

    with cpu_runtime.device_scope():
        state = dist_checkpointing.load(_sharded_state_dict(policy, is_loading=True), str(directory / "policy"))
        policy.model.module.load_state_dict(state["model"])
        policy.optimizer.load_state_dict(state["optimizer"])
    rng_file = directory / "rng" / f"rank_{torch.distributed.get_rank()}.pt"
    if rng_file.is_file():
        _set_rng_states(torch.load(rng_file, weights_only=False))


def save_model_weights(model, directory: Path) -> None:
    """The model's weights alone (MTP block included; no optimizer) of ``model`` (unwrapped
    GPTModel) as ``dist_checkpointing`` shards in ``directory``."""
    from megatron.core import dist_checkpointing

    directory.mkdir(parents=True, exist_ok=True)
    with cpu_runtime.device_scope(), write_results_collected_in_process():
        dist_checkpointing.save({"model": model.sharded_state_dict()}, str(directory))


def load_model_weights(model, directory: Path) -> None:
    """The model's weights alone from ``dist_checkpointing`` shards in ``directory`` (what
    :func:`save_model_weights` wrote, or the ``policy`` directory of a :func:`save_policy`
    checkpoint), written at any parallel layout, into ``model`` (unwrapped GPTModel) at this
    process's layout."""
    from megatron.core import dist_checkpointing

    with cpu_runtime.device_scope():
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(directory))
        model.load_state_dict(state["model"])


def _sharded_state_dict(policy: MegatronPolicyModel, is_loading: bool = False) -> dict:
    model_state = policy.model.module.sharded_state_dict()
    return {"model": model_state, "optimizer": policy.optimizer.sharded_state_dict(model_state, is_loading=is_loading)}


def _rng_states() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    states = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if cpu_runtime.cuda_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng_states(states: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(states["torch"])
    get_cuda_rng_tracker().set_states(states["tracker"])
    if "cuda" in states and cpu_runtime.cuda_available():
        torch.cuda.set_rng_state(states["cuda"])
