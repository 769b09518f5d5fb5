"""The code a stage runs, as a digest for its cache key.

A stage's code is its runner (``run_<stage>`` in runners.py) and every ``nectar`` module reachable
from the imports inside it (the stage module, the model code, the attention capture, the prompts
folder's text files, …), found by reading the import statements — lazy ones inside functions too.
The digest covers each module's syntax tree without docstrings, so a comment, a docstring or a
README edit changes nothing, and any change to a statement of, say, ``nectar/targets/capture.py``
changes the digest of ``targets`` (and of every stage that imports it) — that stage is redone, and
the stages after it follow when its outputs change (their keys hold the outputs' content digests).

Plumbing that moves bytes without computing them (run directories, the atomic write, manifests,
the orchestration and the Prefect layer) is not part of any stage's code, nor is the configuration
schema: a stage's configuration enters its key by value, defaults included.
"""
from __future__ import annotations

import ast
import functools
import hashlib
from pathlib import Path
from typing import Callable, Iterable

PACKAGE = "nectar"
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
PLUMBING = ("nectar.storage", "nectar.integrity", "nectar.orchestration", "nectar.pipeline",
            # configuration enters cache keys by value (every field, defaults included), not by code
            "nectar.schemas.config", "nectar.schemas.presets")
DATA_SUFFIXES = (".txt", ".json", ".yaml", ".yml", ".jinja", ".j2")


def _is_plumbing(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in PLUMBING)


def _module_file(root: Path, module: str) -> Path | None:
    parts = module.split(".")[1:]
    base = root.joinpath(*parts) if parts else root
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def _statements(tree: ast.AST):
    """Every statement, nested ones too (no expressions: imports and docstrings are statements)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for name in ("body", "orelse", "finalbody", "handlers", "cases"):
            children = getattr(node, name, None)
            if isinstance(children, list):
                stack.extend(c for c in children if isinstance(c, ast.AST))


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in _statements(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return tree


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Fully qualified ``nectar`` modules (or names inside them) that ``tree`` imports."""
    out: set[str] = set()
    package = module if is_package else module.rsplit(".", 1)[0]
    for node in _statements(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == PACKAGE)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if target.split(".")[0] != PACKAGE:
                continue
            out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names)  # a submodule, if one has that name
    return out


@functools.lru_cache(maxsize=1024)
def _parsed(path: Path, mtime_ns: int, name: str) -> tuple[frozenset[str], str]:
    """A module's imports and the digest of its syntax tree without docstrings (cached per file version)."""
    tree = ast.parse(path.read_text())
    imports = frozenset(_imports(tree, name, path.name == "__init__.py"))
    return imports, hashlib.sha256(ast.dump(_strip_docstrings(tree)).encode()).hexdigest()


def _module(path: Path, name: str) -> tuple[frozenset[str], str]:
    return _parsed(path, path.stat().st_mtime_ns, name)


def _closure(root: Path, start: Iterable[str]) -> dict[str, Path]:
    """Every module reachable from ``start`` by imports (plumbing excluded), name → file."""
    seen: dict[str, Path] = {}
    todo = list(start)
    while todo:
        name = todo.pop()
        if name in seen or _is_plumbing(name):
            continue
        path = _module_file(root, name)
        if path is None:  # a function or class imported from a module, not a module
            continue
        seen[name] = path
        todo.extend(_module(path, name)[0])
    return seen


def _runner_tree(root: Path, runner: Callable) -> tuple[str, ast.AST]:
    """The runner function's syntax tree, read from ``root`` (a copy of the package in tests)."""
    module = runner.__module__
    path = _module_file(root, module)
    if path is None:
        raise FileNotFoundError(f"no source for {module} under {root}")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == runner.__name__:
            return module, node
    raise LookupError(f"{runner.__name__} not found in {path}")


def code_digest(runner: Callable, root: Path = PACKAGE_ROOT) -> str:
    """sha256 of the runner and every module it reaches (docstrings and comments excluded)."""
    module, tree = _runner_tree(root, runner)
    tree = _strip_docstrings(tree)
    h = hashlib.sha256()
    h.update(f"{module}.{runner.__name__}\0{ast.dump(tree)}\n".encode())
    modules = _closure(root, _imports(tree, module, False))
    for name in sorted(modules):
        path = modules[name]
        h.update(f"{name}\0{_module(path, name)[1]}\n".encode())
        if path.name == "__init__.py":  # a package's data files (prompt texts) are code too
            for data in sorted(p for p in path.parent.iterdir() if p.suffix in DATA_SUFFIXES and p.is_file()):
                h.update(f"{name}/{data.name}\0".encode() + data.read_bytes() + b"\n")
    return h.hexdigest()


def code_modules(runner: Callable, root: Path = PACKAGE_ROOT) -> list[str]:
    """The modules counted in ``code_digest`` (for docs and tests)."""
    module, tree = _runner_tree(root, runner)
    return sorted(_closure(root, _imports(tree, module, False)))


@functools.lru_cache(maxsize=None)
def code_version(runner: Callable) -> str:
    """``<release>+<code digest>``: what a stage's manifest records and its cache key includes."""
    from .. import __version__

    return f"{__version__}+{code_digest(runner)[:16]}"
