"""The vectorised speculative bookkeeping against megatron-core's own per-request PyTorch loops
(``mtp_utils_pytorch``), on random batches: same return values, same buffers afterwards."""

from __future__ import annotations

import pytest
import torch
from nemo_rl_mtp.megatron_compat import speculative_kernels
from tests.support.release_gates import import_or_skip

mtp_utils_pytorch = import_or_skip("megatron.core.inference.text_generation_controllers.mtp_utils_pytorch", "speculative decoding's PyTorch kernels")


def _rewind_case(generator, num_rows: int, num_active: int, k: int, block_size: int) -> dict:
    """A batch as the engine holds it after a verified step: each request's KV length counts the
    k drafts it just appended, its blocks cover that length."""
    max_blocks = 6
    lengths = torch.randint(k + 1, block_size * (max_blocks - 1), (num_rows,), generator=generator)
    block_counts = (lengths + block_size - 1) // block_size
    block_ids = torch.full((num_rows, max_blocks), -1, dtype=torch.int32)
    for row in range(num_rows):
        block_ids[row, : block_counts[row]] = torch.randperm(100, generator=generator)[: block_counts[row]].int()
    return {
        "accepted_counts": torch.randint(0, k + 1, (num_rows,), generator=generator),
        "prefill_status": (torch.rand(num_rows, generator=generator) < 0.3).int(),
        "last_kv_block_offset": ((lengths - 1) % block_size).int(),
        "kv_length_offsets": (lengths - 1).int(),
        "kv_block_counts": block_counts.int(),
        "last_kv_block_id": block_ids[torch.arange(num_rows), block_counts - 1].clone(),
        "kv_block_ids": block_ids,
        "num_speculative_tokens": k,
        "block_size_tokens": block_size,
        "num_active_requests": num_active,
    }


@pytest.mark.parametrize("k, block_size", [(1, 4), (2, 4), (3, 16)])
def test_rewind_equals_megatrons_loop(k, block_size):
    generator = torch.Generator().manual_seed(k)
    crossings = 0
    for trial in range(20):
        case = _rewind_case(generator, num_rows=12, num_active=12 - trial % 4, k=k, block_size=block_size)
        ours = {name: value.clone() if torch.is_tensor(value) else value for name, value in case.items()}
        expected = mtp_utils_pytorch.rewind_kv_cache(**case)
        got = speculative_kernels.rewind_kv_cache(**ours)
        for name, value in case.items():
            if torch.is_tensor(value):
                assert torch.equal(ours[name], value), name
        assert torch.equal(got[1], expected[1])
        assert torch.equal(got[0][expected[1]], expected[0][expected[1]])
        assert torch.equal(got[0], expected[0]) and got[0].dtype == expected[0].dtype
        crossings += int(expected[1].sum())
    assert crossings > 5  # the block-boundary branch ran


def _prepare_case(generator, num_decode: int, num_prefill: int, k: int) -> dict:
    stride = k + 1
    decode_rows = num_decode * stride
    rows = decode_rows + num_prefill
    mask = torch.zeros(rows, dtype=torch.bool)
    accepted = torch.randint(0, k + 1, (num_decode,), generator=generator)
    for request in range(num_decode):
        mask[request * stride : request * stride + 1 + accepted[request]] = True
    mask[decode_rows:] = True
    last_one = torch.cat([torch.arange(num_decode) * stride + accepted, torch.arange(decode_rows, rows)])
    max_requests = num_decode + num_prefill + 3
    return {
        "num_decode_requests": num_decode,
        "output_tokens": torch.randint(0, 50, (rows,), generator=generator),
        "required_logit_indices": torch.randperm(rows + 5, generator=generator)[:rows],
        "last_one_indices": last_one,
        "accepted_tokens_mask": mask,
        "input_tokens": torch.randint(0, 50, (rows,), generator=generator),
        "sampled_tokens_buf": torch.zeros(max_requests, dtype=torch.long),
        "last_accepted_seq_buf": torch.zeros(max_requests, dtype=torch.long),
        "accepted_tokens_per_request": torch.full((max_requests, k), -1, dtype=torch.long),
        "accepted_token_counts": torch.zeros(max_requests, dtype=torch.long),
        "num_speculative_tokens": k,
    }


@pytest.mark.parametrize("num_decode, num_prefill, k", [(5, 0, 1), (4, 3, 2), (0, 2, 2), (7, 1, 3)])
def test_prepare_next_forward_pass_equals_megatrons_loop(num_decode, num_prefill, k):
    case = _prepare_case(torch.Generator().manual_seed(num_decode + k), num_decode, num_prefill, k)
    ours = {name: value.clone() if torch.is_tensor(value) else value for name, value in case.items()}
    mtp_utils_pytorch.prepare_next_forward_pass(**case)
    speculative_kernels.prepare_next_forward_pass(**ours)
    for name, value in case.items():
        if torch.is_tensor(value):
            assert torch.equal(ours[name], value), name
