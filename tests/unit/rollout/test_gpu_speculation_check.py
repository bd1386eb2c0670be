"""The check prepared for a lent GPU (``benchmarks/gpu_speculation_check.py``) runs as it would
there: in a fresh process whose megatron-core, omegaconf and antlr4 come from the folder
``scripts.gpu_site`` writes, with Ray, wandb and megatron-bridge (which that machine lacks)
unimportable. Here in its dry run: the tiny default model on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import gpu_site

REPO = Path(__file__).resolve().parents[3]
AS_ON_THE_DEVICE = """
import runpy, sys
for name in ("ray", "wandb", "megatron.bridge", "math_verify"):
    sys.modules[name] = None
sys.argv = ["gpu_speculation_check", "--dry-run"]
try:
    runpy.run_module("benchmarks.gpu_speculation_check", run_name="__main__")
finally:
    import antlr4, megatron.core, omegaconf
    print("loaded from:", *(module.__file__ for module in (megatron.core, omegaconf, antlr4)))
"""


@pytest.mark.slow
def test_the_prepared_gpu_check_runs_on_what_travels_with_it(tmp_path):
    site = tmp_path / "gpu_site"
    gpu_site.copy_packages(site)
    environment = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO}"}
    result = subprocess.run([sys.executable, "-c", AS_ON_THE_DEVICE], cwd=REPO, env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    origins = next(line for line in lines if line.startswith("loaded from:")).split()[2:]
    assert len(origins) == 3 and all(origin.startswith(str(site)) for origin in origins), origins
    # The first table: one row per k, its measured cost per step over k = 0's in the fifth column.
    rows = [line.split("|")[1:-1] for line in lines[: next(i for i, line in enumerate(lines) if line.startswith("auto ran"))] if line[:4] in ("| 0 ", "| 1 ", "| 2 ")]
    assert [int(row[0]) for row in rows] == [0, 1, 2], rows
    measured = [float(row[4]) for row in rows]
    assert measured[0] == 1.0 and measured[1] > 1.0 and measured[2] > 1.0, rows  # a drafting step costs more than one without
    assert any(line.startswith("auto ran k = ") for line in lines)
