"""model_class=hybrid: megatron-core's HybridModel built with the local spec on this CPU computes
what the GPTModel of the same architecture computes. A pattern of one attention and one MLP (or
MoE) layer per GPT layer, for the decoder and the MTP layer, holds the GPT's weights under other
names; the test copies them over by a renaming written out here (independent of ``hybrid.py``) and
compares logits and the MTP training step (losses, metrics, every gradient, MoE router metrics);
a hybrid checkpoint round-trips. Engine rollouts: ``generation/test_hybrid_rollouts.py``."""

from __future__ import annotations

import re

import pytest
import torch

from nemo_rl_mtp.megatron_compat import mtp_position_zero
from nemo_rl_mtp.training.checkpoint import load_model_weights, save_policy
from nemo_rl_mtp.training.step import forward_backward_global_batch, mtp_tracker_emptied
from tests.support.helpers import eval_forward_logits, gradients, make_batch, make_policy
from tests.support.release_gates import requires_config
from tests.unit.training.test_mtp_training_step import PG_LOSS, RAGGED_RESPONSES

pytestmark = pytest.mark.usefixtures("megatron_world")


@pytest.fixture(autouse=True)
def drained_mtp_tracker():
    """megatron's class-level MTP tracker is sized by the first model that records into it: what an
    eval forward records (before these tests or in them) is emptied, so each model starts empty."""
    with mtp_tracker_emptied():
        pass
    with mtp_tracker_emptied():
        yield

STEP = {"train_micro_batch_size": 2, "train_global_batch_size": 8}
HYBRID = {"megatron_cfg__model_class": "hybrid", "megatron_cfg__num_layers": 4}
MOE_EXPERTS = {"megatron_cfg__num_moe_experts": 4, "megatron_cfg__moe_router_topk": 2, "megatron_cfg__moe_ffn_hidden_size": 32}
# A GPT layer's parts: the attention half (a hybrid * layer) and the MLP half (a - or E layer).
ATTENTION_PARTS = ("input_layernorm", "self_attention")
MLP_PARTS = ("pre_mlp_layernorm", "mlp")


def hybrid_name(gpt_name: str) -> str:
    """Where a GPT parameter lives in the hybrid pattern "*-*-/*-" (or "*E*E/*E")."""
    if gpt_name == "decoder.final_layernorm.weight":
        return "decoder.final_norm.weight"
    match = re.fullmatch(r"decoder\.layers\.(\d+)\.(\w+)\.(.+)", gpt_name)
    if match:
        index, part, rest = int(match[1]), match[2], match[3]
        return f"decoder.layers.{2 * index + (part in MLP_PARTS)}.{part}.{rest}"
    match = re.fullmatch(r"(mtp\.layers\.\d+\.mtp_model_layer)\.(\w+)\.(.+)", gpt_name)
    if match:
        assert match[2] in ATTENTION_PARTS + MLP_PARTS, gpt_name
        return f"{match[1]}.layers.{int(match[2] in MLP_PARTS)}.{match[2]}.{match[3]}"
    return gpt_name


def copy_gpt_weights(gpt, hybrid) -> None:
    """Every GPT parameter into its hybrid place; the two hold exactly the same parameters."""
    gpt_params = dict(gpt.model.module.named_parameters())
    hybrid_params = dict(hybrid.model.module.named_parameters())
    renamed = {hybrid_name(name): name for name in gpt_params}
    assert sorted(renamed) == sorted(hybrid_params)
    with torch.no_grad():
        for name, param in hybrid_params.items():
            param.copy_(gpt_params[renamed[name]])


def hybrid_pattern(mtp_num_layers: int, moe: bool) -> str:
    """The GPT of this config's tests (two layers) as hybrid layers, each MTP layer likewise."""
    gpt_layer = "*E" if moe else "*-"
    return f'"{gpt_layer * 2}{("/" + gpt_layer) * mtp_num_layers}"'


# HybridModel with MTP in RL mode, which releases before 0.19 refuse in one line.
hybrid_model = requires_config(**HYBRID, megatron_cfg__hybrid_layer_pattern=hybrid_pattern(1, moe=False))


def twin_policies(**overrides):
    """A GPTModel policy and a HybridModel policy of the same architecture and weights."""
    gpt, gpt_cfg = make_policy(**STEP, **overrides)
    pattern = hybrid_pattern(gpt_cfg.megatron_cfg.mtp_num_layers, "megatron_cfg__num_moe_experts" in overrides)
    hybrid, hybrid_cfg = make_policy(**STEP, **overrides, **HYBRID, megatron_cfg__hybrid_layer_pattern=pattern)
    assert type(gpt.model.module).__name__ == "GPTModel" and type(hybrid.model.module).__name__ == "HybridModel"
    copy_gpt_weights(gpt, hybrid)
    return (gpt, gpt_cfg), (hybrid, hybrid_cfg)


def max_abs_diff(first: torch.Tensor, second: torch.Tensor) -> float:
    return (first - second).abs().max().item()


@hybrid_model
@pytest.mark.parametrize("experts", [{}, MOE_EXPERTS], ids=["dense", "moe"])
def test_same_weights_give_the_same_logits_in_gpt_and_hybrid_models(experts):
    (gpt, _), (hybrid, _) = twin_policies(megatron_cfg__mtp_num_layers=1, **experts)
    batch = make_batch(RAGGED_RESPONSES)
    tokens, mask = batch["input_ids"], batch["token_mask"]
    gpt_logits, gpt_depths = eval_forward_logits(gpt, tokens, mask)
    hybrid_logits, hybrid_depths = eval_forward_logits(hybrid, tokens, mask)
    assert len(gpt_depths) == len(hybrid_depths) == 1
    print(f"max abs diff: logits {max_abs_diff(gpt_logits, hybrid_logits):.2e}, MTP logits {max_abs_diff(gpt_depths[0], hybrid_depths[0]):.2e}")
    torch.testing.assert_close(hybrid_logits, gpt_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(hybrid_depths[0], gpt_depths[0], rtol=0, atol=1e-5)
    # Control: the same comparison sees one weight moved.
    with torch.no_grad():
        hybrid.model.module.mtp.layers[0].eh_proj.weight.add_(1e-2)
    assert max_abs_diff(eval_forward_logits(hybrid, tokens, mask)[1][0], gpt_depths[0]) > 1e-4


def run_step(policy, policy_cfg, batch):
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    # megatron's process-wide MoE tracker sizes its entries for the first model that records (one
    # model per worker); here two models of different layer counts share the process.
    get_moe_metrics_tracker().metrics.clear()
    return forward_backward_global_batch(policy, batch, PG_LOSS, policy_cfg), gradients(policy)


@hybrid_model
@pytest.mark.parametrize(
    "overrides",
    [
        {"megatron_cfg__mtp_loss_type": "cross_entropy"},
        {"megatron_cfg__mtp_loss_type": "total_variation", "megatron_cfg__mtp_num_layers": 2},
        {"megatron_cfg__mtp_loss_type": "cross_entropy", **MOE_EXPERTS},
        {"megatron_cfg__mtp_num_layers": 2, "megatron_cfg__mtp_use_repeated_layer": True},
        {"megatron_cfg__mtp_num_layers": 2, "megatron_cfg__mtp_use_repeated_layer": True, **MOE_EXPERTS},
        {"megatron_cfg__mtp_num_layers": 2, "megatron_cfg__mtp_zero_embedding_at_position_0": True, **MOE_EXPERTS},
    ],
    ids=["cross_entropy", "total_variation_two_depths", "moe", "repeated_layer", "repeated_moe_layer", "position_0_zeroed_moe"],
)
def test_an_mtp_training_step_gives_the_same_losses_metrics_and_gradients(overrides):
    """MTP loss, acceptance, forecast, policy loss, router metrics and every gradient (right-padded
    rows: the MoE routers of the MTP layer must exclude the padding in both classes)."""
    (gpt, gpt_cfg), (hybrid, hybrid_cfg) = twin_policies(**{"megatron_cfg__mtp_num_layers": 1, **overrides})
    zeroed = "megatron_cfg__mtp_zero_embedding_at_position_0" in overrides
    assert mtp_position_zero.zeroes_position_0(gpt.model.module) is mtp_position_zero.zeroes_position_0(hybrid.model.module) is zeroed
    batch = make_batch(RAGGED_RESPONSES)
    gpt_metrics, gpt_grads = run_step(gpt, gpt_cfg, batch)
    hybrid_metrics, hybrid_grads = run_step(hybrid, hybrid_cfg, batch)
    assert gpt_metrics.keys() == hybrid_metrics.keys()
    assert any(key.endswith("expected_acceptance") for key in gpt_metrics)
    assert ("moe/load_balancing_loss" in gpt_metrics) == ("megatron_cfg__num_moe_experts" in overrides)
    grad_diff = max(max_abs_diff(gpt_grads[name], hybrid_grads[hybrid_name(name)]) for name in gpt_grads)
    metric_diff = {key: abs(gpt_metrics[key] - hybrid_metrics[key]) for key in gpt_metrics if not key.startswith("timing")}
    print(f"max abs diff: gradients {grad_diff:.2e}, metrics {max(metric_diff.values()):.2e} ({max(metric_diff, key=metric_diff.get)})")
    for key in metric_diff:
        assert hybrid_metrics[key] == pytest.approx(gpt_metrics[key], rel=1e-5, abs=1e-6), key
    for name in gpt_grads:
        torch.testing.assert_close(hybrid_grads[hybrid_name(name)], gpt_grads[name], rtol=1e-4, atol=1e-7, msg=name)
    assert all(gpt_grads[name].abs().sum() > 0 for name in gpt_grads if name.startswith("mtp."))


@hybrid_model
def test_a_hybrid_checkpoint_round_trips_and_differs_from_a_fresh_model(tmp_path):
    saved, _ = make_policy(**STEP, **HYBRID, megatron_cfg__hybrid_layer_pattern=hybrid_pattern(1, moe=False))
    save_policy(saved, tmp_path / "step_000001")
    other, _ = make_policy(**STEP, **HYBRID, megatron_cfg__hybrid_layer_pattern=hybrid_pattern(1, moe=False), megatron_cfg__seed=7)
    pairs = list(zip(saved.model.module.parameters(), other.model.module.parameters()))
    assert not all(torch.equal(a, b) for a, b in pairs)
    load_model_weights(other.model.module, tmp_path / "step_000001" / "policy")
    assert all(torch.equal(a, b) for a, b in pairs)


def test_a_worker_building_the_local_spec_refuses_mamba_and_gated_delta_net_in_one_line():
    """The driver refuses them on CPU workers; a GPU worker without transformer_engine (auto
    resolves to the local spec) still gets one line naming the key, not an ImportError."""
    from nemo_rl_mtp.training import hybrid
    from nemo_rl_mtp.training.model import build_layer_spec

    policy, _ = make_policy()
    spec = build_layer_spec("local", policy.config)
    with pytest.raises(ValueError, match=r"^policy.megatron_cfg.hybrid_layer_pattern='M\*G-/\*-': Mamba .* and GatedDeltaNet .* layers need CUDA kernels"):
        hybrid.hybrid_stack_spec("local", policy.config, spec, "M*G-/*-")
