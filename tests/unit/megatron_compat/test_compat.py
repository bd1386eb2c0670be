"""The MTP compat shims, against whichever megatron-core release is installed (the release matrix
runs this file under 0.16.1, 0.17.1, 0.18.2 and 0.19.2)."""

from __future__ import annotations

import inspect
import logging

import pytest
import torch
from megatron.core.models.gpt import gpt_model
from megatron.core.pipeline_parallel import schedules
from megatron.core.transformer import multi_token_prediction as mtp_module
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper, MultiTokenPredictionLayer

from nemo_rl_mtp.megatron_compat import shims as compat
from nemo_rl_mtp.megatron_compat import mtp_loss_callable
from nemo_rl_mtp.megatron_compat import recompute
from nemo_rl_mtp.megatron_compat._marks import is_shim
from nemo_rl_mtp.training.step import forward_backward_global_batch
from nemo_rl_mtp.cluster.worker import MegatronPolicyWorker
from tests.support.helpers import make_batch, make_policy, mtp_parameter_names
from tests.support.release_gates import on_this_release
from tests.unit.training.test_mtp_training_step import PG_LOSS, RAGGED_RESPONSES

pytestmark = pytest.mark.usefixtures("megatron_world")


def _unshimmed(function):
    return getattr(function, "original", function)


def _upstream_checkpointed_forward_parameters() -> set[str]:
    return set(inspect.signature(_unshimmed(MultiTokenPredictionLayer._checkpointed_forward)).parameters)


UPSTREAM_DERIVES_RL_LABELS = "input_ids" in inspect.signature(
    _unshimmed(getattr(mtp_module, "process_mtp_loss", lambda: None))
).parameters
UPSTREAM_LACKS_PADDING_MASK = (
    "forward_func" not in _upstream_checkpointed_forward_parameters()
    and "padding_mask" not in _upstream_checkpointed_forward_parameters()
)

# What each release needs, from the measured release matrix (independent of the shims' probes).
# mtp_loss_callable is needed on every release: megatron computes the MTP loss inside the forward.
SHIMS_NEEDED = {
    "0.16": {"metrics_tracker", "rl_labels", "grad_scale", "recompute", "mtp_loss_callable"},
    "0.17": {"metrics_tracker", "rl_labels", "grad_scale", "recompute", "mtp_loss_callable"},
    "0.18": {"metrics_tracker", "rl_labels", "grad_scale", "recompute", "mtp_loss_callable"},
    "0.19": {"mtp_loss_callable"},
}


def _release() -> str:
    return ".".join(compat.megatron_core_version().split(".")[:2])


@pytest.mark.skipif(_release() not in SHIMS_NEEDED, reason=on_this_release("a release outside the measured matrix"))
def test_shims_match_what_the_release_needs_and_log_it(caplog):
    with caplog.at_level(logging.INFO, logger=compat.__name__):
        outcomes = {outcome.name: outcome for outcome in compat.apply_mtp_compat_shims()}
    needed = SHIMS_NEEDED[_release()]
    assert {name for name, outcome in outcomes.items() if outcome.status == "applied"} == needed
    assert f"megatron-core {compat.megatron_core_version()}: {len(needed)} of 5 MTP compat shims applied" in caplog.text
    for name, outcome in outcomes.items():
        assert name in caplog.text and outcome.detail in caplog.text
        if outcome.status == "skipped":
            assert "upstream" in outcome.detail


# Where each shim installs itself (read from compat/*.py): every (owner, attribute) its apply() may
# replace, the first being the one that carries the shim mark.
SHIM_TARGETS = {
    "metrics_tracker": [(MTPLossLoggingHelper, "save_metrics_to_tracker"), (MTPLossLoggingHelper, "reduce_metrics_in_tracker")],
    "rl_labels": [(gpt_model.GPTModel, "_postprocess"), (gpt_model, "process_mtp_loss")],
    "grad_scale": [(schedules, "forward_step_calc_loss")],
    "recompute": [(MultiTokenPredictionLayer, "_checkpointed_forward")],
    # GPTModel, and HybridModel where the release has it (model_class: hybrid).
    "mtp_loss_callable": [(model_class, "compute_language_model_loss") for model_class in mtp_loss_callable.model_classes()],
}
_MISSING = object()


def _raw(owner, attribute):
    """What the owner itself holds (a staticmethod stays a staticmethod), or _MISSING."""
    return vars(owner).get(attribute, _MISSING)


def _snapshot(targets):
    return {target: _raw(*target) for target in targets}


def _restore(saved):
    for (owner, attribute), value in saved.items():
        if value is _MISSING:
            if attribute in vars(owner):
                delattr(owner, attribute)
        else:
            setattr(owner, attribute, value)


def _all_targets():
    return [target for targets in SHIM_TARGETS.values() for target in targets]


def test_shims_are_idempotent():
    """Applying the shims again (through the public entry) changes no attribute and reports the same
    outcomes; a shim skipped because upstream is fixed leaves megatron's own functions in place."""
    compat.apply_mtp_compat_shims()  # whatever this process had not installed yet is installed now
    before = _snapshot(_all_targets())
    first = compat.apply_mtp_compat_shims()
    between = _snapshot(_all_targets())
    second = compat.apply_mtp_compat_shims()
    after = _snapshot(_all_targets())
    assert [outcome.name for outcome in first] == ["metrics_tracker", "rl_labels", "grad_scale", "recompute", "mtp_loss_callable"]
    assert [(o.name, o.status, o.detail) for o in first] == [(o.name, o.status, o.detail) for o in second]
    for target, value in before.items():
        assert between[target] is value and after[target] is value, target
    for outcome in second:
        targets = SHIM_TARGETS[outcome.name]
        if outcome.status == "applied":
            assert outcome.detail == "already installed (idempotent)"
            marked = getattr(*targets[0])
            assert is_shim(marked)
            assert not is_shim(getattr(marked, "original", None))  # never a shim wrapping a shim
        else:
            assert outcome.status == "skipped" and "upstream" in outcome.detail
            for owner, attribute in targets:
                function = getattr(owner, attribute, None)
                if function is None:  # not on this release (process_mtp_loss before 0.17)
                    continue
                assert not is_shim(function), (owner, attribute)
                assert function.__module__.startswith("megatron.core."), (owner, attribute, function.__module__)
    if dict((o.name, o.status) for o in second)["rl_labels"] == "skipped" and hasattr(mtp_module, "process_mtp_loss"):
        # gpt_model's name for the loss is still the very function of the module that defines it.
        assert gpt_model.process_mtp_loss is mtp_module.process_mtp_loss


@pytest.mark.parametrize("name", [name for name, _ in compat.SHIMS])
def test_installing_a_shim_twice_installs_it_once(name):
    """Each shim's own apply(), forced even where the release does not need it (0.19.2 needs none):
    the second call is a no-op (same objects, no shim wrapping a shim). Restored afterwards."""
    shim = dict(compat.SHIMS)[name]
    targets = SHIM_TARGETS[name]
    saved = _snapshot(targets)
    was_installed = shim.is_applied()
    # The function each target held before this test, unwrapped from an earlier install of ours.
    upstream = {}
    for target in targets:
        function = getattr(*target, None)
        upstream[target] = function.original if is_shim(function) and hasattr(function, "original") else function
    try:
        first_detail = shim.apply()
        installed = _snapshot(targets)
        second_detail = shim.apply()
        assert second_detail == "already installed (idempotent)"
        if not was_installed:
            assert first_detail != "already installed (idempotent)"
            assert installed[targets[0]] is not saved[targets[0]]  # the first call did install
        assert shim.is_applied()
        assert shim.probe() == (True, "installed earlier in this process")
        assert all(_raw(*target) is installed[target] for target in targets)  # nothing replaced again
        marked = getattr(*targets[0])
        assert is_shim(marked)
        for target in targets:
            function = getattr(*target, None)
            if is_shim(function) and hasattr(function, "original"):
                assert not is_shim(function.original), target
                assert function.original is upstream[target], target
                assert function.original.__module__.startswith("megatron.core."), target
    finally:
        _restore(saved)
    assert all(_raw(*target) is saved[target] for target in targets)
    assert shim.is_applied() == was_installed


@pytest.mark.skipif(UPSTREAM_LACKS_PADDING_MASK, reason=on_this_release("its _checkpointed_forward rejects padding_mask (the 0.18 defect, tested below)"))
def test_padding_mask_shim_is_not_installed_where_declared():
    if "forward_func" in _upstream_checkpointed_forward_parameters():
        pytest.skip(on_this_release("the 0.14-0.17 _checkpointed_forward signature, handled by the positional-tensor shim"))
    assert "padding_mask" in inspect.signature(MultiTokenPredictionLayer._checkpointed_forward).parameters
    assert not is_shim(MultiTokenPredictionLayer._checkpointed_forward)


@pytest.mark.skipif(not UPSTREAM_LACKS_PADDING_MASK, reason=on_this_release("its _checkpointed_forward has no 0.18 padding_mask defect"))
def test_upstream_0_18_checkpointed_forward_rejects_padding_mask():
    """The bug itself, on the real release: forward passes padding_mask, the method refuses it."""
    compat.apply_mtp_compat_shims()
    upstream = MultiTokenPredictionLayer._checkpointed_forward.original
    with pytest.raises(TypeError, match="padding_mask"):
        upstream(object(), hidden_states=None, decoder_input=None, padding_mask=None)


@pytest.mark.skipif(not UPSTREAM_LACKS_PADDING_MASK, reason=on_this_release("its _checkpointed_forward has no 0.18 padding_mask defect"))
def test_padding_mask_shim_is_installed_on_the_0_18_release():
    compat.apply_mtp_compat_shims()
    method = MultiTokenPredictionLayer._checkpointed_forward
    assert is_shim(method)
    assert "padding_mask" in inspect.signature(method).parameters


def test_padding_mask_shim_forwards_everything_else_unchanged():
    calls = []

    def upstream(self, hidden_states, decoder_input, attention_mask=None, packed_seq_params=None):
        calls.append((self, hidden_states, decoder_input, attention_mask, packed_seq_params))
        return "out"

    shimmed = recompute.accept_padding_mask(upstream)
    layer, hidden, decoder_input, mask, params = object(), torch.ones(2), torch.zeros(2), torch.ones(1), object()
    assert shimmed(layer, hidden, decoder_input, attention_mask=mask, padding_mask=None, packed_seq_params=params) == "out"
    assert calls == [(layer, hidden, decoder_input, mask, params)]
    with pytest.raises(NotImplementedError, match="padding"):
        shimmed(layer, hidden, decoder_input, padding_mask=torch.zeros(2, 3))


def test_positional_tensor_shim_keeps_non_tensors_out_of_the_checkpoint():
    seen = {}

    def upstream(self, forward_func, *args):
        seen["checkpointed"] = args  # what the checkpoint would save_for_backward
        return forward_func(*args)

    def layer_forward(hidden_states, decoder_input=None, packed_seq_params=None, attention_mask=None):
        return hidden_states, decoder_input, packed_seq_params, attention_mask

    shimmed = recompute.positional_tensor_arguments(upstream)
    hidden, params = torch.ones(3), object()
    result = shimmed(object(), layer_forward, hidden, decoder_input=None, packed_seq_params=params, attention_mask=torch.zeros(1))
    assert all(value is None or torch.is_tensor(value) for value in seen["checkpointed"])
    assert result[0] is hidden and result[1] is None and result[2] is params and torch.equal(result[3], torch.zeros(1))


@pytest.mark.skipif(UPSTREAM_DERIVES_RL_LABELS, reason=on_this_release("derives RL labels itself"))
def test_without_the_rl_labels_shim_mtp_silently_does_not_train(monkeypatch):
    """Reproduce the silent failure on the real release (shim taken out): no loss, no gradient.
    0.16 crashes instead. megatron's own loss (cross_entropy): a loss on the policy's distribution
    fails earlier, at the forward whose MTP depths never reached it."""
    policy, cfg = make_policy(
        megatron_cfg__mtp_num_layers=2, megatron_cfg__mtp_loss_type="cross_entropy", train_micro_batch_size=2, train_global_batch_size=8
    )
    monkeypatch.setattr(gpt_model.GPTModel, "_postprocess", gpt_model.GPTModel._postprocess.original)
    if is_shim(getattr(gpt_model, "process_mtp_loss", None)):
        monkeypatch.setattr(gpt_model, "process_mtp_loss", gpt_model.process_mtp_loss.original)
    MTPLossLoggingHelper.tracker.clear()
    if not hasattr(mtp_module, "process_mtp_loss"):  # inline loss: labels.clone() on None
        with pytest.raises(AttributeError, match="clone"):
            forward_backward_global_batch(policy, make_batch(RAGGED_RESPONSES), PG_LOSS, cfg)
        return
    # The training step's guard: the step raises, naming the release, and no MTP gradient arose.
    with pytest.raises(RuntimeError, match=f"no MTP loss .* on megatron-core {compat.megatron_core_version()}"):
        forward_backward_global_batch(policy, make_batch(RAGGED_RESPONSES), PG_LOSS, cfg)
    assert all(policy.model.module.get_parameter(name).main_grad.abs().max() == 0 for name in mtp_parameter_names(policy))


@pytest.mark.skipif(not UPSTREAM_DERIVES_RL_LABELS, reason=on_this_release("no native process_mtp_loss with RL labels to compare with (megatron-core < 0.19)"))
@pytest.mark.parametrize("loss_type, packed", [("cross_entropy", False), ("total_variation", True)])
def test_rl_labels_backport_equals_native_process_mtp_loss(monkeypatch, loss_type, packed):
    """The back-port that 0.16-0.18 run in place of ``process_mtp_loss``, run on this release in
    place of its own: the same step (MTP loss, acceptance, forecast, every gradient) bit for bit on
    the same weights and batch, RL labels derived from input_ids in both."""
    from nemo_rl_mtp.megatron_compat import rl_labels
    from tests.support.helpers import gradients

    batch = make_batch(RAGGED_RESPONSES, sample_mask=[1, 1, 0, 1, 1, 1, 1, 1])
    steps, backport_calls = [], []

    def backport(*args, **kwargs):
        backport_calls.append(kwargs.get("input_ids") is not None)
        return rl_labels.process_mtp_loss_backport(*args, **kwargs)

    keys = {"megatron_cfg__mtp_loss_type": loss_type, "sequence_packing__enabled": packed}
    for use_backport in (False, True):
        if use_backport:
            monkeypatch.setattr(gpt_model, "process_mtp_loss", backport)
        policy, cfg = make_policy(megatron_cfg__mtp_num_layers=2, train_micro_batch_size=2, train_global_batch_size=8, **keys)
        steps.append((forward_backward_global_batch(policy, batch, PG_LOSS, cfg), gradients(policy)))
    (native_metrics, native_grads), (backport_metrics, backport_grads) = steps
    assert backport_calls and all(backport_calls)  # the back-port ran, on labels it derived
    assert backport_metrics == native_metrics
    assert backport_grads.keys() == native_grads.keys()
    for name, grad in native_grads.items():
        assert torch.equal(backport_grads[name], grad), name
    assert any(native_grads[name].abs().max() > 0 for name in mtp_parameter_names(policy))


def test_guard_fails_loudly_naming_the_release():
    config = type("Config", (), {"mtp_num_layers": 2, "mtp_loss_scaling_factor": 0.1})()
    version = compat.megatron_core_version()
    with pytest.raises(RuntimeError, match=f"no MTP loss.*megatron-core {version}"):
        compat.assert_mtp_trained(config, {}, mtp_grad_norm=1.0, global_valid_tokens=10)
    with pytest.raises(RuntimeError, match=f"no gradient.*megatron-core {version}"):
        compat.assert_mtp_trained(config, {"mtp_1_loss": 1.0}, mtp_grad_norm=0.0, global_valid_tokens=10)
    compat.assert_mtp_trained(config, {"mtp_1_loss": 1.0}, mtp_grad_norm=0.0, global_valid_tokens=0)  # all masked
    config.mtp_loss_scaling_factor = 0.0
    compat.assert_mtp_trained(config, {"mtp_1_loss": 1.0}, mtp_grad_norm=0.0, global_valid_tokens=10)


def test_guard_names_the_layers_that_got_no_target_in_a_real_step(caplog):
    """Prompts of 2 tokens, responses of 1-3: response tokens sit at positions 2-4, and depth k
    predicts position q from position q - k - 1 >= 0, so depths 1-3 see 7, 3 and 1 of the 7
    response tokens and depth 4 none (counted here from the layout, not by the code)."""
    worker = MegatronPolicyWorker.__new__(MegatronPolicyWorker)
    worker.policy, worker.policy_cfg = make_policy(megatron_cfg__mtp_num_layers=4, train_micro_batch_size=2, train_global_batch_size=4)
    batch = make_batch([1, 2, 3, 1], prompt_length=2)
    with caplog.at_level(logging.WARNING, logger=compat.__name__):
        metrics = worker.train(batch, PG_LOSS)
    assert [metrics[f"mtp/mtp_{depth}_target_tokens"] for depth in (1, 2, 3, 4)] == [7, 3, 1, 0]
    assert "MTP layers [4] got no targets" in caplog.text


def test_worker_step_passes_the_guard_with_the_shims():
    """The worker's train step (with the guard) on this release: MTP trains, metrics present."""
    worker = MegatronPolicyWorker.__new__(MegatronPolicyWorker)
    worker.policy, worker.policy_cfg = make_policy(
        megatron_cfg__mtp_num_layers=2, train_micro_batch_size=2, train_global_batch_size=8
    )
    metrics = worker.train(make_batch(RAGGED_RESPONSES), PG_LOSS)
    assert metrics["mtp/grad_norm"] > 0
    assert {"mtp/mtp_1_loss", "mtp/mtp_2_loss", "mtp/mtp_1_acceptance_rate", "mtp/mtp_2_acceptance_rate"} <= set(metrics)


def test_mtp_backward_is_seeded_with_one_over_global_tokens():
    """config.mtp_grad_scale_func reaches MTPLossAutoScaler on every release (natively on 0.19,
    through the grad_scale shim before): the seed left after a step is 1 / G."""
    policy, cfg = make_policy(megatron_cfg__mtp_num_layers=1, train_micro_batch_size=2, train_global_batch_size=8)
    batch = make_batch(RAGGED_RESPONSES)
    metrics = forward_backward_global_batch(policy, batch, PG_LOSS, cfg)
    seed = float(mtp_module.MTPLossAutoScaler.main_loss_backward_scale)
    assert seed == pytest.approx(1.0 / metrics["global_valid_tokens"], rel=1e-6)


def test_mtp_loss_substitute_applies_only_inside_its_block():
    """mtp_loss_callable: inside ``substituted_mtp_loss`` megatron's MTP loss calls go to the
    substitute (which can still call megatron's own); outside, and with None, nothing changes."""
    from nemo_rl_mtp.megatron_compat.mtp_loss_callable import substituted_mtp_loss

    compat.apply_mtp_compat_shims()
    policy, _ = make_policy(megatron_cfg__mtp_num_layers=2)
    model = policy.model.module
    labels, logits = torch.tensor([[1, 2]]), torch.randn(2, 1, 32)
    megatron = gpt_model.GPTModel.compute_language_model_loss.original(model, labels, logits.clone())
    calls = []

    def substitute(labels, logits, megatron_loss):
        calls.append(logits.shape)
        return megatron_loss(labels, logits) * 2

    with substituted_mtp_loss(substitute):
        inside = model.compute_language_model_loss(labels, logits.clone())
        with substituted_mtp_loss(None):
            nested_none = model.compute_language_model_loss(labels, logits.clone())
    outside = model.compute_language_model_loss(labels, logits.clone())
    assert calls == [logits.shape]
    assert torch.equal(inside, 2 * megatron) and torch.equal(nested_none, megatron) and torch.equal(outside, megatron)


def test_distribution_losses_are_refused_in_one_line_where_the_loss_is_unreachable(monkeypatch):
    """A release whose process_mtp_loss took no loss callable could not run them: refused before
    any worker starts (when the config is loaded), naming the key and the release (cross_entropy
    still runs)."""
    from nemo_rl_mtp.megatron_compat import mtp_loss_callable
    from nemo_rl_mtp.config.load import ConfigError
    from tests.support.helpers import tiny_config

    def process_mtp_loss(hidden_states, labels, loss_mask, output_layer, config):
        return hidden_states

    monkeypatch.setattr(mtp_module, "process_mtp_loss", process_mtp_loss, raising=False)
    assert mtp_loss_callable.unsupported_reason() is not None
    with pytest.raises(ConfigError, match=r"mtp_loss_type=total_variation is not supported by the installed megatron-core .*: process_mtp_loss takes no compute_language_model_loss"):
        tiny_config(megatron_cfg__mtp_loss_type="total_variation")
    tiny_config(megatron_cfg__mtp_loss_type="cross_entropy")
