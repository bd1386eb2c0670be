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

import contextlib
import itertools

import torch

from nemo_rl_mtp.megatron_compat import engine_names


class DraftRoundsController:
    """Mixin for megatron's ``TextGenerationController`` (or a subclass), placed first among the
    bases: its draft rounds are served by ``make_drafter()`` (None: megatron's own step, as on
    pipeline stages without the MTP layers)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        model = engine_names.unwrapped_model(self)
        self.drafter = self.make_drafter() if getattr(model, "mtp", None) is not None else None

    def make_drafter(self):
        raise NotImplementedError

    def _compute_serial_mtp_and_sample(self, *args, **kwargs) -> None:
        context = self.inference_wrapped_model.inference_context
        hidden = engine_names.step_decoder_hidden(self) if self.drafter is not None else None
        if hidden is None or not engine_names.is_last_pipeline_stage(self):
            return super()._compute_serial_mtp_and_sample(*args, **kwargs)
        self.drafter.start_round(context, self._last_accepted_seq_indices, self._gathered(hidden))
        with serving_draft_steps(engine_names.unwrapped_model(self), self.drafter):
            super()._compute_serial_mtp_and_sample(*args, **kwargs)

    def _gathered(self, hidden: torch.Tensor) -> torch.Tensor:
        """The step's decoder output [T, 1, H], gathered where sequence parallelism scatters it."""
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        if not engine_names.sequence_parallel_across_ranks(self):
            return hidden
        return gather_from_sequence_parallel_region(hidden, group=self.inference_wrapped_model.tp_group)


def with_drafter(controller_class: type, drafter_class: type, mixin: type = DraftRoundsController) -> type:
    """``controller_class`` whose draft rounds ``drafter_class(model, context, num_depths)`` serves."""

    def make_drafter(self):
        model = engine_names.unwrapped_model(self)
        depths = engine_names.draft_depths(model, self.num_speculative_tokens)
        return drafter_class(model, self.inference_wrapped_model.inference_context, depths)

    name = f"{drafter_class.__name__}{controller_class.__name__}"
    return type(name, (mixin, controller_class), {"make_drafter": make_drafter})


@contextlib.contextmanager
def serving_draft_steps(model, drafter):
    """Route the engine's ``compute_mtp_single_step`` calls of one draft round to
    ``drafter.draft_step``, counting depths (a repeated layer is called without one)."""
    depths = itertools.count()

    def compute_mtp_single_step(hidden_states, next_token_ids, position_ids, depth=None, **unused):
        last_hidden, logits = drafter.draft_step(next_token_ids, next(depths) if depth is None else depth)
        return pad_rows(last_hidden, hidden_states.shape[0]), pad_rows(logits, next_token_ids.shape[1])

    model.compute_mtp_single_step = compute_mtp_single_step
    try:
        yield
    finally:
        del model.compute_mtp_single_step
        drafter.end_round()


def output_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The shared output layer on MTP hidden states, as megatron's draft step applies it."""
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    logits, _ = model.output_layer(hidden, weight=weight, runtime_gather_output=True)
    return model._scale_logits(logits)


def pad_rows(values: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero rows appended up to ``rows`` (megatron pads the draft batch for sequence parallelism)."""
    missing = rows - values.shape[0]
    return torch.cat([values, values.new_zeros(missing, *values.shape[1:])]) if missing > 0 else values


def sequence_parallel_multiple(model) -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size() if model.config.sequence_parallel else 1


def mtp_layer(model, depth: int):
    """The MTP layer that drafts at ``depth`` (one layer for all depths when it is repeated)."""
    return model.mtp.layers[0 if model.mtp.mtp_use_repeated_layer else depth]
