"""The serving engines' position-0 convention on megatron-core's MTP layers (real megatron-core,
CPU): with ``mtp_zero_embedding_at_position_0`` the MTP logits equal a reference computed by hand
from the MTP layers' own modules with the token embedding at position 0 set to zero (and, as a
control, the same reference without zeroing equals the model with the option off); packed
sequences zero at every sequence start and nowhere else (packed steps equal unpacked ones, and
the mask of a real pack holds exactly the starts); full recompute trains the same gradients."""

from __future__ import annotations

import functools
import inspect
from types import SimpleNamespace

import pytest
import torch
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

from nemo_rl_mtp.megatron_compat import mtp_position_zero
from nemo_rl_mtp.megatron_compat._marks import is_shim
from nemo_rl_mtp.training.batches import build_microbatches, causal_attention_mask, round_up
from tests.support.helpers import eval_forward_logits, make_batch, make_policy
from tests.unit.training.test_mtp_training_step import assert_same_gradients, run_step

pytestmark = pytest.mark.usefixtures("megatron_world")

ZEROED = "megatron_cfg__mtp_zero_embedding_at_position_0"
RAGGED_RESPONSES = [1, 9, 3, 4, 8, 2, 6, 5]
TOKENS = torch.tensor([[3, 14, 15, 9, 2, 6, 5, 3, 5, 8, 9, 7], [2, 7, 1, 8, 2, 8, 18, 2, 8, 4, 5, 9]])


def captured_trunk_hidden(policy, tokens: torch.Tensor) -> torch.Tensor:
    """The hidden states [s, b, h] megatron hands the MTP block (the trunk's final output)."""
    captured = []
    model = policy.model.module
    hook = model.mtp.register_forward_pre_hook(lambda module, args, kwargs: captured.append(kwargs["hidden_states"]), with_kwargs=True)
    try:
        eval_forward_logits(policy, tokens, torch.ones_like(tokens))
    finally:
        hook.remove()
    return captured[0]


@torch.no_grad()
def hand_mtp_logits(policy, tokens: torch.Tensor, zero_position_0: bool) -> list[torch.Tensor]:
    """Each MTP depth's logits [b, s, v] from the MTP layers' modules, by the definition: depth d
    at position t takes the previous depth's output at t (the trunk's for d = 1) and the word
    embedding of token t + d (id 0 past the end, as megatron's roll fills), set to zero at t = 0
    with ``zero_position_0``; normed each, concatenated (embedding first), projected, one
    transformer layer with causal mask and the trunk's rotary embedding, final norm, output layer."""
    model = policy.model.module
    length = tokens.shape[1]
    hidden = captured_trunk_hidden(policy, tokens)
    rotary = model.rotary_pos_emb(length)
    mask = causal_attention_mask(length)
    depth_logits = []
    for depth, layer in enumerate(model.mtp.layers, start=1):
        shifted = torch.zeros_like(tokens)
        shifted[:, : length - depth] = tokens[:, depth:]
        embedded = model.embedding.word_embeddings(shifted).transpose(0, 1).clone()  # [s, b, h]
        if zero_position_0:
            embedded[0] = 0.0
        projected, _ = layer.eh_proj(torch.cat([layer.enorm(embedded), layer.hnorm(hidden)], dim=-1))
        transformer_layer = getattr(layer, "mtp_model_layer", None) or layer.transformer_layer  # 0.16: transformer_layer
        transformed, _ = transformer_layer(hidden_states=projected, attention_mask=mask, rotary_pos_emb=rotary)
        hidden = layer.final_layernorm(transformed)
        depth_logits.append(model.output_layer(hidden)[0].transpose(0, 1))
    return depth_logits


def test_mtp_logits_equal_the_hand_reference_with_position_0_zeroed_and_megatrons_without():
    """Two depths, same weights: on equals the zeroed reference, off the plain one (the control
    that the reference is megatron's computation), and the two differ at every depth."""
    logits = {}
    for zeroed in (True, False):
        policy, _ = make_policy(megatron_cfg__mtp_num_layers=2, **{ZEROED: zeroed})
        _, depths = eval_forward_logits(policy, TOKENS, torch.ones_like(TOKENS))
        reference = hand_mtp_logits(policy, TOKENS, zero_position_0=zeroed)
        for ours, expected in zip(depths, reference, strict=True):
            torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)
        logits[zeroed] = depths
    for on, off in zip(logits[True], logits[False]):
        gap = (on - off).abs().amax(dim=(0, 2))  # per position
        assert gap[0] > 1e-2, "position 0 reads a zero embedding"
        assert (gap[1:] > 0).all(), "later positions attend to position 0"


def test_the_trunk_and_an_off_model_run_megatrons_code_unchanged():
    """The option touches the MTP input only: trunk logits equal; and a model not marked runs
    the class-level wrapper's original path (same logits as before the wrapper existed is
    checked by the reference test's control)."""
    trunk = {}
    for zeroed in (True, False):
        policy, _ = make_policy(**{ZEROED: zeroed})
        trunk[zeroed], _ = eval_forward_logits(policy, TOKENS, torch.ones_like(TOKENS))
        assert mtp_position_zero.zeroes_position_0(policy.model.module) is zeroed
    torch.testing.assert_close(trunk[True], trunk[False], rtol=0, atol=0)


def test_marking_is_idempotent_and_the_wrapper_installed_once():
    policy, _ = make_policy(**{ZEROED: True})
    model = policy.model.module
    assert is_shim(MultiTokenPredictionBlock.forward)
    wrapper = MultiTokenPredictionBlock.forward
    assert mtp_position_zero.zero_embedding_at_position_0(model) is False  # marked at setup already
    assert MultiTokenPredictionBlock.forward is wrapper
    assert mtp_position_zero.probe() == (True, "installed earlier in this process")


def test_a_release_whose_mtp_block_takes_no_embedding_is_refused_in_one_line(monkeypatch):
    def forward(self, input_ids, position_ids, hidden_states, attention_mask):
        raise AssertionError("not called")

    monkeypatch.setattr(MultiTokenPredictionBlock, "forward", forward)
    with pytest.raises(RuntimeError, match="takes no packed_seq_params, embedding on this release"):
        mtp_position_zero.probe()


def test_a_block_that_ignores_the_embedding_it_is_handed_fails_loudly(monkeypatch):
    """A release whose MTP layers embed through something else would silently train megatron's
    convention: the wrapper counts the calls and refuses."""
    policy, _ = make_policy(**{ZEROED: True})
    model = policy.model.module
    wrapped = MultiTokenPredictionBlock.forward
    signature = inspect.signature(wrapped.original)

    @functools.wraps(wrapped.original)  # its signature is megatron's, as the wrapper reads it
    def original_ignoring_embedding(self, *args, **kwargs):
        arguments = signature.bind(self, *args, **kwargs).arguments
        arguments["embedding"] = model.embedding
        return wrapped.original(**arguments)

    monkeypatch.setattr(MultiTokenPredictionBlock, "forward", mtp_position_zero._forward_with_position_0_zeroed(original_ignoring_embedding))
    with pytest.raises(RuntimeError, match="without computing their token embedding through the embedding it was handed"):
        eval_forward_logits(policy, TOKENS, torch.ones_like(TOKENS))


@pytest.mark.parametrize("cp_size, sequence_parallel_size", [(1, 1), (1, 4), (2, 1)])
def test_the_mask_of_a_real_pack_holds_every_sequence_start_and_nothing_else(cp_size, sequence_parallel_size):
    """Packs built by training.batches (padded to the multiple that context and sequence
    parallelism need, padding at position id 0); the expected starts come from the lengths: each
    padded sequence's first token, on context-parallel rank 0 only."""
    batch = make_batch(RAGGED_RESPONSES)
    lengths = batch["input_lengths"].tolist()
    layout = SimpleNamespace(
        context_parallel_size=cp_size, sequence_parallel=sequence_parallel_size > 1,
        tensor_model_parallel_size=sequence_parallel_size, mtp_num_layers=1,
    )  # fmt: skip
    multiple = 2 * cp_size * sequence_parallel_size if cp_size > 1 else sequence_parallel_size
    padded = [round_up(length, multiple) for length in lengths]
    local_starts = [sum(padded[:i]) // cp_size for i in range(len(padded))]
    for cp_rank in range(cp_size):
        [microbatch] = build_microbatches(batch, len(lengths), True, layout, cp_rank, cp_size)
        mask = mtp_position_zero.position_0_mask(microbatch.position_ids, microbatch.packed_seq_params, cp_size)
        expected = torch.zeros_like(mask)
        if cp_rank == 0:
            expected[0, local_starts] = True
        assert torch.equal(mask, expected), (cp_rank, mask.nonzero().tolist(), local_starts)
        if cp_rank == 0 and multiple > 1:
            assert (microbatch.position_ids == 0).sum() > len(lengths)  # padding sits at position id 0 too


def test_the_mask_of_plain_rows_is_their_first_column():
    positions = torch.arange(6).expand(3, 6)
    expected = torch.zeros(3, 6, dtype=torch.bool)
    expected[:, 0] = True
    assert torch.equal(mtp_position_zero.position_0_mask(positions), expected)


@pytest.mark.parametrize("recompute", [False, True])
def test_packed_steps_equal_unpacked_ones_with_position_0_zeroed(recompute):
    """Each row's first token is zeroed in plain rows; a pack equals them only if every packed
    sequence's start is zeroed too (and full recompute, which reruns the MTP layers in the
    backward, trains the same gradients). Control: against an unpacked step without zeroing,
    the MTP gradients differ."""
    recompute_keys = (
        dict(megatron_cfg__recompute_granularity="full", megatron_cfg__recompute_method="uniform", megatron_cfg__recompute_num_layers=1)
        if recompute
        else {}
    )
    batch = make_batch(RAGGED_RESPONSES, sample_mask=[1, 1, 1, 1, 0, 1, 1, 1])
    results = {}
    for packed, zeroed in ((False, True), (True, True), (False, False)):
        policy, cfg = make_policy(
            megatron_cfg__mtp_num_layers=2,
            megatron_cfg__mtp_loss_type="cross_entropy",
            train_micro_batch_size=4,
            train_global_batch_size=8,
            sequence_packing__enabled=packed,
            **{ZEROED: zeroed},
            **recompute_keys,
        )
        results[packed, zeroed] = run_step(policy, cfg, batch)
    (unpacked_metrics, unpacked_grads), (packed_metrics, packed_grads) = results[False, True], results[True, True]
    for key in unpacked_metrics:
        assert packed_metrics[key] == pytest.approx(unpacked_metrics[key], rel=1e-4, abs=1e-6), key
    assert_same_gradients(unpacked_grads, packed_grads, rtol=1e-3, atol=1e-6)
    off_grads = results[False, False][1]
    assert (off_grads["mtp.layers.0.eh_proj.weight"] - unpacked_grads["mtp.layers.0.eh_proj.weight"]).abs().max() > 1e-6


def test_the_wrapped_forward_shows_megatrons_signature():
    """Probes of the block's signature (hybrid_mtp_padding looks for padding_mask) read megatron's
    arguments through the wrapper, which passes them all on."""
    make_policy(**{ZEROED: True})
    wrapped = MultiTokenPredictionBlock.forward
    assert is_shim(wrapped)
    assert inspect.signature(wrapped) == inspect.signature(wrapped.original)  # padding_mask included, where it exists
