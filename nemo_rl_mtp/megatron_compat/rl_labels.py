"""RL-mode MTP labels (``labels=None``) for releases before megatron-core 0.19.

0.19's ``process_mtp_loss`` takes ``input_ids`` and, when ``labels`` is None, derives the labels by
rolling ``input_ids`` left and rolls ``loss_mask`` in lockstep. Before that:

* 0.17/0.18 have ``process_mtp_loss`` without ``input_ids``: with ``labels=None`` it returns early,
  so the MTP block runs but no MTP loss is computed (no gradient reaches the MTP weights, empty
  tracker, no error). Shim: ``gpt_model.process_mtp_loss`` is replaced by the back-port below;
  ``GPTModel._postprocess`` is wrapped only to hand it ``input_ids``.
* 0.14-0.16 compute the MTP loss inline in ``GPTModel._postprocess`` and call ``labels.clone()``
  (crash with ``labels=None``). Shim: ``_postprocess`` runs the MTP block and the back-port itself,
  then the original with the inline loss switched off.

The back-port follows megatron-core 0.19.2's ``process_mtp_loss`` (Apache-2.0, NVIDIA) and uses the
installed release's own ``roll_tensor``, ``MTPLossAutoScaler`` and tracker, so the MTP loss,
gradient and acceptance match 0.19.2 for the same weights and data.
"""

from __future__ import annotations

import contextvars
import inspect

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import gpt_model
from megatron.core.transformer import multi_token_prediction as mtp_module

from nemo_rl_mtp.megatron_compat._marks import is_shim, mark_shim

# (model, input_ids) of the GPTModel._postprocess call in progress, for the 0.17/0.18 path.
_POSTPROCESS_INPUTS: contextvars.ContextVar = contextvars.ContextVar("mtp_postprocess_inputs", default=None)


def probe() -> tuple[bool, str]:
    if is_shim(gpt_model.GPTModel._postprocess):
        return True, "installed earlier in this process"
    native = getattr(mtp_module, "process_mtp_loss", None)
    if native is None:
        return True, "the MTP loss is computed inline in GPTModel._postprocess and needs labels"
    if "input_ids" not in inspect.signature(native).parameters:
        return True, "process_mtp_loss takes no input_ids: with labels=None it computes no MTP loss"
    return False, "process_mtp_loss derives labels from input_ids when labels is None (upstream)"


def is_applied() -> bool:
    return is_shim(gpt_model.GPTModel._postprocess)


def apply() -> str:
    original = gpt_model.GPTModel._postprocess
    if is_shim(original):
        return "already installed (idempotent)"
    if getattr(mtp_module, "process_mtp_loss", None) is not None:
        gpt_model.process_mtp_loss = mark_shim(_process_mtp_loss_with_postprocess_inputs, gpt_model.process_mtp_loss)
        gpt_model.GPTModel._postprocess = mark_shim(_record_postprocess_inputs(original), original)
        return "gpt_model.process_mtp_loss -> 0.19 back-port (labels from input_ids); _postprocess hands it input_ids"
    gpt_model.GPTModel._postprocess = mark_shim(_postprocess_with_backported_loss(original), original)
    return "GPTModel._postprocess: MTP block + 0.19 back-port of the MTP loss; inline MTP loss switched off"


def process_mtp_loss_backport(
    hidden_states,
    labels,
    loss_mask,
    output_layer,
    output_weight,
    runtime_gather_output,
    is_training,
    compute_language_model_loss,
    config,
    cp_group=None,
    tp_group=None,
    packed_seq_params=None,
    scale_logits_fn=None,
    input_ids=None,
):
    """megatron-core 0.19.2 ``process_mtp_loss`` on an older release."""
    roll_tensor = mtp_module.roll_tensor
    num_layers = config.mtp_num_layers
    hidden_states_list = torch.chunk(hidden_states, 1 + num_layers, dim=0)
    hidden_states = hidden_states_list[0]
    derived_labels_from_input_ids = False
    if labels is None:
        if input_ids is None:
            return hidden_states
        labels, _ = roll_tensor(input_ids, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params)
        derived_labels_from_input_ids = True
    if getattr(config, "mtp_detach_heads", False):
        output_weight = (output_weight if output_weight is not None else output_layer.weight).detach()
    mtp_labels = labels.clone()
    if loss_mask is None:
        loss_mask = torch.ones_like(mtp_labels)
    if derived_labels_from_input_ids:
        # The last rolled-in label is fabricated: roll the mask in lockstep to mask it.
        loss_mask, _ = roll_tensor(loss_mask, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params)
    original_num_tokens = loss_mask.sum()
    for layer in range(num_layers):
        mtp_logits, _ = output_layer(
            hidden_states_list[layer + 1], weight=output_weight, runtime_gather_output=runtime_gather_output
        )
        if scale_logits_fn is not None:
            mtp_logits = scale_logits_fn(mtp_logits)
        mtp_labels, _ = roll_tensor(mtp_labels, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params)
        loss_mask, num_tokens = roll_tensor(
            loss_mask, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params
        )
        mtp_loss = loss_mask * compute_language_model_loss(mtp_labels, mtp_logits)
        if is_training:
            loss_for_log = (torch.sum(mtp_loss) * (num_tokens > 0).to(mtp_loss.dtype)) / num_tokens.clamp(min=1)
            correct, total = _acceptance_counts(mtp_logits, mtp_labels, loss_mask, output_layer, runtime_gather_output, tp_group)
            mtp_module.MTPLossLoggingHelper.save_metrics_to_tracker(
                loss_for_log,
                correct,
                total,
                layer,
                num_layers,
                avg_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
            )
        scale = config.mtp_loss_scaling_factor / num_layers
        if config.calculate_per_token_loss:
            scaled = scale * mtp_loss * (original_num_tokens / num_tokens.clamp(min=1))
        else:
            scaled = scale * mtp_loss / num_tokens.clamp(min=1)
        hidden_states = mtp_module.MTPLossAutoScaler.apply(hidden_states, scaled)
    return hidden_states


def _acceptance_counts(mtp_logits, mtp_labels, loss_mask, output_layer, runtime_gather_output, tp_group):
    """Top-1 MTP prediction == label, over the masked positions (vocab-parallel aware)."""
    native = getattr(mtp_module, "_compute_mtp_acceptance_counts", None)
    if native is not None:
        return native(mtp_logits, mtp_labels, loss_mask, output_layer, runtime_gather_output, tp_group)
    with torch.no_grad():
        sharded = (not runtime_gather_output) if runtime_gather_output is not None else not getattr(output_layer, "gather_output", False)
        tp_size = torch.distributed.get_world_size(group=tp_group) if tp_group is not None else 1
        if tp_size > 1 and sharded:
            shard_size = mtp_logits.size(-1)
            local_max, local_argmax = mtp_logits.max(dim=-1)
            all_max = [torch.empty_like(local_max) for _ in range(tp_size)]
            all_argmax = [torch.empty_like(local_argmax) for _ in range(tp_size)]
            torch.distributed.all_gather(all_max, local_max, group=tp_group)
            torch.distributed.all_gather(all_argmax, local_argmax, group=tp_group)
            winner = torch.stack(all_max).argmax(dim=0)
            predictions = winner * shard_size + torch.gather(torch.stack(all_argmax), 0, winner[None]).squeeze(0)
        else:
            predictions = mtp_logits.argmax(dim=-1)  # [s, b]
        valid = loss_mask.transpose(0, 1).bool()
        correct = ((predictions == mtp_labels.transpose(0, 1)) & valid).sum().float()
        return correct, valid.sum().float()


def _process_mtp_loss_with_postprocess_inputs(*args, **kwargs):
    """0.17/0.18: ``_postprocess`` calls ``process_mtp_loss`` without input_ids; add them."""
    inputs = _POSTPROCESS_INPUTS.get()
    if inputs is not None and "input_ids" not in kwargs:
        model, input_ids = inputs
        kwargs["input_ids"] = input_ids
        kwargs.setdefault("tp_group", getattr(model, "tp_group", None))
    return process_mtp_loss_backport(*args, **kwargs)


def _record_postprocess_inputs(original):
    signature = inspect.signature(original)

    def _postprocess(self, *args, **kwargs):
        input_ids = signature.bind(self, *args, **kwargs).arguments.get("input_ids")
        token = _POSTPROCESS_INPUTS.set((self, input_ids))
        try:
            return original(self, *args, **kwargs)
        finally:
            _POSTPROCESS_INPUTS.reset(token)

    return _postprocess


def _postprocess_with_backported_loss(original):
    """0.14-0.16: run the MTP block and the back-ported loss, then the original with
    ``mtp_in_postprocess=False`` and ``config.mtp_num_layers`` briefly None (skips the inline loss;
    forward is not re-entrant, so the brief change is safe)."""
    signature = inspect.signature(original)

    def _postprocess(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        if not self.post_process or self.config.mtp_num_layers is None:
            return original(self, *args, **kwargs)
        if arguments.get("inference_context") is not None and not self.training:
            # 0.16 runs the MTP block in an inference engine's forward too, then its loss on labels
            # the engine has not; 0.17 on skip both there. The engine's forward is the trunk's.
            return _without_inline_mtp(original, self, arguments)
        hidden_states = arguments["hidden_states"]
        if arguments["mtp_in_postprocess"]:
            hidden_states = self.mtp(
                input_ids=arguments["input_ids"],
                position_ids=arguments["position_ids"],
                hidden_states=hidden_states,
                attention_mask=arguments["attention_mask"],
                inference_params=arguments["inference_params"],
                rotary_pos_emb=arguments["rotary_pos_emb"],
                rotary_pos_cos=arguments["rotary_pos_cos"],
                rotary_pos_sin=arguments["rotary_pos_sin"],
                packed_seq_params=arguments["packed_seq_params"],
                sequence_len_offset=arguments["sequence_len_offset"],
                embedding=self.embedding,
                **(arguments["extra_block_kwargs"] or {}),
            )
        output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        arguments["hidden_states"] = process_mtp_loss_backport(
            hidden_states=hidden_states,
            labels=arguments["labels"],
            loss_mask=arguments["loss_mask"],
            output_layer=self.output_layer,
            output_weight=output_weight,
            runtime_gather_output=arguments["runtime_gather_output"],
            is_training=self.training,
            compute_language_model_loss=self.compute_language_model_loss,
            config=self.config,
            cp_group=self.cp_group,
            tp_group=getattr(self, "tp_group", None),
            packed_seq_params=arguments["packed_seq_params"],
            input_ids=arguments["input_ids"],
        )
        return _without_inline_mtp(original, self, arguments)

    return _postprocess


def _without_inline_mtp(original, model, arguments: dict):
    """0.14-0.16's ``_postprocess`` with ``mtp_in_postprocess=False`` and ``config.mtp_num_layers``
    briefly None: no MTP block, no inline MTP loss (forward is not re-entrant, so the brief change
    is safe)."""
    arguments = {**arguments, "mtp_in_postprocess": False}
    num_layers, model.config.mtp_num_layers = model.config.mtp_num_layers, None
    try:
        return original(**arguments)
    finally:
        model.config.mtp_num_layers = num_layers
