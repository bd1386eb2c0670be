"""The CPU stand-ins for flash-attn's paged kernels against per-request dense attention computed by
torch's scaled_dot_product_attention (an independent route), on a shuffled paged cache. Every test
runs with the requests attended in one call and one request at a time (the stand-ins chunk a large
step's requests; these steps are too small to be chunked at the default size)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nemo_rl_mtp.megatron_compat.cpu import paged_attention
from nemo_rl_mtp.megatron_compat.cpu.paged_attention import flash_attn_varlen_func, flash_attn_with_kvcache, paged_attention_over_pairs

BLOCK_SIZE, HEADS, KV_HEADS, DIM = 4, 4, 2, 8


@pytest.fixture(autouse=True, params=["one call", "one request per call"])
def chunking(request, monkeypatch):
    if request.param == "one request per call":
        monkeypatch.setattr(paged_attention, "CHUNK_BYTES", 1)
    return request.param


def _paged_cache(key_lengths: list[int], generator: torch.Generator):
    """Dense per-request keys/values, and the same scattered over shuffled cache blocks."""
    blocks_per_request = [-(-length // BLOCK_SIZE) for length in key_lengths]
    num_blocks = sum(blocks_per_request) + 3
    order = torch.randperm(num_blocks, generator=generator).tolist()
    key_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, DIM, generator=generator)
    value_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, DIM, generator=generator)
    block_table = torch.full((len(key_lengths), max(blocks_per_request) + 1), -1, dtype=torch.int32)
    keys, values = [], []
    for request, blocks in enumerate(blocks_per_request):
        ids = [order.pop() for _ in range(blocks)]
        block_table[request, :blocks] = torch.tensor(ids)
        keys.append(key_cache[ids].flatten(0, 1)[: key_lengths[request]])
        values.append(value_cache[ids].flatten(0, 1)[: key_lengths[request]])
    return key_cache, value_cache, block_table, keys, values


def _dense(query, key, value):
    """[q, h, d] queries that are the last q of the keys; causal, bottom-right aligned."""
    num_queries, num_keys = query.shape[0], key.shape[0]
    allowed = torch.ones(num_queries, num_keys, dtype=torch.bool).tril(diagonal=num_keys - num_queries)
    key = key.repeat_interleave(HEADS // KV_HEADS, dim=1)
    value = value.repeat_interleave(HEADS // KV_HEADS, dim=1)
    out = F.scaled_dot_product_attention(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), attn_mask=allowed)
    return out.transpose(0, 1)


@pytest.mark.parametrize("query_lengths, key_lengths", [([5, 1, 9], [5, 1, 9]), ([2, 3, 1], [7, 3, 12])])
def test_varlen_prefill_and_chunked_prefill(query_lengths, key_lengths):
    generator = torch.Generator().manual_seed(0)
    key_cache, value_cache, block_table, keys, values = _paged_cache(key_lengths, generator)
    queries = torch.randn(sum(query_lengths) + 2, HEADS, DIM, generator=generator)  # 2 padding rows
    cu_q = torch.tensor([0, *torch.tensor(query_lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(key_lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = flash_attn_varlen_func(
        queries, key_cache, value_cache, cu_q, cu_k, max(query_lengths), max(key_lengths), block_table=block_table
    )
    for request, (start, end) in enumerate(zip(cu_q[:-1].tolist(), cu_q[1:].tolist())):
        expected = _dense(queries[start:end], keys[request], values[request])
        torch.testing.assert_close(out[start:end], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[cu_q[-1] :], torch.zeros_like(out[cu_q[-1] :]))


def test_decode_with_several_new_tokens_per_request():
    """Speculative decode: the last token and 2 drafts per request, already in the cache."""
    generator = torch.Generator().manual_seed(1)
    key_lengths = [6, 3, 11]
    key_cache, value_cache, block_table, keys, values = _paged_cache(key_lengths, generator)
    queries = torch.randn(3, 3, HEADS, DIM, generator=generator)
    out = flash_attn_with_kvcache(
        queries, key_cache, value_cache, cache_seqlens=torch.tensor(key_lengths, dtype=torch.int32), block_table=block_table
    )
    for request in range(3):
        torch.testing.assert_close(out[request], _dense(queries[request], keys[request], values[request]), rtol=1e-5, atol=1e-5)


def test_unsupported_options_fail_loudly():
    with pytest.raises(NotImplementedError, match="window_size"):
        flash_attn_with_kvcache(torch.zeros(1, 1, HEADS, DIM), None, None, window_size=(4, 0), block_table=torch.zeros(1, 1))


def test_a_step_reads_only_the_blocks_that_hold_tokens():
    """The block table is as wide as the longest sequence the engine admits. Its columns past the
    longest request's blocks point at a block of NaNs: read, they would poison every output. (The
    unused ids -1 of shorter requests read some block, masked: see the garbage test below.)"""
    generator = torch.Generator().manual_seed(2)
    key_lengths = [6, 3, 11]
    key_cache, value_cache, block_table, keys, values = _paged_cache(key_lengths, generator)
    poisoned = key_cache.shape[0]
    key_cache = torch.cat([key_cache, torch.full_like(key_cache[:1], float("nan")), key_cache[:1]])
    value_cache = torch.cat([value_cache, torch.full_like(value_cache[:1], float("nan")), value_cache[:1]])
    in_use = -(-max(key_lengths) // BLOCK_SIZE)
    wide_table = torch.full((3, 64), poisoned, dtype=torch.int32)
    wide_table[:, :in_use] = block_table[:, :in_use]
    queries = torch.randn(3, 2, HEADS, DIM, generator=generator)
    out = flash_attn_with_kvcache(
        queries, key_cache, value_cache, cache_seqlens=torch.tensor(key_lengths, dtype=torch.int32), block_table=wide_table
    )
    for request in range(3):
        torch.testing.assert_close(out[request], _dense(queries[request], keys[request], values[request]), rtol=1e-5, atol=1e-5)


def test_keys_and_values_in_one_buffer():
    """The MTP caches' layout ``[2, blocks, ...]``: ragged queries (last of their keys) per request."""
    generator = torch.Generator().manual_seed(3)
    key_lengths, query_lengths = [6, 3, 11], [2, 1, 3]
    key_cache, value_cache, block_table, keys, values = _paged_cache(key_lengths, generator)
    queries = torch.randn(3, 3, HEADS, DIM, generator=generator)
    out = paged_attention_over_pairs(
        queries, torch.tensor(query_lengths), torch.stack([key_cache, value_cache]), block_table, torch.tensor(key_lengths), DIM**-0.5
    )
    for request, count in enumerate(query_lengths):
        expected = _dense(queries[request, :count], keys[request], values[request])
        torch.testing.assert_close(out[request, :count], expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(out[request, count:], torch.zeros_like(out[request, count:]))


@pytest.mark.parametrize("garbage", [float("nan"), float("inf")])
def test_cache_slots_that_hold_no_key_do_not_reach_the_output(garbage):
    """megatron allocates the cache with ``torch.empty``: the slots past a request's keys (the rest
    of its last block, the block an unused id -1 reads) hold whatever the memory last held, NaN
    and inf included. Masked keys there must not turn a row to NaN (then to zeros) in any layout."""
    generator = torch.Generator().manual_seed(4)
    key_lengths = [6, 3, 11]
    key_cache, value_cache, block_table, keys, values = _paged_cache(key_lengths, generator)
    written = torch.zeros(key_cache.shape[:2], dtype=torch.bool)
    for request, length in enumerate(key_lengths):
        for position in range(length):
            written[block_table[request, position // BLOCK_SIZE], position % BLOCK_SIZE] = True
    key_cache[~written], value_cache[~written] = garbage, garbage
    queries = torch.randn(3, 2, HEADS, DIM, generator=generator)
    seqlens = torch.tensor(key_lengths, dtype=torch.int32)
    decode = flash_attn_with_kvcache(queries, key_cache, value_cache, cache_seqlens=seqlens, block_table=block_table)
    pairs = paged_attention_over_pairs(
        queries, torch.full((3,), 2), torch.stack([key_cache, value_cache]), block_table, seqlens.long(), DIM**-0.5
    )
    for request in range(3):
        expected = _dense(queries[request], keys[request], values[request])
        torch.testing.assert_close(decode[request], expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pairs[request], expected, rtol=1e-5, atol=1e-5)


def test_a_buffer_whose_slots_hold_finite_values_needs_no_zeroing_for_the_same_output():
    """The MTP caches' promise (allocated zeroed, written only with keys and values): the slots
    past each request's keys hold finite leftovers of other requests. Without zeroing them the
    output is bit for bit the zeroing path's; the control: the same leftovers as NaN wreck the
    rows that see them when the zeroing is skipped (NaN rows come out as zeros)."""
    generator = torch.Generator().manual_seed(6)
    key_lengths, query_lengths = [6, 3, 11], [2, 1, 3]
    key_cache, value_cache, block_table, keys, values = _paged_cache(key_lengths, generator)
    written = torch.zeros(key_cache.shape[:2], dtype=torch.bool)
    for request, length in enumerate(key_lengths):
        for position in range(length):
            written[block_table[request, position // BLOCK_SIZE], position % BLOCK_SIZE] = True
    leftovers = 100.0 * torch.randn(key_cache.shape, generator=generator)
    key_cache[~written], value_cache[~written] = leftovers[~written], -leftovers[~written]
    queries = torch.randn(3, 3, HEADS, DIM, generator=generator)
    lengths = (torch.tensor(query_lengths), torch.tensor(key_lengths))

    def attend(cache, finite):
        return paged_attention_over_pairs(queries, lengths[0], cache, block_table, lengths[1], DIM**-0.5, slots_hold_finite_values=finite)

    pairs = torch.stack([key_cache, value_cache])
    unzeroed = attend(pairs, True)
    assert torch.equal(unzeroed, attend(pairs, False))
    for request, count in enumerate(query_lengths):
        torch.testing.assert_close(unzeroed[request, :count], _dense(queries[request, :count], keys[request], values[request]), rtol=1e-5, atol=1e-5)
    pairs[:, ~written] = float("nan")
    wrecked = attend(pairs, True)
    assert any(
        not torch.allclose(wrecked[request, :count], unzeroed[request, :count]) for request, count in enumerate(query_lengths)
    )


def test_chunks_of_uneven_size_cover_every_request():
    """Seven requests of ragged lengths in chunks of three (3, 3, 1): each row against its dense
    reference, so a chunk written to the wrong rows or a request left out fails."""
    generator = torch.Generator().manual_seed(5)
    key_lengths = [6, 3, 11, 1, 8, 5, 2]
    key_cache, value_cache, block_table, keys, values = _paged_cache(key_lengths, generator)
    queries = torch.randn(7, 1, HEADS, DIM, generator=generator)
    block_bytes = key_cache[0].nbytes
    in_use = -(-max(key_lengths) // BLOCK_SIZE)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(paged_attention, "CHUNK_BYTES", 3 * in_use * block_bytes)
        out = flash_attn_with_kvcache(
            queries, key_cache, value_cache, cache_seqlens=torch.tensor(key_lengths, dtype=torch.int32), block_table=block_table
        )
    for request in range(7):
        torch.testing.assert_close(out[request], _dense(queries[request], keys[request], values[request]), rtol=1e-5, atol=1e-5)
