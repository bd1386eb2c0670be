"""Every metric key the package logs or hands between its parts, built and parsed here, and how the
results of data-parallel ranks merge.

The key strings are what dashboards and saved ``metrics.jsonl`` files know a run by, so they never
change. What changes is who spells them: the training step, the rollouts and the GRPO loop build
them, and the plot, the summary, the progress bar, ``auto``'s forecast and the MTP guard read them
back, all through the functions here, so no part formats a key one way and another parses it
another way.

A key is a name inside scopes: ``train/`` + ``mtp/`` + ``mtp_2_loss``. Some names come in families,
one per MTP depth or per draft position i (1-based): :class:`Indexed` builds such a key from i and
reads i back from a key.

Each data-parallel rank rolls out its share of the prompts and returns its own results;
:data:`RANK_RESULT_REDUCTIONS` declares how each of them merges over the ranks and
:func:`merge_data_parallel` merges them. A result without a declaration is refused, naming it:
silently summing it (what an unlisted key once got) is wrong for anything that is not a count. A
training step's metrics need no merge: the step's own collectives make them global before a rank
returns them, so ``Policy.train`` reads one rank.

This module imports nothing from the package (the bottom layer of ``tests/unit/test_architecture.py``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable, Mapping, TypeVar

import torch

Value = TypeVar("Value")

# Each row of a run's metrics.jsonl: the GRPO step it logs.
STEP = "step"

# Scopes: where a metric comes from, the first part of its logged key.
TRAIN = "train/"
VALIDATION = "val/"
ROLLOUT = "rollout/"
TIMING = "timing/"
WARMUP = "warmup/"
DATA = "data/"
# Inside a training step's metrics: the MTP heads' and the MoE routers'.
MTP = "mtp/"
MOE = "moe/"


def in_scope(scope: str, name: str) -> str:
    """``name`` logged under ``scope`` (``in_scope(TRAIN, LOSS)`` is ``train/loss``)."""
    return scope + name


def all_in_scope(scope: str, metrics: Mapping[str, Value]) -> dict[str, Value]:
    """Every key of ``metrics`` put under ``scope``, values unchanged."""
    return {scope + name: value for name, value in metrics.items()}


def moved_to_scope(key: str, old_scope: str, new_scope: str) -> str:
    """``key`` taken out of ``old_scope`` and put under ``new_scope`` (validation logs its
    rollouts' speculation metrics as ``val/...``); ValueError where ``key`` is not in ``old_scope``,
    which would otherwise yield a key nobody reads."""
    if not key.startswith(old_scope):
        raise ValueError(f"metric key {key!r} is not under {old_scope!r}")
    return new_scope + key[len(old_scope) :]


@dataclass(frozen=True)
class Indexed:
    """A family of keys, one per MTP depth or draft position i (1-based): ``<stem><i><suffix>``."""

    stem: str
    suffix: str

    def key(self, index: int) -> str:
        return f"{self.stem}{index}{self.suffix}"

    def index(self, key: str) -> int | None:
        """The i of a key of this family; None for a key of any other family or none."""
        if len(key) <= len(self.stem) + len(self.suffix) or not (key.startswith(self.stem) and key.endswith(self.suffix)):
            return None
        digits = key[len(self.stem) : len(key) - len(self.suffix)]
        return int(digits) if digits.isascii() and digits.isdigit() else None

    def indices(self, keys: Iterable[str]) -> list[int]:
        """The i of every key of this family among ``keys``, ascending, once each."""
        return sorted({index for key in keys if (index := self.index(key)) is not None})

    def under(self, *scopes: str) -> "Indexed":
        """The same family under ``scopes``, outermost first (``under(TRAIN, MTP)``)."""
        return Indexed("".join(scopes) + self.stem, self.suffix)


# Per MTP depth, as megatron's MTP tracker is read (``training/aux_losses.get_mtp_metrics``); the
# training step returns them under ``mtp/``, the GRPO loop logs those under ``train/``.
MTP_LOSS = Indexed("mtp_", "_loss")
MTP_ACCEPTANCE_RATE = Indexed("mtp_", "_acceptance_rate")
MTP_TARGET_TOKENS = Indexed("mtp_", "_target_tokens")
# Per MTP depth, the forecast of rollout acceptance (``training/forecast.py``): the microbatches'
# sums and counts, then, once summed over the global batch, their ratio in percent.
MTP_EXPECTED_ACCEPTANCE = Indexed("mtp_", "_expected_acceptance")
MTP_EXPECTED_ACCEPTANCE_SUM = Indexed("mtp_", "_expected_acceptance_sum")
MTP_EXPECTED_ACCEPTANCE_COUNT = Indexed("mtp_", "_expected_acceptance_count")
# Per draft position, a rollout's speculation (``rollout/speculation.speculation_metrics``),
# logged under ``rollout/`` (``val/`` for validation's rollouts).
DRAFT_PROPOSED = Indexed("draft_", "_proposed")
DRAFT_ACCEPTED = Indexed("draft_", "_accepted")
DRAFT_ACCEPTANCE_RATE = Indexed("draft_", "_acceptance_rate")

# A training step's metrics (``training/step.py``; the loss function's from ``training/losses.py``).
LOSS = "loss"
CLIP_FRACTION = "clip_fraction"
KL = "kl"
PROBS_RATIO = "probs_ratio"
ENTROPY = "entropy"
GLOBAL_VALID_TOKENS = "global_valid_tokens"
GRAD_NORM = "grad_norm"
UPDATE_SUCCESSFUL = "update_successful"
MTP_GRAD_NORM = in_scope(MTP, "grad_norm")
MTP_GLOBAL_VALID_TOKENS = in_scope(MTP, "global_valid_tokens")

# An environment's judgement of a batch (``tasks/interfaces.py``), logged under
# ``train/`` and ``val/``.
REWARD = "reward"
ACCURACY = "accuracy"
ANSWER_RATE = "answer_rate"

# The prompt source's running counts (``tasks/jsonl_prompts.py``), logged under ``data/``.
SKIPPED_PROMPTS = "skipped_prompts"
TRUNCATED_PROMPTS = "truncated_prompts"
EPOCH = "epoch"

# What the GRPO loop adds (``grpo/loop.py``): under ``train/`` ...
RESPONSE_LENGTH = "response_length"
GENERATION_LOGPROB_ERROR = "generation_logprob_error"
OPTIMIZER_STEPS = "optimizer_steps"
KL_TO_START = "kl_to_start"
# ... under ``rollout/`` (with speculation's, next) ...
TOKENS_PER_S = "tokens_per_s"
DECODE_STEPS = "decode_steps"
# ... and under ``timing/``, seconds of each part of a step.
GENERATION_SECONDS = "generation_s"
LOGPROBS_SECONDS = "logprobs_s"
TRAIN_SECONDS = "train_s"
STEP_SECONDS = "step_s"

# A rollout's speculation (``rollout/speculation.speculation_metrics``), under ``rollout/``.
ACCEPTED_DRAFTS_PER_DECODE_STEP = "accepted_drafts_per_decode_step"
TOKENS_PER_DECODE_STEP = "tokens_per_decode_step"
NUM_SPECULATIVE_TOKENS = "num_speculative_tokens"
EXPECTED_TOKENS_PER_S = "expected_tokens_per_s"
ENGINE_TOKENS_PER_S = "engine_tokens_per_s"

# The families as they are logged, for the readers of a run's log.
TRAIN_MTP_LOSS = MTP_LOSS.under(TRAIN, MTP)
TRAIN_MTP_ACCEPTANCE_RATE = MTP_ACCEPTANCE_RATE.under(TRAIN, MTP)
TRAIN_MTP_EXPECTED_ACCEPTANCE = MTP_EXPECTED_ACCEPTANCE.under(TRAIN, MTP)
ROLLOUT_DRAFT_ACCEPTANCE_RATE = DRAFT_ACCEPTANCE_RATE.under(ROLLOUT)
VALIDATION_DRAFT_ACCEPTANCE_RATE = DRAFT_ACCEPTANCE_RATE.under(VALIDATION)

# One rank's rollout results (``rollout/engine.RolloutEngine.generate``), host tensors.
TOKENS = "tokens"
LENGTHS = "lengths"
PROMPT_LENGTHS = "prompt_lengths"
LOGPROBS = "logprobs"
DRAFT_PROPOSED_COUNTS = "draft_proposed"
DRAFT_ACCEPTED_COUNTS = "draft_accepted"
SPECULATIVE_TOKENS = "speculative_tokens"  # the k ``auto`` chose


class Reduction(enum.Enum):
    """How one result of every data-parallel rank becomes one."""

    SUM = "sum"  # counts; and rates of ranks that run side by side (tokens/s)
    SUM_BY_POSITION = "sum by position"  # per-draft-position counts; a rank whose auto chose a smaller k counts 0 past it
    MEAN = "mean"  # a per-rank average of equal shares
    MAX = "max"  # the slowest rank's: ranks step in parallel, the rollout lasts as long as it
    SAME = "same"  # equal on every rank (checked), taken once
    CONCATENATE = "concatenate"  # per-sample rows in rank order; [B, S] ones right-padded to the widest


RANK_RESULT_REDUCTIONS: dict[str, Reduction] = {
    TOKENS: Reduction.CONCATENATE,
    LENGTHS: Reduction.CONCATENATE,
    PROMPT_LENGTHS: Reduction.CONCATENATE,
    LOGPROBS: Reduction.CONCATENATE,
    DECODE_STEPS: Reduction.MAX,
    SPECULATIVE_TOKENS: Reduction.MAX,  # each rank's auto chooses its own
    DRAFT_PROPOSED_COUNTS: Reduction.SUM_BY_POSITION,
    DRAFT_ACCEPTED_COUNTS: Reduction.SUM_BY_POSITION,
    EXPECTED_TOKENS_PER_S: Reduction.SUM,
    ENGINE_TOKENS_PER_S: Reduction.SUM,
}


class UndeclaredMetricError(ValueError):
    """A rank's result whose data-parallel reduction nobody declared."""


def reduction_of(key: str) -> Reduction:
    """The declared reduction of a rank's result ``key``; UndeclaredMetricError naming it if none."""
    if key not in RANK_RESULT_REDUCTIONS:
        raise UndeclaredMetricError(
            f"rank result {key!r} has no declared data-parallel reduction; declare it in "
            "nemo_rl_mtp/metrics.py (RANK_RESULT_REDUCTIONS) rather than let it be merged by guess"
        )
    return RANK_RESULT_REDUCTIONS[key]


def reduce_over_ranks(key: str, reduction: Reduction, parts: list[torch.Tensor], pad_value: float = 0) -> torch.Tensor:
    """One result ``key`` of every rank, in rank order, reduced as ``reduction`` says
    (``pad_value`` fills the columns a concatenated [B, S] part lacks)."""
    if reduction is Reduction.CONCATENATE:
        return torch.cat(_right_padded_to_widest(parts, pad_value))
    if reduction is Reduction.SUM_BY_POSITION:
        longest = max(part.shape[0] for part in parts)
        return torch.stack([torch.nn.functional.pad(part, (0, longest - part.shape[0])) for part in parts]).sum(dim=0)
    stacked = torch.stack(parts)
    if reduction is Reduction.SUM:
        return stacked.sum(dim=0)
    if reduction is Reduction.MEAN:
        return stacked.sum(dim=0) / len(parts)
    if reduction is Reduction.MAX:
        return stacked.max(dim=0).values
    if not all(torch.equal(parts[0], part) for part in parts[1:]):
        raise ValueError(f"rank result {key!r} should be the same on every data-parallel rank, and is not: {parts}")
    return parts[0]


def merge_data_parallel(per_rank: list[Mapping[str, torch.Tensor]], pad_values: Mapping[str, float] | None = None) -> dict[str, torch.Tensor]:
    """The results of every data-parallel rank (in rank order) as one, each key merged by its
    declared reduction; ``pad_values``: per key, what fills a concatenated [B, S] result's padding
    columns (0 for a key not given). Raises UndeclaredMetricError for a key without a declaration."""
    pad_values = pad_values or {}
    return {
        key: reduce_over_ranks(key, reduction_of(key), [result[key] for result in per_rank], pad_values.get(key, 0))
        for key in per_rank[0]
    }


def _right_padded_to_widest(parts: list[torch.Tensor], pad_value: float) -> list[torch.Tensor]:
    """[B, S] parts right-padded with ``pad_value`` to the widest part's S; 1-D parts unchanged."""
    width = max((part.shape[1] for part in parts if part.dim() == 2), default=0)
    return [
        torch.nn.functional.pad(part, (0, width - part.shape[1]), value=pad_value) if part.dim() == 2 else part
        for part in parts
    ]
