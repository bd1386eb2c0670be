"""Write a small arithmetic dataset as JSONL (``{"prompt": "What is 17 + 25?", "answer": "42"}``
a line), for the math environment's CPU recipe and tests.

    uv run python scripts/arithmetic_dataset.py --out data/arithmetic   # train.jsonl, val.jsonl

Sums and differences of numbers up to ``--max-operand``; the validation questions never appear in
the training file.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path


def questions(max_operand: int) -> list[tuple[str, str]]:
    """Every (prompt, answer) of the dataset, in a fixed order."""
    pairs = []
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            pairs.append((f"What is {a} + {b}?", str(a + b)))
            pairs.append((f"What is {a} - {b}?", str(a - b)))
    return pairs


def write_arithmetic_dataset(out_dir: str | Path, max_operand: int = 20, num_val: int = 128, seed: int = 0) -> tuple[Path, Path]:
    """``out_dir/train.jsonl`` and ``out_dir/val.jsonl`` (``num_val`` held-out questions)."""
    pairs = questions(max_operand)
    random.Random(seed).shuffle(pairs)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / "train.jsonl", out_dir / "val.jsonl"
    for path, part in zip(paths, (pairs[num_val:], pairs[:num_val])):
        path.write_text("".join(json.dumps({"prompt": prompt, "answer": answer}) + "\n" for prompt, answer in part))
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for train.jsonl and val.jsonl")
    parser.add_argument("--max-operand", type=int, default=20)
    parser.add_argument("--num-val", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train, val = write_arithmetic_dataset(args.out, args.max_operand, args.num_val, args.seed)
    print(f"wrote {train} ({sum(1 for _ in train.open())} prompts) and {val} ({sum(1 for _ in val.open())} prompts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
