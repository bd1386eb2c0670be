"""The vLLM half of ``examples/serve_check.py``: run in the vLLM environment's Python (it imports
nothing of this project, whose environment cannot hold vLLM), it reads a request as JSON on
stdin, generates greedily with vLLM's offline ``LLM`` and writes the responses and vLLM's own
speculative-decoding counters to the JSON file the request names (stdout is vLLM's log).

Request: ``{"model": dir, "prompts": [[ids]], "max_tokens": [n], "stop_token_ids": [ids],
"num_speculative_tokens": k, "trust_remote_code": bool, "out": path, "zero_mtp_position_0": bool}``.
``zero_mtp_position_0: false`` replaces vLLM's MTP layer's masking of the token embedding at
position 0 by megatron's convention (no masking), to measure what the difference costs.
"""

from __future__ import annotations

import json
import sys


def spec_decode_counts(metrics) -> dict:
    """vLLM's counters (``LLM.get_metrics()``): drafts, and tokens accepted per draft position
    (position i counts when the drafts before it were accepted, as this project counts)."""
    counts = {"num_drafts": 0, "num_draft_tokens": 0, "accepted_per_pos": []}
    for metric in metrics:
        if metric.name == "vllm:spec_decode_num_drafts":
            counts["num_drafts"] += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_draft_tokens":
            counts["num_draft_tokens"] += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            values = [int(v) for v in metric.values]
            previous = counts["accepted_per_pos"] or [0] * len(values)
            counts["accepted_per_pos"] = [a + b for a, b in zip(previous, values)]
    return counts


BYPASSED = {"calls": 0}


def megatron_position_0_convention() -> None:
    """vLLM's MTP layers for MiMo, DeepSeek-V3 and GLM-4.5 set the token embedding to zero at
    position 0 (``torch.where(positions == 0, 0, inputs_embeds)``); megatron's MTP layer keeps it.
    Here that ``torch.where`` is bypassed in the three modules, so vLLM computes what megatron
    trained. A measurement aid only."""
    import importlib

    class _KeepEmbeddings:
        def __getattr__(self, name):
            import torch

            return getattr(torch, name)

        @staticmethod
        def where(condition, value, other):
            import torch

            if isinstance(value, (int, float)) and value == 0 and condition.dim() == 2 and condition.shape[-1] == 1:
                BYPASSED["calls"] += 1
                return other
            return torch.where(condition, value, other)

    for name in ("mimo_mtp", "deepseek_mtp", "glm4_moe_mtp"):
        module = importlib.import_module(f"vllm.model_executor.models.{name}")
        module.torch = _KeepEmbeddings()


def main() -> int:
    request = json.load(sys.stdin)
    import os

    # Engine and model in this process: the position-0 switch below patches this process's modules,
    # and one process is what a 2-core machine affords anyway.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if not request.get("zero_mtp_position_0", True):
        megatron_position_0_convention()
    k = request["num_speculative_tokens"]
    speculative = {"method": "mtp", "num_speculative_tokens": k} if k else None
    llm = LLM(
        model=request["model"],
        trust_remote_code=request["trust_remote_code"],
        dtype="float32",
        enforce_eager=True,
        seed=0,
        speculative_config=speculative,
        disable_log_stats=False,
        distributed_executor_backend="uni",
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, stop_token_ids=request["stop_token_ids"], detokenize=False)
        for n in request["max_tokens"]
    ]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]], params, use_tqdm=False)
    result = {"responses": [list(output.outputs[0].token_ids) for output in outputs], **spec_decode_counts(llm.get_metrics())}
    result["position_0_bypassed"] = BYPASSED["calls"]
    with open(request["out"], "w") as handle:
        json.dump(result, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
