"""MTP in RL mode on each released megatron-core with MTP, in its own uv environment
(``uv run --with megatron-core==X``): the MTP unit tests pass there, and with the same weights
and data the MTP loss, acceptance and gradients equal those of 0.19.2.

Per release, the unit tests that must be skipped (and those that must run) are written out in
``RELEASE_SPECIFIC``: a test that silently skips, or runs where it should not, fails the matrix.

On the older releases the suite leaves out the test files that cannot import megatron at all
(read from their imports, lazy ones and the processes they start included:
``tests/support/import_graph.py``) and those of the command line and the GRPO loop's pieces
(``RELEASE_INDEPENDENT_ROOMS``): what they test does not depend on the release. The releases'
suites and the matrix run two at a time (each keeps about one core busy), started together when the
module's first test asks for them.

Releases: ``NEMO_RL_MTP_RELEASES`` (space-separated), default 0.16.1 0.17.1 0.18.2 0.19.2.
"""

from __future__ import annotations

import os
import subprocess
import xml.etree.ElementTree as ET
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.helpers import RUNS_AT_ONCE, release_of
from tests.support.import_graph import can_import

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]

from scripts import mtp_release_matrix

RELEASES = os.environ.get("NEMO_RL_MTP_RELEASES", " ".join(mtp_release_matrix.DEFAULT_RELEASES)).split()
MTP_TEST_FILES = [
    "tests/unit/training/test_mtp_training_step.py",
    "tests/unit/megatron_compat/test_compat.py",
    "tests/unit/training/test_setup.py",
    "tests/unit/training/test_mtp_distribution_losses.py",
    "tests/unit/training/test_mtp_frozen.py",
]


OLDER_RELEASES = [release for release in RELEASES if release != mtp_release_matrix.REFERENCE_RELEASE]


@pytest.fixture(scope="module")
def release_runs(request, tmp_path_factory) -> dict[str, Future]:
    """The selected tests' runs, started together, ``RUNS_AT_ONCE`` at a time: ``"matrix"`` for
    ``run_matrix``, each release's suite under its name (the completed process and its JUnit report)."""
    selected = [item for item in request.session.items if item.module is request.module]
    releases = [release for release in map(release_of, selected) if release is not None]
    with ThreadPoolExecutor(max_workers=RUNS_AT_ONCE) as pool:
        runs = {release: pool.submit(_run_suite, release, tmp_path_factory.mktemp(f"suite-{release}")) for release in releases}
        if any(item.name == "test_every_release_matches_0_19_2" for item in selected):
            runs["matrix"] = pool.submit(mtp_release_matrix.run_matrix, RELEASES)
        yield runs


def test_every_release_matches_0_19_2(release_runs):
    results = release_runs["matrix"].result()
    print(mtp_release_matrix.format_table(results))
    assert {case["release"].split("+")[0] for case in results} == set(RELEASES) | {mtp_release_matrix.REFERENCE_RELEASE}
    for case in results:
        assert case["status"] == "ok", case
        assert case["max_loss_diff"] <= 1e-6, case
        assert case["max_grad_diff"] <= 1e-6, case
        assert case["metrics"]["mtp/grad_norm"] > 0


COMPAT = "tests/unit/megatron_compat/test_compat.py"
SETUP = "tests/unit/training/test_setup.py"
DISTRIBUTION = "tests/unit/training/test_mtp_distribution_losses.py"
LOSSES = ("soft_cross_entropy", "total_variation")
# The release-specific tests of MTP_TEST_FILES and the releases (major.minor) they must run on,
# written out from the measured matrix (what each release has), not from the tests' skip conditions.
# On every other release they must be skipped; every other test must run and pass on every release.
RELEASE_SPECIFIC = {
    f"{COMPAT}::test_padding_mask_shim_is_not_installed_where_declared": {"0.19"},
    f"{COMPAT}::test_upstream_0_18_checkpointed_forward_rejects_padding_mask": {"0.18"},
    f"{COMPAT}::test_padding_mask_shim_is_installed_on_the_0_18_release": {"0.18"},
    f"{COMPAT}::test_without_the_rl_labels_shim_mtp_silently_does_not_train": {"0.16", "0.17", "0.18"},
    **{f"{COMPAT}::test_rl_labels_backport_equals_native_process_mtp_loss[{case}]": {"0.19"} for case in ("cross_entropy-False", "total_variation-True")},
    f"{SETUP}::test_repeated_layer_builds_one_shared_mtp_layer": {"0.17", "0.18", "0.19"},
    **{f"{DISTRIBUTION}::test_gradient_equals_reference_written_per_position[detached-{loss}]": {"0.19"} for loss in LOSSES},
    **{
        f"{DISTRIBUTION}::test_gradient_equals_reference_written_per_position[repeated-{loss}]": {"0.17", "0.18", "0.19"}
        for loss in LOSSES
    },
    **{f"{DISTRIBUTION}::test_gradient_equals_reference_written_per_position[moe-{loss}]": {"0.18", "0.19"} for loss in LOSSES},
}
MEASURED_RELEASES = {"0.16", "0.17", "0.18", "0.19"}


def _junit_outcomes(path: Path) -> dict[str, tuple[str, str]]:
    """node id -> (passed | skipped | failed, the skip's reason), from pytest's JUnit XML report (a
    module skipped whole is one entry, its reason in the element's text)."""
    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        node = f"{case.get('classname').replace('.', '/')}.py::{case.get('name')}"
        skipped = case.find("skipped")
        if case.find("failure") is not None or case.find("error") is not None:
            outcomes[node] = ("failed", "")
        elif skipped is not None:
            outcomes[node] = ("skipped", f"{skipped.get('message', '')} {skipped.text or ''}".strip())
        else:
            outcomes[node] = ("passed", "")
    return outcomes


# Skips that depend on the machine, not the release (none of them skips on a CPU machine with uv).
MACHINE_SKIPS = ("this machine has GPUs", "checks the CPU-only adaptation", "needs uv on PATH")
# NEMO_RL_MTP_RELEASE_SUITE=full adds the slow tests (about the main suite's time per release);
# the release tests themselves always stay out (they start other releases).
SUITE = os.environ.get("NEMO_RL_MTP_RELEASE_SUITE", "quick")
RELEASE_TESTS = ("tests/functional/test_release_matrix.py", "tests/functional/test_release_grpo.py")


# Rooms whose tests reach megatron only through the code they drive, and whose subject does not
# change with the release: the command line (its refusals of bad input come before the release is
# asked) and the GRPO loop's own pieces (advantages, batches, run directories, resume checks).
RELEASE_INDEPENDENT_ROOMS = ("tests/unit/cli", "tests/unit/grpo")
# Single files of that kind in other rooms: the C library's allocator settings of a policy worker
# (glibc and torch; megatron is imported only on the way to the worker module).
RELEASE_INDEPENDENT_FILES = ("tests/unit/cluster/test_host_memory.py",)


def release_independent_files() -> list[str]:
    """The test files that cannot import megatron (nor start a process that does), and those of
    ``RELEASE_INDEPENDENT_ROOMS`` and ``RELEASE_INDEPENDENT_FILES``."""
    files = [path.relative_to(REPO_ROOT).as_posix() for path in (REPO_ROOT / "tests").rglob("test_*.py")]
    assert set(RELEASE_INDEPENDENT_FILES) <= set(files), f"RELEASE_INDEPENDENT_FILES names a missing file: {RELEASE_INDEPENDENT_FILES}"
    return sorted(
        name for name in files
        if not can_import(REPO_ROOT / name, "megatron")
        or Path(name).parent.as_posix() in RELEASE_INDEPENDENT_ROOMS
        or name in RELEASE_INDEPENDENT_FILES
    )  # fmt: skip


def _suite_command(junit: Path) -> list[str]:
    if SUITE not in ("quick", "full"):
        raise ValueError(f"NEMO_RL_MTP_RELEASE_SUITE={SUITE}: choose quick or full")
    selection = ["-m", "not slow"] if SUITE == "quick" else []
    ignored = [f"--ignore={path}" for path in (*RELEASE_TESTS, *release_independent_files())]
    return ["pytest", "-q", "-p", "no:cacheprovider", *selection, *ignored, f"--junitxml={junit}", "tests"]


def _run_suite(release: str, directory: Path) -> tuple[subprocess.CompletedProcess, Path]:
    junit = directory / "junit.xml"
    completed = subprocess.run(
        ["uv", "run", "--compile-bytecode", "--with", f"megatron-core=={release}", "--group", "test", *_suite_command(junit)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NEMO_RL_MTP_EXPECT_RELEASE": release},
    )
    return completed, junit


# The reference release's run is the main suite itself.
@pytest.mark.parametrize("release", OLDER_RELEASES)
def test_the_suite_passes_on_release(release, release_runs):
    """The whole suite (its quick part by default) on ``release``, less the release-independent
    files: nothing fails; each skip names the release and what it lacks; the MTP training tests
    run or skip exactly as the measured matrix says (``RELEASE_SPECIFIC``)."""
    minor = ".".join(release.split(".")[:2])
    assert minor in MEASURED_RELEASES, f"megatron-core {release}: add its release-specific tests to RELEASE_SPECIFIC"
    completed, junit = release_runs[release].result()
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-2000:]
    outcomes = _junit_outcomes(junit)
    assert {Path(node.split("::")[0]).as_posix() for node in outcomes} >= set(MTP_TEST_FILES)
    assert not [node for node, (outcome, _) in outcomes.items() if outcome == "failed"]
    unnamed = {
        node: reason for node, (outcome, reason) in outcomes.items()
        if outcome == "skipped" and f"megatron-core {release}" not in reason and not reason.endswith(MACHINE_SKIPS)
    }  # fmt: skip
    assert not unnamed, f"megatron-core {release}: skips that do not name the release: {unnamed}"
    mtp_outcomes = {node: outcome for node, (outcome, _) in outcomes.items() if node.split("::")[0] in MTP_TEST_FILES}
    must_skip = {node for node, releases in RELEASE_SPECIFIC.items() if minor not in releases}
    must_run = {node for node, releases in RELEASE_SPECIFIC.items() if minor in releases}
    skipped = {node for node, outcome in mtp_outcomes.items() if outcome == "skipped"}
    assert skipped == must_skip, f"megatron-core {release}: skipped {sorted(skipped)}, expected {sorted(must_skip)}"
    passed = {node for node, outcome in mtp_outcomes.items() if outcome == "passed"}
    assert must_run <= passed, f"megatron-core {release}: release-specific tests missing or not passed: {sorted(must_run - passed)}"
