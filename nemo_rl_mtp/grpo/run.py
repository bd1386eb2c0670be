"""Everything around a GRPO run but the algorithm: its name and directory, the model it starts
from, what this machine must offer, and its checkpoints (writing, rotating, resuming).

A run lives in ``<logger.log_dir>/<logger.run_name>/``. Its checkpoints are directories
``step_<NNNNNN>`` (the number of GRPO steps done), written as ``step_<NNNNNN>.partial`` and renamed
only once every part is on disk, so a run killed during a save leaves a ``.partial`` directory that
is never taken for a checkpoint (and is removed by the next save). The latest checkpoint is the
complete one with the most steps; a run restarted with the same run directory resumes from it.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from omegaconf import OmegaConf, read_write

from nemo_rl_mtp.config.load import ConfigError, load_exemplar, resolve_checkpoint_keys
from nemo_rl_mtp.config.schema import LoggerConfig, MasterConfig
from nemo_rl_mtp.grpo.checked_config import check_installed_release, check_run_config
from nemo_rl_mtp.megatron_compat.capabilities import multi_latent_attention_refusal
from nemo_rl_mtp.tasks.interfaces import PromptSource

logger = logging.getLogger(__name__)


@dataclass
class Run:
    """A run ready to start: its config (run name and the checkpoint's keys filled in), its
    directory and checkpoints, and where it resumes from (None: a new run)."""

    cfg: MasterConfig
    directory: Path
    checkpoints: "CheckpointDirectory"
    resume_from: Optional[Path]
    trainer_state: dict = field(default_factory=lambda: {"steps_done": 0, "wandb_run_id": None})

    @property
    def steps_done(self) -> int:
        return self.trainer_state["steps_done"]


def prepare_run(cfg: MasterConfig, overwrite: bool) -> Run:
    """Name the run, check this machine and the files the config names, claim its directory,
    check what the installed release can do, and resolve its model: resume from the directory's
    latest complete checkpoint (refusing a changed config), replace it with ``overwrite``, or
    refuse a directory holding another run. The checks that need no megatron-core come first, so
    bad input is refused in seconds; ``overwrite`` removes the earlier run only once every check
    has passed. Raises ConfigError; starts no worker."""
    cfg = with_run_name(cfg)
    preflight_checks(cfg)
    directory = run_directory(cfg.logger)
    checkpoints = checkpoint_directory(cfg, directory)
    resume_from = None if overwrite else prepare_run_directory(directory, checkpoints, overwrite=False)
    check_installed_release(cfg)  # imports megatron-core
    cfg = resolve_model(cfg)  # opens an imported checkpoint's config (megatron-bridge)
    if overwrite:
        prepare_run_directory(directory, checkpoints, overwrite=True)
    run = Run(cfg, directory, checkpoints, resume_from)
    if resume_from is not None:
        check_resumable_config(directory / "config.yaml", cfg)
        run.trainer_state = torch.load(resume_from / TRAINER_STATE, weights_only=False)
        logger.info("resuming %s from %s (%d steps done)", directory, resume_from, run.steps_done)
    return run


def restore_prompt_order(run: Run, prompts: PromptSource) -> None:
    """A resumed run continues its prompts where the checkpoint left them."""
    if run.resume_from is not None:
        prompts.load_state_dict(_prompt_source_state(run.trainer_state))


def with_run_name(cfg: MasterConfig) -> MasterConfig:
    """``cfg`` with ``logger.run_name`` filled in (grpo-<date>-<time> when null), so that the
    saved config.yaml, the resume hint and a resumed run all name the same directory. The name is
    claimed by creating its directory: runs started in the same second (two default runs side by
    side) get grpo-<date>-<time>-2, -3, ... instead of writing into one directory."""
    return _named(cfg, claim_run_name(Path(cfg.logger.log_dir), _default_run_stem())) if cfg.logger.run_name is None else cfg


@contextlib.contextmanager
def run_named(cfg: MasterConfig) -> Iterator[MasterConfig]:
    """``cfg`` with its run name (as :func:`with_run_name`) for the run in the block. A name
    claimed here is given back when the block ends in an error or an interrupt before anything
    was written into its directory (a config the preflight checks refuse, a data file that does
    not open, a Ray that does not start): the claimed directory, still empty, is removed, so the
    log directory gains no empty run directory that reads as a run. A directory holding anything
    is kept, and a run name the user chose is never touched. A process ended by the Ray start's
    watchdog (``reporting.console.hard_exit``) gives it back too."""
    if cfg.logger.run_name is not None:
        yield cfg
        return
    from nemo_rl_mtp.reporting.console import undone_on_hard_exit

    stem = _default_run_stem()
    name = _claim(Path(cfg.logger.log_dir), stem)
    if name is None:  # log_dir not writable: nothing claimed, which the preflight checks report
        yield _named(cfg, stem)
        return

    def give_back() -> None:
        with contextlib.suppress(OSError):  # not empty: the run wrote into it, and it stays
            (Path(cfg.logger.log_dir) / name).rmdir()

    try:
        with undone_on_hard_exit(give_back):  # also when a Ray start held in C++ is abandoned
            yield _named(cfg, name)
    except BaseException:
        give_back()
        raise


def _default_run_stem() -> str:
    return datetime.now().strftime("grpo-%Y%m%d-%H%M%S")


def _named(cfg: MasterConfig, run_name: str) -> MasterConfig:
    named = copy.deepcopy(cfg)
    with read_write(named):
        named.logger.run_name = run_name
    return named


def claim_run_name(log_dir: Path, stem: str) -> str:
    """The first of ``stem``, ``stem-2``, ``stem-3``, ... whose directory under ``log_dir`` this
    call creates (atomic: another process's claim of the same name fails). ``stem`` unclaimed
    where ``log_dir`` is not writable, which the preflight checks report."""
    return _claim(log_dir, stem) or stem


def _claim(log_dir: Path, stem: str) -> Optional[str]:
    """:func:`claim_run_name`'s claim; None where ``log_dir`` is not writable (nothing claimed)."""
    attempt = 1
    while True:
        name = stem if attempt == 1 else f"{stem}-{attempt}"
        try:
            (log_dir / name).mkdir(parents=True)
            return name
        except FileExistsError:
            attempt += 1
        except OSError:
            return None


def run_directory(logger_cfg: LoggerConfig) -> Path:
    return Path(logger_cfg.log_dir) / logger_cfg.run_name


def resolve_model(cfg: MasterConfig) -> MasterConfig:
    """``cfg`` with what an imported checkpoint (``policy.model_name``) decides: its architecture
    keys and MTP layer count; raises ConfigError where the checkpoint cannot be used as configured.
    Opens the checkpoint's config only (megatron-bridge, about 15 s), before any worker starts."""
    from nemo_rl_mtp.training import hf_checkpoint

    if cfg.policy.model_name is None:
        log_mtp_position_0_convention(cfg, None, None)
        return cfg

    try:
        facts = hf_checkpoint.checkpoint_facts(
            hf_checkpoint.open_checkpoint(cfg.policy.model_name, cfg.policy.trust_remote_code), cfg.policy.model_name
        )
    except hf_checkpoint.CheckpointError as error:
        raise ConfigError(str(error)) from None
    if facts.multi_latent_attention and workers_transformer_impl(cfg) == "local":
        raise ConfigError(
            multi_latent_attention_refusal(
                "policy.model_name", cfg.policy.model_name, f"this {facts.architecture} run's workers (no GPU, or transformer_impl=local)"
            )
        )
    resolved = resolve_checkpoint_keys(cfg, facts)
    check_run_config(resolved)  # the task's and the release's checks, now with the checkpoint's keys
    logger.info(
        "model: %s (%s) through megatron-bridge, %d MTP layer(s)%s", cfg.policy.model_name, facts.architecture,
        resolved.policy.megatron_cfg.mtp_num_layers, " with weights" if facts.mtp_num_layers else " (new)",
    )  # fmt: skip
    log_mtp_position_0_convention(resolved, facts.architecture, facts.model_type)
    return resolved


def log_mtp_position_0_convention(cfg: MasterConfig, architecture: Optional[str], model_type: Optional[str]) -> None:
    """Say once, on the driver's console, whether the MTP layers will train and draft with their
    token embedding zeroed at position 0, and why (each worker resolves the same and logs it too)."""
    from nemo_rl_mtp.training import hf_checkpoint

    megatron_cfg = cfg.policy.megatron_cfg
    if not megatron_cfg.mtp_num_layers:
        return
    zero, reason = hf_checkpoint.mtp_position_0_zeroing(megatron_cfg.mtp_zero_embedding_at_position_0, architecture, model_type)
    logger.info("MTP token embedding at position 0: %s (%s)", "zeroed" if zero else "megatron's (not zeroed)", reason)


def workers_transformer_impl(cfg: MasterConfig) -> Optional[str]:
    """The layer spec the workers will build, where the driver can tell: the configured one; for
    ``auto``, this machine's resolution when the workers run here (no ``cluster.address``), local
    for CPU workers on a cluster. None: ``auto`` on a cluster's GPU workers, decided on each node
    (whether transformer_engine imports there), which the driver may not share."""
    from nemo_rl_mtp.training.model import resolve_transformer_impl

    requested = cfg.policy.megatron_cfg.transformer_impl
    if requested != "auto":
        return requested
    if cfg.cluster.address is None:
        return resolve_transformer_impl(requested)
    return None if cfg.cluster.gpus_per_worker else "local"


def preflight_checks(cfg: MasterConfig) -> None:
    """What the config needs from this machine and the files it names (a local checkpoint, the
    JSONL data files), checked before any worker starts and before megatron-core is imported;
    raises ConfigError."""
    from nemo_rl_mtp.megatron_compat.installed import transformer_engine_installed
    from nemo_rl_mtp.tasks.jsonl_prompts import check_data_files
    from nemo_rl_mtp.training.hf_checkpoint import CheckpointError, check_reachable

    cluster = cfg.cluster
    if cluster.gpus_per_worker and cluster.address is None:
        import torch

        needed = cluster.num_nodes * cluster.workers_per_node * cluster.gpus_per_worker
        if torch.cuda.device_count() < needed:
            raise ConfigError(
                f"cluster.gpus_per_worker={cluster.gpus_per_worker}: this is a GPU recipe for {needed} GPU(s), "
                f"and this machine has {torch.cuda.device_count()}; run it on a GPU node, or join a GPU "
                "cluster with cluster.address"
            )
    _check_local_cpus(cluster)
    _check_log_dir_writable(cfg.logger.log_dir)
    if cfg.policy.model_name is not None:
        try:
            check_reachable(cfg.policy.model_name, cfg.policy.trust_remote_code)
        except CheckpointError as error:
            raise ConfigError(str(error)) from None
    check_data_files(cfg.data)
    if cfg.policy.megatron_cfg.transformer_impl == "transformer_engine" and not transformer_engine_installed():
        raise ConfigError(
            "policy.megatron_cfg.transformer_impl=transformer_engine, but transformer_engine is not installed "
            "(it needs CUDA); install it on the GPU nodes or use transformer_impl=auto"
        )


def _check_local_cpus(cluster) -> None:
    """Without cluster.address the workers run here: refuse what this machine cannot place,
    rather than letting Ray wait for resources that never come."""
    if cluster.address is not None:
        return
    if cluster.num_nodes > 1:
        raise ConfigError(f"cluster.num_nodes={cluster.num_nodes}: several nodes need cluster.address (a running Ray cluster)")
    needed = cluster.workers_per_node * cluster.cpus_per_worker
    available = os.cpu_count() or 1
    if needed > available:
        raise ConfigError(
            f"cluster.workers_per_node={cluster.workers_per_node}: needs {needed} CPUs (x cluster.cpus_per_worker="
            f"{cluster.cpus_per_worker}), this machine has {available}"
        )


def _check_log_dir_writable(log_dir: str) -> None:
    try:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=log_dir):
            pass
    except OSError as error:
        raise ConfigError(f"logger.log_dir={log_dir}: not writable ({error.strerror or error})") from None


TRAINER_STATE = "trainer_state.pt"


START_OF_RL = "start_of_rl"


def keep_start_of_rl_policy(cfg: MasterConfig, policy, checkpoints: CheckpointDirectory, resumed: bool) -> None:
    """The policy GRPO starts from, for ``train/kl_to_start``: kept by the workers, and saved
    once next to the checkpoints (written as ``.partial``, renamed when complete), from where a
    resumed run reads it back."""
    directory = checkpoints.root / START_OF_RL
    if resumed:
        if not directory.is_dir():
            raise ConfigError(f"grpo.log_kl_to_start_of_rl=true: {directory} is missing, so the policy this run started from is unknown")
        policy.load_start_of_rl_weights(directory)
        return
    if not cfg.checkpointing.enabled:
        policy.keep_start_of_rl_weights(None)
        return
    partial = directory.with_name(directory.name + PARTIAL_SUFFIX)
    for stale in (partial, directory):
        if stale.exists():
            shutil.rmtree(stale)
    policy.keep_start_of_rl_weights(partial)
    os.rename(partial, directory)


def _prompt_source_state(trainer_state: dict) -> dict:
    """The prompt order's state; runs saved before prompt sources existed kept the digit tasks'
    generator state under ``prompt_generator``."""
    if "prompt_source" in trainer_state:
        return trainer_state["prompt_source"]
    return {"generator": trainer_state["prompt_generator"]}


def checkpoint_directory(cfg: MasterConfig, run_dir: Path) -> CheckpointDirectory:
    """``checkpointing.checkpoint_dir``, or ``<run_dir>/checkpoints`` when it is null."""
    root = Path(cfg.checkpointing.checkpoint_dir) if cfg.checkpointing.checkpoint_dir else run_dir / "checkpoints"
    return CheckpointDirectory(root, cfg.checkpointing.keep_last)


def latest_checkpoint(cfg: MasterConfig) -> Optional[Path]:
    """The newest complete checkpoint of the run ``cfg`` names (run name filled in), if any."""
    return checkpoint_directory(cfg, run_directory(cfg.logger)).latest()


def prepare_run_directory(run_dir: Path, checkpoints: CheckpointDirectory, overwrite: bool) -> Optional[Path]:
    """The checkpoint to resume from, or None for a new run. A run directory holding an earlier
    run is resumed when it has a complete checkpoint, replaced with ``overwrite``, else refused:
    two runs never write into one directory."""
    if overwrite:
        for directory in (run_dir, checkpoints.root):
            if directory.exists():
                shutil.rmtree(directory)
        return None
    latest = checkpoints.latest()
    if latest is not None:
        return latest
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(
            f"logger.run_name={run_dir.name}: {run_dir} holds an earlier run with no complete checkpoint to resume "
            "from; choose another logger.run_name, or pass --overwrite to replace it"
        )
    return None


# What a resumed run may change: its length, where and how it runs and logs, and the parallel
# layout (checkpoints are sharded). Any other change would continue a different run.
RESUMABLE_CHANGES = (
    "grpo.max_num_steps",
    "cluster.",
    "logger.",
    "checkpointing.",
    "policy.generation.engine.",
    # Speculation is lossless: it changes how fast rollouts come, not what they are.
    "policy.generation.num_speculative_tokens",
    "policy.generation.spec_verification",
    "policy.generation.draft_context",
    "policy.train_micro_batch_size",
    "policy.megatron_cfg.tensor_model_parallel_size",
    "policy.megatron_cfg.pipeline_model_parallel_size",
    "policy.megatron_cfg.context_parallel_size",
    "policy.megatron_cfg.sequence_parallel",
    "policy.megatron_cfg.recompute_",
)


def check_resumable_config(saved_config: Path, cfg: MasterConfig) -> None:
    """Refuse to resume a run with settings it was not started with (other than
    ``RESUMABLE_CHANGES``), naming each key with its saved and its new value. A key the saved
    config lacks (added by a later version) counts as its exemplar default, the behaviour the run
    had before the key existed."""
    if not saved_config.is_file():
        return
    saved = {**_leaves(load_exemplar()), **_leaves(OmegaConf.load(saved_config))}
    now = _leaves(cfg)
    changed = [
        f"{key}: {saved.get(key)!r} -> {now.get(key)!r}"
        for key in sorted(saved.keys() | now.keys())
        if saved.get(key) != now.get(key) and not key.startswith(RESUMABLE_CHANGES)
    ]
    if changed:
        raise ConfigError(
            f"logger.run_name={cfg.logger.run_name}: resuming with settings the run did not start with "
            f"({'; '.join(changed)}); resume with its saved {saved_config}, choose another logger.run_name, "
            "or pass --overwrite to start afresh"
        )


def _leaves(config) -> dict:
    """Dotted key -> value of every leaf of a config."""
    def walk(node, prefix):
        if isinstance(node, dict):
            for key, value in node.items():
                yield from walk(value, f"{prefix}{key}.")
        else:
            yield prefix[:-1], node

    return dict(walk(OmegaConf.to_container(config, resolve=True), ""))


def checkpoint_due(checkpointing_cfg, steps_done: int, max_num_steps: int) -> bool:
    return checkpointing_cfg.enabled and (steps_done % checkpointing_cfg.save_period == 0 or steps_done == max_num_steps)


def save_checkpoint(checkpoints: CheckpointDirectory, steps_done: int, policy, prompts: PromptSource, log) -> Path:
    """Policy shards (every worker) and the driver's state; complete only when all are written."""

    def write(directory: Path) -> None:
        policy.save_checkpoint(directory)
        state = {"steps_done": steps_done, "prompt_source": prompts.state_dict(), "wandb_run_id": log.wandb_run_id}
        torch.save(state, directory / TRAINER_STATE)

    path = checkpoints.save(steps_done, write)
    logger.info("checkpoint %s", path)
    return path


_COMPLETE = re.compile(r"^step_(\d{6,})$")
PARTIAL_SUFFIX = ".partial"


class CheckpointDirectory:
    def __init__(self, root: Path, keep_last: int):
        self.root = root
        self.keep_last = keep_last

    def complete(self) -> list[tuple[int, Path]]:
        """(steps done, path) of every complete checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), path) for path in self.root.iterdir() if (m := _COMPLETE.match(path.name))]
        return sorted(found)

    def latest(self) -> Optional[Path]:
        complete = self.complete()
        return complete[-1][1] if complete else None

    def save(self, steps_done: int, write: Callable[[Path], None]) -> Path:
        """``write(directory)`` fills a partial directory; it becomes the latest checkpoint when
        ``write`` returns, and checkpoints beyond ``keep_last`` are removed, oldest first."""
        for stale in self.root.glob(f"*{PARTIAL_SUFFIX}") if self.root.is_dir() else []:
            shutil.rmtree(stale)
        final = self.root / f"step_{steps_done:06d}"
        partial = final.with_name(final.name + PARTIAL_SUFFIX)
        partial.mkdir(parents=True)
        write(partial)
        if final.exists():  # the same step saved again (a resumed run's final save)
            shutil.rmtree(final)
        os.rename(partial, final)
        self._prune()
        return final

    def _prune(self) -> None:
        complete = self.complete()
        if self.keep_last > 0:
            for _, path in complete[: -self.keep_last]:
                shutil.rmtree(path)
