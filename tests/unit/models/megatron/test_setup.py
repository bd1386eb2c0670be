"""Model setup from policy.megatron_cfg."""

from __future__ import annotations

import dataclasses

import pytest
from megatron.core.transformer.transformer_config import TransformerConfig

from nemo_rl_mtp.models.megatron.setup import (
    _apply_mtp_config,
    build_transformer_config,
    padded_vocab_size,
    resolve_transformer_impl,
)
from tests.helpers import make_policy, tiny_config


def test_apply_mtp_config_copies_the_keys_present():
    kwargs = {}
    _apply_mtp_config(kwargs, {"mtp_num_layers": 3, "mtp_loss_scaling_factor": 0.3})
    assert kwargs == {"mtp_num_layers": 3, "mtp_loss_scaling_factor": 0.3}


def test_apply_mtp_config_copies_only_fields_the_release_has():
    fields = {field.name for field in dataclasses.fields(TransformerConfig)}
    kwargs = {}
    _apply_mtp_config(kwargs, {"mtp_num_layers": 1, "mtp_detach_heads": False, "mtp_use_repeated_layer": False})
    expected = {"mtp_num_layers": 1}
    expected.update({key: False for key in ("mtp_detach_heads", "mtp_use_repeated_layer") if key in fields})
    assert kwargs == expected


def test_apply_mtp_config_leaves_a_non_mtp_recipe_untouched():
    for megatron_cfg in ({"mtp_num_layers": 0, "mtp_loss_scaling_factor": 0.3, "mtp_use_repeated_layer": True}, {}):
        kwargs = {"num_layers": 2}
        _apply_mtp_config(kwargs, megatron_cfg)
        assert kwargs == {"num_layers": 2}


RELEASE_FIELDS = {field.name for field in dataclasses.fields(TransformerConfig)}
needs_field = lambda name: pytest.mark.skipif(name not in RELEASE_FIELDS, reason=f"this megatron-core has no {name}")  # noqa: E731


def test_transformer_config_carries_mtp_settings():
    megatron_cfg = tiny_config(megatron_cfg__mtp_num_layers=2, megatron_cfg__mtp_loss_scaling_factor=0.3).policy.megatron_cfg
    config = build_transformer_config(megatron_cfg)
    assert (config.mtp_num_layers, config.mtp_loss_scaling_factor) == (2, 0.3)
    assert config.calculate_per_token_loss and config.hidden_dropout == 0.0 and config.attention_dropout == 0.0
    off = build_transformer_config(tiny_config(megatron_cfg__mtp_num_layers=0).policy.megatron_cfg)
    assert not off.mtp_num_layers


@pytest.mark.parametrize("feature", ["mtp_use_repeated_layer", "mtp_detach_heads"])
def test_requested_mtp_feature_reaches_the_config_or_is_rejected(feature):
    megatron_cfg = tiny_config(**{f"megatron_cfg__{feature}": True}).policy.megatron_cfg
    if feature in RELEASE_FIELDS:
        assert getattr(build_transformer_config(megatron_cfg), feature) is True
    else:
        with pytest.raises(ValueError, match=f"{feature}=true is not supported by the installed megatron-core"):
            build_transformer_config(megatron_cfg)


@needs_field("mtp_use_repeated_layer")
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
