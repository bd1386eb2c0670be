"""The default recipe learns: over its budget the reward rises clearly, and as the policy sharpens
the MTP heads' acceptance rises with it, in training and in the speculative rollouts."""

from __future__ import annotations

import importlib.util
import statistics
from pathlib import Path

import pytest

from nemo_rl_mtp.utils.config import load_config
from nemo_rl_mtp.utils.logger import read_metrics

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("run_grpo", REPO_ROOT / "examples" / "run_grpo.py")
run_grpo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_grpo)


def test_default_recipe_reward_and_mtp_acceptance_rise_in_training_and_rollouts(tmp_path):
    budget = load_config(run_grpo.DEFAULT_RECIPE).grpo.max_num_steps
    argv = [
        f"logger.log_dir={tmp_path}",
        "logger.run_name=learns",
        "logger.console=false",
        "logger.wandb_enabled=false",
        "logger.tensorboard_enabled=false",
    ]
    assert run_grpo.main(argv) == 0
    rows = read_metrics(tmp_path / "learns" / "metrics.jsonl")
    assert len(rows) == budget
    window = 10

    def start_and_end(key):
        values = [row[key] for row in rows]
        return statistics.mean(values[:window]), statistics.mean(values[-window:])

    reward_start, reward_end = start_and_end("train/reward")
    acceptance_start, acceptance_end = start_and_end("train/mtp/mtp_1_acceptance_rate")
    drafts_start, drafts_end = start_and_end("rollout/draft_1_acceptance_rate")
    per_step_start, per_step_end = start_and_end("rollout/tokens_per_decode_step")
    print(
        f"reward {reward_start:.3f} -> {reward_end:.3f}, MTP acceptance {acceptance_start:.1f}% -> {acceptance_end:.1f}%, "
        f"rollout acceptance {drafts_start:.1f}% -> {drafts_end:.1f}%, tokens per decode step {per_step_start:.2f} -> {per_step_end:.2f}"
    )
    assert reward_end > 2 * reward_start and reward_end - reward_start > 0.08
    assert acceptance_end > acceptance_start + 20
    assert drafts_end > drafts_start + 15 and per_step_end > per_step_start + 0.15
