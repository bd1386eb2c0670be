"""``policy.generation.num_speculative_tokens: auto``: the number of drafts per step, chosen before
each rollout so that rollouts are never slower than without speculation by more than the error of
their own measurements.

The rule is a bandit over k = 0 .. max_k whose reward is the rollout's realised tokens per second
(tokens generated / the clock's seconds for the rollout), kept per batch size (rounded to a power
of two) and per greedy/sampled (they accept differently):

- **Prior.** Before the first rollout of a batch size every candidate k runs the rollout's own
  prompts for a few decode steps, in three rounds over the candidates, and keeps its fastest
  step c_k (on an H100 or H200 only k = 0 runs, and c_k / c_0 comes from the decode-step cost model,
  :mod:`step_cost_model`, at the rollout's batch and mid-rollout context; a rollout short enough
  to end within those steps runs whole, and c_k is its seconds per request-step: :func:`profile`). A
  step at k yields 1 + sum_{i <= k} rho_i tokens per request (rho_i: draft i accepted, with every
  draft before it), so the prior expects R (1 + sum rho_i) / c_k tokens/s, R the requests a step
  serves. rho_i is the latest rollout's measurement while no training step came after it, else
  the trainer's forecast (``mtp_{d}_expected_acceptance``, chained), else the latest measurement.
- **Estimates.** A k measured in this context is estimated by the fastest of its last
  ``WINDOW`` realised tokens/s, each scaled by how its acceptance moved since (1 + sum rho_i now,
  over the tokens per request-step that rollout realised: the heads train between rollouts;
  costs per step are taken as they were measured). The fastest, as the profile keeps a k's
  fastest step: another job on the machine only ever slows a rollout, and where it slowed two of
  three a median took them for the k's speed. A k not measured yet is estimated by its prior in
  proportion to the latest measured k's (the profile's short sequences set the ratios, the
  rollouts the scale).
- **Choice.** A context's first rollouts are its first looks: every candidate k runs once (the
  profile can be wrong by tens of percent: in the default recipe it chose k = 1 where k = 0 was
  1.2x faster, and beside another job one profile read k = 1's step at 2.94x k = 0's where
  the same work read 1.90x, putting k = 1, 1.09x k = 0 in rollouts, at 0.68x; until late on
  2026-12-06 only the k the prior put within 70% of its best were looked at, and that k = 1
  never ran: a k never measured is outside the bound below). The prior's best runs last (a drafting k is
  the best only where it beats k = 0 by ``MIN_GAIN``) and is the incumbent, the others before it
  from the least promising up: where the prior was right, the rollouts after the looks go on
  with the last look's k, without a change of k (until 2026-12-06 the prior's best ran first,
  and the rollout after the looks changed k back to it), and the incumbent's look is the
  latest, in the state of the machine nearest the decision. Then the best estimate is run, the
  incumbent kept unless another beats it by ``HYSTERESIS``. Re-measuring another k (a refresh) costs its gap to
  the incumbent plus two changes of k, each a rebuild of the engine (timed, as a fraction of the
  latest rollout: about 12% in the default recipe on a CPU, next to nothing against a GPU's
  rollouts). A k whose refresh costs at most ``REFRESH_WITHIN`` of a rollout and that was last
  measured ``REFRESH_EVERY`` or more rollouts ago is run once (the longest unmeasured first); a
  costlier one after proportionally more rollouts (``refresh_interval``: a gap of 30% with free
  switches waits 60), so its refreshes cost on average ``FAR_REFRESH_COST`` of a rollout and no
  estimate stays stale for a whole run.
- **Rechecks.** The prior's best, where the estimates put another k ahead of it (the prior by
  more than ``HYSTERESIS`` behind it), run fewer than ``WINDOW`` times in this context and
  estimated ``RECHECK_BELOW`` or more below what the prior implies for it from every other
  measured k (that k's estimate times the prior's ratio of the two), runs again at once, until
  it has run ``WINDOW`` times or its estimate stops contradicting the prior that far (the
  profile's error on this CPU: 2-15%). A look out of line with every other look is the look's
  error; where one other look agrees with it, the profile erred about the k that disagree (on
  2026-12-07 it misread k = 0's step in two of seven profiles of one cell, by 30-60%, putting
  k = 2 at 1.3-1.5x k = 0 where rollouts ran it at 0.90-0.93x; against k = 0 alone, k = 2's
  look was "20% below" and k = 2 ran two more rollouts, where k = 1's look agreed with it).
  The profile times every k in rounds, each k's passes beside the others' in one state of the
  machine; a look is one rollout at one time. In the default recipe's 70 ms rollouts the same
  work ran 75 or 135 ms in spells of about ten (2026-12-06), and in three default runs that day
  k = 0's one look read 0.5-0.7x its later rollouts: auto ran k = 1, 1.2x slower, for 9-41
  rollouts, until k = 0's second look or refresh. A recheck costs the prior's best's true gap to
  the best k (nothing where the prior was right), at most ``WINDOW`` - 1 rollouts per context.
- **Second looks.** k = 0 and the prior's best, if auto has moved on from either and it has run
  only its first look, run once more ``REFRESH_EVERY`` rollouts after it; the k of the context's
  first rollout (the least promising by the prior), in the same case and estimated within
  ``REFRESH_WITHIN`` of the incumbent (a k refreshed every ``REFRESH_EVERY`` rollouts anyway),
  right after the first looks (and rechecks). A context's first rollout runs in a state the
  others do not: in the rollout benchmark's cells on 2026-12-07 it read 10-20% below the fixed
  engine's median (auto's machine-speed reading, against which later rollouts are read, rose
  3-10% after it), and there k = 0's one look, the first, put it behind k = 1 and 2 where it was
  4-10% ahead. In a seeded simulation (``benchmarks.auto_k_noise_simulation``, the first
  rollout 10% slow) this look costs nothing over a run and within 0.4% in rollouts 4-8; at
  ``RECHECK_BELOW`` it cost up to 1.6% there where the first look's k was truly 5-15% behind.
  Where that second look displaces the incumbent and the incumbent was looked at once, the
  incumbent is looked at again at once, like with like: in a loaded cell on 2026-12-07 all three
  looks ran at 0.80-0.82 of the fixed engines' medians, k = 0's second look ran in a faster state
  (1.10x its engine's median) and displaced k = 2, 8% faster, for the rest of the cell. In the
  simulation with the first three rollouts 20% slow this gains 0.5-1.6% in rollouts 4-8 (and
  lifts their 10th percentile from 0.86 to 0.95 where k = 2 leads k = 1 by 5%); with the first
  rollout alone slow it moves nothing by more than 0.1%, with the profile misreading k = 0 it
  costs up to 0.4% (the answer is a rollout of the displaced k).
  The first looks come at the start of a run, where on a CPU the process is still warming up (in 3 of 6 default runs
  on 2026-12-06 rollouts 2-6 ran at 0.45-0.7x their later speed): in 2 of those 6 runs k = 0's
  one look landed there and auto ran k = 1, 1.2x slower, for 45 and 70 rollouts until k = 0's
  refresh (its gap plus two rebuilds, at ``FAR_REFRESH_COST``). k = 0 is what auto must never
  lose to, and the prior's best what the profile expects to be fastest; the looks at other k are
  what the bound's refreshes keep fresh. A second look costs its gap and two switches, once.
- **Confirmation.** A switch away from the incumbent made as the incumbent's latest rollout
  lowered its estimate (its window's fastest left the window) is confirmed by the new k's first
  rollout after it: if that rollout is slower than the k left behind is estimated, the new k's
  earlier rollouts are set aside (its estimate is that rollout alone) and the estimates decide
  again. That is a slow spell's signature: on this project's 2-core VM a spell of a few
  rollouts, which the machine-speed probe hardly sees, can take all of the incumbent's window
  while the other k's estimate rests on a look from before it (in a default run, k = 0's three
  slowed rollouts put auto on k = 1, 1.2x slower, for 25 rollouts until k = 0's refresh). The
  new k's first rollout runs in the same state of the machine as the incumbent's latest ones:
  slower than them, the switch rested on another state. A switch made on a new measurement of
  the other k (a look, a refresh) is not second-guessed by one rollout: until 2026-12-07 every
  switch was, and in a near tie (rollouts of one k 5-12% apart) one rollout reversed a right
  switch to k = 0 and left auto on k = 1, 0.96x, for the rest of a 2048-token cell.

**The bound.** After the first looks, a rollout runs either the best estimate (or an incumbent
within ``HYSTERESIS`` of it) or a refresh of a k whose cost (gap and switches), over the
rollouts since that k last ran, is at most REFRESH_WITHIN / REFRESH_EVERY (``FAR_REFRESH_COST``
is less). So over a run, tokens/s is at least (1 - HYSTERESIS) (1 - max_k REFRESH_WITHIN /
REFRESH_EVERY) of the best k's, less the error of the estimates themselves (one rollout's
tokens/s against its repeat; the fastest of ``WINDOW`` leaves out the slowed ones): 0.99 x 0.99
= 0.98 at max_k = 1, 0.99 x 0.98 = 0.97 at max_k = 2. The first looks cost each k one rollout
per context (k = 0, the prior's best, the context's first rollout's k and an incumbent that
k's second look displaced at most two), once per run, and rechecks at most
``WINDOW`` - 1 more of the prior's best; a switch the estimates call for costs one rebuild. A confirmation runs
nothing of its own; where it sets aside a faster k's rollouts wrongly (its first rollout after the
switch unlucky), that k is estimated from the unlucky rollout until it runs again: an error of
one rollout's measurement, which the bound leaves out as it does any other.

The choice and the numbers behind it (the estimate it was chosen on; afterwards the realised
tokens/s) are returned with the rollout and logged as ``rollout/num_speculative_tokens``,
``rollout/expected_tokens_per_s`` and ``rollout/engine_tokens_per_s``.

Times are wall-clock on a GPU (where the device's work is what a step waits for) and CPU time
without one: on a CPU the engine's work is the process's own, and other jobs on a shared machine
would otherwise add their load to whichever k happened to be measured while they ran. With one
torch thread (a CPU run's default) it is the CPU time of the thread that runs the engine: the
process's other threads (Ray's, the loggers') add about 2% to a rollout of the default recipe,
and more the longer a busy machine stretches its wall time (6-27% in rollouts stretched 3-20-fold),
which made such rollouts of one k look slower than they ran. The CPU's own speed drifts too (on
this project's 2-core VM the same rollout took 4.4-6.9 s of CPU time within minutes), and auto
measures one k at a time: so on a CPU each rollout's tokens/s is taken at the machine's speed
during the tuner's first rollout, divided by its speed during this one as a fixed probe timed
beside the steps reads it, conservatively (:mod:`machine_speed`: rollouts of the same work that
spread 13-17% as measured spread 7-11% so read), and a choice's expected tokens/s is given at the
latest rollout's speed.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import math
import statistics
import time

import torch

from nemo_rl_mtp.metrics import (
    DECODE_STEPS,
    DRAFT_ACCEPTED_COUNTS,
    DRAFT_PROPOSED_COUNTS,
    ENGINE_TOKENS_PER_S,
    EXPECTED_TOKENS_PER_S,
    LENGTHS,
    MTP,
    MTP_EXPECTED_ACCEPTANCE,
    PROMPT_LENGTHS,
    SPECULATIVE_TOKENS,
)
from nemo_rl_mtp.rollout import machine_speed, step_cost_model

logger = logging.getLogger(__name__)

# Decode steps each candidate k runs in each of the profile's passes (after its prefill step).
PROFILE_DECODE_STEPS = 6
# The profile's rounds over the candidates (:func:`profile_order`).
PROFILE_PASSES = 3
# A measured acceptance needs at least this many proposals to be trusted.
MIN_PROPOSALS = 8
# The first rollout speculates only where the prior expects it to beat k = 0 by this factor.
MIN_GAIN = 1.03
# The incumbent k is kept unless another is estimated faster by more than this fraction.
HYSTERESIS = 0.01
# The prior's best, where another k is estimated ahead of it, run fewer than WINDOW times here and
# estimated this fraction or more below what the prior implies for it, runs again at once.
RECHECK_BELOW = 0.2
# A k estimated at least (1 - REFRESH_WITHIN) of the incumbent is re-measured every REFRESH_EVERY
# rollouts of its context.
REFRESH_WITHIN = 0.10
REFRESH_EVERY = 10
# A k farther below is re-measured after gap / FAR_REFRESH_COST rollouts: on average its refreshes
# cost this fraction of a rollout (half what a close k's may).
FAR_REFRESH_COST = 0.005
# Realised tokens/s of a k: the fastest of its latest WINDOW rollouts.
WINDOW = 3


@dataclasses.dataclass
class Choice:
    """The drafts per step for the next rollout and the tokens/s expected from them."""

    num_speculative_tokens: int
    expected_tokens_per_s: float


@dataclasses.dataclass
class Observation:
    """One rollout at some k: its number within its context, its realised tokens/s and tokens per
    request-step (1 + its accepted drafts per request-step)."""

    number: int
    tokens_per_s: float
    tokens_per_request_step: float


@dataclasses.dataclass
class ContextState:
    """What auto has measured for one (batch size bucket, greedy) context."""

    rollouts: int = 0
    incumbent: int = 0  # the k chosen on its estimate (set by the first rollout)
    observations: dict[int, collections.deque] = dataclasses.field(default_factory=dict)
    requests_per_step: float | None = None
    rollout_seconds: float | None = None  # the latest rollout's
    first_looks: list[int] | None = None  # the k still to run once, in order (set at the first choice)
    unconfirmed: tuple[int, int] | None = None  # (the k left behind, the k switched to) until the latter's next rollout
    priors_best: int = 0  # the k the prior put first (the first looks' last)
    second_looks: set[int] = dataclasses.field(default_factory=set)  # the k whose first look has been repeated
    opening: int | None = None  # the k of the context's first rollout (the first looks' first) until judged for a second look
    lowered: int | None = None  # the k whose estimate the latest rollout lowered (its window's fastest left it)
    answering: int | None = None  # the incumbent as the opening's second look ran: looked at again if that look displaced it
    runs: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # rollouts of each k here, set aside or not

    def since_measured(self, k: int) -> float:
        """Rollouts of this context since k's latest (infinite if k never ran here)."""
        return self.rollouts - self.observations[k][-1].number if k in self.observations else math.inf


def refresh_interval(relative: float, switch_cost: float = 0.0) -> float:
    """Rollouts between re-measurements of a k estimated at ``relative`` x the chosen k's tokens/s,
    when changing k costs ``switch_cost`` of a rollout (the engine is rebuilt, there and back).
    A refresh costs its gap plus two switches: ``REFRESH_EVERY`` when that is within
    ``REFRESH_WITHIN``, and beyond in proportion, so that its refreshes cost on average
    ``FAR_REFRESH_COST`` of a rollout, however far the k is estimated (a gap of 30%, switches
    free: 60 rollouts). Every k is re-measured in time: an estimate left low by a few unlucky
    rollouts (k = 0's above all) cannot keep auto on a slower k for the rest of a run."""
    gap = 1.0 - relative
    if gap >= 1.0:
        return math.inf
    cost = max(gap, 0.0) + 2.0 * switch_cost
    if cost <= REFRESH_WITHIN:
        return REFRESH_EVERY
    return math.ceil(round(cost / FAR_REFRESH_COST, 6))  # rounded: 0.3 / 0.005 is 59.99999999999999


def batch_bucket(num_requests: int) -> int:
    """Step costs are kept per batch size, rounded up to a power of two."""
    return 1 << max(num_requests - 1, 0).bit_length()


def acceptance_rates(proposed: torch.Tensor, accepted: torch.Tensor) -> dict[int, float]:
    """Per draft position i (1-based) with enough proposals, accepted / proposed."""
    return {
        position: float(num_accepted) / float(num_proposed)
        for position, (num_proposed, num_accepted) in enumerate(zip(proposed.tolist(), accepted.tolist()), start=1)
        if num_proposed >= MIN_PROPOSALS
    }


class AdaptiveSpeculation:
    """What auto knows and how it chooses (module docstring). ``max_k``: the most drafts the
    model allows."""

    def __init__(self, max_k: int):
        self.max_k = max_k
        self.measured: dict[bool, dict[int, float]] = {False: {}, True: {}}
        self.measured_since_training: dict[bool, set[int]] = {False: set(), True: set()}
        self.forecast: list[float] | None = None
        self.profiled: dict[int, dict[int, float]] = {}
        self.contexts: dict[tuple[int, bool], ContextState] = {}
        self.switch_seconds: collections.deque = collections.deque(maxlen=WINDOW)
        # The machine's speed (module docstring, "Times"): the first rollout's probe seconds, and
        # the latest rollout's speed relative to them.
        self.reference_probe_seconds: float | None = None
        self.speed = 1.0

    def record_switch(self, seconds: float) -> None:
        """How long one change of k took (the engine torn down and rebuilt)."""
        self.switch_seconds.append(seconds)

    def switch_cost(self, state: ContextState) -> float:
        """A change of k in rollouts of this context: the median of the latest switches' seconds
        over the latest rollout's (0 before either is measured)."""
        if not self.switch_seconds or not state.rollout_seconds:
            return 0.0
        return statistics.median(self.switch_seconds) / state.rollout_seconds

    @property
    def candidates(self) -> range:
        return range(self.max_k + 1)

    def needs_profile(self, bucket: int) -> bool:
        return bucket not in self.profiled

    def record_profile(self, bucket: int, seconds_per_step: dict[int, float], greedy: bool, counts: dict) -> None:
        """Decode-step times of every candidate on this batch size; the counts of the deepest
        candidate are a first, rough acceptance."""
        self.profiled[bucket] = dict(seconds_per_step)
        for position, rate in acceptance_rates(counts[DRAFT_PROPOSED_COUNTS], counts[DRAFT_ACCEPTED_COUNTS]).items():
            self.measured[greedy].setdefault(position, rate)

    def observe_forecast(self, per_depth_overlap: list[float]) -> None:
        """A training step's forecast (per MTP depth, the expected acceptance in [0, 1]); the
        heads changed, so earlier rollouts' acceptance is no longer current."""
        self.forecast = list(per_depth_overlap)
        for current in self.measured_since_training.values():
            current.clear()

    def acceptance(self, greedy: bool) -> list[float]:
        """rho_1 .. rho_max_k (module docstring for the order of sources)."""
        measured, current = self.measured[greedy], self.measured_since_training[greedy]
        rates = []
        for position in range(1, self.max_k + 1):
            if position in current:
                rates.append(measured[position])
            elif self.forecast is not None and position <= len(self.forecast):
                rates.append(math.prod(self.forecast[:position]))
            else:
                rates.append(measured.get(position, 0.0))
        return rates

    def tokens_per_request_step(self, greedy: bool) -> dict[int, float]:
        """1 + sum_{i <= k} rho_i for every candidate k."""
        rates = self.acceptance(greedy)
        return {k: 1.0 + sum(rates[:k]) for k in self.candidates}

    def context(self, bucket: int, greedy: bool) -> ContextState:
        return self.contexts.setdefault((bucket, greedy), ContextState())

    def prior(self, bucket: int, greedy: bool, num_requests: int) -> dict[int, float]:
        """The profile's expected tokens/s of every candidate: R (1 + sum rho_i) / c_k."""
        requests = self.context(bucket, greedy).requests_per_step or float(num_requests)
        tokens = self.tokens_per_request_step(greedy)
        return {k: requests * tokens[k] / self.profiled[bucket][k] for k in self.candidates}

    def estimates(self, bucket: int, greedy: bool, num_requests: int) -> dict[int, float]:
        """Tokens/s of every candidate: measured ones from their realised rollouts scaled by the
        acceptance's move since, the others from the prior scaled to the latest measured k."""
        state, tokens = self.context(bucket, greedy), self.tokens_per_request_step(greedy)
        measured = {k: max(_at_acceptance(obs, tokens[k]) for obs in observations) for k, observations in state.observations.items()}
        prior = self.prior(bucket, greedy, num_requests)
        if not measured:
            return prior
        latest = min(measured, key=state.since_measured)
        scale = measured[latest] / prior[latest]
        return {k: measured[k] if k in measured else prior[k] * scale for k in self.candidates}

    def choose(self, bucket: int, greedy: bool, num_requests: int) -> Choice:
        """The k for the next rollout of this context (module docstring)."""
        state = self.context(bucket, greedy)
        expected = self.estimates(bucket, greedy, num_requests)
        if state.first_looks is None:
            state.first_looks = self._first_looks(expected)
            state.incumbent = state.priors_best = state.first_looks[-1]
            state.opening = state.first_looks[0]
        k = self._next_choice(state, expected, self.prior(bucket, greedy, num_requests))
        return Choice(k, expected[k] * self.speed)

    def _first_looks(self, expected: dict[int, float]) -> list[int]:
        """The k a new context runs once each, in this order (module docstring, "Choice"): every
        candidate, the prior's best last (a drafting k only where it beats k = 0 by
        ``MIN_GAIN``), the others before it from the least promising up."""
        best = max(self.candidates, key=lambda k: (expected[k], -k))
        if expected[best] < MIN_GAIN * expected[0]:
            best = 0
        others = [k for k in self.candidates if k != best]
        return [*sorted(others, key=lambda k: (expected[k], -k)), best]

    def _next_choice(self, state: ContextState, expected: dict[int, float], prior: dict[int, float]) -> int:
        if state.first_looks:
            return state.first_looks[0]
        best = self._settle_incumbent(state, expected)
        if self._recheck_due(state, expected, prior, best):
            return state.priors_best
        second_looks = self._second_looks_due(state, expected)
        # Both judged once: the opening right after the first looks and rechecks, the answer right after the opening's second look.
        opening, state.opening, state.answering = state.opening, None, None
        if second_looks:
            k = second_looks[0]
            state.second_looks.add(k)
            if k == opening:
                state.answering = state.incumbent
            return k
        switch_cost = self.switch_cost(state)
        due = [k for k in self.candidates if k != best and self._refresh_due(state, k, expected[k] / expected[best], switch_cost)]
        return max(due, key=state.since_measured) if due else best

    @staticmethod
    def _refresh_due(state: ContextState, k: int, relative: float, switch_cost: float) -> bool:
        """Whether k, estimated at ``relative`` x the chosen k, is due a rollout: after its
        ``refresh_interval`` (every k has run here: the first looks run each once)."""
        return state.since_measured(k) + 1 >= refresh_interval(relative, switch_cost)

    def _settle_incumbent(self, state: ContextState, expected: dict[int, float]) -> int:
        """The k with the best estimate, the incumbent kept unless beaten by ``HYSTERESIS``; a new
        incumbent awaits its confirmation (module docstring). Calling it again changes nothing."""
        best = max(self.candidates, key=lambda k: (expected[k], -k))
        if expected[state.incumbent] * (1.0 + HYSTERESIS) >= expected[best]:
            best = state.incumbent
        if best != state.incumbent and state.lowered == state.incumbent:
            state.unconfirmed = (state.incumbent, best)
        state.incumbent = best
        return best

    @staticmethod
    def _recheck_due(state: ContextState, expected: dict[int, float], prior: dict[int, float], best: int) -> bool:
        """Whether the prior's best is due a recheck (module docstring, "Rechecks"): not the best
        estimate, put ahead of it by the prior (by more than ``HYSTERESIS``), run here fewer
        than ``WINDOW`` times, and estimated ``RECHECK_BELOW`` or more below what the prior implies
        for it from ``best`` and every other measured k (that k's estimate times the prior's ratio
        of the two): a look out of line with all the others is the look's error; where another
        k's look agrees with it, the prior erred."""
        k = state.priors_best
        implied = min(expected[other] * prior[k] / prior[other] for other in {best, *state.observations} - {k})
        return (
            k != best and 0 < state.runs[k] < WINDOW and prior[k] > (1.0 + HYSTERESIS) * prior[best]
            and expected[k] < (1.0 - RECHECK_BELOW) * implied
        )  # fmt: skip

    @staticmethod
    def _second_looks_due(state: ContextState, expected: dict[int, float]) -> list[int]:
        """The k due a second look (module docstring, "Second looks"), each not the incumbent and
        run only for its first look: the incumbent that the opening's second look (the latest
        rollout) displaced, at once; the context's first rollout's k right after the first looks
        and rechecks where it is estimated within ``REFRESH_WITHIN`` of the incumbent then; k = 0
        and the prior's best ``REFRESH_EVERY`` rollouts after their look."""
        def once(k: int) -> bool:
            return k not in state.second_looks and k != state.incumbent and len(state.observations.get(k, ())) == 1

        if state.answering is not None and once(state.answering):
            return [state.answering]
        opening = state.opening
        if opening is not None and once(opening) and expected[opening] >= (1.0 - REFRESH_WITHIN) * expected[state.incumbent]:
            return [opening]
        return [k for k in sorted({0, state.priors_best}) if once(k) and state.since_measured(k) + 1 >= REFRESH_EVERY]

    def record_rollout(
        self, bucket: int, greedy: bool, choice: Choice, seconds: float, steps: int, tokens: int, counts: dict, probe_seconds: float | None = None
    ) -> None:
        """A finished rollout: its realised tokens/s (at the first rollout's machine speed, where
        ``probe_seconds``, the machine-speed probe's, are given), its requests per step, its
        acceptance; a first look done (:meth:`_first_looks`) leaves the list."""
        if probe_seconds is not None:
            self.reference_probe_seconds = self.reference_probe_seconds or probe_seconds
            self.speed = machine_speed.speed(probe_seconds, self.reference_probe_seconds)
        state, k = self.context(bucket, greedy), choice.num_speculative_tokens
        if state.first_looks and state.first_looks[0] == k:
            state.first_looks.pop(0)
        rates = acceptance_rates(counts[DRAFT_PROPOSED_COUNTS], counts[DRAFT_ACCEPTED_COUNTS])
        self.measured[greedy].update(rates)
        self.measured_since_training[greedy] |= set(rates)
        tokens_per_request_step = realised_tokens_per_request_step(k, counts)
        state.rollouts += 1
        state.rollout_seconds = seconds
        observation = Observation(state.rollouts, tokens / max(seconds, 1e-9) / self.speed, tokens_per_request_step)
        window = state.observations.setdefault(k, collections.deque(maxlen=WINDOW))
        fastest_before = max((earlier.tokens_per_s for earlier in window), default=0.0)
        window.append(observation)
        state.lowered = k if max(later.tokens_per_s for later in window) < fastest_before else None
        state.runs[k] += 1
        state.requests_per_step = tokens / (max(steps, 1) * tokens_per_request_step)
        if state.unconfirmed is not None and state.unconfirmed[1] == k:
            self._confirm_switch(bucket, greedy, state)

    def _confirm_switch(self, bucket: int, greedy: bool, state: ContextState) -> None:
        """The switched-to k's first rollout since the switch against the k left behind
        (module docstring, "Confirmation"): slower, and the k's earlier rollouts are set aside."""
        left_behind, k = state.unconfirmed
        state.unconfirmed = None
        latest = state.observations[k][-1]
        if _at_acceptance(latest, self.tokens_per_request_step(greedy)[k]) < self.estimates(bucket, greedy, 1)[left_behind]:
            logger.debug("auto: k = %d's first rollout after the switch ran slower than k = %d's estimate; its earlier rollouts set aside", k, left_behind)
            state.observations[k] = collections.deque([latest], maxlen=WINDOW)


def realised_tokens_per_request_step(k: int, counts: dict) -> float:
    """What a run at k realised per request and step: 1 + its accepted drafts over its decode
    request-steps (each decode request-step proposes a first draft)."""
    proposed, accepted = counts[DRAFT_PROPOSED_COUNTS], counts[DRAFT_ACCEPTED_COUNTS]
    if k and proposed.numel() and int(proposed[0]):
        return 1.0 + float(accepted.sum()) / float(proposed[0])
    return 1.0


def _at_acceptance(observation: Observation, tokens_per_request_step: float) -> float:
    """An observation's tokens/s scaled to the acceptance now (``tokens_per_request_step``, 1 +
    sum rho_i): the heads train between rollouts; costs per step are taken as measured."""
    return observation.tokens_per_s * tokens_per_request_step / observation.tokens_per_request_step


AUTO = "auto"


def auto_limit(megatron_cfg) -> int:
    """The most drafts auto considers: what the engine allows for the model, and for a repeated
    MTP layer (no limit there) the depths it was trained for."""
    from nemo_rl_mtp.rollout.speculation import max_speculative_tokens

    limit = max_speculative_tokens(megatron_cfg)
    return megatron_cfg.mtp_num_layers if limit is None else limit


def forecast_from_metrics(metrics: dict[str, float]) -> list[float]:
    """The training step's ``mtp/mtp_{d}_expected_acceptance`` (percent) as rates per depth."""
    rates = []
    for depth in itertools.count(1):
        value = metrics.get(MTP_EXPECTED_ACCEPTANCE.under(MTP).key(depth))
        if value is None:
            return rates
        rates.append(value / 100.0)


def choose(rollout_engine, prompts: list[list[int]], params, greedy: bool) -> Choice:
    """Before a rollout (inside its sampling session): profile this batch size if it is new,
    choose k, agree on it with the model-parallel peers, and put the engine for it in place."""
    tuner = rollout_engine.adaptive
    bucket = batch_bucket(len(prompts))
    if tuner.needs_profile(bucket):
        profile(rollout_engine, prompts, params, bucket, greedy)
    choice = agreed_with_model_parallel_peers(tuner.choose(bucket, greedy, len(prompts)))
    switch_engine(rollout_engine, choice.num_speculative_tokens)
    return choice


def switch_engine(rollout_engine, k: int) -> None:
    """Put the engine for k in place; a change of k is timed (with the clock rollouts are) for
    the tuner, which weighs re-measuring another k against what the switches there and back cost."""
    if k == rollout_engine.num_speculative_tokens:
        return
    clock = step_clock()
    start = clock()
    rollout_engine.use_speculative_tokens(k)
    rollout_engine.adaptive.record_switch(clock() - start)


def profile(rollout_engine, prompts: list[list[int]], params, bucket: int, greedy: bool) -> None:
    """The measured k on the rollout's prompts for a few decode steps, in ``PROFILE_PASSES``
    rounds over them (:func:`profile_order`; the engine is rebuilt at every change), each k's
    fastest step kept. In the earlier order, k descending then ascending, k = 0's two passes were
    adjacent, and under another process on a 2-core VM one profile read its step at 1.56x the
    next profile's (the same work) and put k = 2 at 1.58x k = 0 where rollouts ran it at 0.93x
    (2026-12-06): a slow spell as long as two passes no longer covers all of a k's.
    Every candidate is measured, except on a GPU the cost model knows (``gpu_step_cost_ratios``):
    there k = 0 is, and the others follow the model's ratios (the profile's short sequences would
    understate what attention over long ones costs). The deepest measured k's counts are a first
    acceptance.

    Rollouts whose every request ends within the profile's decode steps (``max_new_tokens`` at
    most ``PROFILE_DECODE_STEPS`` + 1) are run whole instead, and a k's cost is its whole rollout's
    (start, prefill, every step to the last request's end) per request-step it delivered: there
    the prefill and the steps over the last few unfinished requests are most of a rollout, and a
    speculative prefill costs more. At the default recipe's 128 requests of 5 tokens the fastest
    decode steps put k = 1 at 1.03-1.54x k = 0's tokens/s in three profiles, where whole rollouts
    ran it at 0.89x (2026-12-06)."""
    tuner = rollout_engine.adaptive
    model = rollout_engine.policy.model.module
    context_length = round(statistics.mean(map(len, prompts)) + rollout_engine.generation_cfg.max_new_tokens / 2)
    ratios = gpu_step_cost_ratios(model.config, model.vocab_size, _device_name(), len(prompts), context_length, tuner.max_k)
    measured = [0] if ratios else list(tuner.candidates)
    whole = rollout_engine.generation_cfg.max_new_tokens - 1 <= PROFILE_DECODE_STEPS
    seconds, counts = {}, None
    for k in profile_order(measured):
        switch_engine(rollout_engine, k)
        run = profile_run(rollout_engine, prompts, params, whole)
        cost = run.whole_rollout_step_seconds(len(prompts), k) if whole else run.fastest_step
        seconds[k] = min(seconds.get(k, cost), cost)
        if k == measured[-1]:
            counts = run.counts  # the deepest k's: a first acceptance at every depth
    if ratios:
        seconds = {k: seconds[0] * ratio for k, ratio in ratios.items()}
        logger.info("auto on %s, %d requests at ~%d tokens: step costs from the cost model, c_k/c_0 %s", _device_name(), len(prompts), context_length,
                    ", ".join(f"{ratio:.2f}" for ratio in ratios.values()))  # fmt: skip
    tuner.record_profile(bucket, agreed_with_model_parallel_peers(seconds), greedy, counts)


def profile_order(measured: list[int]) -> list[int]:
    """The profile's passes: ``PROFILE_PASSES`` rounds over the measured k, each in the same order,
    so that a k's passes lie a round apart and no two of them are adjacent."""
    return measured * PROFILE_PASSES


def gpu_step_cost_ratios(model_config, vocab_size: int, device_name: str | None, batch_size: int, context_length: int, max_k: int) -> dict[int, float] | None:
    """c_k / c_0 for k = 0 .. ``max_k`` from the decode-step cost model
    (:mod:`step_cost_model`) for a megatron ``model_config`` with ``vocab_size`` output rows on
    the CUDA device named ``device_name``; None without a GPU or on one the model has no figures
    for (then every k is profiled)."""
    gpu = None if device_name is None else step_cost_model.gpu_spec_from_device_name(device_name)
    if gpu is None:
        return None
    shape = step_cost_model.model_shape_from_megatron_config(model_config, vocab_size)
    return step_cost_model.relative_step_costs(
        shape, gpu, batch_size, context_length, max_k, tensor_parallel_size=model_config.tensor_model_parallel_size
    )


def _device_name() -> str | None:
    from nemo_rl_mtp.megatron_compat.cpu.training_runtime import cuda_available

    return torch.cuda.get_device_name() if cuda_available() else None


def step_clock():
    """The clock step costs are measured with (module docstring)."""
    from nemo_rl_mtp.megatron_compat.cpu.training_runtime import cuda_available

    if cuda_available():
        return time.perf_counter
    return time.thread_time if torch.get_num_threads() == 1 else time.process_time


@dataclasses.dataclass
class ProfileRun:
    """One profiling pass of one k: its fastest decode step, the drafts it proposed and accepted,
    and where it ran the rollout whole, the rollout's seconds and the tokens it generated."""

    fastest_step: float
    counts: dict
    whole_seconds: float | None = None
    tokens: int = 0

    def whole_rollout_step_seconds(self, num_requests: int, k: int) -> float:
        """The whole rollout's seconds per request-step as the prior reads a step's cost: the
        prior, R (1 + sum rho_i) / c_k, gives back the run's tokens/s at the run's acceptance."""
        return self.whole_seconds * num_requests * realised_tokens_per_request_step(k, self.counts) / max(self.tokens, 1)


def profile_run(rollout_engine, prompts: list[list[int]], params, whole: bool = False) -> ProfileRun:
    """``prompts`` on the current engine: its prefill step, then decode steps, the first
    ``PROFILE_DECODE_STEPS`` or, ``whole``, until every request has ended (timed as a rollout is,
    from the engine's start); the engine is reset after."""
    from nemo_rl_mtp.rollout.speculation import speculation_counts, through_first_end

    clock = step_clock()
    started = clock()
    rollout_engine.start(prompts, 0, params)
    engine = rollout_engine.engine
    finished = list(engine.step_modern()["finished_request_records"])  # prefill
    times = []
    while engine.has_unfinished_requests() and (whole or len(times) < PROFILE_DECODE_STEPS):
        start = clock()
        finished.extend(engine.step_modern()["finished_request_records"])
        times.append(clock() - start)
    whole_seconds = clock() - started if whole else None
    tokens = sum(len(through_first_end(list(record.merge().generated_tokens), params.termination_id)) for record in finished) if whole else 0
    run = ProfileRun(min(times) if times else float("inf"), speculation_counts(engine), whole_seconds, tokens)
    engine.reset()
    return run


def agreed_with_model_parallel_peers(value):
    """``value`` as the first rank of this rank's model-parallel group has it: tensor- and
    pipeline-parallel peers run one engine together and must choose alike."""
    from megatron.core import parallel_state

    group = parallel_state.get_model_parallel_group()
    if torch.distributed.get_world_size(group) == 1:
        return value
    holder = [value]
    torch.distributed.broadcast_object_list(holder, src=torch.distributed.get_global_rank(group, 0), group=group)
    return holder[0]


def record(
    tuner: AdaptiveSpeculation, choice: Choice, rollouts: dict[str, torch.Tensor], greedy: bool, seconds: float, probe_seconds: float | None
) -> dict[str, torch.Tensor]:
    """After the rollout: what it measured (and on a CPU the machine-speed probe's seconds during
    it) goes to the tuner; the choice and the tokens/s expected and delivered go to the rollout's
    results."""
    tokens = int((rollouts[LENGTHS] - rollouts[PROMPT_LENGTHS]).sum())
    counts = {DRAFT_PROPOSED_COUNTS: rollouts[DRAFT_PROPOSED_COUNTS], DRAFT_ACCEPTED_COUNTS: rollouts[DRAFT_ACCEPTED_COUNTS]}
    bucket = batch_bucket(rollouts[LENGTHS].numel())
    tuner.record_rollout(bucket, greedy, choice, seconds, int(rollouts[DECODE_STEPS]), tokens, counts, probe_seconds)
    return {
        SPECULATIVE_TOKENS: torch.tensor(choice.num_speculative_tokens),
        EXPECTED_TOKENS_PER_S: torch.tensor(choice.expected_tokens_per_s),
        ENGINE_TOKENS_PER_S: torch.tensor(tokens / seconds),
    }
