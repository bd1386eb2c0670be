"""Draft acceptance of exact-match vs rejection-sampling verification, and of drafts from each
request's sequence vs megatron's single-position draft step, side by side in one run, on MTP
heads trained during a short GRPO run (the default recipe with two MTP layers), at the rollout
temperature of RL (1.0).

    uv run python -m benchmarks.spec_verification [--steps 80] [--warm-start] [--prompts 512] [-o PATH]

1. Runs GRPO (Ray workers, as `examples/run_grpo.py` does) and keeps its final checkpoint.
2. Loads that checkpoint into one in-process policy, builds one engine per (draft context,
   verification, k) over it, and generates the same prompts with each (same seed).
3. Prints acceptance per draft position, tokens per decode step and generated tokens per second,
   and, with ``-o PATH``, plots the acceptance and tokens per step (the figures docs/results.md
   shows are ``benchmarks/spec_verification.png`` and ``spec_verification_warm_start.png``;
   without ``-o`` none is drawn, so a run cannot overwrite them unasked).
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

from omegaconf import read_write

REPO_ROOT = Path(__file__).resolve().parents[1]

from nemo_rl_mtp.grpo.loop import grpo_train  # noqa: E402
from nemo_rl_mtp.grpo.run import latest_checkpoint  # noqa: E402
from nemo_rl_mtp.tasks.tokenizer import DigitTokenizer  # noqa: E402
from nemo_rl_mtp.cluster.ray_cluster import shutdown_ray  # noqa: E402
from nemo_rl_mtp.tasks.digit_tasks import DigitTaskPrompts  # noqa: E402
from nemo_rl_mtp.rollout.engine import RolloutEngine  # noqa: E402
from nemo_rl_mtp.rollout.speculation import speculation_metrics  # noqa: E402
from nemo_rl_mtp.training.checkpoint import load_policy  # noqa: E402
from nemo_rl_mtp.training.model import initialize_model_parallel, setup_megatron_policy  # noqa: E402
from nemo_rl_mtp.grpo.checked_config import load_checked_config  # noqa: E402
from tests.support.helpers import free_port  # noqa: E402

TOKENIZER = DigitTokenizer()
MTP_LAYERS = 2


def trained_run(steps: int, log_dir: str, warm_start: bool):
    """The config of a finished GRPO run of ``steps`` steps, whose last checkpoint holds its weights:
    from scratch (a policy early in RL, far from greedy), or with the default recipe's warm start
    (a policy that has learned the task, with heads that learned it too)."""
    from_scratch = ["grpo.warmup_imitation_steps=0", "policy.megatron_cfg.optimizer.lr=1e-3"]
    cfg = load_checked_config(
        REPO_ROOT / "examples" / "configs" / "grpo_mtp_tiny_cpu.yaml",
        [
            f"grpo.max_num_steps={steps}",
            f"policy.megatron_cfg.mtp_num_layers={MTP_LAYERS}",
            f"policy.generation.num_speculative_tokens={MTP_LAYERS}",
            f"logger.log_dir={log_dir}",
            "logger.run_name=spec-verification",
            "logger.console=false",
            "logger.wandb_enabled=false",
            "logger.tensorboard_enabled=false",
            *([] if warm_start else from_scratch),
        ],
    )
    history = grpo_train(cfg)
    shutdown_ray()
    return cfg, history[-1]


DRAFT_CONTEXTS = ("single_position", "sequence")
VERIFICATIONS = ("exact_match", "rejection_sampling")
VARIANTS = [(context, verification) for context in DRAFT_CONTEXTS for verification in VERIFICATIONS]


def engine_config(cfg, k: int, draft_context: str, verification: str):
    """The run's policy config with k drafts from ``draft_context``, verified by ``verification``."""
    policy = copy.deepcopy(cfg.policy)
    with read_write(policy):
        policy.generation.num_speculative_tokens = k
        policy.generation.draft_context = draft_context
        policy.generation.spec_verification = verification
    return policy


def measure(policy, cfg, prompts: list[list[int]]) -> dict[tuple[str, str, int], dict]:
    results = {}
    for k in range(0, MTP_LAYERS + 1):
        for draft_context, verification in VARIANTS if k else [("-", "-")]:
            engine = RolloutEngine(policy, engine_config(cfg, k, draft_context if k else "sequence", verification if k else "exact_match"))
            start = time.perf_counter()
            rollouts = engine.generate(prompts, TOKENIZER.eos_id, TOKENIZER.pad_id, seed=7)
            seconds = time.perf_counter() - start
            metrics = speculation_metrics(rollouts)
            generated = int((rollouts["lengths"] - rollouts["prompt_lengths"]).sum())
            results[(draft_context, verification, k)] = {
                "acceptance": [metrics[f"rollout/draft_{i}_acceptance_rate"] for i in range(1, k + 1)],
                "tokens_per_decode_step": metrics.get("rollout/tokens_per_decode_step", 1.0),
                "tokens_per_s": generated / seconds,
            }
    return results


def report(results: dict, trained: dict) -> None:
    training = ", ".join(f"depth {i}: {trained[f'train/mtp/mtp_{i}_acceptance_rate']:.0f}%" for i in range(1, MTP_LAYERS + 1))
    print(f"\nheads after GRPO (reward {trained['train/reward']:.2f}; training-side top-1 MTP acceptance {training})")
    print(f"{'draft context':<17}{'verification':<20}{'k':>3}{'tok/step':>10}{'tokens/s':>10}  acceptance by draft position")
    for (draft_context, verification, k), result in results.items():
        shown = " ".join(f"{value:.0f}%" for value in result["acceptance"])
        print(f"{draft_context:<17}{verification:<20}{k:>3}{result['tokens_per_decode_step']:>10.2f}{result['tokens_per_s']:>10.0f}  {shown}")


def plot(results: dict, output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (acceptance_axis, steps_axis) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.2
    middle = width * (len(VARIANTS) - 1) / 2
    for offset, (draft_context, verification) in enumerate(VARIANTS):
        label = f"{verification}, drafts from {'the sequence' if draft_context == 'sequence' else 'one position'}"
        rates = results[(draft_context, verification, MTP_LAYERS)]["acceptance"]
        acceptance_axis.bar([i + offset * width for i in range(len(rates))], rates, width, label=label)
        per_step = [results[(draft_context, verification, k)]["tokens_per_decode_step"] for k in range(1, MTP_LAYERS + 1)]
        steps_axis.bar([k + offset * width for k in range(len(per_step))], per_step, width, label=label)
    acceptance_axis.set_xticks([i + middle for i in range(MTP_LAYERS)], [f"draft {i + 1}" for i in range(MTP_LAYERS)])
    acceptance_axis.set_ylabel(f"rollout acceptance, % (k = {MTP_LAYERS})")
    steps_axis.set_xticks([k + middle for k in range(MTP_LAYERS)], [f"k = {k + 1}" for k in range(MTP_LAYERS)])
    steps_axis.set_ylabel("tokens per decode step")
    acceptance_axis.legend(fontsize=7)
    figure.suptitle("MTP draft verification at temperature 1, heads trained during GRPO")
    figure.tight_layout()
    figure.savefig(output, dpi=110)
    print(f"figure: {output}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warm-start", action="store_true", help="the default recipe's imitation warm start before GRPO")
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("-o", "--output", type=Path, default=None, help="plot to this PNG (none drawn without it)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as log_dir:
        cfg, trained = trained_run(args.steps, log_dir, args.warm_start)
        initialize_model_parallel(cfg.policy.megatron_cfg, 0, 1, f"tcp://127.0.0.1:{free_port()}")
        policy = setup_megatron_policy(cfg.policy, TOKENIZER.vocab_size)
        load_policy(policy, latest_checkpoint(cfg))
    prompts = [prompt.prompt_ids for prompt in DigitTaskPrompts(cfg.env, TOKENIZER, seed=1).next_prompts(args.prompts)]
    results = measure(policy, cfg, prompts)
    report(results, trained)
    if args.output is not None:
        plot(results, args.output)


if __name__ == "__main__":
    main()
