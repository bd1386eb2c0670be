"""What training the MTP heads during RL buys, on a run where RL moves the policy: the same GRPO
run from the same warm start with the heads frozen at the start of RL
(``policy.mtp_frozen_during_rl``) and trained during RL with each MTP loss
(``policy.megatron_cfg.mtp_loss_type``), several seeds each, same speculation settings. The warm
start trains the heads with cross entropy in every variant, so a seed's variants share it exactly.

One figure (per GRPO step, mean over seeds with the seeds' range shaded): rollout acceptance per
draft position (temperature 1, rejection sampling), tokens per decode step, the trainer's forecast,
the policy's KL to the start of RL and its entropy, reward, validation accuracy and step time. One
table (markdown) of the end of RL: mean over the last ``--window`` steps of each run (validation:
its last value; step time: the median over the run), then mean and range over seeds.

    uv run examples/compare_mtp_heads.py [--config <recipe>] [--seeds 42 1 2] [-o examples/mtp_heads_during_rl.png] [key=value ...]
    uv run examples/compare_mtp_heads.py --from-json logs/mtp_heads_during_rl.json   # figure and table again
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RECIPE = REPO_ROOT / "examples" / "configs" / "grpo_mtp_policy_moves_tiny_cpu.yaml"
VARIANTS = {
    "frozen at start of RL": ["policy.mtp_frozen_during_rl=true"],
    "cross_entropy": ["policy.megatron_cfg.mtp_loss_type=cross_entropy"],
    "soft_cross_entropy": ["policy.megatron_cfg.mtp_loss_type=soft_cross_entropy"],
    "total_variation": ["policy.megatron_cfg.mtp_loss_type=total_variation"],
}
# (key, label, format) of the table's columns; the figure draws the same series.
COLUMNS = [
    ("rollout/draft_{}_acceptance_rate", "rollout acceptance, draft {} (%)", "{:.1f}"),
    ("rollout/tokens_per_decode_step", "tokens per decode step", "{:.3f}"),
    ("train/mtp/mtp_{}_expected_acceptance", "forecast, depth {} (%)", "{:.1f}"),
    ("train/kl_to_start", "KL to start of RL (nats/token)", "{:.3f}"),
    ("train/entropy", "entropy (nats/token)", "{:.3f}"),
    ("train/reward", "reward", "{:.3f}"),
    ("val/accuracy", "validation accuracy", "{:.3f}"),
    ("timing/step_s", "step time, median (s)", "{:.2f}"),
]


def run_variant(config: str, overrides: list[str], variant: str, seed: int, log_dir: str) -> list[dict[str, float]]:
    from nemo_rl_mtp.grpo.loop import grpo_train
    from nemo_rl_mtp.grpo.checked_config import load_checked_config

    quiet = ["logger.console=false", "logger.wandb_enabled=false", "logger.tensorboard_enabled=false", "checkpointing.enabled=false"]
    name = f"{variant.replace(' ', '_')}_seed{seed}"
    cfg = load_checked_config(config, [*overrides, *VARIANTS[variant], f"grpo.seed={seed}", *quiet, f"logger.log_dir={log_dir}", f"logger.run_name={name}"])
    return grpo_train(cfg)


def expand(rows: list[dict]) -> list[tuple[str, str, str]]:
    """(key, label, format) of every column, ``{}`` filled in for each draft position / depth the
    rows hold."""
    columns = []
    for key, label, fmt in COLUMNS:
        depth = 1
        if "{}" not in key:
            columns.append((key, label, fmt))
        while "{}" in key and any(key.format(depth) in row for row in rows):
            columns.append((key.format(depth), label.format(depth), fmt))
            depth += 1
    return columns


def end_of_run(rows: list[dict], key: str, window: int) -> float:
    """The mean over the run's last ``window`` steps; validation: its last value; step time: the
    median over the whole run (other jobs on the machine make single steps slow)."""
    values = [row[key] for row in rows if key in row]
    if key.startswith("timing/"):
        return statistics.median(values)
    return values[-1] if key.startswith("val/") else statistics.mean(values[-window:])


def kept(rows: list[dict]) -> list[dict]:
    """What the table and figure read from each step (the saved histories stay small)."""
    keys = {"step"} | {key for key, _, _ in expand(rows)}
    return [{key: value for key, value in row.items() if key in keys or key.startswith("warmup/")} for row in rows]


def table(histories: dict[str, dict[int, list[dict]]], window: int) -> str:
    """Markdown: one row per variant, each cell the mean over seeds (and their range)."""
    columns = expand(next(iter(next(iter(histories.values())).values())))
    lines = ["| variant | " + " | ".join(label for _, label, _ in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for variant, runs in histories.items():
        cells = []
        for key, _, fmt in columns:
            values = [end_of_run(rows, key, window) for rows in runs.values()]
            cells.append(f"{fmt.format(statistics.mean(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(histories: dict[str, dict[int, list[dict]]], output: Path, smooth: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = expand(next(iter(next(iter(histories.values())).values())))
    figure, axes = plt.subplots(2, (len(panels) + 1) // 2, figsize=(5 * ((len(panels) + 1) // 2), 8))
    for axis, (key, label, _) in zip(axes.flat, panels):
        for colour, (variant, runs) in zip(("C7", "C0", "C1", "C2", "C3"), histories.items()):
            steps = sorted({row["step"] for rows in runs.values() for row in rows if key in row})
            series = [[next(row[key] for row in rows if row["step"] == step) for rows in runs.values()] for step in steps]
            if not key.startswith("val/"):  # per-step values: a moving mean over the last `smooth` steps
                series = [[statistics.mean(column) for column in zip(*series[max(0, i - smooth + 1) : i + 1])] for i in range(len(series))]
            axis.plot(steps, [statistics.mean(values) for values in series], color=colour, label=variant, marker="o" if key.startswith("val/") else None, markersize=3)
            axis.fill_between(steps, [min(values) for values in series], [max(values) for values in series], color=colour, alpha=0.15)
        axis.set(title=label, xlabel="GRPO step")
    axes.flat[0].legend()
    for axis in list(axes.flat)[len(panels):]:
        axis.axis("off")
    seeds = len(next(iter(histories.values())))
    figure.suptitle(
        f"MTP heads during RL on a run where the policy moves: mean over {seeds} seeds, their range shaded "
        f"(per-step series: moving mean over {smooth} steps)"
    )
    figure.tight_layout()
    figure.savefig(output, dpi=90)


def check_same_warm_start(histories: dict[str, dict[int, list[dict]]]) -> None:
    """A seed's variants must share the warm start: its logged metrics must be identical."""
    for seed in next(iter(histories.values())):
        warm = [{key: value for key, value in runs[seed][0].items() if key.startswith("warmup/")} for runs in histories.values()]
        if any(metrics != warm[0] for metrics in warm[1:]):
            raise RuntimeError(f"seed {seed}: the variants' warm starts differ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_RECIPE))
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2])
    parser.add_argument("--window", type=int, default=10, help="steps averaged at the end of each run")
    parser.add_argument("-o", "--output", type=Path, default=REPO_ROOT / "examples" / "mtp_heads_during_rl.png")
    parser.add_argument("--from-json", type=Path, help="redraw from the histories a previous run saved")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    histories_path = REPO_ROOT / "logs" / f"{args.output.stem}.json"
    histories_path.parent.mkdir(exist_ok=True)
    if args.from_json:
        histories = {variant: {int(seed): rows for seed, rows in runs.items()} for variant, runs in json.loads(args.from_json.read_text()).items()}
    else:
        from nemo_rl_mtp.cluster.ray_cluster import shutdown_ray
        from nemo_rl_mtp.reporting.console import quiet_third_party_output

        quiet_third_party_output()
        histories = {variant: {} for variant in VARIANTS}
        with tempfile.TemporaryDirectory() as log_dir:
            try:
                for seed in args.seeds:
                    for variant in VARIANTS:
                        histories[variant][seed] = kept(run_variant(args.config, args.overrides, variant, seed, log_dir))
                        histories_path.write_text(json.dumps(histories))
            finally:
                shutdown_ray()
        check_same_warm_start(histories)
    print(table(histories, args.window))
    plot(histories, args.output, args.window)
    print(f"figure: {args.output}" + ("" if args.from_json else f"; histories: {histories_path}"))


if __name__ == "__main__":
    main()
