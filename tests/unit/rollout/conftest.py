import pytest
import torch

from nemo_rl_mtp.training.imitation import imitation_step
from tests.support.helpers import make_policy, task_demonstrations
from tests.support.engine_cases import SIZES, TOKENIZER, engine_overrides


@pytest.fixture(scope="session")
def trained_policy(megatron_world):
    """A policy whose heads were trained (imitation of count_up) until drafts are often right."""
    policy, cfg = make_policy(**engine_overrides(2, **SIZES))
    generator = torch.Generator().manual_seed(0)
    for _ in range(40):
        lengths = torch.randint(2, 4, (64,), generator=generator)
        digits = [torch.randint(0, 10, (int(n),), generator=generator).tolist() for n in lengths]
        imitation_step(policy, task_demonstrations("count_up", digits, TOKENIZER), cfg)
    return policy
