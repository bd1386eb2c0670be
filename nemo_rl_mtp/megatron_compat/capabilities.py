"""What the installed megatron-core and megatron-bridge can do for a config: each probe, and the
one place they are asked (:func:`check_installed_release`), once per config, after the pure checks
(``config.checks``, ``tasks.config_checks``) and before any model is built or worker started.

Every refusal is one line naming the key, its value and the release (the release gates of the
test suite, ``tests/release_gates.py``, skip a test on exactly these lines). Probes read what the
release has (a module, a dataclass field, a signature), never its version string. This module
imports megatron only inside the probes, so importing it stays cheap; asking it does not.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect

from nemo_rl_mtp.config.checks import ConfigError
from nemo_rl_mtp.config.schema import GLOBAL_BATCH_AUX_LOSS
from nemo_rl_mtp.megatron_compat import engine_release
from nemo_rl_mtp.megatron_compat.installed import megatron_core_version


def check_installed_release(cfg) -> None:
    """Raise ConfigError, one line naming key, value and release, where the installed releases
    cannot run ``cfg``: megatron-bridge for an imported checkpoint; MTP features and loss types,
    the MoE trunk, HybridModel and speculative decoding for the model (once its MTP layer count
    is known: with a checkpoint's, again after ``resolve_checkpoint_keys``)."""
    policy = cfg.policy
    megatron_cfg = policy.megatron_cfg
    if policy.model_name is not None:
        check_bridge_imports(policy.model_name)
    if megatron_cfg.mtp_num_layers is None:  # from the checkpoint: asked again once resolved
        return
    try:
        check_mtp_features_supported(megatron_cfg)
        check_moe_supported(megatron_cfg)
        if megatron_cfg.model_class == "hybrid":
            check_hybrid_supported()
        check_speculation_release(policy.generation, megatron_cfg)
    except ConfigError:
        raise
    except ValueError as error:
        raise ConfigError(str(error)) from None


def check_bridge_imports(model_name: str) -> None:
    """An imported checkpoint goes through megatron-bridge, which does not import on every
    megatron-core release: refused in one line here rather than when the driver opens it."""
    from nemo_rl_mtp.megatron_compat.megatron_bridge import bridge_unavailable

    reason = bridge_unavailable()
    if reason is not None:
        raise ConfigError(f"policy.model_name={model_name}: {reason}; build the model from scratch (policy.model_name=null) or use megatron-core >= 0.18")


def check_speculation_release(generation_cfg, megatron_cfg) -> None:
    """Raise ValueError, one line naming the key and the release, where the installed engine cannot
    speculate as configured (no speculative decoding, or fewer drafts with a repeated MTP layer
    than asked); how many drafts the model's heads allow is ``config.checks.check_speculation_depth``'s."""
    unsupported = engine_release.unsupported_generation(generation_cfg, megatron_cfg)
    if unsupported is not None:
        raise ValueError(unsupported)


def multi_latent_attention_refusal(key: str, value, spec_builder: str) -> str:
    """The one line for a model with multi-latent attention that is about to be built from the
    local spec (``spec_builder``: who builds it, and why local): megatron-core has MLA only in its
    transformer_engine spec. The driver says it for an imported checkpoint, a worker for its own
    build (where ``auto`` resolved to local)."""
    return (
        f"{key}={value}: the model uses multi-latent attention, which megatron-core builds only with transformer_engine, "
        f"and {spec_builder} builds the local spec"
    )


def unsupported_mtp_features(megatron_cfg) -> list[str]:
    """Requested MTP features the installed megatron-core's TransformerConfig lacks (no shim
    provides them). Turned-off features are fine: a release without the field behaves as off."""
    if not megatron_cfg.mtp_num_layers:
        return []
    requested = [key for key in ("mtp_use_repeated_layer", "mtp_detach_heads") if megatron_cfg[key]]
    if not requested:
        return []
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {field.name for field in dataclasses.fields(TransformerConfig)}
    return [key for key in requested if key not in fields]


def check_mtp_features_supported(megatron_cfg) -> None:
    """Raise before any worker starts if the config asks for an MTP feature this release lacks."""
    if megatron_cfg.mtp_num_layers and megatron_cfg.mtp_loss_type != "cross_entropy":
        from nemo_rl_mtp.megatron_compat import mtp_loss_callable  # imports megatron-core

        reason = mtp_loss_callable.unsupported_reason()
        if reason is not None:
            raise ValueError(
                f"policy.megatron_cfg.mtp_loss_type={megatron_cfg.mtp_loss_type} is not supported by the installed "
                f"megatron-core {megatron_core_version()}: {reason}; use mtp_loss_type=cross_entropy"
            )
    missing = unsupported_mtp_features(megatron_cfg)
    if missing:
        raise ValueError(
            f"policy.megatron_cfg: {', '.join(f'{key}=true' for key in missing)} is not supported by the "
            f"installed megatron-core {megatron_core_version()} (its TransformerConfig has no such field); "
            "set it to false or install a megatron-core release that has it "
            "(mtp_use_repeated_layer: >= 0.17, mtp_detach_heads: >= 0.19)"
        )


# megatron-core's MoE metrics tracker (0.18 on), from which a step reads the load-balancing loss.
MOE_METRICS_MODULE = "megatron.core.transformer.moe.moe_logging"


def check_moe_supported(megatron_cfg) -> None:
    """Raise ValueError, one line naming the key and the release, where the installed megatron-core
    cannot run the configured MoE trunk: before 0.18 it has no MoE metrics tracker; before 0.19
    its schedule reads no ``moe_grad_scale_func``
    (the load-balancing loss cannot be normalised), or the router's private names the global load
    statistics reach are gone or changed (:func:`router_names_changed`)."""
    from megatron.core.pipeline_parallel import schedules

    if not megatron_cfg.num_moe_experts:
        return
    try:
        importlib.import_module(MOE_METRICS_MODULE)
    except ModuleNotFoundError:
        raise ValueError(
            f"policy.megatron_cfg.num_moe_experts={megatron_cfg.num_moe_experts}: megatron-core {megatron_core_version()} "
            f"has no MoE metrics tracker ({MOE_METRICS_MODULE}), from which a training step reads "
            "the routers' load-balancing loss; set it to 0 or use megatron-core >= 0.18"
        ) from None
    if megatron_cfg.moe_aux_loss_coeff > 0 and not hasattr(schedules, "_get_moe_loss_scale"):
        raise ValueError(
            f"policy.megatron_cfg.moe_aux_loss_coeff={megatron_cfg.moe_aux_loss_coeff}: megatron-core "
            f"{megatron_core_version()}'s schedule has no moe_grad_scale_func, so the load-balancing loss cannot be "
            "normalised like the policy loss (megatron-core >= 0.19 can); set it to 0 or upgrade"
        )
    changed = router_names_changed() if megatron_cfg.moe_router_load_balancing_type == GLOBAL_BATCH_AUX_LOSS else []
    if changed:
        raise ValueError(
            f"policy.megatron_cfg.moe_router_load_balancing_type={GLOBAL_BATCH_AUX_LOSS}: megatron-core "
            f"{megatron_core_version()}'s router changed what the global load statistics reach ({'; '.join(changed)}); "
            "use aux_loss or adapt nemo_rl_mtp/training/moe.py"
        )


# TopKRouter's private or positional names the global load statistics reach, with the parameters
# they need (by name): the aux loss replaced per router, the padding mask the token counts read,
# the loss attached with a valid-token count.
ROUTER_METHODS = {
    "_apply_global_aux_loss": ["probs", "scores_for_aux_loss", "routing_map"],
    "forward": ["padding_mask"],
    "attach_and_log_load_balancing_loss": ["activation", "aux_loss_coeff", "aux_loss", "aux_loss_name", "reduce_group", "valid_token_count"],
    "get_aux_loss_coeff": ["aux_loss_type"],
}


def router_names_changed() -> list[str]:
    """What of ``ROUTER_METHODS`` the installed ``TopKRouter`` lacks (gone, or a parameter gone)."""
    from megatron.core.transformer.moe.router import TopKRouter

    problems = []
    for name, needed in ROUTER_METHODS.items():
        method = getattr(TopKRouter, name, None)
        if not callable(method):
            problems.append(f"TopKRouter.{name} (gone)")
            continue
        parameters = inspect.signature(method).parameters
        if not set(needed) <= set(parameters):
            problems.append(f"TopKRouter.{name} (no parameter {sorted(set(needed) - set(parameters))[0]}; parameters now {list(parameters)})")
    return problems


def check_hybrid_supported() -> None:
    """Raise ValueError (one line, naming the key) where the installed megatron-core cannot train a
    HybridModel's MTP layers in RL mode: no HybridModel taking MTP depths in its layer pattern
    (before 0.18), or a ``process_mtp_loss`` that cannot derive the MTP labels from ``input_ids``
    (0.18: HybridModel would skip its MTP loss with ``labels=None``; the ``rl_labels`` shim covers
    GPTModel only). Probed by signature."""
    try:
        from megatron.core.models.hybrid.hybrid_model import HybridModel
    except ImportError:
        HybridModel = None
    if HybridModel is None or "hybrid_layer_pattern" not in inspect.signature(HybridModel).parameters:
        missing = "a HybridModel with MTP layers in its hybrid_layer_pattern (megatron.core.models.hybrid)"
    else:
        from megatron.core.transformer import multi_token_prediction

        process_mtp_loss = getattr(multi_token_prediction, "process_mtp_loss", None)
        if process_mtp_loss is not None and "input_ids" in inspect.signature(process_mtp_loss).parameters:
            return
        missing = "a process_mtp_loss that takes input_ids (HybridModel's MTP loss in RL mode, labels=None)"
    raise ValueError(
        f"policy.megatron_cfg.model_class=hybrid: the installed megatron-core {megatron_core_version()} lacks {missing}; "
        "use model_class=gpt or megatron-core >= 0.19"
    )
