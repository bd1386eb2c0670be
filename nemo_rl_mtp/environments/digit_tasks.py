"""Verifiable digit-string tasks small enough for a tiny model to learn on a CPU."""

from __future__ import annotations

import torch

from nemo_rl_mtp.data.tokenizer import DigitTokenizer
from nemo_rl_mtp.utils.config_schema import EnvConfig


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


# Seeds the held-out validation prompts: a property of the task, the same for every run and seed.
VALIDATION_SEED = 20_261_130


class DigitTaskEnvironment:
    def __init__(self, env_cfg: EnvConfig, tokenizer: DigitTokenizer, num_validation_prompts: int = 0):
        self.task = env_cfg.task
        self.min_digits = env_cfg.min_digits
        self.max_digits = env_cfg.max_digits
        self.tokenizer = tokenizer
        self.validation_prompts = self._distinct_prompts(num_validation_prompts, torch.Generator().manual_seed(VALIDATION_SEED))
        self._held_out = {tuple(prompt) for prompt in self.validation_prompts}

    def sample_prompts(self, num_prompts: int, generator: torch.Generator) -> list[list[int]]:
        """Digit strings of random length in [min_digits, max_digits], never one of the
        validation prompts (a drawn validation prompt is drawn again)."""
        prompts = []
        while len(prompts) < num_prompts:
            prompts += [prompt for prompt in self._draw(num_prompts - len(prompts), generator) if tuple(prompt) not in self._held_out]
        return prompts

    def _draw(self, num_prompts: int, generator: torch.Generator) -> list[list[int]]:
        lengths = torch.randint(self.min_digits, self.max_digits + 1, (num_prompts,), generator=generator)
        return [torch.randint(0, 10, (int(length),), generator=generator).tolist() for length in lengths]

    def _distinct_prompts(self, num_prompts: int, generator: torch.Generator) -> list[list[int]]:
        distinct: dict[tuple, None] = {}
        while len(distinct) < num_prompts:
            distinct.update(dict.fromkeys(tuple(prompt) for prompt in self._draw(num_prompts - len(distinct), generator)))
        return [list(prompt) for prompt in distinct]

    def rewards(self, prompts: list[list[int]], responses: list[list[int]]) -> list[float]:
        """Reward of each response (token ids after the prompt) to the prompt with the same index."""
        return [
            answer_reward(
                self.tokenizer.encode_answer(expected_answer(self.task, digits)),
                self.tokenizer.response_tokens(response),
            )
            for digits, response in zip(prompts, responses)
        ]
