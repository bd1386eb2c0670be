"""The package's rooms import only downward, and nothing imports in a circle.

The layers are declared here and in ``docs/architecture.md``; the imports are read from the source
with ``ast`` (every ``import`` and ``from ... import``, module level or inside a function), so a
lazy import that climbs a layer fails too.
"""

from __future__ import annotations

from pathlib import Path

import nemo_rl_mtp
from tests.support import import_graph

PACKAGE = Path(nemo_rl_mtp.__file__).parent

# Top to bottom; a room may import its own modules and any room in a lower layer. Rooms that share
# a layer are independent of each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("cli",),
    ("grpo",),
    ("cluster",),
    ("rollout",),
    ("training", "tasks"),
    ("megatron_compat",),
    ("config", "reporting"),
    # Every metric key is built and parsed here, reporting's readers included.
    ("metrics",),
)


def module_name(path: Path, package: Path = PACKAGE) -> str:
    return import_graph.module_name(path, root=package.parent)


def imported_modules(path: Path, package: Path = PACKAGE) -> set[str]:
    """Package modules ``path`` imports (absolute names; relative imports resolved)."""
    return {module for module in import_graph.imported_names(path, root=package.parent) if module.split(".")[0] == "nemo_rl_mtp"}


def room_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def layer_of(room: str) -> int:
    for index, rooms in enumerate(LAYERS):
        if room in rooms:
            return index
    raise AssertionError(f"room {room!r} is in no layer of LAYERS; declare it (and in docs/architecture.md)")


def package_modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def test_every_room_is_declared_in_a_layer():
    rooms = {room_of(module) for module in package_modules()} - {None}
    for room in rooms:
        layer_of(room)


def test_rooms_import_only_downward():
    climbing = []
    for module, path in package_modules().items():
        room = room_of(module)
        if room is None:
            continue
        for target in imported_modules(path):
            target_room = room_of(target)
            if target_room is None or target_room == room:
                continue
            if layer_of(target_room) <= layer_of(room):
                climbing.append(f"{module} -> {target}")
    assert not climbing, "imports that climb or cross a layer:\n" + "\n".join(sorted(climbing))


def test_no_import_circle_between_modules():
    modules = package_modules()
    graph = {
        module: {target for target in imported_modules(path) if target in modules and target != module}
        for module, path in modules.items()
    }
    # A package's __init__ is imported on the way to its submodules; only real edges count.
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append(" -> ".join(stack[stack.index(target) :] + [target]))
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def test_the_checker_sees_a_lazy_climbing_import(tmp_path):
    """Control: an upward import inside a function, written into a file, is found."""
    fake = tmp_path / "nemo_rl_mtp" / "config" / "bad.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("def f():\n    from nemo_rl_mtp.rollout.engine import RolloutEngine\n")
    found = imported_modules(fake, package=tmp_path / "nemo_rl_mtp")
    assert "nemo_rl_mtp.rollout.engine" in found
    assert layer_of(room_of("nemo_rl_mtp.rollout.engine")) < layer_of(room_of("nemo_rl_mtp.config.bad"))


def _write(root: Path, relative: str, text: str) -> Path:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_the_release_matrix_reader_follows_lazy_imports_and_started_processes(tmp_path):
    """The release matrix leaves out, on older releases, the test files that cannot import
    megatron (``import_graph.can_import``): a lazy import two modules away, code run with
    ``python -c`` and a checkout script named by a string must each count; a file without any
    must not."""
    _write(tmp_path, "nemo_rl_mtp/__init__.py", "")
    _write(tmp_path, "nemo_rl_mtp/deep.py", "def build():\n    import megatron.core\n")
    _write(tmp_path, "nemo_rl_mtp/middle.py", "from nemo_rl_mtp import deep\n")
    _write(tmp_path, "nemo_rl_mtp/light.py", "import json\n")
    _write(tmp_path, "examples/run_it.py", "import nemo_rl_mtp.middle\n")
    cases = {
        "lazy": ("def test():\n    from nemo_rl_mtp.middle import deep\n", True),
        "python -c": ("CODE = 'from nemo_rl_mtp.deep import build; build()'\n", True),
        "script": ("COMMAND = ['python', 'examples', 'run_it.py']\n", True),
        "none": ("import nemo_rl_mtp.light\nTEXT = 'nothing is imported here'\n", False),
    }
    for name, (text, expected) in cases.items():
        path = _write(tmp_path, f"tests/test_{name.replace(' ', '_')}.py", text)
        assert import_graph.can_import(path, "megatron", root=tmp_path) == expected, name
