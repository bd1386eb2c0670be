"""The controllers that run are classes declared in the source, one per combination, and none of
the rollout's classes overrides a private method of megatron-core (megatron_compat does)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from tests.support.engine_cases import skip_module_without_speculation

skip_module_without_speculation()

import nemo_rl_mtp  # noqa: E402
from nemo_rl_mtp.rollout import controllers  # noqa: E402
from nemo_rl_mtp.rollout.engine import RolloutEngine  # noqa: E402
from tests.support.helpers import make_policy  # noqa: E402
from tests.support.engine_cases import engine_overrides  # noqa: E402

pytestmark = pytest.mark.usefixtures("megatron_world")


def private_megatron_overrides(cls: type) -> list[str]:
    """Methods with one leading underscore that a megatron-core class among ``cls``'s bases
    defines and a class of ours in its method-resolution order (a mixin included) overrides
    outside megatron_compat."""
    megatron_bases = [base for base in cls.__mro__ if base.__module__.startswith("megatron.")]
    ours = [owner for owner in cls.__mro__ if owner.__module__.startswith("nemo_rl_mtp.") or owner.__module__ == __name__]
    return sorted({
        f"{owner.__module__}.{owner.__qualname__}.{name}"
        for owner in ours
        if not owner.__module__.startswith("nemo_rl_mtp.megatron_compat")
        for name, member in vars(owner).items()
        if inspect.isfunction(member) and name.startswith("_") and not name.startswith("__")
        and any(name in vars(base) for base in megatron_bases)
    })


def package_classes(outside: str) -> list[type]:
    found = []
    for module_info in pkgutil.walk_packages(nemo_rl_mtp.__path__, "nemo_rl_mtp."):
        if module_info.name.startswith(outside) or module_info.name.endswith("__main__"):
            continue
        try:
            module = importlib.import_module(module_info.name)
        except ImportError:
            continue
        found += [cls for _, cls in inspect.getmembers(module, inspect.isclass) if cls.__module__ == module.__name__]
    return found


def test_no_class_outside_megatron_compat_overrides_a_private_megatron_method():
    overrides = [name for cls in package_classes("nemo_rl_mtp.megatron_compat") for name in private_megatron_overrides(cls)]
    assert not overrides, overrides


def test_the_override_check_sees_an_override_control():
    from megatron.core.inference.text_generation_controllers.text_generation_controller import TextGenerationController

    class Mixin:  # a mixin's override counts where it lands on a megatron class
        def _sample_from_logits_2d(self, logits_2d):
            return logits_2d

    class Overriding(Mixin, TextGenerationController):
        pass

    assert private_megatron_overrides(Overriding) == [f"{__name__}.{Mixin.__qualname__}._sample_from_logits_2d"]


@pytest.mark.parametrize("draft_context", ["single_position", "sequence", "incremental"])
@pytest.mark.parametrize("verification", ["exact_match", "rejection_sampling"])
def test_the_controller_that_runs_is_the_tables_declared_class(draft_context, verification):
    policy, cfg = make_policy(**engine_overrides(1, 1, generation__draft_context=draft_context, generation__spec_verification=verification))
    controller = type(RolloutEngine(policy, cfg).engine.controller)
    source = {"single_position": controllers.MEGATRON_DRAFTS}.get(draft_context, draft_context)
    assert controller is controllers.CONTROLLERS[(source, verification)]
    assert getattr(controllers, controller.__name__) is controller
