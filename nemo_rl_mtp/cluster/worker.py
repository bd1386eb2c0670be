"""One rank of the policy: a megatron-core GPTModel with MTP heads, as a Ray actor.

Ray ships this class to its actor processes with cloudpickle. cloudpickle also pickles the
modules a method's code names, so a method that mentioned ``config`` next to
``torch.distributed`` once dragged in ``torch.distributed.config`` (an unpicklable
``ConfigModuleInstance``) and no worker could start. Hence: megatron and the training code are
imported inside the methods that use them (the training step, metrics included, lives in
``training/step.py``).
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import logging

logger = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h) and its ceiling on the mmap threshold (64-bit).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_MAX = 32 * 2**20
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes a C int: hand memory back only past 2 GB free


def keep_freed_host_memory() -> bool:
    """On a CPU, let the C library keep freed memory for the next allocation instead of handing
    it back to the operating system. By default glibc maps each block over a threshold afresh
    and unmaps it when freed (and trims its heap's top), so the engine's per-step tensors of a
    512-request rollout came back as fresh pages every time: 20,000-58,000 page faults per
    generate call and 0.04-0.68 s of system time on a call of 0.3-1.0 s, varying from call to
    call. With blocks up to glibc's 32 MB ceiling taken from the heap and the heap kept, a
    call's faults fall to zero after the first. The process's memory stays at its peak, as
    PyTorch's own CUDA caching allocator keeps device memory. Returns whether it was set; not
    on a GPU (the tensors live in device memory there) or without glibc's ``mallopt`` (logged).
    Idempotent."""
    from nemo_rl_mtp.megatron_compat.cpu.training_runtime import cuda_available

    if cuda_available():
        return False
    mallopt = getattr(_c_library(), "mallopt", None)
    if mallopt is None:
        logger.info("no glibc mallopt in this process: freed host memory goes back to the system as its C library decides")
        return False
    applied = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    logger.debug("glibc malloc keeps freed memory (mmap threshold %d, trim threshold %d): %s", MMAP_THRESHOLD_MAX, TRIM_THRESHOLD, applied)
    return applied


def _c_library():
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def freeze_startup_heap() -> None:
    """Take every object alive now (the imported modules, the model, its engine) out of the cyclic
    collector's generations, as vLLM does once its engine is built (``gc.freeze``). A process with
    megatron imported tracks about 600,000 objects, and each full collection walks them all: 0.38 s
    on the 2-core CPU, landing in a rollout or training step at random (a 512-request rollout of
    0.33 s took 0.69 s with one). Objects made later are collected as before; a frozen object is
    still freed by reference counting when its last reference goes (a replaced rollout engine:
    ``engine_teardown`` breaks its cycles). At exit they are handed back, so that the interpreter's
    last collection finalises them (native extensions otherwise report them leaked)."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)


class MegatronPolicyWorker:
    def __init__(
        self,
        policy_cfg,
        vocab_size: int,
        rank: int,
        world_size: int,
        init_method: str,
        keep_reference_weights: bool = False,
    ):
        from nemo_rl_mtp.reporting.console import quiet_third_party_output

        quiet_third_party_output()  # before megatron is imported
        keep_freed_host_memory()
        from nemo_rl_mtp.training.model import initialize_model_parallel, setup_megatron_policy

        self.policy_cfg = policy_cfg
        self.vocab_size = vocab_size
        self.rank = rank
        from nemo_rl_mtp.rollout.engine import RolloutEngine

        initialize_model_parallel(policy_cfg.megatron_cfg, rank, world_size, init_method)
        self.policy = setup_megatron_policy(policy_cfg, vocab_size)
        self.rollout_engine = RolloutEngine(self.policy, policy_cfg)
        # The latest training step's metrics, until the next rollout reads its acceptance forecast.
        self.latest_training_metrics = None
        # The reference policy for the KL penalty: the initial weights, kept on the host.
        self.reference_weights = self._host_copy_of_weights() if keep_reference_weights else None

    def freeze_startup_heap(self) -> None:
        """After set-up: :func:`freeze_startup_heap` in this worker's process."""
        freeze_startup_heap()

    def parallel_ranks(self) -> dict:
        """Where this worker sits in megatron's parallel layout, and what its inference engine
        had adapted for the CPU (None on GPU)."""
        from megatron.core import parallel_state

        from nemo_rl_mtp.megatron_compat.cpu.inference_runtime import adaptations_in_place

        return {
            "engine_cpu_adaptations": adaptations_in_place(),
            "rank": self.rank,
            "dp_rank": parallel_state.get_data_parallel_rank(),
            "dp_size": parallel_state.get_data_parallel_world_size(),
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "cp_rank": parallel_state.get_context_parallel_rank(),
            "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
            "pp_size": parallel_state.get_pipeline_model_parallel_world_size(),
        }

    def generate(self, prompts: list[list[int]], eos_id: int, pad_id: int, seed: int, greedy: bool) -> dict:
        """Responses to this rank's share of the prompts, from the inference engine over the live
        model. Each data-parallel rank draws from its own seed; its tensor/pipeline peers share it."""
        from megatron.core import parallel_state

        rank_seed = seed * 1_000_003 + parallel_state.get_data_parallel_rank()
        if self.latest_training_metrics is not None:
            self.rollout_engine.observe_training_metrics(self.latest_training_metrics)
            self.latest_training_metrics = None
        return self.rollout_engine.generate(prompts, eos_id, pad_id, rank_seed, greedy)

    def imitate(self, batch: dict, lr: float) -> dict[str, float]:
        """One imitation (supervised) step at learning rate ``lr`` on this rank's share of a
        global batch of demonstrations; metrics are global, MTP loss and acceptance included."""
        from nemo_rl_mtp.training.imitation import imitation_step

        groups = self.policy.optimizer.param_groups
        configured = [group["lr"] for group in groups]
        for group in groups:
            group["lr"] = lr
        try:
            self.latest_training_metrics = imitation_step(self.policy, batch, self.policy_cfg)
            return self.latest_training_metrics
        finally:
            for group, value in zip(groups, configured):
                group["lr"] = value

    def get_logprobs(self, batch: dict):
        from nemo_rl_mtp.training.logprobs import compute_logprobs

        return compute_logprobs(self.policy, batch, self.policy_cfg)

    def get_reference_logprobs(self, batch: dict):
        """Logprobs under the initial weights (the weights being trained are restored after)."""
        return self._logprobs_under(self.reference_weights, batch)

    def keep_start_of_rl_weights(self, directory: str | None) -> None:
        """Keep the weights GRPO starts from (after the warm start) on the host, for
        ``get_start_of_rl_logprobs``; also save them into ``directory`` (collective), so a resumed
        run measures against the same policy."""
        self.start_of_rl_weights = self._host_copy_of_weights()
        if directory is not None:
            from pathlib import Path

            from nemo_rl_mtp.training.checkpoint import save_model_weights

            save_model_weights(self.policy.model.module, Path(directory))

    def load_start_of_rl_weights(self, directory: str) -> None:
        """The weights :meth:`keep_start_of_rl_weights` saved, at this run's parallel layout."""
        from pathlib import Path

        from nemo_rl_mtp.training.checkpoint import load_model_weights

        current = self._host_copy_of_weights()
        load_model_weights(self.policy.model.module, Path(directory))
        self.start_of_rl_weights = self._host_copy_of_weights()
        self.policy.model.module.load_state_dict(current)

    def get_start_of_rl_logprobs(self, batch: dict):
        """Logprobs under the weights GRPO started from (the weights being trained are restored after)."""
        return self._logprobs_under(self.start_of_rl_weights, batch)

    def _logprobs_under(self, weights: dict, batch: dict):
        from nemo_rl_mtp.training.logprobs import compute_logprobs

        current = self._host_copy_of_weights()
        module = self.policy.model.module
        module.load_state_dict(weights)
        try:
            return compute_logprobs(self.policy, batch, self.policy_cfg)
        finally:
            module.load_state_dict(current)

    def train(self, batch: dict, loss_fn) -> dict[str, float]:
        """One GRPO optimizer step on this rank's share of a global batch (MTP heads as configured
        for RL: ``mtp_loss_type``, ``mtp_frozen_during_rl``); metrics are global."""
        from nemo_rl_mtp.training.step import train_global_batch

        self.latest_training_metrics = train_global_batch(self.policy, batch, loss_fn, self.policy_cfg)
        return self.latest_training_metrics

    def save_checkpoint(self, directory: str) -> None:
        """This rank's part of a checkpoint (collective over all workers)."""
        from pathlib import Path

        from nemo_rl_mtp.training.checkpoint import save_policy

        save_policy(self.policy, Path(directory))

    def load_checkpoint(self, directory: str) -> None:
        """Weights, optimizer and RNG states from a checkpoint of any parallel layout (collective)."""
        from pathlib import Path

        from nemo_rl_mtp.training.checkpoint import load_policy

        load_policy(self.policy, Path(directory))

    def _host_copy_of_weights(self) -> dict:
        state = self.policy.model.module.state_dict()
        return {name: value.detach().to("cpu", copy=True) if hasattr(value, "detach") else value for name, value in state.items()}
