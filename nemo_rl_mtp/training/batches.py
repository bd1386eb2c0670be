"""Worker-side data path: a global batch on this data-parallel rank -> MTP loss mask ->
microbatches laid out for the model forward (plain rows, or packed THD sequences).

All layout work (lengths, packing indices, context-parallel split) happens on the host, once per
global batch; the finished microbatches are moved to the device in one go, so nothing here makes
the host wait for the device inside the microbatch loop.

Batch keys (``[B, S]`` unless noted): ``input_ids``, ``input_lengths`` ``[B]``, ``token_mask``
(1 on response tokens), ``sample_mask`` ``[B]`` (0 drops a whole sample), and per-token loss inputs
such as ``advantages``, ``prev_logprobs``, ``reference_logprobs`` (token-aligned: entry ``t``
belongs to token ``t``).
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field
from typing import Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from nemo_rl_mtp.training.forecast import MTPTargets, mtp_targets

# Token-aligned per-token loss inputs, handed to the policy loss at the position predicting the token.
SHIFTED_LOSS_KEYS = ("advantages", "prev_logprobs", "reference_logprobs")


@dataclass
class Microbatch:
    """One microbatch as the model consumes it: ``[b, s]`` rows, or one packed ``[1, t]`` row."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: Optional[torch.Tensor]
    packed_seq_params: Optional[PackedSeqParams]
    # megatron's ``loss_mask`` for the MTP loss (token-aligned; megatron rolls it). None: MTP off.
    mtp_loss_mask: Optional[torch.Tensor]
    # True on padding (row padding, or pack padding): MoE routers leave it out of their statistics.
    padding_mask: Optional[torch.Tensor] = None
    # Position-aligned inputs of the policy loss: entry p concerns the token predicted at p.
    # Always holds ``target_ids`` and ``loss_mask`` (response tokens of valid samples).
    loss_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    # Packed only: for each packed position, its flat index in the microbatch's [b * s] rows
    # (-1 on padding), to scatter per-token results back to rows of ``rows_shape``.
    source_index: Optional[torch.Tensor] = None
    rows_shape: Optional[tuple[int, int]] = None
    # Where each MTP depth's targets sit (acceptance_forecast.mtp_targets); None: MTP off, or
    # context parallelism.
    mtp_targets: Optional[MTPTargets] = None

    def to(self, device: torch.device) -> "Microbatch":
        def move(tensor):
            return None if tensor is None else tensor.to(device, non_blocking=True)

        params = self.packed_seq_params
        if params is not None:
            params = dataclasses.replace(
                params,
                cu_seqlens_q=move(params.cu_seqlens_q),
                cu_seqlens_kv=move(params.cu_seqlens_kv),
                cu_seqlens_q_padded=move(params.cu_seqlens_q_padded),
                cu_seqlens_kv_padded=move(params.cu_seqlens_kv_padded),
            )
        return dataclasses.replace(
            self,
            input_ids=move(self.input_ids),
            position_ids=move(self.position_ids),
            attention_mask=move(self.attention_mask),
            packed_seq_params=params,
            mtp_loss_mask=move(self.mtp_loss_mask),
            padding_mask=move(self.padding_mask),
            loss_inputs={key: move(value) for key, value in self.loss_inputs.items()},
            source_index=move(self.source_index),
            mtp_targets=None if self.mtp_targets is None else self.mtp_targets.to(device),
        )



def compute_mtp_loss_mask(
    token_mask: torch.Tensor, sample_mask: torch.Tensor, advantages: torch.Tensor, mask_policy: str
) -> torch.Tensor:
    """The tokens the MTP heads learn to predict ([B, S], weighted like the policy's tokens by
    ``sample_mask``): the response tokens of valid samples (``all_responses``), or only those of
    samples with a positive advantage (``positive_advantage``: the drafter imitates the behaviour
    RL reinforces). ``advantages`` is token-aligned [B, S], constant over a sample's response.

    Not shifted: megatron derives MTP labels by rolling ``input_ids`` and rolls this mask with them.
    """
    mask = token_mask.float() * sample_mask.float()[:, None]
    if mask_policy == "positive_advantage":
        mask = mask * (advantages > 0).float()
    return mask


def policy_loss_mask(token_mask: torch.Tensor, sample_mask: torch.Tensor) -> torch.Tensor:
    """Position-aligned policy-loss mask: position p counts when token p+1 is a response token."""
    return shift_to_predicting_position(token_mask.float()) * sample_mask.float()[:, None]


def local_valid_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Tokens the policy loss counts on this rank: response tokens (after the first) of valid samples."""
    return (batch["token_mask"][:, 1:].float() * batch["sample_mask"].float()[:, None]).sum()


def shift_to_predicting_position(tensor: torch.Tensor) -> torch.Tensor:
    """``out[:, p] = tensor[:, p + 1]``, zero at the last position."""
    shifted = torch.zeros_like(tensor)
    shifted[:, :-1] = tensor[:, 1:]
    return shifted


def sequence_length_multiple(megatron_cfg) -> int:
    """Each sequence must split evenly: 2 * CP chunks (load-balanced CP), times TP under SP."""
    multiple = 1
    if megatron_cfg.context_parallel_size > 1:
        multiple *= 2 * megatron_cfg.context_parallel_size
    if megatron_cfg.sequence_parallel:
        multiple *= megatron_cfg.tensor_model_parallel_size
    return multiple


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def causal_attention_mask(seq_length: int) -> torch.Tensor:
    """[1, 1, s, s] boolean, True above the diagonal (masked). Built explicitly: megatron's
    default mask is built on "cuda"."""
    return torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool), diagonal=1)[None, None]


def build_microbatches(
    batch: dict[str, torch.Tensor],
    micro_batch_size: int,
    pack_sequences: bool,
    megatron_cfg,
    cp_rank: int,
    cp_size: int,
) -> list[Microbatch]:
    """Split this rank's share of the global batch into model-ready microbatches (on the host)."""
    num_samples = batch["input_ids"].shape[0]
    if num_samples % micro_batch_size:
        raise ValueError(f"{num_samples} samples do not split into microbatches of {micro_batch_size}")
    lengths = batch["input_lengths"].tolist()  # host tensor: no device sync
    multiple = sequence_length_multiple(megatron_cfg)
    seq_length = round_up(max(lengths), multiple)
    rows = _rows_for_model(batch, seq_length)
    microbatches = []
    for start in range(0, num_samples, micro_batch_size):
        chunk = {key: value[start : start + micro_batch_size] for key, value in rows.items()}
        chunk_lengths = lengths[start : start + micro_batch_size]
        if pack_sequences:
            microbatch = _packed_microbatch(chunk, chunk_lengths, multiple, cp_rank, cp_size)
        else:
            microbatch = _unpacked_microbatch(chunk, chunk_lengths, seq_length)
        if cp_size == 1:
            microbatch.mtp_targets = mtp_targets(microbatch.mtp_loss_mask, microbatch.packed_seq_params, megatron_cfg.mtp_num_layers)
        microbatches.append(microbatch)
    return microbatches


def microbatches_for_this_rank(batch: dict[str, torch.Tensor], policy_cfg, device: torch.device) -> list[Microbatch]:
    """This rank's microbatches (its context-parallel share when CP > 1), moved to ``device`` in
    one go before the microbatch loop starts."""
    from megatron.core import parallel_state

    microbatches = build_microbatches(
        batch,
        micro_batch_size=policy_cfg.train_micro_batch_size,
        pack_sequences=policy_cfg.sequence_packing.enabled,
        megatron_cfg=policy_cfg.megatron_cfg,
        cp_rank=parallel_state.get_context_parallel_rank(),
        cp_size=parallel_state.get_context_parallel_world_size(),
    )
    return [microbatch.to(device) for microbatch in microbatches]


def _rows_for_model(batch: dict[str, torch.Tensor], seq_length: int) -> dict[str, torch.Tensor]:
    """Per-token tensors trimmed (or zero-padded) to ``seq_length``; the policy-loss inputs moved
    to the position that predicts their token."""
    input_ids = _fit_length(batch["input_ids"], seq_length)
    rows = {
        "input_ids": input_ids,
        "position_ids": torch.arange(seq_length).expand_as(input_ids),
        "target_ids": shift_to_predicting_position(input_ids),
        "loss_mask": policy_loss_mask(_fit_length(batch["token_mask"], seq_length), batch["sample_mask"]),
    }
    if "mtp_loss_mask" in batch:
        rows["mtp_loss_mask"] = _fit_length(batch["mtp_loss_mask"], seq_length)
    for key in SHIFTED_LOSS_KEYS:
        if key in batch:
            rows[key] = shift_to_predicting_position(_fit_length(batch[key], seq_length))
    return rows


def _fit_length(tensor: torch.Tensor, seq_length: int) -> torch.Tensor:
    if tensor.shape[1] >= seq_length:
        return tensor[:, :seq_length]
    return torch.nn.functional.pad(tensor, (0, seq_length - tensor.shape[1]))


_MODEL_KEYS = ("input_ids", "position_ids", "mtp_loss_mask")


def _unpacked_microbatch(rows: dict[str, torch.Tensor], lengths: list[int], seq_length: int) -> Microbatch:
    return Microbatch(
        input_ids=rows["input_ids"],
        position_ids=rows["position_ids"],
        attention_mask=causal_attention_mask(seq_length),
        packed_seq_params=None,
        mtp_loss_mask=rows.get("mtp_loss_mask"),
        padding_mask=torch.arange(seq_length)[None, :] >= torch.tensor(lengths)[:, None],
        loss_inputs={key: value for key, value in rows.items() if key not in _MODEL_KEYS},
    )


def _packed_microbatch(
    rows: dict[str, torch.Tensor], lengths: list[int], multiple: int, cp_rank: int, cp_size: int
) -> Microbatch:
    packed, cu_seqlens_padded, max_seqlen, source_index = pack_sequences(rows, lengths, multiple, cp_rank, cp_size)
    cu_seqlens = torch.tensor(cu_seqlens_padded, dtype=torch.int32)
    # cu_seqlens_q is the padded layout too: megatron's packed roll_tensor (MTP labels and loss
    # mask) slices by cu_seqlens_q, so it must describe where each sequence sits in the pack.
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens,
        cu_seqlens_kv_padded=cu_seqlens,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
    )
    return Microbatch(
        input_ids=packed["input_ids"],
        position_ids=packed["position_ids"],
        attention_mask=None,
        packed_seq_params=params,
        mtp_loss_mask=packed.get("mtp_loss_mask"),
        padding_mask=(source_index < 0).unsqueeze(0),
        loss_inputs={key: value for key, value in packed.items() if key not in _MODEL_KEYS},
        source_index=source_index,
        rows_shape=tuple(rows["input_ids"].shape),
    )


def pack_sequences(
    rows: dict[str, torch.Tensor], lengths: list[int], multiple: int, cp_rank: int, cp_size: int
) -> tuple[dict[str, torch.Tensor], list[int], int, torch.Tensor]:
    """Pack ``[b, s]`` rows into ``[1, t]`` THD rows, every tensor through the same index.

    Each sequence keeps its first ``length`` tokens, is zero-padded to a multiple of ``multiple``
    and, under context parallelism, contributes chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank``
    of its ``2 * cp_size`` chunks (megatron's load-balanced split).

    Returns the packed tensors, the padded cumulative lengths (full sequences, before the CP split,
    as megatron expects), the longest padded sequence, and each packed position's flat index in the
    ``[b * s]`` rows (-1 on padding).
    """
    seq_length = next(iter(rows.values())).shape[1]
    gather_index, valid, cu_seqlens_padded = _packing_index(lengths, seq_length, multiple, cp_rank, cp_size)
    packed = {
        key: (value.reshape(-1)[gather_index] * valid.to(value.dtype)).unsqueeze(0)
        for key, value in rows.items()
    }
    padded_lengths = [end - start for start, end in zip(cu_seqlens_padded, cu_seqlens_padded[1:])]
    source_index = torch.where(valid, gather_index, -1)
    return packed, cu_seqlens_padded, max(padded_lengths), source_index


def _packing_index(
    lengths: list[int], seq_length: int, multiple: int, cp_rank: int, cp_size: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Flat ``[b * s]`` indices of the tokens this CP rank holds, in packed order, and whether each
    is a real token (False: padding, filled with zeros)."""
    if cp_size > 1 and multiple % (2 * cp_size):
        raise ValueError(f"padding multiple {multiple} does not split into 2 * cp_size={2 * cp_size} chunks")
    indices, valid, cu_seqlens_padded = [], [], [0]
    for row, length in enumerate(lengths):
        padded_length = round_up(length, multiple)
        positions = torch.arange(padded_length)
        if cp_size > 1:
            chunks = positions.chunk(2 * cp_size)
            positions = torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]])
        indices.append(row * seq_length + positions)
        valid.append(positions < length)
        cu_seqlens_padded.append(cu_seqlens_padded[-1] + padded_length)
    return torch.cat(indices), torch.cat(valid), cu_seqlens_padded
