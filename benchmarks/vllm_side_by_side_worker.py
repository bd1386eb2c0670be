"""The vLLM half of ``benchmarks/vllm_side_by_side.py``: run in the vLLM environment's Python (it
imports nothing of this project), it builds vLLM's offline ``LLM`` once for one speculation depth
and then serves timed generations.

    <vllm python> vllm_side_by_side_worker.py <reply fd>   # requests as JSON lines on stdin

First line on stdin: ``{"model": dir, "num_speculative_tokens": k, "trust_remote_code": bool}``.
Each further line: ``{"prompts": [[ids]], "max_tokens": n, "stop_token_ids": [ids], "ignore_eos":
bool, "sequential": bool}``; the reply (one JSON line on the reply fd, vLLM's own log stays on
stdout): the responses, the seconds of the generate calls alone (perf_counter), and the
speculative-decoding counters the calls added. ``sequential``: each prompt alone, one after the
other (a batch of one).
"""

from __future__ import annotations

import json
import os
import sys
import time


def counters(llm) -> dict:
    """vLLM's speculative-decoding counters so far: drafts and accepted tokens per position."""
    counts = {"num_drafts": 0, "accepted_per_pos": []}
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_drafts":
            counts["num_drafts"] += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            values = [int(v) for v in metric.values]
            previous = counts["accepted_per_pos"] or [0] * len(values)
            counts["accepted_per_pos"] = [a + b for a, b in zip(previous, values)]
    return counts


def main() -> int:
    reply = os.fdopen(int(sys.argv[1]), "w")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: one process, one core
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    setup = json.loads(sys.stdin.readline())
    k = setup["num_speculative_tokens"]
    llm = LLM(
        model=setup["model"],
        trust_remote_code=setup["trust_remote_code"],
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=False,
        seed=0,
        speculative_config={"method": "mtp", "num_speculative_tokens": k} if k else None,
        disable_log_stats=False,
        distributed_executor_backend="uni",
    )
    import torch

    torch.set_num_threads(1)  # one thread, as ours (vLLM's CPU worker sets its own count at start)
    reply.write(json.dumps({"threads": torch.get_num_threads()}) + "\n")
    reply.flush()
    for line in sys.stdin:
        request = json.loads(line)
        params = SamplingParams(
            temperature=0.0, max_tokens=request["max_tokens"], stop_token_ids=request["stop_token_ids"],
            ignore_eos=request["ignore_eos"], detokenize=False,
        )  # fmt: skip
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
        before = counters(llm)
        start = time.perf_counter()
        if request["sequential"]:
            outputs = [llm.generate([prompt], params, use_tqdm=False)[0] for prompt in prompts]
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        after = counters(llm)
        accepted = [a - b for a, b in zip(after["accepted_per_pos"], before["accepted_per_pos"] or [0] * len(after["accepted_per_pos"]))]
        result = {
            "responses": [list(output.outputs[0].token_ids) for output in outputs],
            "seconds": seconds,
            "num_drafts": after["num_drafts"] - before["num_drafts"],
            "accepted_per_pos": accepted,
        }
        reply.write(json.dumps(result) + "\n")
        reply.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
