"""How fast the machine ran during a rollout, read from a fixed probe timed beside the engine's
steps, so that ``auto`` (:mod:`auto_k`) can compare rollouts of different k run seconds or
minutes apart.

Why: on a CPU a rollout's CPU seconds move with the machine's speed, not only with its work. On the
2-core VM this project is built on, the same rollout at one k took 1.9 s or 2.7 s of CPU time as
the machine switched between a fast and a slow state every few rollouts (and 4.4-6.9 s at twice the
length); auto runs one k at a time (one engine within the memory budget), so a k looked at once in
a slow spell kept a low estimate. A small fixed workload timed on the same clock moves with the
rollouts (correlation 0.87-0.94 in four runs of 60-300 rollouts, 0.71 in one of 30), if not by as
much: a rollout's seconds move as the probe's to a power of 0.45-0.8 at k = 0 and k = 2 with
untrained heads, and about 0.4 with heads that are always accepted at k = 2 (fitted per run).
``speed`` takes the probe's seconds to a power just below the lowest, ``TRACKING`` = 0.35, so that
a rollout in a slow spell is not read faster than it would have run at full speed: auto estimates a
k by the fastest of its last three rollouts, which would keep such an over-read (with 0.75, in the
rollout benchmark, a look at k = 0 so read beat the k = 2 that was 13% faster). Where rollouts
track the probe more closely part of the drift stays, and the fastest of three leaves it out as
before. Replaying auto on four measured traces of this machine in three cases each
(``benchmarks/auto_k_noise_simulation.py --traces``), read so it realised as much of the best fixed
k as with the raw seconds or more in 11 of 12 (0.5 points less in one), up to 1.4 points more over
a run and 1.7 in its rollouts 4-8. ``benchmarks/machine_speed.py`` measures the spread of the same
rollouts both ways and fits the power.

The probe is a chain of small tensor operations (about 0.4 ms) on the clock the rollouts are
timed with, run whenever the steps since the last probe took ``1 / PROBE_SHARE`` times the
probe's own seconds: its cost is ``PROBE_SHARE`` of the stepped time, whatever the rollouts'
length. It runs across rollouts (one probe per engine), and a rollout is read by the median of the
probes during it or, where it had fewer than ``READING_SAMPLES`` (a short rollout), of the latest
``READING_SAMPLES``: the machine's states last seconds, so the probes just before a short rollout
tell its speed. On a GPU a rollout is timed by the wall clock on the device's work, which a CPU
probe does not track: no probe runs there (:func:`applies`).
"""

from __future__ import annotations

import collections
import statistics

import torch

# The probe: PROBE_LINKS links of a chain, each a [32, 64] x [64, 256] product, an activation, a
# slice and an add: small operations, as a small model's decode step is made of.
PROBE_ROWS, PROBE_WIDTH = 32, 64
PROBE_LINKS = 12
# Probes take this share of the stepped seconds.
PROBE_SHARE = 0.005
# A rollout with fewer probes during it is read by this many of the latest.
READING_SAMPLES = 3
# A rollout's seconds move as the probe's to this power (module docstring).
TRACKING = 0.35


def applies() -> bool:
    """Whether rollouts are timed on the CPU's clock (no GPU), where the probe tracks them."""
    from nemo_rl_mtp.megatron_compat.cpu.training_runtime import cuda_available

    return not cuda_available()


def speed(probe_seconds: float, reference_probe_seconds: float) -> float:
    """The machine's speed when the probe took ``probe_seconds`` relative to when it took
    ``reference_probe_seconds``: a rollout's seconds there over its seconds here."""
    return (reference_probe_seconds / probe_seconds) ** TRACKING


class SpeedProbe:
    """The probe for one engine's rollouts, timed on ``clock`` (the clock their steps are timed
    with): the rollouts report their steps, and take a reading as they finish."""

    def __init__(self, clock):
        self.clock = clock
        generator = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(PROBE_ROWS, PROBE_WIDTH, generator=generator)
        self.weight = torch.randn(PROBE_WIDTH, 4 * PROBE_WIDTH, generator=generator) / PROBE_WIDTH**0.5
        self.samples: collections.deque = collections.deque(maxlen=256)
        self.taken = 0  # probes ever run
        self.stepped_since_probe = 0.0
        # Once untimed: in a fresh process the first run took 2-3x the next ones (its kernels'
        # set-up), and the first timed probe is the reference auto reads every rollout against.
        self._workload()

    def _workload(self) -> torch.Tensor:
        hidden = self.inputs
        for _ in range(PROBE_LINKS):
            hidden = torch.nn.functional.silu(hidden @ self.weight)[:, :PROBE_WIDTH] * 0.5 + self.inputs
        return hidden

    def probe(self) -> None:
        """Time the fixed workload once."""
        start = self.clock()
        self._workload()
        self.samples.append(self.clock() - start)
        self.taken += 1
        self.stepped_since_probe = 0.0

    def after_step(self, step_seconds: float) -> None:
        """Count an engine step's seconds; probe if none ran yet or if the steps since the last
        probe took enough that this one costs ``PROBE_SHARE`` of them."""
        self.stepped_since_probe += step_seconds
        if not self.samples or self.stepped_since_probe * PROBE_SHARE >= self.samples[-1]:
            self.probe()

    def reading(self, taken_before: int) -> float | None:
        """The probe's seconds for a rollout that began when ``taken`` was ``taken_before``: the
        median of the probes since, or of the latest ``READING_SAMPLES`` if fewer ran since
        (None before any probe)."""
        if not self.samples:
            return None
        during = min(self.taken - taken_before, len(self.samples))
        return statistics.median(list(self.samples)[-max(during, READING_SAMPLES) :])
