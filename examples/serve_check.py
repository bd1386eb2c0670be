"""Serve an exported checkpoint in vLLM with its MTP heads drafting, on the run's held-out
validation prompts, and set vLLM's draft acceptance per position next to this project's own.

    uv run examples/serve_check.py --hf-ckpt-path exported/<run> --config logs/<run>/config.yaml \\
        [--vllm-python /tmp/vllm-venv/bin/python] [--num-speculative-tokens 1] [--ours metrics|engine]

vLLM runs in its own environment (``uv run python -m scripts.vllm_env --out /tmp/vllm-venv``
makes one): its torch build cannot share this project's, so ``examples/serve_check_vllm.py`` runs
there as a subprocess, twice (with MTP speculation and without), greedy and in eager mode, the
prompts passed as JSON. The prompts are the ones ``val/`` uses: the task is rebuilt from the run's
config with the project's own task code. The project's figure is the run's last
``val/draft_{i}_acceptance_rate`` from its ``metrics.jsonl`` (``--ours metrics``: the same weights
when the export is of the run's last checkpoint), or a validation pass of the project's engine on
the exported checkpoint itself (``--ours engine``: any checkpoint; starts the run's workers).
Prints the comparison, whether greedy outputs with speculation equal those without, and vLLM's
validation accuracy; ``--json`` writes the figures for scripts and tests.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from nemo_rl_mtp.config.load import ConfigError, load_saved_config
from nemo_rl_mtp.reporting.console import EXIT_CONFIG_ERROR, EXIT_ERROR, one_line, quiet_third_party_output

WORKER = Path(__file__).resolve().parent / "serve_check_vllm.py"
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VLLM_PYTHON = os.environ.get("NEMO_RL_MTP_VLLM_PYTHON", "/tmp/vllm-venv/bin/python")
CREATE_VENV = "uv run python -m scripts.vllm_env --out /tmp/vllm-venv"
# Keys of config.json that count MTP layers, in the layouts vLLM's MTP method serves.
MTP_COUNT_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers")


@dataclass
class VllmRun:
    """One vLLM generation over the prompts: responses and its speculative-decoding counters."""

    responses: list[list[int]]
    num_drafts: int = 0
    num_draft_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    # Calls in which vLLM's position-0 masking was bypassed (--megatron-position-0; 0 otherwise).
    position_0_bypassed: int = 0
    seconds: float = 0.0

    def acceptance(self) -> list[float]:
        """Percent of drafts whose position i was accepted (with the positions before it)."""
        return [100.0 * accepted / max(self.num_drafts, 1) for accepted in self.accepted_per_pos]


def vllm_python(path: str) -> Path:
    """The vLLM environment's interpreter, or one line saying how to make one."""
    python = Path(path)
    if not python.is_file():
        raise ConfigError(f"--vllm-python={path}: no such interpreter; create the vLLM environment with `{CREATE_VENV}`")
    return python


def export_mtp_layers(hf_ckpt_path: Path) -> int:
    """MTP layers the export's config.json declares; one line when there are none to draft with."""
    config_file = hf_ckpt_path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"--hf-ckpt-path={hf_ckpt_path}: no config.json (not a Hugging Face checkpoint)")
    config = json.loads(config_file.read_text())
    layers = max((int(config.get(key) or 0) for key in MTP_COUNT_KEYS), default=0)
    if layers == 0:
        raise ConfigError(
            f"--hf-ckpt-path={hf_ckpt_path}: config.json declares no MTP layers ({'/'.join(MTP_COUNT_KEYS)} absent or 0), "
            "so there are no heads to draft with"
        )
    return layers


def preload_env(python: Path) -> dict[str, str]:
    """The subprocess's environment: the venv's Intel OpenMP preloaded (vLLM's CPU kernels need
    it loaded first) and a small KV cache (vLLM's CPU default reserves gigabytes)."""
    env = dict(os.environ)
    venv = python.parent.parent
    iomp = sorted(glob.glob(str(venv / "lib" / "libiomp5.so")) + glob.glob(str(venv / "lib" / "python3*" / "site-packages" / "**" / "libiomp5.so"), recursive=True))
    if iomp:
        env["LD_PRELOAD"] = ":".join([iomp[0], *filter(None, [env.get("LD_PRELOAD")])])
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.pop("VIRTUAL_ENV", None)
    return env


def run_vllm(python: Path, model: Path, request: dict, num_speculative_tokens: int, timeout_s: int) -> VllmRun:
    """One generation in the vLLM environment; its last log lines in the error when it fails."""
    import time

    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "result.json"
        payload = {**request, "model": str(model), "num_speculative_tokens": num_speculative_tokens, "out": str(out)}
        started = time.monotonic()
        completed = subprocess.run(
            [str(python), str(WORKER)], input=json.dumps(payload), capture_output=True, text=True,
            env=preload_env(python), timeout=timeout_s, cwd=scratch,
        )  # fmt: skip
        if completed.returncode != 0 or not out.is_file():
            tail = " | ".join((completed.stderr + completed.stdout).strip().splitlines()[-3:])
            raise RuntimeError(f"vLLM ({python}) failed with exit code {completed.returncode}: {tail}")
        return VllmRun(**json.loads(out.read_text()), seconds=time.monotonic() - started)


def held_out_prompts(cfg, hf_ckpt_path: Path):
    """The run's validation prompts (``val/``'s), built by the project's task code with the
    export's tokenizer, and the task's environment to judge responses."""
    from nemo_rl_mtp.tasks import setup_task
    from nemo_rl_mtp.tasks.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(hf_ckpt_path), cfg.policy.trust_remote_code, cfg.data.apply_chat_template)
    prompts, env = setup_task(cfg, tokenizer)
    return prompts.validation_prompts, env, tokenizer


def ours_from_metrics(config_path: Path, positions: int) -> tuple[list[float], list[int], str]:
    """The run's last validation acceptance per position (percent), drafts proposed, and where it
    came from."""
    from nemo_rl_mtp.reporting.logger import read_metrics

    metrics_file = config_path.parent / "metrics.jsonl"
    if not metrics_file.is_file():
        raise ConfigError(f"--config={config_path}: no metrics.jsonl next to it to read val/ from; use --ours engine")
    rows = [row for row in read_metrics(metrics_file) if "val/draft_1_acceptance_rate" in row]
    if not rows:
        raise ConfigError(f"{metrics_file}: no val/draft_1_acceptance_rate (the run validated without speculation); use --ours engine")
    row = rows[-1]
    rates = [row.get(f"val/draft_{i}_acceptance_rate", float("nan")) for i in range(1, positions + 1)]
    proposed = [int(row.get(f"val/draft_{i}_proposed", 0)) for i in range(1, positions + 1)]
    return rates, proposed, f"val/ at step {row.get('step', '?')} of {metrics_file}"


def ours_from_engine(config_path: Path, hf_ckpt_path: Path, k: int, timeout_s: int) -> tuple[list[float], list[int], str]:
    """A validation-only run of the project's engine (GRPO with no steps) on the exported
    checkpoint, with the run's config: ``val/`` on exactly these weights."""
    from nemo_rl_mtp.reporting.logger import read_metrics

    with tempfile.TemporaryDirectory() as logs:
        recipe = Path(logs) / "config.yaml"
        recipe.write_text(_without_architecture_keys(config_path))
        command = [
            sys.executable, str(REPO_ROOT / "examples" / "run_grpo.py"), "--config", str(recipe),
            f"policy.model_name={hf_ckpt_path.resolve()}", "grpo.max_num_steps=0", "grpo.warmup_imitation_steps=0",
            f"policy.generation.num_speculative_tokens={k}", "checkpointing.enabled=false", f"logger.log_dir={logs}",
            "logger.run_name=serve_check", "logger.wandb_enabled=false", "logger.tensorboard_enabled=false",
            "grpo.log_kl_to_start_of_rl=false",
        ]  # fmt: skip
        completed = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=REPO_ROOT)
        if completed.returncode != 0:
            raise RuntimeError(f"the project's validation run failed: {completed.stderr.strip().splitlines()[-1:]}")
        row = read_metrics(Path(logs) / "serve_check" / "metrics.jsonl")[-1]
    rates = [row[f"val/draft_{i}_acceptance_rate"] for i in range(1, k + 1)]
    proposed = [int(row[f"val/draft_{i}_proposed"]) for i in range(1, k + 1)]
    return rates, proposed, "the project's engine on the export (validation only)"


def _without_architecture_keys(config_path: Path) -> str:
    """The run's saved config as a recipe for a run on the export: without the architecture keys,
    which the driver resolved from the run's checkpoint and the export brings again (a recipe that
    sets them is refused with policy.model_name)."""
    from omegaconf import OmegaConf

    from nemo_rl_mtp.config.schema import ARCHITECTURE_KEYS

    saved = OmegaConf.load(config_path)
    for key in ARCHITECTURE_KEYS:
        parent, leaf = key.rsplit(".", 1)
        node = OmegaConf.select(saved, parent)
        if node is not None and leaf in node:
            del node[leaf]
    return OmegaConf.to_yaml(saved)


def accuracy(env, held_out, responses: list[list[int]]) -> float:
    """The environment's ``accuracy`` of responses (as ``val/accuracy`` judges them)."""
    return float(env.metrics(env.step(held_out, responses))["accuracy"])


def report(figures: dict) -> str:
    """The comparison as the console shows it."""
    lines = [f"held-out prompts: {figures['num_prompts']} (val/ of {figures['config']}); vLLM greedy, enforce_eager, MTP k={figures['k']}"]
    lines.append("draft position | vLLM accepted / drafts | vLLM acceptance | ours")
    for i, (ours, theirs) in enumerate(zip(figures["ours_acceptance"], figures["vllm_acceptance"]), start=1):
        accepted = figures["vllm_accepted_per_pos"][i - 1]
        lines.append(f"{i} | {accepted} / {figures['vllm_num_drafts']} | {theirs:.1f}% | {ours:.1f}% ({figures['ours_proposed'][i - 1]} drafts)")
    lines.append(f"ours: {figures['ours_source']}")
    lines.append(f"vLLM accuracy with speculation: {figures['vllm_accuracy']:.3f}; wall time {figures['vllm_seconds'][0]:.0f} s (start-up included)")
    same = figures["greedy_equal"]
    if same is not None:  # not with --no-plain
        verdict = "yes" if same == figures["num_prompts"] else "NO"
        lines.append(f"greedy outputs with speculation == without: {verdict} ({same}/{figures['num_prompts']} prompts)")
        lines.append(f"vLLM accuracy without speculation: {figures['vllm_plain_accuracy']:.3f}; wall time {figures['vllm_seconds'][1]:.0f} s")
    return "\n".join(lines)


def serve_check(args) -> dict:
    """Every figure of the check, as a dict (what ``--json`` writes)."""
    cfg = load_saved_config(args.config)
    python = vllm_python(args.vllm_python)
    hf_ckpt_path = Path(args.hf_ckpt_path).resolve()  # vLLM runs in a scratch directory: a relative path would read as a hub id
    layers = export_mtp_layers(hf_ckpt_path)
    k = args.num_speculative_tokens
    held_out, env, tokenizer = held_out_prompts(cfg, hf_ckpt_path)
    try:
        request = {
            "prompts": [prompt.prompt_ids for prompt in held_out],
            "max_tokens": [cfg.policy.generation.max_new_tokens] * len(held_out),
            "stop_token_ids": [tokenizer.eos_id],
            "trust_remote_code": cfg.policy.trust_remote_code,
            "zero_mtp_position_0": not args.megatron_position_0,
        }
        speculative = run_vllm(python, hf_ckpt_path, request, k, args.timeout_s)
        plain = None if args.no_plain else run_vllm(python, hf_ckpt_path, request, 0, args.timeout_s)
        if args.ours == "engine":
            ours, proposed, source = ours_from_engine(Path(args.config), hf_ckpt_path, k, args.timeout_s)
        else:
            ours, proposed, source = ours_from_metrics(Path(args.config), k)
        return {
            "config": args.config, "export": str(hf_ckpt_path), "mtp_layers": layers, "k": k, "num_prompts": len(held_out),
            "vllm_num_drafts": speculative.num_drafts, "vllm_accepted_per_pos": speculative.accepted_per_pos,
            "vllm_acceptance": speculative.acceptance(), "ours_acceptance": ours, "ours_proposed": proposed, "ours_source": source,
            "greedy_equal": None if plain is None else sum(a == b for a, b in zip(speculative.responses, plain.responses)),
            "vllm_accuracy": accuracy(env, held_out, speculative.responses),
            "vllm_plain_accuracy": None if plain is None else accuracy(env, held_out, plain.responses),
            "vllm_seconds": [speculative.seconds, None if plain is None else plain.seconds], "megatron_position_0": args.megatron_position_0,
            "position_0_bypassed": speculative.position_0_bypassed,
        }  # fmt: skip
    finally:
        env.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-ckpt-path", required=True, help="an export (examples/converters/convert_megatron_to_hf.py)")
    parser.add_argument("--config", required=True, help="the run's config.yaml (logs/<run>/config.yaml)")
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON, help=f"the vLLM venv's python (make one: {CREATE_VENV})")
    parser.add_argument("--num-speculative-tokens", type=int, default=1, help="drafts per step in vLLM (and --ours engine)")
    parser.add_argument("--ours", choices=("metrics", "engine"), default="metrics", help="where the project's figure comes from")
    parser.add_argument("--no-plain", action="store_true", help="skip the run without speculation (no greedy-equality check)")
    parser.add_argument("--megatron-position-0", action="store_true", help="vLLM without its position-0 embedding masking (a measurement aid)")
    parser.add_argument("--timeout-s", type=int, default=1800, help="limit for each subprocess")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--verbose", action="store_true", help="full tracebacks and third-party output")
    args = parser.parse_args(argv)
    if not args.verbose:
        quiet_third_party_output()
    try:
        figures = serve_check(args)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except Exception as error:
        if args.verbose:
            raise
        print(f"error: {one_line(error)} (--verbose shows the traceback)", file=sys.stderr)
        return EXIT_ERROR
    print(report(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
