import pytest

from tests.support.helpers import make_policy, train_count_up
from tests.support.engine_cases import SIZES, engine_overrides


@pytest.fixture(scope="session")
def trained_policy(megatron_world):
    """A policy whose heads were trained (imitation of count_up) until drafts are often right."""
    policy, cfg = make_policy(**engine_overrides(2, **SIZES))
    return train_count_up(policy, cfg)
