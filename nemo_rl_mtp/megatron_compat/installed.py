"""Which megatron-core is installed, from its package metadata: no megatron import, so the config
checks and the driver's modules that name the release in a message stay light."""

from __future__ import annotations

import importlib.metadata


def megatron_core_version() -> str:
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:  # a source checkout on PYTHONPATH
        import megatron.core

        return getattr(megatron.core, "__version__", "unknown")
