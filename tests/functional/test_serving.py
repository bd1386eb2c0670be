"""The exported MTP heads serve in vLLM: the tiny MiMo-layout checkpoint, warm-started and one
GRPO step trained with speculation, exported by the converter and checked by
``examples/serve_check.py`` on the run's held-out prompts: greedy outputs with speculation equal
those without, vLLM's draft acceptance is within sampling tolerance of the project's own, and
the control (the same export with the untrained MTP head put back) is far below it.

vLLM runs in its own Python 3.11 environment (``scripts/vllm_env.py``): ``$NEMO_RL_MTP_VLLM_PYTHON``,
/tmp/vllm-venv or one made under ~/.cache (bounded in time); where none can be had the test skips
and says why. Cost on 2 CPU cores: about 1.5 min of training and export, then three vLLM start-ups
of 1-3 min each (start-up dominates: 128 prompts of at most 8 new tokens take seconds).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.support.release_gates import requires_megatron_bridge

pytestmark = [pytest.mark.slow, requires_megatron_bridge()]

REPO_ROOT = Path(__file__).resolve().parents[2]
from scripts.tiny_mimo_checkpoint import write_tiny_mimo_checkpoint  # noqa: E402
from scripts.vllm_env import DEFAULT_PYTHON, DEFAULT_TORCH_WHEEL, EnvError, create  # noqa: E402

CACHED_VENV = Path.home() / ".cache" / "nemo_rl_mtp" / "vllm-venv"
INSTALL_TIMEOUT_S = 900
# Standard errors of the difference between the two engines' acceptance that the test allows.
SIGMAS = 3.0


def vllm_python() -> Path:
    """An interpreter with vLLM: an existing environment, else one made now; else skip, saying why."""
    candidates = [os.environ.get("NEMO_RL_MTP_VLLM_PYTHON"), "/tmp/vllm-venv/bin/python", str(CACHED_VENV / "bin" / "python")]
    for candidate in filter(None, candidates):
        if Path(candidate).is_file():
            return Path(candidate)
    try:
        return create(CACHED_VENV, DEFAULT_PYTHON, DEFAULT_TORCH_WHEEL, timeout_s=INSTALL_TIMEOUT_S)
    except EnvError as error:
        pytest.skip(f"no vLLM environment and none can be made here: {error}")


def run(command: list[str], timeout_s: int = 1800) -> subprocess.CompletedProcess:
    completed = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s)
    assert completed.returncode == 0, (completed.stdout + completed.stderr)[-3000:]
    return completed


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """The digit recipe on the tiny checkpoint: its 100-step warm start (which trains the MTP head)
    and one GRPO step with speculation, validated on the 128 held-out prompts; then exported."""
    python = vllm_python()  # first: skip before spending minutes on training
    root = tmp_path_factory.mktemp("serving")
    source = write_tiny_mimo_checkpoint(root / "tiny-mimo")
    run([
        sys.executable, "examples/run_grpo.py", "--config", "examples/configs/grpo_mtp_tiny_mimo_cpu.yaml", "logger.console=false",
        f"policy.model_name={source}", "grpo.warmup_imitation_steps=100", "grpo.max_num_steps=1",
        "policy.generation.num_speculative_tokens=1", f"logger.log_dir={root}", "logger.run_name=run",
        "logger.wandb_enabled=false", "logger.tensorboard_enabled=false",
    ])  # fmt: skip
    run_dir = root / "run"
    checkpoint = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    export = root / "export"
    run([
        sys.executable, "examples/converters/convert_megatron_to_hf.py", "--config", str(run_dir / "config.yaml"),
        "--megatron-ckpt-path", str(checkpoint), "--hf-ckpt-path", str(export),
    ])  # fmt: skip
    return {"python": python, "source": source, "run": run_dir, "export": export, "root": root}


def untrained_head(export: Path, source: Path, out: Path) -> Path:
    """A copy of ``export`` whose MTP tensors are the source checkpoint's (random) ones: the trunk
    trained, the head not."""
    out.mkdir()
    for path in export.iterdir():
        if path.name != "model.safetensors":
            (out / path.name).write_bytes(path.read_bytes())
    tensors, random_tensors = load_file(export / "model.safetensors"), load_file(source / "model.safetensors")
    replaced = {name: random_tensors[name] for name in tensors if ".mtp_layers." in name}
    assert replaced and all(name in random_tensors for name in replaced)
    save_file({**tensors, **replaced}, out / "model.safetensors", metadata={"format": "pt"})
    return out


def serve_check(trained: dict, export: Path, *extra: str) -> dict:
    figures_file = trained["root"] / f"{export.name}.json"
    run([
        sys.executable, "examples/serve_check.py", "--hf-ckpt-path", str(export), "--config", str(trained["run"] / "config.yaml"),
        "--vllm-python", str(trained["python"]), "--json", str(figures_file), *extra,
    ])  # fmt: skip
    return json.loads(figures_file.read_text())


def tolerance_points(p_ours: float, n_ours: int, p_vllm: float, n_vllm: int) -> float:
    """SIGMAS standard errors of the difference of two acceptance rates (percent points), each a
    binomial proportion over its drafts: the engines draft on the same greedy sequences, so this
    bounds sampling noise from above; a systematic gap (a different MTP input) above it fails."""
    p1, p2 = p_ours / 100, p_vllm / 100
    return 100 * SIGMAS * math.sqrt(p1 * (1 - p1) / n_ours + p2 * (1 - p2) / n_vllm)


def test_the_export_serves_in_vllm_with_the_acceptance_training_measured(trained):
    figures = serve_check(trained, trained["export"])
    assert figures["greedy_equal"] == figures["num_prompts"] == 128  # speculation changes no greedy output
    assert figures["vllm_accuracy"] == figures["vllm_plain_accuracy"]
    ours, theirs = figures["ours_acceptance"][0], figures["vllm_acceptance"][0]
    n_ours, n_vllm = figures["ours_proposed"][0], figures["vllm_num_drafts"]
    assert n_vllm > 100 and n_ours > 100
    tolerance = tolerance_points(ours, n_ours, theirs, n_vllm)
    assert ours > 50, "the warm start should have trained the head; the comparison needs a trained one"
    assert abs(ours - theirs) <= tolerance, (ours, theirs, tolerance)

    control = serve_check(trained, untrained_head(trained["export"], trained["source"], trained["root"] / "untrained_head"), "--no-plain")
    # Far lower: below the trained head's vLLM acceptance by more than twice the tolerance.
    assert control["vllm_acceptance"][0] < theirs - 2 * tolerance, (control["vllm_acceptance"], theirs, tolerance)


def test_serve_check_refuses_an_export_without_mtp_layers_and_a_missing_venv_in_one_line(tmp_path):
    no_mtp = write_tiny_mimo_checkpoint(tmp_path / "no-mtp", mtp_layers=0)
    (tmp_path / "config.yaml").write_text("policy:\n  model_name: null\n")
    cases = {
        "declares no MTP layers": ["--hf-ckpt-path", str(no_mtp), "--vllm-python", sys.executable],
        "python -m scripts.vllm_env": ["--hf-ckpt-path", str(no_mtp), "--vllm-python", str(tmp_path / "missing" / "python")],
    }
    for expected, args in cases.items():
        command = [sys.executable, "examples/serve_check.py", "--config", str(tmp_path / "config.yaml"), *args]
        completed = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
        lines = completed.stderr.strip().splitlines()
        assert completed.returncode == 2 and len(lines) == 1 and expected in lines[0], completed.stderr[-2000:]


def test_the_vllm_env_helper_names_a_missing_torch_wheel_in_one_line(tmp_path):
    command = [sys.executable, "-m", "scripts.vllm_env", "--out", str(tmp_path / "venv"), "--torch-wheel", str(tmp_path / "torch.whl")]
    completed = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    lines = completed.stderr.strip().splitlines()
    assert completed.returncode == 2 and len(lines) == 1 and "--torch-wheel=" in lines[0] and "not found" in lines[0], completed.stderr
    assert not (tmp_path / "venv").exists()  # nothing was installed
