"""One logger fanning out to the console (a progress bar per step), a JSONL file, TensorBoard and
Weights & Biases (offline when there is no API key or no network; `wandb sync` uploads later)."""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from nemo_rl_mtp.metrics import (
    ACCURACY,
    LOSS,
    NUM_SPECULATIVE_TOKENS,
    REWARD,
    ROLLOUT,
    ROLLOUT_DRAFT_ACCEPTANCE_RATE,
    STEP,
    STEP_SECONDS,
    TIMING,
    TOKENS_PER_DECODE_STEP,
    TRAIN,
    TRAIN_MTP_ACCEPTANCE_RATE,
    TRAIN_MTP_LOSS,
    VALIDATION,
    in_scope,
)

logger = logging.getLogger(__name__)

# Shown in the progress bar, the latest value of each: (metric key, short label). MTP acceptance
# in training (mtp_acc) next to the rollout's acceptance of the first draft token (draft_acc).
# draft_acc and tok/step are the latest rollout that drafted; with ``auto``, k is the latest
# rollout's drafts per step (at k = 0 the two drafting fields are that earlier rollout's).
PROGRESS_FIELDS = (
    (in_scope(TRAIN, REWARD), "reward"),
    (in_scope(VALIDATION, ACCURACY), "val_acc"),
    (in_scope(TRAIN, LOSS), "loss"),
    (TRAIN_MTP_LOSS.key(1), "mtp_loss"),
    (TRAIN_MTP_ACCEPTANCE_RATE.key(1), "mtp_acc"),
    (in_scope(ROLLOUT, NUM_SPECULATIVE_TOKENS), "k"),
    (ROLLOUT_DRAFT_ACCEPTANCE_RATE.key(1), "draft_acc"),
    (in_scope(ROLLOUT, TOKENS_PER_DECODE_STEP), "tok/step"),
    (in_scope(TIMING, STEP_SECONDS), "step_s"),
)


class Logger:
    """``start_step`` > 0 continues a resumed run: the JSONL keeps its rows before that step (a
    killed run may have logged past its last checkpoint), TensorBoard purges events from that step
    on, and wandb resumes the run with id ``wandb_run_id``."""

    def __init__(
        self,
        logger_cfg,
        run_dir: Path,
        run_config,
        total_steps: int,
        start_step: int = 0,
        wandb_run_id: Optional[str] = None,
    ):
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(run_config, run_dir / "config.yaml")
        self.jsonl = _jsonl_continuing_at(run_dir / "metrics.jsonl", start_step)
        self.tensorboard = None
        if logger_cfg.tensorboard_enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=start_step or None)
        self.wandb_run = None
        if logger_cfg.wandb_enabled:
            import wandb

            mode = resolve_wandb_mode(logger_cfg.wandb.mode)
            self.wandb_run = wandb.init(
                project=logger_cfg.wandb.project,
                name=run_dir.name,
                dir=str(run_dir),
                mode=mode,
                config=OmegaConf.to_container(run_config, resolve=True),
                settings=wandb.Settings(quiet=True),
                id=wandb_run_id,
                resume="allow" if wandb_run_id else None,
            )
            logger.info("wandb run %s (%s) in %s", run_dir.name, mode, run_dir / "wandb")
        self.progress = None
        self.shown: dict[str, str] = {}
        if logger_cfg.console:
            from tqdm import tqdm

            self.progress = tqdm(total=total_steps, initial=start_step, desc="GRPO", unit="step", dynamic_ncols=True)

    @property
    def wandb_run_id(self) -> Optional[str]:
        return self.wandb_run.id if self.wandb_run is not None else None

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.jsonl.write(json.dumps({STEP: step, **metrics}) + "\n")
        self.jsonl.flush()
        if self.tensorboard is not None:
            for key, value in metrics.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)
        if self.progress is not None:
            self.shown.update({label: f"{metrics[key]:.3g}" for key, label in PROGRESS_FIELDS if key in metrics})
            self.progress.set_postfix(self.shown, refresh=False)
            self.progress.update(1)

    def close(self) -> None:
        self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
        if self.progress is not None:
            self.progress.close()


def resolve_wandb_mode(mode: str) -> str:
    """``auto``: online only with an API key and a reachable wandb server."""
    if mode != "auto":
        return mode
    if not _wandb_api_key_configured():
        return "offline"
    return "online" if _reachable("api.wandb.ai", 443) else "offline"


def _wandb_api_key_configured() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")


def _reachable(host: str, port: int, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _jsonl_continuing_at(path: Path, start_step: int):
    """The metrics file opened for appending, holding only its rows before ``start_step``."""
    kept = [row for row in read_metrics(path) if row[STEP] < start_step] if path.is_file() else []
    with open(path, "w") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in kept)
    return open(path, "a")


def read_metrics(path: Path) -> list[dict]:
    """The JSONL log of a run, one dict per step."""
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]

