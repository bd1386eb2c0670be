"""What MTP speculation should buy on a GPU, on paper: the cost model of a decode step
(``nemo_rl_mtp/rollout/step_cost_model.py``) for the shipped GPU recipes on an H100 and an H200,
then the same model against the published figures. No GPU needed; nothing is measured.

    uv run python -m benchmarks.gpu_cost_model [--overheads eager|graphs]

For each recipe, GPU, batch size (requests per engine) and context length (tokens in each
request's cache): c_k / c_0 for k = 1..3 and the expected tokens/s against k = 0 at the
acceptance assumed for the recipe, and k = 0's modelled tokens/s per engine (all its GPUs).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from nemo_rl_mtp.config.load import load_config
from nemo_rl_mtp.rollout.step_cost_model import (
    ATTENTION,
    CUDA_GRAPHS,
    EAGER_MEGATRON,
    GPUS,
    H200_SXM,
    MLP,
    MOE,
    GPUSpec,
    HostOverheads,
    MLAShape,
    ModelShape,
    MoEShape,
    chained_acceptance,
    expected_speedups,
    fits_in_memory,
    model_shape_from_megatron_config,
    relative_step_costs,
    step_cost,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPES = REPO_ROOT / "examples" / "configs"
BATCH_SIZES = (1, 8, 64, 256)
CONTEXT_LENGTHS = (1024, 16384)
MAX_K = 3
# The recipes built from scratch run the digit tasks (a 14-id tokenizer, 64 tokens); a real run with
# their shapes would bring a real tokenizer: 128k ids assumed here, the as-shipped rows below too.
ASSUMED_VOCAB = 131072

# MiMo-7B-RL's config.json (Qwen2 layout: 36 layers, hidden 4096, 32 query and 8 key-value heads
# of 128, SwiGLU 11008, vocabulary 151,680, one MTP layer of the same kind); the recipe imports
# it, so its shape is not in the recipe file.
MIMO_7B = ModelShape(
    name="MiMo-7B-RL",
    hidden_size=4096,
    vocab_size=151680,
    decoder_layers=(ATTENTION, MLP) * 36,
    mtp_layer=(ATTENTION, MLP),
    num_attention_heads=32,
    num_query_groups=8,
    head_dim=128,
    ffn_hidden_size=11008,
)
# DeepSeek-V3 as published (61 layers, the first 3 dense with SwiGLU 18432, then 256 routed experts
# of 2048, 8 per token, one shared expert; MLA with 128 heads, q rank 1536, kv rank 512, rotary 64;
# vocabulary 129,280; one MTP module, an MoE layer), fp8 weights as it is served, bf16 latent cache.
DEEPSEEK_V3 = ModelShape(
    name="DeepSeek-V3 (671B, fp8)",
    hidden_size=7168,
    vocab_size=129280,
    decoder_layers=(ATTENTION, MLP) * 3 + (ATTENTION, MOE) * 58,
    mtp_layer=(ATTENTION, MOE),
    num_attention_heads=128,
    num_query_groups=128,
    head_dim=128,
    ffn_hidden_size=18432,
    moe=MoEShape(num_experts=256, topk=8, expert_ffn_hidden_size=2048, shared_ffn_hidden_size=2048),
    mla=MLAShape(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
    weight_bytes_per_param=1.0,
)

# Chained acceptance rho_1..rho_3 assumed per recipe. MiMo: ~90% at depth 1, ~75% at depth 3 (MiMo's
# report), the middle interpolated geometrically. The others: DeepSeek-V3's 85-90% at depth 1
# (87.5%), then each further depth accepted 87% of the time given the ones before (SkyRL's RL-time
# ratios: 77.0/88.6 and 66.3/77.0).
MIMO_ACCEPTANCE = [0.90, 0.90 * math.sqrt(0.75 / 0.90), 0.75]
DEFAULT_ACCEPTANCE = chained_acceptance([0.875, 0.87, 0.87])


def recipe_shape(file_name: str, vocab_size: int) -> tuple[ModelShape, int]:
    """The shape a recipe builds from scratch and its tensor-parallel size."""
    megatron_cfg = load_config(RECIPES / file_name).policy.megatron_cfg
    name = file_name.removeprefix("grpo_mtp_").removesuffix("_gpu.yaml")
    return model_shape_from_megatron_config(megatron_cfg, vocab_size, name=name), int(megatron_cfg.tensor_model_parallel_size)


def recipes(vocab_size: int) -> list[tuple[ModelShape, int, list[float]]]:
    """(shape, tensor-parallel size, chained acceptance) of each shipped GPU recipe."""
    rows = [(MIMO_7B, 2, MIMO_ACCEPTANCE)]
    for file_name in (
        "grpo_mtp_deepseek_v3_style_gpu.yaml",
        "grpo_mtp_nemotron3_super_style_gpu.yaml",
        "grpo_mtp_nemotron3_super_style_hybrid_gpu.yaml",
    ):
        shape, parallel = recipe_shape(file_name, vocab_size)
        rows.append((shape, parallel, DEFAULT_ACCEPTANCE))
    return rows


def tokens_per_s(model: ModelShape, gpu: GPUSpec, batch: int, context: int, k: int, overheads: HostOverheads, parallel: int, rates: list[float]) -> float:
    """Modelled tokens/s of one engine (its ``parallel`` GPUs together) at k."""
    seconds = step_cost(model, gpu, batch, context, k, overheads, parallel).seconds
    return batch * (1.0 + sum(rates[:k])) / seconds


def recipe_table(overheads: HostOverheads) -> list[str]:
    """One row per recipe, batch size and context: c_k / c_0 and tokens/s against k = 0 for
    k = 1/2/3 on each GPU; k = 0's tokens/s, what bounds its step, whether it fits."""
    lines = [
        f"Recipes, {overheads.name}; chained acceptance rho_1/2/3: MiMo {fmt_rates(MIMO_ACCEPTANCE)}, others {fmt_rates(DEFAULT_ACCEPTANCE)}",
        "| recipe (TP) | batch | context | H100 c_k/c_0, k=1/2/3 | H100 tokens/s vs k=0 | H200 c_k/c_0 | H200 tokens/s vs k=0 | H200 k=0 tokens/s | H200 k=0 bound | fits H100/H200 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    h100, h200 = GPUS["H100 SXM"], GPUS["H200 SXM"]
    for model, parallel, rates in recipes(ASSUMED_VOCAB):
        for batch in BATCH_SIZES:
            for context in CONTEXT_LENGTHS:
                cells = []
                for gpu in (h100, h200):
                    costs = relative_step_costs(model, gpu, batch, context, MAX_K, overheads, parallel)
                    gains = expected_speedups(costs, rates)
                    cells.append(" / ".join(f"{costs[k]:.2f}" for k in range(1, MAX_K + 1)))
                    cells.append(" / ".join(f"{gains[k]:.2f}" for k in range(1, MAX_K + 1)))
                base = step_cost(model, h200, batch, context, 0, overheads, parallel)
                fits = "/".join("yes" if fits_in_memory(model, gpu, batch, context, parallel) else "no" for gpu in (h100, h200))
                lines.append(
                    f"| {model.name} ({parallel}) | {batch} | {context} | " + " | ".join(cells)
                    + f" | {tokens_per_s(model, h200, batch, context, 0, overheads, parallel, rates):,.0f} | {bound(base)} | {fits} |"
                )
    return lines


def as_shipped_table(overheads: HostOverheads) -> list[str]:
    """The from-scratch recipes exactly as shipped: 14-id vocabulary, 64-token sequences."""
    lines = [
        f"As shipped (digits tokenizer, 14 ids; context 64), H200, {overheads.name}",
        "| recipe | batch | c1/c0 | k=1 | k=0 tokens/s | bound at k=0 |",
        "|---|---|---|---|---|---|",
    ]
    for model, parallel, rates in recipes(14)[1:]:
        for batch in BATCH_SIZES:
            costs = relative_step_costs(model, H200_SXM, batch, 64, 1, overheads, parallel)
            base = step_cost(model, H200_SXM, batch, 64, 0, overheads, parallel)
            lines.append(
                f"| {model.name} | {batch} | {costs[1]:.2f} | **{expected_speedups(costs, rates)[1]:.2f}x** | "
                f"{tokens_per_s(model, H200_SXM, batch, 64, 0, overheads, parallel, rates):,.0f} | {bound(base)} |"
            )
    return lines


def operating_points() -> list[str]:
    """Each recipe where it runs: requests per engine = prompts x generations per step over the
    data-parallel engines (GPUs / TP), context half the recipe's longest sequence (the mean over a
    rollout that fills it), the recipe's own vocabulary (MiMo's; the digits tokenizer's 14 ids)."""
    lines = [
        "Each recipe at its own operating point, H200 (k=2, 3 beyond mtp_num_layers for MiMo and DeepSeek-V3-style: what a repeated application would cost)",
        "| recipe | requests per engine | context | vocabulary | eager c_k/c_0, k=1/2/3 | eager tokens/s vs k=0 | graphs c_k/c_0 | graphs tokens/s vs k=0 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    files = {
        "MiMo-7B-RL": "grpo_math_mimo_7b_rl_gpu.yaml",
        "deepseek_v3_style": "grpo_mtp_deepseek_v3_style_gpu.yaml",
        "nemotron3_super_style": "grpo_mtp_nemotron3_super_style_gpu.yaml",
        "nemotron3_super_style_hybrid": "grpo_mtp_nemotron3_super_style_hybrid_gpu.yaml",
    }
    for model, parallel, rates in [(MIMO_7B, 2, MIMO_ACCEPTANCE), *recipes(14)[1:]]:
        cfg = load_config(RECIPES / files[model.name])
        gpus = cfg.cluster.num_nodes * cfg.cluster.workers_per_node * cfg.cluster.gpus_per_worker
        batch = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt // (gpus // parallel)
        context = cfg.policy.max_total_sequence_length // 2
        cells = []
        for overheads in (EAGER_MEGATRON, CUDA_GRAPHS):
            costs = relative_step_costs(model, H200_SXM, batch, context, MAX_K, overheads, parallel)
            gains = expected_speedups(costs, rates)
            cells.append(" / ".join(f"{costs[k]:.2f}" for k in range(1, MAX_K + 1)))
            cells.append(" / ".join(f"{gains[k]:.2f}" for k in range(1, MAX_K + 1)))
        lines.append(f"| {model.name} (TP{parallel}) | {batch} | {context} | {model.vocab_size:,} | " + " | ".join(cells) + " |")
    return lines


def bound(cost) -> str:
    """What limits a step: the host's launches, memory or compute (the larger device term)."""
    if cost.launch_s >= cost.device_s:
        return "host"
    return "memory" if cost.bytes / H200_SXM.bandwidth_bytes_per_s >= cost.flops / H200_SXM.flops_per_s else "compute"


def yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def fmt_rates(rates: list[float]) -> str:
    return "/".join(f"{rate:.0%}" for rate in rates)


def solve_per_depth_acceptance(tokens_per_step: float, k: int) -> float:
    """The per-depth acceptance a (the same at every depth) with 1 + a + a^2 + .. + a^k equal to
    ``tokens_per_step`` (bisection; 1.0 where even a = 1 falls short)."""
    low, high = 0.0, 1.0
    if k + 1 <= tokens_per_step:
        return 1.0
    for _ in range(60):
        middle = (low + high) / 2
        if sum(middle**i for i in range(k + 1)) < tokens_per_step:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def published_rows() -> list[str]:
    lines = ["Against the published figures (model / published)"]
    # DeepSeek-V3: 1.8x tokens/s at 85-90% depth-1 acceptance, one draft.
    lines += [
        "",
        "DeepSeek-V3, k=1, published 1.8x at 85-90% acceptance. Model: 671B fp8, TP8 over 8 H200, context 4096.",
        "| overheads | batch | c1/c0 | k=1 at 85% | k=1 at 90% | experts read per MoE layer k=0 -> k=1 | fits |",
        "|---|---|---|---|---|---|---|",
    ]
    for overheads in (CUDA_GRAPHS, EAGER_MEGATRON):
        for batch in BATCH_SIZES:
            costs = relative_step_costs(DEEPSEEK_V3, H200_SXM, batch, 4096, 1, overheads, 8)
            touched = [256 * (1 - (1 - 8 / 256) ** (batch * (k + 1))) for k in (0, 1)]
            lines.append(
                f"| {overheads.name} | {batch} | {costs[1]:.2f} | {expected_speedups(costs, [0.85])[1]:.2f}x | "
                f"{expected_speedups(costs, [0.90])[1]:.2f}x | {touched[0]:.0f} -> {touched[1]:.0f} | {yes_no(fits_in_memory(DEEPSEEK_V3, H200_SXM, batch, 4096, 8))} |"
            )
    # Megatron-LM's engine with MTP (PR #7033): 5.9 tokens per step with 12 drafts, 1.75x.
    implied = 5.9 / 1.75
    lines += [
        "",
        f"Megatron-LM engine with MTP (PR #7033): 12 drafts, 5.9 tokens/step, 1.75x, i.e. c12/c0 = {implied:.2f}. "
        "Model on MiMo-7B's shape with a repeated MTP layer, H200, TP1, context 4096 (the published model and batch are not in our notes).",
        "| overheads | batch | c12/c0 | at 5.9 tokens/step |",
        "|---|---|---|---|",
    ]
    for overheads in (CUDA_GRAPHS, EAGER_MEGATRON):
        for batch in (1, 8, 64):
            costs = relative_step_costs(MIMO_7B, H200_SXM, batch, 4096, 12, overheads, 1)
            lines.append(f"| {overheads.name} | {batch} | {costs[12]:.2f} | {5.9 / costs[12]:.2f}x |")
    # slime/miles on MiMo-7B-RL, H200, SGLang EAGLE with 3 steps: 1,219 -> 1,464 (frozen) -> 1,667 (online).
    lines += [
        "",
        "slime/miles, MiMo-7B-RL on H200, SGLang with 3 draft steps (k=3): 1,219 tokens/s without speculation, "
        "1,464 frozen heads (1.20x), 1,667 trained online (1.37x). Model: TP1, CUDA graphs, context 16384 (24k-token responses).",
        "| batch | fits | k=0 tokens/s | c3/c0 | k=3 at MiMo's 90/82/75% | tokens/step 1.20x needs | per-depth a | tokens/step 1.37x needs | per-depth a |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    largest = max(batch for batch in range(1, 1024) if fits_in_memory(MIMO_7B, H200_SXM, batch, 16384))
    for batch in sorted({*BATCH_SIZES, largest}):
        costs = relative_step_costs(MIMO_7B, H200_SXM, batch, 16384, 3, CUDA_GRAPHS, 1)
        frozen, online = 1464 / 1219 * costs[3], 1667 / 1219 * costs[3]
        lines.append(
            f"| {batch} | {yes_no(fits_in_memory(MIMO_7B, H200_SXM, batch, 16384))} | {tokens_per_s(MIMO_7B, H200_SXM, batch, 16384, 0, CUDA_GRAPHS, 1, MIMO_ACCEPTANCE):,.0f} | {costs[3]:.2f} | "
            f"{expected_speedups(costs, MIMO_ACCEPTANCE)[3]:.2f}x | {frozen:.2f} | {solve_per_depth_acceptance(frozen, 3):.0%} | "
            f"{online:.2f} | {solve_per_depth_acceptance(online, 3):.0%} |"
        )
    # The 58.6% acceptance an RL framework reported for MiMo-7B's head trained online (+50.4%
    # rollout throughput), read as SGLang's accept rate (accepted / drafted) at 3 drafts.
    tokens = 1.0 + 3 * 0.586
    lines.append("")
    lines.append(f"58.6% of 3 drafts accepted (reported with +50.4% rollout throughput) is {tokens:.2f} tokens/step; the model gives, by batch:")
    lines.append(
        " ".join(
            f"{batch}: {tokens / relative_step_costs(MIMO_7B, H200_SXM, batch, 16384, 3, CUDA_GRAPHS, 1)[3]:.2f}x;" for batch in sorted({*BATCH_SIZES, largest})
        )
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--overheads", choices=("eager", "graphs"), default="eager", help="host overheads of the recipe table")
    args = parser.parse_args()
    overheads = EAGER_MEGATRON if args.overheads == "eager" else CUDA_GRAPHS
    for gpu in GPUS.values():
        print(
            f"{gpu.name}: {gpu.peak_bandwidth_bytes_per_s / 1e12:.2f} TB/s HBM, {gpu.peak_flops_per_s / 1e12:.0f} dense bf16 TFLOP/s, "
            f"used at {gpu.bandwidth_efficiency:.0%} / {gpu.flops_efficiency:.0%}"
        )
    other = CUDA_GRAPHS if overheads is EAGER_MEGATRON else EAGER_MEGATRON
    tables = [*operating_points(), "", *recipe_table(overheads), "", *recipe_table(other), "", *as_shipped_table(overheads), "", *published_rows()]
    print("\n".join(["", *tables]))


if __name__ == "__main__":
    main()
