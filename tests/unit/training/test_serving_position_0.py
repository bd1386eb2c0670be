"""``policy.megatron_cfg.mtp_zero_embedding_at_position_0`` resolved per architecture: ``auto`` is
on exactly where a serving engine's MTP drafter zeroes the MTP embedding at position 0 (vLLM 0.32.0
``mimo_mtp.py``, ``deepseek_mtp.py``, ``glm4_moe_mtp.py``; SGLang ``mimo_mtp.py``: read from their
sources, docs/serving.md) and off where none does (vLLM ``qwen3_next_mtp.py``,
``nemotron_h_mtp.py``) or no engine serves the model (a GPT built from scratch)."""

from __future__ import annotations

import pytest

from nemo_rl_mtp.training.hf_checkpoint import mtp_position_0_zeroing


@pytest.mark.parametrize(
    "architecture, model_type, zeroed, engines",
    [
        ("MiMoForCausalLM", "mimo", True, "vLLM (mimo_mtp.py) and SGLang (mimo_mtp.py)"),
        ("DeepseekV3ForCausalLM", "deepseek_v3", True, "vLLM (deepseek_mtp.py)"),
        ("Glm4MoeForCausalLM", "glm4_moe", True, "vLLM (glm4_moe_mtp.py)"),
        (None, "glm4_moe", True, "vLLM (glm4_moe_mtp.py)"),  # architectures missing: model_type decides
        ("Qwen3NextForCausalLM", "qwen3_next", False, "take megatron's input"),
        ("NemotronHForCausalLM", "nemotron_h", False, "take megatron's input"),
        ("Qwen3ForCausalLM", "qwen3", False, "take megatron's input"),
        (None, None, False, "built from scratch"),
    ],
)
def test_auto_follows_the_engines_that_serve_the_architecture(architecture, model_type, zeroed, engines):
    zero, reason = mtp_position_0_zeroing("auto", architecture, model_type)
    assert zero is zeroed
    assert reason.startswith("auto: ") and engines in reason


@pytest.mark.parametrize("setting", [True, False])
@pytest.mark.parametrize("architecture, model_type", [("MiMoForCausalLM", "mimo"), ("Qwen3NextForCausalLM", "qwen3_next"), (None, None)])
def test_true_and_false_hold_whatever_the_model(setting, architecture, model_type):
    assert mtp_position_0_zeroing(setting, architecture, model_type) == (setting, f"set to {str(setting).lower()} in the config")
