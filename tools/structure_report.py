"""Measure the package's structure: import cycles, imports that point up a floor, file and function sizes.

    python tools/structure_report.py            # a table of everything below

Imports are read from the source with ``ast`` (nothing is executed): module-level and function-level imports count;
imports inside ``if TYPE_CHECKING:`` blocks do not, nor do those of a module-level ``__getattr__`` that serves a
``_MOVED`` table (the compatibility shims that keep an old public path working after its name moved up a floor).
``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg`` itself. The floors are the
layer order of docs/architecture.md; tests/unit_tests/test_structure.py enforces them with the same functions.
"""

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIR = ROOT / "megatron"

# The house, bottom floor first. A module lives on the floor of the longest prefix listed here; an import may only
# point to the same floor or a lower one. Packages' __init__ modules sit on their package's floor.
FLOORS = [
    # 1: pure data and leaves that import nothing of ours above them
    [
        "megatron.core.process_groups_config",
        "megatron.core.config",
        "megatron.core.enums",
        "megatron.core.activations",
        "megatron.core.packed_seq_params",
        "megatron.core.num_microbatches_calculator",
        "megatron.core.not_supported_yet",
        "megatron.core.public_api",
        "megatron.core.tokenizers",
        "megatron.core.fusions",
        "megatron.core.extensions",
        "megatron.core.transformer.enums",
        "megatron.core.typed_torch",
        "megatron.core.msc_utils",
        "megatron.core.fault_injector",
        "megatron.core._slurm_utils",
        "megatron.core._rank_utils",
        "megatron.core._api_lifecycle",
    ],
    # 2: the leaf helpers
    ["megatron.core.utils", "megatron.core.straggler_detector"],
    # 3: groups and the things that only need groups
    [
        "megatron.core.parallel_state",
        "megatron.core.rank_generator",
        "megatron.core.group_creation",
        "megatron.core.hyper_comm_grid",
        "megatron.core.model_parallel_config",
        "megatron.core.datasets",
        "megatron.core.dist_checkpointing",
        "megatron.core.optimizer_param_scheduler",
        "megatron.core.fp8",
    ],
    # 4
    ["megatron.core.rerun_state_machine", "megatron.core.mpu"],
    # 5
    ["megatron.core.tensor_parallel"],
    # 6
    ["megatron.core.transformer"],
    # 7
    [
        "megatron.core.distributed",
        "megatron.core.pipeline_parallel",
        "megatron.core.optimizer",
        "megatron.core.ssm",
        "megatron.core.safe_globals",
        "megatron.core.fp8_utils",
    ],
    # 8
    ["megatron.core.models"],
    # 9
    ["megatron.core.inference", "megatron.training"],
    # the package roots hold no code and sit where anything may import them
    ["megatron.core", "megatron"],
]


def floor_of(module: str) -> int:
    """1-based floor of a module: the floor of the longest listed prefix."""
    best, best_len = None, -1
    for number, rooms in enumerate(FLOORS, start=1):
        for room in rooms:
            if (module == room or module.startswith(room + ".")) and len(room) > best_len:
                best, best_len = number, len(room)
    if best is None:
        raise KeyError(f"{module} is on no floor: add its room to FLOORS in tools/structure_report.py")
    return best


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


@dataclass
class Import:
    target: str
    line: int
    function_level: bool


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def moved_names(tree: ast.Module) -> set[str]:
    """Names of the module's ``_MOVED`` table (a dict or tuple literal at module level), or an empty set."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_MOVED" for t in node.targets):
            value = ast.literal_eval(node.value)
            return set(value)
    return set()


def _resolve(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """Our modules that ``module`` imports, with line numbers, skipping TYPE_CHECKING blocks."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def add(target: str, node: ast.AST, in_function: bool):
        while target and target not in modules:  # `import megatron.core.x.y` names a module or a package above it
            target = target.rpartition(".")[0]
        if target and target != module:
            found.append(Import(target, node.lineno, in_function))

    def visit(node: ast.AST, in_function: bool):
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__" and node in tree.body and moved_names(tree):
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child, in_function)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node, in_function)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, module, is_package)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                add(submodule if submodule in modules else base, node, in_function)
        in_function = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, in_function)

    visit(tree, False)
    return found


def import_graph() -> dict[str, list[Import]]:
    modules = all_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, list[Import]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), largest first."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = [0]

    def connect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for edge in graph.get(v, []):
            w = edge.target
            if w not in index:
                connect(w)
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

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(found, key=len, reverse=True)


def upward_imports(graph: dict[str, list[Import]]) -> list[tuple[str, Import]]:
    """Imports that point to a higher floor than their importer's."""
    found = {}
    for module, edges in sorted(graph.items()):
        for edge in edges:
            if floor_of(edge.target) > floor_of(module):
                found.setdefault((module, edge.target), (module, edge))
    return list(found.values())


def core_to_training(graph: dict[str, list[Import]]) -> list[tuple[str, Import]]:
    return [
        (module, edge)
        for module, edges in sorted(graph.items())
        if module.startswith("megatron.core")
        for edge in edges
        if edge.target.startswith("megatron.training")
    ]


@dataclass(order=True)
class Size:
    lines: int
    where: str = field(compare=False)


def file_sizes() -> list[Size]:
    sizes = [
        Size(len(p.read_text(encoding="utf-8").splitlines()), str(p.relative_to(ROOT))) for p in all_modules().values()
    ]
    return sorted(sizes, reverse=True)


def function_sizes() -> list[Size]:
    sizes = []
    for path in all_modules().values():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                sizes.append(Size(lines, f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"))
    return sorted(sizes, reverse=True)


def comment_share() -> float:
    code = comments = 0
    for path in all_modules().values():
        for line in path.read_text(encoding="utf-8").splitlines():
            stripped = line.strip()
            if stripped:
                code += 1
                comments += "#" in stripped and not stripped.startswith(("'", '"'))
    return comments / max(code, 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=5, help="how many of the largest files and functions to list")
    args = parser.parse_args()

    graph = import_graph()
    found_cycles = cycles(graph)
    upward = upward_imports(graph)
    files, functions = file_sizes(), function_sizes()
    print(f"modules: {len(graph)}, import edges: {sum(len(e) for e in graph.values())}")
    print(f"import cycles: {len(found_cycles)} (sizes {[len(c) for c in found_cycles]})")
    for component in found_cycles:
        print("  " + " <-> ".join(m.removeprefix("megatron.") for m in component))
    print(f"imports pointing up a floor: {len(upward)}")
    for module, edge in upward:
        kind = "function-level" if edge.function_level else "module-level"
        print(f"  {module}:{edge.line} -> {edge.target} ({kind}; floor {floor_of(module)} -> {floor_of(edge.target)})")
    print(f"megatron.core importing megatron.training: {len(core_to_training(graph))}")
    print(f"files over 800 lines: {sum(s.lines > 800 for s in files)}; largest:")
    for size in files[: args.top]:
        print(f"  {size.lines:5d}  {size.where}")
    print(f"functions over 120 lines: {sum(s.lines > 120 for s in functions)}; longest:")
    for size in functions[: args.top]:
        print(f"  {size.lines:5d}  {size.where}")
    print(f"lines with a comment: {comment_share():.1%}")


if __name__ == "__main__":
    main()
