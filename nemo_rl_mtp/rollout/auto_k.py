"""``policy.generation.num_speculative_tokens: auto``: the number of drafts per step, chosen before
each rollout from what speculation gains and what it costs on this engine.

A decode step at k drafts yields, per request, 1 + sum_{i <= k} rho_i tokens in expectation, rho_i
being the rate at which draft i is accepted (with every draft before it: megatron's per-position
count). It costs c_k seconds. The rollout's tokens per second at k are therefore about
R (1 + sum_{i <= k} rho_i) / c_k, R being the requests a step serves on average, the same for
every k; auto picks the k that maximises it, 0 included (vLLM's "goodput"; SGLang picks per batch
size among candidates the same way), but speculates only where that is expected to beat k = 0
by ``MIN_GAIN``: a gain smaller than the error of the estimates is not worth the risk of a loss.

- rho_i: the rate measured in the latest rollout that proposed draft i, as long as no training
  step came after it; else the trainer's forecast (the per-depth overlap of policy and head that
  training measures, ``mtp_{d}_expected_acceptance``; rho_i = prod_{d <= i} of them); else the
  latest measurement, however old; else the profile's.
- c_k: per batch size (rounded to a power of two), first a profile before the first rollout of
  that size: every candidate k runs the rollout's own prompts for a few decode steps, twice, in
  opposite orders, and keeps its fastest step (load from elsewhere on the machine only ever adds
  time). Each rollout then measures its own k's step time (prefill included: per step of the
  rollout, that is what its tokens/s divides by). A k measured in one of the last
  ``MEASUREMENT_LIFETIME`` rollouts of this batch size is estimated by that measurement; the
  others from the latest measurement through the profile's ratios. The profile's short
  sequences understate what attention over long ones costs, and how much fewer steps save there,
  so a candidate expected within ``EXPLORE_WITHIN`` of the best, and not measured lately, is run
  once to measure it.

The choice and the numbers behind it (expected tokens/s; afterwards the realised) are returned
with the rollout and logged as ``rollout/num_speculative_tokens``, ``rollout/expected_tokens_per_s``
and ``rollout/engine_tokens_per_s``.

Times are wall-clock on a GPU (where the device's work is what a step waits for) and the process's
CPU time without one: on a CPU the engine's work is the process's own, and other jobs on a shared
machine would otherwise add their load to whichever k happened to be measured while they ran.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
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

# Decode steps each candidate k runs in each of the profile's two passes (after its prefill step).
PROFILE_DECODE_STEPS = 6
# A measured acceptance needs at least this many proposals to be trusted.
MIN_PROPOSALS = 8
# Speculation is chosen only where it is expected to beat k = 0 by this factor.
MIN_GAIN = 1.03
# A candidate not measured lately and expected within this factor of the best is run to measure it.
EXPLORE_WITHIN = 1.10
# Rollouts of a batch size after which a step-time measurement is no longer used as such.
MEASUREMENT_LIFETIME = 10


@dataclasses.dataclass
class Choice:
    """The drafts per step for the next rollout and the tokens/s expected from them."""

    num_speculative_tokens: int
    expected_tokens_per_s: float


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
    model allows; ``greedy`` and sampled rollouts keep separate acceptance (they accept
    differently)."""

    def __init__(self, max_k: int):
        self.max_k = max_k
        self.measured: dict[bool, dict[int, float]] = {False: {}, True: {}}
        self.measured_since_training: dict[bool, set[int]] = {False: set(), True: set()}
        self.forecast: list[float] | None = None
        self.profiled: dict[int, dict[int, float]] = {}
        # bucket -> k -> (seconds per step, rollout number) of its latest rollout at k
        self.step_seconds: dict[int, dict[int, tuple[float, int]]] = {}
        self.rollouts: dict[int, int] = {}  # bucket -> rollouts measured
        self.latest: dict[int, int] = {}  # bucket -> k of the latest rollout
        self.requests_per_step: dict[int, float] = {}

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

    def recent_measurements(self, bucket: int) -> dict[int, float]:
        """Seconds per step of the k measured in the last ``MEASUREMENT_LIFETIME`` rollouts."""
        oldest = self.rollouts.get(bucket, 0) - MEASUREMENT_LIFETIME
        return {k: seconds for k, (seconds, number) in self.step_seconds.get(bucket, {}).items() if number > oldest}

    def seconds_per_step(self, bucket: int) -> dict[int, float]:
        """c_k for every candidate: its recent measurement, else the profile scaled to the latest
        measured rollout."""
        profile = self.profiled[bucket]
        if bucket not in self.latest:
            return dict(profile)
        latest_k = self.latest[bucket]
        scale = self.step_seconds[bucket][latest_k][0] / profile[latest_k]
        measured = self.recent_measurements(bucket)
        return {k: measured.get(k, seconds * scale) for k, seconds in profile.items()}

    def choose(self, bucket: int, greedy: bool, num_requests: int) -> Choice:
        rates = self.acceptance(greedy)
        costs = self.seconds_per_step(bucket)
        requests = self.requests_per_step.get(bucket, float(num_requests))
        expected = {k: requests * (1.0 + sum(rates[:k])) / costs[k] for k in self.candidates}
        best = max(self.candidates, key=lambda k: (expected[k], -k))
        if expected[best] < MIN_GAIN * expected[0]:
            best = 0
        if bucket in self.latest:  # after the first rollout: measure a close runner-up once
            measured = self.recent_measurements(bucket)
            close = [k for k in self.candidates if k not in measured and expected[k] * EXPLORE_WITHIN >= expected[best]]
            if close:
                best = max(close, key=lambda k: expected[k])
        return Choice(best, expected[best])

    def record_rollout(self, bucket: int, greedy: bool, k: int, seconds: float, steps: int, tokens: int, counts: dict) -> None:
        """A finished rollout at k: its step time, its requests per step, its acceptance."""
        self.rollouts[bucket] = self.rollouts.get(bucket, 0) + 1
        self.step_seconds.setdefault(bucket, {})[k] = (seconds / max(steps, 1), self.rollouts[bucket])
        self.latest[bucket] = k
        rates = acceptance_rates(counts[DRAFT_PROPOSED_COUNTS], counts[DRAFT_ACCEPTED_COUNTS])
        self.measured[greedy].update(rates)
        self.measured_since_training[greedy] |= set(rates)
        tokens_per_request_step = 1.0
        proposed, accepted = counts[DRAFT_PROPOSED_COUNTS], counts[DRAFT_ACCEPTED_COUNTS]
        if k and proposed.numel() and int(proposed[0]):
            tokens_per_request_step += float(accepted.sum()) / float(proposed[0])
        self.requests_per_step[bucket] = tokens / (max(steps, 1) * tokens_per_request_step)


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
    rollout_engine.use_speculative_tokens(choice.num_speculative_tokens)
    return choice


def profile(rollout_engine, prompts: list[list[int]], params, bucket: int, greedy: bool) -> None:
    """Every candidate k on the rollout's prompts for a few decode steps, in two passes (k
    descending, then ascending: the engine is rebuilt once per change), its fastest step kept. The
    deepest candidate's counts are a first acceptance."""
    tuner = rollout_engine.adaptive
    seconds, counts = {}, None
    for k in [*reversed(tuner.candidates), *tuner.candidates]:
        rollout_engine.use_speculative_tokens(k)
        fastest, step_counts = decode_step_seconds(rollout_engine, prompts, params)
        seconds[k] = min(seconds.get(k, fastest), fastest)
        counts = counts or step_counts
    tuner.record_profile(bucket, agreed_with_model_parallel_peers(seconds), greedy, counts)


def step_clock():
    """The clock step costs are measured with (module docstring)."""
    from nemo_rl_mtp.megatron_compat.cpu.training_runtime import cuda_available

    return time.perf_counter if cuda_available() else time.process_time


def decode_step_seconds(rollout_engine, prompts: list[list[int]], params) -> tuple[float, dict]:
    """The fastest of the first decode steps of ``prompts`` on the current engine (after its
    prefill step), and the drafts it proposed and accepted; the engine is reset after."""
    from nemo_rl_mtp.rollout.speculation import speculation_counts

    rollout_engine.start(prompts, seed=0)
    engine = rollout_engine.engine
    for request_id, prompt in enumerate(prompts):
        engine.add_request(request_id, prompt, params)
    engine.step_modern()  # prefill
    times, clock = [], step_clock()
    while engine.has_unfinished_requests() and len(times) < PROFILE_DECODE_STEPS:
        start = clock()
        engine.step_modern()
        times.append(clock() - start)
    counts = speculation_counts(engine)
    engine.reset()
    return (min(times) if times else float("inf")), counts


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


def record(tuner: AdaptiveSpeculation, choice: Choice, rollouts: dict[str, torch.Tensor], greedy: bool, seconds: float) -> dict[str, torch.Tensor]:
    """After the rollout: what it measured goes to the tuner; the choice and the tokens/s
    expected and delivered go to the rollout's results."""
    tokens = int((rollouts[LENGTHS] - rollouts[PROMPT_LENGTHS]).sum())
    counts = {DRAFT_PROPOSED_COUNTS: rollouts[DRAFT_PROPOSED_COUNTS], DRAFT_ACCEPTED_COUNTS: rollouts[DRAFT_ACCEPTED_COUNTS]}
    bucket = batch_bucket(rollouts[LENGTHS].numel())
    tuner.record_rollout(bucket, greedy, choice.num_speculative_tokens, seconds, int(rollouts[DECODE_STEPS]), tokens, counts)
    return {
        SPECULATIVE_TOKENS: torch.tensor(choice.num_speculative_tokens),
        EXPECTED_TOKENS_PER_S: torch.tensor(choice.expected_tokens_per_s),
        ENGINE_TOKENS_PER_S: torch.tensor(tokens / seconds),
    }
