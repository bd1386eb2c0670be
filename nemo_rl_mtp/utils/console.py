"""How a command-line run ends: signals turned into an orderly unwind, errors as one line.

The first SIGINT (Ctrl-C) or SIGTERM (a scheduler's stop, ``kill``) raises KeyboardInterrupt or
:class:`Terminated` in the driver, so the same ``finally`` blocks run for both: the logger
closes its files, the workers and placement group are released and Ray's processes are
stopped, instead of a crash dump and Ray processes that linger until they notice the driver is
gone. Later signals are ignored so they cannot cut that clean-up short: Ctrl-C reaches the
driver twice under ``uv run`` (from the terminal, and forwarded by uv)."""

from __future__ import annotations

import logging
import os
import signal
import warnings

EXIT_CONFIG_ERROR = 2
EXIT_ERROR = 1


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the driver happens to be, like KeyboardInterrupt for SIGINT."""


def _interrupt_once(signum, frame) -> None:
    for handled in (signal.SIGINT, signal.SIGTERM):
        signal.signal(handled, signal.SIG_IGN)
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def interrupt_once_on_signals() -> None:
    """Install the handler of the first SIGINT / SIGTERM (main thread only)."""
    for handled in (signal.SIGINT, signal.SIGTERM):
        signal.signal(handled, _interrupt_once)


def interrupt_exit_status(interrupt: KeyboardInterrupt) -> int:
    """128 + the signal number, as shells report a process ended by that signal."""
    return 128 + (signal.SIGTERM if isinstance(interrupt, Terminated) else signal.SIGINT)


def one_line(error: BaseException) -> str:
    """``Type: first line of the message`` of the error a worker raised (Ray wraps it, with the
    worker's traceback, in a RayTaskError whose ``cause`` is the original) or of ``error``."""
    cause = getattr(error, "cause", None)
    if not isinstance(cause, BaseException):
        cause = error
    lines = [line for line in str(cause).splitlines() if line.strip()]
    return f"{type(cause).__name__}: {lines[0].strip() if lines else ''}"


# Set by the command line's --verbose; read by the driver and (through the inherited environment)
# by the local Ray workers.
VERBOSE_ENV = "NEMO_RL_MTP_VERBOSE"

# Third-party output with no action for a user of this project (all shown again with --verbose).
_QUIET_WARNINGS = (
    # "Transformer Engine and Apex are not installed. Falling back to ..." (expected on CPU),
    # megatron's MiMo/TransformerConfig notices.
    dict(category=UserWarning, module=r"megatron\."),
    # Invalid escape sequences in megatron's docstrings, reported when its modules compile.
    dict(category=SyntaxWarning, message=r"invalid escape sequence"),
)
_QUIET_LOGGERS = {
    "megatron.core.models.gpt.gpt_model": logging.ERROR,  # "GPTModel IS DEPRECATED", once per worker
    "megatron.core.distributed.fsdp": logging.WARNING,  # Megatron-FSDP detection (FSDP is not used)
    "megatron.core.dist_checkpointing.strategies.torch": logging.ERROR,  # "MCore's async save is deprecated"
    "torch.utils.cpp_extension": logging.ERROR,  # "No CUDA runtime is found" (expected on CPU)
    "ray._private.authentication": logging.ERROR,  # token authentication notice of a local instance
    # megatron-bridge: its trust_remote_code reminder (the config asked for it), fusions unavailable
    # on CPU, FlexAttention notices, failed optional imports of TE symbols.
    "megatron.bridge": logging.ERROR,
    "transformers": logging.ERROR,  # "`torch_dtype` is deprecated" from megatron-bridge's own calls
}


def quiet_third_party_output() -> None:
    """Filter the output listed above, unless ``--verbose`` asked for everything (idempotent)."""
    if os.environ.get(VERBOSE_ENV) == "1":
        return
    for rule in _QUIET_WARNINGS:
        warnings.filterwarnings("ignore", **rule)
    for name, level in _QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)
    os.environ.setdefault("WANDB_SILENT", "true")
