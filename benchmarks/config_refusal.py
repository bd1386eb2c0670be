"""How fast the command line refuses a bad config: each case is a fresh process, as a user runs
it (``uv run examples/run_grpo.py ...`` and ``python -m nemo_rl_mtp.cli ...``), timed from start
to exit. Every case must exit 2 with one line naming the key; the target is 2 s each. Before the
config path was split into pure checks and release capabilities, the speculation-depth case took
33-40 s (loading a config imported megatron-core and torch first).

    uv run python -m benchmarks.config_refusal [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 2.0
EXIT_CONFIG_ERROR = 2  # nemo_rl_mtp.reporting.console.EXIT_CONFIG_ERROR (not imported: this stays light)

# name -> (overrides, what the one-line refusal must say)
CASES: dict[str, tuple[list[str], str]] = {
    "speculation depth": (
        ["policy.megatron_cfg.mtp_num_layers=1", "policy.generation.num_speculative_tokens=3"],
        "policy.generation.num_speculative_tokens=3: this model's MTP heads can propose at most 1",
    ),
    "range": (["grpo.num_prompts_per_step=0"], "grpo.num_prompts_per_step=0: must be in [1, inf)"),
    "unknown key": (["policy.megatron_cfg.mtp_layerz=2"], "mtp_layerz"),
    "bad choice": (["env.name=chess"], "env.name='chess' is not one of ['digits', 'math']"),
    "math without data": (
        ["env.name=math", "policy.model_name=Qwen/Qwen3-0.6B"],
        "data.train_data_path=None: env.name=math takes its prompts from JSONL files",
    ),
}
ENTRY_POINTS = {
    "uv run examples/run_grpo.py": ["uv", "run", "examples/run_grpo.py"],
    "python -m nemo_rl_mtp.cli": [sys.executable, "-m", "nemo_rl_mtp.cli"],
}


def time_refusal(command: list[str], expected: str) -> float:
    """Seconds from start to exit of ``command``; raises unless it exits 2 with ``expected`` in
    its one-line refusal."""
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    refusal = done.stderr.strip().splitlines()
    if done.returncode != EXIT_CONFIG_ERROR or len(refusal) != 1 or expected not in refusal[0]:
        raise SystemExit(f"{' '.join(command)}: exit {done.returncode}, stderr {done.stderr.strip()!r}; expected exit 2 with {expected!r}")
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each case (the median is shown)")
    args = parser.parse_args()
    print(f"config refusal, median of {args.repeats} run(s) per case; target {TARGET_S:.1f} s")
    slowest = 0.0
    for entry, command in ENTRY_POINTS.items():
        print(f"{entry}:")
        for name, (overrides, expected) in CASES.items():
            seconds = statistics.median(time_refusal([*command, *overrides], expected) for _ in range(args.repeats))
            slowest = max(slowest, seconds)
            print(f"  {name:<20s} {seconds:5.2f} s  {'ok' if seconds <= TARGET_S else 'OVER TARGET'}")
    print(f"slowest {slowest:.2f} s (target {TARGET_S:.1f} s)")
    return 0 if slowest <= TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
