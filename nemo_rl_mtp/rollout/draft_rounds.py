"""The draft round of megatron-core's engine, served by one of our drafters.

After each verified step megatron's controller runs ``_compute_serial_mtp_and_sample``: for each
MTP depth it calls the model's ``compute_mtp_single_step`` on the last accepted position of every
request and samples a draft from the logits. A drafter (:mod:`sequence_drafts`,
:mod:`incremental_drafts`) replaces that single step for the duration of a round and computes the
drafts with the context the heads had in training; megatron's own loop still samples them, so
verification, log-probs and acceptance counters are untouched.

A drafter has ``start_round(context, last_accepted, hidden)`` (the step's verified tokens and the
decoder's hidden states ``[T, 1, H]`` at them) and ``draft_step(next_token_ids, depth)``
(``next_token_ids`` ``[1, >= R]``: the sampled token at depth 0, the previous draft after; returns
hidden ``[R, 1, H]`` and logits ``[R, 1, V]`` at each request's drafting position).
"""

from __future__ import annotations

import torch

from nemo_rl_mtp.megatron_compat import engine_access, mtp_position_zero
from nemo_rl_mtp.megatron_compat.controller_hooks import serving_draft_steps


class DraftRoundsController:
    """Mixin for megatron's controller under :class:`controller_hooks.SpeculativeControllerHooks`,
    placed before it among the bases: its draft rounds are served by a ``drafter_class(model,
    context, num_depths)`` (None: megatron's own step, as on pipeline stages without the MTP
    layers). A subclass names its drafter class."""

    drafter_class: type | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        model = engine_access.unwrapped_model(self)
        self.drafter = self.make_drafter() if getattr(model, "mtp", None) is not None else None

    def make_drafter(self):
        model = engine_access.unwrapped_model(self)
        depths = engine_access.draft_depths(model, self.num_speculative_tokens)
        return self.drafter_class(model, self.inference_wrapped_model.inference_context, depths)

    def draft_round(self, megatron_round) -> None:
        context = self.inference_wrapped_model.inference_context
        hidden = engine_access.step_decoder_hidden(self) if self.drafter is not None else None
        if hidden is None or not engine_access.is_last_pipeline_stage(self):
            return super().draft_round(megatron_round)
        self.drafter.start_round(context, engine_access.last_accepted_indices(self), self._gathered(hidden))
        with serving_draft_steps(engine_access.unwrapped_model(self), self.drafter):
            super().draft_round(megatron_round)

    def _gathered(self, hidden: torch.Tensor) -> torch.Tensor:
        """The step's decoder output [T, 1, H], gathered where sequence parallelism scatters it."""
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        if not engine_access.sequence_parallel_across_ranks(self):
            return hidden
        return gather_from_sequence_parallel_region(hidden, group=self.inference_wrapped_model.tp_group)


def output_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The shared output layer on MTP hidden states, as megatron's draft step applies it."""
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    logits, _ = model.output_layer(hidden, weight=weight, runtime_gather_output=True)
    return engine_access.scale_logits(model, logits)


def sequence_parallel_multiple(model) -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size() if model.config.sequence_parallel else 1


def mtp_layer(model, depth: int):
    """The MTP layer that drafts at ``depth`` (one layer for all depths when it is repeated)."""
    return model.mtp.layers[0 if model.mtp.mtp_use_repeated_layer else depth]


def draft_embedding(model, trunk_positions: torch.Tensor):
    """The token embedding a draft's MTP layer takes: the model's, zeroed where the trunk position
    of the hidden state it is combined with (``trunk_positions`` [b, s], laid out as the layer's
    token ids) is 0, when the model's MTP layers are trained so (the serving engines' convention,
    :mod:`megatron_compat.mtp_position_zero`): drafts then compute what training does, and the
    rollouts' acceptance measures what the engine that serves the export accepts."""
    if not mtp_position_zero.zeroes_position_0(model):
        return model.embedding
    return mtp_position_zero.zeroed_embedding(model.embedding, trunk_positions == 0)
