"""Data parallel 2 (two gloo processes) vs data parallel 1 on the same global batch: the policy
and MTP gradients and metrics must agree, which checks the global valid-token normalisation and
the DP reduction of the MTP tracker."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from nemo_rl_mtp.training.losses import loss_sample_weights
from nemo_rl_mtp.training.step import forward_backward_global_batch
from tests.support.helpers import free_port, gradients, make_batch, make_policy
from tests.unit.training.test_mtp_training_step import PG_LOSS, RAGGED_RESPONSES

POLICY = dict(megatron_cfg__mtp_num_layers=2, train_micro_batch_size=2, train_global_batch_size=8)
SAMPLE_MASK = [1, 1, 1, 0, 1, 1, 1, 1]


def _step(policy, cfg, batch):
    return forward_backward_global_batch(policy, batch, PG_LOSS, cfg), gradients(policy)


def _batch(token_level_loss: bool) -> dict[str, torch.Tensor]:
    batch = make_batch(RAGGED_RESPONSES, sample_mask=SAMPLE_MASK)
    batch["sample_mask"] = loss_sample_weights(batch["token_mask"], batch["sample_mask"], token_level_loss)
    return batch


# (token-level loss, MTP loss type): token- and sequence-level losses (the sample weights split
# with the batch), with megatron's MTP loss and with a loss on the policy's distribution.
CASES = [(True, "cross_entropy"), (False, "cross_entropy"), (False, "soft_cross_entropy")]


def _data_parallel_rank(rank: int, world_size: int, init_method: str, directory: str):
    """Each case in turn on one data-parallel rank of the two; rank 0 saves what the case gave."""
    from nemo_rl_mtp.training.model import initialize_model_parallel
    from tests.support.helpers import tiny_config

    from megatron.core.utils import check_param_hashes_across_dp_replicas

    from nemo_rl_mtp.megatron_compat.cpu import training_runtime as cpu_runtime
    from nemo_rl_mtp.training.model import setup_megatron_policy
    from tests.support.helpers import VOCAB_SIZE

    initialize_model_parallel(tiny_config().policy.megatron_cfg, rank, world_size, init_method)
    for index, (token_level_loss, loss_type) in enumerate(CASES):
        cfg = tiny_config(**POLICY, megatron_cfg__mtp_loss_type=loss_type).policy
        policy = setup_megatron_policy(cfg, VOCAB_SIZE)
        with cpu_runtime.device_scope():
            identical_init = check_param_hashes_across_dp_replicas([policy.model.module], cross_check=True)
        policy.model.module.load_state_dict(torch.load(f"{directory}/weights_{index}.pt"))
        batch = _batch(token_level_loss)
        share = slice(rank * 4, (rank + 1) * 4)
        metrics, grads = _step(policy, cfg, {key: value[share] for key, value in batch.items()})
        if rank == 0:
            torch.save({"metrics": metrics, "grads": grads, "identical_init": identical_init}, f"{directory}/dp2_{index}.pt")


@pytest.fixture(scope="module")
def one_and_two(megatron_world, tmp_path_factory) -> dict[tuple[bool, str], tuple]:
    """Per case, (metrics, gradients) of one process and the two ranks' result, from the same
    initial weights; the two processes are started once for every case (each start imports
    megatron-core)."""
    directory = tmp_path_factory.mktemp("data_parallel")
    one = {}
    for index, (token_level_loss, loss_type) in enumerate(CASES):
        policy, cfg = make_policy(**POLICY, megatron_cfg__mtp_loss_type=loss_type)
        torch.save(policy.model.module.state_dict(), directory / f"weights_{index}.pt")
        one[CASES[index]] = _step(policy, cfg, _batch(token_level_loss))
    mp.start_processes(
        _data_parallel_rank, args=(2, f"tcp://127.0.0.1:{free_port()}", str(directory)), nprocs=2, start_method="spawn"
    )
    return {case: (one[case], torch.load(directory / f"dp2_{index}.pt")) for index, case in enumerate(CASES)}


@pytest.mark.parametrize("token_level_loss, loss_type", CASES)
def test_data_parallel_two_matches_one(one_and_two, token_level_loss, loss_type):
    (metrics_one, grads_one), result = one_and_two[token_level_loss, loss_type]
    assert result["identical_init"], "data-parallel replicas were initialised differently"
    assert result["metrics"].keys() == metrics_one.keys()
    for key, value in metrics_one.items():
        assert result["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    for name, grad in grads_one.items():
        torch.testing.assert_close(result["grads"][name], grad, rtol=1e-4, atol=1e-7, msg=name)
