"""Python code run in a fresh interpreter, so that what the test process imported already does not
count; the code prints one JSON line last, which is returned."""

from __future__ import annotations

import json
import subprocess
import sys


def json_report(code: str, *args: str, timeout_s: float = 600) -> dict:
    """Run ``code`` (``python -c code *args``); fail with its stderr unless it exits 0; return the
    JSON object on its last line of output."""
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
