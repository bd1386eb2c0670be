"""Verifiable digit-string tasks small enough for a tiny model to learn on a CPU: the environment
that judges them, and the prompts, which the task generates itself.

With the digit tasks' own tokenizer a prompt is ``<bos> digits =``; with a Hugging Face tokenizer
(an imported model) the task is rendered as text (``reverse: 314 =`` -> ``413``) and tokenized by
it, so every recipe runs on an imported model.
"""

from __future__ import annotations

import dataclasses

from typing import Optional

import torch

from nemo_rl_mtp.tasks.demonstrations import warmup_tasks
from nemo_rl_mtp.tasks.interfaces import PromptSource, TaskPrompt
from nemo_rl_mtp.tasks.tokenizer import DigitTokenizer
from nemo_rl_mtp.tasks.interfaces import EnvironmentInterface, EnvironmentReturn
from nemo_rl_mtp.config.load import ConfigError
from nemo_rl_mtp.config.schema import EnvConfig


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


def prompt_ids(task: str, digits: list[int], tokenizer) -> list[int]:
    if isinstance(tokenizer, DigitTokenizer):
        return tokenizer.encode_prompt(digits)
    return tokenizer.prompt_ids(f"{task.replace('_', ' ')}: {''.join(map(str, digits))} =")


def answer_ids(digits: list[int], tokenizer) -> list[int]:
    """Token ids of the response that gives ``digits`` and ends."""
    if isinstance(tokenizer, DigitTokenizer):
        return tokenizer.encode_answer(digits)
    return tokenizer.response_ids("".join(map(str, digits)))


class DigitTaskEnvironment(EnvironmentInterface):
    """Reward: the fraction of the expected answer's tokens (end-of-sequence token included) the
    response gets right, position by position; 1.0 iff exact."""

    def __init__(self, env_cfg: EnvConfig, tokenizer):
        self.task = env_cfg.task
        self.tokenizer = tokenizer

    def step(self, prompts: list[TaskPrompt], responses: list[list[int]]) -> EnvironmentReturn:
        rewards = self.rewards([prompt.answer for prompt in prompts], responses)
        return EnvironmentReturn(torch.tensor(rewards), [{} for _ in prompts])

    def rewards(self, digit_prompts: list[list[int]], responses: list[list[int]]) -> list[float]:
        """Reward of each response (token ids after the prompt) to the digit prompt with the same index."""
        return [
            answer_reward(answer_ids(expected_answer(self.task, digits), self.tokenizer), self.tokenizer.response_tokens(response))
            for digits, response in zip(digit_prompts, responses)
        ]


# Seeds the held-out validation prompts: a property of the task, the same for every run and seed.
VALIDATION_SEED = 20_261_130


class DigitTaskPrompts(PromptSource):
    """Digit strings of random length in [min_digits, max_digits] from a generator seeded with
    the run's seed; validation prompts are distinct strings from a fixed seed, and never drawn
    for training (a drawn validation prompt is drawn again)."""

    def __init__(self, env_cfg: EnvConfig, tokenizer, seed: int, num_validation_prompts: int = 0, max_prompt_tokens: Optional[int] = None):
        self.task = env_cfg.task
        self.min_digits = env_cfg.min_digits
        self.max_digits = env_cfg.max_digits
        self.tokenizer = tokenizer
        longest = len(prompt_ids(self.task, [0] * self.max_digits, tokenizer))
        if max_prompt_tokens is not None and longest > max_prompt_tokens:
            raise ConfigError(
                f"policy.max_total_sequence_length: env.max_digits={self.max_digits} prompts take {longest} tokens with this "
                f"tokenizer, more than the {max_prompt_tokens} left after policy.generation.max_new_tokens"
            )
        self.generator = torch.Generator().manual_seed(seed)
        self.validation_digits = self._distinct_prompts(num_validation_prompts, torch.Generator().manual_seed(VALIDATION_SEED))
        self._held_out = {tuple(digits) for digits in self.validation_digits}
        self.validation_prompts = [self.task_prompt(digits) for digits in self.validation_digits]

    def task_prompt(self, digits: list[int]) -> TaskPrompt:
        return TaskPrompt(
            prompt_ids=prompt_ids(self.task, digits, self.tokenizer),
            answer=digits,
            demonstration_ids=answer_ids(expected_answer(self.task, digits), self.tokenizer),
        )

    def next_prompts(self, num_prompts: int) -> list[TaskPrompt]:
        return [self.task_prompt(digits) for digits in self.sample_digits(num_prompts, self.generator)]

    def warmup_prompts(self, num_prompts: int, distractor_task: Optional[str], distractor_fraction: float) -> list[TaskPrompt]:
        """Training prompts whose demonstrations answer ``distractor_task`` with probability
        ``distractor_fraction`` (drawn from the run's generator after the prompts), else the task."""
        prompts = self.next_prompts(num_prompts)
        tasks = warmup_tasks(self.task, distractor_task, distractor_fraction, len(prompts), self.generator)
        return [self.answered_as(prompt, task) for prompt, task in zip(prompts, tasks)]

    def answered_as(self, prompt: TaskPrompt, task: str) -> TaskPrompt:
        """``prompt`` with ``task``'s answer as its demonstration: a warm start whose
        demonstrations differ from what the reward asks for (``grpo.warmup_distractor_task``)."""
        return dataclasses.replace(prompt, demonstration_ids=answer_ids(expected_answer(task, prompt.answer), self.tokenizer))

    def sample_digits(self, num_prompts: int, generator: torch.Generator) -> list[list[int]]:
        """``num_prompts`` digit strings drawn from ``generator``, none of them held out."""
        prompts = []
        while len(prompts) < num_prompts:
            prompts += [prompt for prompt in self._draw(num_prompts - len(prompts), generator) if tuple(prompt) not in self._held_out]
        return prompts

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])

    def _draw(self, num_prompts: int, generator: torch.Generator) -> list[list[int]]:
        lengths = torch.randint(self.min_digits, self.max_digits + 1, (num_prompts,), generator=generator)
        return [torch.randint(0, 10, (int(length),), generator=generator).tolist() for length in lengths]

    def _distinct_prompts(self, num_prompts: int, generator: torch.Generator) -> list[list[int]]:
        distinct: dict[tuple, None] = {}
        while len(distinct) < num_prompts:
            distinct.update(dict.fromkeys(tuple(prompt) for prompt in self._draw(num_prompts - len(distinct), generator)))
        return [list(prompt) for prompt in distinct]
