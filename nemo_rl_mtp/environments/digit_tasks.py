"""Verifiable digit-string tasks small enough for a tiny model to learn on a CPU."""

from __future__ import annotations

import torch

from nemo_rl_mtp.data.tokenizer import DigitTokenizer


def expected_answer(task: str, digits: list[int]) -> list[int]:
    if task == "reverse":
        return digits[::-1]
    if task == "sort":
        return sorted(digits)
    if task == "count_up":
        return [(digits[-1] + step) % 10 for step in range(1, len(digits) + 1)]
    raise ValueError(f"unknown task {task!r}")


def answer_reward(expected: list[int], response: list[int]) -> float:
    """Fraction of positions right, comparing token sequences that end with the end-of-sequence
    token (so stopping at the right place earns credit too); extra or missing tokens count as
    wrong. 1.0 iff exact."""
    matches = sum(r == e for r, e in zip(response, expected))
    return matches / max(len(expected), len(response), 1)


class DigitTaskEnvironment:
    def __init__(self, env_cfg, tokenizer: DigitTokenizer):
        self.task = env_cfg.task
        self.min_digits = env_cfg.min_digits
        self.max_digits = env_cfg.max_digits
        self.tokenizer = tokenizer

    def sample_prompts(self, num_prompts: int, generator: torch.Generator) -> list[list[int]]:
        """Digit strings of random length in [min_digits, max_digits]."""
        lengths = torch.randint(self.min_digits, self.max_digits + 1, (num_prompts,), generator=generator)
        return [torch.randint(0, 10, (int(length),), generator=generator).tolist() for length in lengths]

    def rewards(self, prompts: list[list[int]], responses: list[list[int]]) -> list[float]:
        """Reward of each response (token ids after the prompt) to the prompt with the same index."""
        return [
            answer_reward(
                self.tokenizer.encode_answer(expected_answer(self.task, digits)),
                self.tokenizer.response_tokens(response),
            )
            for digits, response in zip(prompts, responses)
        ]
