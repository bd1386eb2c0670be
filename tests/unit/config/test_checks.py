"""The pure checks: a bad config is refused before torch, megatron or ray is imported (the command
line answers in about a second), and the pure rules agree with what megatron-core means."""

from __future__ import annotations

import importlib

import pytest
from omegaconf import OmegaConf

from nemo_rl_mtp.config.checks import ConfigError, check_speculation_depth, split_hybrid_pattern
from tests.support.fresh_process import json_report
from tests.support.release_gates import on_this_release

HEAVY = ("torch", "megatron", "ray", "transformers")
TOO_MANY_DRAFTS = ["policy.megatron_cfg.mtp_num_layers=1", "policy.generation.num_speculative_tokens=3"]
# What the child process reports: the heavy packages imported so far.
HEAVY_IMPORTED = f"sorted({{name.split('.')[0] for name in sys.modules}} & set({HEAVY!r}))"


def test_load_and_pure_checks_import_nothing_heavy_and_the_release_check_does():
    """Control: the same process, asked for the release's capabilities afterwards, has megatron
    imported, so the probe sees an import when one happens."""
    seen = json_report(
        "import json, sys\n"
        "from nemo_rl_mtp.config.load import ConfigError\n"
        "from nemo_rl_mtp.grpo.checked_config import check_installed_release, load_pure_checked_config\n"
        "cfg = load_pure_checked_config()\n"
        f"try:\n    load_pure_checked_config(overrides={TOO_MANY_DRAFTS!r})\n    refusal = None\n"
        "except ConfigError as error:\n    refusal = str(error)\n"
        f"before = {HEAVY_IMPORTED}\n"
        "check_installed_release(cfg)\n"
        f"print(json.dumps({{'before': before, 'after': {HEAVY_IMPORTED}, 'refusal': refusal}}))\n"
    )
    assert seen["refusal"].startswith("policy.generation.num_speculative_tokens=3: this model's MTP heads can propose at most 1")
    assert seen["before"] == []
    assert "megatron" in seen["after"]


def test_the_command_line_refuses_before_any_heavy_import():
    seen = json_report(
        "import json, sys\n"
        "from nemo_rl_mtp.cli import main\n"
        f"status = main({TOO_MANY_DRAFTS!r})\n"
        f"print(json.dumps({{'status': status, 'heavy': {HEAVY_IMPORTED}}}))\n"
    )
    assert seen == {"status": 2, "heavy": []}


def test_the_task_checks_import_only_config():
    seen = json_report(f"import json, sys\nimport nemo_rl_mtp.tasks.config_checks\nprint(json.dumps({HEAVY_IMPORTED}))\n")
    assert seen == []


def _speculation(k: int, layers: int, repeated: bool):
    generation = OmegaConf.create({"num_speculative_tokens": k})
    megatron = OmegaConf.create({"mtp_num_layers": layers, "mtp_use_repeated_layer": repeated})
    return generation, megatron


def test_more_drafts_than_mtp_layers_need_a_repeated_layer():
    check_speculation_depth(*_speculation(1, 1, False))
    check_speculation_depth(*_speculation(3, 1, True))  # one layer, drafted once per token
    check_speculation_depth(*_speculation("auto", 1, False))
    with pytest.raises(ConfigError, match=r"^policy.generation.num_speculative_tokens=3: this model's MTP heads can propose at most 1"):
        check_speculation_depth(*_speculation(3, 1, False))
    with pytest.raises(ConfigError, match=r"^policy.generation.num_speculative_tokens=1: the model has no MTP heads"):
        check_speculation_depth(*_speculation(1, 0, True))


@pytest.mark.parametrize("pattern", ["*-*-", "*-*-/*-", "*E*E/*E/*E", "*-|*-/*-", "M*M*|-E-*/*-"])
def test_the_hybrid_split_is_megatrons(pattern):
    """Reference: megatron-core's own parser of the pattern, which builds the model."""
    try:
        allocation = importlib.import_module("megatron.core.models.hybrid.hybrid_layer_allocation")
        allocation.parse_hybrid_pattern
    except (ModuleNotFoundError, AttributeError):
        pytest.skip(on_this_release("no megatron.core.models.hybrid.hybrid_layer_allocation.parse_hybrid_pattern (HybridModel)"))
    parsed = allocation.parse_hybrid_pattern(pattern)
    split = split_hybrid_pattern(pattern)
    assert split.decoder_layers == parsed.main_pattern.replace(allocation.Symbols.PIPE, "")
    assert len(split.mtp_depths) == parsed.mtp_num_depths
    assert (split.mtp_depths[0] if split.mtp_depths else None) == parsed.mtp_pattern


def test_every_constrained_key_is_a_key_of_the_schema():
    """A typo in CHOICES, RANGES or ARCHITECTURE_KEYS would select nothing, and a range on nothing
    checks nothing; control: a made-up key is found missing."""
    from nemo_rl_mtp.config.load import load_exemplar
    from nemo_rl_mtp.config.schema import ARCHITECTURE_KEYS, CHOICES, RANGES

    exemplar = load_exemplar()

    def missing(keys):
        return [key for key in keys if OmegaConf.select(exemplar, key, default="<absent>") == "<absent>"]

    assert missing([*CHOICES, *RANGES, *ARCHITECTURE_KEYS]) == []
    assert missing(["policy.megatron_cfg.mtp_layerz"]) == ["policy.megatron_cfg.mtp_layerz"]
