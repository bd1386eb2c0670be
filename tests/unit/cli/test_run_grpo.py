"""The package's GRPO command (``nemo_rl_mtp.cli``): the recipe a run without ``--config``
loads is the one its caller names, and the command runs from outside the checkout."""

from __future__ import annotations

import importlib.util
import json
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


REPO_ROOT = Path(__file__).resolve().parents[3]


def test_files_the_config_names_are_refused_before_megatron_is_imported(tmp_path):
    """A missing checkpoint directory, a bad JSONL line and a run directory holding an earlier run
    (``benchmarks.config_refusal``'s bad files, which it times) are each refused in one line by the
    run's preflight, in a process that never imports megatron-core (its import alone takes over
    10 s here); an --overwrite of that earlier run is not carried out by a refused run: nothing is
    lost."""
    from benchmarks.config_refusal import file_cases

    bad_files = file_cases(tmp_path)
    earlier = tmp_path / "logs" / "earlier"
    bad_jsonl, refusal = bad_files["bad JSONL line"]
    cases = [*bad_files.values(), ([*bad_jsonl, "logger.run_name=earlier", "--overwrite"], refusal)]
    code = (
        "import contextlib, io, json, sys\n"
        "from nemo_rl_mtp.cli import main\n"
        "seen = []\n"
        f"for argv in {[argv for argv, _ in cases]!r}:\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        status = main(argv)\n"
        "    seen.append([status, [line for line in err.getvalue().splitlines() if line.startswith('config error')]])\n"
        "print(json.dumps({'seen': seen, 'megatron': 'megatron' in sys.modules}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for (_, expected), (status, errors) in zip(cases, result["seen"]):
        assert status == EXIT_CONFIG_ERROR and len(errors) == 1 and expected in errors[0], (expected, errors)
    assert result["megatron"] is False
    assert (earlier / "metrics.jsonl").read_text() == '{"step": 0}\n'  # the refused --overwrite removed nothing


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="transformer_engine is installed here")
def test_transformer_engine_asked_for_where_it_is_not_installed_is_refused_in_one_line(tmp_path, capsys, signal_handlers_restored):
    status = main(["policy.megatron_cfg.transformer_impl=transformer_engine", "policy.sequence_packing.enabled=false", f"logger.log_dir={tmp_path}"])
    error = capsys.readouterr().err.strip()
    assert status == EXIT_CONFIG_ERROR
    assert error.splitlines()[-1].startswith("config error: policy.megatron_cfg.transformer_impl=transformer_engine, but transformer_engine is not installed")
    assert list(tmp_path.iterdir()) == []
