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
        "GRPO moved the policy: validation accuracy 0.500 -> 1.000 (+0.500); the MTP head's rollout acceptance 30.0% -> 45.0% (the first and last of 2 rollouts that drafted)",
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


def test_what_moved_says_whether_grpo_moved_the_policy_and_whether_the_head_kept_up():
    from nemo_rl_mtp.reporting.summary import what_moved

    still = [{"val/accuracy": 0.95, "rollout/draft_1_acceptance_rate": 90.0}, {"val/accuracy": 1.0, "rollout/draft_1_acceptance_rate": 97.0}]
    assert what_moved(still) == (
        "GRPO hardly moved the policy: validation accuracy 0.950 -> 1.000 (+0.050); "
        "the MTP head's rollout acceptance 90.0% -> 97.0% (the first and last of 2 rollouts that drafted)"
    )
    moved = [
        {"val/accuracy": 0.3, "train/kl_to_start": 0.0, "rollout/draft_1_acceptance_rate": 85.0},
        {"train/kl_to_start": 0.5},  # a step without validation or drafts
        {"val/accuracy": 0.7, "train/kl_to_start": 0.8, "rollout/draft_1_acceptance_rate": 70.0},
    ]
    assert what_moved(moved) == (
        "GRPO moved the policy: validation accuracy 0.300 -> 0.700 (+0.400), KL to the start of RL 0.80 nats/token; "
        "the MTP head's rollout acceptance 85.0% -> 70.0% (the first and last of 2 rollouts that drafted)"
    )
    assert what_moved([{"train/reward": 1.0}]) == ""  # no validation: nothing to say


def test_the_heads_acceptance_is_averaged_over_ten_steps_at_each_end():
    from nemo_rl_mtp.reporting.summary import what_moved

    history = [{"val/accuracy": 0.2, "rollout/draft_1_acceptance_rate": 80.0}]
    history += [{"rollout/draft_1_acceptance_rate": value} for value in [80.0] * 9 + [50.0] * 15 + [70.0] * 10]
    history[-1]["val/accuracy"] = 0.6
    assert what_moved(history).endswith("the MTP head's rollout acceptance 80.0% -> 70.0% (means of the first and last 10 of 35 rollouts that drafted)")


def test_the_kl_to_the_start_of_rl_is_the_mean_of_the_last_ten_steps():
    """A fresh-clone run's last step read 2.85 nats/token where the ten before it read 0.4-1.0:
    the line gives the mean of the last ten steps, and says so; the start, where the KL is 0 by
    construction, is never averaged in (a short run takes the last half)."""
    from nemo_rl_mtp.reporting.summary import what_moved

    kl = [0.0] + [0.5] * 19 + [0.6] * 9 + [3.0]
    history = [{"train/kl_to_start": value} for value in kl]
    history[0]["val/accuracy"], history[-1]["val/accuracy"] = 0.3, 0.5
    assert what_moved(history) == (
        "GRPO moved the policy: validation accuracy 0.300 -> 0.500 (+0.200), KL to the start of RL 0.84 nats/token (mean of the last 10 steps)"
    )
    short = [{"train/kl_to_start": value} for value in (0.0, 0.2, 0.4, 0.6)]
    short[0]["val/accuracy"], short[-1]["val/accuracy"] = 0.3, 0.5
    assert what_moved(short).endswith("KL to the start of RL 0.50 nats/token (mean of the last 2 steps)")


def test_a_run_that_drafted_once_says_so_and_gives_the_trainers_forecast_instead_of_first_to_last():
    """auto may run k = 0 at every step but one: one rollout's acceptance is no "first -> last".
    The summary says it drafted once and adds the trainer's forecast, first -> last; the
    per-key lines say "logged at one step only". Control: two drafted steps give first -> last."""
    from nemo_rl_mtp.reporting.summary import what_moved

    once = [
        {"val/accuracy": 0.3, "rollout/draft_1_acceptance_rate": 85.4, "train/mtp/mtp_1_expected_acceptance": 85.7},
        {"train/mtp/mtp_1_expected_acceptance": 80.0},
        {"val/accuracy": 0.7, "train/mtp/mtp_1_expected_acceptance": 74.4},
    ]
    assert what_moved(once) == (
        "GRPO moved the policy: validation accuracy 0.300 -> 0.700 (+0.400); "
        "the MTP head's rollout acceptance 85.4% (only one rollout drafted), its forecast from training 85.7% -> 74.4%"
    )
    lines = run_summary(once, Path("logs/run"), 5.0, Path("logs/run/mtp_run.png")).splitlines()
    assert "rollout/draft_1_acceptance_rate: 85.4% (logged at one step only)" in lines
    assert "train/mtp/mtp_1_expected_acceptance: 85.7% -> 74.4%" in lines
    twice = [dict(once[0]), {"val/accuracy": 0.7, "rollout/draft_1_acceptance_rate": 80.0}]
    assert what_moved(twice).endswith("the MTP head's rollout acceptance 85.4% -> 80.0% (the first and last of 2 rollouts that drafted)")
