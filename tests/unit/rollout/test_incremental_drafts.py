"""Drafts from the MTP depths' KV caches against the sequence path (megatron's MTP layers rerun over
each request's whole sequence, with megatron's own attention): the same logits at every draft of
every step, on the real engine (CPU), through rejections, requests admitted while others decode,
and batches of every composition; and the caches' memory inside the engine's budget."""

from __future__ import annotations

import collections

import pytest

from tests.support.engine_cases import skip_module_without_speculation

skip_module_without_speculation()

from nemo_rl_mtp.megatron_compat import engine_release  # noqa: E402
from nemo_rl_mtp.rollout import incremental_drafts  # noqa: E402
from nemo_rl_mtp.rollout.engine import RolloutEngine, kv_memory  # noqa: E402
from nemo_rl_mtp.rollout.sequence_drafts import SequenceDrafts  # noqa: E402
from tests.support.helpers import make_policy, tiny_config  # noqa: E402
from tests.support.engine_cases import PROMPTS, SIZES, engine_overrides, generate  # noqa: E402

pytestmark = pytest.mark.usefixtures("megatron_world")

# Three requests at a time, so requests are admitted (prefilled) while others decode.
MIXED_STEPS = {"generation__engine__max_requests": 3}


@pytest.fixture
def draft_gaps(monkeypatch):
    """Runs the sequence path next to every incremental draft round, on the same step and the same
    draft tokens; records per draft (depth, largest logit difference, rows)."""
    drafts = incremental_drafts.IncrementalDrafts
    reset, start_round, end_round, draft_step = drafts.reset, drafts.start_round, drafts.end_round, drafts.draft_step
    gaps = []

    def reset_both(self, num_request_ids):
        reset(self, num_request_ids)
        self.reference = SequenceDrafts(self.model)

    def start_both(self, context, last_accepted, hidden):
        self.reference.start_round(context, last_accepted, hidden)
        start_round(self, context, last_accepted, hidden)

    def end_both(self):
        self.reference.end_round()
        end_round(self)

    def draft_both(self, next_token_ids, depth):
        hidden, logits = draft_step(self, next_token_ids, depth)
        _, expected = self.reference.draft_step(next_token_ids, depth)
        gaps.append((depth, float((logits - expected).abs().max()), logits.shape[0]))
        return hidden, logits

    monkeypatch.setattr(drafts, "reset", reset_both)
    monkeypatch.setattr(drafts, "start_round", start_both)
    monkeypatch.setattr(drafts, "end_round", end_both)
    monkeypatch.setattr(drafts, "draft_step", draft_both)
    return gaps


@pytest.fixture
def last_depth_passes(monkeypatch):
    """Records how the last depth's keys-only positions ran in each round that had some: in a
    keys-only pass, or riding along in the pass over the last positions."""
    drafts, passes = incremental_drafts.IncrementalDrafts, []
    run_layer = drafts._run_layer

    def recording(self, depth, hidden, tokens, positions, layout, keys_only=False):
        round_kind = "decode" if self._round["decode_only"] else "prefill"
        if keys_only:
            passes.append(f"{round_kind}, keys-only pass")
        elif layout["attending_rows"] < layout["slots"].shape[0]:
            passes.append(f"{round_kind}, keys in the last pass")
        return run_layer(self, depth, hidden, tokens, positions, layout, keys_only)

    monkeypatch.setattr(drafts, "_run_layer", recording)
    return passes


def _check(gaps, rollouts, k):
    proposed, accepted = rollouts["draft_proposed"], rollouts["draft_accepted"]
    print(f"rounds {len(gaps) // k}, proposed {proposed.tolist()}, accepted {accepted.tolist()}")
    assert {depth for depth, _, _ in gaps} == set(range(k))
    assert sum(rows for _, _, rows in gaps) > 50
    assert 0 < int(accepted[0]) < int(proposed[0]), "needs both accepted and rejected drafts"
    worst = max(gap for _, gap, _ in gaps)
    assert worst <= 1e-5, worst


@pytest.mark.parametrize(
    "mtp_num_layers, k, repeated",
    [
        (1, 1, False),
        (2, 2, False),
        pytest.param(
            2, 3, True,
            marks=pytest.mark.skipif(
                engine_release.repeated_layer_depths_missing() is not None,
                reason=f"{engine_release.megatron_release()}: {engine_release.repeated_layer_depths_missing()}",
            ),
        ),
    ],
    ids=["one layer", "two layers", "repeated layer, three depths"],
)
def test_every_draft_equals_the_sequence_path(draft_gaps, last_depth_passes, monkeypatch, mtp_num_layers, k, repeated):
    """Untrained heads at temperature 0.5 disagree with the policy often: many rejections. A
    second rollout on the same engine, in another order, starts from fresh caches. On the CPU the
    layer runs only the positions in range: rounds with padding left out are among them; and the
    last depth runs keys-only passes, or, where they are few (at most two positions here), its
    keys in the pass over the last positions: both in decode rounds at k = 1."""
    kept_positions = incremental_drafts._kept_positions
    left_out = []
    monkeypatch.setattr(incremental_drafts, "_kept_positions", lambda valid: left_out.append(int((~valid).sum())) or kept_positions(valid))
    overrides = engine_overrides(k, mtp_num_layers, megatron_cfg__mtp_use_repeated_layer=repeated, **MIXED_STEPS)
    policy, cfg = make_policy(**overrides, generation__temperature=0.5)
    model_config = policy.model.module.config
    monkeypatch.setattr(incremental_drafts, "RIDE_ALONG_MULTIPLY_ADDS", 2 * model_config.hidden_size * model_config.ffn_hidden_size)
    engine = RolloutEngine(policy, cfg)
    _check(draft_gaps, generate(engine, PROMPTS * 2, seed=3), k)
    draft_gaps.clear()
    _check(draft_gaps, generate(engine, PROMPTS[::-1] * 2, seed=4), k)
    assert sum(count > 0 for count in left_out) >= 3, left_out
    passes = collections.Counter(last_depth_passes)
    print(passes)
    assert {"prefill, keys-only pass", "decode, keys-only pass"} <= set(passes), passes
    if k == 1:  # at most one position before each of three requests' last: two or fewer often
        assert "decode, keys in the last pass" in passes, passes


def test_with_every_position_run_as_on_a_gpu_every_draft_equals_the_sequence_path(draft_gaps, monkeypatch):
    """Off the CPU the layer runs every ``[R, W]`` position, padding included (finding the ones in
    range would read their count back from the device), and the last depth of a decode round in
    one pass: that layout, forced here, drafts the same."""
    monkeypatch.setattr(incremental_drafts, "_on_cpu", lambda device: False)
    policy, cfg = make_policy(**engine_overrides(2, 2, **MIXED_STEPS), generation__temperature=0.5)
    _check(draft_gaps, generate(RolloutEngine(policy, cfg), PROMPTS * 2, seed=3), 2)


def test_every_draft_of_trained_heads_equals_the_sequence_path(trained_policy, draft_gaps, last_depth_passes):
    """Trained heads: long runs of accepted drafts (several positions committed per step). Second
    drafts are accepted 8 times in 18 here: the 3 more accepted (of 21) counted before requests
    ended at an accepted end-of-sequence draft were end tokens drafted after an accepted end.
    Three requests' keys-only positions are few: they ride along in every round."""
    cfg = tiny_config(**engine_overrides(2, **SIZES, **MIXED_STEPS)).policy
    rollouts = generate(RolloutEngine(trained_policy, cfg), PROMPTS * 2, seed=5)
    accepted, proposed = rollouts["draft_accepted"].tolist(), rollouts["draft_proposed"].tolist()
    assert accepted[0] > 0.5 * proposed[0] and accepted[1] > 0.4 * proposed[1]
    _check(draft_gaps, rollouts, 2)
    assert {"prefill, keys in the last pass", "decode, keys in the last pass"} == set(last_depth_passes), collections.Counter(last_depth_passes)


def test_the_mtp_caches_live_inside_the_engines_memory_budget():
    """Each MTP depth stores, per block, what one decoder layer stores; their bytes come out of
    buffer_size_gb (one decoder block's worth of rounding at most)."""
    policy, cfg = make_policy(**engine_overrides(2, 2))
    engine = RolloutEngine(policy, cfg)
    memory = kv_memory(engine.engine)
    megatron = cfg.megatron_cfg
    head_dim = megatron.hidden_size // megatron.num_attention_heads
    per_block_and_layer = 2 * cfg.generation.engine.block_size_tokens * megatron.num_query_groups * head_dim * 4
    blocks = engine.engine.context.kv_block_allocator.total_count
    assert memory["trunk"] == blocks * per_block_and_layer * megatron.num_layers
    assert memory["mtp"] == (blocks + 1) * per_block_and_layer * 2  # + one scratch block
    budget = cfg.generation.engine.buffer_size_gb * 1024**3
    assert budget - per_block_and_layer * (megatron.num_layers + 2) <= memory["trunk"] + memory["mtp"] - per_block_and_layer * 2 <= budget
