"""The package's shape, checked statically: imports point down the layers, no import cycle, every
cited markdown file and section exists.

Run as a script (`python tests/test_architecture.py`) it prints the figures issue 20 tracks: import
cycles, upward imports, function-level imports and the five largest files.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nectar"

# The layers, bottom first. A module may import from its own layer or any layer below. Within the
# core layer the packages may import each other, but never in a cycle (checked separately).
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    ("schemas", frozenset({"schemas"})),
    (
        "core",
        frozenset(
            {
                "attention", "states", "documents", "evaluation", "integrity",
                "layout", "llm", "vllm", "ports", "venvs", "base_model", "modules", "prompts", "shutdown", "storage", "tables",
                "targets", "training", "quantization", "kl", "kvpress", "cache_call", "queries", "partial",
            }
        ),
    ),
    ("stages", frozenset({"stages"})),
    # Applications over run directories sit with the code that runs them: comparison (compare and
    # sweep run stages in child runs) and serving (ask and serve open a finished run).
    ("orchestration", frozenset({"orchestration", "comparison", "serving"})),
    ("pipeline", frozenset({"pipeline"})),
)


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name, e.g. "nectar.stages.train"
    imported: str  # dotted nectar module it names
    line: int
    in_function: bool


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _target(name: str, modules: dict[str, Path]) -> str | None:
    """The nectar module `name` refers to (a module, or the package holding a re-exported name)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    tree = ast.parse(path.read_text(), str(path))
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                continue  # annotations only: no import at run time
            if isinstance(child, ast.Import):
                for alias in child.names:
                    t = _target(alias.name, modules)
                    if t and t.startswith("nectar"):
                        found.append(Import(name, t, child.lineno, in_function))
            elif isinstance(child, ast.ImportFrom):
                base = _resolve(child, name, path.name == "__init__.py")
                for alias in child.names:
                    t = _target(f"{base}.{alias.name}", modules)
                    if t and t.startswith("nectar") and t != name:
                        found.append(Import(name, t, child.lineno, in_function))
            visit(child, nested)

    visit(tree, False)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


@functools.lru_cache(maxsize=1)
def all_imports() -> tuple[Import, ...]:
    modules = all_modules()
    found = [imp for name, path in modules.items() for imp in imports_of(name, path, modules)]
    return tuple(dict.fromkeys(found))  # `from x import a, b` is one import of x


def package_of(module: str) -> str:
    """`nectar.training.data` -> `nectar.training`; a root module is its own package."""
    return ".".join(module.split(".")[:2])


def package_imports(imports: tuple[Import, ...] | list[Import]) -> list[Import]:
    """The same imports between the top-level folders: `targets.online` -> `training.data` and
    `training.data` -> `targets.store` is no module cycle, but it ties the two folders together."""
    return [
        Import(package_of(i.importer), package_of(i.imported), i.line, i.in_function)
        for i in imports
        if package_of(i.importer) != package_of(i.imported)
    ]


def _package_imports(imp: Import) -> bool:
    """`nectar.x.y` importing `nectar.x` runs `nectar/x/__init__.py`, which Python has already started
    when it imports `nectar.x.y`: the edge is real but not an ordering constraint we police."""
    return imp.importer.startswith(imp.imported + ".")


def layer_of(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else ""
    for index, (_, members) in enumerate(LAYERS):
        if top in members:
            return index
    if top == "":
        return 0  # nectar/__init__.py holds only the version string
    raise AssertionError(f"{module} is in no layer: add its folder to LAYERS in {Path(__file__).name}")


def upward_imports(imports: tuple[Import, ...] | list[Import]) -> list[Import]:
    return [i for i in imports if layer_of(i.imported) > layer_of(i.importer)]


def cycles(imports: tuple[Import, ...] | list[Import]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if _package_imports(imp):
            continue
        graph.setdefault(imp.importer, set()).add(imp.imported)
        graph.setdefault(imp.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return found


# --- references to markdown files and their sections -------------------------------------------

_MD_REF = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.md)(?:\s*(?:§|#)\s*([\w.-]+))?")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"\s", "-", text)


def anchors(md: Path) -> set[str]:
    found: set[str] = set()
    for line in md.read_text().splitlines():
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
            found.add(_slug(heading))
            number = re.match(r"§?(\d+(?:\.\d+)*)", heading)
            if number:
                found.add(number.group(1))
    return found


def _scanned_files() -> list[Path]:
    files = [p for p in PACKAGE.rglob("*.py")]
    files += [p for p in (ROOT / "tests").rglob("*.py") if p.name != Path(__file__).name]
    files += list((ROOT / "benchmarks").rglob("*.py")) + list((ROOT / "docs").rglob("*.md"))
    files += [ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml"]
    return [f for f in files if f.is_file()]


def _find_md(ref: str, cited_from: Path) -> Path | None:
    for base in (cited_from.parent, ROOT, ROOT / "docs"):
        candidate = (base / ref).resolve()
        if candidate.is_file():
            return candidate
    return None


def _written_names() -> set[str]:
    """Markdown files the pipeline writes into a run directory, or a benchmark into its output folder
    (`"report.md"` as a string literal in the package or benchmarks/): citing them is citing an
    output, not a document of the repository."""
    names: set[str] = set()
    for path in [*PACKAGE.rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]:
        names.update(re.findall(r"[\"']([\w-]+\.md)[\"']", path.read_text()))
    return names


def broken_references() -> list[str]:
    written = _written_names()
    broken = []
    for path in _scanned_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for match in _MD_REF.finditer(line):
                ref, section = match.group(1), match.group(2)
                where = f"{path.relative_to(ROOT)}:{number}"
                target = _find_md(ref, path)
                if target is None and Path(ref).name in written:
                    continue
                if target is None:
                    broken.append(f"{where}: {ref} does not exist")
                elif section and section.rstrip(".") not in anchors(target):
                    broken.append(f"{where}: {ref} has no section {section!r}")
    return broken


# --- the tests -------------------------------------------------------------------------------------


def test_no_import_cycle_in_the_package():
    """Module-level and function-level imports both count: a function-level import that closes a
    cycle only moves the failure from import time to call time."""
    found = cycles(all_imports())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_import_cycle_between_folders():
    found = cycles(package_imports(all_imports()))
    assert not found, "folders importing each other:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_imports_point_down_the_layers():
    found = upward_imports(all_imports())
    assert not found, "upward imports:\n" + "\n".join(
        f"{i.importer}:{i.line} imports {i.imported}" for i in found
    )



def missing_modules() -> list[str]:
    """Imports of a ``nectar`` module that does not exist (a moved module's old name): an old
    editable install can still serve the old file, so such an import passes where it is stale."""
    modules = all_modules()
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
    out = []
    for path in sorted(files):
        importer = module_name(path) if path.is_relative_to(PACKAGE) else ""
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.level == 0 or importer):
                base = _resolve(node, importer, path.name == "__init__.py")
                names = [base] if base.startswith("nectar") else []
            else:
                continue
            out += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                    if n.startswith("nectar") and n.split(".")[0] == "nectar" and n not in modules]
    return out


def test_every_imported_nectar_module_exists():
    assert missing_modules() == []

def test_every_cited_markdown_file_and_section_exists():
    found = broken_references()
    assert not found, "\n".join(found)


def test_the_checks_see_a_cycle_and_a_broken_reference(tmp_path):
    """The checkers themselves can fail: a two-module cycle and a missing section are reported."""
    loop = [Import("nectar.a", "nectar.b", 1, False), Import("nectar.b", "nectar.a", 1, True)]
    assert cycles(loop) == [["nectar.a", "nectar.b"]]
    doc = tmp_path / "x.md"
    doc.write_text("# Title\n## 2. The identity\n")
    assert {"title", "2", "2-the-identity"} <= anchors(doc)


# --- the figures -----------------------------------------------------------------------------------


def report() -> None:
    imports = all_imports()
    found = cycles(imports)
    up = upward_imports(imports)
    in_function = [i for i in imports if i.in_function]
    sizes = sorted(((len(p.read_text().splitlines()), n) for n, p in all_modules().items()), reverse=True)
    print(f"internal imports: {len(imports)} (function-level: {len(in_function)})")
    print(f"import cycles (strongly connected components): {len(found)}, modules in them: "
          f"{sum(len(c) for c in found)}")
    for c in found:
        print("   ", " ".join(m.removeprefix("nectar.") for m in c))
    folder_cycles = cycles(package_imports(imports))
    print(f"folder-level cycles: {len(folder_cycles)}")
    for c in folder_cycles:
        print("   ", " ".join(m.removeprefix("nectar.") for m in c))
    print(f"upward imports: {len(up)}")
    for i in up:
        print(f"    {i.importer}:{i.line} -> {i.imported}{' (in function)' if i.in_function else ''}")
    print("five largest files:", ", ".join(f"{n} {lines}" for lines, n in sizes[:5]))
    refs = broken_references()
    print(f"broken markdown references: {len(refs)}")
    for r in refs:
        print("   ", r)




def frames_to_optimizer_step(argv: list[str]) -> None:
    """Run `nectar <argv>` in this process and print the stack at the first `optimizer.step()`: the
    nectar frames in order, and how many frames lie between the CLI command and the step."""
    import traceback

    import torch

    from nectar.pipeline.cli import app

    original = torch.optim.AdamW.step
    seen: list[traceback.FrameSummary] = []

    def step(self, *args, **kwargs):
        if not seen:
            seen.extend(traceback.extract_stack()[:-1])
        return original(self, *args, **kwargs)

    torch.optim.AdamW.step = step
    try:
        app(argv, standalone_mode=False)
    finally:
        torch.optim.AdamW.step = original
    ours = [f for f in seen if f.filename.startswith(str(PACKAGE))]
    files = list(dict.fromkeys(Path(f.filename).relative_to(ROOT) for f in ours))
    print(f"frames in the thread that steps: {len(seen)}; nectar frames: {len(ours)}; "
          f"nectar files: {len(files)}")
    for f in ours:
        print(f"    {Path(f.filename).relative_to(ROOT)}:{f.lineno} {f.name}")


if __name__ == "__main__" and sys.argv[1:2] == ["--frames"]:
    frames_to_optimizer_step(sys.argv[2:])
elif __name__ == "__main__":
    report()
