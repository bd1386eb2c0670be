import logging
import os

import pytest

import nemo_rl_mtp  # noqa: F401  first: megatron-core, imported by test modules, then skips torch's compiler


def pytest_sessionstart(session):
    """Under the release matrix, make sure the intended megatron-core is the one imported."""
    expected = os.environ.get("NEMO_RL_MTP_EXPECT_RELEASE")
    if expected:
        from nemo_rl_mtp.megatron_compat.installed import megatron_core_version

        installed = megatron_core_version()
        if installed.split("+")[0] != expected:
            raise pytest.UsageError(f"expected megatron-core {expected}, imported {installed}")


def pytest_collection_modifyitems(config, items):
    """The longest modules first, so that two xdist workers finish together (``tests/support/schedule.py``)."""
    from tests.support.schedule import longest_first

    longest_first(items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from tests.support.schedule import LongestFirstFileScheduling

    return LongestFirstFileScheduling(config, log)


@pytest.fixture(scope="session")
def megatron_world():
    """torch.distributed (gloo, world size 1) and megatron's parallel state, once per session."""
    from nemo_rl_mtp.training.model import initialize_model_parallel
    from tests.support.helpers import free_port, tiny_config

    logging.basicConfig(level=logging.INFO)
    cfg = tiny_config()
    initialize_model_parallel(cfg.policy.megatron_cfg, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    yield
