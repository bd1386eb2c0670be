"""What the engine tests share: the tokenizer and prompts, policy sizes, and a rollout call."""

from __future__ import annotations

import pytest

from nemo_rl_mtp.tasks.tokenizer import DigitTokenizer
from nemo_rl_mtp.megatron_compat import engine_release

TOKENIZER = DigitTokenizer()
PROMPTS = [TOKENIZER.encode_prompt(digits) for digits in ([1, 2], [3, 4, 5], [6], [7, 8, 9, 0])] * 2
# Sizes of the policy whose heads are trained by imitation (``trained_policy``).
SIZES = {"generation__max_new_tokens": 5, "train_micro_batch_size": 64, "train_global_batch_size": 64, "megatron_cfg__optimizer__lr": 3e-3}


def engine_overrides(num_speculative_tokens: int, mtp_num_layers: int = 2, **overrides) -> dict:
    return {
        "megatron_cfg__mtp_num_layers": mtp_num_layers,
        "generation__num_speculative_tokens": num_speculative_tokens,
        "generation__max_new_tokens": 12,
        "max_total_sequence_length": 24,
        "train_micro_batch_size": 4,
        "train_global_batch_size": 8,
        **overrides,
    }


def generate(engine, prompts=PROMPTS, seed=0):
    return engine.generate(prompts, TOKENIZER.eos_id, TOKENIZER.pad_id, seed)


def speculation_skip_reason() -> str | None:
    """Why the installed release's engine cannot speculate (None: it can), naming the release."""
    missing = engine_release.speculation_missing()
    return None if missing is None else f"{engine_release.megatron_release()}: {missing}"


# Tests of speculation: skipped, naming what the release lacks, on an engine without it (0.16).
requires_speculation = pytest.mark.skipif(speculation_skip_reason() is not None, reason=str(speculation_skip_reason()))


def skip_module_without_speculation() -> None:
    """At the top of a module that is about speculation only (before it imports what the release
    may not have)."""
    reason = speculation_skip_reason()
    if reason is not None:
        pytest.skip(reason, allow_module_level=True)


def drafts_where_possible(k: int) -> int:
    """``k`` drafts per step for a rollout test about more than speculation; 0 on an engine without
    speculation, so the test still checks the rest there."""
    return k if speculation_skip_reason() is None else 0
