"""Step time with MTP on vs off on the tiny CPU model, as ratios measured side by side in one run,
next to the ratio of their FLOPs (counted by torch's FlopCounterMode on one step of each). MTP on
is measured with each ``mtp_loss_type`` and with heads frozen for RL (``mtp_frozen_during_rl``);
the headline ratio is the configured one's (the exemplar's default unless overridden).

    uv run python -m benchmarks.mtp_step_overhead [--steps 20] [key=value ...]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

REPO_ROOT = Path(__file__).resolve().parents[1]

from nemo_rl_mtp.training.losses import ClippedPGLossFn  # noqa: E402
from nemo_rl_mtp.training.model import initialize_model_parallel, setup_megatron_policy  # noqa: E402
from nemo_rl_mtp.training.step import train_global_batch  # noqa: E402
from nemo_rl_mtp.grpo.checked_config import load_checked_config  # noqa: E402
from tests.support.synthetic import synthetic_rl_batch  # noqa: E402

VOCAB_SIZE = 32
LOSS = ClippedPGLossFn(ratio_clip_min=0.2, ratio_clip_max=0.2, reference_policy_kl_penalty=0.0)
LOSS_TYPES = ("cross_entropy", "soft_cross_entropy", "total_variation")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--mtp-layers", type=int, default=1)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    base = load_checked_config(overrides=args.overrides)
    initialize_model_parallel(base.policy.megatron_cfg, 0, 1, "tcp://127.0.0.1:29571")
    generator = torch.Generator().manual_seed(0)
    seq_length, prompt_length = base.policy.max_total_sequence_length, 8
    response_lengths = torch.randint(2, seq_length - prompt_length + 1, (base.policy.train_global_batch_size,), generator=generator)
    batch = synthetic_rl_batch(response_lengths.tolist(), VOCAB_SIZE, prompt_length, seq_length)
    on = [f"policy.megatron_cfg.mtp_num_layers={args.mtp_layers}"]
    configured = f"mtp_on ({base.policy.megatron_cfg.mtp_loss_type})"
    variant_overrides = {"mtp_off": ["policy.megatron_cfg.mtp_num_layers=0"], configured: on}
    for loss_type in LOSS_TYPES:
        if loss_type != base.policy.megatron_cfg.mtp_loss_type:
            variant_overrides[f"mtp_on ({loss_type})"] = [*on, f"policy.megatron_cfg.mtp_loss_type={loss_type}"]
    variant_overrides["mtp_on (frozen)"] = [*on, "policy.mtp_frozen_during_rl=true"]
    variants = {}
    for name, overrides in variant_overrides.items():
        cfg = load_checked_config(overrides=[*args.overrides, *overrides])
        variants[name] = (setup_megatron_policy(cfg.policy, VOCAB_SIZE), cfg.policy)

    def step(name: str) -> float:
        policy, policy_cfg = variants[name]
        start = time.perf_counter()
        train_global_batch(policy, batch, LOSS, policy_cfg)
        return time.perf_counter() - start

    flops = {}
    for name in variants:
        step(name)  # warm-up
        with FlopCounterMode(display=False) as counter:
            step(name)
        flops[name] = counter.get_total_flops()
    times = {name: [] for name in variants}
    for _ in range(args.steps):  # interleaved, so drift in machine load hits every variant alike
        for name in variants:
            times[name].append(step(name))
    median = {name: statistics.median(values) for name, values in times.items()}
    print(f"steps per variant: {args.steps}, global batch {base.policy.train_global_batch_size} x {base.policy.max_total_sequence_length} tokens")
    print(f"{'variant':30s} {'median step':>12s} {'GFLOP/step':>11s} {'time ratio':>11s} {'FLOPs ratio':>12s} {'time / FLOPs ratio':>19s}")
    for name in variants:
        time_ratio, flops_ratio = median[name] / median["mtp_off"], flops[name] / flops["mtp_off"]
        print(
            f"{name:30s} {median[name] * 1e3:9.1f} ms {flops[name] / 1e9:11.3f} {time_ratio:11.3f} {flops_ratio:12.3f} "
            f"{time_ratio / flops_ratio:19.3f}"
        )
    print(f"step-time ratio (MTP on / off, {args.mtp_layers} MTP layer(s), {configured}): {median[configured] / median['mtp_off']:.3f}")
    print(f"FLOPs ratio     (MTP on / off): {flops[configured] / flops['mtp_off']:.3f}")


if __name__ == "__main__":
    main()
