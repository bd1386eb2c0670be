"""Nothing lost: real GRPO driver processes killed with SIGKILL mid-run and mid-save, resumed
from their run directory; Ctrl-C and SIGTERM end a run in one line, with every Ray process gone;
runs that would mix are refused; a data-parallel-2 checkpoint resumes at data-parallel 1.

Rollouts are greedy here so that every parallel layout samples the same tokens (sampled rollouts
depend on the data-parallel layout); the MTP loss still trains policy trunk and heads, and the
resumed runs are compared bit for bit, MTP and rollout metrics included."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_rl_mtp.reporting.logger import read_metrics
from tests.support.helpers import SMALL_GRPO_STEP
from tests.support.engine_cases import drafts_where_possible

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    *SMALL_GRPO_STEP,
    "logger.tensorboard_enabled=false",
    "logger.wandb_enabled=false",
    "checkpointing.save_period=2",
    "policy.generation.top_k=1",
    # The recipe's auto chooses k from measured step times; decode steps and draft counts follow k
    # (0 where the release's engine has no speculative decoding).
    f"policy.generation.num_speculative_tokens={drafts_where_possible(1)}",
    # train/kl_to_start after a resume is measured against the saved start of RL, not the resume point.
    "grpo.log_kl_to_start_of_rl=true",
]
STEPS = 4
# Wall-clock dependent: not expected to agree between runs.
TIMING_KEYS = ("timing/", "rollout/tokens_per_s")


def _command(log_dir: Path, run_name: str, *overrides: str) -> list[str]:
    return [
        sys.executable, str(REPO_ROOT / "examples" / "run_grpo.py"), *SMALL, f"grpo.max_num_steps={STEPS}",
        f"logger.log_dir={log_dir}", f"logger.run_name={run_name}", *overrides,
    ]  # fmt: skip


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)


def _kill_when(command: list[str], ready) -> None:
    """Start the driver in its own process group and SIGKILL the group once ``ready()``; a run
    that ends first fails the test with the last lines it wrote to stderr."""
    import tempfile

    with tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
        deadline = time.monotonic() + 300
        while not ready():
            if process.poll() is not None:
                stderr.seek(0)
                tail = " | ".join(stderr.read().strip().splitlines()[-5:])
                raise AssertionError(f"the run ended (status {process.returncode}) before the fault could be injected: {tail}")
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _signal_when(command: list[str], ready, send) -> tuple[subprocess.CompletedProcess, list]:
    """Start the driver in its own process group, call ``send(process)`` once ``ready()``; returns
    the completed process and the driver's descendants (Ray's processes) still alive
    ``RAY_EXIT_GRACE_S`` after it exited."""
    import psutil

    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    while not ready():
        assert process.poll() is None, "the run ended before the signal could be sent"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    descendants = psutil.Process(process.pid).children(recursive=True)
    send(process)
    stdout, stderr = process.communicate(timeout=120)
    _, alive = psutil.wait_procs(descendants, timeout=RAY_EXIT_GRACE_S)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr), alive


RAY_EXIT_GRACE_S = 10


def _checkpointed(run_dir: Path, steps: int):
    return lambda: (run_dir / "checkpoints" / f"step_{steps:06d}").is_dir()


# A run also validates after its last step: the first half of a run split in two validates once more.
EXTRA_VALIDATION = ("val/",)


def _comparable(rows: list[dict], also_ignored: tuple[str, ...] = ()) -> list[dict]:
    ignored = TIMING_KEYS + also_ignored
    return [{key: value for key, value in row.items() if not key.startswith(ignored)} for row in rows]


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


# Sampled rollouts (temperature 1) and dropout in the training forwards: a resumed run is exact
# only if every random state (torch's, megatron's RNG tracker) comes back with the checkpoint.
SAMPLED_WITH_DROPOUT = ("policy.generation.top_k=0", "policy.megatron_cfg.hidden_dropout=0.1", "policy.megatron_cfg.attention_dropout=0.1")


class Uninterrupted:
    """The runs the interrupted ones are compared with, started in the background when the module's
    first test asks (while it runs its own): ``"uninterrupted"`` (greedy) and
    ``"uninterrupted_sampled"`` (sampled, with dropout)."""

    OVERRIDES = {"uninterrupted": (), "uninterrupted_sampled": SAMPLED_WITH_DROPOUT}

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.processes = {}
        for name, overrides in self.OVERRIDES.items():
            with open(log_dir / f"{name}.stderr", "w") as stderr:  # a file: a pipe nobody reads would fill
                self.processes[name] = subprocess.Popen(_command(log_dir, name, *overrides), cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=stderr)

    def metrics(self, name: str) -> list[dict]:
        """The run's metrics, once it has finished."""
        returncode = self.processes[name].wait(timeout=900)
        assert returncode == 0, (self.log_dir / f"{name}.stderr").read_text()[-3000:]
        return read_metrics(self.log_dir / name / "metrics.jsonl")

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
            process.wait()


@pytest.fixture(scope="module")
def uninterrupted(log_dir):
    runs = Uninterrupted(log_dir)
    yield runs
    runs.stop()


def _steps_saved(checkpoints: Path) -> list[str]:
    """The step checkpoints (complete or partial); the start of RL is saved beside them."""
    return sorted(path.name for path in checkpoints.iterdir() if path.name.startswith("step_"))


def test_kill_9_mid_run_during_a_save_then_resume_gives_the_uninterrupted_metrics_bit_exactly(log_dir, uninterrupted):
    """Killed while it saves the final checkpoint, mid-run for what resumes it: the step-2
    checkpoint is the latest complete one, the partial step-4 one must not be taken, and the
    metrics of steps 2 and 3 were already logged past the checkpoint. Then resumed to the end.
    With sampled rollouts and dropout, so that a resume which lost a random state would differ
    (shown by breaking the restore of the RNG states: the losses after the resume then differ)."""
    metrics = log_dir / "killed" / "metrics.jsonl"
    checkpoints = log_dir / "killed" / "checkpoints"
    command = _command(log_dir, "killed", *SAMPLED_WITH_DROPOUT)
    _kill_when(command, lambda: (checkpoints / f"step_{STEPS:06d}.partial").exists())
    assert _steps_saved(checkpoints) == [f"step_{STEPS - 2:06d}", f"step_{STEPS:06d}.partial"]
    assert [row["step"] for row in read_metrics(metrics)] == list(range(STEPS))  # logged past the checkpoint
    resumed = _run(command)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"from {checkpoints / f'step_{STEPS - 2:06d}'} ({STEPS - 2} steps done)" in resumed.stderr
    rows = read_metrics(metrics)
    assert [row["step"] for row in rows] == list(range(STEPS))
    assert _comparable(rows) == _comparable(uninterrupted.metrics("uninterrupted_sampled"))  # MTP and rollout metrics included
    assert any(row["train/probs_ratio"] != 1.0 for row in rows)  # dropout did act on the training forwards
    assert _steps_saved(checkpoints) == [f"step_{STEPS - 2:06d}", f"step_{STEPS:06d}"]


def test_ctrl_c_at_data_parallel_two_exits_130_naming_the_checkpoint_which_resumes_at_data_parallel_one(log_dir, uninterrupted):
    """Ctrl-C as a terminal sends it (SIGINT to the driver's whole process group) to a run of two
    data-parallel workers: exit 130, one line naming the checkpoint to resume from, no Ray process
    left. Resumed there by one worker, the run logs what a one-worker run logs from the start:
    weights and optimizer state crossed the layout change (up to the float order of the DP2
    gradient reduction)."""
    run_dir = log_dir / "ctrl_c_dp2_then_dp1"
    interrupted, alive = _signal_when(
        _command(log_dir, run_dir.name, "grpo.max_num_steps=1000", "cluster.workers_per_node=2"),
        _checkpointed(run_dir, 2),
        lambda process: os.killpg(process.pid, signal.SIGINT),
    )
    assert interrupted.returncode == 130, interrupted.stderr[-3000:]
    assert "Traceback" not in interrupted.stderr
    last_line = interrupted.stderr.strip().splitlines()[-1]
    assert last_line.startswith(f"interrupted: run again with logger.run_name={run_dir.name} to resume from")
    resume_from = Path(last_line.rsplit(" ", 1)[1])
    assert resume_from.parent == run_dir / "checkpoints" and (resume_from / "trainer_state.pt").is_file()
    assert alive == []
    resumed = _run(_command(log_dir, run_dir.name))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = _comparable(read_metrics(run_dir / "metrics.jsonl"), EXTRA_VALIDATION)
    assert [row["step"] for row in rows] == list(range(STEPS))
    for row_expected, row_resumed in zip(_comparable(uninterrupted.metrics("uninterrupted"), EXTRA_VALIDATION), rows):
        assert row_resumed.keys() == row_expected.keys()
        for key, value in row_expected.items():
            assert row_resumed[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (row_expected["step"], key)


@pytest.mark.skipif(shutil.which("uv") is None, reason="needs uv on PATH (CI runs the suite through uv)")
def test_under_uv_run_workers_use_the_driver_environment_and_sigterm_exits_143_in_one_line(log_dir):
    """Launched as the README says (``uv run``, no sync, so the suite's environment is left as is):
    no per-run virtual environment is built for the workers; SIGTERM to uv alone (``kill``, a
    container stop), which uv forwards, ends the run in the same orderly way as Ctrl-C."""
    command = ["uv", "run", "--no-sync", *_command(log_dir, "sigterm", "grpo.max_num_steps=1000")[1:]]
    terminated, alive = _signal_when(
        command, _checkpointed(log_dir / "sigterm", 2), lambda process: process.send_signal(signal.SIGTERM)
    )
    assert terminated.returncode == 143, terminated.stderr[-3000:]
    assert "Traceback" not in terminated.stderr and "SIGTERM received" not in terminated.stderr
    assert terminated.stderr.strip().splitlines()[-1].startswith("interrupted: run again with logger.run_name=sigterm")
    assert alive == []
    assert "Ray workers start from this interpreter" in terminated.stderr
    assert "Creating virtual environment" not in terminated.stderr  # uv's line when Ray's uv hook builds one
    assert terminated.stderr.count("rollout engine adapted to the CPU") == 1  # once, from the driver
    assert "GPTModel IS DEPRECATED" not in terminated.stderr and "Falling back" not in terminated.stderr  # filtered


def test_a_run_directory_without_checkpoint_is_refused_unless_overwritten(log_dir):
    """Refused before any worker starts; ``--overwrite`` clears the directory for the new run."""
    from nemo_rl_mtp.grpo.run import CheckpointDirectory, prepare_run_directory

    earlier = log_dir / "earlier"
    earlier.mkdir()
    (earlier / "metrics.jsonl").write_text('{"step": 0}\n')
    refused = _run(_command(log_dir, "earlier", "grpo.max_num_steps=1", "checkpointing.enabled=false"))
    assert refused.returncode == 2
    assert "logger.run_name=earlier" in refused.stderr and "--overwrite" in refused.stderr
    assert "Started a local Ray instance" not in refused.stderr
    assert (earlier / "metrics.jsonl").read_text() == '{"step": 0}\n'  # untouched
    assert prepare_run_directory(earlier, CheckpointDirectory(earlier / "checkpoints", 2), overwrite=True) is None
    assert not earlier.exists()


def test_checkpoints_hold_no_callables(log_dir, uninterrupted):
    """NeMo-RL's caveat: ``mtp_grad_scale_func`` must never land in a saved config."""
    from megatron.core import dist_checkpointing

    uninterrupted.metrics("uninterrupted")  # finished
    latest = log_dir / "uninterrupted" / "checkpoints" / f"step_{STEPS:06d}"
    common = dist_checkpointing.load_common_state_dict(str(latest / "policy"))

    def callables(value):
        if isinstance(value, dict):
            return [found for item in value.values() for found in callables(item)]
        if isinstance(value, (list, tuple)):
            return [found for item in value for found in callables(item)]
        return [value] if callable(value) and not isinstance(value, type) else []

    assert callables(common) == []
    assert "grad_scale_func" not in (log_dir / "uninterrupted" / "config.yaml").read_text()
