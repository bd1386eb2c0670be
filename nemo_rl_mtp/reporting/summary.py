"""The end-of-run summary on the console: what the run reached, first step -> last step."""

from __future__ import annotations

from pathlib import Path

from nemo_rl_mtp.metrics import (
    ACCURACY,
    KL_TO_START,
    REWARD,
    ROLLOUT,
    ROLLOUT_DRAFT_ACCEPTANCE_RATE,
    TOKENS_PER_DECODE_STEP,
    TRAIN,
    TRAIN_MTP_ACCEPTANCE_RATE,
    TRAIN_MTP_EXPECTED_ACCEPTANCE,
    TRAIN_MTP_LOSS,
    VALIDATION,
    VALIDATION_DRAFT_ACCEPTANCE_RATE,
    in_scope,
)

# Shown per MTP depth or draft position, in the order of their keys.
PER_DEPTH_FAMILIES = (
    TRAIN_MTP_LOSS,
    TRAIN_MTP_ACCEPTANCE_RATE,
    TRAIN_MTP_EXPECTED_ACCEPTANCE,
    ROLLOUT_DRAFT_ACCEPTANCE_RATE,
    VALIDATION_DRAFT_ACCEPTANCE_RATE,
)

# Validation accuracy must change by this much for the summary to say GRPO moved the policy: about
# two standard errors of an accuracy near 0.5 measured on the default 128 held-out prompts.
MOVED_ACCURACY = 0.09
# Steps averaged at an end of the run for a per-step quantity measured on one step's samples: the
# head's rollout acceptance (one step's few hundred drafts are 2-3 points of noise) and the KL to
# the start of RL (one step's last value was 2.85 nats/token where the ten before it read 0.4-1.0).
END_WINDOW = 10


def run_summary(history: list[dict[str, float]], run_dir: Path, wall_s: float, figure: Path) -> str:
    """What moved (:func:`what_moved`), reward and validation accuracy first -> last, then MTP loss, acceptance and its forecast
    per depth (training, rollouts, validation), tokens per decode step, wall time and where things are."""
    lines = [
        what_moved(history),
        _change("reward", history, in_scope(TRAIN, REWARD), "{:.3f}"),
        _change("validation accuracy", history, in_scope(VALIDATION, ACCURACY), "{:.3f}"),
    ]
    keys = sorted({key for row in history for key in row if _per_depth(key)})
    lines += [_change(key, history, key, "{:.3f}" if TRAIN_MTP_LOSS.index(key) is not None else "{:.1f}%") for key in keys]
    speedups = [in_scope(scope, TOKENS_PER_DECODE_STEP) for scope in (ROLLOUT, VALIDATION)]
    lines += [_change(key, history, key, "{:.2f}") for key in speedups]
    lines.append(f"{len(history)} steps in {wall_s:.0f} s (start-up included); logs: {run_dir}; figure: {figure}")
    return "\n".join(line for line in lines if line)


def _per_depth(key: str) -> bool:
    return any(family.index(key) is not None for family in PER_DEPTH_FAMILIES)


def _change(label: str, history: list[dict[str, float]], key: str, fmt: str) -> str:
    """``label: first -> last`` over the steps that logged ``key``; '' when none did."""
    values = _logged(history, key)
    if not values:
        return ""
    if len(values) == 1:  # one measurement is no change (auto may draft at one step only)
        return f"{label}: {fmt.format(values[0])} (logged at one step only)"
    return f"{label}: {fmt.format(values[0])} -> {fmt.format(values[-1])}"


def what_moved(history: list[dict[str, float]]) -> str:
    """One line saying what the run did: whether GRPO moved the policy (validation accuracy first
    -> last, and the KL to the start of RL where it was logged, the mean of the last ``END_WINDOW``
    steps), and where the MTP head's depth-1 rollout acceptance went (means of the first and the
    last ``END_WINDOW`` steps that drafted; where only one did, that one and the trainer's forecast
    of the acceptance, first -> last). '' for a run without validation."""
    accuracy = _first_last(history, in_scope(VALIDATION, ACCURACY))
    if accuracy is None:
        return ""
    first, last = accuracy
    verdict = "GRPO moved the policy" if abs(last - first) >= MOVED_ACCURACY else "GRPO hardly moved the policy"
    line = f"{verdict}: validation accuracy {first:.3f} -> {last:.3f} ({last - first:+.3f})"
    kl = _logged(history, in_scope(TRAIN, KL_TO_START))
    if kl:
        window = _end_window(len(kl))  # never reaching back to the start, where it is 0
        line += f", KL to the start of RL {sum(kl[-window:]) / window:.2f} nats/token" + (f" (mean of the last {window} steps)" if window > 1 else "")
    drafted = _logged(history, ROLLOUT_DRAFT_ACCEPTANCE_RATE.key(1))
    if len(drafted) == 1:  # auto chose k = 0 at every other step: the trainer's forecast says where the head went
        line += f"; the MTP head's rollout acceptance {drafted[0]:.1f}% (only one rollout drafted)"
        forecast = _first_last(history, TRAIN_MTP_EXPECTED_ACCEPTANCE.key(1))
        if forecast is not None:
            line += f", its forecast from training {forecast[0]:.1f}% -> {forecast[1]:.1f}%"
    elif drafted:
        window = _end_window(len(drafted))  # the two ends never overlap
        first, last = sum(drafted[:window]) / window, sum(drafted[-window:]) / window
        # auto may draft at a few steps only (its refreshes): say how many rollouts the ends are
        ends = ("the first and last" if window == 1 else f"means of the first and last {window}") + f" of {len(drafted)} rollouts that drafted"
        line += f"; the MTP head's rollout acceptance {first:.1f}% -> {last:.1f}% ({ends})"
    return line


def _first_last(history: list[dict[str, float]], key: str) -> tuple[float, float] | None:
    """The first and the last value of ``key`` over the steps that logged it."""
    values = _logged(history, key)
    return (values[0], values[-1]) if values else None


def _logged(history: list[dict[str, float]], key: str) -> list[float]:
    """The values of ``key`` over the steps that logged it, in order."""
    return [row[key] for row in history if key in row]


def _end_window(count: int) -> int:
    """How many of ``count`` logged values an end of the run averages: ``END_WINDOW``, at most
    half of them (so the two ends never overlap), at least one."""
    return max(1, min(END_WINDOW, count // 2))
