"""What GRPO asks of a task: its data (:class:`PromptSource`: prompts to train on in a seeded,
resumable order, a fixed set of held-out prompts to validate on, and for each prompt what its judge
needs) and its judge (:class:`EnvironmentInterface`, NeMo-RL's shape, single turn: a batch of
prompts and the policy's responses in, a reward and per-sample metadata for each out; the metrics
of a judged batch are the environment's to define). GRPO, validation and the summary know nothing
task-specific.

To add a task: subclass :class:`EnvironmentInterface`, register it in
``nemo_rl_mtp.tasks.ENVIRONMENTS`` under the ``env.name`` that selects it, and give its settings a
section of their own under ``env`` in the exemplar config; a dataset of another shape gets a
:class:`PromptSource`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from nemo_rl_mtp.metrics import ACCURACY, REWARD

if TYPE_CHECKING:
    import torch


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


@dataclass
class EnvironmentReturn:
    """``rewards`` ``[B]`` (float); ``metadata``: one dict per sample (what the judge saw)."""

    rewards: torch.Tensor
    metadata: list[dict]


class EnvironmentInterface(abc.ABC):
    @abc.abstractmethod
    def step(self, prompts: list[TaskPrompt], responses: list[list[int]]) -> EnvironmentReturn:
        """Judge each response (token ids after its prompt; it may run past its end-of-sequence
        token) to the prompt with the same index."""

    def demonstration(self, answer) -> Optional[str]:
        """The text of a correct response to a prompt whose reference answer is ``answer``, for
        the imitation warm start of prompts from a dataset; None where the task cannot say."""
        return None

    def close(self) -> None:
        """Release what the environment holds (processes, files); the run is over."""

    def metrics(self, result: EnvironmentReturn) -> dict[str, float]:
        """Metrics of a judged batch, unprefixed (GRPO logs them as ``train/...`` and
        ``val/...``): the mean reward, and ``accuracy``, the share of responses with reward 1."""
        rewards = result.rewards.float()
        return {REWARD: rewards.mean().item(), ACCURACY: (rewards == 1.0).float().mean().item()}
