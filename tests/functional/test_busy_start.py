"""The default command on a busy machine and next to another run (issue 27): the default recipe's
first steps next to a busy loop on every core, and two default runs started at once, each with
its own Ray instance and run directory, and a third started while they run. Runs are started as
a user starts them (subprocesses of ``examples/run_grpo.py``); short: two GRPO steps after two
imitation steps."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from benchmarks.startup_breakdown import busy_cores
from nemo_rl_mtp.reporting.logger import read_metrics

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]

SHORT = [
    "grpo.max_num_steps=2", "grpo.warmup_imitation_steps=2", "grpo.val_num_prompts=8", "logger.console=false",
    "logger.wandb_enabled=false", "logger.tensorboard_enabled=false", "checkpointing.enabled=false",
]  # fmt: skip
RUN_LIMIT_S = 900


def _start(log_dir: Path, *overrides: str) -> subprocess.Popen:
    command = [sys.executable, str(REPO_ROOT / "examples" / "run_grpo.py"), *SHORT, f"logger.log_dir={log_dir}", *overrides]
    return subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _finish(process: subprocess.Popen) -> tuple[int, str]:
    try:
        _, stderr = process.communicate(timeout=RUN_LIMIT_S)
    except subprocess.TimeoutExpired:
        _kill_tree(process.pid)
        _, stderr = process.communicate()
    return process.returncode, stderr


def _kill_tree(pid: int) -> None:
    try:
        parent = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    for process in [*parent.children(recursive=True), parent]:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def _run_directories(log_dir: Path) -> list[Path]:
    return sorted(path for path in log_dir.iterdir() if path.is_dir())


def test_the_default_recipe_starts_and_finishes_next_to_a_busy_loop_on_every_core(tmp_path):
    with busy_cores(True, limit_s=RUN_LIMIT_S):
        returncode, stderr = _finish(_start(tmp_path, "logger.run_name=busy"))
    assert returncode == 0, stderr[-3000:]
    assert len(read_metrics(tmp_path / "busy" / "metrics.jsonl")) == 2


def _has_started_ray(process: subprocess.Popen) -> bool:
    """Its local Ray instance is up: a raylet runs among its descendants."""
    try:
        return any("raylet" in child.name() for child in psutil.Process(process.pid).children(recursive=True))
    except psutil.Error:
        return False


def test_two_default_runs_started_at_once_both_finish_and_a_third_started_while_they_run_too(tmp_path):
    """No run names: the two are named in the same second, so the second claims <name>-2. The
    third starts once both have their Ray instances up (ports, memory and CPUs then held)."""
    start = time.monotonic()
    processes = [_start(tmp_path) for _ in range(2)]
    while not all(_has_started_ray(process) for process in processes) and time.monotonic() - start < RUN_LIMIT_S:
        if any(process.poll() is not None for process in processes):
            break  # one ended before its Ray was seen: its status tells why, below
        time.sleep(1)
    processes.append(_start(tmp_path))
    results = [_finish(process) for process in processes]
    for returncode, stderr in results:
        assert returncode == 0, stderr[-3000:]
    directories = _run_directories(tmp_path)
    assert len(directories) == 3, directories
    for directory in directories:
        assert len(read_metrics(directory / "metrics.jsonl")) == 2
    print(f"two runs at once and a third beside them: {time.monotonic() - start:.0f} s; {[d.name for d in directories]}")
