"""Export a run's checkpoint (trained MTP heads included) as a Hugging Face checkpoint, for vLLM,
SGLang or transformers; NeMo-RL's converter flags.

    uv run examples/converters/convert_megatron_to_hf.py --config logs/<run>/config.yaml \\
        --megatron-ckpt-path logs/<run>/checkpoints/step_000100 --hf-ckpt-path exported/<run>

Works for runs started from a Hugging Face checkpoint (policy.model_name), from a checkpoint of
any parallel layout, on one process (CPU or GPU).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from nemo_rl_mtp.config.load import ConfigError
from nemo_rl_mtp.grpo.checked_config import load_checked_saved_config
from nemo_rl_mtp.reporting.console import EXIT_CONFIG_ERROR, EXIT_ERROR, one_line, quiet_third_party_output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Export a run's checkpoint as a Hugging Face checkpoint")
    parser.add_argument("--config", required=True, help="the run's config.yaml (logs/<run>/config.yaml)")
    parser.add_argument("--megatron-ckpt-path", required=True, help="a checkpoint of the run (logs/<run>/checkpoints/step_N)")
    parser.add_argument("--hf-ckpt-path", required=True, help="directory to write the Hugging Face checkpoint into")
    parser.add_argument("--verbose", action="store_true", help="full tracebacks and third-party output")
    args = parser.parse_args(argv)
    if not args.verbose:
        quiet_third_party_output()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_checked_saved_config(args.config)
        from nemo_rl_mtp.training.hf_export import export_run_checkpoint

        out = export_run_checkpoint(cfg, Path(args.megatron_ckpt_path), Path(args.hf_ckpt_path))
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except Exception as error:
        if args.verbose:
            raise
        print(f"error: {one_line(error)} (--verbose shows the traceback)", file=sys.stderr)
        return EXIT_ERROR
    print(f"exported to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
