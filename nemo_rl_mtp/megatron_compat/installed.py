"""Which megatron-core is installed, from its package metadata, and whether transformer_engine is:
no megatron or TE import, so the config checks and the driver's modules that name the release in a
message stay light."""

from __future__ import annotations

import importlib.metadata
import importlib.util


def megatron_core_version() -> str:
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:  # a source checkout on PYTHONPATH
        import megatron.core

        return getattr(megatron.core, "__version__", "unknown")


def transformer_engine_installed() -> bool:
    """Whether a ``transformer_engine`` package is there to import (found, not imported: TE
    loads CUDA libraries at import)."""
    return importlib.util.find_spec("transformer_engine") is not None
