"""The decode-step cost model (``nemo_rl_mtp/rollout/step_cost_model.py``) against references
worked out here by hand: bytes and FLOPs of a tiny shape, KV and state sizes, experts touched,
host-bound steps, published parameter counts; and its limits: k = 0 is 1, costs grow with batch
and context, a memory-bound step at k costs a little more than at 0, a compute-bound one about
k + 1 times as much."""

from __future__ import annotations

import dataclasses
import types

import pytest

from nemo_rl_mtp.rollout.step_cost_model import (
    ATTENTION,
    EAGER_MEGATRON,
    H100_SXM,
    H200_SXM,
    MAMBA,
    MLP,
    MOE,
    GPUSpec,
    HostOverheads,
    MambaShape,
    MLAShape,
    ModelShape,
    MoEShape,
    chained_acceptance,
    expected_experts_touched,
    expected_speedups,
    fits_in_memory,
    gpu_spec_from_device_name,
    model_shape_from_megatron_config,
    relative_step_costs,
    step_cost,
)

NO_OVERHEADS = HostOverheads("none", {ATTENTION: 0.0, MLP: 0.0, MOE: 0.0, MAMBA: 0.0}, 0.0, 0.0, 0.0, 0.0)
# bandwidth 1 byte/s, FLOPs free: device seconds are bytes
BYTES_ONLY = GPUSpec("bytes", peak_bandwidth_bytes_per_s=1.0, peak_flops_per_s=1e30, interconnect_bytes_per_s=1.0, memory_bytes=1e12, bandwidth_efficiency=1.0, flops_efficiency=1.0)
# FLOPs at 1/s, bytes free: device seconds are FLOPs
FLOPS_ONLY = GPUSpec("flops", peak_bandwidth_bytes_per_s=1e30, peak_flops_per_s=1.0, interconnect_bytes_per_s=1.0, memory_bytes=1e12, bandwidth_efficiency=1.0, flops_efficiency=1.0)

# hidden 8, vocabulary 16, one attention (2 heads of 4, one key-value group) + gated MLP (12)
# layer, an MTP layer of the same kind, bf16.
TINY = ModelShape(
    name="tiny",
    hidden_size=8,
    vocab_size=16,
    decoder_layers=(ATTENTION, MLP),
    mtp_layer=(ATTENTION, MLP),
    num_attention_heads=2,
    num_query_groups=1,
    head_dim=4,
    ffn_hidden_size=12,
)


def _dense(layers: int = 32, vocab: int = 1000) -> ModelShape:
    """A 7B-like dense trunk (hidden 4096, 32 heads, 8 key-value groups, SwiGLU 11008)."""
    return ModelShape(
        name="dense",
        hidden_size=4096,
        vocab_size=vocab,
        decoder_layers=(ATTENTION, MLP) * layers,
        mtp_layer=(ATTENTION, MLP),
        num_attention_heads=32,
        num_query_groups=8,
        head_dim=128,
        ffn_hidden_size=11008,
    )


def test_bytes_of_a_tiny_step_without_drafts_match_the_hand_count():
    """2 requests at 10 tokens, k = 0: embedding 2*8*2 = 32; attention weights (8*(2+2)*4 + 2*4*8)
    * 2 = 384; KV read 2*10*16 = 320 and written 2*16 = 32 (16 bytes per token: 2*1*4*2); MLP
    3*8*12*2 = 576; output layer 16*8*2 = 256; logits written and read 2*16*4*2 = 256."""
    cost = step_cost(TINY, BYTES_ONLY, batch_size=2, context_length=10, num_speculative_tokens=0, overheads=NO_OVERHEADS)
    assert cost.bytes == 32 + 384 + 352 + 576 + 256 + 256 == 1856
    assert cost.seconds == pytest.approx(1856)


def test_bytes_of_a_tiny_step_with_one_draft_match_the_hand_count():
    """k = 1: the trunk over 4 tokens (embedding 64, KV written 4*16 = 64, logits 4*16*4 written,
    read, and read again next to the drafts' = 768) and one MTP pass over 2 tokens (input
    projection 2*8*8*2 = 256, its layer as the trunk's at 2 tokens, output layer and logits)."""
    cost = step_cost(TINY, BYTES_ONLY, batch_size=2, context_length=10, num_speculative_tokens=1, overheads=NO_OVERHEADS)
    trunk = 64 + 384 + (320 + 64) + 576 + 256 + 768
    mtp = 256 + 384 + (320 + 32) + 576 + 256 + 256
    assert cost.bytes == trunk + mtp == 4512


def test_flops_of_a_tiny_step_match_the_hand_count():
    """k = 0, 2 tokens: 2 FLOPs per weight and token (attention 192, MLP 288, output layer 128
    weights) and attention's 4 * heads * head_dim = 32 per token and context token (x 2 x 10)."""
    cost = step_cost(TINY, FLOPS_ONLY, batch_size=2, context_length=10, num_speculative_tokens=0, overheads=NO_OVERHEADS)
    assert cost.flops == 2 * 2 * (192 + 288 + 128) + 2 * 10 * 32 == 3072
    assert cost.seconds == pytest.approx(3072)


def test_kv_and_state_sizes_match_the_hand_count():
    """GQA: 2 x 8 groups x 128 x 2 bytes = 4096 per token and layer. MLA (DeepSeek-V3): the 512
    latent plus the 64 rotary key, 1152 bytes. Mamba (2 heads of 4, state 16, one group, 4 taps):
    SSM 8*16 = 128 plus convolution (8 + 2*16) * 4 = 160 elements, 576 bytes."""
    assert _dense().kv_bytes_per_token_per_layer() == 4096
    mla = dataclasses.replace(_dense(), mla=MLAShape(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128))
    assert mla.kv_bytes_per_token_per_layer() == 1152
    mamba = dataclasses.replace(TINY, decoder_layers=(MAMBA, MLP), mamba=MambaShape(num_heads=2, head_dim=4, state_dim=16, num_groups=1))
    assert mamba.mamba_state_bytes_per_request() == 576
    # one Mamba layer, no attention: the state is the whole per-request cache, whatever the length
    assert mamba.kv_cache_bytes_per_request(10) == mamba.kv_cache_bytes_per_request(10_000) == 576


def test_a_drafting_step_writes_the_mamba_state_once_per_verified_token():
    """k = 2 over one request: the state read once and written 3 times (so a rejection can roll
    back); k = 0: read and written once."""
    mamba = dataclasses.replace(TINY, decoder_layers=(MAMBA,), mtp_layer=(MLP,), mamba=MambaShape(num_heads=2, head_dim=4, state_dim=16, num_groups=1))
    assert step_cost(mamba, BYTES_ONLY, 1, 10, 0, NO_OVERHEADS).bytes_by_part["mamba_state"] == 576 * 2
    assert step_cost(mamba, BYTES_ONLY, 1, 10, 2, NO_OVERHEADS).bytes_by_part["mamba_state"] == 576 * 4


def test_experts_touched():
    """4 experts, 2 per token: one token reads 2; two tokens 4 * (1 - (1/2)^2) = 3; many, all 4."""
    assert expected_experts_touched(4, 2, 1) == pytest.approx(2.0)
    assert expected_experts_touched(4, 2, 2) == pytest.approx(3.0)
    assert expected_experts_touched(4, 2, 10_000) == pytest.approx(4.0)
    assert expected_experts_touched(256, 8, 0) == 0.0


def test_verifying_a_draft_reads_the_extra_experts_its_tokens_route_to():
    """One request, 4 experts of 2 per token (gated MLP 3*8*6 = 144 weights, 288 bytes each):
    the trunk's MoE layer reads 2 experts at k = 0 and 3 at k = 1; the MTP layer's (one token)
    reads 2."""
    moe = dataclasses.replace(TINY, decoder_layers=(MOE,), mtp_layer=(MOE,), moe=MoEShape(num_experts=4, topk=2, expert_ffn_hidden_size=6))
    at = {k: step_cost(moe, BYTES_ONLY, 1, 10, k, NO_OVERHEADS).bytes_by_part["weights"] for k in (0, 1)}
    router, expert, output_layer, input_projection = 8 * 4 * 2, 288, 256, 256
    assert at[0] == router + 2 * expert + output_layer
    assert at[1] == (router + 3 * expert + output_layer) + (input_projection + router + 2 * expert + output_layer)


def test_a_host_bound_step_costs_its_overheads():
    """Device work negligible: k = 0 costs the launches (100 + 50 + 20 us) plus 1 ms per step; k = 2
    adds two MTP passes' launches (2 x 170 us), two draft rounds (2 x 0.2 ms) and a verification
    (0.3 ms): 2.21 ms against 1.17 ms."""
    overheads = HostOverheads("test", {ATTENTION: 100e-6, MLP: 50e-6, MOE: 0.0, MAMBA: 0.0}, 20e-6, 1e-3, 0.2e-3, 0.3e-3)
    fast = dataclasses.replace(H200_SXM, peak_bandwidth_bytes_per_s=1e30, peak_flops_per_s=1e30)
    assert step_cost(TINY, fast, 4, 100, 0, overheads).seconds == pytest.approx(1.17e-3)
    assert step_cost(TINY, fast, 4, 100, 2, overheads).seconds == pytest.approx(2.21e-3)
    assert relative_step_costs(TINY, fast, 4, 100, 2, overheads)[2] == pytest.approx(2.21 / 1.17)


def test_no_drafts_costs_one():
    for gpu in (H100_SXM, H200_SXM):
        assert relative_step_costs(_dense(), gpu, 8, 4096, 3)[0] == 1.0


@pytest.mark.parametrize("overheads", [NO_OVERHEADS, EAGER_MEGATRON])
def test_step_time_grows_with_batch_context_and_drafts(overheads):
    model = _dense(vocab=32000)
    seconds = {
        (batch, context, k): step_cost(model, H100_SXM, batch, context, k, overheads).seconds
        for batch in (1, 8, 64, 256)
        for context in (128, 4096, 32768)
        for k in range(4)
    }
    for (batch, context, k), value in seconds.items():
        for bigger in [(batch * 8, context, k), (batch, context * 8, k), (batch, context, k + 1)]:
            if bigger in seconds:
                assert seconds[bigger] >= value, (bigger, (batch, context, k))
    # without overheads strictly: more tokens, more context, more drafts always read more
    if overheads is NO_OVERHEADS:
        assert seconds[(8, 4096, 1)] > seconds[(1, 4096, 1)] and seconds[(1, 32768, 1)] > seconds[(1, 4096, 1)]


def test_a_memory_bound_step_costs_little_more_with_drafts():
    """One request on a 32-layer 7B trunk, short context, no host overheads: the weights dominate
    and are read once whatever the tokens, so a draft adds about an MTP layer (1/32) per depth."""
    costs = relative_step_costs(_dense(), H100_SXM, 1, 128, 3, NO_OVERHEADS)
    assert 1.0 < costs[1] < 1.05
    assert costs[1] < costs[2] < costs[3] < 1.15


def test_a_compute_bound_step_costs_about_k_plus_one_times_as_much():
    """FLOPs only: the trunk's FLOPs scale with k + 1 tokens per request; the k MTP passes add
    1/32 of a trunk each (one layer of 32, a small vocabulary)."""
    costs = relative_step_costs(_dense(), FLOPS_ONLY, 64, 1024, 3, NO_OVERHEADS)
    for k in (1, 2, 3):
        assert k + 1 <= costs[k] <= (k + 1) + k * 0.05


def test_drafts_pay_less_on_a_faster_memory_and_at_small_batch():
    """Same FLOP/s, more bandwidth (H200): weights read faster, so the extra FLOPs of verifying
    matter sooner at large batch; at batch 1 both are memory-bound and alike."""
    model = _dense(vocab=151680)
    big_h100 = relative_step_costs(model, H100_SXM, 256, 1024, 1, NO_OVERHEADS)[1]
    big_h200 = relative_step_costs(model, H200_SXM, 256, 1024, 1, NO_OVERHEADS)[1]
    small = relative_step_costs(model, H200_SXM, 1, 1024, 1, NO_OVERHEADS)[1]
    assert big_h200 > big_h100 > small


def test_expected_speedups_and_chained_acceptance():
    """Costs 1, 1.1, 1.2 and acceptance 90% then 80%: 1.9/1.1 and 2.7/1.2 the tokens/s of k = 0."""
    assert expected_speedups({0: 1.0, 1: 1.1, 2: 1.2}, [0.9, 0.8]) == pytest.approx({0: 1.0, 1: 1.9 / 1.1, 2: 2.7 / 1.2})
    assert chained_acceptance([0.9, 0.5]) == pytest.approx([0.9, 0.45])
    with pytest.raises(ValueError):
        expected_speedups({0: 1.0, 2: 1.2}, [0.9])


def test_published_parameter_counts():
    """DeepSeek-V3's 671B (its embedding, not modelled, is 129,280 x 7168 = 0.93B of them) and
    MiMo-7B's trunk (7.0B without its 0.62B embedding), from the shapes the benchmark uses."""
    from benchmarks.gpu_cost_model import DEEPSEEK_V3, MIMO_7B

    embedding = 129280 * 7168
    assert DEEPSEEK_V3.weight_bytes() / DEEPSEEK_V3.weight_bytes_per_param + embedding == pytest.approx(671e9, rel=0.01)
    assert MIMO_7B.weight_bytes() / 2 + 151680 * 4096 == pytest.approx(7.6e9, rel=0.02)


def test_memory_fit():
    """A 7B-like trunk in bf16 (11.35 GB: 32 x 177.3M weights and a 1000-row output layer), KV
    of 128 KiB a token (4096 bytes x 32 layers): 16 requests of 4096 tokens (8.6 GB more) fit an H100;
    128 of 8192 tokens (137 GB more, 149 GB in all) fit neither GPU (90% of 80 / 141 GB), two H200
    (74 GB each) do, two H100 do not."""
    model = _dense()
    assert model.weight_bytes() == pytest.approx(11.35e9, rel=0.01)
    assert model.kv_cache_bytes_per_request(1) == 131072
    assert fits_in_memory(model, H100_SXM, 16, 4096)
    assert not fits_in_memory(model, H100_SXM, 128, 8192) and not fits_in_memory(model, H200_SXM, 128, 8192)
    assert fits_in_memory(model, H200_SXM, 128, 8192, tensor_parallel_size=2)
    assert not fits_in_memory(model, H100_SXM, 128, 8192, tensor_parallel_size=2)


def test_shape_from_the_deepseek_v3_style_recipe():
    from nemo_rl_mtp.config.load import load_config
    from benchmarks.gpu_cost_model import RECIPES

    cfg = load_config(RECIPES / "grpo_mtp_deepseek_v3_style_gpu.yaml").policy.megatron_cfg
    shape = model_shape_from_megatron_config(cfg, vocab_size=14)
    assert shape.decoder_layers == (ATTENTION, MOE) * 24 and shape.mtp_layer == (ATTENTION, MOE)
    assert shape.moe == MoEShape(num_experts=16, topk=4, expert_ffn_hidden_size=1408)
    assert (shape.hidden_size, shape.num_query_groups, shape.head_dim, shape.weight_bytes_per_param) == (2048, 4, 128, 2.0)


def test_shape_from_the_hybrid_recipe():
    """6 blocks of MEMEM*E: 18 Mamba, 18 MoE, 6 attention; MTP "*E" repeated 5 times; Mamba heads
    2 x 4096 / 64 = 128 by megatron's defaults."""
    from nemo_rl_mtp.config.load import load_config
    from benchmarks.gpu_cost_model import RECIPES

    cfg = load_config(RECIPES / "grpo_mtp_nemotron3_super_style_hybrid_gpu.yaml").policy.megatron_cfg
    shape = model_shape_from_megatron_config(cfg, vocab_size=14)
    counts = {symbol: shape.decoder_layers.count(symbol) for symbol in (MAMBA, MOE, ATTENTION, MLP)}
    assert counts == {MAMBA: 18, MOE: 18, ATTENTION: 6, MLP: 0}
    assert (shape.mtp_layer, shape.mtp_num_layers, shape.mtp_repeated) == ((ATTENTION, MOE), 5, True)
    assert shape.mamba == MambaShape(num_heads=128, head_dim=64, state_dim=128, num_groups=8)


def test_shape_from_a_transformer_config_like_object():
    """megatron's TransformerConfig names: gated_linear_unit, kv_channels, moe_layer_freq as a
    list (the first layer dense), multi-latent attention, a torch dtype's name."""
    config = types.SimpleNamespace(
        num_layers=3, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=None, kv_channels=32,
        gated_linear_unit=False, num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=[0, 1, 1],
        moe_shared_expert_intermediate_size=64, multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=16,
        qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8, mtp_num_layers=1, params_dtype="torch.float32",
    )
    shape = model_shape_from_megatron_config(config, vocab_size=100)
    assert shape.decoder_layers == (ATTENTION, MLP, ATTENTION, MOE, ATTENTION, MOE)
    assert shape.moe == MoEShape(num_experts=8, topk=2, expert_ffn_hidden_size=32, shared_ffn_hidden_size=64)
    assert shape.mla == MLAShape(q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    assert (shape.num_query_groups, shape.head_dim, shape.gated_mlp, shape.weight_bytes_per_param) == (4, 32, False, 4.0)
    assert shape.kv_bytes_per_token_per_layer() == (16 + 4) * 4.0


def test_refuses_what_it_does_not_model():
    with pytest.raises(ValueError):
        dataclasses.replace(TINY, decoder_layers=(MOE,))  # no MoEShape
    with pytest.raises(ValueError):
        model_shape_from_megatron_config(types.SimpleNamespace(hidden_size=8, num_attention_heads=2, hybrid_layer_pattern="*G"), 16)
    with pytest.raises(ValueError):
        step_cost(TINY, H100_SXM, 0, 10, 1)


def test_tensor_parallelism_splits_the_kv_cache_only_by_its_heads():
    """8 key-value groups split over 2 or 8 GPUs but not 16; an MLA latent (one head) stays whole
    on each GPU, so at TP2 a GPU reads all of it while the weights halve."""
    dense = _dense()
    assert [dense.kv_shards(parallel) for parallel in (1, 2, 8, 16)] == [1, 2, 8, 8]
    mla = dataclasses.replace(dense, mla=MLAShape(q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128))
    assert mla.kv_shards(8) == 1
    one = step_cost(mla, BYTES_ONLY, 4, 1000, 0, NO_OVERHEADS).bytes_by_part
    two = step_cost(mla, BYTES_ONLY, 4, 1000, 0, NO_OVERHEADS, tensor_parallel_size=2).bytes_by_part
    assert two["kv_cache"] == one["kv_cache"] and two["weights"] == pytest.approx(one["weights"] / 2)


def test_gpu_spec_from_the_device_name():
    assert gpu_spec_from_device_name("NVIDIA H100 80GB HBM3") is H100_SXM
    assert gpu_spec_from_device_name("NVIDIA H200") is H200_SXM
    assert gpu_spec_from_device_name("NVIDIA H100 PCIe") is None
    assert gpu_spec_from_device_name("NVIDIA A100-SXM4-80GB") is None
