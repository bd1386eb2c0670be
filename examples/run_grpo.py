"""GRPO with MTP training, from a YAML recipe and Hydra-style overrides (the command-line logic is
``nemo_rl_mtp.cli``; this script only names its default recipe).

    uv run examples/run_grpo.py                                   # the default: examples/configs/grpo_mtp_default_tiny_cpu.yaml
    uv run examples/run_grpo.py --config examples/configs/<recipe>.yaml key=value ...
    uv run examples/run_grpo.py policy.megatron_cfg.mtp_num_layers=2 grpo.max_num_steps=20
"""

from __future__ import annotations

import sys
from pathlib import Path

from nemo_rl_mtp.cli import main

DEFAULT_RECIPE = Path(__file__).resolve().parent / "configs" / "grpo_mtp_default_tiny_cpu.yaml"

if __name__ == "__main__":
    sys.exit(main(default_config=DEFAULT_RECIPE))
