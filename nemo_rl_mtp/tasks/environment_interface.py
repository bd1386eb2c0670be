"""The environment interface (NeMo-RL's shape, single turn): a batch of prompts and the policy's
responses in, a reward and per-sample metadata for each out; the metrics of a judged batch are
the environment's to define. GRPO, validation and the summary know nothing task-specific.

To add a task: subclass :class:`EnvironmentInterface`, register it in
``nemo_rl_mtp.tasks.ENVIRONMENTS`` under the ``env.name`` that selects it, and give its
settings a section of their own under ``env`` in the exemplar config.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Optional

import torch

from nemo_rl_mtp.tasks.interfaces import TaskPrompt
from nemo_rl_mtp.metrics import ACCURACY, REWARD


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
