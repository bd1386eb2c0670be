"""The compat shims behind model_class=hybrid, against the installed megatron-core: each is needed
here for a reason the test shows, idempotent, off where upstream behaves, loud when its target is
gone; and the release check. Their effect on the numbers: ``test_hybrid_model``."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.support.release_gates import import_or_skip

hybrid_block = import_or_skip("megatron.core.models.hybrid.hybrid_block", "HybridModel")

from megatron.core.transformer import transformer_block  # noqa: E402
from megatron.core.transformer.moe.router import Router, TopKRouter  # noqa: E402

from nemo_rl_mtp.megatron_compat import capabilities  # noqa: E402
from nemo_rl_mtp.training import model as setup  # noqa: E402
from nemo_rl_mtp.megatron_compat import hybrid_final_norm  # noqa: E402
from nemo_rl_mtp.megatron_compat import hybrid_mtp_padding  # noqa: E402
from nemo_rl_mtp.megatron_compat import hybrid_mtp_router  # noqa: E402
from nemo_rl_mtp.megatron_compat._marks import is_shim  # noqa: E402
from nemo_rl_mtp.training.batches import causal_attention_mask  # noqa: E402
from tests.support.helpers import make_batch, make_policy  # noqa: E402
from tests.unit.training.test_hybrid_model import HYBRID, MOE_EXPERTS, STEP, drained_mtp_tracker, hybrid_model, hybrid_pattern  # noqa: F401, E402 (autouse)

pytestmark = pytest.mark.usefixtures("megatron_world")


def hybrid_policy(mtp_num_layers: int = 1, moe: bool = False, **overrides):
    experts = MOE_EXPERTS if moe else {}
    pattern = hybrid_pattern(mtp_num_layers, moe)
    return make_policy(**STEP, **HYBRID, **experts, megatron_cfg__mtp_num_layers=mtp_num_layers, megatron_cfg__hybrid_layer_pattern=pattern, **overrides)


@hybrid_model
def test_final_norm_stand_in_is_there_for_the_build_only_and_nests(caplog):
    """No transformer_engine here: HybridStack's TENorm cannot build, so the stand-in is TransformerBlock's
    final norm class for the duration, put back after, not re-wrapped by a nested build."""
    gpt = make_policy()[0].model.module
    config = gpt.config
    needed, reason = hybrid_final_norm.probe(config)
    assert needed is not setup._transformer_engine_importable(), reason
    if not needed:  # transformer_engine present: TENorm builds, nothing to stand in for
        return
    assert "TENorm" in reason
    original = hybrid_block.TENorm
    with caplog.at_level("INFO"), hybrid_final_norm.local_final_norm(config):
        installed = hybrid_block.TENorm
        assert is_shim(installed) and installed.original is original
        with hybrid_final_norm.local_final_norm(config):
            assert hybrid_block.TENorm is installed
        norm = hybrid_block.TENorm(config, config.hidden_size)
    assert hybrid_block.TENorm is original
    assert type(norm) is type(gpt.decoder.final_layernorm) and "hybrid_final_norm applied" in caplog.text
    policy, _ = hybrid_policy()
    assert type(policy.model.module.decoder.final_norm) is type(gpt.decoder.final_layernorm)


def test_final_norm_stand_in_stays_off_where_upstream_builds_and_is_loud_when_its_target_is_gone(monkeypatch):
    config = make_policy()[0].config

    def builds(config, hidden_size, eps=1e-5, **kwargs):  # a release whose final norm builds here
        return transformer_block.LayerNormImpl(config=config, hidden_size=hidden_size, eps=eps)

    monkeypatch.setattr(hybrid_block, "TENorm", builds)
    assert hybrid_final_norm.probe(config)[0] is False
    with hybrid_final_norm.local_final_norm(config):
        assert hybrid_block.TENorm is builds
    monkeypatch.delattr(hybrid_block, "TENorm")  # renamed upstream, and still hard-coded
    with pytest.raises(RuntimeError, match="hybrid_block.TENorm, which nemo_rl_mtp's hybrid_final_norm patch replaces, is gone"):
        hybrid_final_norm.probe(config)


@hybrid_model
def test_mtp_block_gets_the_forwards_padding_mask_once_hooked(caplog):
    """An MoE layer in the MTP pattern: HybridModel.forward leaves the padding mask out of its MTP
    call; the hook hands it over (hooking again adds nothing). A dense MTP pattern needs none."""
    assert not hybrid_mtp_padding.needed(hybrid_policy()[0].model.module, "*-")
    policy, cfg = hybrid_policy(moe=True)
    model = policy.model.module
    assert hybrid_mtp_padding.needed(model, "*E")
    assert hybrid_mtp_padding.pass_padding_mask_to_mtp(model) is False  # built hooked: idempotent
    seen = []
    handle = model.mtp.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs.get("padding_mask")), with_kwargs=True)
    batch = make_batch([3, 5])
    padding_mask = batch["input_ids"] == 0
    try:
        length = batch["input_ids"].shape[1]
        model(
            input_ids=batch["input_ids"],
            position_ids=torch.arange(length).expand_as(batch["input_ids"]),
            attention_mask=causal_attention_mask(length),
            labels=None,
            loss_mask=batch["token_mask"],
            padding_mask=padding_mask,
        )
    finally:
        handle.remove()
    assert len(seen) == 1 and seen[0] is padding_mask


@hybrid_model
def test_padding_hook_is_loud_where_the_mtp_block_takes_no_padding_mask(monkeypatch):
    policy, _ = hybrid_policy(moe=True)
    model = policy.model.module
    delattr(model, hybrid_mtp_padding._HOOKED)

    def forward(input_ids, position_ids, hidden_states, attention_mask):
        return hidden_states

    monkeypatch.setattr(model.mtp, "forward", forward)
    with pytest.raises(RuntimeError, match="MultiTokenPredictionBlock.forward takes no padding_mask"):
        hybrid_mtp_padding.pass_padding_mask_to_mtp(model)


@hybrid_model
def test_mtp_routers_are_marked_as_gpts_are_once_and_loud_without_their_attributes(monkeypatch):
    """A repeated MTP layer with experts: HybridStack builds its router as a decoder router; after
    the build it is an MTP router numbered as its MTP layer (GPTModel's: 1), once."""
    policy, _ = hybrid_policy(mtp_num_layers=2, moe=True, megatron_cfg__mtp_use_repeated_layer=True)
    model = policy.model.module
    routers = [module for module in model.mtp.modules() if isinstance(module, TopKRouter)]
    gpt_routers = [m for m in make_policy(**STEP, **MOE_EXPERTS, megatron_cfg__mtp_num_layers=2, megatron_cfg__mtp_use_repeated_layer=True)[0].model.module.mtp.modules() if isinstance(m, TopKRouter)]
    assert routers and [(r.is_mtp_layer, r.layer_number) for r in routers] == [(r.is_mtp_layer, r.layer_number) for r in gpt_routers]
    assert hybrid_mtp_router.mark_mtp_routers(model) == 0
    routers[0].is_mtp_layer = False  # as HybridStack builds it
    assert hybrid_mtp_router.mark_mtp_routers(model) == 1 and routers[0].is_mtp_layer
    monkeypatch.delattr(Router, "set_layer_number")
    with pytest.raises(RuntimeError, match="TopKRouter has no is_mtp_layer / set_layer_number"):
        hybrid_mtp_router.unmarked_mtp_routers(model)


@hybrid_model
def test_a_release_without_hybrid_model_is_refused_in_one_line(monkeypatch):
    capabilities.check_hybrid_supported()  # the installed release has it
    monkeypatch.setitem(sys.modules, "megatron.core.models.hybrid.hybrid_model", None)
    with pytest.raises(ValueError, match=r"^policy.megatron_cfg.model_class=hybrid: the installed megatron-core .* lacks a HybridModel") as error:
        capabilities.check_hybrid_supported()
    assert "\n" not in str(error.value)


def test_a_release_whose_mtp_loss_cannot_take_input_ids_is_refused_in_one_line(monkeypatch):
    """0.18.2's process_mtp_loss (its signature): HybridModel would skip the MTP loss in RL mode."""
    from megatron.core.transformer import multi_token_prediction

    def process_mtp_loss(hidden_states, labels, loss_mask, output_layer, output_weight, runtime_gather_output, is_training,
                         compute_language_model_loss, config, cp_group=None, packed_seq_params=None, scale_logits_fn=None):  # fmt: skip
        return hidden_states

    monkeypatch.setattr(multi_token_prediction, "process_mtp_loss", process_mtp_loss)
    with pytest.raises(ValueError, match=r"^policy.megatron_cfg.model_class=hybrid: .* lacks a process_mtp_loss that takes input_ids .*>= 0.19$"):
        capabilities.check_hybrid_supported()
