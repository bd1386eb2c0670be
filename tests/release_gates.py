"""Skips for tests that need what the installed megatron-core lacks. Every reason names the
release and the missing piece; the release matrix (``tests/functional/test_release_matrix.py``)
fails a skip on an older release whose reason does not name it, and a gated skip on the newest.

Two kinds of gate:
- :func:`requires_config`: the product's own one-line refusal of a configuration (checked at
  config load, before any model is built) is the reason: MoE load balancing, HybridModel,
  detached heads, a repeated layer, speculation where the release's engine lacks them;
- :func:`import_or_skip`: a megatron-core module a test compares against (a kernel's PyTorch
  version, the hybrid stack), absent from the release.
"""

from __future__ import annotations

import importlib

import pytest

from nemo_rl_mtp.models.generation.engine_release import megatron_release
from nemo_rl_mtp.utils.config import ConfigError
from tests.helpers import tiny_config


def release_refusal(**policy_overrides) -> str | None:
    """The installed megatron-core's one-line refusal of the tiny config with these
    ``policy.<key>`` overrides (None: it runs it). A refusal for any other reason is a broken
    test, raised."""
    try:
        tiny_config(**policy_overrides)
    except ConfigError as error:
        if megatron_release() not in str(error):
            raise
        return str(error)
    return None


def requires_config(**policy_overrides) -> pytest.MarkDecorator:
    """Skip marker: the test runs this configuration, which the installed release may refuse."""
    reason = release_refusal(**policy_overrides)
    return pytest.mark.skipif(reason is not None, reason=str(reason))


def import_or_skip(module: str, what_for: str):
    """``module`` imported, or the calling test module skipped where the release has no such
    module (call at module level, before the names it would import)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name is None or not module.startswith(error.name):
            raise
        pytest.skip(f"{megatron_release()} has no {module} ({what_for})", allow_module_level=True)


def on_this_release(what: str) -> str:
    """A skip reason that names the installed release: ``megatron-core X.Y.Z: <what>``."""
    return f"{megatron_release()}: {what}"



def requires_megatron_bridge() -> pytest.MarkDecorator:
    """Skip marker for tests of Hugging Face checkpoints: megatron-bridge does not import on every
    release (the product's own probe, which imports the bridge: call it only where it is used)."""
    from nemo_rl_mtp.models.megatron.compat.megatron_bridge import bridge_unavailable

    reason = bridge_unavailable()
    return pytest.mark.skipif(reason is not None, reason=str(reason))
