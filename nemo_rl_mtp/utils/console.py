"""How a command-line run ends: signals turned into an orderly unwind, errors as one line.

The first SIGINT (Ctrl-C) or SIGTERM (a scheduler's stop, ``kill``) raises KeyboardInterrupt or
:class:`Terminated` in the driver, so the same ``finally`` blocks run for both: the logger
closes its files, the workers and placement group are released and Ray's processes are
stopped, instead of a crash dump and Ray processes that linger until they notice the driver is
gone. Later signals are ignored so they cannot cut that clean-up short: Ctrl-C reaches the
driver twice under ``uv run`` (from the terminal, and forwarded by uv)."""

from __future__ import annotations

import signal

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
