"""The package's GRPO command (``nemo_rl_mtp.cli``): the recipe a run without ``--config``
loads is the one its caller names, and the command runs from outside the checkout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_rl_mtp.cli import main
from nemo_rl_mtp.reporting.console import EXIT_CONFIG_ERROR


@pytest.fixture
def signal_handlers_restored():
    """main installs its SIGINT/SIGTERM handlers; pytest's come back afterwards."""
    saved = {handled: signal.getsignal(handled) for handled in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for handled, handler in saved.items():
            signal.signal(handled, handler)


def test_without_config_the_callers_default_recipe_is_loaded(tmp_path, capsys, signal_handlers_restored):
    default = tmp_path / "default_recipe.yaml"
    default.write_text("defaults: grpo_mtp.yaml\npolicy:\n  megatron_cfg:\n    mtp_layerz: 2\n")
    assert main([], default_config=default) == EXIT_CONFIG_ERROR
    error = capsys.readouterr().err
    assert "default_recipe.yaml" in error and "mtp_layerz" in error
    # --config replaces the default (the default's bad key is never read).
    other = tmp_path / "other_recipe.yaml"
    other.write_text("defaults: grpo_mtp.yaml\ngrpo:\n  num_prompts_per_step: 0\n")
    assert main(["--config", str(other)], default_config=default) == EXIT_CONFIG_ERROR
    error = capsys.readouterr().err
    assert "grpo.num_prompts_per_step=0" in error and "mtp_layerz" not in error


@pytest.mark.parametrize("entry", ["python -m", "console script"])
def test_the_command_runs_outside_the_checkout(tmp_path, entry):
    """``python -m`` and the installed ``nemo-rl-mtp-grpo`` command (``[project.scripts]``), from
    another directory: no recipe by default (the packaged exemplar alone)."""
    command = [sys.executable, "-m", "nemo_rl_mtp.cli"] if entry == "python -m" else [str(Path(sys.executable).parent / "nemo-rl-mtp-grpo")]
    shown = subprocess.run([*command, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "default: None; None: the packaged exemplar alone" in " ".join(shown.stdout.split())
    refused = subprocess.run([*command, "grpo.num_prompts_per_step=0"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert refused.returncode == EXIT_CONFIG_ERROR
    assert "grpo.num_prompts_per_step=0: must be in [1, inf)" in refused.stderr


def test_a_run_refused_at_preflight_leaves_no_run_directory(tmp_path, capsys, signal_handlers_restored):
    """The preflight checks (this machine's CPUs) run after the default run name is claimed by
    creating its directory; the refused run gives it back, and says why in one line."""
    too_many = (os.cpu_count() or 1) + 1
    status = main([f"cluster.cpus_per_worker={too_many}", f"logger.log_dir={tmp_path}"])
    error = capsys.readouterr().err.strip()
    assert status == EXIT_CONFIG_ERROR
    assert error.splitlines()[-1].startswith("config error: cluster.workers_per_node=1: needs")
    assert f"cluster.cpus_per_worker={too_many}" in error
    assert list(tmp_path.iterdir()) == []
