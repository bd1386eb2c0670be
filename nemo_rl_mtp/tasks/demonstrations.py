"""Demonstrations: prompts followed by their correct answers, as a training batch in which every
answer token is trained with advantage 1 (see :mod:`nemo_rl_mtp.training.imitation`)."""

from __future__ import annotations

import torch

from nemo_rl_mtp.tasks.interfaces import TaskPrompt


def demonstration_batch(prompts: list[list[int]], answers: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """A training batch of prompts followed by their answers (token ids; ``[B, S]`` right-padded),
    every answer token trained with advantage 1."""
    width = max(len(prompt) + len(answer) for prompt, answer in zip(prompts, answers))
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    token_mask = torch.zeros(len(prompts), width)
    for row, (prompt, answer) in enumerate(zip(prompts, answers)):
        input_ids[row, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        token_mask[row, len(prompt) : len(prompt) + len(answer)] = 1.0
    return {
        "input_ids": input_ids,
        "input_lengths": torch.tensor([len(prompt) + len(answer) for prompt, answer in zip(prompts, answers)]),
        "token_mask": token_mask,
        "sample_mask": torch.ones(len(prompts)),
        "advantages": token_mask.clone(),
    }


def prompt_demonstrations(prompts: list[TaskPrompt], pad_id: int) -> dict[str, torch.Tensor]:
    """``demonstration_batch`` of task prompts and their demonstrated responses."""
    missing = sum(prompt.demonstration_ids is None for prompt in prompts)
    if missing:
        raise ValueError(f"{missing} of {len(prompts)} prompts have no demonstration (a correct response) to imitate")
    return demonstration_batch([prompt.prompt_ids for prompt in prompts], [prompt.demonstration_ids for prompt in prompts], pad_id)


def warmup_tasks(task: str, distractor_task: str | None, distractor_fraction: float, count: int, generator: torch.Generator) -> list[str]:
    """The task each of ``count`` warm-start demonstrations answers: ``distractor_task`` with
    probability ``distractor_fraction`` (drawn from ``generator``), else ``task``. Draws nothing
    without a distractor, so such runs keep their random streams."""
    if distractor_task is None or distractor_fraction == 0.0:
        return [task] * count
    draws = torch.rand(count, generator=generator)
    return [distractor_task if draw < distractor_fraction else task for draw in draws.tolist()]
