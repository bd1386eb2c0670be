"""How the rollout benchmark's way of stepping its engines moves the ratios it reports: the fixed
engines at k = 0, 1, 2 and a second k = 0 engine (an A/A control), their rollouts of the same
prompts run each alone, whole, one after the other (as a training run and auto's rollouts run),
and stepped in turn with turns of one step or of a given length of time (as
``benchmarks/rollout_throughput.py`` steps them: ``run_in_turn``, ``--turn-ms``).

Why: each change of turn slows the next step (another engine's step has evicted its data from the
caches); turns of one step charge that once per step, so most to the engine with the cheapest
steps (k = 0), and the benchmark read k = 2 ahead of k = 0 by more than rollouts alone do. Turns
of equal time charge every engine the same share of its time; the longer they are, the more of
the machine's drift between turns reaches the ratios. Whole rollouts alone have no bias of
either kind and the most drift.

    uv run python -m benchmarks.turn_length [key=value overrides, e.g. policy.megatron_cfg.num_layers=8]
        [--heads trained] [--repeats 12] [--new-tokens 128] [--turn-ms 0 10 30 100]

(the overrides before ``--turn-ms``, which takes every value after it).

Set-up as the rollout benchmark (its config, counting prompts, imitation training of the heads
for ``--heads trained``, the end of sequence masked), 32 prompts, one torch thread, CPU time. In
each repeat the ways of stepping run in a random order, and the engines in a random order within
each. Prints per way: k = 0's tokens/s (median), and each engine's tokens/s over k = 0's in the
same repeat: median, quartiles, standard deviation.
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

import benchmarks.rollout_throughput as throughput
from nemo_rl_mtp.rollout.engine import RolloutEngine

BATCH = 32
ENGINES = (("k=0", 0), ("k=1", 1), ("k=2", 2), (throughput.CONTROL, 0))
ALONE = "whole rollouts alone"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", choices=("untrained", "trained"), default="trained")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--turn-ms", type=float, nargs="+", default=[0, 10, 30, 100], help="turn lengths to compare (0: one step a turn)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--train-steps", type=int, default=60)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args()
    args.mtp_layers, args.train_batch, args.train_length = 2, 64, 128  # rollout_throughput's defaults
    throughput.CLOCK_NAME[0] = "cpu"

    base = throughput.config(args, 0, max(args.new_tokens, args.train_length), args.train_batch)
    policy = throughput.benchmark_policy(base)
    phases_of = {}
    throughput.attention_timers(phases_of)
    if args.heads == "trained":
        throughput.train_heads(policy, args, base)

    ways = [ALONE, *(f"turns of {turn_ms:g} ms" if turn_ms else "turns of one step" for turn_ms in args.turn_ms)]
    turn_seconds = dict(zip(ways[1:], (turn_ms / 1000 for turn_ms in args.turn_ms)))
    engines = {
        way: [throughput.Variant(name, RolloutEngine(policy, throughput.config(args, k, args.new_tokens, BATCH))) for name, k in ENGINES]
        for way in ways
    }
    prompts, _ = throughput.counting_task(BATCH, 1, torch.Generator().manual_seed(BATCH))
    for way in ways:  # each engine's first rollout, untimed
        throughput.run_in_turn(engines[way], prompts, 999, phases_of, timed=False)
    order = random.Random(0)
    for repeat in range(args.repeats):
        for way in order.sample(ways, len(ways)):
            shuffled = order.sample(engines[way], len(engines[way]))
            if way == ALONE:
                for variant in shuffled:
                    throughput.run_in_turn([variant], prompts, repeat, phases_of)
            else:
                throughput.TURN_SECONDS[0] = turn_seconds[way]
                throughput.run_in_turn(shuffled, prompts, repeat, phases_of)

    print(f"\n{args.heads} heads, {BATCH} x {args.new_tokens} new tokens, {args.repeats} repeats, CPU time\n")
    print("| way of stepping | k=0 tokens/s | " + " | ".join(f"{name} / k=0: median (quartiles), sd" for name, _ in ENGINES[1:]) + " |")
    print("|---|---|" + "---|" * (len(ENGINES) - 1))
    for way in ways:
        reference, *others = engines[way]
        cells = []
        for variant in others:
            ratios = sorted(variant.paired_ratios(reference))
            quartiles = f"{ratios[len(ratios) // 4]:.3f}-{ratios[(3 * len(ratios)) // 4]:.3f}"
            cells.append(f"{statistics.median(ratios):.3f} ({quartiles}), {statistics.pstdev(ratios):.3f}")
        print(f"| {way} | {reference.rate:.0f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
