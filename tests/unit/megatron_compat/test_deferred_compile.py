"""megatron-core's import skips torch's compiler on a CPU (``megatron_compat/cpu/deferred_compile.py``):
measured in a fresh process, and the deferred functions compiled by the real ``torch.compile`` at
their first call, not before. (``benchmarks/megatron_import.py`` measures the import with and
without it side by side.)"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import sys

import pytest
import torch

from nemo_rl_mtp.megatron_compat.cpu import deferred_compile
from tests.support.fresh_process import json_report

# In a fresh process: the package, then megatron-core; what it imported and what was deferred.
IMPORT_PROBE = """
import json, sys
import nemo_rl_mtp
from nemo_rl_mtp.megatron_compat.cpu import deferred_compile
import megatron.core, megatron.core.models.gpt
from megatron.core import jit
compiler = [name for name in ("torch._dynamo", "torch._inductor.compile_fx") if name in sys.modules]
print(json.dumps({"compiler": compiler, "deferred": deferred_compile.deferred_calls, "jit_fuser": jit.jit_fuser.__qualname__,
                  "loader": type(megatron.core.__loader__).__name__}))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shim acts only without CUDA")
def test_megatron_core_imported_after_the_package_does_not_import_torchs_compiler():
    report = json_report(IMPORT_PROBE)
    fusions = [name for name in report["deferred"] if name.startswith("megatron.core.fusions.")]
    assert report["compiler"] == [], f"megatron-core's import imported torch's compiler: {report}"
    assert fusions, f"megatron-core's import no longer calls torch.compile: deferred_compile can go ({report})"
    assert report["jit_fuser"].endswith("deferring_compile"), report  # later megatron modules defer too
    assert report["loader"] == "SourceFileLoader", report  # the module keeps its own loader


def compile_counter():
    """torch's backend that counts the frames it compiles (imported here: TorchDynamo comes with it)."""
    from torch._dynamo.testing import CompileCounter

    return CompileCounter()


def test_a_deferred_function_is_compiled_by_torch_compile_at_its_first_call_only():
    backend = compile_counter()
    with deferred_compile.torch_compile_deferred() as deferred:

        @torch.compile(backend=backend)
        def gelu_gate(y: torch.Tensor) -> torch.Tensor:
            first, second = torch.chunk(y, 2, -1)
            return torch.nn.functional.gelu(first) * second

    assert backend.frame_count == 0 and len(deferred) == 1 and deferred[0].endswith("gelu_gate")
    y = torch.randn(4, 6)
    reference = torch.nn.functional.gelu(y[:, :3]) * y[:, 3:]
    torch.testing.assert_close(gelu_gate(y), reference)
    assert backend.frame_count == 1  # compiled by the real torch.compile, with the options given
    torch.testing.assert_close(gelu_gate(2 * y), torch.nn.functional.gelu(2 * y[:, :3]) * 2 * y[:, 3:])
    assert backend.frame_count == 1  # and not again


def test_modules_compile_at_once_and_torch_compile_is_put_back_after_an_error():
    real_compile = torch.compile
    with pytest.raises(RuntimeError, match="import failed"):
        with deferred_compile.torch_compile_deferred() as deferred:
            compiled = torch.compile(torch.nn.Linear(2, 2), backend=compile_counter())
            assert hasattr(compiled, "_orig_mod") and deferred == []  # an OptimizedModule, as torch returns
            raise RuntimeError("import failed")
    assert torch.compile is real_compile


def test_install_is_idempotent_and_does_nothing_once_megatron_core_is_imported():
    import megatron.core  # noqa: F401

    assert deferred_compile.install() is False
    assert sum(isinstance(finder, deferred_compile._FirstMegatronCoreImport) for finder in sys.meta_path) == 0


@pytest.mark.parametrize("compiles", [True, False])
def test_the_wrapped_import_logs_what_it_deferred_and_warns_when_there_was_nothing(compiles, tmp_path, caplog):
    """The loader as megatron-core's import uses it, on a module of our own: one with a
    ``@torch.compile`` function is deferred and counted; one without is the shim's target gone."""
    source = tmp_path / "fused_example.py"
    decorator = "@torch.compile(backend='eager')\n" if compiles else ""  # eager: no C++ compiler needed
    source.write_text(f"import torch\n\n{decorator}def double(x):\n    return 2 * x\n")
    loader = importlib.machinery.SourceFileLoader("fused_example", str(source))
    spec = importlib.util.spec_from_file_location("fused_example", source, loader=deferred_compile._DeferringLoader(loader))
    module = importlib.util.module_from_spec(spec)
    with caplog.at_level(logging.INFO, logger=deferred_compile.__name__):
        spec.loader.exec_module(module)
    assert module.__loader__ is loader and module.double(torch.ones(2)).tolist() == [2.0, 2.0]
    if compiles:
        assert "fused_example imported without torch's compiler on this CPU: 1 torch.compile calls deferred" in caplog.text
        assert deferred_compile.deferred_calls[-1] == "fused_example.double"
    else:
        assert "importing fused_example called no torch.compile: deferred_compile has nothing left to do" in caplog.text
