"""What GRPO asks of a task's data: prompts to train on (in a seeded, resumable order), a fixed
set of held-out prompts to validate on, and for each prompt what its judge needs."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class TaskPrompt:
    """One prompt of a task.

    ``prompt_ids``: the tokens the policy continues. ``answer``: what the environment judges a
    response against (a digit string, a reference answer). ``demonstration_ids``: a correct
    response (end-of-sequence token included), for the imitation warm start; None where the task
    has none.
    """

    prompt_ids: list[int]
    answer: Any
    demonstration_ids: Optional[list[int]] = None
    # Anything else the environment may use (the dataset record's other fields, say).
    metadata: dict = field(default_factory=dict)


class PromptSource(abc.ABC):
    """Where a run's prompts come from."""

    #: Held-out prompts, the same for every run of the task; never drawn for training.
    validation_prompts: list[TaskPrompt]

    @abc.abstractmethod
    def next_prompts(self, num_prompts: int) -> list[TaskPrompt]:
        """The next ``num_prompts`` training prompts of the run's order."""

    def warmup_prompts(self, num_prompts: int, distractor_task: Optional[str], distractor_fraction: float) -> list[TaskPrompt]:
        """Training prompts for the imitation warm start, each with the demonstration to imitate.
        A ``distractor_task`` (answering some prompts as another task would) is the digit tasks'
        alone; the config checks refuse it for any other source."""
        if distractor_task is not None:
            raise ValueError(f"grpo.warmup_distractor_task={distractor_task}: {type(self).__name__} has no other task to answer as")
        return self.next_prompts(num_prompts)

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """Where the order stands, for a checkpoint: a resumed run continues the same order."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Continue from a ``state_dict()``."""

    def counters(self) -> dict[str, float]:
        """Running counts worth logging (``data/...``), e.g. prompts skipped for their length."""
        return {}
