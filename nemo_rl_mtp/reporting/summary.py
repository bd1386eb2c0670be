"""The end-of-run summary on the console: what the run reached, first step -> last step."""

from __future__ import annotations

import re
from pathlib import Path

_PER_DEPTH = re.compile(
    r"^(train/mtp/mtp_\d+_(loss|acceptance_rate|expected_acceptance)|rollout/draft_\d+_acceptance_rate|val/draft_\d+_acceptance_rate)$"
)


def run_summary(history: list[dict[str, float]], run_dir: Path, wall_s: float, figure: Path) -> str:
    """Reward and validation accuracy first -> last, then MTP loss, acceptance and its forecast
    per depth (training, rollouts, validation), tokens per decode step, wall time and where things are."""
    lines = [_change("reward", history, "train/reward", "{:.3f}"), _change("validation accuracy", history, "val/accuracy", "{:.3f}")]
    keys = sorted({key for row in history for key in row if _PER_DEPTH.match(key)})
    lines += [_change(key, history, key, "{:.3f}" if key.endswith("loss") else "{:.1f}%") for key in keys]
    lines += [_change(key, history, key, "{:.2f}") for key in ("rollout/tokens_per_decode_step", "val/tokens_per_decode_step")]
    lines.append(f"{len(history)} steps in {wall_s:.0f} s (start-up included); logs: {run_dir}; figure: {figure}")
    return "\n".join(line for line in lines if line)


def _change(label: str, history: list[dict[str, float]], key: str, fmt: str) -> str:
    """``label: first -> last`` over the steps that logged ``key``; '' when none did."""
    values = [row[key] for row in history if key in row]
    if not values:
        return ""
    return f"{label}: {fmt.format(values[0])} -> {fmt.format(values[-1])}"
