"""MTP drafts from each request's own sequence, with the context the heads had in training
(``policy.generation.draft_context: sequence``).

In training, MTP depth d at position j combines the hidden state of depth d - 1 at j with the
embedding of token j + d + 1, and its transformer layer attends causally over all positions of
the sequence, with the model's rotary embedding. megatron-core's serial draft step
(``compute_mtp_single_step``, 0.19.2) runs the layer on the last accepted position of every
request only, with no KV cache and no rotary embedding, and lays the batch's requests out as one
causally masked sequence: a draft sees no context of its own request, and sees the requests before
it in the batch. Outputs stay exact (the policy verifies every draft), but the heads draft from
inputs they were never trained on, and accept far less than training measures.

This module keeps, per request, its verified tokens and the main decoder's hidden states at their
positions (megatron caches the step's decoder output for its draft step, and knows which
positions were accepted), and drafts by running megatron's own MTP layers
(``MultiTokenPredictionLayer.forward_single_position``) over every request's whole sequence at
once: right-padded rows, a causal mask, the model's rotary embedding, the draft read at each
row's last position. A draft therefore depends on its request's tokens alone and equals the
training forward's MTP output at that position. The cost is one MTP layer over the sequence
per depth and decode step (no MTP KV cache: upstream's, Megatron-LM PR #7033, covers one repeated
attention layer without rotary embedding only); ``single_position`` keeps megatron's step.
"""

from __future__ import annotations

import itertools
import logging

import torch

from nemo_rl_mtp.rollout.draft_rounds import DraftRoundsController, draft_embedding, mtp_layer, output_logits, sequence_parallel_multiple
from nemo_rl_mtp.training.batches import causal_attention_mask, round_up

logger = logging.getLogger(__name__)


class SequenceDrafts:
    """Each request's verified tokens ``[n]`` and main-decoder hidden states ``[n, H]``
    (positions 0..n-1), and drafts computed from them."""

    def __init__(self, model, context=None, num_depths: int = 0):
        self.model = model
        self.histories: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._round: dict[str, torch.Tensor] | None = None

    def start_round(self, context, last_accepted: torch.Tensor, hidden: torch.Tensor) -> None:
        """Record the step's verified tokens, then lay out the histories of the requests about to draft."""
        self.record_verified_step(context, last_accepted, hidden)
        self.begin_round(context.request_ids[context.paused_request_count : context.total_request_count].tolist())

    def end_round(self) -> None:
        self._round = None

    def record_verified_step(self, context, last_accepted: torch.Tensor, hidden: torch.Tensor) -> None:
        """Extend each active request's history with this step's tokens up to its last accepted
        one (``last_accepted`` [R]: indices into the step's tokens; ``hidden`` [T, 1, H]: the
        decoder output of the step). Positions from a rejected draft are overwritten: a request's
        step starts at its first unverified position."""
        active = slice(context.paused_request_count, context.total_request_count)
        starts = [0, *itertools.accumulate(context.request_query_lengths[active].tolist())]
        request_ids = context.request_ids[active].tolist()
        self._forget_finished(set(context.request_ids[: context.total_request_count].tolist()))
        for request_id, start, end in zip(request_ids, starts, (last_accepted + 1).tolist()):
            self._extend(request_id, int(context.token_to_pos_ids[start]), context.token_to_input_ids[start:end], hidden[start:end, 0])

    def _extend(self, request_id: int, first_position: int, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        known_tokens, known_hidden = self.histories.get(request_id, (tokens[:0], hidden[:0]))
        if first_position > known_tokens.numel():
            raise RuntimeError(
                f"MTP drafts: request {request_id} resumes at position {first_position} but only {known_tokens.numel()} "
                "positions are known (prefix caching skips them); use policy.generation.draft_context=single_position"
            )
        self.histories[request_id] = (
            torch.cat([known_tokens[:first_position], tokens.to(known_tokens.device)]),
            torch.cat([known_hidden[:first_position], hidden]),
        )

    def _forget_finished(self, live_ids: set[int]) -> None:
        for request_id in set(self.histories) - live_ids:
            del self.histories[request_id]

    def begin_round(self, request_ids: list[int]) -> None:
        """Lay out the histories of the requests about to draft, in the engine's order: hidden
        [L, R, H] and tokens [R, L], right-padded to the longest sequence L."""
        histories = [self.histories[request_id] for request_id in request_ids]
        lengths = torch.tensor([tokens.numel() for tokens, _ in histories])
        longest = round_up(int(lengths.max()), sequence_parallel_multiple(self.model))
        hidden = histories[0][1].new_zeros(longest, len(histories), histories[0][1].shape[-1])
        tokens = torch.zeros(len(histories), longest, dtype=torch.long, device=hidden.device)
        for row, (row_tokens, row_hidden) in enumerate(histories):
            hidden[: row_tokens.numel(), row] = row_hidden
            tokens[row, : row_tokens.numel()] = row_tokens
        positions = torch.arange(longest, device=hidden.device).expand(len(histories), longest)
        self._round = {
            "request_ids": request_ids,
            "hidden": hidden,
            "tokens": tokens,
            "positions": positions,
            "last": lengths.to(hidden.device) - 1,
        }

    def draft_step(self, next_token_ids: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP depth over every sequence of the round: ``next_token_ids`` [1, >= R] are the
        tokens after each request's last position (the verified token at depth 0, the previous
        draft after). Returns the hidden states [R, 1, H] and logits [R, 1, V] at the last
        positions, as megatron's ``compute_mtp_single_step`` does for one position."""
        state = self._round
        rows = torch.arange(state["tokens"].shape[0], device=state["tokens"].device)
        tokens, positions = state["tokens"].roll(-1, dims=1), state["positions"] + 1
        tokens[rows, state["last"]] = next_token_ids[0, : rows.numel()].to(tokens.device)
        hidden = self._mtp_layer_over_sequences(state["hidden"], tokens, positions, depth)
        state.update(hidden=hidden, tokens=tokens, positions=positions)
        last_hidden = hidden[state["last"], rows].unsqueeze(1)
        return last_hidden, output_logits(self.model, last_hidden)

    def _mtp_layer_over_sequences(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, depth: int) -> torch.Tensor:
        """megatron's MTP layer for ``depth`` over the padded sequences, as in training: causal
        mask, the model's rotary embedding, the token embedding zeroed at each row's position 0
        where the model's MTP layers zero it; [L, R, H] in and out."""
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region

        model, length = self.model, hidden.shape[0]
        layer = mtp_layer(model, depth)
        rotary = model.rotary_pos_emb(length) if model.position_embedding_type == "rope" else None
        sequence_parallel = model.config.sequence_parallel
        if sequence_parallel:
            hidden = scatter_to_sequence_parallel_region(hidden)
        output = layer.forward_single_position(
            hidden_states=hidden,
            next_token_ids=tokens,
            position_ids=positions,
            embedding=draft_embedding(model, torch.arange(length, device=tokens.device).expand_as(tokens)),
            attention_mask=causal_attention_mask(length).to(hidden.device),
            rotary_pos_emb=rotary,
        )
        return gather_from_sequence_parallel_region(output) if sequence_parallel else output


class SequenceDraftsController(DraftRoundsController):
    """Draft rounds served by :class:`SequenceDrafts` (a mixin: see :mod:`controllers`)."""

    drafter_class = SequenceDrafts
