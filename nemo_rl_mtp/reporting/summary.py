"""The end-of-run summary on the console: what the run reached, first step -> last step."""

from __future__ import annotations

from pathlib import Path

from nemo_rl_mtp.metrics import (
    ACCURACY,
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


def run_summary(history: list[dict[str, float]], run_dir: Path, wall_s: float, figure: Path) -> str:
    """Reward and validation accuracy first -> last, then MTP loss, acceptance and its forecast
    per depth (training, rollouts, validation), tokens per decode step, wall time and where things are."""
    lines = [
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
    values = [row[key] for row in history if key in row]
    if not values:
        return ""
    return f"{label}: {fmt.format(values[0])} -> {fmt.format(values[-1])}"
