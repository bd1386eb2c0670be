"""Worker-side data path: MTP mask, microbatching, packing (pure tensor code, no model)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from nemo_rl_mtp.training.batches import (
    build_microbatches,
    compute_mtp_loss_mask,
    pack_sequences,
    sequence_length_multiple,
)
from tests.support.helpers import make_batch, tiny_config


def _all_responses(batch):
    return compute_mtp_loss_mask(batch["token_mask"], batch["sample_mask"], batch["advantages"], "all_responses")


def test_mtp_loss_mask_is_response_tokens_of_valid_samples():
    token_mask = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1], [0, 0, 0, 1, 1]], dtype=torch.float)
    sample_mask = torch.tensor([1.0, 0.0, 1.0])
    advantages = torch.tensor([-1.0, 1.0, 0.5])[:, None].expand(3, 5)
    expected = torch.tensor([[0, 0, 1, 1, 0], [0, 0, 0, 0, 0], [0, 0, 0, 1, 1]], dtype=torch.float)
    assert torch.equal(compute_mtp_loss_mask(token_mask, sample_mask, advantages, "all_responses"), expected)
    # positive_advantage also drops the first sample (advantage -1).
    expected[0] = 0
    assert torch.equal(compute_mtp_loss_mask(token_mask, sample_mask, advantages, "positive_advantage"), expected)


def _megatron_cfg(**overrides):
    cfg = tiny_config(**{f"megatron_cfg__{key}": value for key, value in overrides.items()})
    return cfg.policy.megatron_cfg


def test_unpacked_microbatches_pass_the_mask_through_unchanged():
    batch = make_batch([3, 7, 4, 6])
    batch["mtp_loss_mask"] = _all_responses(batch)
    microbatches = build_microbatches(batch, 2, False, _megatron_cfg(), cp_rank=0, cp_size=1)
    assert len(microbatches) == 2
    seq_length = int(batch["input_lengths"].max())
    for index, microbatch in enumerate(microbatches):
        rows = slice(2 * index, 2 * index + 2)
        assert torch.equal(microbatch.mtp_loss_mask, batch["mtp_loss_mask"][rows, :seq_length])
        assert torch.equal(microbatch.input_ids, batch["input_ids"][rows, :seq_length])
        assert microbatch.packed_seq_params is None


def test_microbatches_without_mtp_carry_no_mask():
    microbatches = build_microbatches(make_batch([3, 7]), 2, True, _megatron_cfg(), cp_rank=0, cp_size=1)
    assert microbatches[0].mtp_loss_mask is None


@pytest.mark.parametrize("multiple", [1, 4])
def test_packed_mask_lines_up_with_packed_input_ids(multiple):
    batch = make_batch([3, 7, 1, 6], seq_length=16)
    lengths = batch["input_lengths"].tolist()
    mask = _all_responses(batch)
    packed, cu_seqlens, max_seqlen, _ = pack_sequences(
        {"input_ids": batch["input_ids"], "mtp_loss_mask": mask}, lengths, multiple, cp_rank=0, cp_size=1
    )
    assert packed["input_ids"].shape == packed["mtp_loss_mask"].shape == (1, cu_seqlens[-1])
    for row, (start, end) in enumerate(zip(cu_seqlens, cu_seqlens[1:])):
        length = lengths[row]
        assert end - start == -(-length // multiple) * multiple
        assert torch.equal(packed["input_ids"][0, start : start + length], batch["input_ids"][row, :length])
        assert torch.equal(packed["mtp_loss_mask"][0, start : start + length], mask[row, :length])
        # Padding to the multiple is zero-filled in both.
        assert not packed["input_ids"][0, start + length : end].any()
        assert not packed["mtp_loss_mask"][0, start + length : end].any()
    assert max_seqlen == max(end - start for start, end in zip(cu_seqlens, cu_seqlens[1:]))


def test_context_parallel_split_is_the_same_for_mask_and_input_ids():
    """Two CP ranks hold chunks (r, 2cp-1-r) of every sequence; together they rebuild it exactly."""
    cp_size, multiple = 2, 4
    batch = make_batch([3, 7, 1], seq_length=16)
    lengths = batch["input_lengths"].tolist()
    mask = _all_responses(batch)
    rows = {"input_ids": batch["input_ids"], "mtp_loss_mask": mask, "position": torch.arange(16).expand(3, 16)}
    full, cu_seqlens, _, _ = pack_sequences(rows, lengths, multiple, cp_rank=0, cp_size=1)
    shards = [pack_sequences(rows, lengths, multiple, cp_rank=rank, cp_size=cp_size)[0] for rank in range(cp_size)]
    for start, end in zip(cu_seqlens, cu_seqlens[1:]):
        chunk = (end - start) // (2 * cp_size)
        local_start = start // cp_size
        for rank, shard in enumerate(shards):
            for key in rows:
                local = shard[key][0, local_start : local_start + 2 * chunk]
                front = full[key][0, start + rank * chunk : start + (rank + 1) * chunk]
                back_chunk = 2 * cp_size - 1 - rank
                back = full[key][0, start + back_chunk * chunk : start + (back_chunk + 1) * chunk]
                assert torch.equal(local, torch.cat([front, back])), key


def test_padding_multiple_follows_context_and_sequence_parallelism():
    def multiple(cp, tp, sp):
        layout = {"context_parallel_size": cp, "tensor_model_parallel_size": tp, "sequence_parallel": sp}
        return sequence_length_multiple(OmegaConf.create(layout))

    assert multiple(1, 1, False) == 1
    assert multiple(2, 1, False) == 4
    assert multiple(2, 2, False) == 4
    assert multiple(2, 2, True) == 8
    assert multiple(1, 4, True) == 4


def test_policy_loss_inputs_sit_at_the_predicting_position():
    batch = make_batch([3, 7])
    microbatch = build_microbatches(batch, 2, False, _megatron_cfg(), cp_rank=0, cp_size=1)[0]
    inputs = microbatch.loss_inputs
    assert torch.equal(inputs["target_ids"][:, :-1], microbatch.input_ids[:, 1:])
    seq_length = microbatch.input_ids.shape[1]
    assert torch.equal(inputs["loss_mask"][:, :-1], batch["token_mask"][:, 1:seq_length])
    assert inputs["loss_mask"].sum() == batch["token_mask"][:, 1:].sum()
