"""``num_speculative_tokens: auto``: the choice from acceptance and step cost (hand-worked cases),
where each acceptance comes from, and auto on the real engine (lossless, rebuilt for its choice,
k = 0 where drafts are rarely accepted, the trainer's forecast reaching the choice)."""

from __future__ import annotations

import gc
import math
import statistics
import threading
import time
import weakref

import pytest
import torch

from benchmarks.auto_k_noise_simulation import OpeningLookedAtWhenClose, OpeningLookUnanswered
from nemo_rl_mtp.rollout import auto_k as adaptive_speculation
from nemo_rl_mtp.rollout import machine_speed
from nemo_rl_mtp.rollout.auto_k import AdaptiveSpeculation, batch_bucket, forecast_from_metrics
from nemo_rl_mtp.megatron_compat import engine_teardown
from nemo_rl_mtp.rollout.engine import RolloutEngine, build_engine
from nemo_rl_mtp.config.load import ConfigError
from tests.support.helpers import make_policy, recompute_sampler, tiny_config
from tests.support.release_gates import on_this_release
from tests.support.engine_cases import PROMPTS, TOKENIZER, engine_overrides, generate, requires_speculation, speculation_skip_reason

COUNTS_NONE = {"draft_proposed": torch.zeros(0, dtype=torch.long), "draft_accepted": torch.zeros(0, dtype=torch.long)}


def _counts(proposed: list[int], accepted: list[int]) -> dict:
    return {"draft_proposed": torch.tensor(proposed), "draft_accepted": torch.tensor(accepted)}


def _tuner(profile: dict[int, float], counts: dict = COUNTS_NONE, max_k: int = 2, rule: type = AdaptiveSpeculation) -> AdaptiveSpeculation:
    """``rule``: the rule, or one of ``benchmarks.auto_k_noise_simulation``'s earlier versions of it (a control)."""
    tuner = rule(max_k)
    tuner.record_profile(32, profile, greedy=False, counts=counts)
    return tuner


def test_batch_sizes_share_costs_by_power_of_two():
    assert [batch_bucket(n) for n in (1, 2, 3, 8, 9, 32, 33)] == [1, 2, 4, 8, 16, 32, 64]


def _first_looks(tuner: AdaptiveSpeculation) -> list[int]:
    """The k a fresh context of ``tuner`` runs once each, in order, from its prior: the last is
    the prior's best, its incumbent."""
    tuner.choose(32, greedy=False, num_requests=32)
    state = tuner.context(32, False)
    assert state.incumbent == state.first_looks[-1]
    return list(state.first_looks)


def test_chooses_the_most_tokens_per_second():
    """Steps of 10, 13 and 16 ms; drafts accepted 90% and 80% (with the first): per request and
    step 1, 1.9 and 2.7 tokens, i.e. 100, 146 and 169 tokens per second per request. All three
    are looked at (146 is within 30% of 169), the least promising first, the best last."""
    tuner = _tuner({0: 0.010, 1: 0.013, 2: 0.016}, _counts([100, 100], [90, 80]))
    assert _first_looks(tuner) == [0, 1, 2]
    assert tuner.estimates(32, False, 1)[2] == pytest.approx(2.7 / 0.016)
    choice = tuner.choose(32, greedy=False, num_requests=1)
    assert choice.num_speculative_tokens == 0 and choice.expected_tokens_per_s == pytest.approx(100.0)


def test_where_the_prior_is_right_the_rollouts_after_the_first_looks_keep_its_k():
    """k = 2 is the fastest, as the prior says (169 tokens/s a request against 146 and 100): the
    first looks end on it and the rollouts after them go on with it, two changes of k in all (each
    a rebuild of the engine). With the prior's best run first, as until 2026-12-06, the looks
    after it took a third change, back to it, in the rollout after them."""
    tuner = _tuner({0: 0.010, 1: 0.013, 2: 0.016}, _counts([100, 100], [90, 80]))
    chosen = [_rollout(tuner, {0: 700.0, 1: 900.0, 2: 1000.0}, rates=(0.9, 0.8)) for _ in range(8)]
    assert chosen == [0, 1, 2, 2, 2, 2, 2, 2], chosen
    assert sum(before != after for before, after in zip(chosen, chosen[1:])) == 2


def test_chooses_no_speculation_when_drafts_are_rarely_accepted():
    """Accepted 10% / 2%: 1.1 tokens per 13 ms (85/s) and 1.12 per 16 ms (70/s) against 100/s."""
    tuner = _tuner({0: 0.010, 1: 0.013, 2: 0.016}, _counts([100, 100], [10, 2]))
    assert _first_looks(tuner)[-1] == 0


def test_speculates_only_where_the_expected_gain_clears_the_margin():
    """Accepted 40%: 1.4 tokens per 13.7 ms (102/s) is under 3% above 100/s; per 13 ms (108/s) it is over."""
    tuner = _tuner({0: 0.010, 1: 0.0137}, _counts([100], [40]), max_k=1)
    assert _first_looks(tuner) == [1, 0]
    tuner = _tuner({0: 0.010, 1: 0.013}, _counts([100], [40]), max_k=1)
    assert _first_looks(tuner) == [0, 1]


def test_one_draft_when_the_second_is_not_worth_its_cost():
    """Accepted 90% / 20%: 1.9 / 13 ms = 146/s beats 2.1 / 16 ms = 131/s."""
    tuner = _tuner({0: 0.010, 1: 0.013, 2: 0.016}, _counts([100, 100], [90, 20]))
    assert _first_looks(tuner)[-1] == 1


def _counts_for(k: int, rates: list[float], drafts: int = 100) -> dict:
    """What a rollout at k proposing ``drafts`` per position accepts at chained ``rates``."""
    return _counts([drafts] * k, [round(drafts * rate) for rate in rates[:k]])


def _rollout(tuner: AdaptiveSpeculation, tokens_per_s: dict[int, float], rates: list[float] = (0.9, 0.2), bucket: int = 32) -> int:
    """One rollout of 3200 tokens at auto's choice, realising ``tokens_per_s[k]``; its k."""
    choice = tuner.choose(bucket, False, 32)
    k = choice.num_speculative_tokens
    steps = round(3200 / (32 * (1 + sum(rates[:k]))))
    tuner.record_rollout(bucket, False, choice, 3200 / tokens_per_s[k], steps, 3200, _counts_for(k, list(rates)))
    return k


def test_the_forecast_replaces_acceptance_measured_before_a_training_step():
    """The profile's acceptance (10%) is stale once training forecasts 95% per depth."""
    tuner = _tuner({0: 0.010, 1: 0.013, 2: 0.016}, _counts([100, 100], [10, 2]))
    assert tuner.acceptance(greedy=False) == pytest.approx([0.1, 0.02])
    tuner.observe_forecast(forecast_from_metrics({"mtp/mtp_1_expected_acceptance": 95.0, "mtp/mtp_2_expected_acceptance": 95.0}))
    assert tuner.acceptance(greedy=False) == pytest.approx([0.95, 0.95**2])
    assert _first_looks(tuner)[-1] == 2


def test_acceptance_measured_since_the_last_training_step_beats_the_forecast():
    tuner = _tuner({0: 0.010, 1: 0.013, 2: 0.016})
    tuner.observe_forecast([0.95, 0.95])
    choice = tuner.choose(32, False, 32)
    tuner.record_rollout(32, False, choice, seconds=1.0, steps=50, tokens=3200, counts=_counts([50], [10]))
    assert tuner.acceptance(greedy=False) == pytest.approx([0.2, 0.95**2])  # position 2 not measured since
    tuner.record_rollout(32, False, choice, seconds=1.0, steps=50, tokens=3200, counts=_counts([50, 50], [10, 2]))
    assert tuner.acceptance(greedy=False) == pytest.approx([0.2, 0.04])
    assert tuner.acceptance(greedy=True) == pytest.approx([0.95, 0.95**2])  # greedy rollouts measured nothing yet


def test_a_profile_that_favours_drafts_gives_way_to_the_rollouts_that_measure_them_slower():
    """The profile expects k = 1 at 146/s against 100/s (3-step rollouts of short prompts), but
    rollouts realise 1,000 tokens/s at k = 0 and 830 at k = 1 (long responses: the default
    recipe's case before its profile ran such rollouts whole): the first looks run k = 0, k = 2
    (the prior's 100/s and 135/s) and k = 1 (the prior's best) once each. k = 1 reads 0.57x what
    the prior implies for it from k = 0's look, but 1.10x what it implies from k = 2's (700 x
    146 / 135.5 = 754): the looks at drafting k agree with each other, the prior erred about k = 0
    (the 2-layer benchmark cells' case on 2026-12-07, where the profile misread k = 0's step), and
    k = 0 runs from the fourth rollout on (but for k = 1's second look). Control: with one drafting k (max_k = 1) no other look
    can side with k = 1's, and it is rechecked until it has run WINDOW = 3 times (what a profile
    this wrong costs there, once per context), then k = 0 runs."""
    assert adaptive_speculation.WINDOW == 3
    tuner = _tuner({0: 0.010, 1: 0.013, 2: 0.0155}, _counts([100, 100], [90, 20]))
    realised = {0: 1000.0, 1: 830.0, 2: 700.0}
    chosen = [_rollout(tuner, realised) for _ in range(14)]
    assert chosen == [0, 2, 1, *[0] * 9, 1, 0], chosen  # 13: k = 1's second look, REFRESH_EVERY after its first
    control = _tuner({0: 0.010, 1: 0.013}, _counts([100], [90]), max_k=1)
    chosen = [_rollout(control, realised) for _ in range(14)]
    assert chosen[:4] == [0, 1, 1, 1] and set(chosen[4:]) == {0}, chosen


def test_a_k_the_profile_puts_far_below_the_best_is_looked_at_once_and_kept_where_rollouts_find_it_fastest():
    """The profile misreads k = 1's step at 3x k = 0's (beside another job on 2026-12-06 one read
    2.94x where the same work read 1.90x): k = 1's prior, 1.9 tokens per 30 ms (63/s a request),
    is 0.37x k = 2's (2.7 per 16 ms), but rollouts run k = 1 at 1,000 tokens/s against k = 2's
    900 and k = 0's 700. Every k is looked at once, the least promising by the prior first, so
    k = 1 runs at rollout 1, and from the looks on k = 1 runs but for k = 2's two rechecks (the
    prior's best, read far below what the prior implies for it) and the others' second looks and
    refreshes. Control: the first looks as until late on 2026-12-06 (k = 0 and the k the prior
    puts within 70% of its best; a k left out ran once its prior, scaled to the rollouts, came
    within REFRESH_WITHIN of the best estimate): k = 1 never runs in 40 rollouts."""
    profile, realised = {0: 0.010, 1: 0.030, 2: 0.016}, {0: 700.0, 1: 1000.0, 2: 900.0}
    tuner = _tuner(profile, _counts([100, 100], [90, 80]))
    chosen = [_rollout(tuner, realised, rates=(0.9, 0.8)) for _ in range(40)]
    assert chosen[:5] == [1, 0, 2, 2, 2] and chosen.count(1) >= 30, chosen
    control = _tuner(profile, _counts([100, 100], [90, 80]))

    def plausible_looks_only(expected: dict[int, float]) -> list[int]:
        *others, best = AdaptiveSpeculation._first_looks(control, expected)
        return [*(k for k in others if k == 0 or expected[k] >= 0.7 * expected[best]), best]

    def refresh_due_once_within_reach(state, k: int, relative: float, switch_cost: float) -> bool:
        if k not in state.observations:
            return relative >= 1.0 - adaptive_speculation.REFRESH_WITHIN
        return AdaptiveSpeculation._refresh_due(state, k, relative, switch_cost)

    control._first_looks, control._refresh_due = plausible_looks_only, refresh_due_once_within_reach
    chosen = [_rollout(control, realised, rates=(0.9, 0.8)) for _ in range(40)]
    assert 1 not in chosen and chosen[:2] == [0, 2], chosen
    assert 1.9 / 0.030 < 0.7 * 2.7 / 0.016


def test_the_fastest_measured_k_is_kept_and_the_others_refreshed_in_proportion_to_their_gap():
    """k = 1 realises 1,000/s, k = 2 960/s (within REFRESH_WITHIN = 10%), k = 0 700/s (30% below):
    k = 2 is re-run once every REFRESH_EVERY = 10 rollouts, k = 0 once every 0.3 / 0.005 = 60
    (its refreshes cost 0.3 of a rollout each, half a percent on average): after its first look
    (rollout 1) and its second, REFRESH_EVERY rollouts on (rollout 11), at rollout 71."""
    constants = (adaptive_speculation.REFRESH_WITHIN, adaptive_speculation.REFRESH_EVERY, adaptive_speculation.FAR_REFRESH_COST)
    assert constants == (0.10, 10, 0.005)
    tuner = _tuner({0: 0.010, 1: 0.013, 2: 0.0155}, _counts([100, 100], [90, 20]))
    realised = {0: 700.0, 1: 1000.0, 2: 960.0}
    chosen = [_rollout(tuner, realised) for _ in range(73)]
    assert chosen[:3] == [0, 2, 1], chosen
    assert [number for number, k in enumerate(chosen, start=1) if k == 0] == [1, 11, 71], chosen
    assert chosen[12:42].count(2) == 3 and chosen[12:42].count(1) == 27, chosen


class _UnluckyLooksAtZero(dict):
    """Tokens/s per k, except k = 0's first ``unlucky`` rollouts, which come out at 600/s (a load
    spike, or a run's first rollouts while the process warms up)."""

    def __init__(self, speeds: dict[int, float], unlucky: int):
        super().__init__(speeds)
        self.unlucky = unlucky

    def __getitem__(self, k: int) -> float:
        if k == 0 and self.unlucky:
            self.unlucky -= 1
            return 600.0
        return super().__getitem__(k)


def test_k0_left_with_an_unlucky_first_look_is_looked_at_again():
    """k = 0 is truly the fastest (1,000/s against k = 1's 800/s), but its first look came out at
    600/s, and the profile favours drafting (k = 1 the incumbent): auto stays on k = 1, looks at
    k = 0 again REFRESH_EVERY rollouts after its first look (rollout 11), finds 1,000/s and keeps
    k = 0 from there on (the default recipe's case in 2 of 6 runs on 2026-12-06, before this
    second look: k = 1 for 45 and 70 rollouts). If the second look is unlucky too, k = 0 is
    re-measured after (1 - 600/800) / FAR_REFRESH_COST = 50 more rollouts (rollout 61); without a
    refresh beyond REFRESH_WITHIN, k = 0 (25% below) would never run again."""
    tuner = _tuner({0: 0.010, 1: 0.0125}, _counts([100], [90]), max_k=1)
    realised = _UnluckyLooksAtZero({0: 1000.0, 1: 800.0}, unlucky=1)
    chosen = [_rollout(tuner, realised) for _ in range(20)]
    assert chosen[:2] == [0, 1], chosen
    assert [number for number, k in enumerate(chosen, start=1) if k == 0] == [1, *range(11, 21)], chosen
    tuner = _tuner({0: 0.010, 1: 0.0125}, _counts([100], [90]), max_k=1)
    realised = _UnluckyLooksAtZero({0: 1000.0, 1: 800.0}, unlucky=2)
    chosen = [_rollout(tuner, realised) for _ in range(70)]
    assert [number for number, k in enumerate(chosen, start=1) if k == 0] == [1, 11, *range(61, 71)], chosen
    assert 600.0 / 800.0 < 1.0 - adaptive_speculation.REFRESH_WITHIN  # outside the close refresh


class _UnluckyLookAtOne(dict):
    """Tokens/s per k, except k = 1's first rollout, which comes out at 600/s (a run's slow start)."""

    def __getitem__(self, k: int) -> float:
        if k == 1 and not getattr(self, "looked", False):
            self.looked = True
            return 600.0
        return super().__getitem__(k)


def test_the_priors_best_after_an_unlucky_first_look_is_rechecked_at_once():
    """k = 1 is truly the fastest (1,000/s against k = 0's 800/s), as the profile says (1.52x k =
    0), but its one look, the first looks' last (rollout 2), came out at 600/s: 0.49x what the
    prior implies for it against k = 0's 800 (1,216/s), beyond RECHECK_BELOW = 20%. It runs again
    at once (rollout 3), finds 1,000/s and keeps k = 1 from there on (but for k = 0's second look,
    REFRESH_EVERY rollouts after its first: k = 0's one look, the context's first rollout, read
    20% below k = 1, beyond REFRESH_WITHIN, is not looked at again at once). Controls (the next test): without rechecks
    auto moves to k = 0 and looks at k = 1 again REFRESH_EVERY rollouts after its first look
    (rollout 12, the second look); without that second look either, k = 1 (25% below k = 0 as
    estimated) waits for its far refresh, (1 - 600/800) / FAR_REFRESH_COST = 50 rollouts on."""
    assert adaptive_speculation.RECHECK_BELOW == 0.2
    tuner = _tuner({0: 0.010, 1: 0.0125}, _counts([100], [90]), max_k=1)
    realised = _UnluckyLookAtOne({0: 800.0, 1: 1000.0})
    chosen = [_rollout(tuner, realised) for _ in range(20)]
    assert [number for number, k in enumerate(chosen, start=1) if k == 0] == [1, 11], chosen  # 11: k = 0's second look
    assert 600.0 < (1.0 - 0.2) * 800.0 * 1.9 / 0.0125 / 100.0


def test_without_a_recheck_the_priors_best_is_looked_at_again():
    """The previous test's run with rechecks off (as where a look falls within RECHECK_BELOW of
    the prior's word): the second look at the prior's best, REFRESH_EVERY rollouts after its
    first, finds k = 1's 1,000/s (rollout 12). Control: without the second look either, k = 1
    runs once only in 20 rollouts."""
    tuner = _tuner({0: 0.010, 1: 0.0125}, _counts([100], [90]), max_k=1)
    tuner._recheck_due = lambda state, expected, prior, best: False
    realised = _UnluckyLookAtOne({0: 800.0, 1: 1000.0})
    chosen = [_rollout(tuner, realised) for _ in range(20)]
    assert [number for number, k in enumerate(chosen, start=1) if k == 1] == [2, *range(12, 21)], chosen
    control = _tuner({0: 0.010, 1: 0.0125}, _counts([100], [90]), max_k=1)
    control._recheck_due = lambda state, expected, prior, best: False
    control._second_looks_due = lambda state, expected: [k for k in AdaptiveSpeculation._second_looks_due(state, expected) if k == 0]
    realised = _UnluckyLookAtOne({0: 800.0, 1: 1000.0})
    chosen = [_rollout(control, realised) for _ in range(20)]
    assert [number for number, k in enumerate(chosen, start=1) if k == 1] == [2], chosen


def test_on_a_cpu_auto_times_the_engines_thread_alone():
    """Another thread of the process spinning while the engine's thread waits (as Ray's and the
    loggers' threads run while a busy machine stretches a rollout) adds nothing to auto's clock;
    the control, the process's CPU time, counts it. With several torch threads computing for the
    engine, all of the process's CPU time counts."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert adaptive_speculation.step_clock() is time.process_time
        torch.set_num_threads(1)  # a CPU run's default
        clock = adaptive_speculation.step_clock()
    finally:
        torch.set_num_threads(threads)
    done = threading.Event()

    def spin():
        while not done.is_set():
            pass

    start, process_start = clock(), time.process_time()
    spinner = threading.Thread(target=spin)
    spinner.start()
    deadline = time.monotonic() + 60.0
    while time.process_time() - process_start < 0.2 and time.monotonic() < deadline:  # however busy the machine
        time.sleep(0.01)
    done.set()
    spinner.join()
    elapsed, process_elapsed = clock() - start, time.process_time() - process_start
    assert process_elapsed >= 0.2, process_elapsed  # the control: the spinning thread's CPU time
    assert elapsed < 0.1 * process_elapsed, (elapsed, process_elapsed)


def test_two_slowed_rollouts_of_three_do_not_hide_a_ks_speed():
    """k = 0 runs at 1,000/s, k = 1 at 800/s. After k = 0's first three rollouts two more come out
    at 330/s and 500/s (another job on the machine slowed them): its window holds 1,000, 330 and
    500, and auto stays on k = 0, its fastest. The control, the median of that window (500/s),
    is below k = 1's 800/s: a median would have switched to the slower k."""
    tuner = _tuner({0: 0.010, 1: 0.0125}, _counts([100], [90]), max_k=1)
    realised = {0: 1000.0, 1: 800.0}
    for _ in range(7):  # the first looks (k = 0, then k = 1, the prior's best, rechecked twice), k = 0 settled
        _rollout(tuner, realised)
    state = tuner.context(32, False)
    assert state.incumbent == 0 and len(state.observations[0]) == adaptive_speculation.WINDOW
    for slowed in (330.0, 500.0):
        assert _rollout(tuner, {0: slowed, 1: 800.0}) == 0
    window = [observation.tokens_per_s for observation in state.observations[0]]
    assert sorted(window) == [330.0, 500.0, 1000.0], window
    assert statistics.median(window) < realised[1]  # the control
    assert tuner.choose(32, False, 32).num_speculative_tokens == 0


def _run_through_a_slow_spell(spell: list[float], confirmed: bool = True) -> list[int]:
    """k = 0 runs at 1,000 tokens/s, k = 1 at 800/s; after the first looks (k = 0, then k = 1, the
    profile's best, rechecked twice: the profile puts it at 1.52x k = 0) and one settled rollout
    of k = 0, the machine runs at ``spell[n]`` x its speed in rollout 6 + n, whichever k runs
    (the probe not told: it hardly sees such spells), at full speed after. The k of 14
    rollouts; ``confirmed=False`` switches confirmation off."""
    tuner = _tuner({0: 0.010, 1: 0.0125}, _counts([100], [90]), max_k=1)
    if not confirmed:
        tuner._confirm_switch = lambda bucket, greedy, state: None
    speeds = [1.0] * 5 + [*spell, *[1.0] * (9 - len(spell))]
    return [_rollout(tuner, {0: 1000.0 * speed, 1: 800.0 * speed}) for speed in speeds]


def test_a_switch_made_in_a_slow_spell_is_undone_by_the_new_ks_first_rollout():
    """The default run traced on 2026-12-06: three rollouts of k = 0 in a slow spell (600/s) fill
    its window, so k = 0's estimate (600) falls under k = 1's look from before the spell (800) and
    auto switches to k = 1; the spell lasts one more rollout (k = 1 at 480/s). That rollout, slower
    than k = 0's estimate, sets k = 1's look aside, and auto is back on k = 0 at the next rollout.
    Control: without the confirmation auto stays on k = 1 (k = 0's refresh is far: 0.25 of a
    rollout's gap / FAR_REFRESH_COST = 50 rollouts). And where the spell ends with the switch
    (k = 1's rollout at its 800/s, faster than k = 0's 600), the switch stands."""
    start = [0, 1, 1, 1, 0]  # the first looks, k = 1's rechecks, k = 0 settled
    assert _run_through_a_slow_spell([0.6, 0.6, 0.6, 0.6]) == [*start, 0, 0, 0, 1, 0, 0, 0, 0, 0]
    assert _run_through_a_slow_spell([0.6, 0.6, 0.6, 0.6], confirmed=False) == [*start, 0, 0, 0, *[1] * 6]  # the control
    assert _run_through_a_slow_spell([0.6, 0.6, 0.6]) == [*start, 0, 0, 0, *[1] * 6]


class _Readings(dict):
    """Tokens/s per k, each k's rollouts reading its listed values in turn, the last repeated."""

    def __getitem__(self, k: int) -> float:
        readings = super().__getitem__(k)
        return readings.pop(0) if len(readings) > 1 else readings[0]


def test_a_switch_on_a_new_look_is_not_undone_by_one_rollout():
    """The quiet 2-layer 2048-token cell traced on 2026-12-07 (tokens/s): the prior puts k = 1
    first (1.13x k = 0), the looks read k = 2 at 900, k = 0 at 1,339 and k = 1 at 1,266, and auto
    switches to k = 0, the best. k = 0's next rollout reads 1,178, below k = 1's one look (its
    rollouts differ by 5-12% there). The switch was made on k = 0's look, not on the incumbent's
    estimate falling (a slow spell's signature, the confirmation's case: the slow-spell test
    above), and stands: k = 0 runs on. Control: with every switch confirmed, as until
    2026-12-07, k = 0's look is set aside and auto goes back to k = 1, 0.95x k = 0 by these
    readings, for the rest of the context's first ten rollouts."""
    profile = {0: 0.010, 1: 0.0168, 2: 0.030}  # per request 100, 113 and 70 tokens/s
    tuner = _tuner(profile, _counts([100, 100], [90, 20]))
    readings = _Readings({0: [1339.0, 1178.0, 1339.0], 1: [1266.0], 2: [900.0]})
    chosen = [_rollout(tuner, readings) for _ in range(10)]
    assert chosen == [2, 0, 1, *[0] * 7], chosen
    control = _tuner(profile, _counts([100, 100], [90, 20]))
    settle = control._settle_incumbent

    def settle_confirming_every_switch(state, expected):
        state.lowered = state.incumbent
        return settle(state, expected)

    control._settle_incumbent = settle_confirming_every_switch
    readings = _Readings({0: [1339.0, 1178.0, 1339.0], 1: [1266.0], 2: [900.0]})
    chosen = [_rollout(control, readings) for _ in range(10)]
    assert chosen == [2, 0, 1, 0, *[1] * 6], chosen


def test_the_contexts_first_rollout_is_looked_at_again_at_once_where_it_read_close_to_the_best():
    """The 2-layer 128-token cells traced on 2026-12-07: the profile misread k = 0's step (prior
    k2 / k0 2.0 where rollouts run k = 2 at 0.93x k = 0), so k = 0's look comes first, in the
    context's first rollout, which ran slow there (910 tokens/s against k = 0's 1,000); k = 1
    reads 970, k = 2 930. k = 0 read within REFRESH_WITHIN of the best and runs again at once
    (rollout 4), finds 1,000/s; k = 1, the incumbent it displaced, looked at once, is looked at
    again at once (rollout 5: like with like), reads 970 again, and k = 0 runs from there on.
    Controls: without the first rollout's second look, k = 1 runs until k = 0's second look,
    REFRESH_EVERY rollouts after its first (rollout 11); and a first rollout read beyond
    REFRESH_WITHIN (850/s: 12% below k = 1) waits for that second look too."""
    profile = {0: 0.013, 1: 0.013, 2: 0.0135}  # per request 77, 146 and 156 tokens/s
    tuner = _tuner(profile, _counts([100, 100], [90, 20]))
    readings = _Readings({0: [910.0, 1000.0], 1: [970.0], 2: [930.0]})
    chosen = [_rollout(tuner, readings) for _ in range(12)]
    assert chosen[:11] == [0, 1, 2, 0, 1, *[0] * 6], chosen
    control = _tuner(profile, _counts([100, 100], [90, 20]))
    control.choose(32, False, 32)
    control.context(32, False).opening = None
    readings = _Readings({0: [910.0, 1000.0], 1: [970.0], 2: [930.0]})
    chosen = [_rollout(control, readings) for _ in range(12)]
    assert chosen[:11] == [0, 1, 2, *[1] * 7, 0], chosen
    far = _tuner(profile, _counts([100, 100], [90, 20]))
    readings = _Readings({0: [850.0, 1000.0], 1: [970.0], 2: [930.0]})
    chosen = [_rollout(far, readings) for _ in range(12)]
    assert chosen[:11] == [0, 1, 2, *[1] * 7, 0], chosen


def test_the_contexts_first_rollout_is_judged_for_a_second_look_once_right_after_the_looks():
    """The quiet trained 2-layer 128-token cell on 2026-12-07, afternoon: k = 0's look (the
    context's first rollout) read 14% below k = 2's and was not looked at again; four rollouts
    later k = 2's estimate fell within 10% of it, and k = 0's second look ran then, in the last
    timed rollout, a refresh ahead of its time (k = 0 0.89x k = 2 there). Here k = 0 reads 850,
    k = 1 970 and k = 2 880, k = 1 runs and its later rollouts read 900, 880 and 890: k = 0 comes
    within 10% of it once 970 leaves k = 1's window (rollout 7), and runs only at its second look,
    REFRESH_EVERY rollouts after its first (rollout 11). Control: judged whenever it comes close,
    as from a5a261e until that afternoon (the simulation's ``OpeningLookedAtWhenClose``), k = 0
    runs at rollout 7."""
    profile = {0: 0.013, 1: 0.013, 2: 0.0135}  # the prior's order: k = 0, k = 1, k = 2 last

    def eleven_rollouts(tuner) -> list[int]:
        readings = _Readings({0: [850.0], 1: [970.0, 900.0, 880.0, 890.0], 2: [880.0]})
        return [_rollout(tuner, readings) for _ in range(11)]

    chosen = eleven_rollouts(_tuner(profile, _counts([100, 100], [90, 20])))
    assert chosen == [0, 1, 2, *[1] * 7, 0], chosen
    chosen = eleven_rollouts(_tuner(profile, _counts([100, 100], [90, 20]), rule=OpeningLookedAtWhenClose))
    assert chosen[:7] == [0, 1, 2, 1, 1, 1, 0], chosen


def test_an_incumbent_displaced_by_the_openings_second_look_is_looked_at_again_at_once():
    """The trained 2-layer 128-token cell beside a load, traced on 2026-12-07 (tokens/s; fixed
    engines' medians k = 0 3,477, k = 2 3,774): all three looks ran slow (k = 0 2,835, k = 1 2,913,
    k = 2 3,028, at 0.80-0.82 of those medians), k = 2 became the incumbent, and k = 0, the
    context's first rollout's k within REFRESH_WITHIN of it, ran its second look in a faster state
    (3,842) and displaced k = 2, whose one look is from the slow state: auto ran k = 0 in all five
    timed rollouts, 0.92 of k = 2. Now k = 2, displaced by that second look while looked at once,
    runs its own second look at once (rollout 5), reads 3,950 and is back. Controls: without that,
    k = 0 runs until k = 2's second look REFRESH_EVERY rollouts after its first; and where k = 2's
    second look confirms it behind (3,300), the look costs one rollout and k = 0 runs on."""
    profile = {0: 0.010, 1: 0.0168, 2: 0.0163}  # prior vs k = 0: 1.00, 1.13, 1.29
    readings = {0: [2835.0, 3842.0, 3500.0], 1: [2913.0], 2: [3028.0, 3950.0]}

    def ten_rollouts(tuner, readings: dict) -> list[int]:
        readings = _Readings({k: list(values) for k, values in readings.items()})
        return [_rollout(tuner, readings) for _ in range(10)]

    chosen = ten_rollouts(_tuner(profile, _counts([100, 100], [90, 20])), readings)
    assert chosen == [0, 1, 2, 0, 2, *[2] * 5], chosen
    chosen = ten_rollouts(_tuner(profile, _counts([100, 100], [90, 20]), rule=OpeningLookUnanswered), readings)
    assert chosen == [0, 1, 2, *[0] * 7], chosen
    chosen = ten_rollouts(_tuner(profile, _counts([100, 100], [90, 20])), readings | {2: [3028.0, 3300.0]})
    assert chosen == [0, 1, 2, 0, 2, *[0] * 5], chosen


def _rollouts_at_speeds(tokens_per_s: dict[int, float], speeds: list[float], probed: bool) -> list[int]:
    """Rollouts as ``_rollout``'s on a machine running at ``speeds[n]`` x its first rollout's speed
    in rollout n: a rollout realises that share of ``tokens_per_s[k]`` and, where ``probed``, the
    machine-speed probe slows as the rollouts do (to the power ``machine_speed.TRACKING``, as
    measured) from 1 ms. The k of each."""
    tuner = _tuner({0: 0.010, 1: 0.013, 2: 0.0155}, _counts([100, 100], [90, 20]))
    chosen = []
    for speed in speeds:
        choice = tuner.choose(32, False, 32)
        k = choice.num_speculative_tokens
        realised = tokens_per_s[k] * speed
        tuner.record_rollout(32, False, choice, 3200 / realised, 50, 3200, _counts_for(k, [0.9, 0.2]), 0.001 * speed ** (-1 / machine_speed.TRACKING) if probed else None)
        chosen.append(k)
    return chosen


def test_a_first_look_on_a_slowed_machine_is_read_at_the_machines_speed():
    """k = 2 is the fastest (1,100 tokens/s against k = 1's 1,000 and k = 0's 700), but the
    machine ran at 0.85x its speed during k = 2's first look (935/s). The probe, slowed alike,
    puts k = 2 at 1,100 and auto runs it from there on. Control: without the probe k = 2's look
    reads below k = 1 and auto keeps k = 1 (until k = 2's refresh, ten rollouts on)."""
    realised = {0: 700.0, 1: 1000.0, 2: 1100.0}
    speeds = [1.0, 0.85, 1.0, *[1.0] * 6]  # the first looks: k = 0, k = 2 (slowed), k = 1 (the prior's best)
    assert _rollouts_at_speeds(realised, speeds, probed=True) == [0, 2, 1, 2, 2, 2, 2, 2, 2]
    assert _rollouts_at_speeds(realised, speeds, probed=False) == [0, 2, 1, 1, 1, 1, 1, 1, 1]  # the control


def test_the_machine_speed_probe_costs_about_its_share_of_the_stepped_time():
    """400 steps of real work (a matrix product chain, about 1 ms each): the probes, run as a
    rollout's steps report in, take between half and twice ``PROBE_SHARE`` of the steps' CPU
    time (they are timed with it; the machine's drift moves probe and steps alike), and a reading
    taken after the first probe is a median of probes that ran. One torch thread, as a CPU run
    has and as the thread's clock assumes (with more, the thread's time counts its spinning while
    it waits for the others, which a busy machine stretches)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        probe = machine_speed.SpeedProbe(time.thread_time)
        matrix = torch.randn(128, 128, generator=torch.Generator().manual_seed(0)) / 128**0.5
        stepped = 0.0
        for _ in range(400):
            start = time.thread_time()
            product = matrix
            for _ in range(20):
                product = product @ matrix
            seconds = time.thread_time() - start
            stepped += seconds
            probe.after_step(seconds)
    finally:
        torch.set_num_threads(threads)
    share = sum(probe.samples) / stepped
    assert 0.5 * machine_speed.PROBE_SHARE <= share <= 2.0 * machine_speed.PROBE_SHARE, (share, probe.taken)
    assert min(probe.samples) <= probe.reading(probe.taken - 1) <= max(probe.samples)


def test_an_incumbent_within_the_hysteresis_is_kept():
    """k = 2 measured 0.5% faster than k = 1 does not displace it; 5% faster does."""
    tuner = _tuner({0: 0.010, 1: 0.013, 2: 0.0155}, _counts([100, 100], [90, 20]))
    chosen = [_rollout(tuner, {0: 500.0, 1: 1000.0, 2: 1005.0}) for _ in range(6)]
    assert chosen[3:] == [1, 1, 1], chosen
    chosen = [_rollout(tuner, {0: 500.0, 1: 1000.0, 2: 1050.0}) for _ in range(adaptive_speculation.REFRESH_EVERY + 2)]
    assert chosen[-1] == 2, chosen


def test_a_k_left_behind_returns_when_the_forecast_raises_its_acceptance():
    """k = 2 measured at 800/s against k = 1's 1,000 while the second draft was accepted 20% of
    the time (2.1 tokens per request-step); the trainer then forecasts 95% per depth: k = 2's
    estimate scales by (1 + 0.95 + 0.9025) / 2.1 to 1,087/s and it is run again."""
    tuner = _tuner({0: 0.010, 1: 0.013, 2: 0.0155}, _counts([100, 100], [90, 20]))
    tuner.observe_forecast([0.9, 0.2 / 0.9])
    chosen = [_rollout(tuner, {0: 500.0, 1: 1000.0, 2: 800.0}) for _ in range(5)]
    assert chosen[3:] == [1, 1], chosen
    tuner.observe_forecast([0.95, 0.95])
    estimates = tuner.estimates(32, False, 32)
    assert estimates[2] == pytest.approx(800.0 * (1 + 0.95 + 0.95**2) / 2.1, rel=0.01)
    assert tuner.choose(32, False, 32).num_speculative_tokens == 2


def _seeded_run(true: dict[int, float], max_k: int, profile_error: float, switch: float = 0.0, told: bool = True) -> float:
    """150 rollouts of 3200 tokens realising ``true[k]`` tokens/s with 5% log-normal noise (seeded),
    a change of k costing ``switch`` of the fastest k's rollout (recorded with the tuner when
    ``told``); the profile misjudges the speculative steps' cost by ``profile_error``. Returns
    total tokens over total seconds, switches included, against the best fixed k's tokens/s."""
    generator = torch.Generator().manual_seed(1234 + max_k)
    tuner = AdaptiveSpeculation(max_k)
    profile = {0: 0.010, 1: 0.0135 * profile_error, 2: 0.017 * profile_error}
    tuner.record_profile(32, {k: profile[k] for k in tuner.candidates}, False, _counts([100, 100], [90, 20]))
    seconds, previous = 0.0, None
    for _ in range(150):
        choice = tuner.choose(32, False, 32)
        k = choice.num_speculative_tokens
        if previous is not None and k != previous:
            seconds += switch * 3200 / max(true.values())
            if told:
                tuner.record_switch(switch * 3200 / max(true.values()))
        previous = k
        realised = true[k] * math.exp(0.05 * float(torch.randn(1, generator=generator)))
        seconds += 3200 / realised
        tuner.record_rollout(32, False, choice, 3200 / realised, 50, 3200, _counts_for(k, [0.9, 0.2]))
    return 150 * 3200 / seconds / max(true.values())


@pytest.mark.parametrize("max_k", [1, 2])
@pytest.mark.parametrize("profile_error", [0.6, 1.0, 1.6])
def test_over_a_run_auto_realises_at_least_97_percent_of_the_best_fixed_k(max_k, profile_error):
    """k = 1 the best by 4%, the others 0.96x and 0.7x: at least 0.97 of the best k's tokens/s,
    the issue's goal. Control: always running the second best falls short of it by construction
    (0.96)."""
    true = {0: 960.0, 1: 1000.0, 2: 700.0}
    ratio = _seeded_run(true, max_k, profile_error)
    assert ratio >= 0.97, ratio
    assert true[0] / true[1] < 0.97  # the control


@pytest.mark.parametrize("profile_error", [0.6, 1.0, 1.6])
def test_auto_counts_the_engine_rebuilds_its_refreshes_cost(profile_error):
    """k = 0, 1 and 2 within 3% of each other, and a change of k costs 12% of a rollout (the
    default recipe's on this CPU: an engine rebuilt in about 6 ms, against rollouts of about 50):
    re-measuring a close k every REFRESH_EVERY rollouts there and back would cost 2.4% a k. auto,
    told what its switches cost, re-measures less often and realises at least 0.97 of the best k's
    tokens/s, switches counted. Control: the same run with the switches' cost not told to it falls
    short of 0.97."""
    true = {0: 1000.0, 1: 990.0, 2: 970.0}
    told = _seeded_run(true, 2, profile_error, switch=0.12)
    not_told = _seeded_run(true, 2, profile_error, switch=0.12, told=False)
    assert told >= 0.97, (told, not_told)
    assert not_told < 0.97, (told, not_told)  # the control


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
    # the profile's engine changes (k = 0 -> 1 -> 2 -> 0, three rounds) were timed
    assert len(engine.adaptive.switch_seconds) == adaptive_speculation.WINDOW and min(engine.adaptive.switch_seconds) > 0


@requires_speculation
@pytest.mark.usefixtures("megatron_world")
def test_the_profile_times_every_k_and_reads_a_first_acceptance_at_every_depth():
    """The profile alone (no rollout yet): a step cost for k = 0, 1 and 2, in rounds that never
    run one k twice in a row, and a first acceptance for both draft depths, so the prior can
    weigh k = 2 before any rollout has drafted (read from k = 0's run, it had none: the prior put
    trained heads' k = 2 at 0.37x k = 0 and auto never looked at it)."""
    policy, cfg = make_policy(**engine_overrides("auto", 2))
    engine = RolloutEngine(policy, cfg)
    order = adaptive_speculation.profile_order([0, 1, 2])
    assert sorted(order) == sorted([0, 1, 2] * adaptive_speculation.PROFILE_PASSES)
    assert all(first != second for first, second in zip(order, order[1:]))
    with engine.sampling_session():
        params = engine.sampling_params(TOKENIZER.eos_id)
        adaptive_speculation.profile(engine, PROMPTS, params, batch_bucket(len(PROMPTS)), greedy=False)
    assert engine.adaptive.profiled[batch_bucket(len(PROMPTS))].keys() == {0, 1, 2}
    assert set(engine.adaptive.measured[False]) == {1, 2}, engine.adaptive.measured


@requires_speculation
@pytest.mark.usefixtures("megatron_world")
def test_the_profile_runs_a_short_rollout_whole_as_a_rollout_runs():
    """Rollouts of at most PROFILE_DECODE_STEPS + 1 new tokens are profiled whole (their prefill
    and last steps are most of them): the profile's run at k = 1 generates, greedily, the tokens
    the engine's own rollout of the same prompts does, counted through each response's end, with
    the same drafts proposed and accepted, and its whole seconds cover its fastest step's."""
    new_tokens = adaptive_speculation.PROFILE_DECODE_STEPS + 1
    policy, cfg = make_policy(**engine_overrides(1, 1, generation__top_k=1, generation__max_new_tokens=new_tokens))
    engine = RolloutEngine(policy, cfg)
    rollouts = generate(engine)
    with engine.sampling_session():
        run = adaptive_speculation.profile_run(engine, PROMPTS, engine.sampling_params(TOKENIZER.eos_id, greedy=True), whole=True)
    assert run.tokens == int((rollouts["lengths"] - rollouts["prompt_lengths"]).sum())
    assert run.counts["draft_proposed"].tolist() == rollouts["draft_proposed"].tolist()
    assert run.counts["draft_accepted"].tolist() == rollouts["draft_accepted"].tolist()
    assert run.whole_seconds > run.fastest_step > 0


@requires_speculation
@pytest.mark.usefixtures("megatron_world")
def test_auto_does_not_speculate_with_drafts_the_policy_rarely_accepts():
    """Untrained heads verified by equality at temperature 1 over 14 tokens: about sum_x p q, under
    15% accepted, far below what a speculative step costs. The profile's choice is k = 0, the
    last of the first looks; k = 1 and k = 2 run once each to look before it, and k = 0 is kept
    from there on. One exception the rule makes on purpose: the first look's k (the opening) runs
    once more right after the looks where its look came within ``REFRESH_WITHIN`` of k = 0's
    (a context's first rollout runs slow, module docstring "Second looks"); on a loaded machine
    it can (in CI on 2026-12-07 the looks ran 1, 2, 0 and k = 1 looked again), so that one
    rollout may draft, and every later one must not."""
    policy, cfg = make_policy(**engine_overrides("auto", 2, generation__spec_verification="exact_match"))
    engine = RolloutEngine(policy, cfg)
    chosen = [int(generate(engine, PROMPTS * 2, seed=seed)["speculative_tokens"]) for seed in range(6)]
    looks, after = chosen[:3], chosen[3:]
    context = (chosen, engine.adaptive.acceptance(greedy=False))
    assert sorted(looks[:2]) == [1, 2] and looks[2] == 0, context
    assert after[0] in (0, looks[0]) and after[1:] == [0, 0], context


@requires_speculation
@pytest.mark.usefixtures("megatron_world")
def test_the_trainers_forecast_reaches_the_next_choice():
    """Step costs fixed by hand (a speculative step at 1.2x a plain one): with the forecast of
    trained heads (1.97 tokens per 12 ms against 1 per 10) the prior's best is k = 1, which the
    first looks run last, after k = 0, and the engine stays rebuilt for drafts; with that of poor
    heads (1.05 per 12 ms) k = 1 is looked at first and k = 0 is last."""
    for forecast, expected_k in ((97.0, 1), (5.0, 0)):
        policy, cfg = make_policy(**engine_overrides("auto", 1))
        engine = RolloutEngine(policy, cfg)
        engine.adaptive.record_profile(batch_bucket(len(PROMPTS)), {0: 0.010, 1: 0.012}, greedy=False, counts=COUNTS_NONE)
        engine.observe_training_metrics({"mtp/mtp_1_expected_acceptance": forecast})
        chosen = [int(generate(engine)["speculative_tokens"]) for _ in range(2)]
        assert chosen == [1 - expected_k, expected_k] and engine.num_speculative_tokens == expected_k, chosen


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


@pytest.mark.usefixtures("megatron_world")
def test_on_a_gpu_the_cost_model_knows_its_ratios_replace_the_profile_of_drafting_steps():
    """The live model's config on an H200 name: k = 0 costs 1 and each draft more (a step verifies
    more tokens and runs one more MTP pass); a GPU the model has no figures for, or none, profiles
    every k."""
    policy, cfg = make_policy(**engine_overrides("auto", 2))
    model = policy.model.module
    ratios = adaptive_speculation.gpu_step_cost_ratios(model.config, model.vocab_size, "NVIDIA H200", 32, 512, 2)
    assert list(ratios) == [0, 1, 2] and ratios[0] == 1.0 and 1.0 < ratios[1] < ratios[2]
    for device_name in ("NVIDIA A10G", None):
        assert adaptive_speculation.gpu_step_cost_ratios(model.config, model.vocab_size, device_name, 32, 512, 2) is None


@requires_speculation
@pytest.mark.usefixtures("megatron_world")
def test_a_rebuilt_engine_frees_the_one_it_replaces_without_a_collection():
    """auto rebuilds the engine when k changes. megatron's engine, controller and context refer to
    each other, so a dropped engine (its KV buffer) lingered until a garbage collection: measured,
    every rebuild kept one more alive. Here collection is off throughout: each replaced engine
    must be gone the moment it is replaced. Control: an engine built and dropped without the
    teardown survives exactly where the teardown's probe finds a cycle."""
    policy, cfg = make_policy(**engine_overrides("auto", 1))
    engine = RolloutEngine(policy, cfg)
    gc.collect()
    gc.disable()
    try:
        for k in (1, 0, 1, 0):
            replaced = weakref.ref(engine.engine)
            engine.use_speculative_tokens(k)
            assert replaced() is None, f"the engine replaced by k={k} is still alive"
        orphan = build_engine(policy.model.module, cfg, 1)
        has_cycle = engine_teardown.refers_back_to(orphan, [orphan.controller, orphan.context])
        orphan = weakref.ref(orphan)
        assert (orphan() is not None) == has_cycle, "the probe and reference counting disagree on whether an engine frees itself"
    finally:
        gc.enable()
        gc.collect()


def test_the_teardown_probe_finds_a_way_back_and_only_a_real_one():
    """The probe against objects whose references are known: a cycle through a bound method
    three references deep is found; the same objects without the back reference, and a cycle
    deeper than the probe looks, are not."""

    class Part:
        def callback(self):
            return None

    engine, controller, context = Part(), Part(), Part()
    engine.controller, engine.context = controller, context
    controller.callbacks = {"stop": None}
    context.buffer = [1, 2]
    assert not engine_teardown.refers_back_to(engine, [controller, context])
    controller.callbacks["stop"] = engine.callback  # controller -> dict -> dict -> method -> engine
    assert engine_teardown.refers_back_to(engine, [controller, context])
    deep = engine
    for _ in range(engine_teardown.PROBE_DEPTH + 2):
        deep = [deep]
    controller.callbacks["stop"] = deep
    assert not engine_teardown.refers_back_to(engine, [controller, context])
