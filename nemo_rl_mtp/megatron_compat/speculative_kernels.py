"""megatron-core's per-request speculative-decoding bookkeeping, vectorised.

After each verified step megatron's controller rewinds the KV-cache bookkeeping of rejected drafts
(``rewind_kv_cache``, PyTorch on the host on every machine) and records each request's accepted
drafts and next token (``prepare_next_forward_pass``, a triton kernel on GPUs, a PyTorch fallback
elsewhere). The PyTorch versions in ``mtp_utils_pytorch`` loop over requests in Python with a few
tensor reads and writes each: with 32 requests they cost about as much as the MTP layer itself on
a CPU. The functions here take the same arguments, mutate the same buffers and return the same
values, with a fixed number of tensor operations per step whatever the batch (tested against
megatron's loops on random batches).

The same holds for the per-request log-prob lists megatron's controller builds at each speculative
step (``_dynamic_step_calculate_log_probs_speculative``): an ``.item()`` and a row slice per
request, 1.6-1.9 ms a step at 512 requests on a CPU. :func:`decode_log_probs` builds them from
one host copy (tested against megatron's method at every step of real rollouts).
"""

from __future__ import annotations

import torch


def rewind_kv_cache(
    accepted_counts,
    prefill_status,
    last_kv_block_offset,
    kv_length_offsets,
    kv_block_counts,
    last_kv_block_id,
    kv_block_ids,
    num_speculative_tokens,
    block_size_tokens,
    num_active_requests=None,
):
    """``mtp_utils_pytorch.rewind_kv_cache``: per active request (the first
    ``num_active_requests`` rows), step back over its rejected drafts (none for prefill requests):
    shorter KV length and last-block offset, and where that crosses back into the previous block,
    one block fewer (its id returned for release, its table entry cleared). Returns
    ``(blocks_to_release, remove_mask)`` ``[N]``."""
    count = accepted_counts.shape[0]
    rows = torch.arange(count, device=accepted_counts.device)
    active = rows < (count if num_active_requests is None else num_active_requests)
    rewound = torch.where(prefill_status == 1, 0, num_speculative_tokens - accepted_counts)
    rewound = torch.where(active, rewound, 0)
    offset = last_kv_block_offset - rewound
    remove = active & (offset < 0)
    block_count = torch.where(remove, kv_block_counts - 1, kv_block_counts)
    previous_block = kv_block_ids[rows, (block_count - 1).clamp(min=0)]
    blocks_to_release = torch.where(active, last_kv_block_id, 0)
    last_kv_block_offset.copy_(torch.where(active, offset % block_size_tokens, last_kv_block_offset))
    kv_length_offsets.copy_(kv_length_offsets - rewound)
    kv_block_counts.copy_(block_count)
    last_kv_block_id.copy_(torch.where(remove, previous_block, last_kv_block_id))
    cleared = block_count.clamp(max=kv_block_ids.shape[1] - 1)
    kv_block_ids[rows, cleared] = torch.where(remove, -1, kv_block_ids[rows, cleared])
    return blocks_to_release.to(last_kv_block_id.dtype), remove


def prepare_next_forward_pass(
    num_decode_requests,
    output_tokens,
    required_logit_indices,
    last_one_indices,
    accepted_tokens_mask,
    input_tokens,
    sampled_tokens_buf,
    last_accepted_seq_buf,
    accepted_tokens_per_request,
    accepted_token_counts,
    num_speculative_tokens,
):
    """``mtp_utils_triton.prepare_next_forward_pass``: per active request, the token sampled at
    its last accepted row and that row's index into the step's tokens; per decode request, its
    accepted drafts (-1 past the first rejection) and their number."""
    count = last_one_indices.shape[0]
    sampled_tokens_buf[:count] = output_tokens[last_one_indices]
    last_accepted_seq_buf[:count] = required_logit_indices[last_one_indices]
    if num_decode_requests == 0 or num_speculative_tokens == 0:
        return
    stride = num_speculative_tokens + 1
    device = input_tokens.device
    draft_rows = (
        torch.arange(num_decode_requests, device=device)[:, None] * stride
        + 1
        + torch.arange(num_speculative_tokens, device=device)[None, :]
    )
    accepted = torch.where(accepted_tokens_mask[draft_rows], input_tokens[draft_rows], -1)
    accepted_tokens_per_request[:num_decode_requests, :num_speculative_tokens] = accepted
    accepted_token_counts[:num_decode_requests] = (accepted != -1).sum(dim=1)


def decode_log_probs(
    log_probs: torch.Tensor,
    accepted_tokens: torch.Tensor,
    sampled_tokens: torch.Tensor,
    num_decode_requests: int,
    num_speculative_tokens: int,
) -> list[list[float]]:
    """The decode requests' lists of megatron's ``_dynamic_step_calculate_log_probs_speculative``:
    per request, the log-probs of its accepted drafts, then of its newly sampled token, read from
    its k + 1 verification rows of ``log_probs`` ``[>= D * (k + 1), V]`` (row j predicts the token
    after draft j). ``accepted_tokens`` ``[>= D, k]`` (-1 past the first rejection, whose count is
    megatron's accepted count) and ``sampled_tokens`` ``[>= D]``; D = ``num_decode_requests``.
    Returns D lists of (accepted count + 1) floats."""
    count, k = num_decode_requests, num_speculative_tokens
    rows = log_probs[: count * (k + 1)].reshape(count, k + 1, -1)
    counts = (accepted_tokens[:count, :k] != -1).sum(dim=1)
    tokens = torch.zeros(count, k + 1, dtype=torch.long, device=log_probs.device)
    tokens[:, :k] = accepted_tokens[:count, :k].clamp(min=0)
    tokens[torch.arange(count, device=log_probs.device), counts] = sampled_tokens[:count]
    gathered = rows.gather(2, tokens.unsqueeze(-1)).squeeze(-1)
    return [row[: accepted + 1] for row, accepted in zip(gathered.tolist(), counts.tolist())]
