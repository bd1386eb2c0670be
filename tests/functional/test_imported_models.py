"""GRPO on imported Hugging Face checkpoints, end to end: ``examples/run_grpo.py`` on tiny MiMo-
layout checkpoints (digit task rendered as text, and the math environment on a JSONL dataset),
with speculation; the converter's output loads in transformers; checkpoints saved at tensor- and
pipeline-parallel 2 export to the source tensors bit for bit; a dataset run killed with SIGKILL
resumes its prompt order; bad inputs end in one line before any worker starts."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nemo_rl_mtp.reporting.logger import read_metrics
from tests.functional.test_fault_injection import TIMING_KEYS, _kill_when
from tests.support.hf_reference import load_hf_model
from tests.support.helpers import SMALL_GRPO_STEP, run_grpo
from tests.support.release_gates import requires_megatron_bridge

pytestmark = [pytest.mark.slow, requires_megatron_bridge()]

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS = REPO_ROOT / "examples" / "configs"
from scripts.arithmetic_dataset import write_arithmetic_dataset  # noqa: E402
from scripts.tiny_mimo_checkpoint import write_tiny_mimo_checkpoint  # noqa: E402

QUIET = ["logger.wandb_enabled=false", "logger.tensorboard_enabled=false"]
MATH_STEPS = 4


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inputs")
    train, val = write_arithmetic_dataset(root / "arithmetic", num_val=16)
    return {
        "mtp1": write_tiny_mimo_checkpoint(root / "mimo1", mtp_layers=1),
        "mtp2": write_tiny_mimo_checkpoint(root / "mimo2", mtp_layers=2, seed=2),
        "train": train,
        "val": val,
        "logs": tmp_path_factory.mktemp("runs"),
    }


def math_command(files, run_name: str) -> list[str]:
    """The math recipe on the tiny checkpoint and dataset, small steps, sampled rollouts."""
    return [
        "--config", str(CONFIGS / "grpo_math_tiny_mimo_cpu.yaml"), *SMALL_GRPO_STEP, *QUIET,
        f"policy.model_name={files['mtp1']}", f"data.train_data_path={files['train']}", f"data.val_data_path={files['val']}",
        f"grpo.max_num_steps={MATH_STEPS}", "grpo.warmup_imitation_steps=2", "grpo.val_num_prompts=16", "checkpointing.save_period=2",
        f"logger.log_dir={files['logs']}", f"logger.run_name={run_name}",
    ]  # fmt: skip


class KilledThenResumed:
    """The math run killed with SIGKILL near its end, then run again (which resumes it), in a
    thread started with the module: it runs beside the in-process runs (each keeps about one core
    busy)."""

    def __init__(self, files):
        self.command = [sys.executable, str(REPO_ROOT / "examples" / "run_grpo.py"), *math_command(files, "math_killed")]
        self.metrics = files["logs"] / "math_killed" / "metrics.jsonl"
        self.outcome: subprocess.CompletedProcess | BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            _kill_when(self.command, lambda: self.metrics.is_file() and len(read_metrics(self.metrics)) >= MATH_STEPS - 1)
            self.outcome = subprocess.run(self.command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
        except BaseException as error:  # raised in the test that asks
            self.outcome = error

    def resumed(self) -> subprocess.CompletedProcess:
        self.thread.join(timeout=1200)
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        assert self.outcome is not None, "the killed run did not finish"
        return self.outcome


@pytest.fixture(scope="module")
def math_killed(files) -> KilledThenResumed:
    return KilledThenResumed(files)


@pytest.fixture(scope="module")
def runs(files, math_killed):
    """Each configuration once, in this process, on one local Ray instance (``math_killed``, which
    they do not need, is started first, to run beside them)."""
    digits = ["--config", str(CONFIGS / "grpo_mtp_tiny_mimo_cpu.yaml"), *SMALL_GRPO_STEP, *QUIET]
    untouched = ["grpo.max_num_steps=0", "grpo.warmup_imitation_steps=0", "cluster.workers_per_node=2"]
    configs = {
        "digits": [*digits, f"policy.model_name={files['mtp1']}", "grpo.max_num_steps=3", "grpo.warmup_imitation_steps=2", "policy.generation.num_speculative_tokens=1"],
        "untouched_tp2": [*digits, f"policy.model_name={files['mtp1']}", *untouched, "policy.megatron_cfg.tensor_model_parallel_size=2"],
        "untouched_pp2": [
            *digits, f"policy.model_name={files['mtp2']}", *untouched, "policy.megatron_cfg.pipeline_model_parallel_size=2",
            "policy.generation.num_speculative_tokens=2",
        ],  # fmt: skip
        "math": math_command(files, "math"),
    }
    import ray

    from nemo_rl_mtp.cluster.ray_cluster import init_ray
    from nemo_rl_mtp.config.load import load_config

    init_ray(load_config().cluster)
    try:  # stopped whatever happens: a failed run must not leave it to the next module's tests
        for name, argv in configs.items():
            if name != "math":
                argv = [*argv, f"logger.log_dir={files['logs']}", f"logger.run_name={name}"]
            assert run_grpo(argv) == 0, name
        yield {name: files["logs"] / name for name in configs}
    finally:
        ray.shutdown()


def export(run_dir: Path, out: Path) -> Path:
    """The converter, as a user runs it, on the run's latest checkpoint."""
    checkpoint = sorted((run_dir / "checkpoints").iterdir())[-1]
    command = [
        sys.executable, str(REPO_ROOT / "examples" / "converters" / "convert_megatron_to_hf.py"), "--config", str(run_dir / "config.yaml"),
        "--megatron-ckpt-path", str(checkpoint), "--hf-ckpt-path", str(out),
    ]  # fmt: skip
    completed = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return out


def test_grpo_on_an_imported_checkpoint_speculates_and_its_export_loads_in_transformers(runs, files, tmp_path):
    rows = read_metrics(runs["digits"] / "metrics.jsonl")
    assert len(rows) == 3
    assert all(row["rollout/draft_1_proposed"] > 0 and "train/mtp/mtp_1_loss" in row for row in rows)
    assert "val/accuracy" in rows[0] and "val/draft_1_acceptance_rate" in rows[-1]
    out = export(runs["digits"], tmp_path / "hf")
    model, info = load_hf_model(out)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert {"modeling_mimo.py", "configuration_mimo.py", "tokenizer.json"} <= {path.name for path in out.iterdir()}
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    source, exported = load_file(files["mtp1"] / "model.safetensors"), load_file(out / "model.safetensors")
    trained_mtp = [name for name in source if ".mtp_layers." in name and not torch.equal(source[name], exported[name])]
    assert len(trained_mtp) > 10  # the heads trained during GRPO leave in Hugging Face format


@pytest.mark.parametrize("run, checkpoint", [("untouched_tp2", "mtp1"), ("untouched_pp2", "mtp2")])
def test_checkpoints_saved_at_tp2_and_pp2_export_to_the_source_tensors_bit_for_bit(runs, files, tmp_path, run, checkpoint):
    """A validation-only run (grpo.max_num_steps=0) saves the imported model at its parallel
    layout; the export must give back every source tensor, as TP1's does (unit test)."""
    assert read_metrics(runs[run] / "metrics.jsonl")[0]["val/accuracy"] >= 0.0
    out = export(runs[run], tmp_path / run)
    source, exported = load_file(files[checkpoint] / "model.safetensors"), load_file(out / "model.safetensors")
    assert source.keys() == exported.keys()
    assert all(torch.equal(source[name], exported[name]) for name in source)


def test_the_math_environment_trains_from_a_dataset_and_logs_validation_accuracy(runs):
    rows = read_metrics(runs["math"] / "metrics.jsonl")
    assert len(rows) == MATH_STEPS
    for key in ("val/accuracy", "val/answer_rate", "train/answer_rate", "rollout/draft_1_acceptance_rate", "data/skipped_prompts"):
        assert key in rows[0], key
    assert 0.0 <= rows[-1]["val/accuracy"] <= 1.0 and rows[-1]["train/answer_rate"] > 0


def test_a_dataset_run_killed_with_sigkill_resumes_the_same_prompt_order(runs, math_killed):
    """Sampled rollouts and the dataset's shuffled order: the resumed run's metrics equal the
    uninterrupted run's (the ``math`` run) bit for bit, rewards included."""
    resumed = math_killed.resumed()
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stderr

    def comparable(rows):
        # The first half validates once more after its last step (as every run does).
        return [{key: value for key, value in row.items() if not key.startswith(TIMING_KEYS + ("val/",))} for row in rows]

    uninterrupted = read_metrics(runs["math"] / "metrics.jsonl")
    assert comparable(read_metrics(math_killed.metrics)) == comparable(uninterrupted)


def test_bad_inputs_end_in_one_line_before_any_worker_starts(files, tmp_path):
    bad_line = tmp_path / "bad.jsonl"
    bad_line.write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n{"prompt": "What is 2 + 2?" "answer": "4"}\n')
    cases = {
        "policy.model_name=": [f"policy.model_name={tmp_path / 'missing'}", "policy.trust_remote_code=true"],
        f"data.train_data_path={bad_line}, line 2: not JSON": [
            "--config", str(CONFIGS / "grpo_math_tiny_mimo_cpu.yaml"), f"policy.model_name={files['mtp1']}",
            f"data.train_data_path={bad_line}", f"data.val_data_path={files['val']}",
        ],  # fmt: skip
    }
    for expected, overrides in cases.items():
        command = [sys.executable, str(REPO_ROOT / "examples" / "run_grpo.py"), *overrides, f"logger.log_dir={tmp_path}"]
        completed = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
        errors = [line for line in completed.stderr.splitlines() if line.startswith("config error")]
        assert completed.returncode == 2 and len(errors) == 1 and expected in errors[0], completed.stderr[-2000:]
        assert "policy: 1 workers" not in completed.stderr  # no worker was started
