"""How far one rollout's measured speed moves on this machine, the error ``auto`` decides under
(``nemo_rl_mtp.rollout.auto_k``): several identical engines at one k run the same rollout in
rotating order, each step timed with the process's CPU time (the clock auto uses without a GPU).

    uv run python -m benchmarks.rollout_noise [--new-tokens 128] [--batch 32] [--engines 4]
        [--rounds 10] [--k 0] [--beside-load] [key=value overrides]

Prints three answers, in markdown:
- **Between rollouts:** each rollout's seconds over the median of its round (the same work by
  every engine, one after the other): the spread of those ratios is what a single measurement of
  a k is worth, and auto's bound holds only up to it.
- **Between engines:** each engine's median ratio, with its lowest and highest over the rounds.
  auto rebuilds its engine at every change of k; were one engine's memory placement luckier than
  another's, a rebuild alone would move auto's measurements. A median near 1 says it does not.
- **Where a rollout's noise sits:** the first spread again with every step capped at 1.5x its
  rollout's median step, and what the cap takes. If a slow rollout is slow in a few steps (a
  preemption, a collection), capping narrows the spread and auto could measure robustly so; if
  it is slow in every step (a shift), the spread stays, and only more rollouts reduce it.

Set-up as ``benchmarks/rollout_throughput.py`` (its config, its counting prompts, the end of
sequence masked so every rollout does the same work, ``--beside-load``'s one-thread matmul loop).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

import benchmarks.rollout_throughput as throughput
from nemo_rl_mtp.rollout.engine import RolloutEngine

STEP_CAP = 1.5  # a step above this multiple of its rollout's median step counts as an outlier


def timed_rollout(rollout_engine: RolloutEngine, prompts, seed: int) -> list[float]:
    """One rollout of ``prompts``; the CPU seconds of each of its engine steps."""
    engine, steps = rollout_engine.engine, []
    step = engine.step_modern

    def timed_step(*args, **kwargs):
        start = time.process_time()
        try:
            return step(*args, **kwargs)
        finally:
            steps.append(time.process_time() - start)

    engine.step_modern = timed_step
    try:
        rollout_engine.generate(prompts, throughput.TOKENIZER.eos_id, throughput.TOKENIZER.pad_id, seed)
    finally:
        del engine.step_modern
    return steps


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--k", type=int, default=0, help="drafts per step of every engine")
    parser.add_argument("--mtp-layers", type=int, default=2)
    parser.add_argument("--beside-load", action="store_true", help="run a second CPU-bound process (a one-thread matmul loop) beside the benchmark")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args()
    args.train_batch = 64  # throughput.config's training batch (its default); no training runs here
    if args.engines < 2 or args.rounds < 2:
        parser.error("--engines and --rounds: at least 2 each, so there is a spread to show")

    policy = throughput.benchmark_policy(throughput.config(args, 0, args.new_tokens, args.batch))
    engines = [RolloutEngine(policy, throughput.config(args, args.k, args.new_tokens, args.batch)) for _ in range(args.engines)]
    prompts, _ = throughput.counting_task(args.batch, 1, torch.Generator().manual_seed(args.batch))

    steps = [[] for _ in engines]  # per engine, per round: the step times of its rollout
    with throughput.beside_load() if args.beside_load else contextlib.nullcontext(), throughput.end_of_sequence_masked(policy):
        for rollout_engine in engines:
            rollout_engine.generate(prompts, throughput.TOKENIZER.eos_id, throughput.TOKENIZER.pad_id, seed=99)  # warm
        for round_number in range(args.rounds):
            shift = round_number % len(engines)
            for index in [*range(shift, len(engines)), *range(shift)]:
                steps[index].append(timed_rollout(engines[index], prompts, seed=round_number))

    totals = [[sum(rollout) for rollout in engine_steps] for engine_steps in steps]
    capped = [[capped_total(rollout) for rollout in engine_steps] for engine_steps in steps]
    relative = over_round_medians(totals)
    every = [value for engine_relative in relative for value in engine_relative]
    deviations = sorted(abs(value - 1.0) for value in every)
    load = "beside a one-thread matmul loop" if args.beside_load else "quiet"
    print(f"\n{args.engines} engines at k = {args.k}, {args.batch} prompts x {args.new_tokens} new tokens, {args.rounds} rounds, {load}; "
          f"CPU seconds per rollout: median {statistics.median(seconds for engine_totals in totals for seconds in engine_totals):.3f}\n")  # fmt: skip
    print("| | median (lowest-highest) |\n|---|---|")
    print(f"| a rollout over its round's median | {spread(every)} |")
    print(f"| half of all rollouts within | +-{100 * deviations[len(deviations) // 2]:.1f}% |")
    print(f"| nine in ten within | +-{100 * deviations[int(0.9 * (len(deviations) - 1))]:.1f}% |")
    for index, engine_relative in enumerate(relative):
        print(f"| engine {index}: its rollouts over their rounds' medians | {spread(engine_relative)} |")
    capped_relative = [value for engine_relative in over_round_medians(capped) for value in engine_relative]
    print(f"| a rollout over its round's median, steps capped at {STEP_CAP}x its median step | {spread(capped_relative)} |")
    removed = [1.0 - cut / total for engine_capped, engine_totals in zip(capped, totals) for cut, total in zip(engine_capped, engine_totals)]
    print(f"| what the cap takes from a rollout's total | {100 * statistics.median(removed):.1f}% ({100 * min(removed):.1f}-{100 * max(removed):.1f}%) |")


def over_round_medians(seconds: list[list[float]]) -> list[list[float]]:
    """Per engine, each round's seconds over that round's median across the engines."""
    medians = [statistics.median(round_seconds) for round_seconds in zip(*seconds)]
    return [[value / median for value, median in zip(engine_seconds, medians)] for engine_seconds in seconds]


def capped_total(step_seconds: list[float]) -> float:
    """A rollout's seconds with every step above ``STEP_CAP`` x its median step counted at that."""
    cap = STEP_CAP * statistics.median(step_seconds)
    return sum(min(seconds, cap) for seconds in step_seconds)


if __name__ == "__main__":
    main()
