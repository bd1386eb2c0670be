"""An independent Hugging Face-side reference for checkpoints in MiMo's layout: the trunk is
transformers' own Qwen2 (loaded with the checkpoint's remote code), and the MTP heads are computed
here from the architecture's definition, not by megatron-bridge or megatron-core.

MiMo's MTP layer d (1-based) at position t combines the previous depth's output h_{d-1}[t] (the
trunk's final, normed hidden state for d = 1) with the embedding of token t + d:
``input_proj(cat(hidden_layernorm(h), token_layernorm(e)))``, then a Qwen2 decoder block attending
causally over the sequence with rotary embedding at the true positions, then ``final_layernorm``;
``lm_head`` gives its logits, a prediction of token t + d + 1.

``zero_position_0``: the embedding e is set to zero at position 0 before its norm, at every depth,
as vLLM's and SGLang's MiMo MTP drafters compute it (``inputs_embeds[positions == 0] = 0``).
"""

from __future__ import annotations

from pathlib import Path

import torch


def load_hf_model(checkpoint: Path):
    """The checkpoint through transformers (remote code), with what loading reported."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True, dtype=torch.float32, output_loading_info=True)
    return model.eval(), info


@torch.no_grad()
def hf_logits(model, input_ids: torch.Tensor, *, zero_position_0: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The trunk's logits ``[B, S, V]`` and each MTP depth's ``[B, S, V]`` (positions whose token
    t + d is past the sequence see token id 0, as megatron's roll fills them); the MTP token
    embedding zeroed at position 0 with ``zero_position_0``."""
    trunk = model.model
    hidden = trunk(input_ids).last_hidden_state
    logits = model.lm_head(hidden)
    batch, length = input_ids.shape
    positions = torch.arange(length)[None].expand(batch, length)
    rotary = trunk.rotary_emb(hidden, positions)
    causal = torch.full((length, length), float("-inf")).triu(1)[None, None]
    depth_logits = []
    for depth, layer in enumerate(trunk.mtp_layers, start=1):
        shifted = torch.zeros_like(input_ids)
        shifted[:, : length - depth] = input_ids[:, depth:]
        embedded = trunk.embed_tokens(shifted)
        if zero_position_0:
            embedded[:, 0] = 0.0
        embedded = layer.token_layernorm(embedded)
        hidden = layer.input_proj(torch.cat([layer.hidden_layernorm(hidden), embedded], dim=-1))
        attended, _ = layer.self_attn(layer.input_layernorm(hidden), position_embeddings=rotary, attention_mask=causal)
        hidden = hidden + attended
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = layer.final_layernorm(hidden)
        depth_logits.append(model.lm_head(hidden))
    return logits, depth_logits


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_id: int) -> list[int]:
    """The prompt and transformers' greedy continuation, up to and including end-of-sequence."""
    output = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_id, pad_token_id=eos_id)
    return output[0].tolist()
