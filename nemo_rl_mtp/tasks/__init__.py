"""Environments (judges of responses) by ``env.name``, and the prompts a run trains on."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # annotations only: the package stays torch-free to import (tasks.config_checks)
    from nemo_rl_mtp.tasks.interfaces import EnvironmentInterface, PromptSource


def _digits(env_cfg, tokenizer) -> EnvironmentInterface:
    from nemo_rl_mtp.tasks.digit_tasks import DigitTaskEnvironment

    return DigitTaskEnvironment(env_cfg, tokenizer)


def _math(env_cfg, tokenizer) -> EnvironmentInterface:
    from nemo_rl_mtp.tasks.math_environment import MathEnvironment

    return MathEnvironment(env_cfg.math, tokenizer)


# env.name -> the environment built from the env config and the policy's tokenizer.
ENVIRONMENTS: dict[str, Callable] = {"digits": _digits, "math": _math}


def setup_task(cfg, tokenizer) -> tuple[PromptSource, EnvironmentInterface]:
    """The environment ``env.name`` selects, and the prompts: the digit tasks make their own,
    other environments read ``data.*_data_path``. Files are checked here, before any worker
    starts."""
    env = ENVIRONMENTS[cfg.env.name](cfg.env, tokenizer)
    max_prompt_tokens = cfg.policy.max_total_sequence_length - cfg.policy.generation.max_new_tokens
    if cfg.env.name == "digits":
        from nemo_rl_mtp.tasks.digit_tasks import DigitTaskPrompts

        return DigitTaskPrompts(cfg.env, tokenizer, cfg.grpo.seed, cfg.grpo.val_num_prompts, max_prompt_tokens), env
    from nemo_rl_mtp.tasks.jsonl_prompts import JsonlPrompts

    prompts = JsonlPrompts(cfg.data, tokenizer, cfg.grpo.seed, cfg.grpo.val_num_prompts, max_prompt_tokens, env.demonstration)
    return prompts, env
