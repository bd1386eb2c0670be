"""The output layer's padding ids: megatron pads the vocabulary (to a multiple of the tensor-parallel
size and ``make_vocab_size_divisible_by``), so logits have a few columns past the tokenizer's
vocabulary. Training, sampling and the MTP losses leave them out; this is the one place that says
which columns they are."""

from __future__ import annotations

import torch
from megatron.core import parallel_state


def first_padding_column(width: int, vocab_size: int, padded_vocab_size: int | None = None) -> int | None:
    """Column of logits ``[..., width]`` where the ids >= ``vocab_size`` start; None: none there.
    The logits are this tensor-parallel rank's shard, or the whole (gathered) vocabulary when
    ``width == padded_vocab_size``."""
    first_id = 0 if width == padded_vocab_size else parallel_state.get_tensor_model_parallel_rank() * width
    return None if first_id + width <= vocab_size else max(vocab_size - first_id, 0)


def mask_ids_past_vocabulary(logits: torch.Tensor, vocab_size: int, padded_vocab_size: int | None = None) -> torch.Tensor:
    """-inf on the ids >= ``vocab_size`` of logits ``[..., width]`` (a shard or the whole
    vocabulary, see ``first_padding_column``), in a copy; the logits themselves where there are
    none."""
    column = first_padding_column(logits.shape[-1], vocab_size, padded_vocab_size)
    return logits if column is None else _filled_from(logits.clone(), column)


def fill_ids_past_vocabulary_(logits: torch.Tensor, vocab_size: int, padded_vocab_size: int | None = None) -> torch.Tensor:
    """``mask_ids_past_vocabulary`` in place (returns ``logits``)."""
    column = first_padding_column(logits.shape[-1], vocab_size, padded_vocab_size)
    return logits if column is None else _filled_from(logits, column)


def _filled_from(logits: torch.Tensor, column: int) -> torch.Tensor:
    """-inf written into the columns from ``column`` on, alone: a ``masked_fill`` with a broadcast
    column mask read and wrote every logit and cost 8x a copy (237 against 30 us for 1,024 rows of
    336 on a CPU, every decode step)."""
    logits[..., column:] = float("-inf")
    return logits
