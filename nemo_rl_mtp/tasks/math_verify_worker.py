"""math-verify in a child process, so that every equivalence check ends within a wall-clock limit.

Why a process: math-verify bounds its own work with ``signal.alarm``, which counts whole seconds,
works only in the main thread (elsewhere parse and verify raise), and interrupts only Python code
between bytecodes (C code that does not poll for signals runs on). A child process that is killed
at the deadline bounds a check whatever it is doing, from any thread of the caller, and a crash or
a memory blow-up inside sympy stays in the child. Checks are sub-millisecond to a few
milliseconds, so one child answering them one at a time is enough; a check that runs out of time
costs the limit, and the next check waits for a fresh child (about 2 s on a 2-core CPU).

The parent side (:class:`MathVerifyProcess`) imports only the standard library; the child runs
this file as a script (:func:`serve`), so it imports math-verify and nothing of the package.
Protocol: one JSON object a line. The child writes ``{"ready": true}`` once warmed up, then
answers each ``{"answer": ..., "reference": ...}`` with ``{"equivalent": bool}``.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
import weakref
from typing import Literal, Optional

logger = logging.getLogger(__name__)

#: How long a fresh child may take to import math-verify and warm up its parser.
STARTUP_TIMEOUT_S = 120.0

Outcome = Literal["equivalent", "not_equivalent", "timed_out", "worker_died"]


def as_latex_math(text: str) -> str:
    """``text`` as inline LaTeX math, the form in which math-verify's LaTeX extraction reads an
    answer whole: plain numbers, ``\\frac{1}{2}``, ``1,000``, ``5 \\text{ cm}`` and ``42.`` all
    parse this way (wrapped as ``\\boxed{42.}`` instead, math-verify keeps ``42.`` as a string
    that equals nothing)."""
    return f"${text}$"


class MathVerifyProcess:
    """A math-verify child process, started on construction and again after a check that ran out of
    time (it is killed then) or during which it died.

    Not safe for concurrent use from several threads (one check at a time), but usable from any
    one thread. On Linux the child is killed when the thread that started it ends, so that a
    check stuck in sympy never outlives the driver.
    """

    def __init__(self, timeout_s: float):
        self.timeout_s = float(timeout_s)
        self._process: Optional[subprocess.Popen] = None
        self._buffer = b""
        self._start()

    def check(self, answer: str, reference: str) -> Outcome:
        """Whether ``answer`` is mathematically equivalent to ``reference`` (both as text),
        decided by math-verify within ``timeout_s`` seconds of wall-clock time."""
        if self._process is None or self._process.poll() is not None:
            self._start()
        request = json.dumps({"answer": answer, "reference": reference}) + "\n"
        try:
            self._process.stdin.write(request.encode())
            self._process.stdin.flush()
        except BrokenPipeError:
            self._stop()
            return "worker_died"
        try:
            reply = self._read_line(time.monotonic() + self.timeout_s)
        except EOFError:
            logger.warning("the math-verify worker died during a check (exit code %s); starting another", self._process.wait())
            self._stop()
            return "worker_died"
        if reply is None:
            logger.warning("a math-verify check ran past %.3g s; its worker was killed", self.timeout_s)
            self._stop()
            return "timed_out"
        return "equivalent" if reply["equivalent"] else "not_equivalent"

    def close(self) -> None:
        """End the child (it is also ended when this object is collected or the interpreter exits)."""
        self._stop()

    def _start(self) -> None:
        self._stop()
        self._process = subprocess.Popen(
            [sys.executable, __file__, str(os.getpid())], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self._finalizer = weakref.finalize(self, _kill, self._process)
        try:
            ready = self._read_line(time.monotonic() + STARTUP_TIMEOUT_S)
        except EOFError:
            code = self._process.wait()
            self._stop()
            raise RuntimeError(f"the math-verify worker process exited while starting (exit code {code}); its error is above") from None
        if ready is None:
            self._stop()
            raise RuntimeError(f"the math-verify worker process did not start within {STARTUP_TIMEOUT_S:.0f} s")

    def _stop(self) -> None:
        if self._process is not None:
            self._finalizer()
            self._process = None
        self._buffer = b""

    def _read_line(self, deadline: float) -> Optional[dict]:
        """The child's next reply; None if none came by ``deadline`` (``time.monotonic()``);
        EOFError if the child's output ended (it died)."""
        fd = self._process.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise EOFError
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.wait()
    for pipe in (process.stdin, process.stdout):
        pipe.close()


def serve(parent_pid: int) -> None:
    """The child: answer checks from stdin until it closes."""
    # Replies go to a private copy of stdout; anything printed by the libraries goes to stderr.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it ends us.
    _die_with_parent_thread(parent_pid)

    from math_verify import parse, verify

    # The parent bounds each check by killing this process, so math-verify's own signal-based
    # limits are switched off (and so is its warning that they are).
    logging.getLogger("math_verify").setLevel(logging.ERROR)

    def equivalent(answer: str, reference: str) -> bool:
        gold = parse(as_latex_math(reference), parsing_timeout=None)
        target = parse(as_latex_math(answer), parsing_timeout=None)
        return verify(gold, target, timeout_seconds=None)

    equivalent("1", "1")  # loads the LaTeX parser, so the first real check is not charged for it
    print(json.dumps({"ready": True}), file=replies, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        print(json.dumps({"equivalent": equivalent(request["answer"], request["reference"])}), file=replies, flush=True)


def _die_with_parent_thread(parent_pid: int) -> None:
    """Have the kernel kill this process when the parent's thread that started it ends (Linux)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent ended before the request was made
        os._exit(0)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
