"""Joining a real two-node Ray cluster on this machine (a head and a second raylet, started with
``ray start`` as an operator would, token authentication on, uv not on the nodes' PATH); a local
run that ignores what an earlier Ray left behind; a SIGTERM while Ray starts ends the run."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from nemo_rl_mtp.reporting.logger import read_metrics
from tests.support.helpers import SMALL_GRPO_STEP, free_port

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
NODE_PATH = f"{VENV_BIN}:/usr/bin:/bin"
QUIET = ["logger.wandb_enabled=false", "logger.tensorboard_enabled=false", "checkpointing.enabled=false"]


def _ray(*args: str, env: dict) -> None:
    completed = subprocess.run([str(VENV_BIN / "ray"), *args], env=env, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-2000:]


@pytest.fixture(scope="module")
def two_node_cluster():
    """``ray start --head`` and a second ``ray start --address``, one CPU each, in a private temp
    directory (so nothing else on the machine finds them), PATH without uv; killed afterwards."""
    temp_dir = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths must fit
    port = free_port()
    env = {**os.environ, "PATH": NODE_PATH, "RAY_AUTH_MODE": "token"}
    env.pop("VIRTUAL_ENV", None)
    assert shutil.which("uv", path=NODE_PATH) is None, f"the nodes' PATH ({NODE_PATH}) must not have uv"
    try:
        _ray("start", "--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}", env=env)
        _ray("start", f"--address=127.0.0.1:{port}", "--num-cpus=1", "--disable-usage-stats", f"--temp-dir={temp_dir}", env=env)
        yield f"127.0.0.1:{port}"
    finally:
        for process in psutil.process_iter(["cmdline"]):
            if any(temp_dir in part for part in process.info["cmdline"] or ()):
                process.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _run(log_dir: Path, run_name: str, *overrides: str, env: dict | None = None, under_uv_run: bool = False) -> subprocess.CompletedProcess:
    """The driver, as a user starts it; ``under_uv_run``: as ``uv run`` (named ``uv``, as from a
    shell's PATH) starts it, which is what Ray's uv integration looks for in the driver's parents."""
    uv_run = ["uv", "run", "--frozen", "--no-sync"] if under_uv_run else []
    command = [
        *uv_run,
        sys.executable, str(REPO_ROOT / "examples" / "run_grpo.py"), *SMALL_GRPO_STEP, *QUIET, "grpo.max_num_steps=1",
        f"logger.log_dir={log_dir}", f"logger.run_name={run_name}", *overrides,
    ]  # fmt: skip
    return subprocess.run(
        command, executable=shutil.which("uv") if under_uv_run else None, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
        env=env or {**os.environ, "RAY_AUTH_MODE": "token"},
    )  # fmt: skip


def test_a_run_joins_two_nodes_with_the_drivers_python(two_node_cluster, tmp_path):
    """Started by ``uv run`` too: the default worker_python=driver switches Ray's uv hook off."""
    completed = _run(tmp_path, "driver_python", f"cluster.address={two_node_cluster}", "cluster.num_nodes=2", under_uv_run=True)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "cluster: 2 node(s) start workers" in completed.stderr
    assert len(read_metrics(tmp_path / "driver_python" / "metrics.jsonl")) == 1


def test_a_node_that_cannot_start_a_worker_fails_the_run_in_one_line_naming_it(two_node_cluster, tmp_path):
    """A driver started by ``uv run``, with Ray's uv integration: the nodes, whose PATH has no uv,
    never start a worker; Ray alone would retry for minutes."""
    start = time.monotonic()
    completed = _run(
        tmp_path, "uv_python", f"cluster.address={two_node_cluster}", "cluster.num_nodes=2", "cluster.worker_python=uv", "cluster.node_probe_timeout_s=20",
        under_uv_run=True,
    )  # fmt: skip
    errors = [line for line in completed.stderr.splitlines() if line.startswith("error:")]
    assert completed.returncode == 1 and len(errors) == 1, completed.stderr[-3000:]
    assert re.search(r"cluster: node [\d.]+ started no worker within 20 s with Ray's uv integration.*: \S", errors[0]), errors[0]
    assert time.monotonic() - start < 120


def test_without_an_address_a_run_starts_its_own_ray_whatever_an_earlier_one_left_behind():
    """A crashed cluster leaves its address in Ray's temp directory; ``ray.init()`` would try to
    join it (about 100 s of waiting, then an error). The driver's Ray start, in a process of its own."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    script = (
        "from nemo_rl_mtp.cluster.ray_cluster import init_ray, shutdown_ray\n"
        "from nemo_rl_mtp.config.load import load_config\n"
        "init_ray(load_config().cluster)\n"
        "import ray; print('CPUs', ray.cluster_resources()['CPU'])\n"
        "shutdown_ray()\n"
    )
    try:
        (ray_tmp / "ray").mkdir()
        (ray_tmp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{free_port()}")  # nothing listens there
        start = time.monotonic()
        completed = subprocess.run(
            [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "RAY_TMPDIR": str(ray_tmp)}
        )
        assert completed.returncode == 0 and "CPUs" in completed.stdout, completed.stderr[-3000:]
        assert "Connecting to existing Ray cluster" not in completed.stderr
        assert time.monotonic() - start < 60
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _session_processes(session: int) -> list[int]:
    """The processes still in the session ``session`` leads (a driver's Ray processes stay in it)."""
    alive = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == session and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process.pid)
        except (OSError, psutil.Error):
            continue
    return alive


def test_a_sigterm_while_ray_starts_ends_the_run_in_one_line(tmp_path):
    """Ray's own SIGTERM handler is in place during ``ray.init``; it must end the run as any
    SIGTERM does: exit status 143 and the interrupted line, and no Ray process left running."""
    command = [sys.executable, str(REPO_ROOT / "examples" / "run_grpo.py"), *QUIET, f"logger.log_dir={tmp_path}", "logger.run_name=sigterm"]
    process = subprocess.Popen(command, cwd=REPO_ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, start_new_session=True)
    for line in process.stderr:
        if "starting a local Ray instance" in line:
            time.sleep(0.3)  # inside ray.init
            process.send_signal(signal.SIGTERM)
            break
    rest = process.stderr.read()
    process.wait(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, rest[-2000:]
    assert [line for line in rest.splitlines() if line.startswith("interrupted:")], rest[-2000:]
    deadline = time.monotonic() + 15
    while _session_processes(process.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _session_processes(process.pid) == []
