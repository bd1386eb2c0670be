"""Model setup from policy.megatron_cfg."""

from __future__ import annotations

import pytest

from nemo_rl_mtp.megatron_compat.installed import megatron_core_version
from nemo_rl_mtp.training.model import (
    _apply_mtp_config,
    build_transformer_config,
    padded_vocab_size,
    resolve_transformer_impl,
)
from tests.support.helpers import make_policy, tiny_config
from tests.support.release_gates import on_this_release


def test_apply_mtp_config_copies_the_keys_present():
    kwargs = {}
    _apply_mtp_config(kwargs, {"mtp_num_layers": 3, "mtp_loss_scaling_factor": 0.3})
    assert kwargs == {"mtp_num_layers": 3, "mtp_loss_scaling_factor": 0.3}


# Per megatron-core release (major.minor), what _apply_mtp_config must copy from
# {mtp_num_layers: 1, mtp_detach_heads: false, mtp_use_repeated_layer: false}: written out by hand
# from the releases' own TransformerConfig sources (0.16.1 has neither field, 0.17.1 and 0.18.2
# have mtp_use_repeated_layer, 0.19.2 both), not derived from the installed TransformerConfig.
COPIED_BY_RELEASE = {
    (0, 16): {"mtp_num_layers": 1},
    (0, 17): {"mtp_num_layers": 1, "mtp_use_repeated_layer": False},
    (0, 18): {"mtp_num_layers": 1, "mtp_use_repeated_layer": False},
    (0, 19): {"mtp_num_layers": 1, "mtp_use_repeated_layer": False, "mtp_detach_heads": False},
}
# The first release whose TransformerConfig has the field (same sources).
FIELD_SINCE = {"mtp_use_repeated_layer": (0, 17), "mtp_detach_heads": (0, 19)}


def _release() -> tuple[int, int]:
    major, minor = megatron_core_version().split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _release_has(field: str) -> bool:
    return _release() >= FIELD_SINCE[field]


@pytest.mark.skipif(_release() not in COPIED_BY_RELEASE, reason=on_this_release("a release outside the measured matrix"))
def test_apply_mtp_config_copies_only_fields_the_release_has():
    kwargs = {}
    _apply_mtp_config(kwargs, {"mtp_num_layers": 1, "mtp_detach_heads": False, "mtp_use_repeated_layer": False})
    assert kwargs == COPIED_BY_RELEASE[_release()]


def test_apply_mtp_config_leaves_a_non_mtp_recipe_untouched():
    for megatron_cfg in ({"mtp_num_layers": 0, "mtp_loss_scaling_factor": 0.3, "mtp_use_repeated_layer": True}, {}):
        kwargs = {"num_layers": 2}
        _apply_mtp_config(kwargs, megatron_cfg)
        assert kwargs == {"num_layers": 2}


needs_field = lambda name: pytest.mark.skipif(not _release_has(name), reason=on_this_release(f"its TransformerConfig has no {name}"))  # noqa: E731


def test_transformer_config_carries_mtp_settings():
    megatron_cfg = tiny_config(megatron_cfg__mtp_num_layers=2, megatron_cfg__mtp_loss_scaling_factor=0.3).policy.megatron_cfg
    config = build_transformer_config(megatron_cfg)
    assert (config.mtp_num_layers, config.mtp_loss_scaling_factor) == (2, 0.3)
    assert config.calculate_per_token_loss and config.hidden_dropout == 0.0 and config.attention_dropout == 0.0
    off = build_transformer_config(tiny_config(megatron_cfg__mtp_num_layers=0).policy.megatron_cfg)
    assert not off.mtp_num_layers


@pytest.mark.parametrize("feature", ["mtp_use_repeated_layer", "mtp_detach_heads"])
def test_requested_mtp_feature_reaches_the_config_or_is_rejected(feature):
    if _release_has(feature):
        megatron_cfg = tiny_config(**{f"megatron_cfg__{feature}": True}).policy.megatron_cfg
        assert getattr(build_transformer_config(megatron_cfg), feature) is True
    else:  # refused with the config, before any model is built
        with pytest.raises(ValueError, match=f"{feature}=true is not supported by the installed megatron-core"):
            tiny_config(**{f"megatron_cfg__{feature}": True})


@needs_field("mtp_use_repeated_layer")
@pytest.mark.usefixtures("megatron_world")
def test_repeated_layer_builds_one_shared_mtp_layer():
    repeated, _ = make_policy(megatron_cfg__mtp_num_layers=3, megatron_cfg__mtp_use_repeated_layer=True)
    assert len(repeated.model.module.mtp.layers) == 1
    separate, _ = make_policy(megatron_cfg__mtp_num_layers=3)
    assert len(separate.model.module.mtp.layers) == 3
    # Counted on the built models: three depths sharing one layer hold a third of the MTP weights
    # of three separate (identically shaped) layers.
    assert 3 * _mtp_parameter_count(repeated) == _mtp_parameter_count(separate) > 0


def _mtp_parameter_count(policy) -> int:
    return sum(param.numel() for name, param in policy.model.module.named_parameters() if name.startswith("mtp."))


def test_auto_impl_is_local_without_cuda():
    import torch

    if not torch.cuda.is_available():
        assert resolve_transformer_impl("auto") == "local"
    assert resolve_transformer_impl("local") == "local"


def test_vocab_is_padded_for_tensor_parallelism():
    assert padded_vocab_size(30, 1) == 30
    assert padded_vocab_size(30, 4) == 32
    assert padded_vocab_size(33, 2) == 34


def test_a_worker_that_would_build_multi_latent_attention_with_the_local_spec_refuses_in_one_line():
    """``auto`` on a cluster's GPU workers is resolved by each worker (the driver defers it): a node
    without transformer_engine gets one line, not megatron's error from deep in the build."""
    from megatron.core.transformer import MLATransformerConfig

    from nemo_rl_mtp.training.model import build_model

    config = MLATransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8,
        v_head_dim=8, multi_latent_attention=True,
    )  # fmt: skip
    megatron_cfg = tiny_config().policy.megatron_cfg
    with pytest.raises(ValueError, match=r"^policy.megatron_cfg.transformer_impl=auto: .*multi-latent attention, which megatron-core builds only with transformer_engine, and this worker .* builds the local spec$"):
        build_model(megatron_cfg, config, 64, 32)
