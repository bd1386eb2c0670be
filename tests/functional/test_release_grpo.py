"""GRPO end to end on every megatron-core release the project supports, each in its own uv
environment (``uv run --with megatron-core==X``, the project's other dependencies as locked): real
Ray workers, rollouts on the release's own inference engine, MTP training, checkpoints.

- 0.17 on: the engine speculates with the policy's MTP head (one draft per step, verified by
  rejection sampling); the rollouts report drafts proposed and accepted, and the MTP head trains.
- 0.18, the oldest release with MoE (megatron-core's MoE metrics tracker), runs with an MoE trunk and
  MoE MTP layer, load balancing off (its normalisation needs 0.19's schedule).
- 0.16: its engine has no speculative decoding. One draft per step is refused before any worker
  starts, in one line naming the release and what it lacks; ``auto`` runs without drafts.

Releases: ``NEMO_RL_MTP_RELEASES`` (space-separated), default 0.16.1 0.17.1 0.18.2 0.19.2. The
reference release's GRPO runs are ``test_grpo.py`` in the locked environment; here it runs only when
named in ``NEMO_RL_MTP_RELEASES``. Each run costs its start-up (uv environment, imports, a local Ray
instance, the worker), about a minute on 2 cores; the selected tests' runs start together when the
first asks, two at a time (each keeps about one core busy).
"""

from __future__ import annotations

import math
import os
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from nemo_rl_mtp.reporting.logger import read_metrics
from tests.support.helpers import RUNS_AT_ONCE, SMALL_GRPO_STEP, release_of

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]

from scripts import mtp_release_matrix

RELEASES = os.environ.get("NEMO_RL_MTP_RELEASES", " ".join(mtp_release_matrix.DEFAULT_RELEASES)).split()
# Releases whose engine has no speculative decoding (written out from what each release has).
WITHOUT_SPECULATION = {"0.16"}
# Per release (major.minor), what its run adds to the default recipe.
RELEASE_OVERRIDES = {
    "0.18": ("policy.megatron_cfg.num_moe_experts=4", "policy.megatron_cfg.moe_router_topk=2", "policy.megatron_cfg.moe_aux_loss_coeff=0"),
}
ONE_STEP = [*SMALL_GRPO_STEP, "grpo.max_num_steps=1", "logger.wandb_enabled=false", "logger.tensorboard_enabled=false"]


def _run_grpo(release: str, log_dir: Path, name: str, *overrides: str) -> subprocess.CompletedProcess:
    command = [
        "uv", "run", "--frozen", "--compile-bytecode", "--with", f"megatron-core=={release}", "--group", "test", "python", "examples/run_grpo.py",
        *ONE_STEP, f"logger.log_dir={log_dir}", f"logger.run_name={name}", *overrides,
    ]  # fmt: skip
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)


def _speculates(release: str) -> bool:
    return ".".join(release.split(".")[:2]) not in WITHOUT_SPECULATION


def _release_run(release: str, log_dir: Path) -> subprocess.CompletedProcess:
    """One GRPO step with the speculation the release's engine has (auto where it has none)."""
    minor = ".".join(release.split(".")[:2])
    k = "1" if _speculates(release) else "auto"
    return _run_grpo(release, log_dir, "run", f"policy.generation.num_speculative_tokens={k}", *RELEASE_OVERRIDES.get(minor, ()))




@pytest.fixture(scope="module")
def release_runs(request, tmp_path_factory) -> dict[tuple[str, str], tuple[Future, Path]]:
    """(test name, release) -> the run's future and its log directory, for the selected tests."""
    runs_of = {
        "test_grpo_runs_on_the_release_with_the_speculation_its_engine_has": _release_run,
        "test_drafts_are_refused_in_one_line_before_any_worker_starts": lambda release, log_dir: _run_grpo(
            release, log_dir, "refused", "policy.generation.num_speculative_tokens=1"
        ),
    }
    # (An empty parameter set leaves an item without a release: pytest skips it.)
    selected = [item for item in request.session.items if item.module is request.module and release_of(item) is not None]
    with ThreadPoolExecutor(max_workers=RUNS_AT_ONCE) as pool:
        runs = {}
        for item in selected:
            release, test = release_of(item), item.originalname
            log_dir = tmp_path_factory.mktemp(f"{release}-{test[:30]}")
            runs[test, release] = pool.submit(runs_of[test], release, log_dir), log_dir
        yield runs


@pytest.mark.parametrize(
    "release", [release for release in RELEASES if release != mtp_release_matrix.REFERENCE_RELEASE or "NEMO_RL_MTP_RELEASES" in os.environ]
)
def test_grpo_runs_on_the_release_with_the_speculation_its_engine_has(release, release_runs):
    speculates = _speculates(release)
    run, log_dir = release_runs["test_grpo_runs_on_the_release_with_the_speculation_its_engine_has", release]
    completed = run.result()
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    (step,) = read_metrics(log_dir / "run" / "metrics.jsonl")
    assert math.isfinite(step["train/loss"]) and step["train/mtp/mtp_1_loss"] > 0 and step["train/mtp/grad_norm"] > 0
    if speculates:
        assert step["rollout/draft_1_proposed"] > 0 and 0 <= step["rollout/draft_1_accepted"] <= step["rollout/draft_1_proposed"]
    else:
        assert not [key for key in step if key.startswith("rollout/draft_")]
        assert "auto chooses 0" in completed.stderr + completed.stdout


@pytest.mark.parametrize("release", [release for release in RELEASES if ".".join(release.split(".")[:2]) in WITHOUT_SPECULATION])
def test_drafts_are_refused_in_one_line_before_any_worker_starts(release, release_runs):
    completed = release_runs["test_drafts_are_refused_in_one_line_before_any_worker_starts", release][0].result()
    output = (completed.stdout + completed.stderr).strip().splitlines()
    assert completed.returncode == 2, output[-20:]
    assert output[-1].startswith(f"config error: policy.generation.num_speculative_tokens=1: megatron-core {release}: ")
    assert "no speculative decoding" in output[-1]
    assert not any("Ray" in line for line in output), "refused after Ray started"
