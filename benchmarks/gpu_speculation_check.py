"""The one prepared check for a lent GPU (issue #26, item 5): megatron-core's engine speculating
with the policy's own MTP heads at k = 0 .. mtp_layers and auto, on a MiMo-7B-shaped model with
random weights, the variants stepped in turn as in ``benchmarks.rollout_throughput``; each k's
decode step against k = 0's as measured and as the decode-step cost model predicts it
(:mod:`nemo_rl_mtp.rollout.step_cost_model`, docs/gpu-cost-model.md), and what each k would give
at a given acceptance from either.

    python3 -m benchmarks.gpu_speculation_check [--layers 16] [--mtp-layers 2] [--batch 32]
        [--prompt-tokens 128] [--new-tokens 512] [--repeats 3] [--acceptance 0.9 0.8] [--dry-run]

A k's cost per step is its rollouts' seconds over their engine steps, whatever its drafts'
acceptance: c_k / c_0, the ratio the cost model is checked on here and the one auto's prior takes
from the model on an H100 or an H200 (random heads over MiMo's vocabulary accept next to nothing,
so there a k's tokens/s over k = 0's is c_0 / c_k as well). MiMo-7B-RL's shape (hidden 4096, 32
heads in 8 groups of 128, SwiGLU 11008, vocabulary 151,680, bf16) with 16 of its 36 layers by
default: a policy model carries its optimizer (fp32 main weights and gradients), and the whole
model with it does not fit an H100's 80 GB; the cost model is given the same shape, so the check
holds at any depth (``--layers 36`` on an H200). The engine runs eagerly (no CUDA graphs), as the
cost model's ``EAGER_MEGATRON`` overheads assume; without flash-attn (a lent machine cannot fetch
it) its paged attention runs in torch, slower than flash-attn's kernels, and the output says so.
``--dry-run``: the tiny default model, a few steps, on whatever is there (a CPU), to check the
script before spending device minutes. How to run it on a lent machine, with the packages it
lacks carried: docs/gpu-cost-model.md, "On a lent GPU".
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

import benchmarks.rollout_throughput as throughput
from nemo_rl_mtp.megatron_compat.cpu import inference_runtime
from nemo_rl_mtp.megatron_compat.cpu.training_runtime import cuda_available
from nemo_rl_mtp.megatron_compat.installed import megatron_core_version
from nemo_rl_mtp.metrics import DECODE_STEPS
from nemo_rl_mtp.rollout import step_cost_model
from nemo_rl_mtp.rollout.engine import RolloutEngine
from nemo_rl_mtp.training.model import initialize_model_parallel, setup_megatron_policy
from tests.support.helpers import free_port

MIMO_7B = {  # MiMo-7B-RL's decoder, as benchmarks.gpu_cost_model.MIMO_7B gives it to the cost model
    "hidden_size": 4096,
    "ffn_hidden_size": 11008,
    "num_attention_heads": 32,
    "num_query_groups": 8,
    "activation": "swiglu",
    "normalization": "RMSNorm",
    "params_dtype": "bfloat16",
    "transformer_impl": "local",
}
MIMO_VOCAB = 151680
# The first ids are the digit tokenizer's (end of sequence among them, masked in the output so
# every response fills its budget); prompts draw from the rest.
FIRST_PROMPT_ID = throughput.TOKENIZER.vocab_size


def policy_config(args, k):
    """One variant's policy config: ``benchmarks.rollout_throughput``'s, at this check's shape,
    prompts and k."""
    return throughput.config(args, k, args.new_tokens, args.batch, prompt_tokens=args.prompt_tokens)


def random_prompts(args, vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(FIRST_PROMPT_ID, vocab_size, (args.batch, args.prompt_tokens), generator=generator).tolist()


def seconds_per_step(variant: throughput.Variant) -> float:
    """The median rollout's seconds over its engine steps (the prefill step among them)."""
    return statistics.median(variant.times[throughput.CLOCK_NAME[0]]) / int(variant.output[DECODE_STEPS])


def tokens_per_step(rates: list[float], k: int) -> float:
    """1 + sum_{i <= k} rho_i, rho_i the chained acceptance of draft i from per-depth ``rates``."""
    return 1.0 + sum(math.prod(rates[:depth]) for depth in range(1, k + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16, help="decoder layers of the MiMo-7B shape (36: the whole model, on an H200)")
    parser.add_argument("--mtp-layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--acceptance", type=float, nargs="+", default=[0.9, 0.8], help="per-depth acceptance for the projection (each given the one before)")
    parser.add_argument("--dry-run", action="store_true", help="the tiny default model, a few steps, on whatever is there")
    args = parser.parse_args()
    if len(args.acceptance) < args.mtp_layers:
        parser.error(f"--acceptance: one rate per MTP depth, {args.mtp_layers} (got {len(args.acceptance)})")
    if args.dry_run:
        args.batch, args.prompt_tokens, args.new_tokens, args.repeats = 4, 8, 16, 2
    vocab_size = 256 if args.dry_run else MIMO_VOCAB
    shape = {} if args.dry_run else {**MIMO_7B, "num_layers": args.layers}
    args.overrides = [f"policy.megatron_cfg.{key}={value}" for key, value in shape.items()]
    args.train_batch = 64  # rollout_throughput's (the policy's optimizer is built, never stepped)

    base = policy_config(args, 0)
    initialize_model_parallel(base.megatron_cfg, 0, 1, f"tcp://127.0.0.1:{free_port()}")
    if not cuda_available():
        attention = "torch paged attention (CPU)"
    elif inference_runtime.install_paged_attention_without_flash_attn():
        attention = "torch paged attention (no flash-attn: slower than a served engine's)"
    else:
        attention = "flash-attn"
    torch.manual_seed(base.megatron_cfg.seed)
    policy = setup_megatron_policy(base, vocab_size)
    device = torch.cuda.get_device_name() if cuda_available() else "CPU"
    print(f"{device}; torch {torch.__version__}, megatron-core {megatron_core_version()}; attention: {attention}; eager (no CUDA graphs)", flush=True)

    variants = [throughput.Variant(f"k={k}", RolloutEngine(policy, policy_config(args, k))) for k in range(args.mtp_layers + 1)]
    auto = throughput.Variant("auto", RolloutEngine(policy, policy_config(args, "auto")))
    prompts, phases_of = random_prompts(args, vocab_size), {}
    for warm_up in range(args.mtp_layers + 1):  # auto's profile and first looks, as in a run
        throughput.run_in_turn([auto], prompts, 1000 + warm_up, phases_of, timed=False)
    throughput.run_in_turn(variants, prompts, 999, phases_of, timed=False)
    everyone = [*variants, auto]
    for repeat in range(args.repeats):
        shift = repeat % len(everyone)
        throughput.run_in_turn(everyone[shift:] + everyone[:shift], prompts, repeat, phases_of)
        print(f"repeat {repeat + 1}/{args.repeats}: " + ", ".join(f"{v.name} {v.tokens / v.times[throughput.CLOCK_NAME[0]][-1]:.0f} tok/s" for v in everyone), flush=True)

    model = policy.model.module
    model_shape = step_cost_model.model_shape_from_megatron_config(model.config, model.vocab_size, "MiMo-7B shape" if not args.dry_run else "tiny")
    gpu = step_cost_model.gpu_spec_from_device_name(device)
    if gpu is None:  # a CPU (the dry run) or a GPU the model has no figures for
        gpu = step_cost_model.H100_SXM
        print(f"(the cost model has no figures for {device}: its column is an {gpu.name}'s)")
    context = args.prompt_tokens + args.new_tokens // 2
    predicted = step_cost_model.relative_step_costs(model_shape, gpu, args.batch, context, args.mtp_layers)
    base_step = seconds_per_step(variants[0])
    print(f"\n{model_shape.name}, {args.layers if not args.dry_run else 'default'} layers + {args.mtp_layers} MTP; {args.batch} requests x "
          f"{args.prompt_tokens} prompt + {args.new_tokens} new tokens (random weights, end of sequence masked); median of {args.repeats}; "
          f"cost model: {gpu.name} at {context} tokens of context, eager\n")  # fmt: skip
    print("| k | tokens/s | vs k = 0 | ms per step | c_k/c_0 measured | c_k/c_0 cost model | acceptance per depth (%) |")
    print("|---|---|---|---|---|---|---|")
    for k, variant in enumerate(variants):
        shown = " / ".join(f"{rate:.1f}" for rate in variant.acceptance()) or "-"
        print(f"| {k} | {variant.rate:,.0f} | {variant.rate / variants[0].rate:.2f} | {1e3 * seconds_per_step(variant):.2f} | "
              f"{seconds_per_step(variant) / base_step:.2f} | {predicted[k]:.2f} | {shown} |")  # fmt: skip
    best = max(variants, key=lambda variant: variant.rate)
    print(f"\nauto ran k = {'/'.join(map(str, auto.chosen))}: {auto.rate:,.0f} tokens/s, {auto.rate / variants[0].rate:.2f} of k = 0, {auto.rate / best.rate:.2f} of the best fixed k ({best.name})")
    rates = list(args.acceptance)
    print(f"\nAt per-depth acceptance {' / '.join(f'{rate:.2f}' for rate in rates)} (tokens/s over k = 0, (1 + sum rho_i) / (c_k / c_0)):\n")
    print("| k | tokens per step | from the measured costs | from the cost model |\n|---|---|---|---|")
    for k in range(args.mtp_layers + 1):
        tokens = tokens_per_step(rates, k)
        measured = seconds_per_step(variants[k]) / base_step
        print(f"| {k} | {tokens:.2f} | {tokens / measured:.2f} | {tokens / predicted[k]:.2f} |")


if __name__ == "__main__":
    main()
