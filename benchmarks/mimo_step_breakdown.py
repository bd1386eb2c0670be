"""Where a decode step's time goes in this project's engine on the MiMo-layout export of the
vLLM side-by-side (``benchmarks/vllm_side_by_side.py``), at k = 0 and k = 1: ms of CPU time per
decode step, by phase, at 512 requests together or one request at a time.

    uv run python -m benchmarks.mimo_step_breakdown [--hf-ckpt-path DIR] [--repeats 3] [--new-tokens 64] [--requests 512|1]

A decode step is isolated by difference: each k runs the prompts (EOS ignored, greedy) to
``--new-tokens`` and to 5 new tokens, and the phases' CPU time of the short run is taken from the
long one's, over the decode steps between them, so prefill and the first steps drop out. Phases
are those of ``benchmarks/rollout_throughput.py`` (trunk forward, drafts, verification,
bookkeeping; the attention over the trunk's and the MTP caches shown apart, and inside trunk and
drafts). The CPU clock, one torch thread: another job's load on a shared machine stays out of it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import benchmarks.rollout_throughput as throughput
from benchmarks.vllm_side_by_side import Cell, Ours, ours_on_export

PHASES = ("trunk", "trunk attention", "drafts", "draft attention", "verification", "bookkeeping", "engine bookkeeping")
SHORT = 5


def phase_seconds(ours: Ours, cell: Cell, k: int, prompts, eos_id: int, pad_id: int, repeats: int, phases_of: dict) -> dict[str, float]:
    """Mean CPU seconds per phase (and ``total``), and mean engine steps (``steps``), of one
    generate call over ``repeats`` runs."""
    ours.run(cell, k, prompts[:4], eos_id, pad_id)  # builds the engine and warms it
    phases = throughput.StepPhases()
    phases.instrument(ours.engine(cell, k).engine)  # once: a second wrapper would time the first
    runs = []
    for _ in range(repeats):
        before, steps_before = dict(phases.seconds), phases.steps
        phases_of["current"] = phases
        start = time.process_time()
        ours.run(cell, k, prompts, eos_id, pad_id)
        total = time.process_time() - start
        phases_of["current"] = None
        seconds = {name: phases.seconds.get(name, 0.0) - before.get(name, 0.0) for name in PHASES}
        runs.append(seconds | {"total": total, "steps": phases.steps - steps_before})
    # The mean, not each phase's median: phases and total then come from the same runs.
    return {name: statistics.fmean(run[name] for run in runs) for name in (*PHASES, "total", "steps")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-ckpt-path", type=Path, help="a MiMo-layout export (default: the tiny random one)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--requests", type=int, choices=(512, 1), default=512, help="512 together, or 1 at a time (8 prompts one after the other)"
    )
    args = parser.parse_args()
    if args.new_tokens < 32:
        parser.error(f"--new-tokens {args.new_tokens}: at least 32, so the decode steps outweigh the runs' noise")
    throughput.CLOCK_NAME[0] = "cpu"
    phases_of: dict = {}
    throughput.attention_timers(phases_of)
    with tempfile.TemporaryDirectory(prefix="mimo_step_breakdown_") as scratch:
        count = 512 if args.requests > 1 else 8
        ours, prompts, eos_id, pad_id = ours_on_export(args.hf_ckpt_path, Path(scratch), count)
        seconds = {}
        for new_tokens in (SHORT, args.new_tokens):
            for k in (0, 1):
                cell = Cell(args.requests, count, new_tokens, True)
                seconds[new_tokens, k] = phase_seconds(ours, cell, k, prompts, eos_id, pad_id, args.repeats, phases_of)
    # Engine steps between the two runs, counted: at k = 1 accepted drafts make them fewer than tokens.
    steps = {k: seconds[args.new_tokens, k]["steps"] - seconds[SHORT, k]["steps"] for k in (0, 1)}
    together = "512 requests together" if args.requests > 1 else "1 request at a time (8 prompts)"
    print(f"ms of CPU time per decode step, {together}, new tokens {SHORT + 1}..{args.new_tokens}: {steps[0]:.0f} steps at k = 0, "
          f"{steps[1]:.0f} at k = 1 (mean of {args.repeats} runs each, one torch thread)\n")  # fmt: skip
    print("| phase | k = 0 | k = 1 | k = 1 extra |\n|---|---|---|---|")
    for name in (*PHASES, "total"):
        per_step = [1000.0 * (seconds[args.new_tokens, k][name] - seconds[SHORT, k][name]) / steps[k] for k in (0, 1)]
        print(f"| {name} | {per_step[0]:.2f} | {per_step[1]:.2f} | {per_step[1] - per_step[0]:+.2f} |")


if __name__ == "__main__":
    main()
