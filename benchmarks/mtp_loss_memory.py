"""Peak memory and time of one MTP depth's loss at a 150k vocabulary, each loss type (and the
acceptance forecast) against megatron's cross entropy alone, measured side by side in one run.

Each variant runs in a fresh process on the same inputs: the policy's logits [T, V] (the forward's,
held anyway) and the head's hidden states [T, H]; the variant computes the head's logits with the
output layer, its loss (and forecast), and the backward into the hidden states and the output
weight. Peak memory is the process's peak resident memory above what it held after building the
inputs (the kernel's peak-resident mark, reset once the inputs exist), also given in units of
one float32 [T, V] tensor.

    uv run python -m benchmarks.mtp_loss_memory [--tokens 4096] [--vocab 150000] [--dtype bfloat16] [--threads 1]

Memory scales with tokens x vocabulary; at 8k tokens every figure doubles (the default stays at 4096
so that the slowest variant fits beside other jobs on a 24 GB machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

VARIANTS = {
    "cross_entropy": "megatron's vocab-parallel cross entropy alone",
    "cross_entropy_forecast_before": "+ the forecast as it was: copies at the targets, whole-tensor float softmaxes",
    "cross_entropy_forecast": "+ the forecast: copies at the targets, chunked overlap",
    "soft_cross_entropy": "soft cross entropy to the policy, forecast fused",
    "total_variation": "total variation to the policy, forecast fused",
}


def _status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS: resident now, VmHWM: its peak) in bytes."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    """Reset the kernel's peak-resident mark (VmHWM) to what is resident now."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def _inputs(tokens: int, vocab: int, hidden: int, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(0)
    policy_logits = torch.empty(tokens, vocab, dtype=dtype)
    for start in range(0, tokens, 256):  # filled in slices: no float32 [T, V] temporary
        policy_logits[start : start + 256] = torch.randn(min(256, tokens - start), vocab, generator=generator) * 3
    hidden_states = torch.randn(tokens, 1, hidden, generator=generator).to(dtype).requires_grad_(True)
    weight = (torch.randn(vocab, hidden, generator=generator) / hidden**0.5).to(dtype).requires_grad_(True)
    labels = torch.randint(0, vocab, (tokens, 1), generator=generator)
    mask = (torch.rand(tokens, generator=generator) < 0.9).float()
    return policy_logits, hidden_states, weight, labels, mask


def _forecast_before(draft_rows: torch.Tensor, policy_rows: torch.Tensor) -> torch.Tensor:
    """The forecast before this change (acceptance_forecast._overlap): whole [M, V] float softmaxes."""
    p, q = (torch.softmax(rows.float(), dim=-1) for rows in (policy_rows, draft_rows))
    return torch.minimum(p, q).sum(dim=-1).sum()


def run_variant(name: str, tokens: int, vocab: int, hidden: int, dtype: torch.dtype, repeats: int) -> dict:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from nemo_rl_mtp.training.draft_distributions import draft_terms

    policy_logits, hidden_states, weight, labels, mask = _inputs(tokens, vocab, hidden, dtype)
    policy_index = torch.arange(tokens)  # one row per token: row t's target predicted at policy row t
    rows = mask > 0
    draft_rows = rows.nonzero().squeeze(1)
    _reset_peak()
    held = _status_bytes("VmRSS")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        draft_logits = torch.matmul(hidden_states, weight.t())  # [T, 1, V], the output layer
        if name.startswith("cross_entropy"):
            if name == "cross_entropy_forecast_before":
                _forecast_before(draft_logits.detach().view(-1, vocab)[rows].clone(), policy_logits[rows])
            elif name == "cross_entropy_forecast":
                copies = draft_logits.detach().view(-1, vocab).index_select(0, draft_rows)
                draft_terms(copies, policy_logits, draft_rows, None, None, None, 0.0, 1.0, vocab)
            loss = (vocab_parallel_cross_entropy(draft_logits, labels) * mask[:, None]).sum()
        else:
            loss, _, _ = draft_terms(draft_logits, policy_logits, policy_index, mask, (mask > 0).float(), name, 0.1, 1.0, vocab)
        loss.backward()
        times.append(time.perf_counter() - start)
        hidden_states.grad = weight.grad = None
        del draft_logits, loss
    return {"peak_above_inputs": _status_bytes("VmHWM") - held, "median_s": statistics.median(times)}


def _child(args) -> None:
    from nemo_rl_mtp.training.model import initialize_model_parallel
    from nemo_rl_mtp.grpo.checked_config import load_checked_config

    initialize_model_parallel(load_checked_config().policy.megatron_cfg, 0, 1, f"tcp://127.0.0.1:{args.port}")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(json.dumps(run_variant(args.variant, args.tokens, args.vocab, args.hidden, dtype, args.repeats)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=150_000)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=3)
    # One thread: with two set explicitly, the chunked passes ran 3x slower on this shared 2-core VM.
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=29581, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        _child(args)
        return
    one_tensor = args.tokens * args.vocab * 4
    print(f"MTP loss of one depth: {args.tokens} tokens x vocabulary {args.vocab}, {args.dtype} logits, hidden {args.hidden}, "
          f"{args.threads} threads; one float32 [tokens, vocab] tensor = {one_tensor / 2**30:.2f} GiB")  # fmt: skip
    results = {}
    for index, name in enumerate(VARIANTS):
        command = [sys.executable, __file__, "--variant", name, "--port", str(args.port + index)]
        for key in ("tokens", "vocab", "hidden", "dtype", "repeats", "threads"):
            command += [f"--{key}", str(getattr(args, key))]
        completed = subprocess.run(command, capture_output=True, text=True, check=True)
        results[name] = json.loads(completed.stdout.strip().splitlines()[-1])
    base = results["cross_entropy"]
    print(f"{'variant':32s} {'peak above inputs':>18s} {'x [T,V] fp32':>13s} {'vs CE':>7s} {'time':>9s} {'vs CE':>7s}")
    for name, result in results.items():
        peak, seconds = result["peak_above_inputs"], result["median_s"]
        print(
            f"{name:32s} {peak / 2**30:15.2f} GiB {peak / one_tensor:13.2f} {peak / base['peak_above_inputs']:7.2f} "
            f"{seconds:8.2f}s {seconds / base['median_s']:7.2f}   ({VARIANTS[name]})"
        )


if __name__ == "__main__":
    main()
