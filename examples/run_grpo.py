"""GRPO with MTP training, from a YAML recipe and Hydra-style overrides.

    uv run examples/run_grpo.py                                   # the tiny CPU default recipe
    uv run examples/run_grpo.py --config examples/configs/<recipe>.yaml key=value ...
    uv run examples/run_grpo.py policy.megatron_cfg.mtp_num_layers=2 grpo.max_num_steps=20
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from nemo_rl_mtp.utils.config import ConfigError, load_config

DEFAULT_RECIPE = Path(__file__).resolve().parent / "configs" / "grpo_mtp_tiny_cpu.yaml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="GRPO with Multi-Token Prediction on megatron-core")
    parser.add_argument("--config", default=str(DEFAULT_RECIPE), help="recipe YAML (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. grpo.max_num_steps=20")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing run directory of the same logger.run_name"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)  # before the heavy imports: bad input fails in a second
        from nemo_rl_mtp.algorithms.grpo import grpo_train

        # Checks the config against this machine and the run directory before any worker starts;
        # resumes from the run directory's latest checkpoint when it has one.
        history = grpo_train(cfg, overwrite=args.overwrite)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    first, last = history[0], history[-1]
    print(f"reward: {first['train/reward']:.3f} -> {last['train/reward']:.3f} over {len(history)} steps")
    for key in sorted(k for k in last if k.endswith("acceptance_rate")):
        print(f"{key}: {first[key]:.1f}% -> {last[key]:.1f}%")
    if "rollout/tokens_per_decode_step" in last:
        print(f"rollout/tokens_per_decode_step: {first['rollout/tokens_per_decode_step']:.2f} -> {last['rollout/tokens_per_decode_step']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
