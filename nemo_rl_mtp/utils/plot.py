"""A run's log as a picture: reward, MTP loss per layer and MTP acceptance per layer, by step.

    uv run python -m nemo_rl_mtp.utils.plot logs/<run>/metrics.jsonl [-o run.png]
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from nemo_rl_mtp.utils.logger import read_metrics  # noqa: E402

_LAYER_KEY = re.compile(r"^train/mtp/mtp_(\d+)_(loss|acceptance_rate)$")


def plot_run(metrics_path: Path, output_path: Path) -> Path:
    rows = read_metrics(metrics_path)
    if not rows:
        raise ValueError(f"{metrics_path} holds no steps")
    layers = sorted({int(m.group(1)) for row in rows for key in row if (m := _LAYER_KEY.match(key))})
    figure, (reward_axis, loss_axis, acceptance_axis) = plt.subplots(1, 3, figsize=(15, 4))

    def series(key):
        points = [(row["step"], row[key]) for row in rows if key in row]
        return [step for step, _ in points], [value for _, value in points]

    reward_axis.plot(*series("train/reward"), label="mean reward")
    if any("train/accuracy" in row for row in rows):
        reward_axis.plot(*series("train/accuracy"), label="exact answers")
    reward_axis.set(title="Reward", xlabel="step", ylim=(0, 1))
    reward_axis.legend()
    for layer in layers:
        loss_axis.plot(*series(f"train/mtp/mtp_{layer}_loss"), label=f"MTP layer {layer}")
        acceptance_axis.plot(*series(f"train/mtp/mtp_{layer}_acceptance_rate"), label=f"MTP layer {layer}")
    loss_axis.set(title="MTP loss", xlabel="step")
    acceptance_axis.set(title="MTP acceptance (%)", xlabel="step", ylim=(0, 100))
    for axis in (loss_axis, acceptance_axis):
        if layers:
            axis.legend()
        else:
            axis.text(0.5, 0.5, "MTP off", ha="center", va="center", transform=axis.transAxes)
    figure.suptitle(metrics_path.parent.name)
    figure.tight_layout()
    figure.savefig(output_path, dpi=100)
    plt.close(figure)
    return output_path


def main() -> None:
    parser = argparse.ArgumentParser(description="Plot reward and per-layer MTP loss/acceptance of a run")
    parser.add_argument("metrics", type=Path, help="the run's metrics.jsonl")
    parser.add_argument("-o", "--output", type=Path, help="PNG path (default: next to metrics.jsonl)")
    args = parser.parse_args()
    output = args.output or args.metrics.with_name("mtp_run.png")
    print(plot_run(args.metrics, output))


if __name__ == "__main__":
    main()
