"""Load, merge and validate configs.

Every config is the exemplar (``nemo_rl_mtp/config/grpo_mtp.yaml``, the one place defaults live;
package data, so an installed wheel has it) merged with a recipe (which may inherit from other
recipes with ``defaults:``) and then with ``key=value`` overrides. Keys are typed by
:mod:`nemo_rl_mtp.config.schema`; an unknown key, a wrong type, a value outside its allowed set or
a broken rule across keys (:mod:`nemo_rl_mtp.config.checks`) raises :class:`ConfigError` naming
the key. Only the pure checks run here (this module imports no torch and no megatron); the task's
rules and the installed release's are ``grpo.checked_config``'s.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Iterable, Optional, Sequence

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nemo_rl_mtp.config.checks import ConfigError, check_config, require
from nemo_rl_mtp.config.schema import ARCHITECTURE_KEYS, MasterConfig

__all__ = ["ConfigError", "load_config", "load_exemplar", "load_saved_config", "resolve_checkpoint_keys"]

# Read through importlib.resources: the package's own data, wherever (and however) it is installed.
EXEMPLAR_CONFIG = resources.files("nemo_rl_mtp") / "config" / "grpo_mtp.yaml"

def load_config(path: Optional[str | Path] = None, overrides: Sequence[str] = ()) -> DictConfig:
    """Exemplar <- recipe at ``path`` (with its ``defaults:`` chain) <- ``overrides``."""
    layers = [("exemplar " + str(EXEMPLAR_CONFIG), load_exemplar())]
    if path is not None:
        layers.append((str(path), _load_yaml_with_defaults(Path(path))))
    if overrides:
        layers.append(("command-line overrides", _parse_overrides(overrides)))

    cfg = OmegaConf.structured(MasterConfig)
    for source, layer in layers:
        try:
            cfg = OmegaConf.merge(cfg, layer)
        except OmegaConfBaseException as error:
            raise ConfigError(f"{source}: {_describe(error)}") from None
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"keys without a value (add them to {EXEMPLAR_CONFIG}): {missing}")
    _defer_checkpoint_keys(cfg, set().union(*(_leaf_keys(layer) for _, layer in layers[1:])))
    check_config(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def load_exemplar() -> DictConfig:
    """The exemplar's keys and defaults, unvalidated (a fresh object each call: callers may change it)."""
    return OmegaConf.create(EXEMPLAR_CONFIG.read_text(encoding="utf-8"))


def _defer_checkpoint_keys(cfg: DictConfig, set_keys: set[str]) -> None:
    """With ``policy.model_name``, refuse architecture keys set by a recipe or an override (the
    checkpoint has its own), and leave ``mtp_num_layers`` to the checkpoint (None until the
    driver resolves it) unless one set it."""
    if cfg.policy.model_name is None:
        return
    for key in ARCHITECTURE_KEYS:
        if key in set_keys:
            raise ConfigError(
                f"{key}={OmegaConf.select(cfg, key)!r}: the architecture comes from policy.model_name="
                f"{cfg.policy.model_name}; remove the key"
            )
    if "policy.megatron_cfg.mtp_num_layers" not in set_keys:
        cfg.policy.megatron_cfg.mtp_num_layers = None


def load_saved_config(path: str | Path) -> DictConfig:
    """A run's saved ``config.yaml`` (already resolved, every key set), over the exemplar for keys
    added since it was written; validated."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(MasterConfig), load_exemplar(), OmegaConf.load(path))
    except OmegaConfBaseException as error:
        raise ConfigError(f"{path}: {_describe(error)}") from None
    check_config(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def resolve_checkpoint_keys(cfg: DictConfig, facts) -> DictConfig:
    """``cfg`` with its architecture keys and MTP layer count as the imported checkpoint has them
    (``facts``: ``hf_checkpoint.CheckpointFacts``), validated again; raises ConfigError where the
    config and the checkpoint disagree."""
    megatron = cfg.policy.megatron_cfg
    mtp_num_layers = megatron.mtp_num_layers
    if facts.mtp_num_layers and mtp_num_layers is not None and mtp_num_layers != facts.mtp_num_layers:
        raise ConfigError(
            f"policy.megatron_cfg.mtp_num_layers={mtp_num_layers}: {facts.model_name} has {facts.mtp_num_layers} MTP "
            f"layer(s) with weights; leave the key unset (or set it to {facts.mtp_num_layers})"
        )
    if mtp_num_layers is None:
        mtp_num_layers = facts.mtp_num_layers or load_exemplar().policy.megatron_cfg.mtp_num_layers
    require(
        cfg.policy.max_total_sequence_length <= facts.max_position_embeddings,
        "policy.max_total_sequence_length",
        cfg.policy.max_total_sequence_length,
        f"exceeds the {facts.max_position_embeddings} positions {facts.model_name} was built for",
    )
    resolved = OmegaConf.merge(cfg, {"policy": {"megatron_cfg": {**facts.architecture_keys, "mtp_num_layers": mtp_num_layers}}})
    check_config(resolved)
    OmegaConf.set_readonly(resolved, True)
    return resolved


def _leaf_keys(layer: DictConfig) -> set[str]:
    """Dotted keys of every leaf a config layer sets."""

    def walk(node, prefix):
        for key, value in node.items():
            if isinstance(value, dict):
                yield from walk(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}"

    return set(walk(OmegaConf.to_container(layer), ""))


def _load_yaml_with_defaults(path: Path, _seen: tuple[Path, ...] = ()) -> DictConfig:
    """A YAML file merged over the files its ``defaults:`` key names (relative to it). The bare name
    of the exemplar (``defaults: grpo_mtp.yaml``) names the packaged exemplar wherever the recipe
    lives; it is skipped here because the exemplar is always the base layer."""
    path = path.resolve()
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path in _seen:
        raise ConfigError(f"defaults cycle: {' -> '.join(map(str, _seen + (path,)))}")
    try:
        raw = OmegaConf.load(path)
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        raise ConfigError(f"{path}: not valid YAML{line}: {getattr(error, 'problem', None) or error}") from None
    if not isinstance(raw, DictConfig):
        raise ConfigError(f"{path}: top level must be a mapping")
    parents = raw.pop("defaults", None)
    if parents is None:
        return raw
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, (list, ListConfig)):
        raise ConfigError(f"{path}: defaults must be a file name or a list of them, got {parents!r}")
    merged = OmegaConf.create()
    for parent in parents:
        if str(parent) == EXEMPLAR_CONFIG.name:
            continue  # the exemplar is always the base layer
        parent_path = (path.parent / str(parent)).resolve()
        merged = OmegaConf.merge(merged, _load_yaml_with_defaults(parent_path, _seen + (path,)))
    return OmegaConf.merge(merged, raw)


def _parse_overrides(overrides: Iterable[str]) -> DictConfig:
    for override in overrides:
        if "=" not in override or override.startswith("="):
            raise ConfigError(f"override {override!r} is not of the form key=value")
    for override in overrides:  # one at a time, to name the one that is not YAML
        try:
            yaml.safe_load(override.split("=", 1)[1])
        except yaml.YAMLError as error:
            raise ConfigError(
                f"override {override!r}: its value is not YAML ({getattr(error, 'problem', None) or error}); quote it, "
                f"e.g. {override.split('=', 1)[0]}='\"{override.split('=', 1)[1]}\"'"
            ) from None
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as error:
        raise ConfigError(f"command-line overrides: {_describe(error)}") from None


def _describe(error: OmegaConfBaseException) -> str:
    key = getattr(error, "full_key", None)
    message = str(error).splitlines()[0]
    return f"{key}: {message}" if key else message
