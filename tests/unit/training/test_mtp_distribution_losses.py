"""MTP losses on the policy's distribution (``policy.megatron_cfg.mtp_loss_type``) on real
megatron-core (CPU): the gradient against a reference written out position by position, the
invariances every MTP step keeps (microbatch split, packing, recompute), megatron's cross entropy
unchanged bit for bit, and the chunked vocab-parallel kernel against plain softmaxes. Packing and
recompute: test_mtp_training_step.py, with every loss type."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.gpt import gpt_model
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

from nemo_rl_mtp.training.batches import local_valid_tokens
from nemo_rl_mtp.training.draft_distributions import draft_terms, entropy_sum
from tests.support.helpers import forward_logits, make_batch, make_policy, mtp_parameter_names
from tests.unit.training.test_setup import _release, needs_field
from tests.support.release_gates import on_this_release
from tests.unit.training.test_mtp_training_step import (
    RAGGED_RESPONSES,
    assert_same_gradients,
    run_step,
    zero_policy_loss,
)

pytestmark = pytest.mark.usefixtures("megatron_world")

LOSS_TYPES = ["soft_cross_entropy", "total_variation"]
SAMPLE_MASK = [1, 1, 0, 1, 1, 1, 0, 1]


def per_position_loss(loss_type: str, p: torch.Tensor, q_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The loss of one target from its definition: p a probability vector (detached), q_logits the
    head's logits over the tokenizer's ids."""
    q = torch.softmax(q_logits / temperature, dim=-1)
    if loss_type == "soft_cross_entropy":
        return -(p * torch.log_softmax(q_logits / temperature, dim=-1)).sum()
    return 0.5 * (p - q).abs().sum()  # total variation distance, = 1 - sum min(p, q)


def reference_loss(policy, batch, loss_type: str, scaling_factor: float, temperature: float) -> torch.Tensor:
    """sum_k (scaling_factor / L) sum_{b, t} m[b, t] loss(p_{b, t - 1}, q^k_{b, t - 2 - k}) / G, the
    logits from one training-mode forward of megatron's model (``forward_logits``), m = token_mask * sample_mask,
    G = sum(token_mask[:, 1:] * sample_mask). Prompts of 5 tokens: megatron's N_0 / N_k is 1."""
    logits, depth_logits = forward_logits(policy, batch["input_ids"], None)
    num_layers, vocab = len(depth_logits), policy.vocab_size
    mask = batch["token_mask"] * batch["sample_mask"][:, None]
    total = torch.zeros(())
    for depth, head in enumerate(depth_logits):
        for row, target in mask.nonzero().tolist():
            if target < depth + 2:
                continue
            p = torch.softmax(logits[row, target - 1, :vocab].detach() / temperature, dim=-1)
            loss = per_position_loss(loss_type, p, head[row, target - 2 - depth, :vocab], temperature)
            total = total + scaling_factor / num_layers * mask[row, target] * loss
    return total / local_valid_tokens(batch)


def reference_gradients(policy, batch, loss_type, scaling_factor, temperature) -> dict[str, torch.Tensor]:
    MTPLossAutoScaler.set_loss_scale(torch.zeros(1))  # the reference forward's own MTP loss: no gradient
    loss = reference_loss(policy, batch, loss_type, scaling_factor, temperature)
    MTPLossLoggingHelper.tracker.clear()
    params = dict(policy.model.module.named_parameters())
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return {name: grad for name, grad in zip(params, grads)}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize(
    "variant",
    [
        dict(megatron_cfg__mtp_num_layers=1),
        dict(megatron_cfg__mtp_num_layers=2, generation__temperature=0.7),
        pytest.param(dict(megatron_cfg__mtp_num_layers=2, megatron_cfg__mtp_detach_heads=True), marks=needs_field("mtp_detach_heads")),
        pytest.param(
            dict(megatron_cfg__mtp_num_layers=2, megatron_cfg__mtp_use_repeated_layer=True), marks=needs_field("mtp_use_repeated_layer")
        ),
        # An MoE trunk and MoE MTP layer (load balancing off: the gradient is the MTP loss's alone).
        pytest.param(
            dict(
                megatron_cfg__mtp_num_layers=1,
                megatron_cfg__num_moe_experts=4,
                megatron_cfg__moe_router_load_balancing_type="none",
                megatron_cfg__moe_aux_loss_coeff=0.0,
            ),
            # 0.17 lacks the MoE logging module moe.py reads; 0.16's MoE layers need TE on the CPU.
            marks=pytest.mark.skipif(_release() < (0, 18), reason=on_this_release("MoE on the CPU needs megatron-core >= 0.18")),
        ),
    ],
    ids=["1_layer", "2_layers_t0.7", "detached", "repeated", "moe"],
)
def test_gradient_equals_reference_written_per_position(loss_type, variant):
    scaling_factor = 0.3
    policy, cfg = make_policy(
        megatron_cfg__mtp_loss_type=loss_type,
        megatron_cfg__mtp_loss_scaling_factor=scaling_factor,
        train_micro_batch_size=2,
        train_global_batch_size=8,
        **variant,
    )
    batch = make_batch(RAGGED_RESPONSES, sample_mask=SAMPLE_MASK)
    metrics, step_grads = run_step(policy, cfg, batch, loss_fn=zero_policy_loss)
    expected = reference_gradients(policy, batch, loss_type, scaling_factor, cfg.generation.temperature)
    compared = 0
    for name, reference in expected.items():
        if reference is None:
            assert step_grads[name].abs().max() == 0, name
            continue
        torch.testing.assert_close(step_grads[name], reference, rtol=2e-4, atol=1e-7, msg=name)
        compared += reference.abs().max() > 0
    assert compared >= len(mtp_parameter_names(policy)) // 2
    trunk = step_grads["decoder.layers.0.self_attention.linear_qkv.weight"]
    reaches_trunk = bool(trunk.abs().max() > 0)
    assert reaches_trunk != cfg.megatron_cfg.mtp_detach_heads
    assert metrics["mtp/grad_norm"] > 0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_logged_loss_is_the_per_token_mean_of_the_loss(loss_type):
    """``mtp_1_loss`` is the trained loss's token mean (one microbatch), from the same reference."""
    policy, cfg = make_policy(megatron_cfg__mtp_loss_type=loss_type, megatron_cfg__mtp_loss_scaling_factor=1.0, train_micro_batch_size=8, train_global_batch_size=8)
    batch = make_batch(RAGGED_RESPONSES, sample_mask=SAMPLE_MASK)
    with torch.no_grad():
        MTPLossAutoScaler.set_loss_scale(torch.zeros(1))
        expected = float(reference_loss(policy, batch, loss_type, 1.0, 1.0))
        MTPLossLoggingHelper.tracker.clear()
    metrics, _ = run_step(policy, cfg, batch)
    assert metrics["mtp/mtp_1_loss"] == pytest.approx(expected, rel=1e-5)
    assert 0 < metrics["mtp/mtp_1_acceptance_rate"] <= 100  # megatron's own top-1 count still runs


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_forecast_is_the_same_whichever_loss_computes_it(loss_type):
    """The forecast from the fused pass equals the one computed beside megatron's cross entropy
    (on copies of the logits), on the same weights and batch."""
    batch = make_batch(RAGGED_RESPONSES, prompt_length=1, sample_mask=SAMPLE_MASK)
    forecasts = []
    for mtp_loss_type in ("cross_entropy", loss_type):
        policy, cfg = make_policy(
            megatron_cfg__mtp_num_layers=2, megatron_cfg__mtp_loss_type=mtp_loss_type, train_micro_batch_size=4, train_global_batch_size=8
        )
        metrics, _ = run_step(policy, cfg, batch)
        forecasts.append([metrics[f"mtp/mtp_{depth}_expected_acceptance"] for depth in (1, 2)])
    assert forecasts[0] == pytest.approx(forecasts[1], abs=1e-5)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_one_vs_four_microbatches_on_a_ragged_batch(loss_type):
    batch = make_batch(RAGGED_RESPONSES, sample_mask=SAMPLE_MASK)
    results = []
    for micro_batch_size in (8, 2):
        policy, cfg = make_policy(
            megatron_cfg__mtp_num_layers=2, megatron_cfg__mtp_loss_type=loss_type, train_micro_batch_size=micro_batch_size, train_global_batch_size=8
        )
        results.append(run_step(policy, cfg, batch))
    (metrics_one, grads_one), (metrics_four, grads_four) = results
    assert_same_gradients(grads_one, grads_four)
    for key in ("mtp/mtp_1_expected_acceptance", "mtp/mtp_2_expected_acceptance", "entropy", "loss"):
        assert metrics_one[key] == pytest.approx(metrics_four[key], rel=1e-5), key


def test_cross_entropy_is_megatrons_loss_bit_for_bit():
    """``cross_entropy`` runs megatron's own MTP loss: gradients and MTP metrics are identical, to
    the bit, to a step in which megatron's loss call is left as megatron wrote it (the shim's
    original restored, so the forecast's copies are not taken)."""
    batch = make_batch(RAGGED_RESPONSES, sample_mask=SAMPLE_MASK)
    results = []
    for substitutable in (True, False):
        policy, cfg = make_policy(
            megatron_cfg__mtp_num_layers=2, megatron_cfg__mtp_loss_type="cross_entropy", train_micro_batch_size=2, train_global_batch_size=8
        )
        shimmed = gpt_model.GPTModel.compute_language_model_loss
        if not substitutable:
            gpt_model.GPTModel.compute_language_model_loss = shimmed.original
        try:
            results.append(run_step(policy, cfg, batch))
        finally:
            gpt_model.GPTModel.compute_language_model_loss = shimmed
    (metrics, grads), (megatron_metrics, megatron_grads) = results
    assert "mtp/mtp_1_expected_acceptance" in metrics and "mtp/mtp_1_expected_acceptance" not in megatron_metrics
    for name, grad in grads.items():
        assert torch.equal(grad, megatron_grads[name]), name
    for key, value in megatron_metrics.items():
        if key != "mtp/grad_norm":
            assert metrics[key] == value, key
    assert metrics["mtp/grad_norm"] == megatron_metrics["mtp/grad_norm"]


# --- the chunked kernel on its own -----------------------------------------------------------


def _kernel_case(rows=13, shard=11, vocab_size=9, seed=0):
    generator = torch.Generator().manual_seed(seed)
    draft = torch.randn(rows, shard, generator=generator) * 2
    policy = torch.randn(rows + 3, shard, generator=generator) * 2
    policy_index = torch.randint(0, rows + 3, (rows,), generator=generator)
    mask = torch.rand(rows, generator=generator) * (torch.rand(rows, generator=generator) > 0.3)
    return draft, policy, policy_index, mask, vocab_size


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("chunk_elements", [None, 11, 40])
def test_kernel_matches_plain_softmaxes_and_autograd(loss_type, chunk_elements):
    """Loss, gradient and overlap against torch's softmax and autograd, with padding ids (shard
    columns >= vocab_size) excluded, a weighted mask, and chunks of 1 and 3 rows."""
    draft, policy, policy_index, mask, vocab_size = _kernel_case()
    temperature, scale = 0.8, 0.37
    leaf = draft.clone().requires_grad_(True)
    reference_draft = leaf[:, :vocab_size]
    p = torch.softmax(policy[policy_index, :vocab_size] / temperature, dim=-1)
    q = torch.softmax(reference_draft / temperature, dim=-1)
    per_row = [per_position_loss(loss_type, p[r], reference_draft[r], temperature) for r in range(len(mask))]
    reference = scale * (torch.stack(per_row) * mask).sum()
    reference.backward()
    overlap = (torch.minimum(p, q).sum(dim=-1) * (mask > 0)).sum()

    kernel_input = draft.clone().requires_grad_(True)
    loss, value, kernel_overlap = draft_terms(
        kernel_input * 1.0, policy, policy_index, mask, (mask > 0).float(), loss_type, scale, temperature, vocab_size, chunk_elements
    )
    loss.backward()
    torch.testing.assert_close(loss, reference.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(value * scale, reference.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kernel_overlap, overlap, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kernel_input.grad, leaf.grad, rtol=1e-5, atol=1e-7)
    assert kernel_input.grad[:, vocab_size:].abs().max() == 0


def test_kernel_forecast_only_leaves_the_logits_alone_and_entropy_matches():
    draft, policy, policy_index, mask, vocab_size = _kernel_case()
    before = draft.clone()
    loss, _, overlap = draft_terms(draft, policy, policy_index, mask, (mask > 0).float(), None, 0.0, 1.0, vocab_size, 11)
    assert torch.equal(draft, before) and float(loss) == 0.0 and float(overlap) > 0
    p = torch.softmax(policy[:, :vocab_size] / 0.7, dim=-1)
    weights = torch.rand(policy.shape[0], generator=torch.Generator().manual_seed(3))
    expected = (-(p * p.log()).sum(dim=-1) * weights).sum()
    torch.testing.assert_close(entropy_sum(policy, weights, 0.7, vocab_size, chunk_elements=22), expected, rtol=1e-5, atol=1e-6)


def _kernel_results(draft, policy, policy_index, mask, loss_type, vocab_size, chunk_elements) -> dict[str, torch.Tensor]:
    leaf = draft.clone().requires_grad_(True)
    loss, _, overlap = draft_terms(leaf * 1.0, policy, policy_index, mask, (mask > 0).float(), loss_type, 0.37, 0.8, vocab_size, chunk_elements)
    loss.backward()
    return {"loss": loss.detach(), "overlap": overlap, "grad": leaf.grad}


def _tensor_parallel_rank(rank: int, init_method: str, result_path: str):
    """One of two tensor-parallel ranks: its half of the vocabulary (the last ids padding)."""
    from megatron.core import parallel_state

    torch.distributed.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    draft, policy, policy_index, mask, vocab_size = _kernel_case(shard=12, vocab_size=10)
    shard = slice(6 * rank, 6 * rank + 6)
    results = {}
    for loss_type in LOSS_TYPES:
        results[loss_type] = _kernel_results(draft[:, shard], policy[:, shard], policy_index, mask, loss_type, vocab_size, 12)
        gathered = [torch.empty_like(results[loss_type]["grad"]) for _ in range(2)]
        torch.distributed.all_gather(gathered, results[loss_type]["grad"])
        results[loss_type]["grad"] = torch.cat(gathered, dim=-1)
    results["entropy"] = entropy_sum(policy[:, shard], torch.linspace(0, 1, policy.shape[0]), 0.8, vocab_size, chunk_elements=12)
    if rank == 0:
        torch.save(results, result_path)


@pytest.mark.slow
def test_kernel_over_two_tensor_parallel_ranks_equals_one_rank(tmp_path):
    """Vocab-parallel: the logits split over two ranks (gloo processes) give the loss, overlap,
    entropy and gradient of the whole vocabulary on one rank, for every loss type."""
    import torch.multiprocessing as mp

    from tests.support.helpers import free_port

    draft, policy, policy_index, mask, vocab_size = _kernel_case(shard=12, vocab_size=10)
    result_path = tmp_path / "tp2.pt"
    mp.start_processes(_tensor_parallel_rank, args=(f"tcp://127.0.0.1:{free_port()}", str(result_path)), nprocs=2, start_method="spawn")
    result = torch.load(result_path)
    for loss_type in LOSS_TYPES:
        expected = _kernel_results(draft, policy, policy_index, mask, loss_type, vocab_size, 24)
        for key, value in expected.items():
            torch.testing.assert_close(result[loss_type][key], value, rtol=1e-5, atol=1e-7, msg=f"{loss_type} {key}")
    expected_entropy = entropy_sum(policy, torch.linspace(0, 1, policy.shape[0]), 0.8, vocab_size)
    torch.testing.assert_close(result["entropy"], expected_entropy, rtol=1e-5, atol=1e-7)
