"""Rollout throughput on the tiny CPU model, all measured side by side in one run:
the full-recompute sampler (the rollouts before the engine) vs megatron-core's inference engine
without speculation and with k = 1 .. mtp_num_layers draft tokens from the MTP heads, first with
untrained heads, then after a short imitation of a deterministic task (count on from the prompt's
digit), which trains policy and heads alike. Sampling at temperature 1, as in RL.

    uv run python benchmarks/rollout_throughput.py [--prompts 32] [--new-tokens 32] [--mtp-layers 2]

Prints tokens/s with ratios to the sampler and to the engine without speculation, tokens a request
gains per decode step, engine steps (forward passes, prefill included) per token of the longest
response, and acceptance per draft position.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from nemo_rl_mtp.algorithms.imitation import imitation_step  # noqa: E402
from nemo_rl_mtp.data.demonstrations import demonstration_batch  # noqa: E402
from nemo_rl_mtp.data.tokenizer import DigitTokenizer  # noqa: E402
from nemo_rl_mtp.models.generation.engine_rollouts import RolloutEngine  # noqa: E402
from nemo_rl_mtp.models.generation.speculation import speculation_metrics  # noqa: E402
from nemo_rl_mtp.models.megatron.setup import initialize_model_parallel, setup_megatron_policy  # noqa: E402
from nemo_rl_mtp.utils.config import load_config  # noqa: E402
from tests.helpers import free_port, recompute_sampler  # noqa: E402

TOKENIZER = DigitTokenizer()


def counting_task(num_prompts: int, new_tokens: int, generator: torch.Generator) -> tuple[list, list]:
    """Prompts ``<bos> d =`` and answers counting on from d for ``new_tokens - 1`` digits, then eos."""
    starts = torch.randint(0, 10, (num_prompts,), generator=generator).tolist()
    prompts = [TOKENIZER.encode_prompt([start]) for start in starts]
    answers = [TOKENIZER.encode_answer([(start + step) % 10 for step in range(1, new_tokens)]) for start in starts]
    return prompts, answers


def config(args, num_speculative_tokens: int):
    return load_config(
        overrides=[
            f"policy.megatron_cfg.mtp_num_layers={args.mtp_layers}",
            f"policy.generation.num_speculative_tokens={num_speculative_tokens}",
            f"policy.generation.max_new_tokens={args.new_tokens}",
            f"policy.max_total_sequence_length={args.new_tokens + 6}",  # fits the exemplar task prompts too
            f"policy.train_global_batch_size={args.train_batch}",
            f"policy.train_micro_batch_size={args.train_batch}",
            f"grpo.num_prompts_per_step={args.train_batch}",
            "grpo.num_generations_per_prompt=2",
            "policy.megatron_cfg.optimizer.lr=3e-3",
            *args.overrides,
        ]
    ).policy


def measure(variants: dict, prompts: list[list[int]], repeats: int) -> dict[str, dict]:
    """Each variant ``repeats`` times, interleaved; the median time, with the last run's output."""
    times = {name: [] for name in variants}
    outputs = {}
    for repeat in range(repeats):
        for name, run in variants.items():
            start = time.perf_counter()
            outputs[name] = run(prompts, repeat)
            times[name].append(time.perf_counter() - start)
    return {name: {"seconds": statistics.median(times[name]), "output": outputs[name]} for name in variants}


def report(title: str, results: dict[str, dict]) -> None:
    sampler_rate = engine_rate = None
    print(f"\n{title}")
    print(f"{'rollouts':<24}{'tokens/s':>10}{'vs sampler':>12}{'vs k=0':>8}{'tok/step':>10}{'steps/token':>13}  acceptance by draft position")
    for name, result in results.items():
        output = result["output"]
        generated = int((output["lengths"] - output["prompt_lengths"]).sum())
        rate = generated / result["seconds"]
        sampler_rate = sampler_rate or rate
        if name.startswith("engine") and engine_rate is None:
            engine_rate = rate
        speculation = speculation_metrics(output) if "draft_proposed" in output else {}
        acceptance = [value for key, value in speculation.items() if key.endswith("acceptance_rate")]
        per_step = speculation.get("rollout/tokens_per_decode_step", 1.0)
        longest = int((output["lengths"] - output["prompt_lengths"]).max())
        steps_per_token = f"{float(output['decode_steps']) / longest:.2f}" if "decode_steps" in output else "-"
        versus_engine = f"{rate / engine_rate:.2f}" if engine_rate else "-"
        shown = " ".join(f"{value:.0f}%" for value in acceptance) or "-"
        print(f"{name:<24}{rate:>10.0f}{rate / sampler_rate:>12.2f}{versus_engine:>8}{per_step:>10.2f}{steps_per_token:>13}  {shown}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--mtp-layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train-steps", type=int, default=60)
    parser.add_argument("--train-batch", type=int, default=64)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args()

    base = config(args, 0)
    initialize_model_parallel(base.megatron_cfg, 0, 1, f"tcp://127.0.0.1:{free_port()}")
    torch.manual_seed(base.megatron_cfg.seed)
    policy = setup_megatron_policy(base, TOKENIZER.vocab_size)
    engines = {k: RolloutEngine(policy, config(args, k)) for k in range(args.mtp_layers + 1)}
    variants = {"full-recompute sampler": lambda prompts, seed: _recompute_rollouts(policy, prompts, args.new_tokens, seed)}
    for k, engine in engines.items():
        variants[f"engine k={k}"] = lambda prompts, seed, engine=engine: engine.generate(
            prompts, TOKENIZER.eos_id, TOKENIZER.pad_id, seed
        )
    generator = torch.Generator().manual_seed(0)
    prompts, _ = counting_task(args.prompts, args.new_tokens, generator)
    print(f"{args.prompts} prompts x up to {args.new_tokens} new tokens, {args.mtp_layers} MTP layers, temperature 1, "
          f"{torch.get_num_threads()} torch thread(s); median of {args.repeats} interleaved runs")
    report("untrained heads", measure(variants, prompts, args.repeats))

    for _ in range(args.train_steps):
        demonstrations = demonstration_batch(*counting_task(args.train_batch, args.new_tokens, generator), TOKENIZER.pad_id)
        metrics = imitation_step(policy, demonstrations, base)
    training = ", ".join(f"layer {i}: {metrics[f'mtp_{i}_acceptance_rate']:.0f}%" for i in range(1, args.mtp_layers + 1))
    report(f"after {args.train_steps} imitation steps (training-side MTP acceptance {training})",
           measure(variants, prompts, args.repeats))


def _recompute_rollouts(policy, prompts, new_tokens, seed) -> dict[str, torch.Tensor]:
    sequences = recompute_sampler(policy, prompts, new_tokens, TOKENIZER.eos_id, temperature=1.0, seed=seed)
    return {
        "lengths": torch.tensor([len(sequence) for sequence in sequences]),
        "prompt_lengths": torch.tensor([len(prompt) for prompt in prompts]),
    }


if __name__ == "__main__":
    main()
