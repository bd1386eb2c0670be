"""A config loaded and checked in full, in the order that refuses bad input fastest: the generic
pure rules (``config.load``, which runs ``config.checks``), then the task's own
(``tasks.config_checks``), both without torch or megatron; only then what the installed
megatron-core and megatron-bridge can do (``megatron_compat.capabilities``, which imports
megatron). Every entry point (the command line, the tests' config builders and release gates,
benchmarks, converters, scripts) loads through here, so each refuses an unsupported release in one
line before any model is built.

This module imports nothing heavy at module level: the capabilities are imported once the pure
checks have passed, so a bad key is refused in about a second.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from omegaconf import DictConfig

from nemo_rl_mtp.config.load import load_config, load_saved_config
from nemo_rl_mtp.tasks.config_checks import check_task_config


def load_checked_config(path: Optional[str | Path] = None, overrides: Sequence[str] = ()) -> DictConfig:
    """Exemplar <- recipe at ``path`` <- ``overrides``, checked in full: the pure checks, then the
    installed release's; raises ConfigError, one line naming the key."""
    cfg = load_pure_checked_config(path, overrides)
    check_installed_release(cfg)
    return cfg


def load_pure_checked_config(path: Optional[str | Path] = None, overrides: Sequence[str] = ()) -> DictConfig:
    """The config with every pure check passed (generic and the task's); nothing heavy imported."""
    cfg = load_config(path, overrides)
    check_task_config(cfg)
    return cfg


def load_checked_saved_config(path: str | Path) -> DictConfig:
    """A run's saved ``config.yaml`` (``config.load.load_saved_config``), checked in full."""
    cfg = load_saved_config(path)
    check_run_config(cfg)
    return cfg


def check_run_config(cfg: DictConfig) -> None:
    """The checks beyond ``config.load``'s, for a config built or changed elsewhere (the driver's
    after ``resolve_checkpoint_keys`` fills in a checkpoint's architecture): the task's, then the
    installed release's."""
    check_task_config(cfg)
    check_installed_release(cfg)


def check_installed_release(cfg: DictConfig) -> None:
    """``megatron_compat.capabilities.check_installed_release``, imported here (it imports
    megatron-core's version probe and, when asked, megatron itself) so that importing this module
    and the pure checks stay light."""
    from nemo_rl_mtp.megatron_compat.capabilities import check_installed_release as check_release

    check_release(cfg)
