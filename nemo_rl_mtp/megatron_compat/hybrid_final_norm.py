"""HybridStack's final norm where transformer_engine is absent (megatron-core 0.18.2, 0.19.2).

``HybridStack`` builds its final norm as ``TENorm(...)``, a name ``hybrid_block`` imports from
megatron's transformer_engine extension, whatever the spec says; without transformer_engine
``TENorm`` raises ImportError, so no HybridModel builds on a CPU. While a HybridModel is built
(:func:`local_final_norm`), ``hybrid_block.TENorm`` builds the norm megatron's own
``TransformerBlock`` builds there (``transformer_block.LayerNormImpl``: torch's, or apex's), so
its final norm is the final norm of the equivalent GPTModel; afterwards the name is put back.

Probe (behaviour): build an empty HybridStack, final norm included. If it builds (transformer_engine
present, or a release that no longer hard-codes TENorm), nothing is patched. If it fails while
``hybrid_block`` still names ``TENorm``, the stand-in is installed for the build; if that name is
gone, the build stops with one line naming it.
"""

from __future__ import annotations

import contextlib
import logging

from megatron.core.models.hybrid import hybrid_block

from nemo_rl_mtp.megatron_compat._marks import is_shim, mark_shim

logger = logging.getLogger(__name__)


def probe(config) -> tuple[bool, str]:
    """(needed, why) for the model's TransformerConfig ``config``; raises where HybridStack's
    final norm cannot be built and the name this patch replaces is gone."""
    if is_shim(getattr(hybrid_block, "TENorm", None)):
        return True, "installed by an enclosing build"
    try:
        _empty_stack(config)
    except (ImportError, NameError) as error:  # NameError: the module no longer defines TENorm
        if not hasattr(hybrid_block, "TENorm"):
            raise RuntimeError(
                f"megatron-core's HybridStack cannot build its final norm here ({error}) and hybrid_block.TENorm, "
                "which nemo_rl_mtp's hybrid_final_norm patch replaces, is gone; model_class=hybrid needs adapting to this release"
            ) from None
        return True, f"HybridStack builds its final norm with TENorm, which needs transformer_engine ({error})"
    return False, "HybridStack builds its final norm here (transformer_engine present, or upstream no longer hard-codes TENorm)"


def _empty_stack(config):
    from megatron.core.process_groups_config import ProcessGroupCollection

    return hybrid_block.HybridStack(
        config,
        hybrid_block.HybridStackSubmodules(),
        layer_type_list=[],
        post_process=True,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "pp"]),
    )


def local_final_norm_class():
    """The norm megatron's TransformerBlock builds its final norm with on this machine."""
    from megatron.core.transformer import transformer_block

    return transformer_block.LayerNormImpl


@contextlib.contextmanager
def local_final_norm(config):
    """For the duration (a HybridModel's construction): ``hybrid_block.TENorm`` builds the local
    norm where the probe says it must; logged; nests; put back whatever happens."""
    needed, reason = probe(config)
    original = hybrid_block.TENorm if hasattr(hybrid_block, "TENorm") else None
    if not needed or is_shim(original):
        logger.info("hybrid_final_norm %s: %s", "skipped" if not needed else "active", reason)
        yield
        return
    norm_class = local_final_norm_class()

    def final_norm(config, hidden_size, eps=1e-5, **kwargs):
        return norm_class(config=config, hidden_size=hidden_size, eps=eps)

    hybrid_block.TENorm = mark_shim(final_norm, original)
    logger.info("hybrid_final_norm applied: HybridStack's final norm is %s while the model is built (%s)", norm_class.__name__, reason)
    try:
        yield
    finally:
        hybrid_block.TENorm = original
