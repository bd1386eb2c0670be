"""Whole GRPO runs of the default recipe at k = 0, 1 and auto, side by side: what ``auto`` costs
or buys where users run it.

    uv run python -m benchmarks.default_recipe_k [--rounds 3] [--beside-load] [--together] [--control] [--keep-logs DIR] [key=value ...]

Each round runs ``examples/run_grpo.py`` once per k (same seed, each its own run directory), the
order rotated from round to round so that a drift of the machine does not fall on one k. Per run:
the medians over its steps of ``timing/generation_s``, ``timing/logprobs_s``, ``timing/train_s``
and ``timing/step_s`` (start-up is not in them), the largest resident memory of the run's process
tree, and for auto how often it chose each k. Then, per round, auto's generation and step medians
against k = 0's, k = 1's and the better of the two; the issue's goal is auto within 3% of the
better (a ratio of at most 1.03). A whole run on a shared VM can run 40% slower than the next in
every phase, generation, logprobs and training alike; so also per step, generation time over the
same step's logprobs time (a forward of the same batch at every k), whose medians keep what k
changes and leave the machine's speed out.

``--control`` adds an A/A control to every round: a second run at k = 0 ("0 again"), the same
work as the first, whose ratio to it is what the machine alone does to a ratio of two runs in
this benchmark, the yardstick for auto's (in one round of three runs together on 2026-12-06 auto
ran k = 0 in all 150 rollouts and its median generation came out 1.064x k = 0's).

``--keep-logs DIR`` keeps the runs' directories (by default in a temporary one, deleted at the
end): a round where auto drafted more than usual can then be read rollout by rollout.

``--beside-load`` runs a second CPU-bound process (a one-thread matmul loop, as in
``benchmarks.rollout_throughput``) beside all the runs.

``--together`` starts each round's three runs at the same time instead of one after the other,
so that all three run through the same minutes of the machine (whose speed drifts by tens of
percent from one run to the next), at the price of sharing its cores: three runs on two cores
each run slower, and at any moment a run's phase meets whatever phases the others are in, which
over 150 steps is much the same mix for every k.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from benchmarks.rollout_throughput import beside_load
from nemo_rl_mtp.metrics import (
    GENERATION_SECONDS, LOGPROBS_SECONDS, NUM_SPECULATIVE_TOKENS, RESPONSE_LENGTH, ROLLOUT, STEP_SECONDS, TIMING, TOKENS_PER_S, TRAIN,
    TRAIN_SECONDS, in_scope,
)  # fmt: skip
from nemo_rl_mtp.reporting.logger import read_metrics

REPO_ROOT = Path(__file__).resolve().parents[1]
PHASES = {"generation": GENERATION_SECONDS, "logprobs": LOGPROBS_SECONDS, "training": TRAIN_SECONDS, "whole step": STEP_SECONDS}
CHOSEN_K = ROLLOUT + NUM_SPECULATIVE_TOKENS
# Each run's own trajectory: responses sampled at k = 1 draw other random numbers than at k = 0, so
# from the first step that speculates the runs diverge (their response lengths could too).
TRAJECTORY = {"response length": in_scope(TRAIN, RESPONSE_LENGTH), "generation tokens/s": in_scope(ROLLOUT, TOKENS_PER_S)}
KS = ("0", "1", "auto")
# The A/A control (``--control``): a second run at k = 0.
CONTROL = "0 again"
# A step's generation time over its logprobs time: the logprobs pass does the same work at every k
# (a forward of the step's batch), so a machine that runs a whole run 40% slower (seen on this
# shared VM) slows both and the ratio keeps only what k changes.
OVER_LOGPROBS = "generation / logprobs, per step"


def peak_tree_memory_mb(process: subprocess.Popen, peak: list[float]) -> None:
    """Sample the resident memory of ``process`` and its descendants every second into ``peak``."""
    try:
        root = psutil.Process(process.pid)
        while process.poll() is None:
            members = [root, *root.children(recursive=True)]
            total = 0
            for member in members:
                with contextlib.suppress(psutil.Error):
                    total += member.memory_info().rss
            peak[0] = max(peak[0], total / 2**20)
            time.sleep(1.0)
    except psutil.Error:
        return


def start_run(variant: str, overrides: list[str], run_root: Path, name: str) -> dict:
    """``examples/run_grpo.py`` for ``variant`` (a k, or ``CONTROL``) started, its memory sampled;
    :func:`finish_run` waits for it."""
    k = "0" if variant == CONTROL else variant
    command = [
        sys.executable, str(REPO_ROOT / "examples" / "run_grpo.py"),
        f"policy.generation.num_speculative_tokens={k}", f"logger.log_dir={run_root}", f"logger.run_name={name}", *overrides,
    ]  # fmt: skip
    log = open(run_root / f"{name}.log", "w")
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    peak = [0.0]
    sampler = threading.Thread(target=peak_tree_memory_mb, args=(process, peak), daemon=True)
    sampler.start()
    return {"variant": variant, "name": name, "run_root": run_root, "process": process, "log": log, "sampler": sampler, "peak": peak, "started": time.monotonic()}


def finish_run(run: dict) -> dict:
    """The started run's per-phase medians, peak memory and auto's choices, once it has exited."""
    status = run["process"].wait()
    wall_s = time.monotonic() - run["started"]
    run["sampler"].join()
    run["log"].close()
    variant, name, run_root = run["variant"], run["name"], run["run_root"]
    if status != 0:
        raise SystemExit(f"the k = {variant} run exited with status {status}; its output: {run_root / f'{name}.log'}")
    rows = [row for row in read_metrics(run_root / name / "metrics.jsonl") if TIMING + STEP_SECONDS in row]
    result = {phase: statistics.median(row[TIMING + key] for row in rows) for phase, key in PHASES.items()}
    result["per_step"] = {phase: [row[TIMING + key] for row in rows] for phase, key in PHASES.items()}
    result.update({name: statistics.median(row[key] for row in rows) for name, key in TRAJECTORY.items()})
    result["per_step"].update({name: [row[key] for row in rows] for name, key in TRAJECTORY.items()})
    result["per_step"][OVER_LOGPROBS] = [row[TIMING + GENERATION_SECONDS] / row[TIMING + LOGPROBS_SECONDS] for row in rows]
    result.update(variant=variant, steps=len(rows), wall_s=wall_s, peak_mb=run["peak"][0])
    result["choices"] = collections.Counter(int(row[CHOSEN_K]) for row in rows if CHOSEN_K in row)
    return result


def table(results: list[dict]) -> str:
    lines = [
        "| round | k | " + " | ".join(f"{phase} (s)" for phase in PHASES) + " | " + " | ".join(TRAJECTORY)
        + " | peak memory (MB) | whole command (s) | auto's choices |",
        "|---|---|" + "---|" * (len(PHASES) + len(TRAJECTORY) + 3),
    ]
    for result in results:
        choices = ", ".join(f"k = {k} in {n}" for k, n in sorted(result["choices"].items())) if result["variant"] == "auto" else ""
        medians = " | ".join(f"{result[phase]:.3f}" for phase in PHASES) + " | " + " | ".join(f"{result[name]:.1f}" for name in TRAJECTORY)
        lines.append(f"| {result['round']} | {result['variant']} | {medians} | {result['peak_mb']:,.0f} | {result['wall_s']:.0f} | {choices} |")
    return "\n".join(lines)


def ratios(results: list[dict]) -> str:
    """auto's medians over k = 0's, k = 1's and the better one's, and with the control the second
    k = 0 run's over the first's: per round, and over the steps of every round pooled (each
    variant ran once in each position of the order when the rounds are a multiple of the
    variants, so a drift of the machine falls on every one alike). Times: lower is better;
    generation tokens/s: higher is. ``OVER_LOGPROBS`` takes the machine's speed out of each step."""
    variants = list(dict.fromkeys(result["variant"] for result in results))
    control = CONTROL in variants
    header = "| round | phase | auto / k = 0 | auto / k = 1 | auto / better |" + (" k = 0 again / k = 0 (A/A) |" if control else "")
    lines = [header, "|---|---|---|---|---|" + ("---|" if control else "")]
    rounds = sorted({result["round"] for result in results})
    for round_number in [*rounds, "all"]:
        chosen = [result for result in results if round_number in ("all", result["round"])]
        for phase, better in (("generation", min), ("whole step", min), (OVER_LOGPROBS, min), ("generation tokens/s", max)):
            median = {variant: statistics.median(value for result in chosen if result["variant"] == variant for value in result["per_step"][phase]) for variant in variants}
            auto, k0, k1 = median["auto"], median["0"], median["1"]
            aa = f" {median[CONTROL] / k0:.3f} |" if control else ""
            lines.append(f"| {round_number} | {phase} | {auto / k0:.3f} | {auto / k1:.3f} | {auto / better(k0, k1):.3f} |{aa}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="a multiple of the variants (3, 4 with --control) puts each once in each position of the order")
    parser.add_argument("--beside-load", action="store_true", help="run a second CPU-bound process (a one-thread matmul loop) beside all the runs")
    parser.add_argument("--together", action="store_true", help="start each round's three runs at the same time (module docstring)")
    parser.add_argument("--control", action="store_true", help="add a second k = 0 run to every round, an A/A control (module docstring)")
    parser.add_argument("--keep-logs", type=Path, help="write the runs' directories (metrics.jsonl: auto's choice per rollout) here and keep them")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = parser.parse_args()
    if args.keep_logs:
        if args.keep_logs.exists() and any(args.keep_logs.iterdir()):
            raise SystemExit(f"--keep-logs {args.keep_logs}: not empty (a run of the same name there would be read in place of this one's)")
        args.keep_logs.mkdir(parents=True, exist_ok=True)
    variants = (*KS, CONTROL) if args.control else KS
    results = []
    logs = contextlib.nullcontext(str(args.keep_logs)) if args.keep_logs else tempfile.TemporaryDirectory(prefix="default_recipe_k_")
    with logs as root, beside_load() if args.beside_load else contextlib.nullcontext():
        for round_number in range(1, args.rounds + 1):
            shift = (round_number - 1) % len(variants)
            order = variants[shift:] + variants[:shift]
            if args.together:
                started = [start_run(variant, args.overrides, Path(root), f"round{round_number}_k{variant.replace(' ', '_')}") for variant in order]
                round_results = [finish_run(run) for run in started]
            else:
                round_results = [finish_run(start_run(variant, args.overrides, Path(root), f"round{round_number}_k{variant.replace(' ', '_')}")) for variant in order]
            for result in round_results:
                result["round"] = round_number
                results.append(result)
                print(f"round {round_number}, k = {result['variant']}: generation {result['generation']:.3f} s, step {result['whole step']:.3f} s (medians of {result['steps']} steps), {result['wall_s']:.0f} s", flush=True)
    load = "a one-thread matmul loop beside the runs" if args.beside_load else "nothing else started"
    load += "; each round's runs at the same time" if args.together else "; each round's runs one after the other"
    print(f"\n{os.cpu_count()} CPUs; {load}; load average now {os.getloadavg()[0]:.1f}\n")
    print(table(results))
    print()
    print(ratios(results))


if __name__ == "__main__":
    main()
