"""Engine rollouts with speculation over a HybridModel (model_class=hybrid) equal those over the
GPTModel whose weights it holds: the policy with trained heads (drafts often accepted), copied
into the hybrid pattern of the same architecture (``test_hybrid_model``'s renaming)."""

from __future__ import annotations

import pytest
import torch

from nemo_rl_mtp.models.generation.engine_rollouts import RolloutEngine
from tests.helpers import make_policy, tiny_config
from tests.unit.models.generation.engine_cases import SIZES, engine_overrides, generate
from tests.unit.models.megatron.test_hybrid_model import HYBRID, copy_gpt_weights, hybrid_model, hybrid_pattern

pytestmark = [pytest.mark.usefixtures("megatron_world"), hybrid_model]


@pytest.mark.parametrize("sampling", [{"generation__top_k": 1}, {"generation__temperature": 1.0}], ids=["greedy", "sampled"])
def test_rollouts_with_speculation_are_the_same_over_gpt_and_hybrid_models(trained_policy, sampling):
    """Same tokens, logprobs and draft counts per position (proposed, accepted): greedy, and
    sampled with one seed (rejection sampling draws from the same generator in both)."""
    overrides = engine_overrides(2, **SIZES, **sampling)
    gpt_cfg = tiny_config(**overrides).policy
    hybrid, hybrid_cfg = make_policy(**overrides, **HYBRID, megatron_cfg__hybrid_layer_pattern=hybrid_pattern(2, moe=False))
    copy_gpt_weights(trained_policy, hybrid)
    gpt_rollouts = generate(RolloutEngine(trained_policy, gpt_cfg), seed=3)
    hybrid_rollouts = generate(RolloutEngine(hybrid, hybrid_cfg), seed=3)
    assert gpt_rollouts["draft_accepted"][0] > 0 and gpt_rollouts["draft_accepted"][1] > 0
    print(
        f"drafts accepted {gpt_rollouts['draft_accepted'].tolist()} of {gpt_rollouts['draft_proposed'].tolist()}; max abs diff of "
        f"rollout logprobs {(gpt_rollouts['logprobs'] - hybrid_rollouts['logprobs']).abs().max().item():.2e}"
    )
    assert gpt_rollouts.keys() == hybrid_rollouts.keys()
    for key, value in gpt_rollouts.items():
        torch.testing.assert_close(hybrid_rollouts[key], value, rtol=0, atol=1e-6, msg=key)



