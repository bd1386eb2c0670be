"""The default recipe learns: a warm start on the task's answers, then GRPO, reaches high
accuracy on prompts it never trained on, with the MTP head trained alongside and drafting in
the rollouts where auto finds that it pays."""

from __future__ import annotations

import statistics

import pytest

from nemo_rl_mtp.grpo.checked_config import load_checked_config
from nemo_rl_mtp.reporting.logger import read_metrics
from tests.support.helpers import DEFAULT_RECIPE, run_grpo
from tests.support.engine_cases import speculation_skip_reason

pytestmark = pytest.mark.slow


def test_default_recipe_reaches_high_validation_accuracy_with_the_mtp_head_trained(tmp_path):
    cfg = load_checked_config(DEFAULT_RECIPE)
    argv = [
        f"logger.log_dir={tmp_path}",
        "logger.run_name=learns",
        "logger.console=false",
        "logger.wandb_enabled=false",
        "logger.tensorboard_enabled=false",
    ]
    assert run_grpo(argv) == 0
    rows = read_metrics(tmp_path / "learns" / "metrics.jsonl")
    assert len(rows) == cfg.grpo.max_num_steps
    validated = [row for row in rows if "val/accuracy" in row]
    assert len(validated) == cfg.grpo.max_num_steps // cfg.grpo.val_period + 1  # step 0, every period
    window = 10

    def end(key):
        return statistics.mean(row[key] for row in rows[-window:])

    if speculation_skip_reason() is not None:  # auto chose 0 at config load: nothing measured, nothing drafted
        assert not [key for row in rows for key in row if key.startswith(("rollout/num_speculative_tokens", "rollout/draft_"))]
        rows = [{**row, "rollout/num_speculative_tokens": 0.0} for row in rows]
    drafting = [row for row in rows if row["rollout/num_speculative_tokens"] == 1]
    print(
        f"warm start: MTP acceptance {rows[0]['warmup/mtp/mtp_1_acceptance_rate']:.0f}%; val accuracy "
        f"{validated[0]['val/accuracy']:.3f} -> {validated[-1]['val/accuracy']:.3f}; reward {rows[0]['train/reward']:.3f} -> "
        f"{end('train/reward'):.3f}; MTP acceptance {end('train/mtp/mtp_1_acceptance_rate'):.1f}%; auto drafted in "
        f"{len(drafting)} of {len(rows)} steps, tokens per decode step there "
        f"{statistics.mean(row['rollout/tokens_per_decode_step'] for row in drafting) if drafting else float('nan'):.2f}"
    )
    assert rows[0]["warmup/mtp/mtp_1_acceptance_rate"] > 80  # the warm start is logged, with the MTP head
    assert validated[-1]["val/accuracy"] >= 0.9 and validated[-1]["val/accuracy"] >= validated[0]["val/accuracy"]
    assert end("train/reward") > 0.9
    assert end("train/mtp/mtp_1_acceptance_rate") > 90
    assert all(row["rollout/num_speculative_tokens"] in (0, 1) for row in rows)
    assert all(row["rollout/tokens_per_decode_step"] > 1.2 for row in drafting[len(drafting) // 2 :])
