"""``num_speculative_tokens: auto``: the choice from acceptance and step cost (hand-worked cases),
where each acceptance comes from, and auto on the real engine (lossless, rebuilt for its choice,
k = 0 where drafts are rarely accepted, the trainer's forecast reaching the choice)."""

from __future__ import annotations

import pytest
import torch

from nemo_rl_mtp.rollout import auto_k as adaptive_speculation
from nemo_rl_mtp.rollout.auto_k import AdaptiveSpeculation, batch_bucket, forecast_from_metrics
from nemo_rl_mtp.rollout.engine import RolloutEngine
from nemo_rl_mtp.config.load import ConfigError
from tests.support.helpers import make_policy, recompute_sampler, tiny_config
from tests.support.release_gates import on_this_release
from tests.support.engine_cases import PROMPTS, TOKENIZER, engine_overrides, generate, requires_speculation, speculation_skip_reason

COUNTS_NONE = {"draft_proposed": torch.zeros(0, dtype=torch.long), "draft_accepted": torch.zeros(0, dtype=torch.long)}


def _counts(proposed: list[int], accepted: list[int]) -> dict:
    return {"draft_proposed": torch.tensor(proposed), "draft_accepted": torch.tensor(accepted)}


def _tuner(profile: dict[int, float], counts: dict = COUNTS_NONE, max_k: int = 2) -> AdaptiveSpeculation:
    tuner = AdaptiveSpeculation(max_k)
    tuner.record_profile(32, profile, greedy=False, counts=counts)
    return tuner


def test_batch_sizes_share_costs_by_power_of_two():
    assert [batch_bucket(n) for n in (1, 2, 3, 8, 9, 32, 33)] == [1, 2, 4, 8, 16, 32, 64]


def test_chooses_the_most_tokens_per_second():
    """Steps of 10, 13 and 16 ms; drafts accepted 90% and 80% (with the first): per request and
    step 1, 1.9 and 2.7 tokens, i.e. 100, 146 and 169 tokens per second per request."""
    tuner = _tuner({0: 0.010, 1: 0.013, 2: 0.016}, _counts([100, 100], [90, 80]))
    choice = tuner.choose(32, greedy=False, num_requests=1)
    assert choice.num_speculative_tokens == 2
    assert choice.expected_tokens_per_s == pytest.approx(2.7 / 0.016)


def test_chooses_no_speculation_when_drafts_are_rarely_accepted():
    """Accepted 10% / 2%: 1.1 tokens per 13 ms (85/s) and 1.12 per 16 ms (70/s) against 100/s."""
    tuner = _tuner({0: 0.010, 1: 0.013, 2: 0.016}, _counts([100, 100], [10, 2]))
    assert tuner.choose(32, greedy=False, num_requests=32).num_speculative_tokens == 0


def test_speculates_only_where_the_expected_gain_clears_the_margin():
    """Accepted 40%: 1.4 tokens per 13.7 ms (102/s) is under 3% above 100/s; per 13 ms (108/s) it is over."""
    tuner = _tuner({0: 0.010, 1: 0.0137}, _counts([100], [40]), max_k=1)
    assert tuner.choose(32, greedy=False, num_requests=32).num_speculative_tokens == 0
    tuner = _tuner({0: 0.010, 1: 0.013}, _counts([100], [40]), max_k=1)
    assert tuner.choose(32, greedy=False, num_requests=32).num_speculative_tokens == 1


def test_one_draft_when_the_second_is_not_worth_its_cost():
    """Accepted 90% / 20%: 1.9 / 13 ms = 146/s beats 2.1 / 16 ms = 131/s."""
    tuner = _tuner({0: 0.010, 1: 0.013, 2: 0.016}, _counts([100, 100], [90, 20]))
    assert tuner.choose(32, greedy=False, num_requests=32).num_speculative_tokens == 1


def test_the_forecast_replaces_acceptance_measured_before_a_training_step():
    """A rollout at k = 0 measures nothing; the profile's acceptance (10%) is stale once training
    forecasts 95% per depth: 1 + 0.95 + 0.9025 tokens per 16 ms beats the rest."""
    tuner = _tuner({0: 0.010, 1: 0.013, 2: 0.016}, _counts([100, 100], [10, 2]))
    tuner.record_rollout(32, False, 0, seconds=1.0, steps=100, tokens=3200, counts=COUNTS_NONE)
    assert tuner.choose(32, False, 32).num_speculative_tokens == 0
    tuner.observe_forecast(forecast_from_metrics({"mtp/mtp_1_expected_acceptance": 95.0, "mtp/mtp_2_expected_acceptance": 95.0}))
    assert tuner.acceptance(greedy=False) == pytest.approx([0.95, 0.95**2])
    assert tuner.choose(32, False, 32).num_speculative_tokens == 2


def test_acceptance_measured_since_the_last_training_step_beats_the_forecast():
    tuner = _tuner({0: 0.010, 1: 0.013, 2: 0.016})
    tuner.observe_forecast([0.95, 0.95])
    tuner.record_rollout(32, False, 1, seconds=1.0, steps=50, tokens=3200, counts=_counts([50], [10]))
    assert tuner.acceptance(greedy=False) == pytest.approx([0.2, 0.95**2])  # position 2 not measured since
    assert tuner.choose(32, False, 32).num_speculative_tokens == 2
    tuner.record_rollout(32, False, 2, seconds=1.0, steps=50, tokens=3200, counts=_counts([50, 50], [10, 2]))
    assert tuner.acceptance(greedy=False) == pytest.approx([0.2, 0.04])
    assert tuner.choose(32, False, 32).num_speculative_tokens == 0
    assert tuner.acceptance(greedy=True) == pytest.approx([0.95, 0.95**2])  # greedy rollouts measured nothing yet


def test_step_costs_follow_the_latest_rollout_in_the_profiles_proportions():
    """Profile 10 / 13 / 16 ms; a rollout at k = 1 measures 26 ms per step (longer sequences):
    the others are estimated at 20 and 32 ms. Its 2 tokens per request-step at 3200 tokens in 50
    steps: 32 requests per step, so k = 1 is expected at 32 * 1.9 / 0.026 tokens/s."""
    tuner = _tuner({0: 0.010, 1: 0.013, 2: 0.016}, _counts([100, 100], [90, 20]))
    tuner.record_rollout(32, False, 1, seconds=1.3, steps=50, tokens=3200, counts=_counts([1600], [1600]))
    assert tuner.seconds_per_step(32) == pytest.approx({0: 0.020, 1: 0.026, 2: 0.032})
    assert tuner.requests_per_step[32] == pytest.approx(32.0)
    choice = tuner.choose(32, False, 99)
    assert choice.num_speculative_tokens == 1 and choice.expected_tokens_per_s == pytest.approx(32 * 2.0 / 0.026)


def test_a_close_runner_up_is_measured_once_then_the_measurements_decide():
    """Profile: 10 / 13 / 15.5 ms, accepted 90% / 20% (k = 1 at 146/s, k = 2 at 135/s: within
    10%). After a rollout at k = 1, k = 2 is run once; measured at 12 ms (long sequences, where
    fewer steps save attention) it wins (175/s) and stays; k = 0 (100/s, not close) is never run."""
    tuner = _tuner({0: 0.010, 1: 0.013, 2: 0.0155}, _counts([100, 100], [90, 20]))
    assert tuner.choose(32, False, 1).num_speculative_tokens == 1
    tuner.record_rollout(32, False, 1, seconds=1.3, steps=100, tokens=190, counts=_counts([100], [90]))
    assert tuner.choose(32, False, 1).num_speculative_tokens == 2
    tuner.record_rollout(32, False, 2, seconds=1.2, steps=100, tokens=210, counts=_counts([100, 100], [90, 20]))
    assert tuner.seconds_per_step(32) == pytest.approx({0: 0.010 * 0.012 / 0.0155, 1: 0.013, 2: 0.012})
    for _ in range(3):
        choice = tuner.choose(32, False, 1)
        assert choice.num_speculative_tokens == 2
        tuner.record_rollout(32, False, 2, seconds=1.2, steps=100, tokens=210, counts=_counts([100, 100], [90, 20]))


def test_step_time_measurements_expire():
    """After MEASUREMENT_LIFETIME rollouts of a batch size at other k, a k's own measurement
    gives way to the profile scaled to the latest one."""
    tuner = _tuner({0: 0.010, 1: 0.013, 2: 0.016}, _counts([100, 100], [90, 20]))
    tuner.record_rollout(32, False, 1, seconds=2.6, steps=100, tokens=190, counts=_counts([100], [90]))  # 26 ms
    for _ in range(adaptive_speculation.MEASUREMENT_LIFETIME):
        tuner.record_rollout(32, False, 2, seconds=1.6, steps=100, tokens=270, counts=_counts([100, 100], [90, 20]))
    assert tuner.seconds_per_step(32)[1] == pytest.approx(0.013)


def test_auto_is_a_config_value_and_other_words_are_not():
    assert tiny_config(generation__num_speculative_tokens="auto").policy.generation.num_speculative_tokens == "auto"
    with pytest.raises(ConfigError, match="policy.generation.num_speculative_tokens='fast'"):
        tiny_config(generation__num_speculative_tokens="fast")


@requires_speculation
@pytest.mark.usefixtures("megatron_world")
def test_auto_rollouts_are_the_greedy_reference_and_report_their_choice():
    policy, cfg = make_policy(**engine_overrides("auto", 2, generation__top_k=1))
    engine = RolloutEngine(policy, cfg)
    rollouts = generate(engine)
    reference = recompute_sampler(policy, PROMPTS, cfg.generation.max_new_tokens, TOKENIZER.eos_id)
    assert [row[:length].tolist() for row, length in zip(rollouts["tokens"], rollouts["lengths"])] == reference
    k = int(rollouts["speculative_tokens"])
    assert 0 <= k <= 2 and engine.num_speculative_tokens == k and rollouts["draft_proposed"].shape == (k,)
    assert float(rollouts["expected_tokens_per_s"]) > 0 and float(rollouts["engine_tokens_per_s"]) > 0
    assert engine.adaptive.profiled[batch_bucket(len(PROMPTS))].keys() == {0, 1, 2}


@requires_speculation
@pytest.mark.usefixtures("megatron_world")
def test_auto_does_not_speculate_with_drafts_the_policy_rarely_accepts():
    """Untrained heads verified by equality at temperature 1 over 14 tokens: about sum_x p q, under
    15% accepted, far below what a speculative step costs."""
    policy, cfg = make_policy(**engine_overrides("auto", 2, generation__spec_verification="exact_match"))
    engine = RolloutEngine(policy, cfg)
    for seed in range(2):
        rollouts = generate(engine, PROMPTS * 2, seed=seed)
        assert int(rollouts["speculative_tokens"]) == 0, engine.adaptive.acceptance(greedy=False)


@requires_speculation
@pytest.mark.usefixtures("megatron_world")
def test_the_trainers_forecast_reaches_the_next_choice():
    """Step costs fixed by hand (a speculative step at 1.2x a plain one): with the forecast of
    trained heads the engine is rebuilt for drafts, with that of poor heads for none."""
    policy, cfg = make_policy(**engine_overrides("auto", 1))
    engine = RolloutEngine(policy, cfg)
    engine.adaptive.record_profile(batch_bucket(len(PROMPTS)), {0: 0.010, 1: 0.012}, greedy=False, counts=COUNTS_NONE)
    engine.observe_training_metrics({"mtp/mtp_1_expected_acceptance": 97.0})
    rollouts = generate(engine)
    assert int(rollouts["speculative_tokens"]) == 1 and rollouts["draft_proposed"].shape == (1,)
    engine.observe_training_metrics({"mtp/mtp_1_expected_acceptance": 5.0})  # the rollout's acceptance is stale now
    assert int(generate(engine)["speculative_tokens"]) == 0 and engine.num_speculative_tokens == 0


@pytest.mark.skipif(
    speculation_skip_reason() is None, reason=on_this_release("its engine speculates; auto without speculation runs on a release without it (0.16)")
)
@pytest.mark.usefixtures("megatron_world")
def test_auto_on_an_engine_without_speculation_chooses_no_drafts_and_a_number_is_refused(caplog):
    """auto chooses 0 (said once, by the configuration check), with no profiling of drafts the
    engine cannot run; k = 1 is refused when the configuration is loaded, in one line naming the
    release and what it lacks."""
    from nemo_rl_mtp.rollout.speculation import check_speculation_supported

    policy, cfg = make_policy(**engine_overrides("auto", 1, generation__top_k=1))
    with caplog.at_level("INFO"):
        check_speculation_supported(cfg.generation, cfg.megatron_cfg)
    assert caplog.text.count("auto chooses 0") == 1
    engine = RolloutEngine(policy, cfg)
    rollouts = generate(engine)
    assert engine.adaptive is None and engine.num_speculative_tokens == 0 and rollouts["draft_proposed"].shape == (0,)
    reference = recompute_sampler(policy, PROMPTS, cfg.generation.max_new_tokens, TOKENIZER.eos_id)
    assert [row[:length].tolist() for row, length in zip(rollouts["tokens"], rollouts["lengths"])] == reference
    with pytest.raises(ConfigError, match=r"^policy.generation.num_speculative_tokens=1: megatron-core 0\.16\.\d+: its DynamicInferenceEngine has no speculative decoding"):
        tiny_config(**engine_overrides(1, 1))
