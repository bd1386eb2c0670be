"""Model setup from policy.megatron_cfg."""

from __future__ import annotations

import pytest

from nemo_rl_mtp.models.megatron.setup import (
    _apply_mtp_config,
    build_transformer_config,
    padded_vocab_size,
    resolve_transformer_impl,
)
from tests.helpers import make_policy, tiny_config


def test_apply_mtp_config_copies_the_keys_present():
    kwargs = {}
    _apply_mtp_config(kwargs, {"mtp_num_layers": 3, "mtp_loss_scaling_factor": 0.3, "mtp_detach_heads": True})
    assert kwargs == {"mtp_num_layers": 3, "mtp_loss_scaling_factor": 0.3, "mtp_detach_heads": True}


def test_apply_mtp_config_leaves_a_non_mtp_recipe_untouched():
    for megatron_cfg in ({"mtp_num_layers": 0, "mtp_loss_scaling_factor": 0.3, "mtp_use_repeated_layer": True}, {}):
        kwargs = {"num_layers": 2}
        _apply_mtp_config(kwargs, megatron_cfg)
        assert kwargs == {"num_layers": 2}


def test_transformer_config_carries_mtp_settings():
    megatron_cfg = tiny_config(
        megatron_cfg__mtp_num_layers=2, megatron_cfg__mtp_loss_scaling_factor=0.3, megatron_cfg__mtp_use_repeated_layer=True
    ).policy.megatron_cfg
    config = build_transformer_config(megatron_cfg)
    assert (config.mtp_num_layers, config.mtp_loss_scaling_factor, config.mtp_use_repeated_layer) == (2, 0.3, True)
    assert config.calculate_per_token_loss and config.hidden_dropout == 0.0 and config.attention_dropout == 0.0
    off = build_transformer_config(tiny_config(megatron_cfg__mtp_num_layers=0).policy.megatron_cfg)
    assert not off.mtp_num_layers


@pytest.mark.usefixtures("megatron_world")
def test_repeated_layer_builds_one_shared_mtp_layer():
    policy, _ = make_policy(megatron_cfg__mtp_num_layers=3, megatron_cfg__mtp_use_repeated_layer=True)
    assert len(policy.model.module.mtp.layers) == 1
    policy, _ = make_policy(megatron_cfg__mtp_num_layers=3)
    assert len(policy.model.module.mtp.layers) == 3


def test_auto_impl_is_local_without_cuda():
    import torch

    if not torch.cuda.is_available():
        assert resolve_transformer_impl("auto") == "local"
    assert resolve_transformer_impl("local") == "local"


def test_vocab_is_padded_for_tensor_parallelism():
    assert padded_vocab_size(30, 1) == 30
    assert padded_vocab_size(30, 4) == 32
    assert padded_vocab_size(33, 2) == 34
