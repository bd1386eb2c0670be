"""The default command tells the RL story: from a warm start that mostly answers the wrong task,
GRPO moves the policy (validation accuracy on prompts it never trained on rises, KL to the start of
RL grows), while the MTP head trains alongside, keeps its rollout acceptance and drafts where auto
finds that it pays."""

from __future__ import annotations

import statistics

import pytest

from nemo_rl_mtp.grpo.checked_config import load_checked_config
from nemo_rl_mtp.reporting.logger import read_metrics
from tests.support.engine_cases import speculation_skip_reason
from tests.support.helpers import DEFAULT_RECIPE, run_grpo

pytestmark = pytest.mark.slow

# Validation is greedy, so a policy GRPO did not move keeps its accuracy (within about 0.05 as it
# drifts); one that GRPO moved gained, from the first validation to the mean of the last three,
# 0.26-0.58 over seeds 1-6 at k = 0 and 0.21-0.25 at the recipe's seed 42 (its lowest: k = 0, and
# a CI run whose last validation dipped, 0.531 -> 0.430; docs/results.md). The mean of the last
# three, not the last alone, keeps one dip from deciding.
MIN_ACCURACY_GAIN = 0.15
LAST_VALIDATIONS = 3
WINDOW = 10


def test_default_recipe_moves_the_policy_while_the_mtp_head_keeps_its_acceptance(tmp_path):
    cfg = load_checked_config(DEFAULT_RECIPE)
    argv = [
        f"logger.log_dir={tmp_path}",
        "logger.run_name=learns",
        "logger.console=false",
        "logger.wandb_enabled=false",
        "logger.tensorboard_enabled=false",
    ]
    assert run_grpo(argv, recipe=DEFAULT_RECIPE) == 0
    rows = read_metrics(tmp_path / "learns" / "metrics.jsonl")
    assert len(rows) == cfg.grpo.max_num_steps
    validated = [row for row in rows if "val/accuracy" in row]
    assert len(validated) == cfg.grpo.max_num_steps // cfg.grpo.val_period + 1  # step 0, every period

    def mean(rows_, key):
        return statistics.mean(row[key] for row in rows_)

    if speculation_skip_reason() is not None:  # auto chose 0 at config load: nothing measured, nothing drafted
        assert not [key for row in rows for key in row if key.startswith(("rollout/num_speculative_tokens", "rollout/draft_"))]
        rows = [{**row, "rollout/num_speculative_tokens": 0.0} for row in rows]
    drafting = [row for row in rows if row["rollout/num_speculative_tokens"] == 1]
    gain = mean(validated[-LAST_VALIDATIONS:], "val/accuracy") - validated[0]["val/accuracy"]
    print(
        f"warm start: MTP acceptance {rows[0]['warmup/mtp/mtp_1_acceptance_rate']:.0f}%; val accuracy "
        f"{validated[0]['val/accuracy']:.3f} -> {validated[-1]['val/accuracy']:.3f}; reward {mean(rows[:WINDOW], 'train/reward'):.3f} -> "
        f"{mean(rows[-WINDOW:], 'train/reward'):.3f}; KL to start {mean(rows[-WINDOW:], 'train/kl_to_start'):.2f}; auto drafted in "
        f"{len(drafting)} of {len(rows)} steps"
    )
    assert rows[0]["warmup/mtp/mtp_1_acceptance_rate"] > 80  # the warm start is logged, with the MTP head
    # GRPO moved the policy: accuracy and reward up, away from where RL started.
    assert gain >= MIN_ACCURACY_GAIN, gain
    assert mean(rows[-WINDOW:], "train/reward") > mean(rows[:WINDOW], "train/reward") + 0.15
    assert mean(rows[-WINDOW:], "train/kl_to_start") > 0.2
    assert all(row["rollout/num_speculative_tokens"] in (0, 1) for row in rows)
    # The head kept up: the trainer's forecast of its acceptance (every step, drafting or not) ...
    forecast = "train/mtp/mtp_1_expected_acceptance"
    assert mean(rows[-WINDOW:], forecast) > mean(rows[:WINDOW], forecast) - 10
    # ... and its measured rollout acceptance where auto drafted (within per-step noise).
    if len(drafting) >= 2 * WINDOW:
        first, last = mean(drafting[:WINDOW], "rollout/draft_1_acceptance_rate"), mean(drafting[-WINDOW:], "rollout/draft_1_acceptance_rate")
        assert last > first - 10 and last > 60, (first, last)
        assert all(row["rollout/tokens_per_decode_step"] > 1.2 for row in drafting[len(drafting) // 2 :])
