"""What may import what (docs/architecture.md), checked by reading the source with `ast`, so it
runs in well under a second: every import counts, at module level or inside a function, and
type-only ones too (a layer that names another's types depends on it). Only the rules about
torch follow imports transitively, since there the cost is what a fresh process loads; a
subprocess checks that at run time as well."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Everything we ship; tests/ drive the UI and the engine together on purpose.
SOURCE_DIRS = ("engine", "kernels", "playground", "benchmarks", "scripts")
TOP_LEVEL_FILES = ("app.py",)


@dataclass(frozen=True)
class Import:
    module: str  # absolute dotted name, e.g. "engine.telemetry.prom"
    line: int
    module_level: bool  # runs on import (not inside a function, not under TYPE_CHECKING)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files() -> list[Path]:
    files = [ROOT / f for f in TOP_LEVEL_FILES]
    for d in SOURCE_DIRS:
        files += sorted((ROOT / d).rglob("*.py"))
    return files


def files_under(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


@cache
def lazy_exports() -> dict[str, str]:
    """engine/__init__.py's name -> module table: `from engine import EngineService` loads
    engine.serving.service on first use, so it counts as importing that module."""
    tree = ast.parse((ROOT / "engine" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "_EXPORTS":
            return {f"engine.{k}": v for k, v in ast.literal_eval(node.value).items()}
    return {}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, module_level: bool) -> Iterator[tuple[ast.AST, bool]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield stmt, False
                yield from _walk(stmt, False)
            for stmt in child.orelse:
                yield stmt, module_level
                yield from _walk(stmt, module_level)
            continue
        yield child, module_level
        in_function = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        yield from _walk(child, module_level and not in_function)


@cache
def imports_of(path: Path) -> tuple[Import, ...]:
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return imports_in(path.read_text(), package, str(path))


def imports_in(source: str, package: str, filename: str = "<source>") -> tuple[Import, ...]:
    """Every import in the source as absolute module names. `from a import b` yields a.b as
    well as a (b may be a submodule); relative imports are resolved against `package`."""
    found: list[Import] = []
    for node, module_level in _walk(ast.parse(source, filename), True):
        if isinstance(node, ast.Import):
            found += [Import(a.name, node.lineno, module_level) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.append(Import(base, node.lineno, module_level))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.append(Import(lazy_exports().get(full, full), node.lineno, module_level))
    return tuple(i for i in found if i.module and i.module != "__future__")


def matches(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def violations(files: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    """One line per offending import statement ("path:line imports module")."""
    found: dict[str, str] = {}
    for f in files:
        for i in imports_of(f):
            where = f"{f.relative_to(ROOT)}:{i.line}"
            if matches(i.module, forbidden) and where not in found:
                found[where] = f"{where} imports {i.module}"
    return list(found.values())


# --- the rules ------------------------------------------------------------------------------


SCAN_PROBE = """
import torch.nn as nn
from typing import TYPE_CHECKING
from . import cost
from ..core.scheduler import Scheduler
from engine import EngineService
if TYPE_CHECKING:
    from engine.serving.server import create_app
class Holder:
    import gradio
def build():
    import plotly.graph_objects as go
"""


def test_the_scan_sees_imports_everywhere():
    """Guards the scanner itself: relative, lazy-export, type-only, class- and function-level
    imports are all found, and only the ones that run on import count as module level."""
    got = {i.module: i.module_level for i in imports_in(SCAN_PROBE, "engine.telemetry")}
    assert got["torch.nn"] and got["engine.telemetry.cost"] and got["engine.core.scheduler"]
    assert got["engine.serving.service"]  # `from engine import EngineService` (lazy export)
    assert got["gradio"]  # a class body runs on import
    assert got["engine.serving.server"] is False and got["plotly.graph_objects"] is False
    assert len(source_files()) > 50


def test_engine_core_never_imports_serving_or_benchmarks():
    bad = violations(files_under("engine/core"), ("engine.serving", "benchmarks"))
    assert not bad, "engine/core must not reach up to serving or benchmarks:\n" + "\n".join(bad)


def test_engine_core_never_imports_prometheus():
    """The engine takes a metrics sink from its caller (EngineService, the server, LLM)."""
    bad = violations(files_under("engine/core"), ("engine.telemetry.prom", "prometheus_client"))
    assert not bad, "engine/core records stats; exporters live outside it:\n" + "\n".join(bad)


def test_engine_never_imports_playground():
    bad = violations(files_under("engine"), ("playground",))
    assert not bad, "the engine knows nothing about the UI:\n" + "\n".join(bad)


def test_kernels_import_only_torch_triton_and_the_standard_library():
    allowed = {"torch", "triton", "kernels", *sys.stdlib_module_names}
    bad = [
        f"{f.relative_to(ROOT)}:{i.line} imports {i.module}"
        for f in files_under("kernels")
        for i in imports_of(f)
        if i.module.split(".")[0] not in allowed
    ]
    assert not bad, "kernels/ runs on bare GPU machines (torch + triton only):\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("package", "allowed"),
    [("plotly", ("playground/",)), ("gradio", ("playground/", "app.py"))],
)
def test_ui_libraries_stay_in_the_playground(package, allowed):
    outside = [f for f in source_files() if not str(f.relative_to(ROOT)).startswith(allowed)]
    bad = violations(outside, (package,))
    assert not bad, f"{package} belongs to the UI ({', '.join(allowed)}):\n" + "\n".join(bad)


def _local_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def loaded_on_import(module: str) -> set[str]:
    """Modules a fresh `import module` loads, following our own files' module-level imports
    (and the packages above each one); third-party modules are leaves."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for k in range(1, len(parts) + 1):
            prefix = ".".join(parts[:k])
            if prefix in seen:
                continue
            seen.add(prefix)
            path = _local_file(prefix)
            if path is not None:
                todo += [i.module for i in imports_of(path) if i.module_level]
    return seen


PURE_PYTHON = ("engine.config", "engine.telemetry.cost", "engine.telemetry.stats")


@pytest.mark.parametrize("module", PURE_PYTHON)
def test_pure_python_modules_do_not_import_torch(module):
    path = _local_file(module)
    assert path is not None
    direct = violations([path], ("torch",))
    assert not direct, "\n".join(direct)
    loaded = loaded_on_import(module)
    assert not matches_any(loaded, ("torch",)), sorted(m for m in loaded if "torch" in m)


def matches_any(modules: set[str], prefixes: tuple[str, ...]) -> bool:
    return any(matches(m, prefixes) for m in modules)


def test_pure_python_modules_load_without_torch_at_run_time():
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in PURE_PYTHON)
        + "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"torch was loaded: {out.stdout.strip()[:300]}"
