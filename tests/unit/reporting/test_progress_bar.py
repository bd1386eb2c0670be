"""The progress bar of a run (``reporting.logger.Logger`` with ``console``), read as a user reads it."""

from __future__ import annotations

from omegaconf import OmegaConf

from nemo_rl_mtp.metrics import NUM_SPECULATIVE_TOKENS, ROLLOUT, TOKENS_PER_DECODE_STEP, in_scope
from nemo_rl_mtp.reporting.logger import Logger


def test_with_auto_the_bar_shows_each_rollouts_k_beside_the_latest_drafting_rollouts_tokens_per_step(tmp_path):
    """A rollout at k = 0 logs no tokens per decode step, so the bar keeps the latest drafting
    rollout's 1.8 (on 2026-12-07 that read as "auto drafted most of the run" where it ran k = 0 in
    127 of 150 rollouts). The bar shows the rollout's k beside it: 1, then 0."""
    logger_cfg = OmegaConf.create(
        {"log_dir": str(tmp_path), "run_name": None, "console": True, "tensorboard_enabled": False, "wandb_enabled": False,
         "wandb": {"project": "p", "mode": "disabled"}}
    )  # fmt: skip
    logger = Logger(logger_cfg, tmp_path / "run", OmegaConf.create({}), total_steps=2)
    try:
        logger.log({in_scope(ROLLOUT, NUM_SPECULATIVE_TOKENS): 1.0, in_scope(ROLLOUT, TOKENS_PER_DECODE_STEP): 1.8}, step=0)
        assert (logger.shown["k"], logger.shown["tok/step"]) == ("1", "1.8")
        logger.log({in_scope(ROLLOUT, NUM_SPECULATIVE_TOKENS): 0.0}, step=1)
        assert (logger.shown["k"], logger.shown["tok/step"]) == ("0", "1.8")
    finally:
        logger.close()
