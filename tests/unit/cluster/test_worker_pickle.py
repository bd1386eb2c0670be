"""Ray ships the worker class with cloudpickle; it must pickle by value once torch.distributed and
megatron are loaded (the failure mode NeMo-RL hit: ``cannot pickle 'ConfigModuleInstance'``)."""

from __future__ import annotations

import cloudpickle
import megatron.core.models.gpt  # noqa: F401  (load megatron as a worker would)
import torch.distributed  # noqa: F401

from nemo_rl_mtp.cluster import worker as megatron_policy_worker


def test_worker_class_pickles_by_value():
    cloudpickle.register_pickle_by_value(megatron_policy_worker)
    try:
        payload = cloudpickle.dumps(megatron_policy_worker.MegatronPolicyWorker)
    finally:
        cloudpickle.unregister_pickle_by_value(megatron_policy_worker)
    restored = cloudpickle.loads(payload)
    assert restored.__name__ == "MegatronPolicyWorker"
    assert {"train", "imitate"} <= set(vars(restored))


def test_the_check_catches_the_known_failure(tmp_path, monkeypatch):
    """Control: a worker whose method names torch.distributed and ``config`` fails to pickle here,
    so the test above would see that regression."""
    import importlib
    import sys

    import pytest

    (tmp_path / "inline_metrics_worker.py").write_text(
        "import torch\n"
        "class Worker:\n"
        "    def train(self):\n"
        "        torch.distributed.barrier()\n"
        "        return self.config\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("inline_metrics_worker")
    assert "torch.distributed.config" in sys.modules
    cloudpickle.register_pickle_by_value(module)
    try:
        with pytest.raises(TypeError, match="ConfigModuleInstance"):
            cloudpickle.dumps(module.Worker)
    finally:
        cloudpickle.unregister_pickle_by_value(module)
