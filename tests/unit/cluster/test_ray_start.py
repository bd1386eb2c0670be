"""Starting Ray on a busy machine: a local start with Ray's start-up settings (a user's own
variable wins), and a start bounded by ``cluster.start_timeout_s`` or ended by SIGTERM even while
the main thread is held in C code, in one line, leaving no process the start began."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from nemo_rl_mtp.cluster.ray_cluster import init_ray, shutdown_ray
from nemo_rl_mtp.config.load import load_config

REPO_ROOT = Path(__file__).resolve().parents[3]


def _descendants(before: frozenset = frozenset()) -> list[psutil.Process]:
    """This process's children, less those running ``before`` (another test's wandb-core, say)."""
    return [process for process in psutil.Process().children(recursive=True) if process.pid not in before]


@pytest.mark.slow
def test_a_local_start_sets_rays_start_up_settings_and_a_users_own_variable_wins(monkeypatch, caplog):
    """The raylet, started by a real ``ray.init``, runs with our settings and the user's value of
    the variable the user set; the driver's environment is as it was afterwards. Its workers'
    tensors sit in huge pages (PyTorch's ``THP_MEM_ALLOC_ENABLE``), where the kernel gives them
    on request and a Python started without the setting gets none."""
    import ray

    assert not ray.is_initialized()
    earlier = frozenset(process.pid for process in _descendants())
    monkeypatch.setenv("RAY_worker_register_timeout_seconds", "77")
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)  # ours, not a value of the machine's
    cluster = load_config(overrides=["cluster.start_timeout_s=150"]).cluster
    try:
        with caplog.at_level(logging.INFO, logger="nemo_rl_mtp.cluster.ray_cluster"):
            init_ray(cluster)
        raylets = [process for process in _descendants(earlier) if "raylet" in " ".join(process.cmdline()[:1])]
        assert len(raylets) == 1, [process.cmdline()[:1] for process in _descendants(earlier)]
        environment = raylets[0].environ()
        assert environment["RAY_worker_register_timeout_seconds"] == "77"
        assert environment["RAY_raylet_start_wait_time_s"] == "150"
        assert environment["RAY_USAGE_STATS_ENABLED"] == "0"
        assert "RAY_raylet_start_wait_time_s" not in os.environ
        assert os.environ["RAY_worker_register_timeout_seconds"] == "77"
        assert "Ray start-up settings: RAY_raylet_start_wait_time_s=150" in caplog.text
        assert "settings of your own, kept: RAY_worker_register_timeout_seconds=77" in caplog.text
        assert "workers' settings: THP_MEM_ALLOC_ENABLE=1" in caplog.text
        assert environment["THP_MEM_ALLOC_ENABLE"] == "1" and "THP_MEM_ALLOC_ENABLE" not in os.environ
        if THP_MODE in ("madvise", "always"):
            _assert_workers_tensors_sit_in_huge_pages()
    finally:
        shutdown_ray()
    assert psutil.wait_procs(_descendants(earlier), timeout=30)[1] == []  # what the start began is gone


def _transparent_huge_pages_mode() -> str | None:
    """The kernel's transparent-huge-pages mode (the bracketed word), None where it has none."""
    try:
        return re.search(r"\[(\w+)\]", Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()).group(1)
    except (OSError, AttributeError):
        return None


THP_MODE = _transparent_huge_pages_mode()
# Run in a Ray worker and in a fresh Python: a filled 64 MB tensor's memory in huge pages (kB), as
# /proc/self/smaps counts it for the mapping that holds it. Compiled under a module name no one can
# import, so that Ray ships the function itself rather than a reference to this test module.
HUGE_PAGES_PROBE = textwrap.dedent(
    """
    def huge_pages_kb():
        import os, re, torch
        tensor = torch.ones(16 * 2**20)
        address, inside = tensor.data_ptr(), False
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                header = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
                if header:
                    inside = int(header.group(1), 16) <= address < int(header.group(2), 16)
                elif inside and line.startswith("AnonHugePages:"):
                    return os.environ.get("THP_MEM_ALLOC_ENABLE"), int(line.split()[1])
        return os.environ.get("THP_MEM_ALLOC_ENABLE"), 0
    """
)


def _assert_workers_tensors_sit_in_huge_pages() -> None:
    """A worker's 64 MB tensor mostly in huge pages; the control, the same tensor in a Python
    started without the setting, in none where the kernel's mode is ``madvise`` (under ``always``
    every process gets them)."""
    import ray

    namespace = {"__name__": "huge_pages_probe"}
    exec(HUGE_PAGES_PROBE, namespace)
    setting, worker_kb = ray.get(ray.remote(num_cpus=0)(namespace["huge_pages_kb"]).remote(), timeout=300)
    assert setting == "1" and worker_kb >= 32 * 1024, (setting, worker_kb)
    environment = {name: value for name, value in os.environ.items() if name != "THP_MEM_ALLOC_ENABLE"}
    control = HUGE_PAGES_PROBE + "\nprint(*huge_pages_kb())"
    setting, control_kb = subprocess.run([sys.executable, "-c", control], env=environment, capture_output=True, text=True, check=True, timeout=300).stdout.split()
    assert setting == "None" and (int(control_kb) == 0 or THP_MODE == "always"), (setting, control_kb)


# A start that never returns, holding the main thread in C code where no Python signal handler
# runs (as Ray's core worker was seen to, for minutes): a second lock of a plain pthread mutex,
# with the GIL released. Before it, the "start" begins a process of its own, as ray.init does,
# and a directory to be given back if the process is abandoned, as a run's claimed directory is.
HELD_START = textwrap.dedent(
    """
    import ctypes, os, subprocess, sys
    from nemo_rl_mtp.cluster.ray_cluster import bounded_start
    from nemo_rl_mtp.reporting.console import interrupt_once_on_signals, undone_on_hard_exit

    interrupt_once_on_signals()
    libc = ctypes.CDLL(None)
    mutex = ctypes.create_string_buffer(64)  # PTHREAD_MUTEX_INITIALIZER: zeros
    os.mkdir(sys.argv[2])
    with undone_on_hard_exit(lambda: os.rmdir(sys.argv[2])), bounded_start(float(sys.argv[1]), "start"):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        print(child.pid, flush=True)
        libc.pthread_mutex_lock(mutex)
        libc.pthread_mutex_lock(mutex)
    """
)


def _held_start(limit_s: float, claimed: Path) -> tuple[subprocess.Popen, int]:
    process = subprocess.Popen(
        [sys.executable, "-c", HELD_START, str(limit_s), str(claimed)], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    return process, int(process.stdout.readline())


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_start_that_hangs_ends_after_the_limit_in_one_line_leaving_nothing(tmp_path):
    process, child = _held_start(3, tmp_path / "claimed")
    start = time.monotonic()
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 1, stderr
    assert time.monotonic() - start < 20
    assert stderr.strip().splitlines()[-1].startswith("error: RayStartError: cluster: Ray did not start within 3 s; load average")
    assert "raise cluster.start_timeout_s (now 3)" in stderr
    assert _gone(child)
    assert not (tmp_path / "claimed").exists()


def test_a_sigterm_while_the_start_holds_the_main_thread_exits_143_leaving_nothing(tmp_path):
    process, child = _held_start(300, tmp_path / "claimed")
    time.sleep(0.5)  # in the held lock
    start = time.monotonic()
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert time.monotonic() - start < 20
    assert stderr.strip().splitlines()[-1].startswith("interrupted: the run had not started"), stderr
    assert _gone(child)
    assert not (tmp_path / "claimed").exists()


def test_a_start_that_raises_stops_what_it_began_and_says_so_in_one_line():
    from nemo_rl_mtp.cluster.ray_cluster import RayStartError, bounded_start

    with pytest.raises(RayStartError, match=r"Ray failed to start after \d+ s \(Exception: The current node timed out\)"):
        with bounded_start(60, "start"):
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
            raise Exception("The current node timed out\nduring startup")
    assert _gone(child.pid)


# Only Ray's dashboard agent is slowed, by a sitecustomize module on its PYTHONPATH: as an agent
# importing on a loaded machine is.
SLOW_AGENT = 'import sys, time\nif any("dashboard/agent.py" in argument for argument in sys.argv):\n    time.sleep(40)\n'
START = "from nemo_rl_mtp.cluster.ray_cluster import init_ray\nfrom nemo_rl_mtp.config.load import load_config\ninit_ray(load_config(overrides=['cluster.start_timeout_s=600']).cluster)\n"


@pytest.mark.slow
def test_a_start_whose_raylet_dies_ends_then_in_one_line_naming_why_leaving_nothing(tmp_path):
    """Ray 2.60's raylet aborts when its dashboard agent has not written its ports within 15 s
    (fixed in Ray), which a loaded machine caused for three runs started side by side; the driver
    then waited for it until cluster.start_timeout_s. The start ends when the raylet dies, naming
    the agent, and no process of its Ray session is left (the agent outlives the raylet)."""
    (tmp_path / "sitecustomize.py").write_text(SLOW_AGENT)
    environment = {**os.environ, "PYTHONPATH": str(tmp_path)}
    completed = subprocess.run([sys.executable, "-c", START], cwd=REPO_ROOT, env=environment, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 1, completed.stderr[-3000:]
    line = completed.stderr.strip().splitlines()[-1]
    assert line.startswith("error: RayStartError: cluster: Ray failed to start after"), line
    assert "its raylet exited (its dashboard agent did not write metrics_agent_port within the raylet's fixed 15 s" in line
    session = line.split("; /", 1)[1].split("/logs/raylet.err", 1)[0]
    left = [process for process in psutil.process_iter() if _names(process, "/" + session)]
    assert left == [], [process.cmdline()[:2] for process in left]


# The agent slowed in the first process only; the process that replaces it starts as usual.
SLOW_FIRST_AGENT = (
    'import os, sys, time\nif any("dashboard/agent.py" in argument for argument in sys.argv) and "NEMO_RL_MTP_START_ATTEMPT" not in os.environ:\n'
    "    time.sleep(40)\n"
)
RESTARTABLE_START = (
    "import sys\nfrom nemo_rl_mtp.reporting import console\nconsole.restartable_as([sys.executable, *sys.orig_argv[1:]])\n"
    + START
    + "import ray\nprint('started on attempt', console.start_attempt(), flush=True)\nray.shutdown()\n"
)


@pytest.mark.slow
def test_a_program_whose_raylet_dies_waiting_for_its_agent_starts_again_in_a_new_process(tmp_path):
    """Where the entry point may be run again (a program, not a library call: the test above is
    the control), a start whose raylet died because its dashboard agent missed Ray's fixed 15 s
    is made again in a new process, which here starts Ray; it says so in one line, and nothing
    of the failed attempt's Ray session is left."""
    (tmp_path / "sitecustomize.py").write_text(SLOW_FIRST_AGENT)
    environment = {**os.environ, "PYTHONPATH": str(tmp_path)}
    environment.pop("NEMO_RL_MTP_START_ATTEMPT", None)
    completed = subprocess.run(
        [sys.executable, "-c", RESTARTABLE_START], cwd=REPO_ROOT, env=environment, capture_output=True, text=True, timeout=600
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.strip().splitlines()[-1] == "started on attempt 2", completed.stdout[-2000:]
    warnings = [line for line in completed.stderr.splitlines() if line.startswith("warning: cluster: Ray failed to start after")]
    assert len(warnings) == 1, completed.stderr[-3000:]
    assert "its dashboard agent did not write metrics_agent_port within the raylet's fixed 15 s" in warnings[0]
    assert "starting the run again in a new process" in warnings[0] and "(attempt 2 of 3)" in warnings[0]
    session = warnings[0].split("; /", 1)[1].split("/logs/raylet.err", 1)[0]
    left = [process for process in psutil.process_iter() if _names(process, "/" + session)]
    assert left == [], [process.cmdline()[:2] for process in left]


def _stand_in(tmp_path: Path, name: str, seconds: float, *flags: str) -> subprocess.Popen:
    """A child process whose name is ``name`` (a script of that name: the kernel names a process
    after the file it runs) with ``flags`` on its command line, living ``seconds``. Not reaped
    until the test ends: it stays a zombie once it exits, as a raylet stays until Ray reaps it."""
    script = tmp_path / name
    script.write_text(f"#!/bin/sh\nsleep {seconds}\n")
    script.chmod(0o755)
    return subprocess.Popen([str(script), *flags])


def _wait_until_zombie(process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 30
    while psutil.Process(process.pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the stand-in did not exit"
        time.sleep(0.05)


def test_a_raylet_first_seen_once_it_has_exited_is_reported_with_its_sessions_stderr_file(tmp_path):
    """Under a load of 18 on 2 CPUs the watchdog first saw a raylet that had already died (its
    command line, which names its stderr file, no longer readable) and reported it without its
    reason, so the start was not made again. Its stderr file is then found from the session
    directory on the GCS server's command line; the control, a raylet seen while it ran, is
    reported with the file its own command line names."""
    from nemo_rl_mtp.cluster.ray_cluster import RayletWatch

    session = tmp_path / "session_2026-12-05_15-44-23_224107_17099"
    (tmp_path / "control").mkdir()
    processes = []
    try:
        watch = RayletWatch(time.time())
        processes.append(_stand_in(tmp_path, "gcs_server", 60, f"--session-dir={session}"))
        processes.append(_stand_in(tmp_path, "raylet", 0, f"--stderr_filepath={session}/logs/raylet.err"))
        _wait_until_zombie(processes[-1])
        assert _command_line(processes[-1]) == []  # what the watchdog saw
        assert watch.death() == str(session / "logs" / "raylet.err")
        processes[-1].wait()  # reaped: the control's watch must not see it

        control = RayletWatch(time.time())
        processes.append(_stand_in(tmp_path / "control", "raylet", 2, "--stderr_filepath=/elsewhere/raylet.err"))
        deadline = time.monotonic() + 30
        while processes[-1].pid not in control.seen:
            assert control.death() is None and time.monotonic() < deadline
            time.sleep(0.05)
        _wait_until_zombie(processes[-1])
        assert control.death() == "/elsewhere/raylet.err"
    finally:
        for process in processes:
            process.kill()
            process.wait()


# A raylet stand-in that forks a child which exits at once, unreaped: a zombie that bears the
# raylet's name (as a raylet's fork does until it runs its program), under a live raylet.
FORKING_RAYLET = "import os, sys, time\nif os.fork() == 0:\n    os._exit(0)\ntime.sleep(float(sys.argv[1]))\n"


def test_a_raylets_own_child_that_exits_is_not_taken_for_the_raylet_dying(tmp_path):
    """The first version of the fix above took a zombie child of the raylet, bearing its name,
    for the raylet dying, and stopped a live start (a CI run: "its raylet exited (no reason in its
    log ...)", both its logs silent). Such a child is not a raylet; the raylet above it, once it
    exits, is reported (the control)."""
    from nemo_rl_mtp.cluster.ray_cluster import RayletWatch

    session = tmp_path / "session"
    script = tmp_path / "raylet"
    script.write_text(f"#!{sys.executable}\n{FORKING_RAYLET}")
    script.chmod(0o755)
    watch = RayletWatch(time.time())
    processes = [_stand_in(tmp_path, "gcs_server", 60, f"--session-dir={session}")]
    processes.append(subprocess.Popen([str(script), "4", f"--stderr_filepath={session}/logs/raylet.err"]))
    try:
        deadline = time.monotonic() + 30
        while not [child for child in psutil.Process(processes[-1].pid).children() if child.status() == psutil.STATUS_ZOMBIE]:
            assert time.monotonic() < deadline, "the raylet stand-in's child did not exit"
            time.sleep(0.05)
        child = psutil.Process(processes[-1].pid).children()[0]
        assert child.name() == "raylet" and psutil.Process(processes[-1].pid).name() == "raylet"
        for _ in range(5):
            assert watch.death() is None
            time.sleep(0.05)
        _wait_until_zombie(processes[-1])
        assert watch.death() == f"{session}/logs/raylet.err"
    finally:
        for process in processes:
            process.kill()
            process.wait()


def _command_line(process: subprocess.Popen) -> list[str]:
    try:
        return psutil.Process(process.pid).cmdline()
    except psutil.Error:
        return []


def _names(process: psutil.Process, text: str) -> bool:
    try:
        return any(text in argument for argument in process.cmdline())
    except psutil.Error:
        return False


def _hold_lock(lock_path, seconds: float) -> subprocess.Popen:
    """Another process holding the start lock for ``seconds`` (as another run's Ray start would);
    it says when it holds it."""
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import fcntl, sys, time\nf = open({str(lock_path)!r}, 'a+')\nfcntl.flock(f, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep({seconds})"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_local_starts_on_one_machine_take_turns(tmp_path, caplog):
    """A start waits while another process holds the lock, and goes on once that one lets go
    (here by exiting); with nobody holding it (the control) it goes on at once."""
    from nemo_rl_mtp.cluster.ray_cluster import one_local_start_at_a_time

    lock_path = tmp_path / "start.lock"
    started = time.monotonic()
    with one_local_start_at_a_time(10, lock_path):
        assert time.monotonic() - started < 1
    holder = _hold_lock(lock_path, 2)
    started = time.monotonic()
    with caplog.at_level("INFO"), one_local_start_at_a_time(30, lock_path):
        waited = time.monotonic() - started
    assert waited > 1, waited  # the holder slept 2 s after taking the lock
    holder.wait()
    assert "another run on this machine is starting its Ray instance" in caplog.text


def test_a_start_lock_held_past_the_limit_fails_in_one_line_naming_it(tmp_path):
    from nemo_rl_mtp.cluster.ray_cluster import RayStartError, one_local_start_at_a_time

    lock_path = tmp_path / "start.lock"
    holder = _hold_lock(lock_path, 30)
    try:
        with pytest.raises(RayStartError, match=rf"^cluster: another run on this machine held {lock_path}.*start_timeout_s=1 s"):
            with one_local_start_at_a_time(1, lock_path):
                pass
    finally:
        holder.kill()
        holder.wait()
