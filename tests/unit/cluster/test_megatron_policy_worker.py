"""The policy worker in-process (single rank): reference logprobs for the KL penalty."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from nemo_rl_mtp.training.losses import ClippedPGLossFn
from nemo_rl_mtp.cluster.worker import MegatronPolicyWorker
from tests.support.helpers import VOCAB_SIZE, free_port, make_batch, tiny_config

pytestmark = pytest.mark.usefixtures("megatron_world")


def test_reference_logprobs_stay_those_of_the_initial_weights():
    cfg = tiny_config(megatron_cfg__mtp_num_layers=1, train_micro_batch_size=4, train_global_batch_size=8)
    worker = MegatronPolicyWorker(
        cfg.policy, VOCAB_SIZE, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}", keep_reference_weights=True
    )
    batch = make_batch([3, 7, 4, 6, 5, 5, 2, 8])
    initial = worker.get_logprobs(batch)
    batch["prev_logprobs"] = initial
    batch["reference_logprobs"] = initial
    kl_loss = ClippedPGLossFn(ratio_clip_min=0.2, ratio_clip_max=0.2, reference_policy_kl_penalty=0.1)
    for _ in range(3):
        metrics = worker.train(batch, kl_loss)
    assert metrics["kl"] > 0
    trained = worker.get_logprobs(batch)
    assert not torch.allclose(trained, initial)
    torch.testing.assert_close(worker.get_reference_logprobs(batch), initial)
    # The swap back restores the weights being trained.
    torch.testing.assert_close(worker.get_logprobs(batch), trained)


def test_start_of_rl_policy_is_kept_and_read_back_from_its_save(tmp_path):
    """The policy GRPO starts from, for the KL to the start of RL: kept on the host while the
    weights train on, and read back from its save (a resumed run) to the same logprobs."""
    cfg = tiny_config(megatron_cfg__mtp_num_layers=1, train_micro_batch_size=4, train_global_batch_size=8)
    worker = MegatronPolicyWorker(cfg.policy, VOCAB_SIZE, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    batch = make_batch([3, 7, 4, 6, 5, 5, 2, 8])
    batch["prev_logprobs"] = start = worker.get_logprobs(batch)
    worker.keep_start_of_rl_weights(str(tmp_path / "start_of_rl"))
    loss = ClippedPGLossFn(ratio_clip_min=0.2, ratio_clip_max=0.2, reference_policy_kl_penalty=0.0)
    for _ in range(3):
        worker.train(batch, loss)
    trained = worker.get_logprobs(batch)
    assert not torch.allclose(trained, start)
    torch.testing.assert_close(worker.get_start_of_rl_logprobs(batch), start)
    worker.start_of_rl_weights = None
    worker.load_start_of_rl_weights(str(tmp_path / "start_of_rl"))
    torch.testing.assert_close(worker.get_start_of_rl_logprobs(batch), start, rtol=0, atol=0)
    torch.testing.assert_close(worker.get_logprobs(batch), trained)


def test_after_set_up_the_collector_no_longer_walks_the_model_but_still_collects_new_cycles():
    """The worker's set-up objects leave the collector's generations (a full collection walks
    them no more), and cyclic garbage made afterwards is collected as before."""
    cfg = tiny_config(megatron_cfg__mtp_num_layers=1)
    worker = MegatronPolicyWorker(cfg.policy, VOCAB_SIZE, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    modules = list(worker.policy.model.module.modules())

    def walked() -> int:
        tracked = {id(item) for item in gc.get_objects()}
        return sum(id(module) in tracked for module in modules)

    assert walked() == len(modules)  # the control: before the freeze, every module is walked
    try:
        worker.freeze_startup_heap()
        assert walked() == 0

        class Node:
            pass

        node = Node()
        node.itself = node
        alive = weakref.ref(node)
        del node
        gc.collect()
        assert alive() is None
    finally:
        gc.unfreeze()  # the rest of this test process collects as before
