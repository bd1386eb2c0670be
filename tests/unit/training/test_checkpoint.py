"""Policy checkpoints: a save round-trips the weights, and its in-process results queue is set for
the save alone (megatron's own queue, a Manager process, stays what an async save would get)."""

from __future__ import annotations

import multiprocessing.context

import pytest
import torch

from nemo_rl_mtp.training.checkpoint import load_model_weights, save_policy
from tests.support.helpers import make_policy

pytestmark = pytest.mark.usefixtures("megatron_world")


def test_a_save_spawns_no_manager_process_and_leaves_megatrons_queue_unset(tmp_path, monkeypatch):
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def no_manager(*args, **kwargs):
        raise AssertionError("a save started a multiprocessing Manager")

    monkeypatch.setattr(multiprocessing.context.BaseContext, "Manager", no_manager)
    policy, _ = make_policy()
    assert filesystem_async._results_queue is None
    save_policy(policy, tmp_path / "step_000001")
    assert filesystem_async._results_queue is None  # put back: an async save gets megatron's own queue
    monkeypatch.undo()
    # 0.16 names it _get_write_results_queue
    megatrons_queue = getattr(filesystem_async, "get_write_results_queue", None) or filesystem_async._get_write_results_queue
    with pytest.raises(AssertionError, match="Manager"):  # control: megatron's queue would have needed one
        monkeypatch.setattr(multiprocessing.context.BaseContext, "Manager", no_manager)
        megatrons_queue()


def test_model_weights_load_from_a_policy_checkpoint(tmp_path):
    saved, _ = make_policy()
    save_policy(saved, tmp_path / "step_000001")
    other, _ = make_policy(megatron_cfg__seed=7)
    assert not all(torch.equal(a, b) for a, b in zip(saved.model.module.parameters(), other.model.module.parameters()))
    load_model_weights(other.model.module, tmp_path / "step_000001" / "policy")
    assert all(torch.equal(a, b) for a, b in zip(saved.model.module.parameters(), other.model.module.parameters()))
