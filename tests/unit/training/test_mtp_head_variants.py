"""MTP head variants on real megatron-core (CPU): detached heads and one repeated MTP layer.

Detached heads (``mtp_detach_heads``): megatron-core cuts the MTP graph off the main model at the
trunk's hidden states, the embedding of the shifted tokens and the output-layer weight, so the MTP
loss trains the MTP heads alone; it also tags the MTP parameters ``grad_norm_group='mtp'`` so the
optimizer computes their gradient norm, and clips them, separately from the rest.

Repeated layer (``mtp_use_repeated_layer``): a single MTP layer is applied at every depth, so its
gradient is the sum of every depth's contribution, each weighted mtp_loss_scaling_factor / depths.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from nemo_rl_mtp.training.losses import ClippedPGLossFn
from nemo_rl_mtp.megatron_compat.cpu import training_runtime as cpu_runtime
from nemo_rl_mtp.training.batches import causal_attention_mask, local_valid_tokens
from nemo_rl_mtp.training.step import forward_backward_global_batch, optimizer_step
from tests.support.helpers import gradients, make_batch, make_policy, mtp_parameter_names
from tests.support.release_gates import requires_config
from tests.unit.training.test_mtp_training_step import zero_policy_loss

pytestmark = pytest.mark.usefixtures("megatron_world")
# One MTP layer repeated over the depths: megatron-core >= 0.17.
repeated_layer = requires_config(megatron_cfg__mtp_num_layers=2, megatron_cfg__mtp_use_repeated_layer=True)

PG_LOSS = ClippedPGLossFn(ratio_clip_min=0.2, ratio_clip_max=0.2, reference_policy_kl_penalty=0.0)
# Prompts are 5 tokens (>= depths + 1 for every depth used here), so the step's MTP gradient is
# exactly the global per-token mean (see the docstring of train.py).
RAGGED_RESPONSES = [1, 9, 3, 4, 8, 2, 6, 5]
SAMPLE_MASK = [1, 1, 0, 1, 1, 1, 0, 1]
FOUR_MICROBATCHES = dict(train_micro_batch_size=2, train_global_batch_size=8)
SCALING_FACTOR = 0.3


def run_step(policy, policy_cfg, batch, loss_fn=PG_LOSS):
    """One forward/backward over the global batch (no optimizer step): metrics and gradients."""
    return forward_backward_global_batch(policy, batch, loss_fn, policy_cfg), gradients(policy)


def is_mtp(name: str) -> bool:
    return name.startswith("mtp.")


def assert_close_gradients(actual: dict, expected: dict, rtol: float, atol: float) -> None:
    assert actual.keys() == expected.keys()
    for name in actual:
        torch.testing.assert_close(actual[name], expected[name], rtol=rtol, atol=atol, msg=name)


# --- detached heads -------------------------------------------------------------------------


def trunk_gradient_change(detach_heads: bool) -> tuple[dict, dict]:
    """Gradients of the same policy-loss step with the MTP loss on and off (scaling factor 0):
    the first step's gradients, and per non-MTP parameter the largest change the MTP loss made."""
    batch = make_batch(RAGGED_RESPONSES, sample_mask=SAMPLE_MASK)
    steps = []
    for scaling_factor in (SCALING_FACTOR, 0.0):
        policy, cfg = make_policy(
            megatron_cfg__mtp_num_layers=2,
            megatron_cfg__mtp_detach_heads=detach_heads,
            megatron_cfg__mtp_loss_scaling_factor=scaling_factor,
            **FOUR_MICROBATCHES,
        )
        steps.append(run_step(policy, cfg, batch)[1])
    with_mtp, without_mtp = steps
    trunk = [name for name in with_mtp if not is_mtp(name)]
    assert trunk and all(without_mtp[name].abs().max() > 0 for name in trunk)  # the policy loss trains them
    change = {name: (with_mtp[name] - without_mtp[name]).abs().max().item() for name in trunk}
    return with_mtp, change


@requires_config(megatron_cfg__mtp_detach_heads=True)
def test_detached_heads_send_no_mtp_gradient_into_the_trunk():
    """Embedding, decoder and output layer get exactly the policy loss's gradient; the MTP
    heads still learn."""
    with_mtp, change = trunk_gradient_change(detach_heads=True)
    assert {name.split(".")[0] for name in change} >= {"embedding", "decoder", "output_layer"}
    leaking = {name: diff for name, diff in change.items() if diff > 1e-9}
    assert not leaking, f"MTP gradient leaks into the trunk with detached heads: {leaking}"
    mtp_names = [name for name in with_mtp if is_mtp(name)]
    assert {name.split(".")[2] for name in mtp_names} == {"0", "1"}
    assert all(with_mtp[name].abs().sum() > 0 for name in mtp_names)


def test_attached_heads_do_send_mtp_gradient_into_the_trunk():
    """The control of the test above: without detaching, the same comparison sees the MTP loss
    in the trunk's gradients, so that test can fail."""
    _, change = trunk_gradient_change(detach_heads=False)
    assert max(change.values()) > 1e-5, change
    assert change["embedding.word_embeddings.weight"] > 0 and change["output_layer.weight"] > 0


@requires_config(megatron_cfg__mtp_detach_heads=True)
def test_detached_heads_mtp_grad_norm_is_megatrons_mtp_group_norm():
    """megatron-core 0.19 tags detached MTP parameters ``grad_norm_group='mtp'`` and norms and
    clips them on their own: our ``mtp/grad_norm`` must be that norm, and megatron's main norm
    must leave the MTP gradients out."""
    clip_grad = 1e-4  # below both norms, so both groups are clipped
    policy, cfg = make_policy(
        megatron_cfg__mtp_num_layers=2,
        megatron_cfg__mtp_detach_heads=True,
        megatron_cfg__optimizer__clip_grad=clip_grad,
        **FOUR_MICROBATCHES,
    )
    params = dict(policy.model.module.named_parameters())
    assert {name for name, param in params.items() if getattr(param, "grad_norm_group", None) == "mtp"} == {
        name for name in params if is_mtp(name)
    }
    metrics, grads = run_step(policy, cfg, make_batch(RAGGED_RESPONSES, sample_mask=SAMPLE_MASK))
    main_norm = math.sqrt(sum(grad.double().square().sum().item() for name, grad in grads.items() if not is_mtp(name)))
    mtp_norm = math.sqrt(sum(grad.double().square().sum().item() for name, grad in grads.items() if is_mtp(name)))

    step_metrics = optimizer_step(policy)

    megatron_mtp_norm = float(policy.optimizer.grad_norms_by_group["mtp"])
    assert metrics["mtp/grad_norm"] == pytest.approx(megatron_mtp_norm, rel=1e-6)
    assert metrics["mtp/grad_norm"] == pytest.approx(mtp_norm, rel=1e-6)
    assert step_metrics["grad_norm"] == pytest.approx(main_norm, rel=1e-6)
    assert abs(main_norm - mtp_norm) > 1e-3 * main_norm  # the two norms are told apart
    # Each group was clipped by its own norm (clip_grad_by_total_norm_fp32: clip / (norm + 1e-6)).
    for name, param in params.items():
        norm = mtp_norm if is_mtp(name) else main_norm
        torch.testing.assert_close(param.main_grad, grads[name] * (clip_grad / (norm + 1e-6)), rtol=1e-5, atol=1e-12, msg=name)


# --- repeated layer -------------------------------------------------------------------------


def make_repeated_policy(mtp_num_layers: int, repeated: bool = True):
    """Trained with megatron's cross entropy, which the references write out."""
    return make_policy(
        megatron_cfg__mtp_num_layers=mtp_num_layers,
        megatron_cfg__mtp_use_repeated_layer=repeated,
        megatron_cfg__mtp_loss_scaling_factor=SCALING_FACTOR,
        megatron_cfg__mtp_loss_type="cross_entropy",
        **FOUR_MICROBATCHES,
    )


def mtp_block_inputs(policy, batch) -> dict:
    """The keyword arguments GPTModel hands its MTP block in an ordinary forward of the batch:
    the trunk's hidden states (with their autograd graph), token ids, rotary embedding, masks."""
    model = policy.model.module
    captured = {}
    handle = model.mtp.register_forward_pre_hook(lambda module, args, kwargs: captured.update(kwargs), with_kwargs=True)
    seq_length = batch["input_ids"].shape[1]
    try:
        with cpu_runtime.device_scope():
            model(
                input_ids=batch["input_ids"],
                position_ids=torch.arange(seq_length).expand_as(batch["input_ids"]),
                attention_mask=causal_attention_mask(seq_length),
                labels=None,
                loss_mask=None,
            )
    finally:
        handle.remove()
        MTPLossLoggingHelper.tracker.clear()  # that forward's own MTP loss is not the step's
    return captured


def reference_repeated_mtp_loss(policy, batch, num_depths: int, scaling_factor: float, depths=None) -> torch.Tensor:
    """The MTP loss by hand, the model's single MTP layer applied once per depth:

        sum_{k in depths} (scaling_factor / num_depths) * sum_{b, i} CE(logits_k[b, i], ids[b, i + 2 + k]) * m[b, i + 2 + k] / G

    where h_0 is the trunk's output, h_{k+1} = layer(h_k, embedding of ids shifted by k + 1) and
    logits_k = output_layer(h_{k+1}); m = token_mask * sample_mask and G the policy loss's
    valid-token count. ``depths`` (default: all) keeps only some depths' terms.
    """
    model = policy.model.module
    (layer,) = model.mtp.layers
    state = mtp_block_inputs(policy, batch)
    input_ids = batch["input_ids"]
    seq_length = input_ids.shape[1]
    mask = batch["token_mask"] * batch["sample_mask"][:, None]
    total = torch.zeros(())
    with cpu_runtime.device_scope():
        for depth in range(num_depths):
            hidden, ids, position_ids, *padding_mask = layer(**state)  # 0.18 on return the rolled padding mask too
            state.update(hidden_states=hidden, input_ids=ids, position_ids=position_ids)
            if padding_mask:
                state["padding_mask"] = padding_mask[0]
            assert torch.equal(ids[:, : seq_length - depth - 1], input_ids[:, depth + 1 :])  # what depth k sees
            if depths is not None and depth not in depths:
                continue
            logits, _ = model.output_layer(hidden)
            logits = logits.transpose(0, 1)[:, : seq_length - 2 - depth]  # [b, s, v]
            targets = input_ids[:, 2 + depth :]
            cross_entropy = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
            total = total + scaling_factor / num_depths * (cross_entropy * mask[:, 2 + depth :].reshape(-1)).sum()
    return total / local_valid_tokens(batch)


def reference_gradients(policy, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gradient of ``loss`` for every parameter, zero where the loss does not reach it."""
    params = dict(policy.model.module.named_parameters())
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return {name: torch.zeros_like(param) if grad is None else grad for (name, param), grad in zip(params.items(), grads)}


@repeated_layer
def test_repeated_layer_holds_one_mtp_layer():
    """Three depths, one set of MTP weights: the same parameters as a one-layer MTP block."""
    repeated, _ = make_repeated_policy(mtp_num_layers=3)
    single, _ = make_repeated_policy(mtp_num_layers=1, repeated=False)
    names = mtp_parameter_names(repeated)
    assert names and all(name.startswith("mtp.layers.0.") for name in names)
    assert len(repeated.model.module.mtp.layers) == 1
    assert names == mtp_parameter_names(single)
    for name, param in repeated.model.module.named_parameters():
        if is_mtp(name):
            assert param.shape == single.model.module.get_parameter(name).shape


@repeated_layer
@pytest.mark.parametrize("mtp_num_layers", [2, 3])
def test_repeated_layer_gradient_equals_independent_reference(mtp_num_layers):
    """The step's gradients (MTP loss only) are those of the hand-computed repeated-layer loss,
    for the MTP layer and, since the heads are attached, for the trunk and output layer too."""
    policy, cfg = make_repeated_policy(mtp_num_layers)
    batch = make_batch(RAGGED_RESPONSES, sample_mask=SAMPLE_MASK)
    _, step_grads = run_step(policy, cfg, batch, loss_fn=zero_policy_loss)
    expected = reference_gradients(policy, reference_repeated_mtp_loss(policy, batch, mtp_num_layers, SCALING_FACTOR))
    assert all(expected[name].abs().sum() > 0 for name in mtp_parameter_names(policy))
    assert_close_gradients(step_grads, expected, rtol=1e-5, atol=1e-7)


@repeated_layer
def test_repeated_layer_gradient_sums_over_depths():
    """With two depths, depth 0 is exactly the one-depth step at half the weight (s/2 instead of
    s), so the two-depth gradient is half the one-depth gradient plus the reference's depth-1 term,
    and differs from both."""
    batch = make_batch(RAGGED_RESPONSES, sample_mask=SAMPLE_MASK)
    one_depth, one_cfg = make_repeated_policy(mtp_num_layers=1)
    two_depths, two_cfg = make_repeated_policy(mtp_num_layers=2)
    for (name, param), other in zip(one_depth.model.module.named_parameters(), two_depths.model.module.parameters()):
        assert torch.equal(param, other), name  # same weights
    _, one_grads = run_step(one_depth, one_cfg, batch, loss_fn=zero_policy_loss)
    _, two_grads = run_step(two_depths, two_cfg, batch, loss_fn=zero_policy_loss)

    second_depth = reference_gradients(
        two_depths, reference_repeated_mtp_loss(two_depths, batch, 2, SCALING_FACTOR, depths=[1])
    )
    predicted = {name: one_grads[name] / 2 + second_depth[name] for name in one_grads}
    assert_close_gradients(two_grads, predicted, rtol=1e-5, atol=1e-7)
    for name in mtp_parameter_names(two_depths):
        assert second_depth[name].abs().max() > 1e-3 * two_grads[name].abs().max(), name
        assert not torch.allclose(two_grads[name], one_grads[name], rtol=1e-3), name
