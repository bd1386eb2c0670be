"""Engine rollouts with speculation over a HybridModel (model_class=hybrid) equal those over the
GPTModel whose weights it holds: the policy with trained heads (drafts often accepted), copied
into the hybrid pattern of the same architecture (``test_hybrid_model``'s renaming)."""

from __future__ import annotations

import pytest
import torch

from nemo_rl_mtp.rollout.engine import RolloutEngine
from tests.support.helpers import make_policy, tiny_config
from tests.support.engine_cases import SIZES, engine_overrides, generate
from tests.unit.training.test_hybrid_model import HYBRID, copy_gpt_weights, hybrid_model, hybrid_pattern

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




def test_a_hybrid_models_engine_and_mtp_caches_fill_the_memory_budget():
    """Incremental drafts carve the MTP depths' caches out of ``engine.buffer_size_gb``, sized for
    the layers megatron's context caches: a hybrid of attention and MLP layers gets a block for
    every layer (megatron treats it as a transformer), so the decoder's blocks and the MTP caches
    together take the whole budget, up to a block's rounding (as ``test_incremental_drafts``
    checks for the GPTModel)."""
    from nemo_rl_mtp.rollout.engine import kv_memory

    policy, policy_cfg = make_policy(**engine_overrides(2), **HYBRID, megatron_cfg__hybrid_layer_pattern=hybrid_pattern(2, moe=False))
    engine = RolloutEngine(policy, policy_cfg).engine
    memory = kv_memory(engine)
    budget = policy_cfg.generation.engine.buffer_size_gb * 1024**3
    trunk_block = engine.context.block_size_bytes
    mtp_block = memory["mtp"] / (engine.context.kv_block_allocator.total_count + 1)  # its scratch block
    assert memory["mtp"] > 0
    assert abs(memory["trunk"] + memory["mtp"] - budget) <= 2 * (trunk_block + mtp_block), (memory, budget)
