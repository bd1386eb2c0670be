"""What importing megatron-core costs a process on a CPU, with and without the package's deferred
compile (``nemo_rl_mtp/megatron_compat/cpu/deferred_compile.py``), measured side by side: fresh
processes, the two kinds interleaved, wall time from the interpreter's start to the import done.

Each process imports what a policy worker imports from megatron-core (the package, the GPT model,
the inference engine, the optimizer), then builds a torch Adam optimizer, whose first
``add_param_group`` imports TorchDynamo whatever megatron did (torch's own ``_disable_dynamo``):
the row "with an optimizer" is what a training worker pays, the row "import" what a process that
builds no optimizer pays (the GRPO driver, a converter).

``--compare bytecode`` measures instead what the installed bytecode is worth (uv's
``--compile-bytecode``, which the test command passes), both kinds deferred: "source" processes
read no ``.pyc`` (``PYTHONPYCACHEPREFIX`` names an empty directory and nothing is written), so they compile every
module from source as they import it, as every process does where packages were installed without
bytecode and Python may not write its cache (``PYTHONDONTWRITEBYTECODE``).

    uv run python -m benchmarks.megatron_import [--repeats 5] [--compare deferral|bytecode]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile

PROBE = """
import json, sys, time
start = time.perf_counter()
if sys.argv[1] == "deferred":
    import nemo_rl_mtp
import megatron.core, megatron.core.models.gpt, megatron.core.inference.engines, megatron.core.optimizer
imported = time.perf_counter()
import torch
torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))])
built = time.perf_counter()
print(json.dumps({"import_s": imported - start, "optimizer_s": built - start, "modules": len(sys.modules),
                  "inductor_modules": sum(name.startswith("torch._inductor") for name in sys.modules)}))
"""
# Per comparison: the base kind, then the candidate; each the probe's argument and whether it reads
# the installed bytecode.
COMPARISONS = {
    "deferral": {"eager": ("eager", True), "deferred": ("deferred", True)},
    "bytecode": {"source": ("deferred", False), "bytecode": ("deferred", True)},
}


def measure(kind: str, probe_argument: str, reads_bytecode: bool, empty_cache: str) -> dict:
    """One fresh process of ``kind``; its times include the interpreter's start of the probe body.
    Without bytecode the process looks for ``.pyc`` files under ``empty_cache`` alone and writes none."""
    env = dict(os.environ)
    if not reads_bytecode:
        env |= {"PYTHONPYCACHEPREFIX": empty_cache, "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([sys.executable, "-c", PROBE, probe_argument], capture_output=True, text=True, timeout=900, env=env)
    if done.returncode != 0:
        raise SystemExit(f"the {kind} probe failed: {done.stderr.strip().splitlines()[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def has_bytecode(module_name: str) -> bool:
    """Whether ``module_name``'s source has its compiled ``.pyc`` beside it (found without importing it)."""
    spec = importlib.util.find_spec(module_name)
    return spec is not None and spec.origin is not None and os.path.exists(importlib.util.cache_from_source(spec.origin))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compare", choices=sorted(COMPARISONS), default="deferral")
    args = parser.parse_args(argv)
    kinds = COMPARISONS[args.compare]
    base, candidate = kinds
    if args.compare == "bytecode" and not has_bytecode("megatron.core"):
        raise SystemExit("megatron-core in this environment has no bytecode: run `uv sync --compile-bytecode` first")
    runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
    with tempfile.TemporaryDirectory(prefix="megatron_import_no_pyc_") as empty_cache:
        for repeat in range(args.repeats):
            for kind in kinds if repeat % 2 == 0 else reversed(kinds):
                runs[kind].append(measure(kind, *kinds[kind], empty_cache))
    print(f"megatron-core's import on this CPU, median of {args.repeats} fresh processes per kind, interleaved")
    ratio = f"{candidate}/{base}"
    print(f"{'':>22} {base:>9} {candidate:>9} {ratio:>17}  paired per repeat")
    for key, label in (("import_s", "import"), ("optimizer_s", "with an optimizer")):
        before, after = ([run[key] for run in runs[kind]] for kind in kinds)
        pairs = " ".join(f"{a / b:.2f}" for b, a in zip(before, after))
        median_before, median_after = statistics.median(before), statistics.median(after)
        print(f"{label:>22} {median_before:>8.2f}s {median_after:>8.2f}s {median_after / median_before:>17.2f}  {pairs}")
    for key in ("modules", "inductor_modules"):
        print(f"{key:>22} {runs[base][0][key]:>9} {runs[candidate][0][key]:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
