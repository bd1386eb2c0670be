"""GRPO with MTP training from the command line: a YAML recipe and Hydra-style overrides.

    python -m nemo_rl_mtp.cli [--config <recipe>.yaml] key=value ...
    uv run examples/run_grpo.py [--config <recipe>.yaml] key=value ...   # in a checkout

Without ``--config`` a run uses ``default_config``, which the caller names: ``examples/run_grpo.py``
passes the tiny CPU recipe next to it; ``python -m`` passes none, so an installed package (no
checkout, no recipes) runs the packaged exemplar alone, itself a tiny model that trains on a CPU.
The package never looks for a checkout: where the recipes are is the entry script's knowledge.

Module level imports nothing heavy (no torch, megatron, ray or the GRPO loop): a config is checked
purely first, so a bad one is refused (exit 2, one line) in about a second; then the run's
machinery is imported (torch), the files the config names are checked (a few seconds), and only
then is the installed release asked what it can do (which imports megatron-core).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from nemo_rl_mtp.config.load import ConfigError
from nemo_rl_mtp.grpo.checked_config import load_pure_checked_config
from nemo_rl_mtp.reporting.console import (
    EXIT_CONFIG_ERROR,
    EXIT_ERROR,
    VERBOSE_ENV,
    interrupt_exit_status,
    interrupt_once_on_signals,
    one_line,
    quiet_third_party_output,
    restartable_as,
)


def main(argv: list[str] | None = None, default_config: str | Path | None = None) -> int:
    """Parse ``argv`` (``sys.argv[1:]`` when None), train, print the run's summary; the exit status.

    ``default_config`` is the recipe used without ``--config``; None: the packaged exemplar alone.
    """
    parser = argparse.ArgumentParser(description="GRPO with Multi-Token Prediction on megatron-core")
    parser.add_argument(
        "--config",
        default=None if default_config is None else str(default_config),
        help="recipe YAML (default: %(default)s; None: the packaged exemplar alone)",
    )
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. grpo.max_num_steps=20")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing run directory of the same logger.run_name"
    )
    parser.add_argument("--verbose", action="store_true", help="debug logging, and full tracebacks on errors")
    args = parser.parse_intermixed_args(argv)  # overrides may come before or after the flags
    start = time.monotonic()
    if args.verbose:
        os.environ[VERBOSE_ENV] = "1"
    quiet_third_party_output()
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    interrupt_once_on_signals()
    if argv is None:  # run as a program: a Ray start that dies in Ray's C++ may run it again (cluster/ray_cluster.py)
        restartable_as([sys.executable, *sys.orig_argv[1:]])
    ray_was_running = ray_is_running()
    cfg = None
    try:
        # The pure checks first, with nothing heavy imported: bad input fails in about a second.
        # The files the config names and what the installed release can do are checked by
        # grpo.run.prepare_run, in that order, before any worker starts.
        cfg = load_pure_checked_config(args.config, args.overrides)
        from nemo_rl_mtp.grpo.loop import grpo_train
        from nemo_rl_mtp.grpo.run import run_named

        # Named here, for the resume hint; a run that fails before writing anything gives its
        # claimed directory back. Checks the config against this machine and the run directory
        # before any worker starts; resumes from the run directory's latest checkpoint if any.
        with run_named(cfg) as cfg:
            history = grpo_train(cfg, overwrite=args.overwrite)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except KeyboardInterrupt as interrupt:
        print(f"interrupted: {resume_hint(cfg)}", file=sys.stderr)
        return interrupt_exit_status(interrupt)
    except Exception as error:
        if args.verbose:
            raise
        print(f"error: {one_line(error)} (--verbose shows the traceback)", file=sys.stderr)
        return EXIT_ERROR
    finally:
        stop_ray(ray_was_running)
    print_summary(cfg, history, time.monotonic() - start)
    return 0


def resume_hint(cfg) -> str:
    """Where an interrupted run can continue from, and the command line that continues it."""
    if cfg is None or cfg.logger.run_name is None:
        return "the run had not started"
    from nemo_rl_mtp.grpo.run import latest_checkpoint

    latest = latest_checkpoint(cfg)
    if latest is None:
        return f"no checkpoint of run {cfg.logger.run_name} yet (checkpointing.enabled={cfg.checkpointing.enabled})"
    return f"run again with logger.run_name={cfg.logger.run_name} to resume from {latest}"


def ray_is_running() -> bool:
    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


def stop_ray(was_running: bool) -> None:
    """Stop the Ray instance this call started (a caller's own instance is left running)."""
    if ray_is_running() and not was_running:
        from nemo_rl_mtp.cluster.ray_cluster import shutdown_ray

        shutdown_ray()


def print_summary(cfg, history: list[dict[str, float]], wall_s: float) -> None:
    """The run's figure, drawn now, and its summary."""
    from nemo_rl_mtp.grpo.run import run_directory
    from nemo_rl_mtp.reporting.plot import plot_run
    from nemo_rl_mtp.reporting.summary import run_summary

    run_dir = run_directory(cfg.logger)
    figure = plot_run(run_dir / "metrics.jsonl", run_dir / "mtp_run.png")
    print(run_summary(history, run_dir, wall_s, figure))


if __name__ == "__main__":
    sys.exit(main())
