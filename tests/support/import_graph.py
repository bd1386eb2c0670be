"""Imports read from the source with ``ast``: every ``import`` and ``from ... import``, module level
or inside a function, relative ones resolved. Used by the architecture test (rooms import only
downward) and by the release matrix (which test files can reach megatron at all).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# The checkout's own top-level packages: imports of these are followed to their files.
LOCAL_PACKAGES = ("nemo_rl_mtp", "tests", "scripts", "benchmarks")


def module_name(path: Path, root: Path = REPO_ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path, root: Path = REPO_ROOT, code_in_strings: bool = False) -> set[str]:
    """Every module name ``path`` imports (absolute; ``from a import b`` gives ``a`` and ``a.b``).

    ``code_in_strings``: also what the file starts in other processes, as far as its text shows:
    the imports of a string constant that parses as Python (``python -c CODE``), and the checkout's
    scripts a string constant names (``"run_grpo.py"``: examples/run_grpo.py), as ``path:<file>``."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    found = _imports_of(tree, package)
    if code_in_strings:
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found |= _started_by(node.value, root)
    return found


def _started_by(text: str, root: Path) -> set[str]:
    if text.endswith(".py") and "/" not in text.strip("/"):
        return {f"path:{script}" for folder in ("examples", "scripts") for script in (root / folder).rglob(text)}
    if "import " not in text:
        return set()
    try:
        return _imports_of(ast.parse(text), "")
    except SyntaxError:
        return set()


def _imports_of(tree: ast.AST, package: str) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def local_file(module: str, root: Path = REPO_ROOT) -> Path | None:
    """The checkout's file of ``module`` (a module or a package's ``__init__``), None if not local."""
    if module.split(".")[0] not in LOCAL_PACKAGES:
        return None
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.lru_cache(maxsize=None)
def _external_imports_closure(path: Path, root: Path) -> frozenset[str]:
    seen: set[Path] = set()
    external: set[str] = set()
    pending = [path]
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        for module in imported_names(current, root, code_in_strings=True):
            if module.startswith("path:"):
                pending.append(Path(module[len("path:"):]))
                continue
            target = local_file(module, root)
            if target is not None:
                pending.append(target)
                # A package's __init__ runs on the way to its submodules.
                parts = module.split(".")
                pending.extend(filter(None, (local_file(".".join(parts[:i]), root) for i in range(1, len(parts)))))
            elif module.split(".")[0] not in LOCAL_PACKAGES:
                external.add(module)
    return frozenset(external)


def can_import(path: Path, package: str, root: Path = REPO_ROOT) -> bool:
    """Whether ``path`` or any local module it imports (lazily or not, transitively), or any
    process it visibly starts (:func:`imported_names`' ``code_in_strings``), imports ``package``
    (a top-level name such as ``megatron``)."""
    return any(module.split(".")[0] == package for module in _external_imports_closure(path.resolve(), root))
