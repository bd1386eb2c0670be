"""Skips for tests that need what the installed megatron-core lacks. Every reason names the
release and the missing piece; the release matrix (``tests/functional/test_release_matrix.py``)
fails a skip on an older release whose reason does not name it. On the newest release the
project allows (``NEWEST_RELEASE``, pyproject's bound) nothing may be missing: a gate that would
skip there fails the collection instead, so the main suite never skips a test silently.

Two kinds of gate:
- :func:`requires_config`: the product's own one-line refusal of a configuration (the pure checks,
  then ``megatron_compat.capabilities``, as every entry point loads a config through
  ``grpo.checked_config``, before any model is built) is the reason: MoE load balancing, HybridModel,
  detached heads, a repeated layer, speculation where the release's engine lacks them;
- :func:`import_or_skip`: a megatron-core module a test compares against (a kernel's PyTorch
  version, the hybrid stack), absent from the release.
"""

from __future__ import annotations

import importlib

import pytest

from nemo_rl_mtp.megatron_compat.engine_release import megatron_release
from nemo_rl_mtp.config.load import ConfigError
from nemo_rl_mtp.grpo.checked_config import load_checked_config
from tests.support.helpers import BASE_RECIPE, tiny_config

# pyproject allows megatron-core < 0.20: every gate is open on 0.19.
NEWEST_RELEASE = "megatron-core 0.19."


def _skip_marker(reason: str | None) -> pytest.MarkDecorator:
    """skipif(reason), where the installed release may lack something; on the newest a reason is
    an error (the product or the suite broke, not the release)."""
    if reason is not None and megatron_release().startswith(NEWEST_RELEASE):
        raise AssertionError(f"a release gate is closed on the newest release: {reason}")
    return pytest.mark.skipif(reason is not None, reason=str(reason))


def release_refusal(**policy_overrides) -> str | None:
    """The installed megatron-core's one-line refusal of the tiny config with these
    ``policy.<key>`` overrides (None: it runs it). A refusal for any other reason is a broken
    test, raised."""
    return _refusal(lambda: tiny_config(**policy_overrides))


def command_refusal(argv: list[str]) -> str | None:
    """The same for a GRPO command line (``tests.support.helpers.run_grpo``'s ``argv``: its recipe, or
    ``--config``'s, with its overrides); on the newest release a refusal raises."""
    recipe, overrides = BASE_RECIPE, list(argv)
    if "--config" in overrides:
        at = overrides.index("--config")
        recipe = overrides[at + 1]
        del overrides[at : at + 2]
    reason = _refusal(lambda: load_checked_config(recipe, overrides))
    _skip_marker(reason)
    return reason


class RunsByName(dict):
    """Run directories by name, as a module's GRPO runs fill them; reading a run the installed
    release refused (``refused``: name -> its one-line refusal) skips the reading test with it."""

    def __init__(self):
        super().__init__()
        self.refused: dict[str, str] = {}

    def __missing__(self, name: str):
        if name in self.refused:
            pytest.skip(self.refused[name])
        raise KeyError(name)


def _refusal(load) -> str | None:
    try:
        load()
    except ConfigError as error:
        if megatron_release() not in str(error):
            raise
        return str(error)
    return None


def requires_config(**policy_overrides) -> pytest.MarkDecorator:
    """Skip marker: the test runs this configuration, which the installed release may refuse."""
    return _skip_marker(release_refusal(**policy_overrides))


def import_or_skip(module: str, what_for: str):
    """``module`` imported, or the calling test module skipped where the release has no such
    module (call at module level, before the names it would import)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name is None or not module.startswith(error.name):
            raise
        reason = f"{megatron_release()} has no {module} ({what_for})"
        _skip_marker(reason)  # raises on the newest release
        pytest.skip(reason, allow_module_level=True)


def on_this_release(what: str) -> str:
    """A skip reason that names the installed release: ``megatron-core X.Y.Z: <what>``."""
    return f"{megatron_release()}: {what}"


def requires_megatron_bridge() -> pytest.MarkDecorator:
    """Skip marker for tests of Hugging Face checkpoints: megatron-bridge does not import on every
    release (the product's own probe, which imports the bridge: call it only where it is used)."""
    from nemo_rl_mtp.megatron_compat.megatron_bridge import bridge_unavailable

    return _skip_marker(bridge_unavailable())
