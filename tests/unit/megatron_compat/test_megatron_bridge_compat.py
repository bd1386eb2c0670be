"""The megatron-bridge compat patches against the installed release: the transformer_engine
stand-in is seen by its one module only, MTP norms resolve under the local spec, each patch is
idempotent and loud when its target is gone."""

from __future__ import annotations

import logging
import sys

import pytest

from nemo_rl_mtp.megatron_compat import megatron_bridge as compat
from tests.support.release_gates import requires_megatron_bridge

pytestmark = requires_megatron_bridge()


@pytest.fixture(scope="module")
def bridge():
    return compat.import_megatron_bridge()


def test_the_te_stand_in_reaches_lora_layers_only_and_megatron_core_still_sees_no_te(bridge):
    from megatron.core.models.gpt import gpt_layer_specs

    lora_layers = sys.modules[compat.LORA_MODULE]
    assert isinstance(lora_layers.te, compat._InertMeta)
    assert "transformer_engine" not in sys.modules and not gpt_layer_specs.HAVE_TE
    with pytest.raises(RuntimeError, match="transformer_engine is not installed"):
        lora_layers.te.pytorch.Linear(4, 4)


def test_the_stand_in_is_shown_to_the_named_importer_only():
    statement = "import transformer_engine.pytorch as te"
    with compat.te_stand_in_for("some.importer") as stand_in:
        scope = {"__name__": "some.importer"}
        exec(statement, scope)
        assert scope["te"] is stand_in.module.pytorch and stand_in.imports == ["transformer_engine.pytorch"]
        with pytest.raises(ModuleNotFoundError):
            exec(statement, {"__name__": "another.module"})
    with pytest.raises(ModuleNotFoundError):
        exec(statement, {"__name__": "some.importer"})


def test_mtp_norms_resolve_and_the_patch_is_idempotent(bridge):
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry

    patched = MegatronMappingRegistry._add_separate_layernorm_mappings
    assert not compat.mtp_norm_alias_needed()
    assert compat.apply_mtp_norm_alias() == "already installed (idempotent)"
    assert MegatronMappingRegistry._add_separate_layernorm_mappings is patched
    MegatronMappingRegistry._add_separate_layernorm_mappings = patched.original
    try:  # the release's own method: the patch is needed exactly while it lacks the alias
        assert compat.mtp_norm_alias_needed()
    finally:
        MegatronMappingRegistry._add_separate_layernorm_mappings = patched


def test_a_renamed_target_is_loud(bridge, monkeypatch):
    """Upstream restructured: the method no longer aliases norms and the rewrite table is gone."""
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry

    monkeypatch.setattr(MegatronMappingRegistry, "_add_separate_layernorm_mappings", lambda self: None)
    monkeypatch.delattr(MegatronMappingRegistry, "_SEPARATE_LAYERNORM_REWRITES")
    with pytest.raises(RuntimeError, match="renamed upstream"):
        compat.apply_mtp_norm_alias()


def test_importing_the_bridge_leaves_the_root_logger_as_it_was():
    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    with compat.root_logging_kept():
        logging.basicConfig(level=logging.INFO)  # what megatron.training's import does
    assert (list(root.handlers), root.level) == before


def test_a_release_the_bridge_does_not_import_on_is_refused_at_config_load_in_one_line(monkeypatch):
    """megatron-core 0.16 and 0.17 (megatron-bridge 0.6.2 imports names they lack), simulated by
    an import that fails on the installed release."""
    from nemo_rl_mtp.config.load import ConfigError
    from nemo_rl_mtp.grpo.checked_config import load_checked_config

    monkeypatch.setitem(sys.modules, "megatron.bridge", None)
    with pytest.raises(ConfigError, match=r"^policy.model_name=x: megatron-bridge \S+ does not import on megatron-core \S+ \(.*\); build the model from scratch") as error:
        load_checked_config(overrides=["policy.model_name=x"])
    assert "\n" not in str(error.value)
