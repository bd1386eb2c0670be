"""Whether the machine-speed probe (``nemo_rl_mtp.rollout.machine_speed``) tracks what a rollout
costs: one engine runs the same rollout over and over (the end of sequence masked, so every one
does the same work), each timed as ``auto`` times its own (the CPU clock over its steps) with the
probe run beside its steps as ``auto``'s rollouts run it.

    uv run python -m benchmarks.machine_speed [--new-tokens 256] [--rounds 14] [--k 0]
        [--beside-load] [--save trace.json] [key=value overrides, e.g. policy.megatron_cfg.num_layers=8]

Prints, in markdown, the spread of the rollouts' seconds as measured and read at the first
rollout's machine speed as ``auto`` reads them on a CPU (the probe's seconds to the power
``machine_speed.TRACKING``), to the power 1 and to the power fitted to this run, their
correlation with the probe's, and what the probe cost. Set-up as
``benchmarks/rollout_throughput.py`` (its config and counting prompts, 32 of them,
``--beside-load``'s one-thread matmul loop), untrained heads (the work, not the drafts, is what
is timed here).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
from pathlib import Path

import torch

import benchmarks.rollout_throughput as throughput
from nemo_rl_mtp.rollout import auto_k, machine_speed
from nemo_rl_mtp.rollout.engine import RolloutEngine

BATCH = 32


def probed_rollout(rollout_engine: RolloutEngine, prompts, seed: int) -> tuple[float, float, int]:
    """One rollout, its engine's probe run as auto's is: the rollout's stepped seconds, the
    probe's reading for it, the probes run during it."""
    with rollout_engine.sampling_session():
        rollout = rollout_engine.begin(prompts, throughput.TOKENIZER.eos_id, throughput.TOKENIZER.pad_id, seed)
        while rollout.step():
            pass
    rollout.finish()
    probe = rollout_engine.speed_probe
    return rollout.seconds, probe.reading(rollout.probes_before), probe.taken - rollout.probes_before


def spread(values: list[float]) -> str:
    """Coefficient of variation, and the lowest and highest over the median."""
    median = statistics.median(values)
    return f"{statistics.pstdev(values) / statistics.mean(values):.3f} | {min(values) / median:.3f}-{max(values) / median:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=14)
    parser.add_argument("--k", type=int, default=0, help="drafts per step of the engine")
    parser.add_argument("--beside-load", action="store_true", help="run a second CPU-bound process (a one-thread matmul loop) beside the benchmark")
    parser.add_argument("--save", type=Path, help="write the rollouts' seconds and probe readings here (JSON), for auto_k_noise_simulation --traces")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args()
    args.mtp_layers, args.train_batch = 2, 64  # rollout_throughput's defaults
    if args.rounds < 3:
        parser.error("--rounds: at least 3, so there is a spread to show")

    policy = throughput.benchmark_policy(throughput.config(args, 0, args.new_tokens, BATCH))
    rollout_engine = RolloutEngine(policy, throughput.config(args, args.k, args.new_tokens, BATCH))
    rollout_engine.speed_probe = machine_speed.SpeedProbe(auto_k.step_clock())  # as auto's engine has (a fixed k's has none)
    prompts, _ = throughput.counting_task(BATCH, 1, torch.Generator().manual_seed(BATCH))
    rows = []
    with throughput.beside_load() if args.beside_load else contextlib.nullcontext(), throughput.end_of_sequence_masked(policy):
        probed_rollout(rollout_engine, prompts, seed=99)  # warm
        probes_before = rollout_engine.speed_probe.taken
        for round_number in range(args.rounds):
            rows.append(probed_rollout(rollout_engine, prompts, seed=round_number))
            print(f"rollout {round_number}: {rows[-1][0]:.3f} s, probe {1e3 * rows[-1][1]:.3f} ms ({rows[-1][2]} probes)", flush=True)

    seconds = [row[0] for row in rows]
    probe = [row[1] for row in rows]
    if args.save:
        args.save.write_text(json.dumps({"rollout_seconds": seconds, "probe_seconds": probe, "command": sys.argv[1:]}))
    fitted = statistics.linear_regression([math.log(value) for value in probe], [math.log(value) for value in seconds]).slope
    cost = statistics.mean(rollout_engine.speed_probe.samples) * (rollout_engine.speed_probe.taken - probes_before) / sum(seconds)
    load = "beside a one-thread matmul loop" if args.beside_load else "quiet"
    print(f"\nk = {args.k}, {BATCH} prompts x {args.new_tokens} new tokens, {args.rounds} rollouts of the same work, {load}; "
          f"{torch.get_num_threads()} torch thread(s); CPU seconds per rollout: median {statistics.median(seconds):.3f}\n")  # fmt: skip
    print("| rollouts' seconds | coefficient of variation | lowest-highest over the median |\n|---|---|---|")
    print(f"| as measured | {spread(seconds)} |")
    for power, name in ((machine_speed.TRACKING, "auto's"), (1.0, "all"), (fitted, "fitted to this run")):
        read = [row_seconds * (probe[0] / row_probe) ** power for row_seconds, row_probe in zip(seconds, probe)]  # machine_speed.speed at ``power``
        print(f"| at the first rollout's speed, taking the probe's to the power {power:.2f} ({name}) | {spread(read)} |")
    print(f"\ncorrelation of the rollouts' seconds with the probe's: {statistics.correlation(seconds, probe):.2f}; "
          f"the probes took {100 * cost:.2f}% of the rollouts' seconds ({statistics.median(row[2] for row in rows):.0f} during a rollout)")  # fmt: skip


if __name__ == "__main__":
    main()
