"""megatron-bridge (Hugging Face <-> megatron conversion) on a machine without transformer_engine,
with MTP layers built from megatron-core's local spec.

Two patches, each probed by behaviour, idempotent, logged, and off where they are not needed:

* ``te_stand_in``: ``megatron.bridge.peft.lora_layers`` imports ``transformer_engine.pytorch`` at
  import time (its annotations name TE classes), and everything in ``megatron.bridge`` imports it.
  TE needs CUDA. A fake ``transformer_engine`` in ``sys.modules`` would break megatron-core, which
  would then believe TE is installed. Instead, while ``megatron.bridge`` is first imported, that
  one module alone is shown a stand-in: inert classes for its annotations and isinstance checks
  (LoRA on TE layers, which conversion never reaches). Active only where ``transformer_engine``
  is not installed, and logged only where that module did import it: the bridge is imported with
  the stand-in at once, as a failed import retried with it cost about 1.2 s more.
* ``mtp_norm_alias``: ``MegatronMappingRegistry`` maps the TE-fused norm names
  (``self_attention.linear_qkv.layer_norm_weight``) onto the local spec's separate norms
  (``input_layernorm.weight``) only for patterns ending in ``*.<name>``; MTP patterns end in
  ``*.mtp_model_layer.<name>``, so the MTP layer's norms have no mapping and loading stops with
  ``'NoneType' object has no attribute 'megatron_module'``. Applied when a registry built with one
  such MTP mapping does not resolve the local name.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import importlib.metadata
import logging
import sys

from nemo_rl_mtp.megatron_compat._marks import is_shim, mark_shim
from nemo_rl_mtp.megatron_compat.installed import megatron_core_version, transformer_engine_installed

logger = logging.getLogger(__name__)

LORA_MODULE = "megatron.bridge.peft.lora_layers"
_MTP_NORM_PROBE = ("mtp.layers.*.mtp_model_layer.self_attention.linear_qkv.layer_norm_weight", "mtp.layers.0.mtp_model_layer.input_layernorm.weight")


def import_megatron_bridge():
    """``megatron.bridge`` with the patches this machine needs, each logged once."""
    if "megatron.bridge" in sys.modules and hasattr(sys.modules["megatron.bridge"], "AutoBridge"):
        return sys.modules["megatron.bridge"]
    with root_logging_kept():
        if transformer_engine_installed():
            bridge, stand_in_shown = importlib.import_module("megatron.bridge"), False
        else:
            bridge, stand_in_shown = _import_with_te_stand_in()
    if stand_in_shown:
        logger.info("megatron-bridge: %s imports transformer_engine, which is absent; shown an inert stand-in (te_stand_in)", LORA_MODULE)
    else:
        logger.debug("megatron-bridge imported without the transformer_engine stand-in (te_stand_in not needed)")
    apply_mtp_norm_alias()
    return bridge


def _import_with_te_stand_in():
    """``megatron.bridge`` imported while :data:`LORA_MODULE` is shown the stand-in, and whether
    that module asked for it. Loud where another module needs transformer_engine."""
    with te_stand_in_for(LORA_MODULE) as stand_in:
        try:
            bridge = importlib.import_module("megatron.bridge")
        except ModuleNotFoundError as error:
            if not (error.name or "").startswith("transformer_engine"):
                raise
            raise RuntimeError(
                f"megatron-bridge imports {error.name} from a module other than {LORA_MODULE}, the one te_stand_in "
                "covers; this megatron-bridge release needs transformer_engine elsewhere"
            ) from error
    return bridge, bool(stand_in.imports)


def bridge_unavailable() -> str | None:
    """Why megatron-bridge cannot serve the installed megatron-core (None: it imports). megatron-
    bridge 0.6.2 imports names that megatron-core 0.17 and earlier lack (``_rank_utils.
    safe_get_world_size``); such a release gets one line naming both, before any worker starts."""
    try:
        import_megatron_bridge()
    except ImportError as error:
        return (
            f"megatron-bridge {importlib.metadata.version('megatron-bridge')} does not import on megatron-core "
            f"{megatron_core_version()} ({error})"
        )
    return None


@contextlib.contextmanager
def root_logging_kept():
    """The root logger's handlers and level as they were: importing megatron-bridge imports
    ``megatron.training.training``, whose import calls ``logging.basicConfig`` (INFO, stdout),
    which would print every library's INFO lines in a process that had not configured logging."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        if root.handlers != handlers or root.level != level:
            root.handlers[:] = handlers
            root.setLevel(level)
            logger.debug("megatron-bridge's import configured the root logger; restored it")


class _InertMeta(type):
    """Classes whose every attribute is another inert class: enough for annotations
    (``te.ops.Sequential``) and ``isinstance`` checks, which no real object ever passes."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        child = _InertMeta(f"{cls.__name__}.{name}", (), {"__module__": "transformer_engine (stand-in)"})
        setattr(cls, name, child)
        return child

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"{cls.__name__}: transformer_engine is not installed (megatron-bridge's TE LoRA path needs it)")


class TEStandIn:
    """What :func:`te_stand_in_for` shows: ``module``, the inert ``transformer_engine``, and
    ``imports``, the names imported from it while active (none: the importer never asked)."""

    def __init__(self) -> None:
        self.module = _InertMeta("transformer_engine", (), {"__module__": "transformer_engine (stand-in)"})
        self.imports: list[str] = []


@contextlib.contextmanager
def te_stand_in_for(importer: str):
    """While active, ``import transformer_engine...`` executed by module ``importer`` (and by no
    other module) yields the inert stand-in; ``sys.modules`` is never touched. Yields the
    :class:`TEStandIn`."""
    original_import = builtins.__import__
    stand_in = TEStandIn()

    def scoped_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and name.split(".")[0] == "transformer_engine" and (globals or {}).get("__name__") == importer:
            stand_in.imports.append(name)
            return stand_in.module
        return original_import(name, globals, locals, fromlist, level)

    builtins.__import__ = scoped_import
    try:
        yield stand_in
    finally:
        builtins.__import__ = original_import


def mtp_norm_alias_needed() -> bool:
    """Whether a registry holding one TE-named MTP norm mapping fails to resolve the local name."""
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.conversion.param_mapping import AutoMapping

    pattern, local_name = _MTP_NORM_PROBE
    registry = MegatronMappingRegistry(AutoMapping(megatron_param=pattern, hf_param="model.mtp_layers.*.input_layernorm.weight"))
    return registry.megatron_to_hf_lookup(local_name) is None


def apply_mtp_norm_alias() -> str:
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry

    method = getattr(MegatronMappingRegistry, "_add_separate_layernorm_mappings", None)
    if method is not None and is_shim(method):
        return "already installed (idempotent)"
    if not mtp_norm_alias_needed():
        logger.info("megatron-bridge: MTP layer norms resolve under the local spec (mtp_norm_alias not needed)")
        return "not needed"
    if method is None or not hasattr(MegatronMappingRegistry, "_SEPARATE_LAYERNORM_REWRITES"):
        raise RuntimeError(
            "megatron-bridge: MTP layer norms do not resolve under the local spec, and MegatronMappingRegistry has no "
            "_add_separate_layernorm_mappings/_SEPARATE_LAYERNORM_REWRITES for mtp_norm_alias to extend (renamed upstream)"
        )
    MegatronMappingRegistry._add_separate_layernorm_mappings = mark_shim(_with_nested_norm_aliases(method), method)
    if mtp_norm_alias_needed():
        raise RuntimeError(
            "megatron-bridge: MegatronMappingRegistry._add_separate_layernorm_mappings was patched but MTP layer norms "
            "still do not resolve; this megatron-bridge release changed how norm aliases are built"
        )
    logger.info("megatron-bridge: norm aliases extended to MTP layers (*.mtp_model_layer.<norm>) for the local spec (mtp_norm_alias)")
    return "applied"


def _with_nested_norm_aliases(original):
    """``original``, then the same TE -> local norm aliases for patterns whose norm name follows
    a named submodule (``*.mtp_model_layer.<name>``) rather than a layer index."""

    def _add_separate_layernorm_mappings(self) -> None:
        from megatron.bridge.models.conversion.param_mapping import AutoMapping

        original(self)
        existing = {mapping.megatron_param for mapping in self.mappings}
        for mapping in list(self.mappings):
            if not isinstance(mapping, AutoMapping):
                continue
            for te_name, local_name in self._SEPARATE_LAYERNORM_REWRITES:
                suffix = f".{te_name}"
                if not mapping.megatron_param.endswith(suffix) or mapping.megatron_param.endswith(f"*{suffix}"):
                    continue
                alias = mapping.megatron_param[: -len(te_name)] + local_name
                if alias not in existing:
                    self.mappings.append(AutoMapping(alias, mapping.hf_param, mapping.permute_dims))
                    existing.add(alias)
                break

    return _add_separate_layernorm_mappings
