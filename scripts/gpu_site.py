"""Copy the Python packages a lent GPU machine lacks for ``benchmarks.gpu_speculation_check`` from
this project's environment into a folder that travels with the working tree:

    uv run python -m scripts.gpu_site [--out .gpu_site]

That machine has Python 3.12 with torch, triton, numpy, yaml, einops, psutil, sympy and
tensorboard, nothing can be fetched there, and what travels is limited to 64 MiB. The check
imports, beyond those, megatron-core, omegaconf and antlr4 (omegaconf's parser; an sdist on PyPI,
so no wheel to carry): about 10 MB as installed here, for the same Python and processor (x86-64).
Ray, wandb and megatron-bridge are not on the check's path (its test runs it with them blocked).
The folder is ignored by git; name it in the device call's ``carry`` and put it first on
``PYTHONPATH`` there (docs/gpu-cost-model.md, "On a lent GPU").
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
from pathlib import Path

# (importable name, where it goes under the folder)
PACKAGES = (("megatron.core", "megatron/core"), ("omegaconf", "omegaconf"), ("antlr4", "antlr4"))


def site_folder(module_name: str) -> Path:
    """The installed folder of ``module_name`` (found without importing it)."""
    spec = importlib.util.find_spec(module_name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"gpu_site: {module_name} is not installed in this environment (uv sync first)")
    return Path(next(iter(spec.submodule_search_locations)))


def copy_packages(out: Path) -> int:
    """Copy every package of ``PACKAGES`` under ``out`` (replacing what is there); bytes copied."""
    if out.exists():
        shutil.rmtree(out)
    for module_name, relative in PACKAGES:
        shutil.copytree(site_folder(module_name), out / relative, ignore=shutil.ignore_patterns("__pycache__"))
    return sum(path.stat().st_size for path in out.rglob("*") if path.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".gpu_site"))
    args = parser.parse_args()
    size = copy_packages(args.out)
    print(f"{args.out}: {', '.join(name for name, _ in PACKAGES)}, {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
