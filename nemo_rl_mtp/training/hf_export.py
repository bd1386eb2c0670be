"""A run's checkpoint as a Hugging Face checkpoint: the policy (MTP heads included) rebuilt in
this process at tensor/pipeline parallel 1 (megatron's sharded checkpoints load at any layout, so
checkpoints of any parallel layout export alike), its weights read from the checkpoint and
streamed through megatron-bridge to the source checkpoint's names."""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import OmegaConf

from nemo_rl_mtp.config.load import ConfigError

logger = logging.getLogger(__name__)


def export_run_checkpoint(cfg, megatron_checkpoint: Path, hf_out: Path) -> Path:
    """Write ``hf_out`` from ``megatron_checkpoint`` (a ``step_N`` directory of the run whose
    resolved config is ``cfg``); returns ``hf_out``."""
    from nemo_rl_mtp.training import hf_checkpoint
    from nemo_rl_mtp.training.checkpoint import load_model_weights
    from nemo_rl_mtp.training.model import build_model, build_transformer_config, initialize_model_parallel

    policy_cfg = single_process_policy(cfg)
    if policy_cfg.model_name is None:
        raise ConfigError(
            "policy.model_name=None: this run built its model from scratch, and only models imported from a Hugging Face "
            "checkpoint have a Hugging Face layout to export to"
        )
    if not (megatron_checkpoint / "policy").is_dir():
        raise ConfigError(f"--megatron-ckpt-path={megatron_checkpoint}: not a checkpoint of a run (no policy/ in it)")
    initialize_model_parallel(policy_cfg.megatron_cfg, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}")
    bridge = hf_checkpoint.open_checkpoint(policy_cfg.model_name, policy_cfg.trust_remote_code)
    architecture = hf_checkpoint.imported_architecture(bridge, tensor_model_parallel_size=1)
    config = build_transformer_config(policy_cfg.megatron_cfg, architecture)
    model, _ = build_model(policy_cfg.megatron_cfg, config, architecture.padded_vocab_size, policy_cfg.max_total_sequence_length, architecture)
    load_model_weights(model.module, megatron_checkpoint / "policy")
    mtp_num_layers = policy_cfg.megatron_cfg.mtp_num_layers
    source = hf_checkpoint.source_directory(policy_cfg.model_name)
    hf_checkpoint.export_hf_checkpoint(bridge, model.module, hf_out, mtp_num_layers, source)
    logger.info("exported %s (%d MTP layer(s)) to %s", megatron_checkpoint, mtp_num_layers, hf_out)
    return hf_out


def single_process_policy(cfg):
    """``cfg.policy`` at tensor, pipeline and context parallel 1 (no sequence parallelism)."""
    overrides = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "context_parallel_size": 1, "sequence_parallel": False}
    policy = OmegaConf.merge(cfg.policy, {"megatron_cfg": overrides})
    OmegaConf.set_readonly(policy, True)
    return policy


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
