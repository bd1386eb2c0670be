"""The driver's view of the policy: Ray actors, one per rank, and the data-parallel sharding of
the work sent to them."""

from __future__ import annotations

import logging
from pathlib import Path

import ray
import torch

from nemo_rl_mtp.cluster.ray_cluster import (
    in_bundle,
    init_ray,
    local_ray_processes_alive,
    rendezvous_address,
    reserve_workers,
    world_size,
)
from nemo_rl_mtp.cluster.worker import MegatronPolicyWorker
from nemo_rl_mtp.metrics import TOKENS, merge_data_parallel

logger = logging.getLogger(__name__)

WORKER_EXIT_TIMEOUT_S = 5


class Policy:
    def __init__(self, cfg, vocab_size: int):
        init_ray(cfg.cluster)
        self.placement_group = reserve_workers(cfg.cluster)
        init_method = rendezvous_address(self.placement_group)
        size = world_size(cfg.cluster)
        actor = ray.remote(MegatronPolicyWorker)
        keep_reference = cfg.loss_fn.reference_policy_kl_penalty > 0
        self.workers = [
            actor.options(
                num_cpus=cfg.cluster.cpus_per_worker,
                num_gpus=cfg.cluster.gpus_per_worker,
                scheduling_strategy=in_bundle(self.placement_group, rank),
            ).remote(cfg.policy, vocab_size, rank, size, init_method, keep_reference)
            for rank in range(size)
        ]
        self.ranks = ray.get([worker.parallel_ranks.remote() for worker in self.workers])
        ray.get([worker.freeze_startup_heap.remote() for worker in self.workers])
        self.dp_size = self.ranks[0]["dp_size"]
        # Per data-parallel rank, the worker whose results are read (all its peers hold the same).
        last_stage = self.ranks[0]["pp_size"] - 1
        self.reader_of_dp_rank = {
            info["dp_rank"]: index
            for index, info in enumerate(self.ranks)
            if info["tp_rank"] == 0 and info["cp_rank"] == 0 and info["pp_rank"] == last_stage
        }
        logger.info("policy: %d workers, data-parallel size %d", size, self.dp_size)
        if self.ranks[0]["engine_cpu_adaptations"]:  # logged once here: Ray does not forward workers' INFO lines
            logger.info("rollout engine adapted to the CPU: %s", self.ranks[0]["engine_cpu_adaptations"])

    def _shards(self, items):
        """Contiguous data-parallel shards of a list or of a dict of [B, ...] tensors."""
        if isinstance(items, dict):
            size = next(iter(items.values())).shape[0] // self.dp_size
            return [{key: value[rank * size : (rank + 1) * size] for key, value in items.items()} for rank in range(self.dp_size)]
        size = len(items) // self.dp_size
        return [items[rank * size : (rank + 1) * size] for rank in range(self.dp_size)]

    def _run_sharded(self, method: str, data, *args):
        """Call ``method`` on every worker (they meet in collectives) with its data-parallel
        shard; returns one result per data-parallel rank."""
        shard_refs = [ray.put(shard) for shard in self._shards(data)]
        futures = [
            getattr(worker, method).remote(shard_refs[info["dp_rank"]], *args)
            for worker, info in zip(self.workers, self.ranks)
        ]
        results = ray.get(futures)
        return [results[self.reader_of_dp_rank[rank]] for rank in range(self.dp_size)]

    def generate(self, prompts: list[list[int]], eos_id: int, pad_id: int, seed: int, greedy: bool = False) -> dict[str, torch.Tensor]:
        """Rollouts (greedy ones with ``greedy``) of every data-parallel rank, in prompt order:
        ``tokens``, ``lengths``, ``prompt_lengths``, ``logprobs`` (see ``RolloutEngine.generate``);
        ``decode_steps`` of the slowest rank; ``draft_proposed``, ``draft_accepted`` summed over
        the ranks: each result merged as ``metrics.RANK_RESULT_REDUCTIONS`` declares (a result
        without a declaration raises, naming it)."""
        shards = self._run_sharded("generate", prompts, eos_id, pad_id, seed, greedy)
        return merge_data_parallel(shards, pad_values={TOKENS: pad_id})

    def get_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat(self._run_sharded("get_logprobs", batch))

    def get_reference_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat(self._run_sharded("get_reference_logprobs", batch))

    def keep_start_of_rl_weights(self, directory: Path | None) -> None:
        """Every worker keeps the weights GRPO starts from (saved into ``directory`` if given)."""
        ray.get([worker.keep_start_of_rl_weights.remote(None if directory is None else str(directory)) for worker in self.workers])

    def load_start_of_rl_weights(self, directory: Path) -> None:
        ray.get([worker.load_start_of_rl_weights.remote(str(directory)) for worker in self.workers])

    def get_start_of_rl_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat(self._run_sharded("get_start_of_rl_logprobs", batch))

    def train(self, batch: dict[str, torch.Tensor], loss_fn) -> dict[str, float]:
        """One optimizer step on a global batch; the metrics are already global."""
        return self._run_sharded("train", batch, loss_fn)[0]

    def imitate(self, batch: dict[str, torch.Tensor], lr: float) -> dict[str, float]:
        """One imitation step at learning rate ``lr`` on a global batch of demonstrations; the
        metrics are global."""
        return self._run_sharded("imitate", batch, lr)[0]

    def save_checkpoint(self, directory: Path) -> None:
        ray.get([worker.save_checkpoint.remote(str(directory)) for worker in self.workers])

    def load_checkpoint(self, directory: Path) -> None:
        ray.get([worker.load_checkpoint.remote(str(directory)) for worker in self.workers])

    def shutdown(self) -> None:
        """Let the workers exit on their own (a forced kill makes each print a stack dump), force
        those that do not within a few seconds, and release their placement group."""
        from ray.util.placement_group import remove_placement_group

        if not local_ray_processes_alive():
            logger.warning("Ray's processes are gone (signalled with this driver); nothing to release")
            return
        exits = [worker.__ray_terminate__.remote() for worker in self.workers]
        ray.wait(exits, num_returns=len(exits), timeout=WORKER_EXIT_TIMEOUT_S)
        for worker in self.workers:
            ray.kill(worker)
        remove_placement_group(self.placement_group)

