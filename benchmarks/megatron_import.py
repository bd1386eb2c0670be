"""What importing megatron-core costs a process on a CPU, with and without the package's deferred
compile (``nemo_rl_mtp/megatron_compat/cpu/deferred_compile.py``), measured side by side: fresh
processes, the two kinds interleaved, wall time from the interpreter's start to the import done.

Each process imports what a policy worker imports from megatron-core (the package, the GPT model,
the inference engine, the optimizer), then builds a torch Adam optimizer, whose first
``add_param_group`` imports TorchDynamo whatever megatron did (torch's own ``_disable_dynamo``):
the row "with an optimizer" is what a training worker pays, the row "import" what a process that
builds no optimizer pays (the GRPO driver, a converter).

    uv run python -m benchmarks.megatron_import [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

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
KINDS = ("eager", "deferred")


def measure(kind: str) -> dict:
    """One fresh process of ``kind``; its times include the interpreter's start of the probe body."""
    done = subprocess.run([sys.executable, "-c", PROBE, kind], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"the {kind} probe failed: {done.stderr.strip().splitlines()[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    runs: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    for repeat in range(args.repeats):
        for kind in KINDS if repeat % 2 == 0 else reversed(KINDS):
            runs[kind].append(measure(kind))
    print(f"megatron-core's import on this CPU, median of {args.repeats} fresh processes per kind, interleaved")
    print(f"{'':>22} {'eager':>9} {'deferred':>9} {'deferred/eager':>15}  paired per repeat")
    for key, label in (("import_s", "import"), ("optimizer_s", "with an optimizer")):
        eager, deferred = ([run[key] for run in runs[kind]] for kind in KINDS)
        pairs = " ".join(f"{d / e:.2f}" for e, d in zip(eager, deferred))
        median_eager, median_deferred = statistics.median(eager), statistics.median(deferred)
        print(f"{label:>22} {median_eager:>8.2f}s {median_deferred:>8.2f}s {median_deferred / median_eager:>15.2f}  {pairs}")
    for key in ("modules", "inductor_modules"):
        print(f"{key:>22} {runs['eager'][0][key]:>9} {runs['deferred'][0][key]:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
