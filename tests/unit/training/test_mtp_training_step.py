"""One MTP training step on real megatron-core (CPU): gradients, normalisation, masking, packing."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

from nemo_rl_mtp.training.losses import ClippedPGLossFn
from nemo_rl_mtp.megatron_compat.cpu import training_runtime as cpu_runtime
from nemo_rl_mtp.training.batches import causal_attention_mask, local_valid_tokens
from nemo_rl_mtp.training.step import forward_backward_global_batch
from tests.support.helpers import gradients, make_batch, make_policy, mtp_parameter_names

pytestmark = pytest.mark.usefixtures("megatron_world")

PG_LOSS = ClippedPGLossFn(ratio_clip_min=0.2, ratio_clip_max=0.2, reference_policy_kl_penalty=0.0)
# Response lengths whose pairs sum to 10: each microbatch of 2 holds the same number of MTP targets
# at every depth, so megatron's mean-over-microbatches loss equals the global token mean.
BALANCED_RESPONSES = [3, 7, 4, 6, 5, 5, 2, 8]
RAGGED_RESPONSES = [1, 9, 3, 4, 8, 2, 6, 5]


def zero_policy_loss(logprobs, inputs, global_valid_tokens):
    """Contributes no gradient, so the step's gradients are the MTP loss's alone."""
    return (logprobs * 0.0).sum(), {"loss": torch.zeros(())}


def run_step(policy, policy_cfg, batch, loss_fn=PG_LOSS):
    return forward_backward_global_batch(policy, batch, loss_fn, policy_cfg), gradients(policy)


def assert_same_gradients(first: dict, second: dict, rtol=1e-4, atol=1e-7):
    assert first.keys() == second.keys()
    for name in first:
        torch.testing.assert_close(first[name], second[name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("mtp_num_layers", [1, 2])
def test_mtp_parameters_receive_gradient(mtp_num_layers):
    policy, cfg = make_policy(megatron_cfg__mtp_num_layers=mtp_num_layers, train_micro_batch_size=2, train_global_batch_size=8)
    metrics, grads = run_step(policy, cfg, make_batch(RAGGED_RESPONSES))
    names = mtp_parameter_names(policy)
    assert names
    for layer in range(mtp_num_layers):
        layer_names = [name for name in names if name.startswith(f"mtp.layers.{layer}.")]
        assert layer_names and all(grads[name].abs().sum() > 0 for name in layer_names)
    assert metrics["mtp/grad_norm"] > 0
    for layer in range(1, mtp_num_layers + 1):
        assert math.isfinite(metrics[f"mtp/mtp_{layer}_loss"]) and metrics[f"mtp/mtp_{layer}_loss"] > 0
        assert 0 <= metrics[f"mtp/mtp_{layer}_acceptance_rate"] <= 100


def test_mtp_off_builds_no_mtp_and_computes_no_mask():
    policy, cfg = make_policy(megatron_cfg__mtp_num_layers=0, train_micro_batch_size=2, train_global_batch_size=8)
    assert not mtp_parameter_names(policy)
    assert getattr(policy.model.module, "mtp", None) is None
    assert not policy.config.mtp_num_layers

    seen_masks = []
    hook = policy.model.module.register_forward_pre_hook(
        lambda module, args, kwargs: seen_masks.append(kwargs["loss_mask"]), with_kwargs=True
    )
    try:
        metrics, _ = run_step(policy, cfg, make_batch(RAGGED_RESPONSES))
    finally:
        hook.remove()
    assert seen_masks == [None] * 4
    assert not [key for key in metrics if key.startswith("mtp")]
    assert getattr(policy.config, "mtp_grad_scale_func", None) is None


def reference_mtp_loss(policy, batch, mtp_num_layers: int, scaling_factor: float) -> torch.Tensor:
    """The MTP loss recomputed from the model's own MTP hidden states and output layer:

        sum_k (scaling_factor / L) * sum_{b, i} CE(logits_k[b, i], ids[b, i + 2 + k]) * m[b, i + 2 + k] / G

    with m = token_mask * sample_mask and G = sum(token_mask[:, 1:] * sample_mask) (the policy
    loss's valid-token count). Exact for prompts of at least L + 1 tokens (see train.py).
    """
    model = policy.model.module
    captured = []
    hook = model.mtp.register_forward_hook(lambda module, args, output: captured.append(output))
    input_ids = batch["input_ids"]
    seq_length = input_ids.shape[1]
    try:
        with cpu_runtime.device_scope():
            model(
                input_ids=input_ids,
                position_ids=torch.arange(seq_length).expand_as(input_ids),
                attention_mask=causal_attention_mask(seq_length),
                labels=None,
                loss_mask=None,
            )
    finally:
        hook.remove()
    mask = batch["token_mask"] * batch["sample_mask"][:, None]
    global_valid_tokens = local_valid_tokens(batch)
    hidden_chunks = torch.chunk(captured[0], 1 + mtp_num_layers, dim=0)
    total = torch.zeros(())
    for depth in range(mtp_num_layers):
        tied = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
        logits, _ = model.output_layer(hidden_chunks[depth + 1], weight=tied)
        logits = logits.transpose(0, 1)[:, : seq_length - 2 - depth]  # [b, s, v]
        targets = input_ids[:, 2 + depth :]
        weights = mask[:, 2 + depth :]
        cross_entropy = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
        total = total + scaling_factor / mtp_num_layers * (cross_entropy * weights.reshape(-1)).sum()
    return total / global_valid_tokens


@pytest.mark.parametrize("mtp_num_layers, tied_embeddings", [(1, False), (2, False), (2, True)])
def test_mtp_gradient_equals_independent_reference(mtp_num_layers, tied_embeddings):
    """With tied input and output embeddings too: the MTP heads' gradient reaches the one shared
    matrix through both the embedding of the shifted tokens and the output layer."""
    scaling_factor = 0.3
    policy, cfg = make_policy(
        megatron_cfg__mtp_num_layers=mtp_num_layers,
        megatron_cfg__mtp_loss_scaling_factor=scaling_factor,
        megatron_cfg__mtp_loss_type="cross_entropy",  # the reference is megatron's loss
        megatron_cfg__share_embeddings_and_output_weights=tied_embeddings,
        train_micro_batch_size=2,
        train_global_batch_size=8,
    )
    batch = make_batch(RAGGED_RESPONSES, sample_mask=[1, 1, 0, 1, 1, 1, 0, 1])
    _, step_grads = run_step(policy, cfg, batch, loss_fn=zero_policy_loss)

    # The reference forward also injects megatron's own MTP loss; seed its backward with zero.
    MTPLossAutoScaler.set_loss_scale(torch.zeros(1))
    reference = reference_mtp_loss(policy, batch, mtp_num_layers, scaling_factor)
    MTPLossLoggingHelper.tracker.clear()
    params = dict(policy.model.module.named_parameters())
    reference_grads = torch.autograd.grad(reference, list(params.values()), allow_unused=True)

    compared = 0
    for (name, _), reference_grad in zip(params.items(), reference_grads):
        if reference_grad is None:
            assert step_grads[name].abs().max() == 0, name
            continue
        torch.testing.assert_close(step_grads[name], reference_grad, rtol=2e-4, atol=1e-7, msg=name)
        compared += 1
    assert compared > len(mtp_parameter_names(policy))  # MTP block, embedding, trunk, output layer
    names = dict(policy.model.module.named_parameters())
    assert ("output_layer.weight" in names) != tied_embeddings


def test_short_prompts_warn_that_deeper_mtp_losses_are_reweighted(caplog):
    """Prompts of 2 tokens with 2 MTP layers: megatron's N_0/N_k re-weighting applies, and says so."""
    policy, cfg = make_policy(megatron_cfg__mtp_num_layers=2, train_micro_batch_size=4, train_global_batch_size=8)
    with caplog.at_level("WARNING"):
        run_step(policy, cfg, make_batch(RAGGED_RESPONSES, prompt_length=5))
        assert "re-weights" not in caplog.text
        run_step(policy, cfg, make_batch(RAGGED_RESPONSES, prompt_length=2))
    assert "8 sample(s) have prompts shorter than mtp_num_layers + 1 = 3 tokens" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        run_step(policy, cfg, make_batch(RAGGED_RESPONSES, prompt_length=2))
    assert "re-weights" not in caplog.text  # once per policy


@pytest.mark.parametrize("mtp_num_layers", [1, 2])
def test_one_vs_four_microbatches_give_same_gradients_and_metrics(mtp_num_layers):
    batch = make_batch(BALANCED_RESPONSES)
    results = []
    for micro_batch_size in (8, 2):
        policy, cfg = make_policy(
            megatron_cfg__mtp_num_layers=mtp_num_layers, train_micro_batch_size=micro_batch_size, train_global_batch_size=8
        )
        results.append(run_step(policy, cfg, batch))
    (metrics_one, grads_one), (metrics_four, grads_four) = results
    assert_same_gradients(grads_one, grads_four)
    assert metrics_one.keys() == metrics_four.keys()
    for key in metrics_one:
        assert metrics_one[key] == pytest.approx(metrics_four[key], rel=1e-4, abs=1e-6), key


def test_microbatch_split_of_ragged_batch_keeps_gradients_and_acceptance():
    batch = make_batch(RAGGED_RESPONSES)
    results = []
    for micro_batch_size in (8, 2):
        policy, cfg = make_policy(megatron_cfg__mtp_num_layers=2, train_micro_batch_size=micro_batch_size, train_global_batch_size=8)
        results.append(run_step(policy, cfg, batch))
    (metrics_one, grads_one), (metrics_four, grads_four) = results
    assert_same_gradients(grads_one, grads_four)
    for layer in (1, 2):
        key = f"mtp/mtp_{layer}_acceptance_rate"
        assert metrics_one[key] == pytest.approx(metrics_four[key], rel=1e-6)


def test_tokens_outside_the_mask_change_nothing():
    """Masked-out targets: whole samples with sample_mask 0, and padding after each response."""
    policy, cfg = make_policy(megatron_cfg__mtp_num_layers=2, train_micro_batch_size=2, train_global_batch_size=8)
    batch = make_batch(RAGGED_RESPONSES, sample_mask=[1, 1, 1, 0, 1, 1, 1, 0])
    metrics, grads = run_step(policy, cfg, batch)

    scrambled = {key: value.clone() for key, value in batch.items()}
    generator = torch.Generator().manual_seed(123)
    random_tokens = torch.randint(1, 32, batch["input_ids"].shape, generator=generator)
    invalid_sample = batch["sample_mask"] == 0
    scrambled["input_ids"][invalid_sample] = random_tokens[invalid_sample]
    past_end = torch.arange(batch["input_ids"].shape[1])[None, :] >= batch["input_lengths"][:, None]
    scrambled["input_ids"][past_end] = random_tokens[past_end]
    assert not torch.equal(scrambled["input_ids"], batch["input_ids"])

    scrambled_metrics, scrambled_grads = run_step(policy, cfg, scrambled)
    assert_same_gradients(grads, scrambled_grads, rtol=1e-5)
    for layer in (1, 2):
        for name in (f"mtp/mtp_{layer}_loss", f"mtp/mtp_{layer}_acceptance_rate"):
            assert scrambled_metrics[name] == pytest.approx(metrics[name], rel=1e-5)


def test_changing_an_unmasked_target_changes_the_mtp_gradient():
    """The counterpart of the test above: the same edit inside the mask is seen (by megatron's
    cross entropy, which trains on the token; the losses on the policy's distribution see the
    token only through the context of later targets)."""
    policy, cfg = make_policy(
        megatron_cfg__mtp_num_layers=1, megatron_cfg__mtp_loss_type="cross_entropy", train_micro_batch_size=2, train_global_batch_size=8
    )
    batch = make_batch(RAGGED_RESPONSES)
    _, grads = run_step(policy, cfg, batch, loss_fn=zero_policy_loss)
    edited = {key: value.clone() for key, value in batch.items()}
    last_response_token = batch["input_lengths"][1] - 1
    edited["input_ids"][1, last_response_token] = (batch["input_ids"][1, last_response_token] % 31) + 1
    _, edited_grads = run_step(policy, cfg, edited, loss_fn=zero_policy_loss)
    assert not torch.allclose(grads["mtp.layers.0.eh_proj.weight"], edited_grads["mtp.layers.0.eh_proj.weight"])


def test_all_masked_batch_gives_finite_metrics_and_zero_mtp_gradient():
    policy, cfg = make_policy(megatron_cfg__mtp_num_layers=2, train_micro_batch_size=2, train_global_batch_size=8)
    batch = make_batch(RAGGED_RESPONSES, sample_mask=[0.0] * 8)
    metrics, grads = run_step(policy, cfg, batch)
    assert all(math.isfinite(value) for value in metrics.values()), metrics
    assert metrics["mtp/mtp_1_acceptance_rate"] == 0.0 and metrics["mtp/mtp_2_acceptance_rate"] == 0.0
    assert all(torch.isfinite(grad).all() for grad in grads.values())
    assert all(grads[name].abs().max() == 0 for name in mtp_parameter_names(policy))


@pytest.mark.parametrize("recompute, loss_type", [(False, "cross_entropy"), (True, "cross_entropy"), (True, "soft_cross_entropy"), (False, "total_variation")])
def test_packed_and_unpacked_steps_agree(recompute, loss_type):
    """Packed (THD, cu_seqlens) through our CPU core attention vs plain rows, for megatron's MTP
    loss and the losses on the policy's distribution (``mtp_loss_type``)."""
    recompute_keys = (
        dict(megatron_cfg__recompute_granularity="full", megatron_cfg__recompute_method="uniform", megatron_cfg__recompute_num_layers=1)
        if recompute
        else {}
    )
    batch = make_batch(RAGGED_RESPONSES, sample_mask=[1, 1, 1, 1, 0, 1, 1, 1])
    results = []
    for packed in (False, True):
        policy, cfg = make_policy(
            megatron_cfg__mtp_num_layers=2,
            megatron_cfg__mtp_loss_type=loss_type,
            train_micro_batch_size=4,
            train_global_batch_size=8,
            sequence_packing__enabled=packed,
            **recompute_keys,
        )
        results.append(run_step(policy, cfg, batch))
    (unpacked_metrics, unpacked_grads), (packed_metrics, packed_grads) = results
    for key in unpacked_metrics:
        assert packed_metrics[key] == pytest.approx(unpacked_metrics[key], rel=1e-4, abs=1e-6), key
    assert_same_gradients(unpacked_grads, packed_grads, rtol=1e-3, atol=1e-6)


def test_grad_scale_func_and_mtp_tracker_are_cleared_after_the_step_even_on_error():
    """A step that raises leaves neither the MTP seed in the config nor its partial losses in
    megatron's class-level tracker (they would be added into the next step's metrics)."""
    policy, cfg = make_policy(megatron_cfg__mtp_num_layers=1, train_micro_batch_size=2, train_global_batch_size=8)

    def failing_loss(logprobs, inputs, global_valid_tokens):
        assert policy.config.mtp_grad_scale_func is not None  # set during the step
        raise RuntimeError("loss failed")

    with pytest.raises(RuntimeError, match="loss failed"):
        forward_backward_global_batch(policy, make_batch(RAGGED_RESPONSES), failing_loss, cfg)
    assert getattr(policy.config, "mtp_grad_scale_func", None) is None
    assert MTPLossLoggingHelper.tracker == {}
