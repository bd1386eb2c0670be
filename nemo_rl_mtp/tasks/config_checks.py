"""Each task's own rules on the config (``env.*``, ``data.*`` and what the task implies for the
rest), kept with the tasks rather than in the generic checks of ``config.checks``.

Pure like those: this module imports only ``config`` (no torch, no tokenizer, no file), so the
command line still refuses a bad config in about a second. ``grpo.checked_config`` runs it after
``config.load`` and before the installed release is asked anything.
"""

from __future__ import annotations

from omegaconf import DictConfig

from nemo_rl_mtp.config.checks import check_mtp_depth, require

# A digit prompt's tokens besides its digits: <bos> before them, "=" after.
DIGIT_PROMPT_EXTRA_TOKENS = 2


def check_task_config(cfg: DictConfig) -> None:
    """The environment ``env.name`` selects: where its prompts come from, the tokenizer it needs,
    and the task's own limits."""
    if cfg.env.name == "digits":
        _check_digit_task(cfg)
    else:
        _check_text_task(cfg)


def _check_digit_task(cfg: DictConfig) -> None:
    """The digit tasks make their own prompts from env.min_digits..max_digits; with the model built
    from scratch their short sequences bound how deep an MTP layer can still get a target."""
    env, data, grpo, policy = cfg.env, cfg.data, cfg.grpo, cfg.policy
    for key in ("train_data_path", "val_data_path"):
        require(data[key] is None, f"data.{key}", data[key], "the digits environment makes its own prompts; leave it unset")
    require(env.min_digits <= env.max_digits, "env.min_digits", env.min_digits, f"must be <= env.max_digits={env.max_digits}")
    prompt_space = sum(10**length for length in range(env.min_digits, env.max_digits + 1))
    require(
        grpo.val_num_prompts <= prompt_space // 4,
        "grpo.val_num_prompts",
        grpo.val_num_prompts,
        f"must hold out at most a quarter of the task's {prompt_space} prompts (env.min_digits..max_digits)",
    )
    require(
        grpo.warmup_distractor_task != env.task,
        "grpo.warmup_distractor_task",
        grpo.warmup_distractor_task,
        f"must differ from env.task={env.task!r}",
    )
    if policy.megatron_cfg.mtp_num_layers is None:  # from the checkpoint: checked again once resolved
        return
    if policy.model_name is not None:  # a checkpoint's tokenizer: prompt lengths are its own
        check_mtp_depth(policy.megatron_cfg.mtp_num_layers, policy.max_total_sequence_length)
        return
    longest_prompt = env.max_digits + DIGIT_PROMPT_EXTRA_TOKENS
    max_new_tokens = policy.generation.max_new_tokens
    require(
        longest_prompt + max_new_tokens <= policy.max_total_sequence_length,
        "policy.max_total_sequence_length",
        policy.max_total_sequence_length,
        f"too short for the longest prompt ({longest_prompt} tokens) plus max_new_tokens={max_new_tokens}",
    )
    check_mtp_depth(policy.megatron_cfg.mtp_num_layers, longest_prompt + max_new_tokens)


def _check_text_task(cfg: DictConfig) -> None:
    """Environments that judge text read their prompts from JSONL files and need a checkpoint's
    tokenizer; the digit-task distractors have no place among them."""
    env, data, grpo = cfg.env, cfg.data, cfg.grpo
    require(
        grpo.warmup_distractor_task is None,
        "grpo.warmup_distractor_task",
        grpo.warmup_distractor_task,
        f"distractor demonstrations are digit tasks' answers; env.name={env.name} has none",
    )
    require(
        cfg.policy.model_name is not None,
        "env.name",
        env.name,
        "judges text, which needs a tokenizer: set policy.model_name to a Hugging Face checkpoint",
    )
    for key in ("train_data_path", "val_data_path"):
        require(data[key] is not None, f"data.{key}", data[key], f"env.name={env.name} takes its prompts from JSONL files; set it")
    if cfg.policy.megatron_cfg.mtp_num_layers is not None:  # None: from the checkpoint, checked once resolved
        check_mtp_depth(cfg.policy.megatron_cfg.mtp_num_layers, cfg.policy.max_total_sequence_length)
