"""How a command-line run ends: signals turned into an orderly unwind, errors as one line.

The first SIGINT (Ctrl-C) or SIGTERM (a scheduler's stop, ``kill``) raises KeyboardInterrupt or
:class:`Terminated` in the driver, so the same ``finally`` blocks run for both: the logger
closes its files, the workers and placement group are released and Ray's processes are
stopped, instead of a crash dump and Ray processes that linger until they notice the driver is
gone. Later signals are ignored so they cannot cut that clean-up short: Ctrl-C reaches the
driver twice under ``uv run`` (from the terminal, and forwarded by uv)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import warnings
from typing import Callable, Iterator, NoReturn

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


# What a process that ends with os._exit must still undo: a start held in C++ code, abandoned by a
# watchdog thread, ends that way, and then no finally block and no atexit handler runs.
_UNDO_ON_HARD_EXIT: list[Callable[[], None]] = []


@contextlib.contextmanager
def undone_on_hard_exit(undo: Callable[[], None]) -> Iterator[None]:
    """While the block runs, ``undo()`` is called by :func:`hard_exit` (a run's claimed
    directory, still empty, is given back so)."""
    _UNDO_ON_HARD_EXIT.append(undo)
    try:
        yield
    finally:
        _UNDO_ON_HARD_EXIT.remove(undo)


def hard_exit(status: int) -> NoReturn:
    """``os._exit(status)`` (from a thread other than the held main thread), after what
    :func:`undone_on_hard_exit` registered, newest first; an undo that fails is skipped."""
    _undo_all()
    os._exit(status)


def _undo_all() -> None:
    for undo in reversed(_UNDO_ON_HARD_EXIT):
        with contextlib.suppress(Exception):
            undo()


# The command that runs this process again, from the start; set by an entry point run as a
# program (a library caller, such as a test calling ``cli.main(argv)``, is never replaced).
_RESTART_COMMAND: list[str] = []
# How many times this run has been started (1: this is its first process), across restarts.
START_ATTEMPT_ENV = "NEMO_RL_MTP_START_ATTEMPT"


def restartable_as(command: list[str]) -> None:
    """Let :func:`hard_restart` replace this process by ``command`` (argv, absolute interpreter
    first)."""
    _RESTART_COMMAND[:] = command


def can_restart() -> bool:
    return bool(_RESTART_COMMAND)


def start_attempt() -> int:
    """This process's attempt at the run: 1, or one more than the process it replaced."""
    return int(os.environ.get(START_ATTEMPT_ENV, "1"))


def hard_restart(line: str) -> NoReturn:
    """Replace this process by the restart command (``os.execv``: from any thread, the main
    thread held in C++ included), after what :func:`undone_on_hard_exit` registered and ``line``
    on stderr; the new process's :func:`start_attempt` is one more."""
    _undo_all()
    print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.environ[START_ATTEMPT_ENV] = str(start_attempt() + 1)
    os.execv(_RESTART_COMMAND[0], _RESTART_COMMAND)


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

# Third-party output with no action for a user of this project, each by its message (all shown
# again with --verbose); anything else they say still reaches the console.
_QUIET_WARNINGS = (
    # megatron-core on a machine without transformer_engine or apex (expected on CPU).
    dict(category=UserWarning, message=r"(Transformer Engine and Apex are not installed|Apex is not installed)\. Falling back"),
    dict(category=UserWarning, message=r"Only transformer-engine>=\S+ supports MoE experts"),
    # megatron-core's notice about its multimodal MimoModelConfig, printed when megatron-bridge imports it.
    dict(category=UserWarning, message=r"MimoModelConfig is experimental"),
    # Invalid escape sequences in megatron's docstrings, reported when its modules compile.
    dict(category=SyntaxWarning, message=r"invalid escape sequence"),
)
# Log records, by the logger that makes them and the start of their message.
_QUIET_RECORDS = {
    "megatron.core.models.gpt.gpt_model": ("GPTModel IS DEPRECATED",),  # once per worker
    "megatron.core.dist_checkpointing.strategies.torch": ("MCore's async save is deprecated",),  # our saves are synchronous
    "torch.utils.cpp_extension": ("No CUDA runtime is found",),  # expected on CPU
    "ray._private.authentication.authentication_token_setup": ("Token authentication is enabled",),  # a local instance's notice
    # megatron-bridge: the reminder about trust_remote_code, which the config asked for; fusions
    # that need TE or apex (expected on CPU); its own transformers calls' dtype deprecation.
    "megatron.bridge.models.conversion.auto_bridge": ("Loading a model with trust_remote_code=True",),
    "megatron.bridge.utils.fusions": ("gradient_accumulation_fusion requires",),
    # Optional TE symbols megatron-bridge tries (this logger prints through a handler of its own).
    "megatron.bridge.utils.import_utils": ("Import of ",),
    "transformers.configuration_utils": ("`torch_dtype` is deprecated",),
    "transformers.modeling_utils": ("`torch_dtype` is deprecated",),
}
# Loggers whose INFO lines are chatter (warnings and errors still show).
_QUIET_INFO = ("megatron.core.distributed.fsdp", "megatron.bridge")


class _DropMessages(logging.Filter):
    """Drops the records whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def quiet_third_party_output() -> None:
    """Filter the output listed above, unless ``--verbose`` asked for everything (idempotent)."""
    if os.environ.get(VERBOSE_ENV) == "1":
        return
    for rule in _QUIET_WARNINGS:
        warnings.filterwarnings("ignore", **rule)
    for name, prefixes in _QUIET_RECORDS.items():
        named = logging.getLogger(name)
        if not any(isinstance(existing, _DropMessages) for existing in named.filters):
            named.addFilter(_DropMessages(prefixes))
    for name in _QUIET_INFO:
        logging.getLogger(name).setLevel(logging.WARNING)
    os.environ.setdefault("WANDB_SILENT", "true")
