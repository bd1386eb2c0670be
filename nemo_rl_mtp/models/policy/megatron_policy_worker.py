"""One data-parallel rank of the policy: a megatron-core GPTModel with MTP heads.

Ray ships this class to its actor processes with cloudpickle. cloudpickle also pickles the
modules a method's code names, so a method that mentioned ``config`` next to
``torch.distributed`` once dragged in ``torch.distributed.config`` (an unpicklable
``ConfigModuleInstance``) and no worker could start. Hence: megatron and the training code are
imported inside the methods that use them, and MTP metrics are collected in a method of their own.
"""

from __future__ import annotations


class MegatronPolicyWorker:
    def __init__(self, policy_cfg, vocab_size: int, rank: int, world_size: int, init_method: str):
        from nemo_rl_mtp.models.megatron.setup import initialize_model_parallel, setup_megatron_policy

        self.policy_cfg = policy_cfg
        self.rank = rank
        initialize_model_parallel(policy_cfg.megatron_cfg, rank, world_size, init_method)
        self.policy = setup_megatron_policy(policy_cfg, vocab_size)

    def train(self, batch: dict, loss_fn) -> dict[str, float]:
        """One optimizer step on this rank's share of a global batch; metrics are global."""
        from nemo_rl_mtp.models.megatron.train import train_global_batch

        metrics, num_microbatches = train_global_batch(self.policy, batch, loss_fn, self.policy_cfg)
        metrics.update(self._collect_mtp_metrics(num_microbatches))
        return metrics

    def _collect_mtp_metrics(self, num_microbatches: int) -> dict[str, float]:
        """Per-layer MTP loss and acceptance from the last pipeline stage, as ``mtp/...`` keys."""
        from megatron.core import parallel_state

        from nemo_rl_mtp.models.megatron.common import get_mtp_metrics
        from nemo_rl_mtp.models.megatron.train import broadcast_from_last_pipeline_stage

        metrics = get_mtp_metrics(num_microbatches) if parallel_state.is_pipeline_last_stage() else None
        metrics = broadcast_from_last_pipeline_stage(metrics)
        return {f"mtp/{name}": value for name, value in metrics.items()}
