"""What the engine tests share: the tokenizer and prompts, policy sizes, and a rollout call."""

from __future__ import annotations

from nemo_rl_mtp.data.tokenizer import DigitTokenizer

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
