"""How fast the machine ran during a rollout, read from a fixed probe timed beside the engine's
steps, so that ``auto`` (:mod:`auto_k`) can compare rollouts of different k run seconds or
minutes apart.

Why: on a CPU a rollout's CPU seconds move with the machine's speed, not only with its work. On
the 2-core VM this project is built on, the same rollout at one k took 1.9 s or 2.7 s of CPU time
as the machine switched between a fast and a slow state every few rollouts (and 4.4-6.9 s at
twice the length); auto runs one k at a time (one engine within the memory budget), so a k
looked at once in a slow spell kept a low estimate. A small fixed workload timed on the same
clock moves with the rollouts (correlation 0.86-0.96 in four runs of 14-30 rollouts), if not by
as much: a rollout's seconds move as the probe's to a power of 0.6-0.9 (fitted per run), so
``speed`` takes them to ``TRACKING`` = 0.75, and the rollouts' seconds read so spread about 5%
where as measured they spread 10-16% (``benchmarks/machine_speed.py`` measures both, and fits
the power).

The probe is a chain of small tensor operations (about 0.4 ms), run as the rollout begins and as
it finishes, and between whenever the rollout's steps since the last probe took ``1 /
PROBE_SHARE`` times the probe's own seconds: about 1% of a 0.3 s rollout, under 0.6% of a
second's. On a GPU a rollout is timed by the wall clock on the device's work, which a CPU probe
does not track: no probe runs there (:func:`applies`).
"""

from __future__ import annotations

import statistics

import torch

# The probe: PROBE_LINKS links of a chain, each a [32, 64] x [64, 256] product, an activation, a
# slice and an add: small operations, as a small model's decode step is made of.
PROBE_ROWS, PROBE_WIDTH = 32, 64
PROBE_LINKS = 12
# Between the first and the last probe, probes take at most this share of the stepped seconds.
PROBE_SHARE = 0.005
# A rollout's seconds move as the probe's to this power (module docstring).
TRACKING = 0.75


def applies() -> bool:
    """Whether rollouts are timed on the CPU's clock (no GPU), where the probe tracks them."""
    from nemo_rl_mtp.megatron_compat.cpu.training_runtime import cuda_available

    return not cuda_available()


def speed(probe_seconds: float, reference_probe_seconds: float) -> float:
    """The machine's speed when the probe took ``probe_seconds`` relative to when it took
    ``reference_probe_seconds``: a rollout's seconds there over its seconds here."""
    return (reference_probe_seconds / probe_seconds) ** TRACKING


class SpeedProbe:
    """The probe for one rollout, timed on ``clock`` (the clock its steps are timed with): the
    caller probes as the rollout begins and finishes and reports each step in between."""

    def __init__(self, clock):
        self.clock = clock
        generator = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(PROBE_ROWS, PROBE_WIDTH, generator=generator)
        self.weight = torch.randn(PROBE_WIDTH, 4 * PROBE_WIDTH, generator=generator) / PROBE_WIDTH**0.5
        self.samples: list[float] = []
        self.stepped_since_probe = 0.0

    def probe(self) -> None:
        """Time the fixed workload once."""
        start = self.clock()
        hidden = self.inputs
        for _ in range(PROBE_LINKS):
            hidden = torch.nn.functional.silu(hidden @ self.weight)[:, :PROBE_WIDTH] * 0.5 + self.inputs
        self.samples.append(self.clock() - start)
        self.stepped_since_probe = 0.0

    def after_step(self, step_seconds: float) -> None:
        """Count an engine step's seconds; probe if the steps since the last probe took enough
        that this probe costs at most ``PROBE_SHARE`` of them."""
        self.stepped_since_probe += step_seconds
        if self.stepped_since_probe * PROBE_SHARE >= self.samples[-1]:
            self.probe()

    def seconds(self) -> float:
        """The probe's median seconds over this rollout."""
        return statistics.median(self.samples)
