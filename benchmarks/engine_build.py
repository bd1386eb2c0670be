"""How long building the rollout engine takes: the first build in a process, and later ones.

    uv run python -m benchmarks.engine_build [--builds 10] [--k 1] [--config examples/configs/grpo_mtp_tiny_cpu.yaml]

The default recipe's policy (examples/run_grpo.py's config) is built once in a single-process
megatron world; then ``build_engine`` runs ``--builds`` times over it with ``--k`` drafts per step
(the default recipe's ``auto`` switches between 0 and 1: each switch is a build). The first build
pays for every once-per-process probe (behaviour self-tests of the installed release); later
builds show what every ``auto`` switch costs. Prints the first build's time and the mean and
median of the others (the median: a shared machine's stalls land on single builds).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

from nemo_rl_mtp.grpo.checked_config import load_checked_config
from nemo_rl_mtp.rollout.engine import build_engine
from nemo_rl_mtp.training.model import initialize_model_parallel, setup_megatron_policy
from tests.support.helpers import BASE_RECIPE, VOCAB_SIZE, free_port


def build_times(config: Path, builds: int, k: int) -> list[float]:
    """Seconds of each of ``builds`` engine builds with ``k`` drafts per step over the recipe's policy."""
    cfg = load_checked_config(config, [f"policy.megatron_cfg.mtp_num_layers={max(k, 1)}"])
    initialize_model_parallel(cfg.policy.megatron_cfg, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    policy = setup_megatron_policy(cfg.policy, VOCAB_SIZE)
    seconds = []
    for _ in range(builds):
        start = time.perf_counter()
        engine = build_engine(policy.model.module, cfg.policy, k)
        seconds.append(time.perf_counter() - start)
        del engine
        gc.collect()  # the old engine's KV cache freed outside the timed build
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--builds", type=int, default=10)
    parser.add_argument("--k", type=int, default=1)
    parser.add_argument("--config", type=Path, default=BASE_RECIPE)
    args = parser.parse_args()
    seconds = build_times(args.config, args.builds, args.k)
    later = seconds[1:] or seconds
    print(
        f"engine builds (k={args.k}, {args.builds} builds): first {seconds[0] * 1e3:.1f} ms; later: mean "
        f"{statistics.mean(later) * 1e3:.1f} ms, median {statistics.median(later) * 1e3:.1f} ms "
        f"(min {min(later) * 1e3:.1f}, max {max(later) * 1e3:.1f}); mean of all {statistics.mean(seconds) * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
