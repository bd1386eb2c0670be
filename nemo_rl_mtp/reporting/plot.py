"""A run's log as a picture, by step: reward; MTP loss per layer; MTP acceptance per layer in
training (solid), its rejection-sampling forecast (dotted) and the rollout's acceptance per draft
position (dashed; same colour for layer i and draft i); and the tokens a request gains per decode
step with speculation.

    uv run python -m nemo_rl_mtp.reporting.plot logs/<run>/metrics.jsonl [-o run.png]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from nemo_rl_mtp.metrics import (  # noqa: E402
    ACCURACY,
    REWARD,
    ROLLOUT,
    ROLLOUT_DRAFT_ACCEPTANCE_RATE,
    STEP,
    TOKENS_PER_DECODE_STEP,
    TRAIN,
    TRAIN_MTP_ACCEPTANCE_RATE,
    TRAIN_MTP_EXPECTED_ACCEPTANCE,
    TRAIN_MTP_LOSS,
    VALIDATION,
    in_scope,
)
from nemo_rl_mtp.reporting.logger import read_metrics  # noqa: E402


def plot_run(metrics_path: Path, output_path: Path) -> Path:
    rows = read_metrics(metrics_path)
    if not rows:
        raise ValueError(f"{metrics_path} holds no steps")
    logged = {key for row in rows for key in row}
    layers = sorted(set(TRAIN_MTP_LOSS.indices(logged)) | set(TRAIN_MTP_ACCEPTANCE_RATE.indices(logged)))
    drafts = ROLLOUT_DRAFT_ACCEPTANCE_RATE.indices(logged)
    figure, (reward_axis, loss_axis, acceptance_axis, speedup_axis) = plt.subplots(1, 4, figsize=(20, 4))

    def series(key):
        points = [(row[STEP], row[key]) for row in rows if key in row]
        return [step for step, _ in points], [value for _, value in points]

    reward_axis.plot(*series(in_scope(TRAIN, REWARD)), label="mean reward")
    if in_scope(TRAIN, ACCURACY) in logged:
        reward_axis.plot(*series(in_scope(TRAIN, ACCURACY)), label="exact answers")
    if in_scope(VALIDATION, ACCURACY) in logged:
        reward_axis.plot(*series(in_scope(VALIDATION, ACCURACY)), marker="o", label="validation: exact answers (greedy)")
    reward_axis.set(title="Reward", xlabel="step", ylim=(0, 1))
    reward_axis.legend()
    for layer in layers:
        colour = f"C{layer - 1}"
        loss_axis.plot(*series(TRAIN_MTP_LOSS.key(layer)), color=colour, label=f"MTP layer {layer}")
        acceptance_axis.plot(
            *series(TRAIN_MTP_ACCEPTANCE_RATE.key(layer)), color=colour, label=f"training top-1, MTP layer {layer}"
        )
        if TRAIN_MTP_EXPECTED_ACCEPTANCE.key(layer) in logged:
            acceptance_axis.plot(
                *series(TRAIN_MTP_EXPECTED_ACCEPTANCE.key(layer)), color=colour, linestyle=":",
                label=f"forecast (rejection sampling), layer {layer}",
            )
    for draft in drafts:
        acceptance_axis.plot(
            *series(ROLLOUT_DRAFT_ACCEPTANCE_RATE.key(draft)), color=f"C{draft - 1}", linestyle="--",
            label=f"rollout, draft {draft}",
        )
    loss_axis.set(title="MTP loss", xlabel="step")
    acceptance_axis.set(title="MTP acceptance (%)", xlabel="step", ylim=(0, 100))
    for axis in (loss_axis, acceptance_axis):
        if layers:
            axis.legend()
        else:
            axis.text(0.5, 0.5, "MTP off", ha="center", va="center", transform=axis.transAxes)
    speedup_axis.set(title="Tokens per decode step", xlabel="step")
    if drafts:
        speedup_axis.plot(*series(in_scope(ROLLOUT, TOKENS_PER_DECODE_STEP)), color="C3")
        speedup_axis.set_ylim(1, 1 + max(drafts))
    else:
        speedup_axis.text(0.5, 0.5, "no speculation", ha="center", va="center", transform=speedup_axis.transAxes)
    figure.suptitle(metrics_path.parent.name)
    figure.tight_layout()
    figure.savefig(output_path, dpi=100)
    plt.close(figure)
    return output_path


def main() -> None:
    parser = argparse.ArgumentParser(description="Plot reward, MTP loss and training/rollout acceptance of a run")
    parser.add_argument("metrics", type=Path, help="the run's metrics.jsonl")
    parser.add_argument("-o", "--output", type=Path, help="PNG path (default: next to metrics.jsonl)")
    args = parser.parse_args()
    output = args.output or args.metrics.with_name("mtp_run.png")
    print(plot_run(args.metrics, output))


if __name__ == "__main__":
    main()
