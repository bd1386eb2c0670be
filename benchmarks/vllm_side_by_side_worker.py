"""The vLLM half of ``benchmarks/vllm_side_by_side.py``: run in the vLLM environment's Python (it
imports nothing of this project), it builds vLLM's offline ``LLM`` once for one speculation depth
and then serves timed generations.

    <vllm python> vllm_side_by_side_worker.py <reply fd>   # requests as JSON lines on stdin

First line on stdin: ``{"model": dir, "num_speculative_tokens": k, "trust_remote_code": bool}``.
Each further line: ``{"prompts": [[ids]], "max_tokens": n, "stop_token_ids": [ids], "ignore_eos":
bool, "sequential": bool, "logprobs": bool}``; the reply (one JSON line on the reply fd, vLLM's
own log stays on stdout): the responses, the seconds of the generate calls alone (perf_counter),
and the speculative-decoding counters the calls added. ``sequential``: each prompt alone, one after the
other (a batch of one). ``logprobs``: each generated token's log-prob is returned too (vLLM's
``logprobs=0``: the sampled token's alone), as an RL rollout needs them.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
import time
from pathlib import Path


@functools.cache
def serve_check_vllm():
    """``examples/serve_check_vllm.py``, loaded from its file (this process has none of the
    project on its path): it reads vLLM's speculative-decoding counters."""
    path = Path(__file__).resolve().parents[1] / "examples" / "serve_check_vllm.py"
    spec = importlib.util.spec_from_file_location("serve_check_vllm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def counters(llm) -> dict:
    """vLLM's speculative-decoding counters so far: drafts and accepted tokens per position."""
    return serve_check_vllm().spec_decode_counts(llm.get_metrics())


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
            ignore_eos=request["ignore_eos"], detokenize=False, logprobs=0 if request["logprobs"] else None,
        )  # fmt: skip
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
        before = counters(llm)
        start = time.perf_counter()
        if request["sequential"]:
            outputs = [llm.generate([prompt], params, use_tqdm=False)[0] for prompt in prompts]
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        if request["logprobs"] and any(output.outputs[0].logprobs is None for output in outputs):
            raise SystemExit("vLLM returned no log-probs where they were asked for")
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
