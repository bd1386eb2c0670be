"""Draft acceptance of exact-match vs rejection-sampling verification, side by side in one run, on
MTP heads trained during a short GRPO run (the default recipe with two MTP layers), at the
rollout temperature of RL (1.0).

    uv run python benchmarks/spec_verification.py [--steps 80] [--prompts 512] [-o benchmarks/spec_verification.png]

1. Runs GRPO (Ray workers, as `examples/run_grpo.py` does) and keeps its final checkpoint.
2. Loads that checkpoint into one in-process policy, builds one engine per (verification, k) over
   it, and generates the same prompts with each (same seed).
3. Prints acceptance per draft position and tokens per decode step, and plots them.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import read_write

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from nemo_rl_mtp.algorithms.grpo import grpo_train, latest_checkpoint  # noqa: E402
from nemo_rl_mtp.data.tokenizer import DigitTokenizer  # noqa: E402
from nemo_rl_mtp.distributed.ray_cluster import shutdown_ray  # noqa: E402
from nemo_rl_mtp.environments.digit_tasks import DigitTaskEnvironment  # noqa: E402
from nemo_rl_mtp.models.generation.engine_rollouts import RolloutEngine  # noqa: E402
from nemo_rl_mtp.models.generation.spec_verification import VERIFICATIONS  # noqa: E402
from nemo_rl_mtp.models.generation.speculation import speculation_metrics  # noqa: E402
from nemo_rl_mtp.models.megatron.checkpoint import load_policy  # noqa: E402
from nemo_rl_mtp.models.megatron.setup import initialize_model_parallel, setup_megatron_policy  # noqa: E402
from nemo_rl_mtp.utils.config import load_config  # noqa: E402
from tests.helpers import free_port  # noqa: E402

TOKENIZER = DigitTokenizer()
MTP_LAYERS = 2


def trained_run(steps: int, log_dir: str):
    """The config of a finished GRPO run of ``steps`` steps, whose last checkpoint holds its weights."""
    cfg = load_config(
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
            # GRPO from scratch, as measured for the README: a policy early in RL, far from greedy.
            "grpo.warmup_imitation_steps=0",
            "policy.megatron_cfg.optimizer.lr=1e-3",
        ],
    )
    history = grpo_train(cfg)
    shutdown_ray()
    return cfg, history[-1]


def engine_config(cfg, k: int, verification: str):
    """The run's policy config with k drafts verified by ``verification``."""
    policy = copy.deepcopy(cfg.policy)
    with read_write(policy):
        policy.generation.num_speculative_tokens = k
        policy.generation.spec_verification = verification
    return policy


def measure(policy, cfg, prompts: list[list[int]]) -> dict[tuple[str, int], dict]:
    results = {}
    for k in range(1, MTP_LAYERS + 1):
        for verification in VERIFICATIONS:
            engine = RolloutEngine(policy, engine_config(cfg, k, verification))
            start = time.perf_counter()
            rollouts = engine.generate(prompts, TOKENIZER.eos_id, TOKENIZER.pad_id, seed=7)
            seconds = time.perf_counter() - start
            metrics = speculation_metrics(rollouts)
            generated = int((rollouts["lengths"] - rollouts["prompt_lengths"]).sum())
            results[(verification, k)] = {
                "acceptance": [metrics[f"rollout/draft_{i}_acceptance_rate"] for i in range(1, k + 1)],
                "tokens_per_decode_step": metrics["rollout/tokens_per_decode_step"],
                "tokens_per_s": generated / seconds,
            }
    return results


def report(results: dict, trained: dict) -> None:
    training = ", ".join(f"depth {i}: {trained[f'train/mtp/mtp_{i}_acceptance_rate']:.0f}%" for i in range(1, MTP_LAYERS + 1))
    print(f"\nheads after GRPO (reward {trained['train/reward']:.2f}; training-side top-1 MTP acceptance {training})")
    print(f"{'verification':<20}{'k':>3}{'tok/step':>10}{'tokens/s':>10}  acceptance by draft position")
    for (verification, k), result in results.items():
        shown = " ".join(f"{value:.0f}%" for value in result["acceptance"])
        print(f"{verification:<20}{k:>3}{result['tokens_per_decode_step']:>10.2f}{result['tokens_per_s']:>10.0f}  {shown}")


def plot(results: dict, output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (acceptance_axis, steps_axis) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.35
    for offset, verification in enumerate(VERIFICATIONS):
        rates = results[(verification, MTP_LAYERS)]["acceptance"]
        positions = [i + offset * width for i in range(len(rates))]
        acceptance_axis.bar(positions, rates, width, label=verification)
        per_step = [results[(verification, k)]["tokens_per_decode_step"] for k in range(1, MTP_LAYERS + 1)]
        steps_axis.bar([k + offset * width for k in range(len(per_step))], per_step, width, label=verification)
    acceptance_axis.set_xticks([i + width / 2 for i in range(MTP_LAYERS)], [f"draft {i + 1}" for i in range(MTP_LAYERS)])
    acceptance_axis.set_ylabel(f"rollout acceptance, % (k = {MTP_LAYERS})")
    steps_axis.set_xticks([k + width / 2 for k in range(MTP_LAYERS)], [f"k = {k + 1}" for k in range(MTP_LAYERS)])
    steps_axis.set_ylabel("tokens per decode step")
    for axis in (acceptance_axis, steps_axis):
        axis.legend()
    figure.suptitle("MTP draft verification at temperature 1, heads trained during GRPO")
    figure.tight_layout()
    figure.savefig(output, dpi=110)
    print(f"figure: {output}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("-o", "--output", type=Path, default=REPO_ROOT / "benchmarks" / "spec_verification.png")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as log_dir:
        cfg, trained = trained_run(args.steps, log_dir)
        initialize_model_parallel(cfg.policy.megatron_cfg, 0, 1, f"tcp://127.0.0.1:{free_port()}")
        policy = setup_megatron_policy(cfg.policy, TOKENIZER.vocab_size)
        load_policy(policy, latest_checkpoint(cfg))
    env = DigitTaskEnvironment(cfg.env, TOKENIZER)
    prompts = [TOKENIZER.encode_prompt(digits) for digits in env.sample_prompts(args.prompts, torch.Generator().manual_seed(1))]
    results = measure(policy, cfg, prompts)
    report(results, trained)
    plot(results, args.output)


if __name__ == "__main__":
    main()
