"""Step time with MTP on vs off on the tiny CPU model, as ratios measured side by side in one run,
next to the ratio of their FLOPs (counted by torch's FlopCounterMode on one step of each).

    uv run python benchmarks/mtp_step_overhead.py [--steps 20] [key=value ...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from nemo_rl_mtp.algorithms.loss_functions import ClippedPGLossFn
from nemo_rl_mtp.data.synthetic import synthetic_rl_batch
from nemo_rl_mtp.models.megatron.common import get_mtp_metrics
from nemo_rl_mtp.models.megatron.setup import initialize_model_parallel, setup_megatron_policy
from nemo_rl_mtp.models.megatron.train import train_global_batch
from nemo_rl_mtp.utils.config import load_config

VOCAB_SIZE = 32
LOSS = ClippedPGLossFn(ratio_clip_min=0.2, ratio_clip_max=0.2, reference_policy_kl_penalty=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--mtp-layers", type=int, default=1)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    base = load_config(overrides=args.overrides)
    initialize_model_parallel(base.policy.megatron_cfg, 0, 1, "tcp://127.0.0.1:29571")
    generator = torch.Generator().manual_seed(0)
    seq_length, prompt_length = base.policy.max_total_sequence_length, 8
    response_lengths = torch.randint(2, seq_length - prompt_length + 1, (base.policy.train_global_batch_size,), generator=generator)
    batch = synthetic_rl_batch(response_lengths.tolist(), VOCAB_SIZE, prompt_length, seq_length)
    variants = {}
    for name, mtp_layers in (("mtp_off", 0), ("mtp_on", args.mtp_layers)):
        cfg = load_config(overrides=[*args.overrides, f"policy.megatron_cfg.mtp_num_layers={mtp_layers}"])
        variants[name] = (setup_megatron_policy(cfg.policy, VOCAB_SIZE), cfg.policy)

    def step(name: str) -> float:
        policy, policy_cfg = variants[name]
        start = time.perf_counter()
        _, num_microbatches = train_global_batch(policy, batch, LOSS, policy_cfg)
        get_mtp_metrics(num_microbatches)
        return time.perf_counter() - start

    flops = {}
    for name in variants:
        step(name)  # warm-up
        with FlopCounterMode(display=False) as counter:
            step(name)
        flops[name] = counter.get_total_flops()
    times = {name: [] for name in variants}
    for _ in range(args.steps):  # interleaved, so drift in machine load hits both alike
        for name in variants:
            times[name].append(step(name))
    median = {name: statistics.median(values) for name, values in times.items()}
    print(f"steps per variant: {args.steps}, global batch {base.policy.train_global_batch_size} x {base.policy.max_total_sequence_length} tokens")
    for name in variants:
        print(f"{name:8s} median step {median[name] * 1e3:8.1f} ms   FLOPs/step {flops[name] / 1e9:8.3f} GFLOP")
    print(f"step-time ratio (MTP on / off, {args.mtp_layers} MTP layer(s)): {median['mtp_on'] / median['mtp_off']:.3f}")
    print(f"FLOPs ratio     (MTP on / off): {flops['mtp_on'] / flops['mtp_off']:.3f}")


if __name__ == "__main__":
    main()
