"""MiMo's model layout, as Xiaomi's MiMo-7B checkpoints ship it (remote code): a Qwen2 decoder and
``model.mtp_layers.N``, each an MTP layer (DeepSeek-V3 style) of its own.

An MTP layer combines the previous depth's hidden state ``h`` (the decoder's output for depth 1)
with the embedding ``e`` of the token one place further ahead:
``input_proj(cat(hidden_layernorm(h), token_layernorm(e)))``, then one Qwen2 decoder block
(``input_layernorm``, ``self_attn``, ``post_attention_layernorm``, ``mlp``) and ``final_layernorm``;
the output layer ``lm_head`` turns its output into logits. ``forward`` is Qwen2's: the MTP layers
are for speculative decoding (vLLM and SGLang read them), not for ``generate``.
"""

from torch import nn
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2ForCausalLM, Qwen2MLP, Qwen2Model, Qwen2RMSNorm

from .configuration_mimo import MiMoConfig


class MiMoMTPLayers(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.token_layernorm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_layernorm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.input_proj = nn.Linear(config.hidden_size * 2, config.hidden_size, bias=False)
        self.input_layernorm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Qwen2Attention(config, layer_idx=0)
        self.post_attention_layernorm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen2MLP(config)
        self.final_layernorm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class MiMoModel(Qwen2Model):
    config_class = MiMoConfig

    def __init__(self, config: MiMoConfig):
        super().__init__(config)
        self.mtp_layers = nn.ModuleList([MiMoMTPLayers(config) for _ in range(config.num_nextn_predict_layers)])


class MiMoForCausalLM(Qwen2ForCausalLM):
    config_class = MiMoConfig

    def __init__(self, config: MiMoConfig):
        super(Qwen2ForCausalLM, self).__init__(config)
        self.model = MiMoModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
