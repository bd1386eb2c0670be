"""PyTorch's huge pages for CPU tensors (``THP_MEM_ALLOC_ENABLE=1``), side by side: two processes
started together, one with the setting and one without, each stepping in turn a fixed k = 0 engine,
an engine switched to k = 0 after a rollout of its own at k = 1 (as auto's is after a switch), and
a second fixed k = 0 engine (the A/A control).

Why two processes: PyTorch reads the setting once, before a process's first allocation, so the
two kinds cannot share one. Started together, one torch thread each, on a machine with a core for
each, they run through the same minutes of the machine's drifting speed. The cores themselves can
differ (on this project's 2-core VM one ran about 10% faster than the other, and two unpinned
processes read 6-16% apart in every phase, 2026-12-08): so the pair runs twice, each process
pinned to a core and then to the other, and the ratio is the geometric mean of the two. On
2026-12-07 (2-core VM, 32 x 2048, 2 layers, not pinned) a k = 0 step took 22.34 ms with huge pages
and 23.18 without, and the switched engine ran 0.997-1.001 of the fixed one with them against
0.989-0.992 without (docs/results.md, "An engine rebuilt after its own rollouts at k > 0").

    uv run python -m benchmarks.huge_pages [--new-tokens 2048] [--rounds 3] [key=value overrides]

"without" means the kernel's default for memory not advised: 4 KB pages where transparent huge
pages are ``madvise`` or ``never`` (the first line printed says which), huge pages anyway where
they are ``always``. Prints, per kind of process and placement, ms per k = 0 step and the switched
engine's and the control's paired ratios per round, then the ratio of the two kinds' k = 0 steps,
in markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from nemo_rl_mtp.cluster.worker_settings import WORKER_SETTINGS

SETTING = "THP_MEM_ALLOC_ENABLE"  # the kind compared: with the workers' value of it, and without
BATCH = 32


def child(args) -> None:
    """One kind's engines, stepped in turn; one JSON line on stdout."""
    import torch

    import benchmarks.rollout_throughput as throughput
    from nemo_rl_mtp.rollout.engine import RolloutEngine

    args.mtp_layers, args.train_batch, args.train_length, args.train_steps = 2, 64, 128, 0
    n = args.new_tokens
    policy = throughput.benchmark_policy(throughput.config(args, 0, n, args.train_batch))
    throughput.CLOCK_NAME[0] = "cpu"
    phases_of = {}
    fixed = throughput.Variant("k=0", RolloutEngine(policy, throughput.config(args, 0, n, BATCH)))
    switched = throughput.Variant("switched 1 -> 0", RolloutEngine(policy, throughput.config(args, 1, n, BATCH)))
    again = throughput.Variant("k=0 again", RolloutEngine(policy, throughput.config(args, 0, n, BATCH)))
    variants = [fixed, switched, again]
    prompts, _ = throughput.counting_task(BATCH, 1, torch.Generator().manual_seed(BATCH))
    throughput.run_in_turn(variants, prompts, 1000, phases_of, timed=False)
    switched.rollout_engine.use_speculative_tokens(0)
    throughput.run_in_turn(variants, prompts, 1001, phases_of, timed=False)
    for repeat in range(args.rounds):
        throughput.run_in_turn(variants[repeat % 3 :] + variants[: repeat % 3], prompts, repeat, phases_of)
    rollup = Path("/proc/self/smaps_rollup")  # Linux only
    huge = [line.split()[1] for line in rollup.read_text().splitlines() if line.startswith("AnonHugePages")] if rollup.exists() else []
    print(json.dumps({
        "ms_per_step": 1000 * fixed.phases.seconds["step"] / max(fixed.phases.steps, 1),
        "round_seconds": fixed.times["cpu"],
        "paired": {variant.name: variant.paired_ratios(fixed) for variant in (switched, again)},
        "huge_pages_mib": int(huge[0]) / 1024 if huge else None,
    }))  # fmt: skip


def run_pair(command: list[str], kinds: dict[str, dict], cores: tuple) -> dict[str, dict]:
    """Both kinds' processes started together, each pinned to its core in ``cores`` (None: not
    pinned); their JSON results."""
    processes = {
        kind: subprocess.Popen(command + ([] if core is None else [f"--core={core}"]), env=env, stdout=subprocess.PIPE, text=True)
        for (kind, env), core in zip(kinds.items(), cores)
    }  # fmt: skip
    results = {}
    for kind, process in processes.items():
        out, _ = process.communicate()
        if process.returncode:
            raise SystemExit(f"the {kind} process failed (status {process.returncode})")
        results[kind] = json.loads(out.strip().splitlines()[-1])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--core", type=int, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args()
    if args.child:
        if args.core is not None:
            os.sched_setaffinity(0, {args.core})
        return child(args)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(f"transparent huge pages: {thp.read_text().strip() if thp.exists() else 'not on this system'}", flush=True)
    command = [sys.executable, "-m", "benchmarks.huge_pages", "--child", f"--new-tokens={args.new_tokens}", f"--rounds={args.rounds}", *args.overrides]
    without = {name: value for name, value in os.environ.items() if name != SETTING}
    kinds = {"huge pages": {**without, SETTING: WORKER_SETTINGS[SETTING]}, "without": without}
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    placements = [(cpus[0], cpus[1]), (cpus[1], cpus[0])] if len(cpus) >= 2 else [(None, None)]
    print(f"\n{BATCH} x {args.new_tokens}, {args.rounds} timed rounds, the two processes side by side"
          + (f", pinned to cores {cpus[0]} and {cpus[1]}, then swapped" if len(placements) == 2 else "") + "\n")  # fmt: skip
    print("| process | core | ms per k = 0 step | switched 1 -> 0, per round | k = 0 again (A/A), per round | huge pages (MiB) |")
    print("|---|---|---|---|---|---|")
    step_ratios = []
    for cores in placements:
        results = run_pair(command, kinds, cores)
        for (kind, result), core in zip(results.items(), cores):
            paired = [" ".join(f"{ratio:.3f}" for ratio in ratios) for ratios in result["paired"].values()]
            huge_mib = "-" if result["huge_pages_mib"] is None else f"{result['huge_pages_mib']:.0f}"
            print(f"| {kind} | {'-' if core is None else core} | {result['ms_per_step']:.2f} | {paired[0]} | {paired[1]} | {huge_mib} |", flush=True)
        step_ratios.append(results["huge pages"]["ms_per_step"] / results["without"]["ms_per_step"])
    # The geometric mean over the two placements cancels a difference in the cores' own speed
    # (this project's 2-core VM: one core about 10% faster than the other, 2026-12-08).
    print(f"\nk = 0 step with huge pages over without: {statistics.geometric_mean(step_ratios):.3f}"
          f" (per placement: {' '.join(f'{ratio:.3f}' for ratio in step_ratios)})")  # fmt: skip


if __name__ == "__main__":
    main()
