"""The layers of docs/architecture.md, enforced.

The table "Layers: who may import whom" is parsed from docs/architecture.md, so the docs and this
test cannot disagree. Every import of every module of the packages (pyproject.toml's list) is read
from its syntax tree: `import a.b`, `from a import b`, relative imports, imports inside functions
and under `TYPE_CHECKING`, and `importlib.import_module("a.b")` / `__import__("a.b")` with a literal
name. Checked: each import is allowed by its row; the modules import each other without a cycle
(type-only imports count); no module is over 400 lines (the Scheduler over 300); the pure rows load
no forbidden library.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE_HEADING = "## Layers: who may import whom"
MAX_LINES = 400
# Tighter bounds: the Scheduler is an orchestrator a newcomer reads as one page (docs/scheduler.md).
LINE_LIMITS = {"tidal_core/scheduler.py": 300}


@dataclass(frozen=True)
class Row:
    package: str
    allowed: tuple[str, ...]          # project packages or modules
    third_party: tuple[str, ...]      # top-level names beyond the standard library
    forbidden: tuple[str, ...]        # project or library names, checked in the source


@dataclass(frozen=True)
class Import:
    module: str   # the importing module
    target: str   # the imported name, resolved to a project module where it is one
    line: int


def _names(cell: str) -> tuple[str, ...]:
    return tuple(re.findall(r"`([^`]+)`", cell))


@cache
def layer_rows() -> tuple[Row, ...]:
    """The table's rows, bottom layer first."""
    lines = (ROOT / "docs" / "architecture.md").read_text().splitlines()
    start = lines.index(TABLE_HEADING)
    table = [ln for ln in lines[start:] if ln.startswith("|")]
    header = [c.strip() for c in table[0].strip("|").split("|")]
    col = {name: i for i, name in enumerate(header)}
    rows = []
    for line in table[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append(Row(package=_names(cells[col["package"]])[0],
                        allowed=_names(cells[col["may import from the project"]]),
                        third_party=_names(cells[col["third-party it may import"]]),
                        forbidden=_names(cells[col["must not import"]])))
    return tuple(rows)


@cache
def project_modules() -> dict[str, Path]:
    """Every module of the installed packages (pyproject.toml), by dotted name."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir = setup.get("package-dir", {})
    modules = {name: ROOT / f"{name}.py" for name in setup["py-modules"]}
    for top in {p.split(".")[0] for p in setup["packages"]}:
        folder = ROOT / package_dir.get(top, top)
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((top, *parts))] = path
    return modules


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def row_of(module: str) -> Row:
    """The most specific row whose package contains the module."""
    rows = [r for r in layer_rows() if _within(module, r.package)]
    assert rows, f"{module} belongs to no row of the layer table in docs/architecture.md"
    return max(rows, key=lambda r: len(r.package))


def _resolve(name: str) -> str:
    """A dotted name to the project module it loads (the longest existing prefix), else itself."""
    modules = project_modules()
    probe = name
    while probe and probe not in modules:
        probe = probe.rpartition(".")[0]
    return probe or name


def _from_base(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".")
    if project_modules()[module].name != "__init__.py":
        package = package[:-1]
    package = package[:len(package) - (node.level - 1)]
    return ".".join([*package, *([node.module] if node.module else [])])


def _literal_import(node: ast.Call) -> str | None:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
        value = node.args[0].value
        return value if isinstance(value, str) else None
    return None


def imports_of(module: str) -> list[Import]:
    path = project_modules()[module]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(module, node)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in project_modules() else base for a in node.names]
        elif isinstance(node, ast.Call) and (literal := _literal_import(node)):
            names = [literal]
        else:
            continue
        found += [Import(module, _resolve(n), node.lineno) for n in names if n != "__future__"]
    return found


def _is_project(name: str) -> bool:
    return name.split(".")[0] in {m.split(".")[0] for m in project_modules()}


def violation(imp: Import) -> str | None:
    """Why the table forbids this import, or None."""
    row = row_of(imp.module)
    top = imp.target.split(".")[0]
    if any(_within(imp.target, f) for f in row.forbidden):
        return "named under 'must not import'"
    if _is_project(imp.target):
        target_row = row_of(imp.target)
        if target_row == row or any(_within(e, target_row.package) and _within(imp.target, e) for e in row.allowed):
            return None
        return f"{row.package} may import only {', '.join(row.allowed) or 'its own package'} from the project"
    if top in sys.stdlib_module_names or top in row.third_party:
        return None
    return f"{top} is not among {row.package}'s third-party imports"


def _all_imports() -> list[Import]:
    return [imp for module in sorted(project_modules()) for imp in imports_of(module)]


def test_table_covers_every_package_and_is_one_way() -> None:
    rows = layer_rows()
    packages = [r.package for r in rows]
    assert len(set(packages)) == len(packages), f"a package appears twice: {packages}"
    tops = {m.split(".")[0] for m in project_modules()}
    assert tops == {p.split(".")[0] for p in packages}, "the table and pyproject.toml list different packages"
    for i, row in enumerate(rows):
        below = {r.package for r in rows[:i]}
        for entry in row.allowed:
            assert entry in project_modules(), f"{row.package} allows {entry}, which is no module"
            assert row_of(entry).package in below, f"{row.package} allows {entry}, which is not listed above it"
            assert not any(_within(entry, f) for f in row.forbidden), f"{row.package} allows and forbids {entry}"


def test_every_package_folder_is_installed() -> None:
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for module, path in project_modules().items():
        if path.name == "__init__.py":
            assert module in setup["packages"], f"{module} is a package folder missing from pyproject.toml"


def test_every_import_is_allowed_by_the_table() -> None:
    imports = _all_imports()
    assert len(imports) > 100, "the scan found almost no imports: is the module list right?"
    bad = [f"{i.module}:{i.line} imports {i.target}: {why}" for i in imports if (why := violation(i))]
    assert not bad, "imports the layer table does not allow:\n" + "\n".join(bad)


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}   # 1 on the path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_between_modules() -> None:
    graph: dict[str, set[str]] = {}
    for imp in _all_imports():
        if imp.target in project_modules() and imp.target != imp.module:
            graph.setdefault(imp.module, set()).add(imp.target)
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_find_cycle_finds_one() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}}) is None


def test_no_module_over_the_line_limit() -> None:
    paths = [*project_modules().values(), *sorted((ROOT / "tests").rglob("*.py")),
             *sorted((ROOT / "benchmarks").rglob("*.py"))]
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in paths}
    assert set(LINE_LIMITS) <= set(sizes), f"a tighter bound names no module: {set(LINE_LIMITS) - set(sizes)}"
    long = {rel: n for rel, n in sizes.items() if n > LINE_LIMITS.get(rel, MAX_LINES)}
    assert not long, f"modules over their line limit ({MAX_LINES}, or LINE_LIMITS): {long}"


def _loaded_by_importing(modules: list[str]) -> set[str]:
    code = ("import sys, importlib; before = set(sys.modules)\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "print(' '.join(sorted({m.split('.')[0] for m in set(sys.modules) - before})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return set(out.stdout.split())


def test_pure_rows_load_no_forbidden_library() -> None:
    checked = 0
    for row in layer_rows():
        libraries = {f for f in row.forbidden if not _is_project(f)}
        if not libraries:
            continue
        modules = sorted(m for m in project_modules() if row_of(m) == row)
        loaded = _loaded_by_importing(modules) & libraries
        assert not loaded, f"importing {row.package} loads {sorted(loaded)}"
        checked += 1
    assert checked >= 2, "the table names no library any row must not load"


def test_core_reads_no_clock_and_never_sleeps() -> None:
    """The core's own source, independent of the table: no clock, no sleep, no threads, no heavy library."""
    banned = {"time", "datetime", "asyncio", "threading", "ray", "torch", "transformers", "fastapi", "numpy"}
    core = [imp for m in project_modules() if _within(m, "tidal_core") for imp in imports_of(m)]
    assert core, "no imports found in tidal_core"
    bad = [f"{i.module}:{i.line} imports {i.target}" for i in core if i.target.split(".")[0] in banned]
    assert not bad, bad


def test_the_serving_unit_starts_its_workers_without_importing_torch() -> None:
    # The unit's process imports what starts its TP workers; only the workers import torch
    # (actors/engine_spec.py), so a unit does not pay torch's import before its workers pay theirs.
    loaded = _loaded_by_importing(["serve_app.unit", "actors.replica", "actors.tp_worker", "actors.engine_spec"])
    assert "torch" not in loaded and "transformers" not in loaded, sorted(loaded)
