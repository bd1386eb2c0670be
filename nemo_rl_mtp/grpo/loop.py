"""GRPO with the MTP heads training alongside the policy.

Each step: prompts -> n samples per prompt from the current policy -> rewards from the
environment -> group-normalised advantages -> previous (and reference) logprobs -> optimizer
step(s) on the clipped policy-gradient loss plus the MTP loss. Generation runs on the policy
workers themselves, so it always samples from the newest weights.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf, read_write

from nemo_rl_mtp.training.losses import ClippedPGLossFn, k3_kl, loss_sample_weights
from nemo_rl_mtp.tasks.demonstrations import prompt_demonstrations, warmup_tasks
from nemo_rl_mtp.tasks.interfaces import PromptSource, TaskPrompt
from nemo_rl_mtp.tasks.tokenizer import load_tokenizer
from nemo_rl_mtp.tasks import setup_task
from nemo_rl_mtp.tasks.environment_interface import EnvironmentInterface
from nemo_rl_mtp.rollout.speculation import speculation_metrics
from nemo_rl_mtp.grpo.run import PARTIAL_SUFFIX, CheckpointDirectory
from nemo_rl_mtp.config.load import ConfigError, load_exemplar, resolve_checkpoint_keys
from nemo_rl_mtp.config.schema import GRPOConfig, LoggerConfig, MasterConfig
from nemo_rl_mtp.reporting.logger import Logger, read_metrics

logger = logging.getLogger(__name__)


def group_advantages(rewards: torch.Tensor, group_size: int, normalize: bool) -> torch.Tensor:
    """Reward minus its group's mean, divided by the group's std when ``normalize`` (groups are
    consecutive runs of ``group_size`` samples of one prompt)."""
    grouped = rewards.view(-1, group_size)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize:
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + 1e-6)
    return advantages.reshape(-1)


def build_train_batch(generation: dict[str, torch.Tensor], advantages: torch.Tensor, token_level_loss: bool) -> dict[str, torch.Tensor]:
    """The policy's training inputs: response tokens (with the end-of-sequence token) are trained,
    each sample weighted for a token- or sequence-level loss (``loss_sample_weights``)."""
    tokens, lengths, prompt_lengths = generation["tokens"], generation["lengths"], generation["prompt_lengths"]
    positions = torch.arange(tokens.shape[1])[None, :]
    token_mask = ((positions >= prompt_lengths[:, None]) & (positions < lengths[:, None])).float()
    return {
        "input_ids": tokens,
        "input_lengths": lengths,
        "token_mask": token_mask,
        "sample_mask": loss_sample_weights(token_mask, torch.ones(tokens.shape[0]), token_level_loss),
        "advantages": advantages[:, None].expand_as(token_mask).contiguous(),
    }


def with_run_name(cfg: MasterConfig) -> MasterConfig:
    """``cfg`` with ``logger.run_name`` filled in (grpo-<date>-<time> when null), so that the
    saved config.yaml, the resume hint and a resumed run all name the same directory. The name is
    claimed by creating its directory: runs started in the same second (two default runs side by
    side) get grpo-<date>-<time>-2, -3, ... instead of writing into one directory."""
    if cfg.logger.run_name is not None:
        return cfg
    named = copy.deepcopy(cfg)
    with read_write(named):
        named.logger.run_name = claim_run_name(Path(cfg.logger.log_dir), datetime.now().strftime("grpo-%Y%m%d-%H%M%S"))
    return named


def claim_run_name(log_dir: Path, stem: str) -> str:
    """The first of ``stem``, ``stem-2``, ``stem-3``, ... whose directory under ``log_dir`` this
    call creates (atomic: another process's claim of the same name fails). ``stem`` unclaimed
    where ``log_dir`` is not writable, which the preflight checks report."""
    attempt = 1
    while True:
        name = stem if attempt == 1 else f"{stem}-{attempt}"
        try:
            (log_dir / name).mkdir(parents=True)
            return name
        except FileExistsError:
            attempt += 1
        except OSError:
            return stem


def run_directory(logger_cfg: LoggerConfig) -> Path:
    return Path(logger_cfg.log_dir) / logger_cfg.run_name


def resolve_model(cfg: MasterConfig) -> MasterConfig:
    """``cfg`` with what an imported checkpoint (``policy.model_name``) decides: its architecture
    keys and MTP layer count; raises ConfigError where the checkpoint cannot be used as configured.
    Opens the checkpoint's config only (megatron-bridge, about 15 s), before any worker starts."""
    if cfg.policy.model_name is None:
        return cfg
    from nemo_rl_mtp.training import hf_checkpoint

    try:
        facts = hf_checkpoint.checkpoint_facts(
            hf_checkpoint.open_checkpoint(cfg.policy.model_name, cfg.policy.trust_remote_code), cfg.policy.model_name
        )
    except hf_checkpoint.CheckpointError as error:
        raise ConfigError(str(error)) from None
    if facts.multi_latent_attention and workers_transformer_impl(cfg) == "local":
        raise ConfigError(
            f"policy.model_name={cfg.policy.model_name}: {facts.architecture} uses multi-latent attention, which "
            "megatron-core builds only with transformer_engine (a GPU)"
        )
    resolved = resolve_checkpoint_keys(cfg, facts)
    logger.info(
        "model: %s (%s) through megatron-bridge, %d MTP layer(s)%s", cfg.policy.model_name, facts.architecture,
        resolved.policy.megatron_cfg.mtp_num_layers, " with weights" if facts.mtp_num_layers else " (new)",
    )  # fmt: skip
    return resolved


def workers_transformer_impl(cfg: MasterConfig) -> Optional[str]:
    """The layer spec the workers will build, where the driver can tell: the configured one; for
    ``auto``, this machine's resolution when the workers run here (no ``cluster.address``), local
    for CPU workers on a cluster. None: ``auto`` on a cluster's GPU workers, decided on each node
    (whether transformer_engine imports there), which the driver may not share."""
    from nemo_rl_mtp.training.model import resolve_transformer_impl

    requested = cfg.policy.megatron_cfg.transformer_impl
    if requested != "auto":
        return requested
    if cfg.cluster.address is None:
        return resolve_transformer_impl(requested)
    return None if cfg.cluster.gpus_per_worker else "local"


def preflight_checks(cfg: MasterConfig) -> None:
    """What the config needs from this machine, checked before any worker starts; raises
    ConfigError."""
    import importlib.util

    cluster = cfg.cluster
    if cluster.gpus_per_worker and cluster.address is None:
        import torch

        needed = cluster.num_nodes * cluster.workers_per_node * cluster.gpus_per_worker
        if torch.cuda.device_count() < needed:
            raise ConfigError(
                f"cluster.gpus_per_worker={cluster.gpus_per_worker}: this is a GPU recipe for {needed} GPU(s), "
                f"and this machine has {torch.cuda.device_count()}; run it on a GPU node, or join a GPU "
                "cluster with cluster.address"
            )
    _check_local_cpus(cluster)
    _check_log_dir_writable(cfg.logger.log_dir)
    if cfg.policy.megatron_cfg.transformer_impl == "transformer_engine" and importlib.util.find_spec("transformer_engine") is None:
        raise ConfigError(
            "policy.megatron_cfg.transformer_impl=transformer_engine, but transformer_engine is not installed "
            "(it needs CUDA); install it on the GPU nodes or use transformer_impl=auto"
        )
    # What the config asks of the installed megatron-core was checked with the config
    # (config/load.py, _check_installed_release).


def _check_local_cpus(cluster) -> None:
    """Without cluster.address the workers run here: refuse what this machine cannot place,
    rather than letting Ray wait for resources that never come."""
    if cluster.address is not None:
        return
    if cluster.num_nodes > 1:
        raise ConfigError(f"cluster.num_nodes={cluster.num_nodes}: several nodes need cluster.address (a running Ray cluster)")
    needed = cluster.workers_per_node * cluster.cpus_per_worker
    available = os.cpu_count() or 1
    if needed > available:
        raise ConfigError(
            f"cluster.workers_per_node={cluster.workers_per_node}: needs {needed} CPUs (x cluster.cpus_per_worker="
            f"{cluster.cpus_per_worker}), this machine has {available}"
        )


def _check_log_dir_writable(log_dir: str) -> None:
    try:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=log_dir):
            pass
    except OSError as error:
        raise ConfigError(f"logger.log_dir={log_dir}: not writable ({error.strerror or error})") from None


def grpo_train(cfg: MasterConfig, overwrite: bool = False) -> list[dict[str, float]]:
    """Run GRPO as configured, resuming from the run directory's latest complete checkpoint if it
    has one; returns the logged metrics of every step (earlier ones read back on a resume).
    ``overwrite`` replaces an existing run directory instead of refusing it."""
    from nemo_rl_mtp.cluster.policy import Policy

    cfg = resolve_model(with_run_name(cfg))
    preflight_checks(cfg)
    run_dir = run_directory(cfg.logger)
    checkpoints = checkpoint_directory(cfg, run_dir)
    resume_from = prepare_run_directory(run_dir, checkpoints, overwrite)
    if resume_from is not None:
        check_resumable_config(run_dir / "config.yaml", cfg)
    try:
        tokenizer = load_tokenizer(cfg.policy.model_name, cfg.policy.trust_remote_code, cfg.data.apply_chat_template)
    except ValueError as error:
        raise ConfigError(f"policy.model_name={cfg.policy.model_name}: {error}") from None
    prompts, env = setup_task(cfg, tokenizer)
    loss_fn = ClippedPGLossFn(
        ratio_clip_min=cfg.loss_fn.ratio_clip_min,
        ratio_clip_max=cfg.loss_fn.ratio_clip_max,
        reference_policy_kl_penalty=cfg.loss_fn.reference_policy_kl_penalty,
    )
    trainer_state = {"steps_done": 0, "wandb_run_id": None}
    if resume_from is not None:
        trainer_state = torch.load(resume_from / TRAINER_STATE, weights_only=False)
        prompts.load_state_dict(_prompt_source_state(trainer_state))
        logger.info("resuming %s from %s (%d steps done)", run_dir, resume_from, trainer_state["steps_done"])
    policy = Policy(cfg, tokenizer.vocab_size)
    log = None
    try:
        if resume_from is not None:
            policy.load_checkpoint(resume_from)
        warmup = warm_up(cfg, policy, prompts, tokenizer.pad_id) if resume_from is None else {}
        if cfg.grpo.log_kl_to_start_of_rl:
            keep_start_of_rl_policy(cfg, policy, checkpoints, resumed=resume_from is not None)
        log = Logger(cfg.logger, run_dir, cfg, cfg.grpo.max_num_steps, trainer_state["steps_done"], trainer_state["wandb_run_id"])
        for step in range(trainer_state["steps_done"], cfg.grpo.max_num_steps):
            metrics = grpo_step(cfg, step, policy, prompts, env, tokenizer, loss_fn)
            if _validation_due(cfg.grpo, step):
                metrics.update(validate(policy, prompts, env, tokenizer))
            log.log({**warmup, **metrics} if step == 0 else metrics, step)
            if _checkpoint_due(cfg.checkpointing, step + 1, cfg.grpo.max_num_steps):
                save_checkpoint(checkpoints, step + 1, policy, prompts, log)
        if cfg.grpo.max_num_steps == trainer_state["steps_done"] == 0:  # validation only: the imported model, saved
            metrics = validate(policy, prompts, env, tokenizer)
            log.log({**warmup, **metrics}, 0)
            if cfg.checkpointing.enabled:
                save_checkpoint(checkpoints, 0, policy, prompts, log)
    finally:
        if log is not None:
            log.close()
        env.close()
        policy.shutdown()
    logger.info("run logged to %s", run_dir)
    return read_metrics(run_dir / "metrics.jsonl")


TRAINER_STATE = "trainer_state.pt"
START_OF_RL = "start_of_rl"


def keep_start_of_rl_policy(cfg: MasterConfig, policy, checkpoints: CheckpointDirectory, resumed: bool) -> None:
    """The policy GRPO starts from, for ``train/kl_to_start``: kept by the workers, and saved
    once next to the checkpoints (written as ``.partial``, renamed when complete), from where a
    resumed run reads it back."""
    directory = checkpoints.root / START_OF_RL
    if resumed:
        if not directory.is_dir():
            raise ConfigError(f"grpo.log_kl_to_start_of_rl=true: {directory} is missing, so the policy this run started from is unknown")
        policy.load_start_of_rl_weights(directory)
        return
    if not cfg.checkpointing.enabled:
        policy.keep_start_of_rl_weights(None)
        return
    partial = directory.with_name(directory.name + PARTIAL_SUFFIX)
    for stale in (partial, directory):
        if stale.exists():
            shutil.rmtree(stale)
    policy.keep_start_of_rl_weights(partial)
    os.rename(partial, directory)


def _prompt_source_state(trainer_state: dict) -> dict:
    """The prompt order's state; runs saved before prompt sources existed kept the digit tasks'
    generator state under ``prompt_generator``."""
    if "prompt_source" in trainer_state:
        return trainer_state["prompt_source"]
    return {"generator": trainer_state["prompt_generator"]}


def checkpoint_directory(cfg: MasterConfig, run_dir: Path) -> CheckpointDirectory:
    """``checkpointing.checkpoint_dir``, or ``<run_dir>/checkpoints`` when it is null."""
    root = Path(cfg.checkpointing.checkpoint_dir) if cfg.checkpointing.checkpoint_dir else run_dir / "checkpoints"
    return CheckpointDirectory(root, cfg.checkpointing.keep_last)


def latest_checkpoint(cfg: MasterConfig) -> Optional[Path]:
    """The newest complete checkpoint of the run ``cfg`` names (run name filled in), if any."""
    return checkpoint_directory(cfg, run_directory(cfg.logger)).latest()


def prepare_run_directory(run_dir: Path, checkpoints: CheckpointDirectory, overwrite: bool) -> Optional[Path]:
    """The checkpoint to resume from, or None for a new run. A run directory holding an earlier
    run is resumed when it has a complete checkpoint, replaced with ``overwrite``, else refused:
    two runs never write into one directory."""
    if overwrite:
        for directory in (run_dir, checkpoints.root):
            if directory.exists():
                shutil.rmtree(directory)
        return None
    latest = checkpoints.latest()
    if latest is not None:
        return latest
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(
            f"logger.run_name={run_dir.name}: {run_dir} holds an earlier run with no complete checkpoint to resume "
            "from; choose another logger.run_name, or pass --overwrite to replace it"
        )
    return None


# What a resumed run may change: its length, where and how it runs and logs, and the parallel
# layout (checkpoints are sharded). Any other change would continue a different run.
RESUMABLE_CHANGES = (
    "grpo.max_num_steps",
    "cluster.",
    "logger.",
    "checkpointing.",
    "policy.generation.engine.",
    # Speculation is lossless: it changes how fast rollouts come, not what they are.
    "policy.generation.num_speculative_tokens",
    "policy.generation.spec_verification",
    "policy.generation.draft_context",
    "policy.train_micro_batch_size",
    "policy.megatron_cfg.tensor_model_parallel_size",
    "policy.megatron_cfg.pipeline_model_parallel_size",
    "policy.megatron_cfg.context_parallel_size",
    "policy.megatron_cfg.sequence_parallel",
    "policy.megatron_cfg.recompute_",
)


def check_resumable_config(saved_config: Path, cfg: MasterConfig) -> None:
    """Refuse to resume a run with settings it was not started with (other than
    ``RESUMABLE_CHANGES``), naming each key with its saved and its new value. A key the saved
    config lacks (added by a later version) counts as its exemplar default, the behaviour the run
    had before the key existed."""
    if not saved_config.is_file():
        return
    saved = {**_leaves(load_exemplar()), **_leaves(OmegaConf.load(saved_config))}
    now = _leaves(cfg)
    changed = [
        f"{key}: {saved.get(key)!r} -> {now.get(key)!r}"
        for key in sorted(saved.keys() | now.keys())
        if saved.get(key) != now.get(key) and not key.startswith(RESUMABLE_CHANGES)
    ]
    if changed:
        raise ConfigError(
            f"logger.run_name={cfg.logger.run_name}: resuming with settings the run did not start with "
            f"({'; '.join(changed)}); resume with its saved {saved_config}, choose another logger.run_name, "
            "or pass --overwrite to start afresh"
        )


def _leaves(config) -> dict:
    """Dotted key -> value of every leaf of a config."""
    def walk(node, prefix):
        if isinstance(node, dict):
            for key, value in node.items():
                yield from walk(value, f"{prefix}{key}.")
        else:
            yield prefix[:-1], node

    return dict(walk(OmegaConf.to_container(config, resolve=True), ""))


def warm_up(cfg: MasterConfig, policy, prompts: PromptSource, pad_id: int) -> dict[str, float]:
    """``grpo.warmup_imitation_steps`` imitation steps, each on the correct answers to one global
    batch of training prompts (a ``grpo.warmup_distractor_fraction`` of them answering
    ``grpo.warmup_distractor_task`` instead); the last step's metrics as ``warmup/...``."""
    metrics, start = {}, time.perf_counter()
    grpo = cfg.grpo
    for _ in range(grpo.warmup_imitation_steps):
        batch_prompts = prompts.next_prompts(cfg.policy.train_global_batch_size)
        if grpo.warmup_distractor_task is not None:  # a digit task's (validated)
            tasks = warmup_tasks(cfg.env.task, grpo.warmup_distractor_task, grpo.warmup_distractor_fraction, len(batch_prompts), prompts.generator)
            batch_prompts = [prompts.answered_as(prompt, task) for prompt, task in zip(batch_prompts, tasks)]
        metrics = policy.imitate(prompt_demonstrations(batch_prompts, pad_id), grpo.warmup_lr)
    if not metrics:
        return {}
    acceptance = metrics.get("mtp/mtp_1_acceptance_rate")
    logger.info(
        "warm start: %d imitation steps in %.0f s; loss %.3f%s", cfg.grpo.warmup_imitation_steps,
        time.perf_counter() - start, metrics["loss"], "" if acceptance is None else f", MTP depth-1 acceptance {acceptance:.0f}%",
    )  # fmt: skip
    return {f"warmup/{key}": value for key, value in metrics.items()}


def _validation_due(grpo_cfg: GRPOConfig, step: int) -> bool:
    return step == 0 or (step + 1) % grpo_cfg.val_period == 0 or step + 1 == grpo_cfg.max_num_steps


def validate(policy, prompts: PromptSource, env: EnvironmentInterface, tokenizer) -> dict[str, float]:
    """Greedy rollouts on the held-out prompts, judged by the environment (``val/reward``,
    ``val/accuracy``: answers exactly right, and the environment's own metrics) and, with
    speculation, the drafts' acceptance as ``val/draft_{i}_...`` and ``val/tokens_per_decode_step``."""
    held_out = prompts.validation_prompts
    generation = policy.generate([prompt.prompt_ids for prompt in held_out], tokenizer.eos_id, tokenizer.pad_id, seed=0, greedy=True)
    result = env.step(held_out, responses_of(generation))
    metrics = {f"val/{key}": value for key, value in env.metrics(result).items()}
    metrics.update({f"val/{key.removeprefix('rollout/')}": value for key, value in speculation_metrics(generation).items()})
    return metrics


def responses_of(generation: dict[str, torch.Tensor]) -> list[list[int]]:
    """Each rollout's response tokens (after its prompt, up to its length)."""
    tokens, starts, ends = generation["tokens"], generation["prompt_lengths"], generation["lengths"]
    return [tokens[row, starts[row] : ends[row]].tolist() for row in range(tokens.shape[0])]


def _checkpoint_due(checkpointing_cfg, steps_done: int, max_num_steps: int) -> bool:
    return checkpointing_cfg.enabled and (steps_done % checkpointing_cfg.save_period == 0 or steps_done == max_num_steps)


def save_checkpoint(checkpoints: CheckpointDirectory, steps_done: int, policy, prompts: PromptSource, log) -> Path:
    """Policy shards (every worker) and the driver's state; complete only when all are written."""

    def write(directory: Path) -> None:
        policy.save_checkpoint(directory)
        state = {"steps_done": steps_done, "prompt_source": prompts.state_dict(), "wandb_run_id": log.wandb_run_id}
        torch.save(state, directory / TRAINER_STATE)

    path = checkpoints.save(steps_done, write)
    logger.info("checkpoint %s", path)
    return path


def kl_on_tokens(logprobs: torch.Tensor, other_logprobs: torch.Tensor, token_mask: torch.Tensor) -> float:
    """KL(policy || other) estimated on tokens the policy sampled: the mean over the masked tokens
    of Schulman's k3, exp(r) - r - 1 with r = other - policy logprob (unbiased, never negative)."""
    return float((k3_kl(logprobs, other_logprobs) * token_mask).sum() / token_mask.sum().clamp(min=1))


def grpo_step(cfg: MasterConfig, step: int, policy, prompts: PromptSource, env: EnvironmentInterface, tokenizer, loss_fn) -> dict[str, float]:
    grpo = cfg.grpo
    group_size = grpo.num_generations_per_prompt
    timings = {}
    start = time.perf_counter()

    samples: list[TaskPrompt] = [prompt for prompt in prompts.next_prompts(grpo.num_prompts_per_step) for _ in range(group_size)]
    generation = policy.generate([sample.prompt_ids for sample in samples], tokenizer.eos_id, tokenizer.pad_id, seed=grpo.seed * 100_003 + step)
    timings["generation_s"] = time.perf_counter() - start

    judged = env.step(samples, responses_of(generation))
    rewards = judged.rewards
    advantages = group_advantages(rewards, group_size, grpo.normalize_rewards)
    batch = build_train_batch(generation, advantages, cfg.loss_fn.token_level_loss)

    logprobs_start = time.perf_counter()
    batch["prev_logprobs"] = policy.get_logprobs(batch)
    if cfg.loss_fn.reference_policy_kl_penalty > 0:
        batch["reference_logprobs"] = policy.get_reference_logprobs(batch)
    kl_to_start = {}
    if grpo.log_kl_to_start_of_rl:
        kl_to_start["train/kl_to_start"] = kl_on_tokens(batch["prev_logprobs"], policy.get_start_of_rl_logprobs(batch), batch["token_mask"])
    timings["logprobs_s"] = time.perf_counter() - logprobs_start

    train_start = time.perf_counter()
    train_metrics = []
    global_batch_size = cfg.policy.train_global_batch_size
    for first in range(0, len(samples), global_batch_size):
        minibatch = {key: value[first : first + global_batch_size] for key, value in batch.items()}
        train_metrics.append(policy.train(minibatch, loss_fn))
    timings["train_s"] = time.perf_counter() - train_start
    timings["step_s"] = time.perf_counter() - start

    response_tokens = batch["token_mask"].sum()
    metrics = {f"train/{key}": value for key, value in env.metrics(judged).items()}
    metrics.update(prompts.counters())
    metrics.update({
        "train/response_length": (response_tokens / len(samples)).item(),
        "rollout/tokens_per_s": (response_tokens / timings["generation_s"]).item(),
        "rollout/decode_steps": float(generation["decode_steps"]),
        # Generation and training compute a token's logprob in different passes; they must agree.
        "train/generation_logprob_error": (
            ((generation["logprobs"] - batch["prev_logprobs"]).abs() * batch["token_mask"]).sum() / response_tokens
        ).item(),
    })
    for key in train_metrics[0]:
        metrics[f"train/{key}"] = sum(m[key] for m in train_metrics) / len(train_metrics)
    metrics["train/optimizer_steps"] = float(len(train_metrics))
    metrics.update(kl_to_start)
    metrics.update(speculation_metrics(generation))
    metrics.update({f"timing/{key}": value for key, value in timings.items()})
    return metrics
