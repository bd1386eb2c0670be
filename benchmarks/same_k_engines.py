"""Engines at the same k, side by side: two fixed engines built one after the other, one rebuilt
through a history of switches as auto's is, and auto itself once it has settled on that k, their
rollouts run first one after the other (whole rollouts in rotating order, as the rollout benchmark
ran them until 2026-12-05) and then in turn (as it runs them now, in turns of 20 ms). Asks
whether auto's engine runs slower than a fixed engine at the k it chose, whether two identical
fixed engines differ, and how much of what a comparison of whole rollouts shows is the machine's
speed drifting between them.

    uv run python -m benchmarks.same_k_engines [--new-tokens 512] [--rounds 8] [--k 2]
        [--train-steps 60] [key=value overrides, e.g. policy.megatron_cfg.num_layers=8]

Set-up as ``benchmarks/rollout_throughput.py`` (its config, counting prompts and imitation
training of the heads, the end of sequence masked so every rollout does the same work), 32
prompts, one torch thread; each rollout timed with the process's CPU time over its own steps,
the engines' order rotating each round. Prints, per way of running, each engine's tokens/s over
the first fixed engine's, per round, their median and their standard deviation, in markdown.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import benchmarks.rollout_throughput as throughput
from nemo_rl_mtp.rollout.engine import RolloutEngine

BATCH = 32
SWITCHES = (1, 0, 1, 2, 0)  # the rebuilt engine's history before it returns to --k (auto's warm-up switches as often)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--k", type=int, default=2, help="the k of the fixed engines, and the one auto should settle on")
    parser.add_argument("--train-steps", type=int, default=60)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args()
    args.mtp_layers, args.train_batch, args.train_length = 2, 64, 128  # rollout_throughput's defaults

    base = throughput.config(args, 0, max(args.new_tokens, args.train_length), args.train_batch)
    policy = throughput.benchmark_policy(base)
    throughput.train_heads(policy, args, base)

    fixed = throughput.config(args, args.k, args.new_tokens, BATCH)
    engines = {"fixed": RolloutEngine(policy, fixed), "fixed, built next": RolloutEngine(policy, fixed)}
    rebuilt = RolloutEngine(policy, fixed)
    for k in (*SWITCHES, args.k):
        rebuilt.use_speculative_tokens(k)
    engines["fixed, rebuilt"] = rebuilt
    engines["auto"] = RolloutEngine(policy, throughput.config(args, "auto", args.new_tokens, BATCH))

    prompts, _ = throughput.counting_task(BATCH, 1, torch.Generator().manual_seed(BATCH))
    throughput.CLOCK_NAME[0] = "cpu"
    phases_of = {}
    variants = [throughput.Variant(name, engine) for name, engine in engines.items()]  # instrumented once, kept across modes
    for warm_up in range(args.mtp_layers + 1):  # auto's profile and first looks, as the benchmark's warm-up
        throughput.run_in_turn(variants[-1:], prompts, 1000 + warm_up, phases_of, timed=False)
    for variant in variants[:-1]:
        throughput.run_in_turn([variant], prompts, 99, phases_of, timed=False)

    for mode in ("one after the other", "in turn"):
        for variant in variants:
            variant.times, variant.chosen = {name: [] for name in throughput.CLOCKS}, []
        for round_number in range(args.rounds):
            shift = round_number % len(variants)
            order = variants[shift:] + variants[:shift]
            if mode == "in turn":
                throughput.run_in_turn(order, prompts, round_number, phases_of)
            else:
                for variant in order:
                    throughput.run_in_turn([variant], prompts, round_number, phases_of)
        print_table(mode, variants, args)


def print_table(mode: str, variants: list, args) -> None:
    auto = variants[-1]
    print(f"\n{BATCH} prompts x {args.new_tokens} new tokens, k = {args.k}, {args.rounds} rounds, rollouts {mode}, "
          f"overrides {args.overrides or 'none'}; auto ran k = {'/'.join(map(str, auto.chosen))}\n")  # fmt: skip
    print("| engine | CPU s per rollout (median) | tokens/s over `fixed`, per round | median | standard deviation |\n|---|---|---|---|---|")
    for variant in variants:
        ratios = variant.paired_ratios(variants[0])
        print(f"| {variant.name} | {statistics.median(variant.times['cpu']):.2f} | {' '.join(f'{r:.3f}' for r in ratios)} | "
              f"{statistics.median(ratios):.3f} | {statistics.stdev(ratios):.3f} |")


if __name__ == "__main__":
    main()
