"""MTP in RL mode on each released megatron-core with MTP, in its own uv environment
(``uv run --with megatron-core==X``): the MTP unit tests pass there, and with the same weights
and data the MTP loss, acceptance and gradients equal those of 0.19.2.

Releases: ``NEMO_RL_MTP_RELEASES`` (space-separated), default 0.16.1 0.17.1 0.18.2 0.19.2.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "scripts"))

import mtp_release_matrix  # noqa: E402

RELEASES = os.environ.get("NEMO_RL_MTP_RELEASES", " ".join(mtp_release_matrix.DEFAULT_RELEASES)).split()
MTP_TEST_FILES = [
    "tests/unit/models/megatron/test_mtp_training_step.py",
    "tests/unit/models/megatron/test_compat.py",
    "tests/unit/models/megatron/test_setup.py",
]


def test_every_release_matches_0_19_2():
    results = mtp_release_matrix.run_matrix(RELEASES)
    print(mtp_release_matrix.format_table(results))
    assert {case["release"].split("+")[0] for case in results} == set(RELEASES) | {mtp_release_matrix.REFERENCE_RELEASE}
    for case in results:
        assert case["status"] == "ok", case
        assert case["max_loss_diff"] <= 1e-6, case
        assert case["max_grad_diff"] <= 1e-6, case
        assert case["metrics"]["mtp/grad_norm"] > 0


@pytest.mark.parametrize("release", [release for release in RELEASES if release != mtp_release_matrix.REFERENCE_RELEASE])
def test_mtp_unit_tests_pass_on_release(release):
    completed = subprocess.run(
        ["uv", "run", "--with", f"megatron-core=={release}", "--group", "test", "pytest", "-q", "-p", "no:cacheprovider", *MTP_TEST_FILES],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NEMO_RL_MTP_EXPECT_RELEASE": release},
    )
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-2000:]
    assert " passed" in completed.stdout
