"""The package's shape: imports point down the floors of docs/architecture.md, no import cycle, megatron.core
never imports megatron.training, small files and functions, and the ``_MOVED``
compatibility tables serve only outside callers."""

import ast
import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import structure_report  # noqa: E402

# Imports that may point up a floor, each with the reason it must.
ALLOWED_UPWARD = {
    # Loading a checkpoint checks its pickles against the allow-list of config classes, which live above it.
    ("megatron.core.dist_checkpointing.safe_load", "megatron.core.safe_globals"),
}
# No import cycle at all (the optimizer and its scheduler refer to each other for type hints only).
MAX_CYCLES, MAX_CYCLE_SIZE = 0, 0
MAX_FILE_LINES, MAX_FUNCTION_LINES = 800, 120


@pytest.fixture(scope="module")
def graph():
    return structure_report.import_graph()


def test_every_module_is_on_a_floor(graph):
    for module in graph:
        structure_report.floor_of(module)


def test_imports_point_down_the_floors(graph):
    upward = [
        f"{module}:{edge.line} -> {edge.target} (floor {structure_report.floor_of(module)} -> "
        f"{structure_report.floor_of(edge.target)})"
        for module, edge in structure_report.upward_imports(graph)
        if (module, edge.target) not in ALLOWED_UPWARD
    ]
    assert upward == [], "imports pointing up a floor:\n" + "\n".join(upward)


def test_no_import_cycles(graph):
    found = structure_report.cycles(graph)
    assert len(found) <= MAX_CYCLES and all(len(c) <= MAX_CYCLE_SIZE for c in found), found


def test_core_never_imports_training(graph):
    assert structure_report.core_to_training(graph) == []


def test_files_and_functions_stay_small():
    files = [s for s in structure_report.file_sizes() if s.lines > MAX_FILE_LINES]
    functions = [s for s in structure_report.function_sizes() if s.lines > MAX_FUNCTION_LINES]
    assert files == [] and functions == [], (files, functions)


def _moved_tables():
    """{module: names} for every module that keeps old public paths alive through a ``_MOVED`` table."""
    tables = {}
    for module, path in structure_report.all_modules().items():
        names = structure_report.moved_names(ast.parse(path.read_text(encoding="utf-8")))
        if names:
            tables[module] = names
    return tables


def test_moved_names_still_resolve_at_their_old_paths():
    tables = _moved_tables()
    assert tables, "no _MOVED table found: the analysis no longer sees them"
    for module, names in tables.items():
        old = importlib.import_module(module)
        for name in names:
            assert getattr(old, name) is not None, f"{module}.{name}"


def test_internal_code_imports_moved_names_from_their_new_homes():
    tables = _moved_tables()
    sources = [*ROOT.glob("megatron/**/*.py"), *ROOT.glob("*.py"), *ROOT.glob("tools/**/*.py")]
    sources += [*ROOT.glob("examples/**/*.py"), *ROOT.glob("benchmarks/**/*.py")]
    offenders = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in tables:
                offenders += [
                    f"{path.relative_to(ROOT)}:{node.lineno} {node.module}.{alias.name}"
                    for alias in node.names
                    if alias.name in tables[node.module]
                ]
    assert offenders == []


def test_analysis_sees_function_level_imports_and_skips_type_checking(tmp_path, monkeypatch):
    """The checks above are only as good as the import reader; make sure it reads what it must."""
    package = tmp_path / "megatron"
    (package / "core").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "core" / "__init__.py").write_text("")
    (package / "core" / "utils.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from megatron.core import parallel_state\n"
        "def f():\n    from megatron.core.parallel_state import get_group\n"
    )
    (package / "core" / "parallel_state.py").write_text("from megatron.core import utils\n")
    monkeypatch.setattr(structure_report, "ROOT", tmp_path)
    monkeypatch.setattr(structure_report, "PACKAGE_DIR", package)
    graph = structure_report.import_graph()
    assert [(e.target, e.function_level) for e in graph["megatron.core.utils"]] == [
        ("megatron.core.parallel_state", True)
    ]
    assert structure_report.cycles(graph) == [["megatron.core.parallel_state", "megatron.core.utils"]]
    assert [(m, e.target) for m, e in structure_report.upward_imports(graph)] == [
        ("megatron.core.utils", "megatron.core.parallel_state")
    ]
