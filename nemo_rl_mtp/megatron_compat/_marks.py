"""Marking patched callables, so every shim can tell that it is already installed."""

from __future__ import annotations

_MARK = "__nemo_rl_mtp_shim__"


def mark_shim(patched, original=None):
    """Mark ``patched`` as ours; when it replaces ``original``, take its name and remember it.
    No ``__wrapped__``: the signature a later probe reads must be the shim's own."""
    if original is not None:
        patched.__name__ = original.__name__
        patched.__qualname__ = original.__qualname__
        patched.__doc__ = original.__doc__
        patched.original = original
    setattr(patched, _MARK, True)
    return patched


def is_shim(function) -> bool:
    return getattr(function, _MARK, False)
