"""A core attention for the local (non-transformer_engine) spec that honours packed sequences, and
builds its default causal mask on the query's device (megatron builds it on "cuda").

megatron-core's local ``DotProductAttention`` rejects ``packed_seq_params``; transformer_engine
needs CUDA. This subclass lets packed (THD) microbatches run anywhere: each token attends causally
to the tokens of its own sequence, as delimited by ``cu_seqlens_q_padded`` (or ``cu_seqlens_q``).
It is exact, not fast: one [t, t] score matrix per layer.
"""

from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention

from nemo_rl_mtp.training.batches import causal_attention_mask


def packed_causal_mask(cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """[1, 1, t, t] boolean mask, True where attention is forbidden: across sequences or ahead.

    Positions past the last boundary (pack padding) form one more sequence of their own.
    """
    positions = torch.arange(total_tokens, device=cu_seqlens.device)
    sequence_of = torch.bucketize(positions, cu_seqlens[1:].to(positions.dtype), right=True)
    same_sequence = sequence_of[:, None] == sequence_of[None, :]
    not_ahead = positions[None, :] <= positions[:, None]
    return ~(same_sequence & not_ahead)[None, None]


class PackedSequenceDotProductAttention(DotProductAttention):
    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params: PackedSeqParams | None = None,
    ):
        if packed_seq_params is None:
            if attention_mask is None:
                # megatron's default causal mask is built on "cuda"; build it where the query is.
                attention_mask = causal_attention_mask(query.shape[0]).to(query.device)
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        cu_seqlens = packed_seq_params.cu_seqlens_q_padded
        if cu_seqlens is None:
            cu_seqlens = packed_seq_params.cu_seqlens_q
        # THD tensors are [t, heads, dim]; the parent expects [s, b, heads, dim] with b = 1.
        mask = packed_causal_mask(cu_seqlens, query.shape[0])
        return super().forward(
            query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), mask, attn_mask_type, attention_bias
        )
