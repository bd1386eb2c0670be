"""What training the MTP heads during RL buys: the same GRPO run from the same start twice, once with
the MTP heads trained alongside the policy and once with them frozen at their initial weights
(``mtp_loss_scaling_factor=0``: no MTP gradient, so the heads never change), same speculation
settings. One figure: rollout acceptance per draft position, tokens per decode step and reward
over steps, both runs on the same axes.

    uv run examples/compare_mtp_heads.py [--config <recipe>] [-o examples/mtp_trained_vs_frozen.png] [key=value ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RECIPE = REPO_ROOT / "examples" / "configs" / "grpo_mtp_tiny_cpu.yaml"
ARMS = {"trained": [], "frozen": ["policy.megatron_cfg.mtp_loss_scaling_factor=0"]}


def run_arm(config: str, overrides: list[str], name: str, log_dir: str) -> list[dict[str, float]]:
    from nemo_rl_mtp.algorithms.grpo import grpo_train
    from nemo_rl_mtp.utils.config import load_config

    quiet = ["logger.console=false", "logger.wandb_enabled=false", "logger.tensorboard_enabled=false", "checkpointing.enabled=false"]
    cfg = load_config(config, [*overrides, *ARMS[name], *quiet, f"logger.log_dir={log_dir}", f"logger.run_name={name}"])
    return grpo_train(cfg)


def plot(histories: dict[str, list[dict]], output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (acceptance_axis, speed_axis, reward_axis) = plt.subplots(1, 3, figsize=(16, 4))
    for colour, (name, rows) in zip(("C0", "C1"), histories.items()):
        steps = [row["step"] for row in rows]
        drafts = sorted({key for row in rows for key in row if key.startswith("rollout/draft_") and key.endswith("acceptance_rate")})
        for style, key in zip(("-", "--", ":", "-."), drafts):
            acceptance_axis.plot(steps, [row[key] for row in rows], style, color=colour, label=f"{name}, {key.split('/')[1][:7]}")
        speed_axis.plot(steps, [row["rollout/tokens_per_decode_step"] for row in rows], color=colour, label=name)
        reward_axis.plot(steps, [row["train/reward"] for row in rows], color=colour, label=name)
    acceptance_axis.set(title="Rollout acceptance per draft position (%)", xlabel="GRPO step", ylim=(0, 100))
    speed_axis.set(title="Tokens per decode step", xlabel="GRPO step")
    reward_axis.set(title="Reward", xlabel="GRPO step", ylim=(0, 1))
    for axis in (acceptance_axis, speed_axis, reward_axis):
        axis.legend()
    figure.suptitle("MTP heads trained during RL vs frozen at the start (same run otherwise)")
    figure.tight_layout()
    figure.savefig(output, dpi=100)


def summary(histories: dict[str, list[dict]], window: int = 10) -> None:
    for name, rows in histories.items():
        last = rows[-window:]

        def mean(key):
            return sum(row[key] for row in last) / len(last)

        drafts = sorted(key for key in rows[-1] if key.startswith("rollout/draft_") and key.endswith("acceptance_rate"))
        shown = ", ".join(f"{key.split('/')[1]} {mean(key):.1f}%" for key in drafts)
        print(f"{name}: last {window} steps: reward {mean('train/reward'):.3f}, {shown}, tokens per decode step {mean('rollout/tokens_per_decode_step'):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_RECIPE))
    parser.add_argument("-o", "--output", type=Path, default=REPO_ROOT / "examples" / "mtp_trained_vs_frozen.png")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    sys.path.insert(0, str(REPO_ROOT))
    from nemo_rl_mtp.distributed.ray_cluster import shutdown_ray
    from nemo_rl_mtp.utils.console import quiet_third_party_output

    quiet_third_party_output()
    with tempfile.TemporaryDirectory() as log_dir:
        try:
            histories = {name: run_arm(args.config, args.overrides, name, log_dir) for name in ARMS}
        finally:
            shutdown_ray()
    summary(histories)
    plot(histories, args.output)
    print(f"figure: {args.output}")


if __name__ == "__main__":
    main()
