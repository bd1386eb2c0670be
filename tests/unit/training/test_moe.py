"""Mixture-of-experts trunks with MoE MTP layers on real megatron-core (CPU, local spec, allgather
dispatcher): they train, and the router's load-balancing loss is normalised like the policy and
MTP losses."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch

from nemo_rl_mtp.megatron_compat import capabilities
from nemo_rl_mtp.training import moe
from nemo_rl_mtp.training.batches import Microbatch
from tests.support.helpers import make_batch, make_policy
from tests.support.release_gates import requires_config
from tests.unit.training.test_mtp_training_step import BALANCED_RESPONSES, PG_LOSS, run_step, zero_policy_loss

MOE = {"megatron_cfg__num_moe_experts": 4, "megatron_cfg__moe_router_topk": 2, "megatron_cfg__mtp_num_layers": 1}
# An MoE trunk (megatron-core >= 0.18: earlier releases have no MoE metrics tracker).
pytestmark = [pytest.mark.usefixtures("megatron_world"), requires_config(**MOE, megatron_cfg__moe_aux_loss_coeff=0.0)]
# The load-balancing loss, which releases without the schedule's moe_grad_scale_func refuse.
load_balancing_loss = requires_config(**MOE, megatron_cfg__moe_aux_loss_coeff=0.1)


def _doubled(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch twice over: every per-token mean (policy, MTP, load statistics) is unchanged."""
    return {key: torch.cat([value, value]) for key, value in batch.items()}


def _router_gradients(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: grad for name, grad in grads.items() if "router" in name}


def _steps_per_micro_batch_size(batch: dict[str, torch.Tensor], micro_batch_sizes: tuple[int, ...], load_balancing: str) -> list:
    """(metrics, gradients) of one step on the same weights and batch for each micro-batch size,
    load-balancing loss on at weight 0.1."""
    results = []
    for micro_batch_size in micro_batch_sizes:
        policy, cfg = make_policy(
            **MOE,
            megatron_cfg__moe_router_load_balancing_type=load_balancing,
            megatron_cfg__moe_aux_loss_coeff=0.1,
            train_micro_batch_size=micro_batch_size,
            train_global_batch_size=batch["input_ids"].shape[0],
        )
        results.append(run_step(policy, cfg, batch, PG_LOSS))
    return results


@pytest.mark.parametrize("aux_loss_coeff", [0.0, pytest.param(0.01, marks=load_balancing_loss)])
def test_moe_trunk_and_moe_mtp_layer_train(aux_loss_coeff):
    """Without the load-balancing loss (megatron-core >= 0.18), and with it (>= 0.19)."""
    policy, cfg = make_policy(**MOE, megatron_cfg__moe_aux_loss_coeff=aux_loss_coeff, train_micro_batch_size=4, train_global_batch_size=8)
    names = [name for name, _ in policy.model.module.named_parameters()]
    assert any(name.startswith("decoder.") and ".mlp.experts." in name for name in names)
    assert any(name.startswith("mtp.") and ".mlp.experts." in name for name in names)  # MoE MTP layer
    metrics, grads = run_step(policy, cfg, make_batch(BALANCED_RESPONSES), PG_LOSS)
    assert metrics["mtp/mtp_1_loss"] > 0 and metrics["mtp/grad_norm"] > 0
    assert (metrics.get("moe/load_balancing_loss", 0.0) > 0) == (aux_loss_coeff > 0)
    assert all(grad.abs().sum() > 0 for grad in _router_gradients(grads).values())


@load_balancing_loss
def test_load_balancing_gradient_does_not_grow_with_the_batch(monkeypatch):
    """Policy loss off, MTP loss off: the router gradient is the load-balancing loss's alone. The
    same batch twice over must give the same gradient, as it does for the policy loss. megatron's
    own scaling (no ``moe_grad_scale``) doubles it: the defect the normalisation removes."""
    keys = dict(MOE, megatron_cfg__mtp_loss_scaling_factor=0.0, megatron_cfg__moe_aux_loss_coeff=0.1, train_micro_batch_size=8)
    batch = make_batch(BALANCED_RESPONSES)
    gradients = {}
    for name, rows, scaled in (("once", batch, True), ("twice", _doubled(batch), True), ("twice, unscaled", _doubled(batch), False)):
        if not scaled:
            monkeypatch.setattr(moe, "moe_grad_scale", lambda config, tokens: contextlib.nullcontext())
        policy, cfg = make_policy(**keys, train_global_batch_size=rows["input_ids"].shape[0])
        gradients[name] = _router_gradients(run_step(policy, cfg, rows, zero_policy_loss)[1])
    for name, once in gradients["once"].items():
        assert once.abs().sum() > 0, name
        torch.testing.assert_close(gradients["twice"][name], once, rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(gradients["twice, unscaled"][name] / gradients["twice"][name].abs().sum() * once.abs().sum(), gradients["twice, unscaled"][name])
    ratio = sum(g.abs().sum() for g in gradients["twice, unscaled"].values()) / sum(g.abs().sum() for g in gradients["twice"].values())
    assert ratio > 10, f"megatron's own scaling gave {ratio:.1f}x the normalised gradient"


@load_balancing_loss
@pytest.mark.parametrize("load_balancing", ["aux_loss", "seq_aux_loss"])
def test_one_microbatch_or_two_give_the_same_gradients_with_load_balancing(load_balancing):
    """A global batch of two identical halves, as one microbatch or two: policy, MTP and
    load-balancing gradients and metrics agree (each microbatch sees the same load statistics)."""
    (metrics_one, grads_one), (metrics_two, grads_two) = _steps_per_micro_batch_size(
        _doubled(make_batch(BALANCED_RESPONSES)), (16, 8), load_balancing
    )
    for name in grads_one:
        torch.testing.assert_close(grads_two[name], grads_one[name], rtol=1e-4, atol=1e-7, msg=name)
    for key in metrics_one:
        assert metrics_two[key] == pytest.approx(metrics_one[key], rel=1e-4, abs=1e-6), key


@load_balancing_loss
@pytest.mark.parametrize("padding_mask_given", [True, False])
def test_padding_stays_out_of_the_load_statistics(monkeypatch, padding_mask_given):
    """Rows padded to the longest sequence vs the same sequences packed without row padding: the
    trunk's routers must see the same tokens, so every gradient agrees. (MoE MTP layers are left
    out: megatron rolls the padding mask with them and fills the last position of a row, or of a
    packed sequence, as a real token, so their statistics differ between the two layouts.)
    Control: without the padding mask the routers count the row padding, and the layouts differ."""
    if not padding_mask_given:
        monkeypatch.setattr(Microbatch, "padding_mask", property(lambda self: None, lambda self, value: None))
    batch = make_batch([1, 9, 3, 4, 8, 2, 6, 5])
    results = []
    for packed in (False, True):
        policy, cfg = make_policy(
            **{**MOE, "megatron_cfg__mtp_num_layers": 0},
            megatron_cfg__moe_aux_loss_coeff=0.1,
            train_micro_batch_size=4,
            train_global_batch_size=8,
            sequence_packing__enabled=packed,
        )
        results.append(run_step(policy, cfg, batch, PG_LOSS))
    (_, unpacked), (_, packed) = results
    agree = all(torch.allclose(packed[name], unpacked[name], rtol=1e-3, atol=1e-6) for name in unpacked)
    assert agree == padding_mask_given


@load_balancing_loss
@pytest.mark.parametrize("load_balancing", ["global_batch_aux_loss", "aux_loss"])
def test_global_batch_load_balancing_does_not_depend_on_the_microbatch_split(load_balancing):
    """A ragged batch (different token mixes per microbatch) as one microbatch or four: with the
    load measured over the global batch every gradient and metric agrees; with megatron's
    per-microbatch ``aux_loss`` the router gradients differ (the control)."""
    batch = make_batch([1, 9, 3, 4, 8, 2, 6, 5], sample_mask=[1, 1, 1, 0, 1, 1, 1, 1])
    (metrics_one, grads_one), (metrics_four, grads_four) = _steps_per_micro_batch_size(batch, (8, 2), load_balancing)
    routers_agree = all(torch.allclose(grads_four[name], grad, rtol=1e-4, atol=1e-7) for name, grad in _router_gradients(grads_one).items())
    assert routers_agree == (load_balancing == "global_batch_aux_loss")
    if load_balancing == "global_batch_aux_loss":
        for name in grads_one:
            torch.testing.assert_close(grads_four[name], grads_one[name], rtol=1e-4, atol=1e-7, msg=name)
        assert metrics_four["moe/load_balancing_loss"] == pytest.approx(metrics_one["moe/load_balancing_loss"], rel=1e-5)


@load_balancing_loss
def test_global_batch_load_balancing_loss_is_the_switch_loss_of_the_whole_batch():
    """The logged loss against the Switch formula written out over the global batch, per MoE
    layer: E / (k T^2) * sum_e F_e * sum_x softmax(router logits of x)_e, with F_e the tokens
    routed to expert e and T the tokens (padding excluded), averaged over layers."""
    batch = make_batch([1, 9, 3, 4, 8, 2, 6, 5])
    policy, cfg = make_policy(
        **{**MOE, "megatron_cfg__mtp_num_layers": 0}, megatron_cfg__moe_aux_loss_coeff=0.1, train_micro_batch_size=2, train_global_batch_size=8
    )
    routers = moe.routers_of(policy.model.module)
    seen = {router: [] for router in routers}
    handles = [router.register_forward_hook(lambda module, args, output: seen[module].append((args[0], args[1], output[1]))) for router in routers]
    try:
        metrics, _ = run_step(policy, cfg, batch, PG_LOSS)
    finally:
        for handle in handles:
            handle.remove()
    experts, topk = 4, 2
    per_layer = []
    for router in routers:
        training_pass = seen[router][len(seen[router]) // 2 :]  # the routing pass came first
        hidden = torch.cat([h.reshape(-1, h.shape[-1]) for h, _, _ in training_pass])
        valid = ~torch.cat([p.reshape(-1) for _, p, _ in training_pass])
        routed = torch.cat([r for _, _, r in training_pass])[valid].float().sum(dim=0)
        with torch.no_grad():
            probabilities = torch.softmax(hidden[valid] @ router.weight.t(), dim=-1)
        tokens = valid.sum()
        per_layer.append(experts / (topk * tokens**2) * (routed * probabilities.sum(dim=0)).sum())
    assert metrics["moe/load_balancing_loss"] == pytest.approx(float(torch.stack(per_layer).mean()), rel=1e-4)


def _global_statistics_cfg():
    from tests.support.helpers import tiny_config

    return tiny_config(
        **MOE, megatron_cfg__moe_router_load_balancing_type=moe.GLOBAL_BATCH_AUX_LOSS, megatron_cfg__moe_aux_loss_coeff=0.0
    ).policy.megatron_cfg


def test_the_router_names_the_global_load_statistics_reach_are_in_the_installed_release():
    assert capabilities.router_names_changed() == []
    capabilities.check_moe_supported(_global_statistics_cfg())


def test_a_release_without_the_moe_metrics_tracker_is_refused_in_one_line(monkeypatch):
    """megatron-core 0.16 and 0.17 (no ``moe_logging``), simulated on the installed release."""
    megatron_cfg = _global_statistics_cfg()
    monkeypatch.setitem(sys.modules, capabilities.MOE_METRICS_MODULE, None)
    with pytest.raises(ValueError, match=r"^policy.megatron_cfg.num_moe_experts=4: megatron-core \S+ has no MoE metrics tracker .*>= 0.18$") as error:
        capabilities.check_moe_supported(megatron_cfg)
    assert "\n" not in str(error.value)


def _forward_with_padding_mask_renamed(self, input, pad_mask=None):
    raise AssertionError("never called: the configuration check runs before any forward")


@pytest.mark.parametrize("renamed", ["_apply_global_aux_loss", "padding_mask"])
def test_a_renamed_router_name_is_refused_naming_it(monkeypatch, renamed):
    """Upstream renaming the aux-loss hook would leave megatron's per-microbatch statistic in place;
    renaming the padding mask would count padding: both silently. The real TopKRouter, renamed."""
    from megatron.core.transformer.moe.router import TopKRouter

    if renamed == "padding_mask":
        monkeypatch.setattr(TopKRouter, "forward", _forward_with_padding_mask_renamed)
    else:
        monkeypatch.delattr(TopKRouter, renamed)
    with pytest.raises(ValueError, match=rf"global_batch_aux_loss: megatron-core .*TopKRouter\.(forward \(no parameter {renamed}|{renamed} \(gone)"):
        capabilities.check_moe_supported(_global_statistics_cfg())


def test_the_routed_token_counts_find_the_padding_mask_by_name():
    """The same router call with the padding mask by position and by keyword counts the same tokens,
    and fewer than without it (the control)."""
    policy, _ = make_policy(**MOE, megatron_cfg__moe_aux_loss_coeff=0.0)
    router = moe.routers_of(policy.model.module)[0]
    hidden = torch.randn(6, 2, router.config.hidden_size)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[:, 4:] = True
    counted = {}
    for name, call in (
        ("positional", lambda: router(hidden, padding)),
        ("keyword", lambda: router(hidden, padding_mask=padding)),
        ("none", lambda: router(hidden)),
    ):
        with torch.no_grad(), moe.counting_routed_tokens([router]) as counts:
            call()
        counted[name] = counts[router]
    assert torch.equal(counted["positional"], counted["keyword"])
    assert counted["keyword"].sum() == 2 * 4 * router.topk and counted["none"].sum() == 2 * 6 * router.topk


@load_balancing_loss
@pytest.mark.parametrize("chosen, megatron_name", [("global_batch_aux_loss", "global_aux_loss"), ("aux_loss", "aux_loss"), ("seq_aux_loss", "seq_aux_loss")])
def test_transformer_config_names_the_chosen_load_balancing(chosen, megatron_name):
    """The TransformerConfig (what a saved model's config says) names the load balancing the user
    chose: megatron's own name for it, global-batch level for ``global_batch_aux_loss``, not the
    per-microbatch ``aux_loss``."""
    from nemo_rl_mtp.training.model import build_transformer_config
    from tests.support.helpers import tiny_config

    megatron_cfg = tiny_config(**MOE, megatron_cfg__moe_router_load_balancing_type=chosen).policy.megatron_cfg
    assert build_transformer_config(megatron_cfg).moe_router_load_balancing_type == megatron_name
