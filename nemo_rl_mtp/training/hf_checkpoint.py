"""Hugging Face checkpoints in and out through megatron-bridge, MTP weights included.

In: ``policy.model_name`` names a checkpoint (hub id or directory). megatron-bridge reads its
config into a model provider (architecture, MTP layer count) and maps its tensors onto megatron's
names; the model itself is built by :mod:`setup` (local spec on CPU, transformer_engine spec on
GPU), so packing, recompute, parallelism, engine rollouts, checkpoints and resume work on it.
Out: :func:`export_hf_checkpoint` streams the trained weights back to Hugging Face names
(``export_hf_weights``: tensor-parallel shards gathered) and writes safetensors, ``config.json``
with the MTP layer count, the tokenizer and the source's remote-code files.

megatron-bridge is imported only here, and only when a checkpoint is imported or exported: it
takes about 15 s.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

# GPTModel arguments the provider holds (besides the TransformerConfig fields).
_MODEL_KWARGS = (
    "share_embeddings_and_output_weights", "position_embedding_type", "rotary_percent", "rotary_base",
    "rope_scaling", "rope_scaling_factor", "seq_len_interpolation_factor",
)  # fmt: skip
# Files of a checkpoint directory that are not weights: copied into an export.
_ARTIFACT_PATTERNS = ("*.py", "tokenizer*", "special_tokens_map.json", "vocab.*", "merges.txt", "chat_template*", "generation_config.json")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as configured; the message names the key and value."""


@dataclass(frozen=True)
class CheckpointFacts:
    """What the driver checks and resolves a config against before any worker starts."""

    model_name: str
    architecture: str
    # config.json's model_type (None where it has none).
    model_type: Optional[str]
    # MTP layers with weights in the checkpoint (0: none).
    mtp_num_layers: int
    max_position_embeddings: int
    multi_latent_attention: bool
    # policy.megatron_cfg's architecture keys as the checkpoint has them (None where the key's
    # choices cannot express the checkpoint's, e.g. an activation other than gelu and swiglu).
    architecture_keys: dict


def open_checkpoint(model_name: str, trust_remote_code: bool):
    """megatron-bridge's ``AutoBridge`` over the checkpoint (its config; weights read lazily)."""
    check_reachable(model_name, trust_remote_code)
    from nemo_rl_mtp.megatron_compat.megatron_bridge import import_megatron_bridge

    auto_bridge = import_megatron_bridge().AutoBridge
    try:
        return auto_bridge.from_hf_pretrained(model_name, trust_remote_code=trust_remote_code)
    except ValueError as error:
        raise CheckpointError(f"policy.model_name={model_name}: megatron-bridge cannot read it ({_first_line(error)})") from None


def check_reachable(model_name: str, trust_remote_code: bool) -> None:
    """A local directory that exists, with a config.json, whose code may run if it has any; a
    name that is not a local path is left to the hub."""
    path = Path(model_name)
    looks_local = path.is_absolute() or model_name.startswith(".") or path.exists() or len(path.parts) > 2
    if not looks_local:
        return
    if not path.is_dir():
        raise CheckpointError(f"policy.model_name={model_name}: no such directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"policy.model_name={model_name}: no config.json there (not a Hugging Face checkpoint)")
    if "auto_map" in json.loads(config_file.read_text()) and not trust_remote_code:
        raise CheckpointError(
            f"policy.model_name={model_name}: the checkpoint's architecture is defined by its own code (config.json "
            "auto_map); set policy.trust_remote_code=true if you trust it"
        )


def checkpoint_facts(bridge, model_name: str) -> CheckpointFacts:
    provider = bridge.to_megatron_provider(load_weights=False)
    hf_config = bridge.hf_pretrained.config
    return CheckpointFacts(
        model_name=model_name,
        architecture=(getattr(hf_config, "architectures", None) or ["?"])[0],
        model_type=getattr(hf_config, "model_type", None),
        mtp_num_layers=int(provider.mtp_num_layers or 0),
        max_position_embeddings=int(provider.seq_length),
        multi_latent_attention=bool(getattr(provider, "multi_latent_attention", False)),
        architecture_keys=_architecture_keys(provider),
    )


def checkpoint_mtp_layers(bridge) -> int:
    """MTP layers with weights in the checkpoint (0: none)."""
    return int(bridge.to_megatron_provider(load_weights=False).mtp_num_layers or 0)


def _architecture_keys(provider) -> dict:
    import torch.nn.functional as F

    activation = None
    if provider.gated_linear_unit and provider.activation_func is F.silu:
        activation = "swiglu"
    elif not provider.gated_linear_unit and provider.activation_func is F.gelu:
        activation = "gelu"
    return {
        "num_layers": provider.num_layers,
        "hidden_size": provider.hidden_size,
        "ffn_hidden_size": provider.ffn_hidden_size,
        "num_attention_heads": provider.num_attention_heads,
        "num_query_groups": provider.num_query_groups or provider.num_attention_heads,
        "normalization": provider.normalization if provider.normalization in ("LayerNorm", "RMSNorm") else None,
        "activation": activation,
        "position_embedding_type": provider.position_embedding_type if provider.position_embedding_type in ("rope", "learned_absolute") else None,
        "rotary_base": int(provider.rotary_base),
        "share_embeddings_and_output_weights": bool(provider.share_embeddings_and_output_weights),
        "num_moe_experts": provider.num_moe_experts or 0,
        "moe_router_topk": provider.moe_router_topk,
        "moe_ffn_hidden_size": provider.moe_ffn_hidden_size if provider.num_moe_experts else None,
    }


def mtp_count_keys() -> tuple[str, ...]:
    """Hugging Face config keys megatron-bridge reads as megatron's ``mtp_num_layers``."""
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge

    return tuple(hf_key for hf_key, megatron_key in MegatronModelBridge.CONFIG_MAPPING if megatron_key == "mtp_num_layers")


# Where the serving engines' MTP drafters zero the MTP layer's token embedding at position 0
# (vLLM 0.32.0 ``vllm/model_executor/models/``, SGLang ``python/sglang/srt/models/``; docs/serving.md,
# "Train/serve differences in the MTP input"), by config.json's architectures[0] or model_type.
_ZEROING_ENGINES = {
    "MiMoForCausalLM": "vLLM (mimo_mtp.py) and SGLang (mimo_mtp.py) zero the MTP embedding at position 0",
    "DeepseekV3ForCausalLM": "vLLM (deepseek_mtp.py) zeroes the MTP embedding at position 0 (SGLang's NextN does not)",
    "Glm4MoeForCausalLM": "vLLM (glm4_moe_mtp.py) zeroes the MTP embedding at position 0 (SGLang's NextN does not)",
}
_ZEROING_MODEL_TYPES = {"mimo": "MiMoForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}


def mtp_position_0_zeroing(setting, architecture: Optional[str], model_type: Optional[str]) -> tuple[bool, str]:
    """``policy.megatron_cfg.mtp_zero_embedding_at_position_0`` resolved for a checkpoint of
    ``architecture`` (config.json's architectures[0]) and ``model_type`` (None, None: a GPT built
    from scratch): whether the MTP layers zero their token embedding at position 0, and why."""
    if setting != "auto":  # true | false (config.checks allows nothing else)
        return bool(setting), f"set to {str(setting).lower()} in the config"
    if architecture is None and model_type is None:
        return False, "auto: a GPT built from scratch, no serving engine's MTP drafter to match"
    name = architecture if architecture in _ZEROING_ENGINES else _ZEROING_MODEL_TYPES.get(model_type or "")
    if name is not None:
        return True, f"auto: {architecture or name} (model_type {model_type}): {_ZEROING_ENGINES[name]}"
    return False, f"auto: {architecture} (model_type {model_type}): the serving engines' MTP drafters take megatron's input at position 0"


def hf_architecture(bridge) -> tuple[Optional[str], Optional[str]]:
    """config.json's architectures[0] and model_type of the checkpoint ``bridge`` reads."""
    hf_config = bridge.hf_pretrained.config
    return (getattr(hf_config, "architectures", None) or [None])[0], getattr(hf_config, "model_type", None)


@dataclass
class ModelArchitecture:
    """What builds an imported GPTModel: the TransformerConfig class and fields of the
    checkpoint's architecture, and the GPTModel arguments."""

    config_class: type
    config_fields: dict
    model_kwargs: dict
    # The output layer's rows (the checkpoint's vocabulary, padded as the bridge pads it).
    padded_vocab_size: int


def imported_architecture(bridge, tensor_model_parallel_size: int) -> ModelArchitecture:
    """The architecture as megatron-bridge's provider for the checkpoint describes it."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    provider = bridge.to_megatron_provider(load_weights=False)
    config_class = next(cls for cls in type(provider).__mro__ if cls.__module__.startswith("megatron.core") and issubclass(cls, TransformerConfig))
    config_fields = {field.name: getattr(provider, field.name) for field in fields(config_class) if field.init}
    model_kwargs = {key: getattr(provider, key) for key in _MODEL_KWARGS if hasattr(provider, key)}
    return ModelArchitecture(config_class, config_fields, model_kwargs, _padded_vocab_size(provider, tensor_model_parallel_size))


def _padded_vocab_size(provider, tensor_model_parallel_size: int) -> int:
    """The vocabulary as the bridge's own model building pads it, so its mappings fit."""
    if not getattr(provider, "should_pad_vocab", False):
        return provider.vocab_size
    from megatron.bridge.models.gpt_provider import calculate_padded_vocab_size

    return calculate_padded_vocab_size(provider.vocab_size, provider.make_vocab_size_divisible_by, tensor_model_parallel_size)


def load_hf_weights(bridge, model, new_mtp_layers: bool) -> None:
    """The checkpoint's weights into ``model`` (DDP-wrapped or not; this rank's shards). With
    ``new_mtp_layers`` the MTP block keeps its fresh initialisation (the checkpoint has none)."""
    from nemo_rl_mtp.megatron_compat.cpu import training_runtime as cpu_runtime

    with cpu_runtime.device_scope():
        bridge.load_hf_weights([model], allowed_mismatched_params=["mtp.*"] if new_mtp_layers else None)


def hf_state_dict(bridge, model, mtp_num_layers: int) -> dict[str, torch.Tensor]:
    """Every tensor of ``model`` under its Hugging Face name (full tensors, on the host, in the
    checkpoint's dtype), on every rank (collective over model-parallel ranks).

    The export runs from the checkpoint's config alone, with its MTP count set to the model's: an
    export that reads the source's tensor names would leave out MTP layers the source lacked."""
    from nemo_rl_mtp.megatron_compat.cpu import training_runtime as cpu_runtime

    config = copy.deepcopy(bridge.hf_pretrained.config)
    for key in mtp_count_keys():
        if hasattr(config, key):
            setattr(config, key, mtp_num_layers)
    config_bridge = type(bridge).from_hf_config(config)
    dtype = _checkpoint_dtype(config)
    with cpu_runtime.device_scope():
        weights = config_bridge.export_hf_weights([model], cpu=True, show_progress=False)
        return {name: tensor.detach().to("cpu", dtype or tensor.dtype).contiguous() for name, tensor in weights}


def _checkpoint_dtype(config) -> Optional[torch.dtype]:
    """The floating-point dtype the checkpoint's weights are stored in, per its config."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def export_hf_checkpoint(bridge, model, out_dir: Path, mtp_num_layers: int, source_dir: Path) -> Path:
    """A Hugging Face checkpoint of ``model`` in ``out_dir``: safetensors (sharded as the hub
    shards them), ``config.json`` (the source's, with its MTP layer count set to
    ``mtp_num_layers``), and the source's tokenizer and remote-code files."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    state = hf_state_dict(bridge, model, mtp_num_layers)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = split_torch_state_dict_into_shards(state)
    for filename, names in plan.filename_to_tensors.items():
        save_file({name: state[name] for name in names}, out_dir / filename, metadata={"format": "pt"})
    if plan.is_sharded:
        index = {"metadata": plan.metadata, "weight_map": plan.tensor_to_filename}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    _copy_artifacts(source_dir, out_dir)
    config = json.loads((source_dir / "config.json").read_text())
    keys = mtp_count_keys()
    present = [key for key in keys if key in config]
    for key in present or keys:  # the source's own key; every key megatron-bridge reads if it had none
        config[key] = mtp_num_layers
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def _copy_artifacts(source_dir: Path, out_dir: Path) -> None:
    for pattern in _ARTIFACT_PATTERNS:
        for path in source_dir.glob(pattern):
            if path.is_file():
                shutil.copy2(path, out_dir / path.name)


def source_directory(model_name: str) -> Path:
    """The checkpoint's files on this machine (a hub id is fetched into the local cache)."""
    if Path(model_name).is_dir():
        return Path(model_name)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model_name, allow_patterns=list(_ARTIFACT_PATTERNS) + ["config.json"]))


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[0].strip() if lines else type(error).__name__
