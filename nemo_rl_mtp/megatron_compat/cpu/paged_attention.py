"""Paged attention in plain torch, standing in for flash-attn's paged kernels on a machine
without CUDA.

megatron-core's dynamic inference engine keeps keys and values in a paged cache (blocks of
``block_size_tokens`` tokens, one row of block ids per request) and reads it through
``flash_attn_varlen_func`` (prefill, requests of any length) and ``flash_attn_with_kvcache``
(decode, every request with the same number of new tokens). Both are CUDA-only. The functions
here take the same arguments and compute the same thing, all requests of a step in one call of
torch's fused ``scaled_dot_product_attention`` over the gathered blocks (a per-request loop
measured 4x slower on a 2-core VM; an explicit softmax over einsum scores, 2x). Causal masks are
aligned bottom-right, as flash-attn aligns them when a request's queries are the last of its keys.

A step reads only the blocks that hold tokens: the block table is as wide as the longest sequence
the engine admits (``max_sequence_length``), so gathering all of it made a decode step cost
O(maximum length) instead of O(tokens in use), and the response budget, not the responses, set
the speed. The longest key length is read on the host once per call (flash-attn reads it on the
device); this module runs only where there is no device.

Requests are attended in chunks whose gathered keys take about ``CHUNK_BYTES``: gathering a whole
decode step at once (512 requests of 112 keys: 15 MB of keys, as much of values, and, then, their
zeroed copies) made each temporary fresh memory from the operating system, and its page faults
cost as much as the attention; chunks of 2 MB are reused from the allocator's free lists and stay
in the cache. One such call alone measured 16-35 ms before and 9-10 ms after; inside the engine,
where memory is partly reused already, a decode step's attention took about 13% less. The slots
past each request's keys are zeroed in place in the gathered copy, not by a masked copy of it
(:func:`zero_past_in_place`), and not at all in a buffer whose slots hold finite numbers (the MTP
caches): the trunk's attention in a 512-request decode step took about 10.8 -> 7.4 ms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_BYTES = 2 * 2**20  # gathered keys per fused attention call (module docstring)


def paged_attention(
    queries: torch.Tensor,
    query_lengths: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    key_lengths: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """Causal attention of each request's queries over its cached keys.

    queries ``[b, sq, h, d]`` (request r's first ``query_lengths[r]`` rows are real; they are the
    last ``query_lengths[r]`` of its ``key_lengths[r]`` tokens); key/value cache
    ``[num_blocks, block_size, h_kv, d]``; block_table ``[b, max_blocks]``. Returns ``[b, sq, h, d]``
    (zeros on padding rows).
    """
    block_table = block_table[:, : blocks_in_use(key_lengths, key_cache.shape[1])]

    def attend(rows: slice) -> torch.Tensor:
        keys, values = _gather_blocks(key_cache, block_table[rows]), _gather_blocks(value_cache, block_table[rows])
        return _attend(queries[rows], query_lengths[rows], keys, values, key_lengths[rows], softmax_scale)

    return _in_chunks(attend, queries, block_table.shape[1] * key_cache[0].nbytes)


def paged_attention_over_pairs(
    queries: torch.Tensor,
    query_lengths: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    key_lengths: torch.Tensor,
    softmax_scale: float,
    slots_hold_finite_values: bool = False,
) -> torch.Tensor:
    """:func:`paged_attention` over one buffer of keys and values ``[2, num_blocks, block_size,
    h_kv, d]``, read with one gather, of every column of ``block_table``: the caller passes the
    columns in use (it knows them from the engine's host-side bookkeeping: no read of a device
    value here, so this runs on a GPU too).

    ``slots_hold_finite_values``: the caller's buffer was allocated zeroed and is written only
    with keys and values, so every slot past a request's keys holds a finite number. The mask
    gives such a slot exactly zero weight (its score becomes -inf, exp(-inf) = 0, and 0 times a
    finite value is 0), so the gathered copy is not zeroed there first (:func:`_attend`): a third
    of the attention's work, for the same result bit for bit."""
    width = block_table.shape[1]

    def attend(rows: slice) -> torch.Tensor:
        ids = block_table[rows].reshape(-1).long() % kv_cache.shape[1]
        pairs = kv_cache.index_select(1, ids).view(2, -1, width * kv_cache.shape[2], *kv_cache.shape[3:])
        return _attend(
            queries[rows], query_lengths[rows], pairs[0], pairs[1], key_lengths[rows], softmax_scale, zero_past=not slots_hold_finite_values
        )

    return _in_chunks(attend, queries, width * kv_cache[0, 0].nbytes)


def _in_chunks(attend, queries: torch.Tensor, key_bytes_per_request: int) -> torch.Tensor:
    """``attend(rows)`` over slices of the requests (module docstring), into one output."""
    num_requests = queries.shape[0]
    chunk = max(1, CHUNK_BYTES // max(key_bytes_per_request, 1))
    if chunk >= num_requests:
        return attend(slice(None))
    output = torch.empty_like(queries)
    for start in range(0, num_requests, chunk):
        output[start : start + chunk] = attend(slice(start, start + chunk))
    return output


def _attend(queries, query_lengths, keys, values, key_lengths, softmax_scale, zero_past: bool = True) -> torch.Tensor:
    """Queries ``[b, sq, h, d]`` over gathered keys and values ``[b, sk, h_kv, d]``.

    Positions past a request's keys (the rest of its last block, blocks of id -1) hold whatever the
    cache's memory held: megatron allocates it with ``torch.empty``, and flash-attn never reads
    there. The mask gives them no weight, but a NaN or inf among them would still reach the output
    (``0 * inf``, ``score + -inf``) and turn the row to NaN, then to zeros below. So they are
    zeroed first: the result depends on the cached tokens only, not on the memory's history.
    ``keys`` and ``values`` are the caller's gathered copies, zeroed in place at those positions
    alone (:func:`zero_past_in_place`)."""
    if zero_past:
        zero_past_in_place(keys, values, key_lengths)
    allowed = _causal_key_mask(query_lengths, key_lengths, queries.shape[1], keys.shape[1])
    attended = F.scaled_dot_product_attention(
        queries.float().transpose(1, 2), keys.float().transpose(1, 2), values.float().transpose(1, 2),
        attn_mask=allowed[:, None], scale=softmax_scale, enable_gqa=keys.shape[2] != queries.shape[2],
    )
    # Padding query rows see no key: their softmax is NaN, and their output is zeroed.
    return attended.transpose(1, 2).nan_to_num(0.0).to(queries.dtype)


def zero_past_in_place(keys: torch.Tensor, values: torch.Tensor, key_lengths: torch.Tensor) -> None:
    """Zeros at and past each request's ``key_lengths`` in the gathered ``keys`` and ``values``
    ``[b, sk, h_kv, d]`` (contiguous copies). Only those positions are written: a decode step's
    requests fill most of their blocks, so this touches a few slots per request, where a masked
    copy of the whole gather (``where``) read and wrote all of it, about a third of the attention.
    The positions are found on the host (this module runs where there is no device)."""
    rows, width = keys.shape[:2]
    past = torch.arange(width, device=key_lengths.device)[None, :] >= key_lengths[:, None]
    index = past.reshape(-1).nonzero().squeeze(1)
    if index.numel():
        keys.view(rows * width, -1).index_fill_(0, index, 0.0)
        values.view(rows * width, -1).index_fill_(0, index, 0.0)


def blocks_in_use(key_lengths: torch.Tensor, block_size: int) -> int:
    """Blocks of the longest request: the block-table columns a step reads (at least one)."""
    longest = int(key_lengths.max()) if key_lengths.numel() else 0
    return max(-(-longest // block_size), 1)


def _gather_blocks(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """``[b, blocks * block_size, h_kv, d]``: each request's blocks in order. Unused block ids
    (-1) read some block; masked later."""
    rows, width = block_table.shape
    return cache.index_select(0, block_table.reshape(-1).long() % cache.shape[0]).view(rows, width * cache.shape[1], *cache.shape[2:])


def _causal_key_mask(
    query_lengths: torch.Tensor, key_lengths: torch.Tensor, max_queries: int, max_keys: int
) -> torch.Tensor:
    """``[b, sq, sk]``: query i of request r sits at position ``key_lengths[r] - query_lengths[r]
    + i`` and sees the keys at or before it; padding query rows see nothing."""
    query_index = torch.arange(max_queries, device=key_lengths.device)
    key_index = torch.arange(max_keys, device=key_lengths.device)
    query_position = (key_lengths - query_lengths)[:, None] + query_index[None, :]
    allowed = key_index[None, None, :] <= query_position[:, :, None]
    return allowed & (query_index[None, :] < query_lengths[:, None])[:, :, None]


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
    causal=True, window_size=(-1, -1), block_table=None, return_attn_probs=False, **unused
) -> torch.Tensor:
    """flash-attn's varlen kernel over a paged cache (the engine's prefill and mixed steps):
    q ``[total_q, h, d]`` packed by ``cu_seqlens_q``; returns ``[total_q, h, d]``."""
    _check_supported(causal, window_size, return_attn_probs, block_table)
    query_lengths = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    key_lengths = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
    num_requests = query_lengths.shape[0]
    widest = int(query_lengths.max()) if num_requests else 0
    rows = cu_seqlens_q[:-1, None].long() + torch.arange(widest, device=q.device)[None, :]
    real = torch.arange(widest, device=q.device)[None, :] < query_lengths[:, None]
    padded_queries = q[rows.clamp(max=q.shape[0] - 1)]
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    attended = paged_attention(padded_queries, query_lengths, k, v, block_table[:num_requests], key_lengths, scale)
    output = torch.zeros_like(q)
    output[rows[real]] = attended[real]
    return output


def flash_attn_with_kvcache(
    q, k_cache, v_cache, cache_seqlens=None, softmax_scale=None, causal=True, window_size=(-1, -1),
    block_table=None, return_softmax_lse=False, **unused
) -> torch.Tensor:
    """flash-attn's decode kernel over a paged cache: q ``[b, s, h, d]`` (s new tokens per request,
    already appended to the cache); returns ``[b, s, h, d]``."""
    _check_supported(causal, window_size, return_softmax_lse, block_table)
    num_requests, num_new = q.shape[:2]
    query_lengths = torch.full((num_requests,), num_new, dtype=torch.long, device=q.device)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return paged_attention(q, query_lengths, k_cache, v_cache, block_table, cache_seqlens.long(), scale)


def _check_supported(causal, window_size, return_softmax_statistics, block_table) -> None:
    if not causal or tuple(window_size) != (-1, -1) or return_softmax_statistics or block_table is None:
        raise NotImplementedError(
            "CPU paged attention covers causal full attention over a paged cache only "
            f"(causal={causal}, window_size={window_size}, softmax statistics={return_softmax_statistics})"
        )
