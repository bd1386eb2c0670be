"""Do greedy outputs of this project's engine change with torch's thread count? The vLLM
side-by-side's two-thread question (issue #26): its 1 x 5 and 512 x 64 cells on the same
MiMo-layout export, at 1 and 2 threads, k = 0 and 1, each twice in alternation.

    uv run python -m benchmarks.thread_count_outputs [--hf-ckpt-path DIR] [--prompts 32]

Prints, per cell, whether every repeat of a (threads, k) variant gave the same responses, and how
many responses of each variant equal the one-thread k = 0 responses.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from benchmarks.vllm_side_by_side import Cell, ours_on_export


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-ckpt-path", type=Path, help="a MiMo-layout export (default: the tiny random one)")
    parser.add_argument("--prompts", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="thread_count_outputs_") as scratch:
        ours, prompts, eos_id, pad_id = ours_on_export(args.hf_ckpt_path, Path(scratch), args.prompts)
        for cell in (Cell(1, args.prompts, 5, False), Cell(512, args.prompts, 64, True)):
            responses = {}
            for threads in (1, 2, 1, 2):
                torch.set_num_threads(threads)
                for k in (0, 1):
                    responses.setdefault((threads, k), []).append(ours.run(cell, k, prompts, eos_id, pad_id).responses)
            reference = responses[1, 0][0]
            print(f"{cell.name}, {sum(map(len, reference))} tokens at one thread, k = 0:")
            for (threads, k), runs in responses.items():
                same = sum(a == b for a, b in zip(reference, runs[0]))
                repeatable = all(run == runs[0] for run in runs)
                print(f"  {threads} thread(s), k = {k}: repeats identical: {'yes' if repeatable else 'no'}; "
                      f"responses equal to one thread k = 0: {same}/{len(reference)}")
    torch.set_num_threads(1)


if __name__ == "__main__":
    main()
