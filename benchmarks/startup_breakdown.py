"""Where a local run's time goes before its first GRPO step: ``examples/run_grpo.py`` (the
default recipe, one GRPO step unless overridden) started as a user starts it, its phases read
from the driver's own log lines as they arrive, quiet or next to a busy loop on every core.

    uv run python -m benchmarks.startup_breakdown [--busy [--busy-limit-s 3600]] [key=value ...]

Phases: interpreter, imports, config, tokenizer and task (until "starting a local Ray
instance"); Ray start (until "started a local Ray instance"); the policy workers (placement,
worker processes, megatron model build, rollout engine build with its probes; until "policy:");
the warm start's imitation steps (until "warm start:"); the first GRPO step (until its row in
metrics.jsonl). The config load alone (its imports and checks) is timed in a process of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

REPO_ROOT = Path(__file__).resolve().parents[1]
# The driver's log line that ends each phase, in order.
MARKERS = (
    ("interpreter, imports, config, tokenizer, task", "starting a local Ray instance"),
    ("Ray start", "started a local Ray instance"),
    ("workers: placement, start, model and engine build", "policy: "),
    ("warm start (imitation steps)", "warm start: "),
)
CONFIG_ALONE = (
    "import time; start = time.monotonic()\n"
    "from nemo_rl_mtp.config.load import load_config\n"
    "load_config(sys.argv[1]); print(time.monotonic() - start)\n"
)


def _spin(stop_at: float) -> None:
    while time.monotonic() < stop_at:
        pass


@contextlib.contextmanager
def busy_cores(enabled: bool, limit_s: float = 1800) -> Iterator[None]:
    """One busy-loop process per core while the block runs (each ends by itself after
    ``limit_s`` at the latest, and is killed when the block ends)."""
    if not enabled:
        yield
        return
    spinners = [multiprocessing.Process(target=_spin, args=(time.monotonic() + limit_s,), daemon=True) for _ in range(os.cpu_count() or 1)]
    for spinner in spinners:
        spinner.start()
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.join()


def config_load_s(recipe: Path) -> float:
    completed = subprocess.run([sys.executable, "-c", "import sys\n" + CONFIG_ALONE, str(recipe)], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    return float(completed.stdout.split()[-1])


def _load() -> float:
    return os.getloadavg()[0]


def run_phases(overrides: list[str]) -> tuple[list[tuple[str, float, float]], float, int]:
    """The phases of one run (name, seconds, the 1-minute load average as it ended), its time to
    the first step's row, its exit status. The load is given because the machine may be shared:
    a phase's time means little without it."""
    with tempfile.TemporaryDirectory() as log_dir:
        metrics = Path(log_dir) / "startup" / "metrics.jsonl"
        command = [
            sys.executable, str(REPO_ROOT / "examples" / "run_grpo.py"), "grpo.max_num_steps=1", "logger.console=false",
            f"logger.log_dir={log_dir}", "logger.run_name=startup", *overrides,
        ]  # fmt: skip
        start = time.monotonic()
        process = subprocess.Popen(command, cwd=REPO_ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        seen: dict[str, tuple[float, float]] = {}
        first_step: list[tuple[float, float]] = []

        def watch_metrics() -> None:
            while process.poll() is None and not first_step:
                if metrics.exists() and metrics.read_text().strip():
                    first_step.append((time.monotonic() - start, _load()))
                time.sleep(0.2)

        watcher = threading.Thread(target=watch_metrics, daemon=True)
        watcher.start()
        for line in process.stderr:
            for _, marker in MARKERS:
                if marker in line and marker not in seen:
                    seen[marker] = (time.monotonic() - start, _load())
                    # As it happens, so a run stopped before its first step still tells where it was.
                    print(f"  [{seen[marker][0]:6.1f} s, load {seen[marker][1]:.1f}] {marker.strip()}", file=sys.stderr, flush=True)
        status = process.wait()
        watcher.join()
    phases, previous = [], 0.0
    for name, marker in MARKERS:
        if marker in seen:
            at, load = seen[marker]
            phases.append((name, at - previous, load))
            previous = at
    total, load = first_step[0] if first_step else (float("nan"), _load())
    phases.append(("first GRPO step", total - previous, load))
    return phases, total, status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", action="store_true", help="one busy-loop process per core throughout")
    parser.add_argument(
        "--busy-limit-s", type=float, default=3600,
        help="the busy loops end by themselves after this long (a loaded start can take over 15 minutes)",
    )  # fmt: skip
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    recipe = REPO_ROOT / "examples" / "configs" / "grpo_mtp_tiny_cpu.yaml"
    load_at_start = _load()
    with busy_cores(args.busy, limit_s=args.busy_limit_s):
        alone = config_load_s(recipe)
        phases, total, status = run_phases(args.overrides)
    print(f"{'busy loop on each core' if args.busy else 'quiet'}; load average {load_at_start:.1f} at the start, {_load():.1f} at the end, on {os.cpu_count()} CPUs; exit status {status}")
    print(f"  config load alone (imports, checks): {alone:6.1f} s")
    for name, seconds, load in phases:
        print(f"  {name:50s} {seconds:6.1f} s  (load {load:.1f} at its end)")
    print(f"  {'to the first GRPO step':50s} {total:6.1f} s")


if __name__ == "__main__":
    main()
