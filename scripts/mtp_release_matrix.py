"""MTP training in RL mode on every released megatron-core with MTP, side by side.

Each release runs in its own uv environment (``uv run --with megatron-core==X``) with the compat
shims applied at model setup. All releases start from the same weights (saved by the 0.19.2 run)
and see the same batch; the table gives, per release x recompute x layout, the status and the MTP
loss and acceptance per layer, and the largest difference to 0.19.2 in MTP loss and in any
parameter's gradient. ``--without-shims`` adds what each release does on its own.

    uv run python -m scripts.mtp_release_matrix [--releases 0.16.1 0.17.1 0.18.2 0.19.2] [--without-shims] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REFERENCE_RELEASE = "0.19.2"
DEFAULT_RELEASES = ("0.16.1", "0.17.1", "0.18.2", "0.19.2")
CASES = (("off", False), ("full", False), ("off", True), ("full", True))  # (recompute, packed)
VOCAB_SIZE = 32
RESPONSE_LENGTHS = [1, 9, 3, 4, 8, 2, 6, 5]
SAMPLE_MASK = [1, 1, 1, 0, 1, 1, 1, 1]
REPO_ROOT = Path(__file__).resolve().parents[1]


def measure(reference_dir: Path, save_reference: bool, shims: bool) -> list[dict]:
    """In the current environment: one MTP step per case; grads compared with the reference."""
    import torch

    from nemo_rl_mtp.megatron_compat import shims as compat

    if not shims:
        compat.apply_mtp_compat_shims = lambda: []

    from nemo_rl_mtp.megatron_compat.installed import megatron_core_version
    from nemo_rl_mtp.training.model import initialize_model_parallel, setup_megatron_policy
    from nemo_rl_mtp.training.step import forward_backward_global_batch
    from nemo_rl_mtp.grpo.checked_config import load_checked_config
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nemo_rl_mtp.training.losses import ClippedPGLossFn

    from tests.support.synthetic import synthetic_rl_batch

    base = load_checked_config()
    initialize_model_parallel(base.policy.megatron_cfg, 0, 1, f"tcp://127.0.0.1:{_free_port()}")
    loss_fn = ClippedPGLossFn(0.2, 0.2, 0.0)
    batch = synthetic_rl_batch(RESPONSE_LENGTHS, VOCAB_SIZE, sample_mask=SAMPLE_MASK)
    weights_path = reference_dir / "weights.pt"
    results = []
    for recompute, packed in CASES:
        overrides = [
            "policy.megatron_cfg.mtp_num_layers=2",
            "policy.train_micro_batch_size=2",
            "policy.train_global_batch_size=8",
            f"policy.sequence_packing.enabled={str(packed).lower()}",
        ]
        if recompute == "full":
            overrides += [
                "policy.megatron_cfg.recompute_granularity=full",
                "policy.megatron_cfg.recompute_method=uniform",
                "policy.megatron_cfg.recompute_num_layers=1",
            ]
        cfg = load_checked_config(overrides=overrides)
        case = {"release": megatron_core_version(), "recompute": recompute, "packed": packed, "shims": shims}
        try:
            model_parallel_cuda_manual_seed(cfg.policy.megatron_cfg.seed)
            torch.manual_seed(cfg.policy.megatron_cfg.seed)
            policy = setup_megatron_policy(cfg.policy, VOCAB_SIZE)
            module = policy.model.module
            if save_reference and not weights_path.exists():
                torch.save(_canonical(module.state_dict()), weights_path)
            module.load_state_dict(_release_names(torch.load(weights_path), module.state_dict()))
            # The step's guard raises where MTP silently does not train (shims off before 0.19).
            metrics = forward_backward_global_batch(policy, batch, loss_fn, cfg.policy)
            grads = _canonical({name: param.main_grad.clone() for name, param in module.named_parameters()})
            grads_path = reference_dir / f"grads_{recompute}_{packed}.pt"
            if save_reference:
                torch.save(grads, grads_path)
            reference = torch.load(grads_path)
            trained = "mtp/mtp_1_loss" in metrics and metrics["mtp/grad_norm"] > 0
            case.update(
                status="ok" if trained else "silent: no MTP loss, zero MTP gradient",
                metrics={key: value for key, value in metrics.items() if key.startswith("mtp")},
                max_grad_diff=max((grads[name] - reference[name]).abs().max().item() for name in reference),
            )
        except Exception as error:  # a cell of the table, not a crash of the matrix
            case.update(status=f"{type(error).__name__}: {str(error).splitlines()[0][:120]}")
        results.append(case)
    return results


def _canonical(state: dict) -> dict:
    """0.16's MTP inner layer is ``transformer_layer``; later releases call it ``mtp_model_layer``."""
    return {name.replace(".transformer_layer.", ".mtp_model_layer."): value for name, value in state.items()}


def _release_names(canonical: dict, target: dict) -> dict:
    renamed = {}
    for name in target:
        renamed[name] = canonical[name.replace(".transformer_layer.", ".mtp_model_layer.")]
    return renamed


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_release(release: str, reference_dir: Path, shims: bool) -> list[dict]:
    command = [
        "uv", "run", "--with", f"megatron-core=={release}", "python", "-m", "scripts.mtp_release_matrix",
        "--measure", "--reference-dir", str(reference_dir),
    ]
    if release == REFERENCE_RELEASE and shims:
        command.append("--save-reference")
    if not shims:
        command.append("--without-shims")
    completed = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    for line in reversed(completed.stdout.splitlines()):
        if line.startswith("MATRIX_RESULTS "):
            return json.loads(line[len("MATRIX_RESULTS "):])
    raise RuntimeError(f"megatron-core {release}: no results (exit {completed.returncode})\n{completed.stderr[-3000:]}")


def run_matrix(releases, without_shims: bool = False) -> list[dict]:
    releases = [REFERENCE_RELEASE] + [release for release in releases if release != REFERENCE_RELEASE]
    variants = [True, False] if without_shims else [True]
    with tempfile.TemporaryDirectory() as reference_dir:
        results = [
            case for shims in variants for release in releases for case in run_release(release, Path(reference_dir), shims)
        ]
    reference = {
        (case["recompute"], case["packed"]): case
        for case in results
        if case["release"].startswith(REFERENCE_RELEASE) and case["shims"]
    }
    for case in results:
        base = reference.get((case["recompute"], case["packed"]))
        if case["status"] == "ok" and base is not None and base["status"] == "ok":
            losses = [key for key in base["metrics"] if key.endswith("_loss")]
            case["max_loss_diff"] = max(abs(case["metrics"][key] - base["metrics"][key]) for key in losses)
    return results


def format_table(results: list[dict]) -> str:
    header = (
        f"{'release':9} {'shims':5} {'recompute':9} {'layout':7} {'status':10} {'mtp_1_loss':>10} {'mtp_2_loss':>10} "
        f"{'acc_1 %':>7} {'acc_2 %':>7} {'|dloss| vs 0.19.2':>17} {'|dgrad| vs 0.19.2':>17}"
    )
    lines = [header, "-" * len(header)]
    for case in results:
        layout = "packed" if case["packed"] else "rows"
        shims = "on" if case["shims"] else "off"
        if case["status"] != "ok":
            lines.append(f"{case['release']:9} {shims:5} {case['recompute']:9} {layout:7} {case['status']}")
            continue
        m = case["metrics"]
        lines.append(
            f"{case['release']:9} {shims:5} {case['recompute']:9} {layout:7} {'ok':10} {m['mtp/mtp_1_loss']:10.6f} {m['mtp/mtp_2_loss']:10.6f} "
            f"{m['mtp/mtp_1_acceptance_rate']:7.2f} {m['mtp/mtp_2_acceptance_rate']:7.2f} "
            f"{case.get('max_loss_diff', float('nan')):17.2e} {case['max_grad_diff']:17.2e}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--releases", nargs="+", default=list(DEFAULT_RELEASES))
    parser.add_argument("--without-shims", action="store_true", help="also run each release without the shims")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--reference-dir", help=argparse.SUPPRESS)
    parser.add_argument("--save-reference", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        results = measure(Path(args.reference_dir), args.save_reference, shims=not args.without_shims)
        print("MATRIX_RESULTS " + json.dumps(results))
        return 0
    results = run_matrix(args.releases, args.without_shims)
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if all(case["status"] == "ok" for case in results if case["shims"]) else 1


if __name__ == "__main__":
    sys.exit(main())
