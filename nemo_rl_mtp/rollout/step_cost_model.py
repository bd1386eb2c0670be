"""A cost model of one speculative decode step on a GPU, on paper: what auto's prior on a GPU can
be before anything is measured, and what speculation should buy for a model's shape.

A decode step at k drafts runs the trunk over k + 1 tokens per request (the token sampled last
step and the k drafts, verified at once), then k MTP passes (one MTP layer and the output layer
over the vocabulary, one token per request each), and yields 1 + sum_{i <= k} rho_i tokens per
request (rho_i: draft i accepted with every draft before it). Its time is modelled as

    seconds = max(device_s, launch_s) + serial_s

- ``device_s``: the sum over the step's kernels of a roofline, max(bytes / bandwidth, FLOPs /
  FLOP rate), at a fraction of the GPU's peaks (``GPUSpec``). Bytes are what a decode step reads
  and writes: the weights once per pass (for a mixture of experts only the experts the pass's
  tokens are routed to, expected under uniform routing), each request's KV cache at the context
  length per attention layer (multi-latent attention's compressed latent where the model uses
  it), a Mamba layer's state per request (read once, written once per verified token so a
  rejection can roll back), the logits over the vocabulary; FLOPs are 2 per weight per token plus
  attention over the context. With tensor parallelism both split over the GPUs (the KV cache
  only as far as its key-value heads go: an MLA latent is whole on every GPU) and each layer adds
  an all-reduce of its output.
- ``launch_s``: the host's time issuing the step's kernels (``HostOverheads``): without CUDA graphs
  (this project's engine: ``cuda_graph_modules=[]``) it is tens of microseconds per kernel of
  Python and dispatch, a few hundred per layer, and it overlaps the device's work (launches are
  asynchronous), so a small batch waits on the host rather than on memory.
- ``serial_s``: the host's work the device waits for each step: the engine's scheduling and
  bookkeeping, each draft round's, verification's.

Why a step at k costs little more than a step at 0 on a GPU at small batch: the weights are read
once whatever the number of tokens, so up to the point where the FLOPs catch up with the bytes
(hundreds of tokens per step on an H100 for a dense model) verifying k + 1 tokens costs what
verifying one does; the k MTP passes add k layers and k output layers, and for a mixture of
experts the extra tokens touch extra experts, so MoE trunks gain least at small batch. At large
batch the FLOPs dominate and a step at k approaches k + 1 times a step at 0.

Pure Python: no torch or megatron import. Units are in the names (``_s`` seconds, ``_bytes``,
``_flops``, ``_per_s``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Optional

# Symbols of a layer, as megatron's hybrid_layer_pattern spells them.
ATTENTION, MLP, MOE, MAMBA = "*", "-", "E", "M"
LAYER_SYMBOLS = (ATTENTION, MLP, MOE, MAMBA)


@dataclasses.dataclass(frozen=True)
class GPUSpec:
    """One GPU's peaks and the fraction of them decode kernels reach.

    ``peak_bandwidth_bytes_per_s``: HBM bandwidth; ``peak_flops_per_s``: dense bf16 tensor-core
    FLOP/s (no sparsity); ``interconnect_bytes_per_s``: NVLink bandwidth per direction, for
    tensor-parallel all-reduces; ``collective_latency_s``: one small all-reduce's latency;
    ``memory_bytes``: HBM capacity (to tell which batch and context fit). The
    efficiencies are what well-tuned decode kernels reach: 80% of peak bandwidth for GEMV-like weight
    and KV reads, 65% of peak FLOP/s for the large GEMMs of a big batch.
    """

    name: str
    peak_bandwidth_bytes_per_s: float
    peak_flops_per_s: float
    interconnect_bytes_per_s: float
    memory_bytes: float
    collective_latency_s: float = 10e-6
    bandwidth_efficiency: float = 0.8
    flops_efficiency: float = 0.65

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.peak_bandwidth_bytes_per_s * self.bandwidth_efficiency

    @property
    def flops_per_s(self) -> float:
        return self.peak_flops_per_s * self.flops_efficiency


# NVIDIA's datasheets: H100 SXM5 80 GB (HBM3 3.35 TB/s, 989 dense bf16 TFLOP/s, NVLink 4 900 GB/s
# both directions together) and H200 SXM 141 GB (HBM3e 4.8 TB/s, same compute and NVLink).
H100_SXM = GPUSpec("H100 SXM", peak_bandwidth_bytes_per_s=3.35e12, peak_flops_per_s=989e12, interconnect_bytes_per_s=450e9, memory_bytes=80e9)
H200_SXM = GPUSpec("H200 SXM", peak_bandwidth_bytes_per_s=4.8e12, peak_flops_per_s=989e12, interconnect_bytes_per_s=450e9, memory_bytes=141e9)
GPUS = {gpu.name: gpu for gpu in (H100_SXM, H200_SXM)}


def gpu_spec_from_device_name(device_name: str) -> Optional[GPUSpec]:
    """The spec for a CUDA device's name as ``torch.cuda.get_device_name()`` gives it ("NVIDIA
    H100 80GB HBM3", "NVIDIA H200"); None for a GPU this module has no figures for (then only
    measurements can tell the cost). An H100 PCIe or NVL is not the SXM part: None too."""
    name = device_name.upper()
    if "H200" in name:
        return H200_SXM
    if "H100" in name and "PCIE" not in name and "NVL" not in name:
        return H100_SXM
    return None


@dataclasses.dataclass(frozen=True)
class HostOverheads:
    """What the host spends per step, in seconds (module docstring: launches overlap the device,
    serial work does not).

    ``launch_s_per_layer``: issuing one layer's kernels, per layer symbol (attention, MLP,
    mixture of experts, Mamba); ``launch_s_per_output_layer``: the final norm, output layer and
    sampling of one pass (for an MTP pass, its input norms and projection too); ``serial_s_per_step``: the engine's scheduling, bookkeeping and the
    synchronisation that ends a step; ``serial_s_per_draft_round``: one MTP depth's bookkeeping
    (positions, cache slots, the drafted token handed on); ``serial_s_per_verification``:
    verifying the drafts and rewinding the KV cache, once per step that drafts.
    """

    name: str
    launch_s_per_layer: Mapping[str, float]
    launch_s_per_output_layer: float
    serial_s_per_step: float
    serial_s_per_draft_round: float
    serial_s_per_verification: float


# This project's engine: megatron-core's dynamic engine in eager mode (no CUDA graphs). Assumed,
# not measured on a GPU here: PyTorch eager costs about 10 us of Python and dispatch per kernel
# launched; an attention layer launches about 15 (norm, QKV, rotary, KV append, attention, output
# projection, residual) with megatron's module overhead, a dense MLP about 6, a routed MoE about
# 20 (router, top-k, permute, grouped GEMMs, unpermute), a Mamba mixer about 12. Eager vLLM on an
# 8B model runs about twice as slow per token at batch 1 as with CUDA graphs, i.e. a few hundred
# microseconds per layer of host time, which is what these add up to. The per-step serial work is
# megatron's Python scheduling and bookkeeping (about 1.5 ms); a draft round's is this project's
# incremental-draft bookkeeping; verification is rejection sampling plus the rewind.
EAGER_MEGATRON = HostOverheads(
    "eager (this project's engine)",
    launch_s_per_layer={ATTENTION: 150e-6, MLP: 60e-6, MOE: 200e-6, MAMBA: 120e-6},
    launch_s_per_output_layer=150e-6,
    serial_s_per_step=1.5e-3,
    serial_s_per_draft_round=0.3e-3,
    serial_s_per_verification=0.5e-3,
)
# Engines that capture the decode step in CUDA graphs (vLLM, SGLang, Megatron-LM's engine with
# graphs on), where the published figures were measured: a few microseconds per layer of graph
# replay gaps, a few hundred microseconds of scheduler per step (SGLang overlaps much of it).
CUDA_GRAPHS = HostOverheads(
    "CUDA graphs (vLLM/SGLang-like)",
    launch_s_per_layer={ATTENTION: 4e-6, MLP: 2e-6, MOE: 6e-6, MAMBA: 4e-6},
    launch_s_per_output_layer=5e-6,
    serial_s_per_step=0.4e-3,
    serial_s_per_draft_round=0.05e-3,
    serial_s_per_verification=0.1e-3,
)


@dataclasses.dataclass(frozen=True)
class MLAShape:
    """Multi-latent attention (DeepSeek-V2/V3): queries through a rank ``q_lora_rank`` bottleneck
    (0: a plain projection), keys and values cached as one latent of ``kv_lora_rank`` plus a
    shared rotary key of ``qk_rope_head_dim`` per token, decoded with the up-projections absorbed
    (attention runs in the latent space)."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """Routed experts: ``num_experts`` gated MLPs of hidden ``expert_ffn_hidden_size``, each token
    routed to ``topk``; ``shared_ffn_hidden_size`` the always-on shared expert (0: none)."""

    num_experts: int
    topk: int
    expert_ffn_hidden_size: int
    shared_ffn_hidden_size: int = 0


@dataclasses.dataclass(frozen=True)
class MambaShape:
    """A Mamba-2 mixer as megatron builds it: ``num_heads`` heads of ``head_dim`` (d_inner =
    num_heads * head_dim), SSM state ``state_dim`` per head channel, ``num_groups`` B/C groups, a
    causal convolution of ``conv_kernel`` taps."""

    num_heads: int
    head_dim: int
    state_dim: int
    num_groups: int
    conv_kernel: int = 4

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.num_groups * self.state_dim


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the cost of a decode step depends on.

    ``decoder_layers``: one symbol per decoder sublayer (``*`` attention, ``-`` MLP, ``E`` mixture
    of experts, ``M`` Mamba: a GPT layer is ``*-`` or ``*E``); ``mtp_layer``: the symbols of one
    MTP layer (it also has its input projection from 2 x hidden to hidden); ``mtp_num_layers``
    and ``mtp_repeated``: how many distinct MTP layers (a repeated one drafts any k).
    ``weight_bytes_per_param`` (2 for bf16, 1 for fp8), ``kv_bytes_per_element`` and
    ``state_bytes_per_element``: storage sizes; ``logit_bytes_per_element``: the logits the
    sampler writes and reads (fp32).
    """

    name: str
    hidden_size: int
    vocab_size: int
    decoder_layers: tuple[str, ...]
    mtp_layer: tuple[str, ...]
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    gated_mlp: bool = True
    mtp_num_layers: int = 1
    mtp_repeated: bool = False
    moe: Optional[MoEShape] = None
    mla: Optional[MLAShape] = None
    mamba: Optional[MambaShape] = None
    weight_bytes_per_param: float = 2.0
    kv_bytes_per_element: float = 2.0
    state_bytes_per_element: float = 2.0
    logit_bytes_per_element: float = 4.0

    def __post_init__(self) -> None:
        for symbol in (*self.decoder_layers, *self.mtp_layer):
            if symbol not in LAYER_SYMBOLS:
                raise ValueError(f"{self.name}: layer symbol {symbol!r} is not one of {LAYER_SYMBOLS}")
        if MOE in (*self.decoder_layers, *self.mtp_layer) and self.moe is None:
            raise ValueError(f"{self.name}: mixture-of-experts layers need a MoEShape")
        if MAMBA in (*self.decoder_layers, *self.mtp_layer) and self.mamba is None:
            raise ValueError(f"{self.name}: Mamba layers need a MambaShape")

    # --- parameters per sublayer ---------------------------------------------------------------

    def attention_params(self) -> int:
        """Weights of one attention sublayer (projections; norms are negligible)."""
        h = self.hidden_size
        if self.mla is not None:
            m, n = self.mla, self.num_attention_heads
            q_head = m.qk_nope_head_dim + m.qk_rope_head_dim
            q = h * m.q_lora_rank + m.q_lora_rank * n * q_head if m.q_lora_rank else h * n * q_head
            kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * n * (m.qk_nope_head_dim + m.v_head_dim)
            return q + kv + n * m.v_head_dim * h
        qkv = h * (self.num_attention_heads + 2 * self.num_query_groups) * self.head_dim
        return qkv + self.num_attention_heads * self.head_dim * h

    def mlp_params(self, ffn_hidden_size: int) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden_size * ffn_hidden_size

    def mamba_params(self) -> int:
        m, h = self.mamba, self.hidden_size
        in_proj = h * (2 * m.d_inner + 2 * m.num_groups * m.state_dim + m.num_heads)
        return in_proj + m.conv_dim * m.conv_kernel + m.d_inner * h

    def output_layer_params(self) -> int:
        return self.vocab_size * self.hidden_size

    # --- per-request caches ----------------------------------------------------------------------

    def kv_bytes_per_token_per_layer(self) -> float:
        """One token's keys and values in one attention layer: 2 x key-value heads x head_dim for
        grouped-query attention, the latent plus the rotary key for multi-latent attention."""
        if self.mla is not None:
            return (self.mla.kv_lora_rank + self.mla.qk_rope_head_dim) * self.kv_bytes_per_element
        return 2 * self.num_query_groups * self.head_dim * self.kv_bytes_per_element

    def attention_flops_per_query_per_context_token(self) -> float:
        """Scores and weighted values: 2 FLOPs per multiply-add, per head. MLA decodes in the
        latent space (up-projections absorbed into the query and output)."""
        if self.mla is not None:
            m = self.mla
            return 2 * self.num_attention_heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim)
        return 4 * self.num_attention_heads * self.head_dim

    def kv_shards(self, tensor_parallel_size: int) -> int:
        """Over how many of the tensor-parallel GPUs the KV cache splits: its key-value heads
        split, a head is not; multi-latent attention's latent is one head that every GPU's query
        heads read, so each GPU holds all of it (an engine with data-parallel attention splits
        requests instead, which this model does not describe)."""
        heads = 1 if self.mla is not None else self.num_query_groups
        return max(1, min(tensor_parallel_size, heads))

    def mamba_state_bytes_per_request(self) -> float:
        """One request's state in one Mamba layer: the SSM state (d_inner x state_dim) and the
        convolution's window (conv_dim x conv_kernel)."""
        m = self.mamba
        return (m.d_inner * m.state_dim + m.conv_dim * m.conv_kernel) * self.state_bytes_per_element

    def kv_cache_bytes_per_request(self, context_length: int) -> float:
        """The trunk's KV cache (and Mamba state) of one request at ``context_length`` tokens."""
        attention_layers = self.decoder_layers.count(ATTENTION)
        mamba_layers = self.decoder_layers.count(MAMBA)
        total = attention_layers * context_length * self.kv_bytes_per_token_per_layer()
        return total + (mamba_layers * self.mamba_state_bytes_per_request() if mamba_layers else 0.0)

    def weight_bytes(self) -> float:
        """All the trunk's weights (every expert), without the MTP layers and the embedding."""
        params = sum(self._sublayer_params(symbol, all_experts=True) for symbol in self.decoder_layers)
        return (params + self.output_layer_params()) * self.weight_bytes_per_param

    def _sublayer_params(self, symbol: str, all_experts: bool = False) -> float:
        if symbol == ATTENTION:
            return self.attention_params()
        if symbol == MLP:
            return self.mlp_params(self.ffn_hidden_size)
        if symbol == MAMBA:
            return self.mamba_params()
        moe = self.moe
        experts = moe.num_experts if all_experts else moe.topk
        return self.hidden_size * moe.num_experts + experts * self.mlp_params(moe.expert_ffn_hidden_size) + self.mlp_params(moe.shared_ffn_hidden_size)


def fits_in_memory(model: ModelShape, gpu: GPUSpec, batch_size: int, context_length: int, tensor_parallel_size: int = 1) -> bool:
    """Whether the trunk's weights and ``batch_size`` requests' caches at ``context_length``
    tokens fit in the GPUs' memory (90% of it: activations and the allocator need the rest)."""
    attention_layers = model.decoder_layers.count(ATTENTION)
    kv = batch_size * attention_layers * context_length * model.kv_bytes_per_token_per_layer() / model.kv_shards(tensor_parallel_size)
    rest = model.weight_bytes() + batch_size * (model.kv_cache_bytes_per_request(context_length) - attention_layers * context_length * model.kv_bytes_per_token_per_layer())
    return kv + rest / tensor_parallel_size <= 0.9 * gpu.memory_bytes


def expected_experts_touched(num_experts: int, topk: int, num_tokens: int) -> float:
    """Distinct experts a layer reads for ``num_tokens`` tokens each routed to ``topk`` of
    ``num_experts``, routing uniform and independent across tokens: E (1 - (1 - topk/E)^T).
    Tokens of one request route alike more often than chance, so for a single request's k + 1
    tokens this overstates what speculation adds."""
    if num_tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - topk / num_experts) ** num_tokens)


@dataclasses.dataclass
class StepCost:
    """One decode step's work on one GPU and its modelled time, in bytes, FLOPs and seconds."""

    num_speculative_tokens: int
    bytes: float = 0.0
    flops: float = 0.0
    device_s: float = 0.0
    launch_s: float = 0.0
    serial_s: float = 0.0
    bytes_by_part: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return max(self.device_s, self.launch_s) + self.serial_s

    def add(self, part: str, bytes_: float, flops: float, gpu: GPUSpec) -> None:
        """One kernel (or group of kernels over the same data) at its roofline."""
        self.bytes += bytes_
        self.flops += flops
        self.bytes_by_part[part] = self.bytes_by_part.get(part, 0.0) + bytes_
        self.device_s += max(bytes_ / gpu.bandwidth_bytes_per_s, flops / gpu.flops_per_s)


def _sublayer(
    cost: StepCost,
    model: ModelShape,
    gpu: GPUSpec,
    symbol: str,
    num_requests: int,
    tokens_per_request: int,
    context_length: int,
    parallel: int,
    state_writes_per_request: int,
) -> None:
    """Bytes and FLOPs of one sublayer over ``num_requests`` x ``tokens_per_request`` tokens at
    ``context_length``, split over ``parallel`` tensor-parallel GPUs, plus its all-reduce."""
    tokens = num_requests * tokens_per_request
    wb = model.weight_bytes_per_param
    if symbol == MOE:
        moe = model.moe
        touched = expected_experts_touched(moe.num_experts, moe.topk, tokens)
        expert = model.mlp_params(moe.expert_ffn_hidden_size)
        dense = model.hidden_size * moe.num_experts + model.mlp_params(moe.shared_ffn_hidden_size)
        cost.add("weights", (touched * expert + dense) * wb / parallel, 2.0 * tokens * (moe.topk * expert + dense) / parallel, gpu)
    else:
        params = model._sublayer_params(symbol)
        cost.add("weights", params * wb / parallel, 2.0 * tokens * params / parallel, gpu)
    if symbol == ATTENTION:
        kv_read = num_requests * context_length * model.kv_bytes_per_token_per_layer()
        kv_write = tokens * model.kv_bytes_per_token_per_layer()
        flops = tokens * context_length * model.attention_flops_per_query_per_context_token()
        cost.add("kv_cache", (kv_read + kv_write) / model.kv_shards(parallel), flops / parallel, gpu)
    if symbol == MAMBA:
        m = model.mamba
        state = model.mamba_state_bytes_per_request()
        scan_flops = 6.0 * tokens * m.d_inner * m.state_dim
        cost.add("mamba_state", num_requests * state * (1 + state_writes_per_request) / parallel, scan_flops / parallel, gpu)
    if parallel > 1:  # one all-reduce of the sublayer's output (bf16 activations)
        message = tokens * model.hidden_size * 2.0
        cost.device_s += gpu.collective_latency_s + 2.0 * (parallel - 1) / parallel * message / gpu.interconnect_bytes_per_s


def _output_layer(cost: StepCost, model: ModelShape, gpu: GPUSpec, tokens: int, parallel: int, extra_logit_reads: int = 0) -> None:
    """The output layer over the vocabulary for ``tokens`` tokens, and the logits the sampler
    writes and reads (vocabulary-parallel over the tensor-parallel GPUs)."""
    params = model.output_layer_params()
    cost.add("weights", params * model.weight_bytes_per_param / parallel, 2.0 * tokens * params / parallel, gpu)
    logits = tokens * model.vocab_size * model.logit_bytes_per_element
    cost.add("logits", logits * (2 + extra_logit_reads) / parallel, 0.0, gpu)


def step_cost(
    model: ModelShape,
    gpu: GPUSpec,
    batch_size: int,
    context_length: int,
    num_speculative_tokens: int,
    overheads: HostOverheads = EAGER_MEGATRON,
    tensor_parallel_size: int = 1,
) -> StepCost:
    """One decode step at ``num_speculative_tokens`` (k) drafts for ``batch_size`` requests whose
    caches hold ``context_length`` tokens, on one of ``tensor_parallel_size`` GPUs that share the
    model: the trunk over k + 1 tokens per request, then k MTP passes of one token per request
    (module docstring for what each term counts)."""
    if batch_size < 1 or context_length < 0 or num_speculative_tokens < 0 or tensor_parallel_size < 1:
        raise ValueError("batch_size and tensor_parallel_size must be >= 1, context_length and k >= 0")
    k, parallel = num_speculative_tokens, tensor_parallel_size
    cost = StepCost(k)
    tokens_per_request = k + 1
    # a drafting step writes a Mamba state per verified token, so that a rejection can roll back
    state_writes = tokens_per_request if k else 1
    cost.add("embedding", batch_size * tokens_per_request * model.hidden_size * model.weight_bytes_per_param, 0.0, gpu)
    for symbol in model.decoder_layers:
        _sublayer(cost, model, gpu, symbol, batch_size, tokens_per_request, context_length, parallel, state_writes)
    # verification reads the k drafts' distributions next to the policy's
    _output_layer(cost, model, gpu, batch_size * tokens_per_request, parallel, extra_logit_reads=1 if k else 0)
    for _ in range(k):
        input_projection = 2 * model.hidden_size * model.hidden_size
        cost.add("weights", input_projection * model.weight_bytes_per_param / parallel, 2.0 * batch_size * input_projection / parallel, gpu)
        for symbol in model.mtp_layer:
            _sublayer(cost, model, gpu, symbol, batch_size, 1, context_length, parallel, 1)
        _output_layer(cost, model, gpu, batch_size, parallel)
    launch = overheads.launch_s_per_layer
    cost.launch_s = sum(launch[symbol] for symbol in model.decoder_layers) + overheads.launch_s_per_output_layer
    cost.launch_s += k * (sum(launch[symbol] for symbol in model.mtp_layer) + overheads.launch_s_per_output_layer)
    cost.serial_s = overheads.serial_s_per_step + k * overheads.serial_s_per_draft_round + (overheads.serial_s_per_verification if k else 0.0)
    return cost


def relative_step_costs(
    model: ModelShape,
    gpu: GPUSpec,
    batch_size: int,
    context_length: int,
    max_k: int,
    overheads: HostOverheads = EAGER_MEGATRON,
    tensor_parallel_size: int = 1,
) -> dict[int, float]:
    """c_k / c_0 for k = 0 .. ``max_k``: what a decode step at k drafts costs relative to one
    without speculation, for ``batch_size`` requests at ``context_length`` tokens each on ``gpu``
    (``step_cost``). Auto's prior on a GPU: with acceptance rho_i, the expected tokens/s at k
    relative to k = 0 is (1 + sum_{i <= k} rho_i) / (c_k / c_0) (``expected_speedups``)."""
    base = step_cost(model, gpu, batch_size, context_length, 0, overheads, tensor_parallel_size).seconds
    return {
        k: step_cost(model, gpu, batch_size, context_length, k, overheads, tensor_parallel_size).seconds / base
        for k in range(max_k + 1)
    }


def expected_speedups(relative_costs: Mapping[int, float], chained_acceptance: Iterable[float]) -> dict[int, float]:
    """Tokens/s at each k relative to k = 0: (1 + sum_{i <= k} rho_i) / (c_k / c_0), rho_i the
    chained acceptance of draft i (a fraction in [0, 1])."""
    rates = list(chained_acceptance)
    speedups = {}
    for k, relative in relative_costs.items():
        if k > len(rates):
            raise ValueError(f"k = {k} needs {k} acceptance rates, got {len(rates)}")
        speedups[k] = (1.0 + sum(rates[:k])) / relative
    return speedups


def chained_acceptance(per_depth: Iterable[float]) -> list[float]:
    """rho_i = prod_{d <= i} a_d from per-depth conditional acceptance a_d."""
    rates, running = [], 1.0
    for rate in per_depth:
        running *= rate
        rates.append(running)
    return rates


# --- building a shape from a config ----------------------------------------------------------------

_DTYPE_BYTES = {"bfloat16": 2.0, "float16": 2.0, "float32": 4.0, "fp8": 1.0}


def _get(config: Any, name: str, default: Any = None) -> Any:
    """An attribute of a megatron TransformerConfig, this project's ``MegatronConfig`` (a dataclass
    or an OmegaConf node) or a mapping; missing or None gives ``default``."""
    if isinstance(config, Mapping):
        value = config.get(name, default)
    else:
        try:
            value = getattr(config, name)
        except Exception:  # OmegaConf raises its own AttributeError subclass or a KeyError
            value = default
    return default if value is None else value


def _parse_hybrid_pattern(pattern: str) -> tuple[tuple[str, ...], tuple[str, ...], int]:
    """``hybrid_layer_pattern`` as (decoder symbols, one MTP layer's symbols, MTP layers); ``|``
    (pipeline boundaries) dropped, ``G`` (GatedDeltaNet) refused (not modelled)."""
    parts = pattern.replace("|", "").split("/")
    decoder, mtp = tuple(parts[0]), [tuple(part) for part in parts[1:] if part]
    for symbol in (*decoder, *(s for layer in mtp for s in layer)):
        if symbol not in LAYER_SYMBOLS:
            raise ValueError(f"hybrid layer symbol {symbol!r} is not modelled (only {LAYER_SYMBOLS})")
    return decoder, (mtp[0] if mtp else ()), len(mtp)


def _moe_layers(frequency: Any, num_layers: int) -> list[bool]:
    """Which decoder layers are MoE under megatron's ``moe_layer_freq``: every n-th layer for an
    int n (layer 0 included), or a 0/1 list per layer (DeepSeek-V3's first three dense)."""
    if isinstance(frequency, int):
        return [index % frequency == 0 for index in range(num_layers)]
    flags = [bool(flag) for flag in frequency]
    if len(flags) != num_layers:
        raise ValueError(f"moe_layer_freq lists {len(flags)} layers, the model has {num_layers}")
    return flags


def model_shape_from_megatron_config(config: Any, vocab_size: int, name: str = "model") -> ModelShape:
    """The shape of the model a megatron config builds: ``config`` is a megatron-core
    ``TransformerConfig`` (the live model's ``model.config``: the only complete source for a model
    imported from Hugging Face), or this project's ``policy.megatron_cfg`` (a model built from
    scratch). ``vocab_size``: the output layer's rows (megatron's padded vocabulary where known).

    Reads num_layers, hidden_size, ffn_hidden_size, num_attention_heads, num_query_groups,
    kv_channels, the gated-unit setting (``gated_linear_unit`` or ``activation: swiglu``),
    num_moe_experts / moe_router_topk / moe_ffn_hidden_size / moe_shared_expert_intermediate_size,
    moe_layer_freq, multi_latent_attention with q_lora_rank / kv_lora_rank / qk_head_dim / qk_pos_emb_head_dim /
    v_head_dim, hybrid_layer_pattern with the mamba_* sizes, mtp_num_layers and
    mtp_use_repeated_layer, params_dtype. A GPT's MTP layer is one of its decoder layers (an MoE
    trunk's MTP layer is MoE too, as megatron builds it)."""
    hidden = int(_get(config, "hidden_size"))
    heads = int(_get(config, "num_attention_heads"))
    groups = int(_get(config, "num_query_groups", heads))
    head_dim = int(_get(config, "kv_channels", hidden // heads))
    gated = bool(_get(config, "gated_linear_unit", str(_get(config, "activation", "swiglu")).lower() == "swiglu"))
    experts = int(_get(config, "num_moe_experts", 0))
    moe = None
    if experts:
        moe = MoEShape(
            num_experts=experts,
            topk=int(_get(config, "moe_router_topk", 2)),
            expert_ffn_hidden_size=int(_get(config, "moe_ffn_hidden_size", _get(config, "ffn_hidden_size"))),
            shared_ffn_hidden_size=int(_get(config, "moe_shared_expert_intermediate_size", 0)),
        )
    mla = None
    if _get(config, "multi_latent_attention", False):
        mla = MLAShape(
            q_lora_rank=int(_get(config, "q_lora_rank", 0)),
            kv_lora_rank=int(_get(config, "kv_lora_rank")),
            qk_nope_head_dim=int(_get(config, "qk_head_dim")),
            qk_rope_head_dim=int(_get(config, "qk_pos_emb_head_dim")),
            v_head_dim=int(_get(config, "v_head_dim")),
        )
    mtp_layers = int(_get(config, "mtp_num_layers", 0))
    pattern = _get(config, "hybrid_layer_pattern", None)
    if pattern:
        decoder, mtp_layer, pattern_mtp_layers = _parse_hybrid_pattern(str(pattern))
        mtp_layers = mtp_layers or pattern_mtp_layers
    else:
        num_layers = int(_get(config, "num_layers"))
        moe_layers = _moe_layers(_get(config, "moe_layer_freq", 1), num_layers) if experts else [False] * num_layers
        decoder = tuple(symbol for is_moe in moe_layers for symbol in (ATTENTION, MOE if is_moe else MLP))
        mtp_layer = (ATTENTION, MOE if experts else MLP) if mtp_layers else ()
    mamba = None
    if MAMBA in decoder or MAMBA in mtp_layer:
        head = int(_get(config, "mamba_head_dim", 64))
        mamba = MambaShape(
            num_heads=int(_get(config, "mamba_num_heads", 2 * hidden // head)),
            head_dim=head,
            state_dim=int(_get(config, "mamba_state_dim", 128)),
            num_groups=int(_get(config, "mamba_num_groups", 8)),
        )
    dtype = str(_get(config, "params_dtype", "bfloat16")).replace("torch.", "")
    element_bytes = _DTYPE_BYTES.get(dtype, 2.0)
    return ModelShape(
        name=name,
        hidden_size=hidden,
        vocab_size=int(vocab_size),
        decoder_layers=decoder,
        mtp_layer=mtp_layer,
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=head_dim,
        ffn_hidden_size=int(_get(config, "ffn_hidden_size", 4 * hidden)),
        gated_mlp=gated,
        mtp_num_layers=mtp_layers,
        mtp_repeated=bool(_get(config, "mtp_use_repeated_layer", False)),
        moe=moe,
        mla=mla,
        mamba=mamba,
        weight_bytes_per_param=element_bytes,
        kv_bytes_per_element=element_bytes,
        state_bytes_per_element=element_bytes,
    )
