"""GRPO with the MTP heads training alongside the policy.

Each step: prompts -> n samples per prompt from the current policy -> rewards from the
environment -> group-normalised advantages -> previous (and reference) logprobs -> optimizer
step(s) on the clipped policy-gradient loss plus the MTP loss. Generation runs on the policy
workers themselves, so it always samples from the newest weights.

``grpo_train`` is the whole run: read it first. Everything around the algorithm (run directory,
model resolution, preflight, checkpoints, resume) is in :mod:`nemo_rl_mtp.grpo.run`.
"""

from __future__ import annotations

import logging
import time

import torch

from nemo_rl_mtp.config.load import ConfigError
from nemo_rl_mtp.config.schema import GRPOConfig, MasterConfig
from nemo_rl_mtp.grpo.run import (
    checkpoint_due,
    keep_start_of_rl_policy,
    prepare_run,
    restore_prompt_order,
    run_named,
    save_checkpoint,
)
from nemo_rl_mtp.reporting.logger import Logger, read_metrics
from nemo_rl_mtp.rollout.speculation import speculation_metrics
from nemo_rl_mtp.tasks import setup_task
from nemo_rl_mtp.tasks.demonstrations import prompt_demonstrations
from nemo_rl_mtp.tasks.interfaces import EnvironmentInterface
from nemo_rl_mtp.tasks.interfaces import PromptSource, TaskPrompt
from nemo_rl_mtp.tasks.tokenizer import load_tokenizer
from nemo_rl_mtp.training.losses import ClippedPGLossFn, k3_kl, loss_sample_weights
from nemo_rl_mtp.metrics import (
    DECODE_STEPS,
    GENERATION_LOGPROB_ERROR,
    GENERATION_SECONDS,
    KL_TO_START,
    LENGTHS,
    LOGPROBS,
    LOGPROBS_SECONDS,
    LOSS,
    MTP,
    MTP_ACCEPTANCE_RATE,
    OPTIMIZER_STEPS,
    PROMPT_LENGTHS,
    RESPONSE_LENGTH,
    ROLLOUT,
    STEP_SECONDS,
    TIMING,
    TOKENS,
    TOKENS_PER_S,
    TRAIN,
    TRAIN_SECONDS,
    VALIDATION,
    WARMUP,
    all_in_scope,
    in_scope,
    moved_to_scope,
)

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
    tokens, lengths, prompt_lengths = generation[TOKENS], generation[LENGTHS], generation[PROMPT_LENGTHS]
    positions = torch.arange(tokens.shape[1])[None, :]
    token_mask = ((positions >= prompt_lengths[:, None]) & (positions < lengths[:, None])).float()
    return {
        "input_ids": tokens,
        "input_lengths": lengths,
        "token_mask": token_mask,
        "sample_mask": loss_sample_weights(token_mask, torch.ones(tokens.shape[0]), token_level_loss),
        "advantages": advantages[:, None].expand_as(token_mask).contiguous(),
    }


    # What the config asks of the installed megatron-core was checked with the config
    # (grpo/checked_config.py: megatron_compat.capabilities.check_installed_release).


def grpo_train(cfg: MasterConfig, overwrite: bool = False) -> list[dict[str, float]]:
    """Run GRPO as configured, resuming from the run directory's latest complete checkpoint if it
    has one; returns the logged metrics of every step (earlier ones read back on a resume).
    ``overwrite`` replaces an existing run directory instead of refusing it. A run name claimed
    here is given back if the run fails before writing anything (``run.run_named``)."""
    with run_named(cfg) as named:
        return _train(named, overwrite)


def _train(cfg: MasterConfig, overwrite: bool) -> list[dict[str, float]]:
    from nemo_rl_mtp.cluster.policy import Policy

    run = prepare_run(cfg, overwrite)  # name, model, this machine, run directory, resume point
    cfg = run.cfg
    tokenizer = task_tokenizer(cfg)
    prompts, env = setup_task(cfg, tokenizer)
    restore_prompt_order(run, prompts)
    loss_fn = ClippedPGLossFn.from_config(cfg.loss_fn)
    policy = Policy(cfg, tokenizer.vocab_size)
    log = None
    try:
        if run.resume_from is not None:
            policy.load_checkpoint(run.resume_from)
        warmup = warm_up(cfg, policy, prompts, tokenizer.pad_id) if run.resume_from is None else {}
        if cfg.grpo.log_kl_to_start_of_rl:
            keep_start_of_rl_policy(cfg, policy, run.checkpoints, resumed=run.resume_from is not None)
        log = Logger(cfg.logger, run.directory, cfg, cfg.grpo.max_num_steps, run.steps_done, run.trainer_state["wandb_run_id"])
        for step in range(run.steps_done, cfg.grpo.max_num_steps):
            metrics = grpo_step(cfg, step, policy, prompts, env, tokenizer, loss_fn)
            if _validation_due(cfg.grpo, step):
                metrics.update(validate(policy, prompts, env, tokenizer))
            log.log({**warmup, **metrics} if step == 0 else metrics, step)
            if checkpoint_due(cfg.checkpointing, step + 1, cfg.grpo.max_num_steps):
                save_checkpoint(run.checkpoints, step + 1, policy, prompts, log)
        if cfg.grpo.max_num_steps == run.steps_done == 0:  # validation only: the imported model, saved
            log.log({**warmup, **validate(policy, prompts, env, tokenizer)}, 0)
            if cfg.checkpointing.enabled:
                save_checkpoint(run.checkpoints, 0, policy, prompts, log)
    finally:
        if log is not None:
            log.close()
        env.close()
        policy.shutdown()
    logger.info("run logged to %s", run.directory)
    return read_metrics(run.directory / "metrics.jsonl")


def task_tokenizer(cfg: MasterConfig):
    """The tokenizer of the run's model (its checkpoint's) or the digit tasks' own."""
    try:
        return load_tokenizer(cfg.policy.model_name, cfg.policy.trust_remote_code, cfg.data.apply_chat_template)
    except ValueError as error:
        raise ConfigError(f"policy.model_name={cfg.policy.model_name}: {error}") from None


def warm_up(cfg: MasterConfig, policy, prompts: PromptSource, pad_id: int) -> dict[str, float]:
    """``grpo.warmup_imitation_steps`` imitation steps, each on the correct answers to one global
    batch of training prompts (a ``grpo.warmup_distractor_fraction`` of them answering
    ``grpo.warmup_distractor_task`` instead); the last step's metrics as ``warmup/...``."""
    metrics, start = {}, time.perf_counter()
    grpo = cfg.grpo
    for _ in range(grpo.warmup_imitation_steps):
        batch_prompts = prompts.warmup_prompts(cfg.policy.train_global_batch_size, grpo.warmup_distractor_task, grpo.warmup_distractor_fraction)
        metrics = policy.imitate(prompt_demonstrations(batch_prompts, pad_id), grpo.warmup_lr)
    if not metrics:
        return {}
    acceptance = metrics.get(MTP_ACCEPTANCE_RATE.under(MTP).key(1))
    logger.info(
        "warm start: %d imitation steps in %.0f s; loss %.3f%s", cfg.grpo.warmup_imitation_steps,
        time.perf_counter() - start, metrics[LOSS], "" if acceptance is None else f", MTP depth-1 acceptance {acceptance:.0f}%",
    )  # fmt: skip
    return all_in_scope(WARMUP, metrics)


def _validation_due(grpo_cfg: GRPOConfig, step: int) -> bool:
    return step == 0 or (step + 1) % grpo_cfg.val_period == 0 or step + 1 == grpo_cfg.max_num_steps


def validate(policy, prompts: PromptSource, env: EnvironmentInterface, tokenizer) -> dict[str, float]:
    """Greedy rollouts on the held-out prompts, judged by the environment (``val/reward``,
    ``val/accuracy``: answers exactly right, and the environment's own metrics) and, with
    speculation, the drafts' acceptance as ``val/draft_{i}_...`` and ``val/tokens_per_decode_step``."""
    held_out = prompts.validation_prompts
    generation = policy.generate([prompt.prompt_ids for prompt in held_out], tokenizer.eos_id, tokenizer.pad_id, seed=0, greedy=True)
    result = env.step(held_out, responses_of(generation))
    metrics = all_in_scope(VALIDATION, env.metrics(result))
    metrics.update({moved_to_scope(key, ROLLOUT, VALIDATION): value for key, value in speculation_metrics(generation).items()})
    return metrics


def responses_of(generation: dict[str, torch.Tensor]) -> list[list[int]]:
    """Each rollout's response tokens (after its prompt, up to its length)."""
    tokens, starts, ends = generation[TOKENS], generation[PROMPT_LENGTHS], generation[LENGTHS]
    return [tokens[row, starts[row] : ends[row]].tolist() for row in range(tokens.shape[0])]


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
    timings[GENERATION_SECONDS] = time.perf_counter() - start

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
        kl_to_start[in_scope(TRAIN, KL_TO_START)] = kl_on_tokens(batch["prev_logprobs"], policy.get_start_of_rl_logprobs(batch), batch["token_mask"])
    timings[LOGPROBS_SECONDS] = time.perf_counter() - logprobs_start

    train_start = time.perf_counter()
    train_metrics = []
    global_batch_size = cfg.policy.train_global_batch_size
    for first in range(0, len(samples), global_batch_size):
        minibatch = {key: value[first : first + global_batch_size] for key, value in batch.items()}
        train_metrics.append(policy.train(minibatch, loss_fn))
    timings[TRAIN_SECONDS] = time.perf_counter() - train_start
    timings[STEP_SECONDS] = time.perf_counter() - start

    response_tokens = batch["token_mask"].sum()
    metrics = all_in_scope(TRAIN, env.metrics(judged))
    metrics.update(prompts.counters())
    metrics.update({
        in_scope(TRAIN, RESPONSE_LENGTH): (response_tokens / len(samples)).item(),
        in_scope(ROLLOUT, TOKENS_PER_S): (response_tokens / timings[GENERATION_SECONDS]).item(),
        in_scope(ROLLOUT, DECODE_STEPS): float(generation[DECODE_STEPS]),
        # Generation and training compute a token's logprob in different passes; they must agree.
        in_scope(TRAIN, GENERATION_LOGPROB_ERROR): (
            ((generation[LOGPROBS] - batch["prev_logprobs"]).abs() * batch["token_mask"]).sum() / response_tokens
        ).item(),
    })
    mean_over_optimizer_steps = {key: sum(m[key] for m in train_metrics) / len(train_metrics) for key in train_metrics[0]}
    metrics.update(all_in_scope(TRAIN, mean_over_optimizer_steps))
    metrics[in_scope(TRAIN, OPTIMIZER_STEPS)] = float(len(train_metrics))
    metrics.update(kl_to_start)
    metrics.update(speculation_metrics(generation))
    metrics.update(all_in_scope(TIMING, timings))
    return metrics
