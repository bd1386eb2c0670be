"""megatron-core's import, on a CPU, without importing torch's compiler.

Importing ``megatron.core`` applies ``torch.compile`` to about twenty functions: its fused
element-wise kernels (``megatron.core.jit.jit_fuser`` is ``torch.compile``) and the MoE inference
router's top-k. ``torch.compile`` compiles nothing until a function's first call, yet calling it
imports TorchDynamo and Inductor, about 800 modules: 3-4 s of a 10-12 s import on a 2-core CPU,
paid by every process that builds a model (the GRPO driver, each policy worker, each test worker),
for functions a CPU run never calls (their fusions are off there).

While ``megatron.core``'s package ``__init__`` executes (it imports nearly all of megatron-core,
``megatron.core.jit`` and the router included), ``torch.compile`` is replaced by
:func:`compile_at_first_call`: for a plain function it returns a stand-in that hands the function
to the real ``torch.compile`` at its first call and calls the result from then on; for anything
else (a module, a method object) it calls the real one at once. A function so compiled computes
what ``torch.compile``'s result computes and is compiled at the same moment, its first call: only
the import moves. ``jit_fuser`` keeps the replacement, so megatron modules imported later defer
the same way.

:func:`install` puts a one-shot finder on ``sys.meta_path`` (from the package's ``__init__``, the
module every process imports before megatron-core); it acts at the first import of
``megatron.core`` and removes itself. Nothing happens on a machine with CUDA (the fusions run and
compile there), where megatron-core was imported before, or where its import no longer calls
``torch.compile`` (then it warns that it has nothing left to do).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import inspect
import logging
import sys
from typing import Callable, Iterator

logger = logging.getLogger(__name__)

TARGET = "megatron.core"
# The functions whose torch.compile this process deferred, by qualified name (filled as it goes).
deferred_calls: list[str] = []


def compile_at_first_call(compile: Callable, function: Callable, options: dict) -> Callable:
    """``function`` as ``compile(function, **options)`` will run it, compiled when first called."""
    compiled = None

    @functools.wraps(function)
    def compiled_at_first_call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            compiled = compile(function, **options)
        return compiled(*args, **kwargs)

    return compiled_at_first_call


@contextlib.contextmanager
def torch_compile_deferred(deferred: list[str] | None = None) -> Iterator[list[str]]:
    """``torch.compile`` deferring plain functions (:func:`compile_at_first_call`) inside the
    block, put back after it. Yields ``deferred`` (a new list if None), to which the name of each
    function deferred is appended, also by a decorator made in the block and used after it."""
    import torch

    real_compile = torch.compile
    deferred = [] if deferred is None else deferred

    def deferring_compile(model=None, /, **options):
        if model is None:  # @torch.compile(...) with options: the decorator it returns
            return lambda function: deferring_compile(function, **options)
        if not inspect.isfunction(model):
            return real_compile(model, **options)
        deferred.append(f"{model.__module__}.{model.__qualname__}")
        return compile_at_first_call(real_compile, model, options)

    torch.compile = deferring_compile
    try:
        yield deferred
    finally:
        torch.compile = real_compile


class _DeferringLoader(importlib.abc.Loader):
    """The loader of ``megatron.core``'s ``__init__``, run inside :func:`torch_compile_deferred`
    when CUDA is absent; the module keeps the original loader."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = module.__spec__.loader = self.loader
        import torch

        # megatron-core's import asks the same itself (dist_checkpointing/strategies/torch.py).
        if torch.cuda.is_available():
            self.loader.exec_module(module)
            return
        before = len(deferred_calls)
        with torch_compile_deferred(deferred_calls):
            self.loader.exec_module(module)
        if len(deferred_calls) > before:
            logger.info(
                "%s imported without torch's compiler on this CPU: %d torch.compile calls deferred to first use",
                module.__name__, len(deferred_calls) - before,
            )  # fmt: skip
        else:
            logger.warning("importing %s called no torch.compile: deferred_compile has nothing left to do", module.__name__)


class _FirstMegatronCoreImport(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core`` with the finders after it, wraps its loader, and leaves
    ``sys.meta_path``."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        _remove()
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(fullname, path, target) if find_spec is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _DeferringLoader(spec.loader)
                else:
                    logger.warning("deferred_compile: %s has no loader to wrap; torch.compile runs at import", TARGET)
                return spec
        return None


def _remove() -> None:
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _FirstMegatronCoreImport)]


def install() -> bool:
    """Defer torch.compile's calls during megatron-core's import in this process, unless it is
    imported already (then False). Idempotent; imports neither torch nor megatron-core."""
    if TARGET in sys.modules:
        return False
    if not any(isinstance(finder, _FirstMegatronCoreImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _FirstMegatronCoreImport())
    return True
