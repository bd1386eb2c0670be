"""How fast the command line refuses a bad config: each case is a fresh process, as a user runs
it (``uv run examples/run_grpo.py ...`` and ``python -m nemo_rl_mtp.cli ...``), timed from start
to exit. Every case must exit 2 with one line naming the key; the target is 2 s each. Before the
config path was split into pure checks and release capabilities, the speculation-depth case took
33-40 s (loading a config imported megatron-core and torch first).

Bad files the config names (a checkpoint directory that is not there, a JSONL line that is not
JSON, a run directory holding an earlier run) are refused by the run's preflight, after torch is
imported and before megatron-core is: their target is 5 s (before, they came after megatron-core's
import, 13-20 s here).

    uv run python -m benchmarks.config_refusal [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
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
        # The default recipe's warm start mixes in a digit-task distractor, which math has none of.
        ["env.name=math", "policy.model_name=Qwen/Qwen3-0.6B", "grpo.warmup_distractor_task=null", "grpo.warmup_distractor_fraction=0"],
        "data.train_data_path=None: env.name=math takes its prompts from JSONL files",
    ),
}
FILES_TARGET_S = 5.0
MATH_RECIPE = REPO_ROOT / "examples" / "configs" / "grpo_math_tiny_mimo_cpu.yaml"


def file_cases(scratch: Path) -> dict[str, tuple[list[str], str]]:
    """Bad files a config names, written under ``scratch`` (name -> (overrides, refusal))."""
    checkpoint = scratch / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")  # reachable: the bad data file is what is refused
    good, bad = scratch / "good.jsonl", scratch / "bad.jsonl"
    good.write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n')
    bad.write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n{"prompt": "What is 2 + 2?" "answer": "4"}\n')
    earlier = scratch / "logs" / "earlier"
    earlier.mkdir(parents=True)
    (earlier / "metrics.jsonl").write_text('{"step": 0}\n')
    logs = f"logger.log_dir={scratch / 'logs'}"
    return {
        "missing checkpoint": ([f"policy.model_name={scratch / 'missing'}", logs], f"policy.model_name={scratch / 'missing'}: no such directory"),
        "bad JSONL line": (
            ["--config", str(MATH_RECIPE), f"policy.model_name={checkpoint}", f"data.train_data_path={bad}", f"data.val_data_path={good}", logs],
            f"data.train_data_path={bad}, line 2: not JSON",
        ),
        "earlier run's directory": ([logs, "logger.run_name=earlier"], f"logger.run_name=earlier: {scratch / 'logs' / 'earlier'} holds an earlier run"),
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
    print(f"config refusal, median of {args.repeats} run(s) per case; target {TARGET_S:.1f} s, bad files {FILES_TARGET_S:.1f} s")
    over = 0
    with tempfile.TemporaryDirectory(prefix="config_refusal_") as scratch:
        groups = ((CASES, TARGET_S), (file_cases(Path(scratch)), FILES_TARGET_S))
        for entry, command in ENTRY_POINTS.items():
            print(f"{entry}:")
            for cases, target in groups:
                for name, (overrides, expected) in cases.items():
                    seconds = statistics.median(time_refusal([*command, *overrides], expected) for _ in range(args.repeats))
                    over += seconds > target
                    print(f"  {name:<24s} {seconds:5.2f} s  {'ok' if seconds <= target else 'OVER TARGET'}")
    print(f"{over} case(s) over target")
    return 0 if over == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
