"""``auto``'s rule (``nemo_rl_mtp.rollout.auto_k.AdaptiveSpeculation``) against two variants, in
a seeded simulation of rollouts whose measured speed lands log-normally around their k's true
speed: how much of the best fixed k it realises early in a context (rollouts 4-8, the rollout
benchmark's five timed rollouts after its three untimed ones) and over 150 rollouts.

    uv run python -m benchmarks.auto_k_noise_simulation [--seeds 300] [--noise 0.05 0.10 0.15]
    uv run python -m benchmarks.auto_k_noise_simulation --traces trace.json [...]

With ``--traces``, the noise is a measured machine's instead (``benchmarks.machine_speed --save``:
one engine's rollouts of the same work, and the machine-speed probe's reading for each; or a GRPO
run's ``metrics.jsonl``: its rollouts at k = 0 after the first five, by ``rollout/engine_tokens_per_s``,
no probe readings): auto as
it was before the probe (its rollouts' tokens/s as measured), auto told the probe's readings
(``nemo_rl_mtp.rollout.machine_speed``), and auto told them with a **slowed second look**: a k
looked at once in a state of the machine slower than the best estimate's rollout (its probe 5%
slower or more), that would be ahead were the slowing read out to the power 0.8 (the closest
tracking measured on 2026-12-05), runs again at once, once. ``--probe-tracking P`` replaces each
trace's probe readings by its rollouts' slowness to the power 1 / P with 2% seeded noise: a
machine whose rollouts track the probe at the power P.

``--switch-cost C`` charges every change of k C of the best k's rollout (an engine rebuilt;
about 0.12 in the default recipe on a CPU) and tells the rule, as the engine does.
``--prior-noise S`` puts each k's profiled step cost off by a seeded log-normal factor of sigma
S (this CPU's profiles of one cell read c_2 / c_0 from 2.6 to 3.0 on 2026-12-06).
``--first-slow F`` makes a context's first rollout F slower (the rollout benchmark's cells on
2026-12-07: 0.1-0.2); ``--drafts-profiled-at F`` reads a drafting k's step cost at F x its true
cost (k = 0's step misread 1.3-1.6x in two of seven profiles of one cell that day: about 0.7);
``--slow-rollouts N`` makes the first N rollouts that much slower instead (a loaded cell on
2026-12-07 ran all three looks at 0.80-0.82 of its fixed engines' medians).
``--rules`` runs only the rules named (by their column names).
``--slow-start`` makes a run's first rollouts slower (rollouts 2-11 at 0.5-0.95 of full speed, as
the start of some default GRPO runs on this CPU) and the profile favour drafting (k >= 1's step
costs read 0.7x: the default recipe's profile put k = 1 first where k = 0 was 1.2x faster). Both
tables also run the rule **without confirmation** (a switch is no longer checked against the new
k's first rollout after it), **without rechecks** (the prior's best no longer run again at once
where a look contradicts the profile by 20% or more: in the rule since 2026-12-06, night),
**plausible k looked at only** (the first looks as until late on 2026-12-06: k = 0 and the k the
prior puts within 70% of its best; a k left out ran once its scaled prior came within 10% of
the best estimate), **without the second look at k = 0** (both in the rule since
2026-12-06), **without the second look at the prior's best**, with **the prior's best first**
(the first looks' order until 2026-12-06: the prior's best, then k = 0, then the others; the
rule runs the prior's best last), **as before 2026-12-07** (every switch confirmed, not only one
made as the incumbent's estimate fell; the prior's best rechecked against the best estimate's
look alone, not every other k's; the context's first rollout's k looked at again no sooner than
k = 0 and the prior's best are; the seeded table also runs each of the three alone: **every
switch confirmed**, **rechecked against the best alone**, **the first rollout's k looked at
late**), with **the opening's second look unanswered** (the incumbent that look displaced, looked
at once, not looked at again at once: the rule from a5a261e until 2026-12-07, afternoon), with
**the opening looked at when close** (the first rollout's k looked at again whenever it comes
within 10% of the incumbent, not only right after the first looks: the same rule's), and with a **look back** (after a switch the new k's first
rollout confirmed, the k left behind runs once three rollouts later), not adopted; the trace
table also runs **like for like** (below).

The other variants, written here as subclasses, are remedies proposed for its misses in near ties
(docs/results.md, "engines stepped in turn"; the slowed second look above, "what the probe sees
on another day"), none adopted:
- **like for like**: every measured k is estimated by the fastest of as many of its latest
  rollouts as the least measured k has (the incumbent, measured thrice, no longer competes by the
  fastest of three against a k measured once);
- **second look**: after the first looks, a k measured once whose estimate is within 10% of the
  best is run a second time two rollouts later.
The profile is told each k's true step cost (exact prior); acceptance 0.9 and 0.8 per depth.
Prints one markdown row per case and noise: mean and 10th percentile of rollouts 4-8, mean over
the run, per rule.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import statistics
from pathlib import Path

import torch

from nemo_rl_mtp.metrics import ENGINE_TOKENS_PER_S, NUM_SPECULATIVE_TOKENS, ROLLOUT
from nemo_rl_mtp.reporting.logger import read_metrics
from nemo_rl_mtp.rollout.auto_k import HYSTERESIS, RECHECK_BELOW, REFRESH_WITHIN, WINDOW, AdaptiveSpeculation
from nemo_rl_mtp.rollout.machine_speed import TRACKING

RATES = (0.9, 0.8)  # acceptance per draft depth
TOKENS = 3200  # tokens of a rollout
CASES = {  # true tokens/s of k = 0, 1, 2 over the best
    "k = 0 best, k = 1 and 2 at 0.96 (the untrained 2-layer 128-token cell)": {0: 1.0, 1: 0.96, 2: 0.96},
    "k = 2 best by 5% over k = 1 (the untrained 2-layer 2048-token cell)": {0: 0.86, 1: 0.95, 2: 1.0},
    "k = 0 best, k = 1 at 0.97, k = 2 at 0.90 (the untrained 2-layer 2048-token cell, 2026-12-07)": {0: 1.0, 1: 0.97, 2: 0.90},
    "k = 2 best by 8%, k = 1 at 0.93 (the trained 2-layer 128-token cell, loaded, 2026-12-07)": {0: 0.92, 1: 0.93, 2: 1.0},
    "k = 2 best by 28% over k = 1 (the trained 8-layer 128-token cell)": {0: 0.56, 1: 0.78, 2: 1.0},
    "one MTP layer, k = 0 best by 25% (the default recipe)": {0: 1.0, 1: 0.8},
    "one MTP layer, k = 0 best by 10%": {0: 1.0, 1: 0.91},
    "one MTP layer, k = 1 best by 5%": {0: 0.95, 1: 1.0},
}


def counts(k: int) -> dict:
    return {
        "draft_proposed": torch.tensor([100] * k, dtype=torch.long),
        "draft_accepted": torch.tensor([round(100 * rate) for rate in RATES[:k]], dtype=torch.long),
    }


class WithoutConfirmation(AdaptiveSpeculation):
    """The rule with a switch's first rollout no longer checked against the k left behind."""

    def _confirm_switch(self, bucket: int, greedy: bool, state) -> None:
        state.unconfirmed = None


class WithoutRechecks(AdaptiveSpeculation):
    """The rule with the prior's best no longer rechecked where a look contradicts the profile."""

    @staticmethod
    def _recheck_due(state, expected: dict[int, float], prior: dict[int, float], best: int) -> bool:
        return False


class PlausibleLooksOnly(AdaptiveSpeculation):
    """The first looks as until late on 2026-12-06: k = 0 and the k whose prior is within 70% of the
    best's; a k left out runs once its estimate (its prior, scaled) comes within REFRESH_WITHIN."""

    def _first_looks(self, expected: dict[int, float]) -> list[int]:
        *others, best = super()._first_looks(expected)
        return [*(k for k in others if k == 0 or expected[k] >= 0.7 * expected[best]), best]

    @staticmethod
    def _refresh_due(state, k: int, relative: float, switch_cost: float) -> bool:
        if k not in state.observations:
            return relative >= 1.0 - REFRESH_WITHIN
        return AdaptiveSpeculation._refresh_due(state, k, relative, switch_cost)


class WithoutSecondLookAtZero(AdaptiveSpeculation):
    """The rule with k = 0's first look not repeated (the prior's best's still is)."""

    @staticmethod
    def _second_looks_due(state, expected: dict[int, float]) -> list[int]:
        return [k for k in AdaptiveSpeculation._second_looks_due(state, expected) if k != 0]


class WithoutSecondLookAtPriorsBest(AdaptiveSpeculation):
    """The rule with the prior's best's first look not repeated (k = 0's still is)."""

    @staticmethod
    def _second_looks_due(state, expected: dict[int, float]) -> list[int]:
        return [k for k in AdaptiveSpeculation._second_looks_due(state, expected) if k == 0]


class PriorsBestFirst(AdaptiveSpeculation):
    """The first looks as until 2026-12-06: the prior's best first (and the incumbent), then k = 0,
    then the others from the most promising down."""

    def _first_looks(self, expected: dict[int, float]) -> list[int]:
        *others, best = super()._first_looks(expected)
        return [best, *sorted(others, key=lambda k: (k != 0, -expected[k]))]

    def choose(self, bucket: int, greedy: bool, num_requests: int):
        state = self.context(bucket, greedy)
        first = state.first_looks is None
        choice = super().choose(bucket, greedy, num_requests)
        if first:
            state.incumbent = choice.num_speculative_tokens
        return choice

    @staticmethod
    def _second_looks_due(state, expected: dict[int, float]) -> list[int]:
        return [k for k in AdaptiveSpeculation._second_looks_due(state, expected) if k == 0]  # k = 0's alone, as then


class ConfirmingEverySwitch(AdaptiveSpeculation):
    """Every switch awaits the new k's first rollout, not only one made as the incumbent's
    estimate fell (the rule until 2026-12-07)."""

    def _settle_incumbent(self, state, expected: dict[int, float]) -> int:
        state.lowered = state.incumbent
        return super()._settle_incumbent(state, expected)


class RecheckedAgainstTheBestAlone(AdaptiveSpeculation):
    """The prior's best rechecked where its look falls RECHECK_BELOW below what the prior implies
    from the best estimate's k alone, not from every other k (the rule until 2026-12-07)."""

    @staticmethod
    def _recheck_due(state, expected: dict[int, float], prior: dict[int, float], best: int) -> bool:
        k = state.priors_best
        implied = expected[best] * prior[k] / prior[best]
        return (
            k != best and 0 < state.runs[k] < WINDOW and prior[k] > (1.0 + HYSTERESIS) * prior[best]
            and expected[k] < (1.0 - RECHECK_BELOW) * implied
        )  # fmt: skip


class OpeningLookedAtLate(AdaptiveSpeculation):
    """The context's first rollout's k looked at again no sooner than k = 0 and the prior's best
    are, REFRESH_EVERY rollouts on (the rule until 2026-12-07)."""

    def choose(self, bucket: int, greedy: bool, num_requests: int):
        choice = super().choose(bucket, greedy, num_requests)
        self.context(bucket, greedy).opening = None
        return choice


class OpeningLookUnanswered(AdaptiveSpeculation):
    """The incumbent that the opening's second look displaced, looked at once, not looked at again
    at once: its second look comes REFRESH_EVERY rollouts on where it is k = 0 or the prior's best
    (the rule from a5a261e until 2026-12-07, afternoon)."""

    def _next_choice(self, state, expected: dict[int, float], prior: dict[int, float]) -> int:
        state.answering = None
        return super()._next_choice(state, expected, prior)


class OpeningLookedAtWhenClose(AdaptiveSpeculation):
    """The context's first rollout's k looked at again whenever its estimate comes within
    REFRESH_WITHIN of the incumbent's, not only right after the first looks (the rule from a5a261e
    until 2026-12-07, afternoon: a refresh ahead of its time where the incumbent's estimate fell
    later)."""

    def _next_choice(self, state, expected: dict[int, float], prior: dict[int, float]) -> int:
        opening = state.opening
        k = super()._next_choice(state, expected, prior)
        if opening is not None and opening not in state.second_looks:
            state.opening = opening
        return k


class BeforeDecember7(ConfirmingEverySwitch, RecheckedAgainstTheBestAlone, OpeningLookedAtLate):
    """The rule as until 2026-12-07 (d6b216a): the three above together."""


class LookBack(AdaptiveSpeculation):
    """After a switch its first rollout confirmed, the k left behind runs once AFTER rollouts on."""

    AFTER = 3

    def record_rollout(self, bucket, greedy, choice, seconds, steps, tokens, counts, probe_seconds=None) -> None:
        state = self.context(bucket, greedy)
        unconfirmed, k = state.unconfirmed, choice.num_speculative_tokens
        super().record_rollout(bucket, greedy, choice, seconds, steps, tokens, counts, probe_seconds)
        if unconfirmed is not None and unconfirmed[1] == k and len(state.observations[k]) > 1:  # confirmed
            state.look_back = (unconfirmed[0], state.rollouts + self.AFTER)

    def _next_choice(self, state, expected: dict[int, float], prior: dict[int, float]) -> int:
        look_back = getattr(state, "look_back", None)
        if look_back is not None and not state.first_looks and state.rollouts >= look_back[1]:
            state.look_back = None
            if state.incumbent != look_back[0] and state.since_measured(look_back[0]) > self.AFTER:
                return look_back[0]
        return super()._next_choice(state, expected, prior)


class LikeForLike(AdaptiveSpeculation):
    """Every measured k by the fastest of as many latest rollouts as the least measured k has."""

    def estimates(self, bucket: int, greedy: bool, num_requests: int) -> dict[int, float]:
        state, tokens = self.context(bucket, greedy), self.tokens_per_request_step(greedy)
        if not state.observations:
            return super().estimates(bucket, greedy, num_requests)
        depth = min(len(observations) for observations in state.observations.values())
        measured = {
            k: max(obs.tokens_per_s * tokens[k] / obs.tokens_per_request_step for obs in list(observations)[-depth:])
            for k, observations in state.observations.items()
        }
        prior = self.prior(bucket, greedy, num_requests)
        latest = min(measured, key=state.since_measured)
        return {k: measured.get(k, prior[k] * measured[latest] / prior[latest]) for k in self.candidates}


class SecondLook(AdaptiveSpeculation):
    """A k measured once and estimated within REFRESH_WITHIN of the best runs again two rollouts on."""

    def _next_choice(self, state, expected: dict[int, float], prior: dict[int, float]) -> int:
        if not state.first_looks:
            best = self._settle_incumbent(state, expected)
            once = [
                k for k in self.candidates
                if k != best and len(state.observations.get(k, ())) == 1
                and expected[k] >= (1.0 - REFRESH_WITHIN) * expected[best] and state.since_measured(k) >= 2
            ]
            if once:
                return once[0]
        return super()._next_choice(state, expected, prior)


class SlowedSecondLook(AdaptiveSpeculation):
    """A k looked at once, in a slower state of the machine than the rollout the best estimate rests
    on, that could be ahead were its slowing read out in full, runs again at once (module docstring)."""

    SLOWER_STATE, TRACKING_HIGHEST = 0.05, 0.8

    def __init__(self, max_k: int):
        super().__init__(max_k)
        self.slowdowns: dict[int, float] = {}  # rollout number -> the probe's seconds over the first rollout's

    def record_rollout(self, bucket, greedy, choice, seconds, steps, tokens, counts, probe_seconds=None) -> None:
        super().record_rollout(bucket, greedy, choice, seconds, steps, tokens, counts, probe_seconds)
        state = self.context(bucket, greedy)
        self.slowdowns[state.rollouts] = probe_seconds / self.reference_probe_seconds if probe_seconds is not None else 1.0

    def _next_choice(self, state, expected: dict[int, float], prior: dict[int, float]) -> int:
        if state.first_looks:
            return super()._next_choice(state, expected, prior)
        best = self._settle_incumbent(state, expected)
        if best not in state.observations:
            return super()._next_choice(state, expected, prior)
        reference = self.slowdowns[max(state.observations[best], key=lambda obs: obs.tokens_per_s / obs.tokens_per_request_step).number]
        for k in sorted(state.observations, key=lambda k: -expected[k]):
            slowdown = self.slowdowns[state.observations[k][0].number]
            if (
                k != best and len(state.observations[k]) == 1 and slowdown >= (1.0 + self.SLOWER_STATE) * reference
                and expected[k] * (slowdown / reference) ** (self.TRACKING_HIGHEST - TRACKING) >= expected[best]
            ):  # fmt: skip
                return k
        return super()._next_choice(state, expected, prior)


# A slow start (``--slow-start``): the speed of a run's rollouts 1-11, and the profile's reading of
# a drafting step's cost over its true cost.
START_SPEED = (1.0, 0.5, 0.6, 0.7, 0.65, 0.8, 0.75, 0.85, 0.9, 0.85, 0.95)
START_PROFILE_ERROR = 0.7


def run(
    rule: type, true: dict[int, float], noise: float, seed: int, switch_cost: float, slow_start: bool, prior_noise: float = 0.0, rollouts: int = 150,
    first_slow: float = 0.0, drafts_profiled_at: float = 1.0, slow_rollouts: int = 1,
) -> list[int]:
    """The k of each rollout of one seeded run, its first ``slow_rollouts`` rollouts ``first_slow`` slower."""
    rng = random.Random(seed)
    machine = lambda number: (math.exp(-noise * rng.gauss(0.0, 1.0)) / (1.0 - first_slow * (number < slow_rollouts)), None)  # noqa: E731
    return simulate(rule, true, machine, switch_cost, slow_start, prior_noise, seed, rollouts, drafts_profiled_at)


def simulate(
    rule: type, true: dict[int, float], machine, switch_cost: float = 0.0, slow_start: bool = False, prior_noise: float = 0.0, prior_seed: int = 0,
    rollouts: int = 150, drafts_profiled_at: float = 1.0,
) -> list[int]:
    """The k of each rollout of a run where ``machine(n)`` gives rollout n's slowness (its
    seconds over its k's typical seconds) and the machine-speed probe's reading told to the
    rule (None: none); a change of k takes ``switch_cost`` of the best k's rollout, told to the
    rule; with ``slow_start``, the run's first rollouts slowed and the profile favouring drafts;
    each k's profiled step cost off by log-normal ``prior_noise`` (seeded by ``prior_seed``), a
    drafting k's by ``drafts_profiled_at`` (where the run does not start slow)."""
    max_k = max(true)
    tuner = rule(max_k)
    profile_error = START_PROFILE_ERROR if slow_start else drafts_profiled_at
    prior_rng = random.Random(10_000 + prior_seed)
    step_seconds = {  # tokens per step over tokens/s
        k: (1 + sum(RATES[:k])) / true[k] * (profile_error if k else 1.0) * math.exp(prior_noise * prior_rng.gauss(0.0, 1.0)) for k in true
    }
    tuner.record_profile(32, step_seconds, False, counts(max_k))
    chosen = []
    for number in range(rollouts):
        choice = tuner.choose(32, False, 32)
        k = choice.num_speculative_tokens
        if chosen and k != chosen[-1]:
            tuner.record_switch(switch_cost * TOKENS / max(true.values()))
        slowness, probe_seconds = machine(number)
        if slow_start and number < len(START_SPEED):
            slowness /= START_SPEED[number]
        tuner.record_rollout(32, False, choice, TOKENS * slowness / true[k], 50, TOKENS, counts(k), probe_seconds)
        chosen.append(k)
    return chosen


def trace_table(paths: list[Path], probe_tracking: float | None, switch_cost: float, slow_start: bool, prior_noise: float) -> None:
    """auto told the probe's readings or not, without confirmation, with a slowed second look, a
    look back or like-for-like estimates, on machines measured
    by ``benchmarks.machine_speed --save``: one run per rollout of the trace to start at (wrapping
    round), rollout n of a run as slow as the trace's rollout there against the trace's median;
    the probe's readings the trace's, or its rollouts' slowness to the power 1 / ``probe_tracking``."""
    rules = {"as measured": (AdaptiveSpeculation, False), "read at the machine's speed (auto)": (AdaptiveSpeculation, True),
             "read so, as before 2026-12-07": (BeforeDecember7, True),
             "read so, without confirmation": (WithoutConfirmation, True), "read so, without rechecks": (WithoutRechecks, True),
             "read so, plausible k looked at only": (PlausibleLooksOnly, True),
             "read so, without the second look at k = 0": (WithoutSecondLookAtZero, True),
             "read so, without the second look at the prior's best": (WithoutSecondLookAtPriorsBest, True),
             "read so, the prior's best first": (PriorsBestFirst, True), "read so, with a slowed second look": (SlowedSecondLook, True),
             "read so, with a look back": (LookBack, True), "read so, like for like": (LikeForLike, True)}  # fmt: skip
    probes_from = "the trace's probe" if probe_tracking is None else f"a probe the rollouts track at the power {probe_tracking}"
    start = ("; runs start slow, the profile favouring drafts" if slow_start else "") + (f"; profile off by {prior_noise} (log-normal)" if prior_noise else "")
    print(f"\nProbe readings: {probes_from}; a change of k costs {switch_cost} of a rollout{start}. Cells: rollouts 4-8 mean (p10), run mean.\n")
    print("| trace | case | " + " | ".join(rules) + " |\n|---|---|" + "---|" * len(rules))
    for path in paths:
        seconds, probes = load_trace(path)
        median = statistics.median(seconds)
        if probe_tracking is not None and None not in probes:
            rng = random.Random(0)
            probes = [probes[0] * (value / median) ** (1.0 / probe_tracking) * (1.0 + 0.02 * rng.gauss(0.0, 1.0)) for value in seconds]
        for case, true in CASES.items():
            cells = []
            for rule, probed in rules.values():
                told = probes if probed else [None] * len(probes)
                machines = [functools.partial(traced, seconds, median, told, start) for start in range(len(seconds))]
                runs = [simulate(rule, true, machine, switch_cost, slow_start, prior_noise, start) for start, machine in enumerate(machines)]
                cells.append(summary(true, runs, switch_cost))
            print(f"| {path.parent.name}/{path.name} ({len(seconds)} rollouts) | {case} | " + " | ".join(cells) + " |", flush=True)


def load_trace(path: Path) -> tuple[list[float], list[float | None]]:
    """A trace's rollout seconds and probe readings: ``machine_speed --save``'s JSON, or a GRPO
    run's ``metrics.jsonl`` (its k = 0 rollouts after the first five, whose seconds are taken as
    one over their tokens/s: the same work each; no probe readings)."""
    if path.suffix != ".jsonl":
        trace = json.loads(path.read_text())
        return trace["rollout_seconds"], trace["probe_seconds"]
    rows = [row for row in read_metrics(path) if ROLLOUT + NUM_SPECULATIVE_TOKENS in row][5:]
    seconds = [1.0 / row[ROLLOUT + ENGINE_TOKENS_PER_S] for row in rows if row[ROLLOUT + NUM_SPECULATIVE_TOKENS] == 0]
    return seconds, [None] * len(seconds)


def traced(seconds: list[float], median: float, probes: list, start: int, number: int) -> tuple[float, float | None]:
    """Rollout ``number`` of a run from ``start`` on a traced machine: its slowness and probe reading."""
    index = (start + number) % len(seconds)
    return seconds[index] / median, probes[index]


def summary(true: dict[int, float], runs: list[list[int]], switch_cost: float = 0.0) -> str:
    """Mean and 10th percentile of rollouts 4-8, and the mean over whole runs, of the best fixed k's tokens/s."""
    early = sorted(realised(true, chosen[3:8], switch_cost, chosen[2]) for chosen in runs)
    whole = statistics.mean(realised(true, chosen, switch_cost) for chosen in runs)
    return f"{statistics.mean(early):.3f} ({early[len(early) // 10]:.3f}), {whole:.3f}"


def realised(true: dict[int, float], chosen: list[int], switch_cost: float = 0.0, before: int | None = None) -> float:
    """Tokens/s of these rollouts (equal tokens each) over the best fixed k's, each change of k
    (from ``before``, the k of the rollout ahead of them, where given) costing ``switch_cost`` of
    the best k's rollout."""
    changes = sum(previous != k for previous, k in zip([before, *chosen], chosen) if previous is not None)
    return len(chosen) / (sum(max(true.values()) / true[k] for k in chosen) + switch_cost * changes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=300)
    parser.add_argument("--noise", type=float, nargs="+", default=[0.05, 0.10, 0.15], help="log-normal sigma of one rollout's speed")
    parser.add_argument("--traces", type=Path, nargs="*", default=[], help="machines measured by benchmarks.machine_speed --save: auto told its probe or not")
    parser.add_argument("--probe-tracking", type=float, help="with --traces: probe readings made from the rollouts' slowness, tracked at this power")
    parser.add_argument("--slow-start", action="store_true", help="runs' first rollouts slowed and the profile favouring drafts (module docstring)")
    parser.add_argument("--switch-cost", type=float, default=0.0, help="a change of k, as a fraction of the best k's rollout (default recipe on a CPU: 0.12)")
    parser.add_argument("--prior-noise", type=float, default=0.0, help="log-normal sigma of each k's profiled step cost (this CPU's profiles: about 0.07)")
    parser.add_argument("--first-slow", type=float, default=0.0, help="a context's first rollout this fraction slower (the rollout benchmark's cells on 2026-12-07: 0.1-0.2)")
    parser.add_argument("--slow-rollouts", type=int, default=1, help="with --first-slow: this many of the context's first rollouts slower (2026-12-07, afternoon: all three looks of a loaded cell)")
    parser.add_argument("--rules", nargs="+", help="only these rules (their column names)")
    parser.add_argument("--drafts-profiled-at", type=float, default=1.0, help="a drafting k's profiled step cost over its true cost (2026-12-07: k = 0's misread 1.3-1.6x, i.e. about 0.7)")
    args = parser.parse_args()
    if args.traces:
        trace_table(args.traces, args.probe_tracking, args.switch_cost, args.slow_start, args.prior_noise)
        return
    rules = {"auto": AdaptiveSpeculation, "as before 2026-12-07": BeforeDecember7, "every switch confirmed": ConfirmingEverySwitch,
             "rechecked against the best alone": RecheckedAgainstTheBestAlone, "the first rollout's k looked at late": OpeningLookedAtLate,
             "the opening's second look unanswered": OpeningLookUnanswered, "the opening looked at when close": OpeningLookedAtWhenClose,
             "without confirmation": WithoutConfirmation, "without rechecks": WithoutRechecks,
             "plausible k looked at only": PlausibleLooksOnly,
             "without the second look at k = 0": WithoutSecondLookAtZero,
             "without the second look at the prior's best": WithoutSecondLookAtPriorsBest,
             "the prior's best first": PriorsBestFirst, "look back": LookBack, "like for like": LikeForLike, "second look": SecondLook}  # fmt: skip
    rules = {name: rule for name, rule in rules.items() if not args.rules or name in args.rules}
    slow = "; runs start slow, the profile favouring drafts" if args.slow_start else ""
    first = f"; a context's first {args.slow_rollouts} rollout(s) {args.first_slow:.0%} slower" if args.first_slow else ""
    first += f"; drafting steps profiled at {args.drafts_profiled_at}x their cost" if args.drafts_profiled_at != 1.0 else ""
    print(f"A change of k costs {args.switch_cost} of a rollout{slow}{first}; the profile off by {args.prior_noise} (log-normal).\n")
    print("| case | noise | " + " | ".join(f"{name}: rollouts 4-8 mean (p10), run" for name in rules) + " |")
    print("|---|---|" + "---|" * len(rules))
    for case, true in CASES.items():
        for noise in args.noise:
            cells = []
            for rule in rules.values():
                runs = [run(rule, true, noise, seed, args.switch_cost, args.slow_start, args.prior_noise, first_slow=args.first_slow, drafts_profiled_at=args.drafts_profiled_at, slow_rollouts=args.slow_rollouts)
                        for seed in range(args.seeds)]
                cells.append(summary(true, runs, args.switch_cost))
            print(f"| {case} | {noise:.2f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
