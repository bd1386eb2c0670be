"""The serving engines' position-0 convention for the MTP input, on megatron-core's MTP layers.

vLLM's MTP drafters for MiMo, DeepSeek-V3 and GLM-4.5 (``mimo_mtp.py``, ``deepseek_mtp.py``,
``glm4_moe_mtp.py``) and SGLang's ``mimo_mtp.py`` set the MTP layer's token embedding to zero where
the trunk's position id is 0: there the layer combines the hidden state of token 0 with a zero
vector instead of the embedding of token 1. megatron-core's ``MultiTokenPredictionLayer`` does not,
so heads trained here and served there see a different input at the first position of every
request, and, through the MTP layer's attention, every later draft sees it too (3.0 points of
vLLM's acceptance on the math recipe's export, docs/serving.md).

:func:`zero_embedding_at_position_0` makes one model's MTP block follow that convention in its
forward (training, log-prob and forecast passes alike): megatron's ``MultiTokenPredictionBlock.forward``
is wrapped once per process (class level, marked, idempotent), and on a model marked for it the
wrapper hands the block an ``embedding`` whose output is zeroed at the block's position-0 tokens.
Every MTP layer computes its token embedding through the ``embedding`` its block hands it (0.16.1
to 0.19.2: ``MultiTokenPredictionLayer._get_embeddings`` calls ``embedding(input_ids=...,
position_ids=...)`` before any activation checkpoint, so a recompute sees the same input). Every
depth is zeroed at the same positions: depth d at position t reads the hidden state of position t
(the trunk's at d = 1), so position t keeps the trunk's position id. vLLM only ever runs depth 1
at position 0 (its later draft steps start at the last verified position); zeroing deeper depths
there too keeps one rule for the layer's attention context at every depth.

The rollout drafters call megatron's ``forward_single_position`` themselves and pass
:func:`zeroed_embedding` with their own mask. Models not marked run megatron's code unchanged.
A release whose MTP block takes no ``embedding``, ``position_ids`` or ``packed_seq_params``
argument, or whose block ran without calling the embedding it was handed, stops the run in one
line: the convention would silently not be trained.
"""

from __future__ import annotations

import inspect
import logging

import torch
from megatron.core import parallel_state
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

from nemo_rl_mtp.megatron_compat._marks import is_shim, mark_shim

logger = logging.getLogger(__name__)

_MARKED = "_nemo_rl_mtp_zero_embedding_at_position_0"
_BLOCK_ARGUMENTS = ("position_ids", "packed_seq_params", "embedding")


def probe() -> tuple[bool, str]:
    """Whether the installed MTP block can be handed a zeroing embedding (never "fixed upstream":
    megatron trains its own convention, so the wrapper is installed whenever the option is on)."""
    if is_shim(MultiTokenPredictionBlock.forward):
        return True, "installed earlier in this process"
    parameters = inspect.signature(MultiTokenPredictionBlock.forward).parameters
    missing = [name for name in _BLOCK_ARGUMENTS if name not in parameters]
    if missing:
        raise RuntimeError(
            f"policy.megatron_cfg.mtp_zero_embedding_at_position_0: megatron-core's MultiTokenPredictionBlock.forward takes no "
            f"{', '.join(missing)} on this release, which nemo_rl_mtp's mtp_position_zero needs to zero the MTP embedding at "
            "position 0; set the key to false or adapt megatron_compat/mtp_position_zero.py to this release"
        )
    return True, "MultiTokenPredictionBlock.forward takes embedding, position_ids and packed_seq_params"


def zero_embedding_at_position_0(model) -> bool:
    """Make ``model``'s MTP block (GPTModel or HybridModel, unwrapped) zero its layers' token
    embedding where the trunk's position id is 0; returns whether the model was marked now (False:
    already marked, or no MTP block on this pipeline stage)."""
    block = getattr(model, "mtp", None)
    if block is None:
        return False
    _install()
    if getattr(block, _MARKED, False):
        return False
    setattr(block, _MARKED, True)
    return True


def zeroes_position_0(model) -> bool:
    """Whether ``model``'s MTP layers zero their token embedding at position 0 (the rollout
    drafters ask, to draft as training computed)."""
    block = getattr(model, "mtp", None)
    return block is not None and getattr(block, _MARKED, False)


def _install() -> None:
    original = MultiTokenPredictionBlock.forward
    if is_shim(original):
        return
    _, reason = probe()
    MultiTokenPredictionBlock.forward = mark_shim(_forward_with_position_0_zeroed(original), original)
    logger.info("mtp_position_zero applied: %s; marked MTP blocks zero their token embedding at position 0", reason)


def _forward_with_position_0_zeroed(original):
    signature = inspect.signature(original)

    def forward(self, *args, **kwargs):
        if not getattr(self, _MARKED, False):
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        arguments = bound.arguments
        position_ids = arguments.get("position_ids")
        if position_ids is None:
            raise RuntimeError(
                "mtp_position_zero: the MTP block got no position_ids, so position 0 cannot be told; the embedding at "
                "position 0 would not be zeroed (policy.megatron_cfg.mtp_zero_embedding_at_position_0)"
            )
        mask = position_0_mask(position_ids, arguments.get("packed_seq_params"), parallel_state.get_context_parallel_world_size())
        calls = [0]
        arguments["embedding"] = zeroed_embedding(arguments["embedding"], mask, calls)
        output = original(*bound.args, **bound.kwargs)
        if calls[0] == 0 and len(self.layers) > 0:
            raise RuntimeError(
                f"mtp_position_zero: megatron-core's {type(self).__name__} ran its MTP layers without computing their token "
                "embedding through the embedding it was handed; this release needs megatron_compat/mtp_position_zero.py "
                "adapted (or policy.megatron_cfg.mtp_zero_embedding_at_position_0=false)"
            )
        return output

    # It takes megatron's arguments and passes them on: probes of the block's signature (such as
    # hybrid_mtp_padding's for padding_mask) read megatron's.
    forward.__signature__ = signature
    return forward


def position_0_mask(position_ids: torch.Tensor, packed_seq_params=None, cp_size: int = 1) -> torch.Tensor:
    """[b, s] bool: the tokens whose trunk position id is 0, the first token of each sequence.

    ``position_ids`` [b, s] are the trunk's (this context-parallel rank's tokens). Unpacked rows
    count from 0, so a row's first token is its only 0. Packed (THD) rows are padded with position
    id 0 as well (training.batches), so there a 0 counts only at a sequence's start in the pack:
    ``cu_seqlens_q_padded`` (or ``cu_seqlens_q``) divided by ``cp_size``, each rank holding
    1 / cp_size of every padded sequence (the start only on rank 0, where its id is 0).
    """
    mask = position_ids == 0
    if packed_seq_params is None or getattr(packed_seq_params, "qkv_format", "thd") != "thd":
        return mask
    cu_seqlens = packed_seq_params.cu_seqlens_q_padded
    if cu_seqlens is None:
        cu_seqlens = packed_seq_params.cu_seqlens_q
    starts = (cu_seqlens[:-1].to(torch.long) // cp_size).to(mask.device)
    at_start = torch.zeros(mask.shape[-1], dtype=torch.bool, device=mask.device)
    at_start[starts[starts < mask.shape[-1]]] = True
    return mask & at_start


def zeroed_embedding(embedding, mask: torch.Tensor, calls: list | None = None):
    """``embedding`` (megatron's ``LanguageModelEmbedding``, called ``embedding(input_ids=[b, s],
    position_ids=[b, s])``, returning [s, b, h], the sequence split over tensor-parallel ranks under
    sequence parallelism) with its output zeroed where ``mask`` [b, s] is True. ``calls``: a list
    whose first item counts the calls (the block's wrapper checks that its layers used it)."""

    def embed(*args, **kwargs):
        output = embedding(*args, **kwargs)
        if calls is not None:
            calls[0] += 1
        zero = mask.transpose(0, 1).to(output.device)  # [s, b]
        if zero.shape[0] != output.shape[0]:  # sequence parallel: this rank's slice of the sequence
            local = output.shape[0]
            rank = parallel_state.get_tensor_model_parallel_rank()
            if zero.shape[0] != local * parallel_state.get_tensor_model_parallel_world_size():
                raise RuntimeError(
                    f"mtp_position_zero: a position-0 mask of {zero.shape[0]} positions for an embedding of {local} "
                    "(not this rank's sequence-parallel slice)"
                )
            zero = zero[rank * local : (rank + 1) * local]
        return output.masked_fill(zero.unsqueeze(-1), 0.0)

    return embed
