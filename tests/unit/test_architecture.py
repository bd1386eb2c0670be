"""The package's rooms import only downward, and nothing imports in a circle.

The layers are declared here and in ``docs/architecture.md``; the imports are read from the source
with ``ast`` (every ``import`` and ``from ... import``, module level or inside a function), so a
lazy import that climbs a layer fails too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import nemo_rl_mtp

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
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, package: Path = PACKAGE) -> set[str]:
    """Package modules ``path`` imports (absolute names; relative imports resolved)."""
    name = module_name(path, package)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {module for module in found if module.split(".")[0] == "nemo_rl_mtp"}


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
