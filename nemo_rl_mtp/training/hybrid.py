"""megatron-core's HybridModel (``policy.megatron_cfg.model_class: hybrid``): the decoder and each
MTP layer are the layers ``hybrid_layer_pattern`` lists, one module per symbol.

On transformer_engine the stack spec is megatron's own (``hybrid_layer_specs.hybrid_stack_spec``:
Mamba, GatedDeltaNet, attention, MLP, MoE). Without it (the CPU), the spec is built here from the
GPT local layer spec that :func:`setup.build_layer_spec` makes, split the way megatron splits a
transformer layer for a hybrid stack: an attention layer (input norm, self-attention with our
packed core attention) and an MLP or MoE layer (pre-MLP norm, MLP or experts), under the same
submodule names. A GPT layer is then exactly an attention layer followed by an MLP layer, and
``"*-*-/*-"`` computes what a two-layer GPTModel with one MTP layer computes (tested). Mamba and
GatedDeltaNet layers need CUDA kernels: the local spec has none.
"""

from __future__ import annotations

import dataclasses
import logging

from megatron.core.transformer.spec_utils import ModuleSpec

from nemo_rl_mtp.config.checks import split_hybrid_pattern
from nemo_rl_mtp.config.schema import HYBRID_GPU_ONLY_LAYERS

logger = logging.getLogger(__name__)


def decoder_layer_types(pattern: str) -> list[str]:
    """The decoder's layer symbols, pipeline stages joined (the config's split, which its checks
    read too)."""
    return list(split_hybrid_pattern(pattern).decoder_layers)


def transformer_config_kwargs(megatron_cfg) -> dict:
    """TransformerConfig fields a hybrid model needs on top of the architecture keys: which decoder
    layers are MoE (megatron's MoE metrics average over them)."""
    if not megatron_cfg.num_moe_experts:
        return {}
    return {"moe_layer_freq": [int(symbol == "E") for symbol in decoder_layer_types(megatron_cfg.hybrid_layer_pattern)]}


def hybrid_stack_spec(transformer_impl: str, config, gpt_layer_spec: ModuleSpec, pattern: str) -> ModuleSpec:
    """megatron's transformer_engine stack spec, or the local one built from ``gpt_layer_spec``
    (:func:`setup.build_layer_spec` for this config, experts or not) and the dense local MLP."""
    if transformer_impl == "transformer_engine":
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec as te_stack_spec

        return te_stack_spec
    gpu_only = [name for symbol, name in HYBRID_GPU_ONLY_LAYERS.items() if symbol in pattern]
    if gpu_only:
        raise ValueError(
            f"policy.megatron_cfg.hybrid_layer_pattern={pattern!r}: {' and '.join(gpu_only)} layers need CUDA kernels and "
            "transformer_engine, and this worker builds the local spec (no CUDA or no transformer_engine)"
        )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        get_mtp_layer_spec,
    )

    dense = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization=config.normalization)
    submodules = HybridStackSubmodules(
        attention_layer=_layer_part(gpt_layer_spec, ("input_layernorm", "self_attention", "self_attn_bda")),
        mlp_layer=_mlp_layer(dense),
        mtp_block_spec=ModuleSpec(
            module=MultiTokenPredictionBlock,
            # Norms and projection only: the layers of each depth come from the pattern.
            submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[get_mtp_layer_spec(None, use_transformer_engine=False)]),
        ),
    )
    if config.num_moe_experts:
        submodules.moe_layer = _layer_part(gpt_layer_spec, ("pre_mlp_layernorm", "mlp", "mlp_bda"))
    return ModuleSpec(module=HybridStack, submodules=submodules)


def _mlp_layer(dense_spec: ModuleSpec) -> ModuleSpec:
    from megatron.core.ssm.mlp_layer import MLPLayer

    return dataclasses.replace(_layer_part(dense_spec, ("pre_mlp_layernorm", "mlp", "mlp_bda")), module=MLPLayer)


def _layer_part(layer_spec: ModuleSpec, parts: tuple[str, ...]) -> ModuleSpec:
    """``layer_spec`` (a TransformerLayer) with only ``parts`` (the rest megatron's identities),
    and the checkpoint key renames of the parts it keeps."""
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    source = layer_spec.submodules
    renames = {key: value for key, value in (source.sharded_state_dict_keys_map or {}).items() if key.rstrip(".") in parts}
    kept = TransformerLayerSubmodules(**{part: getattr(source, part) for part in parts}, sharded_state_dict_keys_map=renames)
    return ModuleSpec(module=layer_spec.module, params=dict(layer_spec.params), submodules=kept)


def build_hybrid_model(config, stack_spec: ModuleSpec, pattern: str, **model_kwargs):
    """megatron's HybridModel (``model_kwargs``: vocab_size, max_sequence_length, pre/post_process,
    embedding and output options), its final norm built as :mod:`compat.hybrid_final_norm` says,
    its MTP block given the padding mask as :mod:`compat.hybrid_mtp_padding` says, its MTP layers'
    MoE routers marked as :mod:`compat.hybrid_mtp_router` says."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from nemo_rl_mtp.megatron_compat import hybrid_mtp_padding
    from nemo_rl_mtp.megatron_compat import hybrid_mtp_router
    from nemo_rl_mtp.megatron_compat.hybrid_final_norm import local_final_norm

    with local_final_norm(config):
        model = HybridModel(config=config, hybrid_stack_spec=stack_spec, hybrid_layer_pattern=pattern, **model_kwargs)
    if hybrid_mtp_padding.needed(model, _mtp_layer_pattern(pattern)):
        hybrid_mtp_padding.pass_padding_mask_to_mtp(model)
    hybrid_mtp_router.mark_mtp_routers(model)
    return model


def mamba_inference_state(model) -> dict:
    """The engine's ``InferenceConfig`` arguments for a HybridModel with Mamba layers (their
    per-request conv and SSM state shapes, megatron's ``MambaInferenceStateConfig.from_model``);
    ``{}`` for a model without (GPTModel, a hybrid of attention, MLP and MoE layers), which
    megatron's context then treats as a transformer, as megatron's own inference set-up does."""
    try:
        from megatron.core.inference.config import MambaInferenceStateConfig
    except ImportError:  # releases whose engine predates hybrid models
        return {}
    state = MambaInferenceStateConfig.from_model(model)
    return {} if state is None else {"mamba_inference_state_config": state}


def _mtp_layer_pattern(pattern: str) -> str | None:
    """The pattern every MTP depth repeats (config.checks requires one for all), None without MTP
    layers: what megatron's ``parse_hybrid_pattern`` calls ``mtp_pattern``."""
    depths = split_hybrid_pattern(pattern).mtp_depths
    return depths[0] if depths else None
