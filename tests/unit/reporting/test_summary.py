"""The end-of-run summary picks its per-depth lines out of a run's keys as saved runs spell them."""

from __future__ import annotations

from pathlib import Path

from nemo_rl_mtp.reporting.summary import run_summary


def test_summary_shows_each_depth_and_draft_and_nothing_else_per_depth():
    history = [
        {
            "train/reward": 0.25,
            "val/accuracy": 0.5,
            "train/mtp/mtp_1_loss": 2.0,
            "train/mtp/mtp_2_acceptance_rate": 40.0,
            "train/mtp/mtp_1_expected_acceptance": 50.0,
            "rollout/draft_1_acceptance_rate": 30.0,
            "val/draft_1_acceptance_rate": 35.0,
            "rollout/tokens_per_decode_step": 1.5,
            # Controls: per-depth keys the summary does not show.
            "train/mtp/mtp_1_target_tokens": 100.0,
            "rollout/draft_1_proposed": 10.0,
            "train/loss": 0.1,
        },
        {
            "train/reward": 0.75,
            "val/accuracy": 1.0,
            "train/mtp/mtp_1_loss": 1.0,
            "train/mtp/mtp_2_acceptance_rate": 60.0,
            "train/mtp/mtp_1_expected_acceptance": 70.0,
            "rollout/draft_1_acceptance_rate": 45.0,
            "val/draft_1_acceptance_rate": 55.0,
            "rollout/tokens_per_decode_step": 2.0,
            "train/mtp/mtp_1_target_tokens": 90.0,
            "rollout/draft_1_proposed": 12.0,
            "train/loss": 0.2,
        },
    ]
    summary = run_summary(history, Path("logs/run"), 12.0, Path("logs/run/mtp_run.png"))
    assert summary.splitlines() == [
        "reward: 0.250 -> 0.750",
        "validation accuracy: 0.500 -> 1.000",
        "rollout/draft_1_acceptance_rate: 30.0% -> 45.0%",
        "train/mtp/mtp_1_expected_acceptance: 50.0% -> 70.0%",
        "train/mtp/mtp_1_loss: 2.000 -> 1.000",
        "train/mtp/mtp_2_acceptance_rate: 40.0% -> 60.0%",
        "val/draft_1_acceptance_rate: 35.0% -> 55.0%",
        "rollout/tokens_per_decode_step: 1.50 -> 2.00",
        "2 steps in 12 s (start-up included); logs: logs/run; figure: logs/run/mtp_run.png",
    ]
