"""Compat shims that make RL-mode MTP training work on every released megatron-core with MTP.

RL mode is ``model(..., labels=None, loss_mask=mtp_loss_mask)``: megatron-core 0.19 derives the MTP
labels by rolling ``input_ids``. Older releases do not (0.17/0.18 silently skip the MTP loss, 0.16
crashes), 0.18 breaks full recompute with a ``padding_mask`` keyword, 0.14-0.17 break full
recompute with packed sequences, releases before 0.19 ignore ``config.mtp_grad_scale_func``, and
releases before 0.19 track no MTP acceptance. On every release, megatron computes the MTP loss
inside the model forward, before the policy's logits exist; mtp_loss_callable makes it reachable
for the acceptance forecast and the losses on the policy's distribution.

Each shim probes the installed megatron-core by signature or attribute (never by version
string), switches itself off where upstream has the fix, is idempotent, and says what it did.
``apply_mtp_compat_shims()`` applies them all once, at model setup.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from nemo_rl_mtp.megatron_compat import grad_scale
from nemo_rl_mtp.megatron_compat.installed import megatron_core_version
from nemo_rl_mtp.megatron_compat import metrics_tracker
from nemo_rl_mtp.megatron_compat import mtp_loss_callable
from nemo_rl_mtp.megatron_compat import recompute
from nemo_rl_mtp.megatron_compat import rl_labels
from nemo_rl_mtp.metrics import MTP_TARGET_TOKENS

logger = logging.getLogger(__name__)

SHIMS = (
    ("metrics_tracker", metrics_tracker),
    ("rl_labels", rl_labels),
    ("grad_scale", grad_scale),
    ("recompute", recompute),
    ("mtp_loss_callable", mtp_loss_callable),
)


@dataclass(frozen=True)
class ShimOutcome:
    """``applied``: installed now or earlier in this process; ``skipped``: upstream is fine."""

    name: str
    status: str  # "applied" | "skipped"
    detail: str


def apply_mtp_compat_shims() -> list[ShimOutcome]:
    """Apply every shim the installed megatron-core needs; log one line per shim."""
    outcomes = []
    for name, shim in SHIMS:
        needed, reason = shim.probe()
        if needed:
            outcomes.append(ShimOutcome(name, "applied", shim.apply()))
        else:
            outcomes.append(ShimOutcome(name, "skipped", reason))
    applied = sum(outcome.status == "applied" for outcome in outcomes)
    logger.info(
        "megatron-core %s: %d of %d MTP compat shims applied", megatron_core_version(), applied, len(outcomes)
    )
    for outcome in outcomes:
        logger.info("  %-15s %-7s %s", outcome.name, outcome.status, outcome.detail)
    return outcomes


def log_shim_coverage(model) -> None:
    """After the model is built: how many MTP layers the class-level shims cover."""
    mtp_block = getattr(model, "mtp", None)
    num_layers = len(mtp_block.layers) if mtp_block is not None else 0
    active = [name for name, shim in SHIMS if shim.is_applied()]
    if active:
        logger.info("MTP compat shims %s cover the %d MTP layer module(s) of this model", active, num_layers)


def assert_mtp_trained(
    config,
    mtp_metrics: dict,
    mtp_grad_norm: float,
    global_valid_tokens: float,
    frozen: bool = False,
    warned: set | None = None,
) -> None:
    """Fail loudly when MTP is configured but a step computed no MTP loss or no MTP gradient (the
    silent failure of megatron-core 0.17/0.18 in RL mode; no gradient is expected of ``frozen``
    heads); warn, naming them, about MTP layers that had no target in the step, once per set of
    layers among ``warned`` (the warnings a policy has given; None: warn every time)."""
    version = megatron_core_version()
    if not mtp_metrics:
        raise RuntimeError(
            f"MTP is configured (mtp_num_layers={config.mtp_num_layers}) but this training step computed "
            f"no MTP loss (empty MTPLossLoggingHelper tracker) on megatron-core {version}. The MTP heads "
            "are not training; check the MTP compat shim log lines at model setup."
        )
    _warn_about_layers_without_targets(mtp_metrics, global_valid_tokens, set() if warned is None else warned)
    if not frozen and mtp_grad_norm == 0.0 and global_valid_tokens > 0 and config.mtp_loss_scaling_factor > 0:
        raise RuntimeError(
            f"MTP is configured (mtp_num_layers={config.mtp_num_layers}) but its parameters got no gradient "
            f"in a step with {global_valid_tokens:.0f} valid tokens on megatron-core {version}. The MTP heads "
            "are not training; check the MTP compat shim log lines at model setup."
        )


def layers_without_targets(mtp_metrics: dict) -> list[int]:
    """MTP layers (1-indexed) that predicted no masked position in the step."""
    return [
        layer for key, count in mtp_metrics.items() if (layer := MTP_TARGET_TOKENS.index(key)) is not None and count == 0
    ]


def _warn_about_layers_without_targets(mtp_metrics: dict, global_valid_tokens: float, warned: set) -> None:
    """A warning per new set of silent layers, not per step."""
    silent = tuple(layers_without_targets(mtp_metrics))
    if silent and global_valid_tokens > 0 and ("mtp_layers_without_targets", silent) not in warned:
        warned.add(("mtp_layers_without_targets", silent))
        logger.warning(
            "MTP layers %s got no targets in this step (every response ends before their depth): they train "
            "nothing, and their loss 0 and acceptance 0%% mean nothing",
            list(silent),
        )
