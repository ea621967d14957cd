"""The public API matches Megatron-Core 0.19.2's, entry by entry, for every module this project implements.

`data/megatron-core-0.19-api.txt` is Megatron-Core 0.19.2's public API written down as facts (one line per name:
its kind, parameters and defaults; dataclass fields with their defaults; enum members; the names a package hands on).
For each module it lists, every entry must exist here with the same parameter names, in the same order, with a
default exactly where Megatron has one, and every dataclass field must have Megatron's default. The exceptions are
the rows of the table under "API entries left out" in docs/compatibility.md (module, entry pattern, reason), so the
documentation and this test cannot disagree. Modules that belong to features still to be built are listed in
LATER, with the issue that builds them.
"""

import dataclasses
import enum
import fnmatch
import importlib
import inspect
import re
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
MANIFEST = Path(__file__).parent / "data" / "megatron-core-0.19-api.txt"
COMPATIBILITY_DOC = REPO_ROOT / "docs" / "compatibility.md"

# Module prefixes of features not built yet: their whole API arrives with them.
LATER = {}


def parse_manifest(text: str) -> Dict[str, Dict[str, str]]:
    """{module: {entry key: manifest line}}; keys are "def f", "class C", "class C :: def m", "dataclass D :: field",
    "enum E", "import Name" (a name the package hands on)."""
    modules: Dict[str, Dict[str, str]] = {}
    module = header = None
    for line in text.splitlines():
        if line.startswith("## "):
            module, header = line[3:].strip(), None
            modules[module] = {}
        elif module is None or not line.strip():
            continue
        elif line.startswith("importable here: "):
            for item in line[len("importable here: ") :].split(", "):
                modules[module]["import " + item.split(" (from ")[0]] = item
        elif not line.startswith("    "):
            kind, rest = line.split(" ", 1)
            header = f"{kind} {re.split(r'[(:]', rest, maxsplit=1)[0].strip()}"
            modules[module][header] = line
        else:
            member = line.strip()
            modules[module][f"{header} :: {member.split(' = ')[0].split('(')[0]}"] = member
    return modules


def _split_parameters(signature: str) -> List[str]:
    """The top-level comma-separated parts between the first "(" and its matching ")"."""
    parts, depth, current = [], 0, ""
    for char in signature[signature.index("(") + 1 :]:
        if char == ")" and depth == 0:
            break
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    parts.append(current.strip())
    return [p for p in parts if p]


def parameters_of_line(line: str) -> List[Tuple[str, bool]]:
    """(name, has a default) for each parameter of a manifest line, `self` dropped."""
    return [(p.split(":")[0].split("=")[0].strip(), "=" in p) for p in _split_parameters(line) if p != "self"]


def parameters_of(obj) -> List[Tuple[str, bool]]:
    """The same for one of our callables, read from its signature as the manifest was."""
    return parameters_of_line(str(inspect.signature(obj)))


def _field_default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return re.sub(r" at 0x[0-9a-f]+", "", repr(field.default))
    if field.default_factory is not dataclasses.MISSING:
        return f"{getattr(field.default_factory, '__name__', 'factory')}()"
    return "<required>"


def check_entry(module, key: str, line: str) -> str:
    """'' when the entry matches, else what is wrong."""
    if key.startswith("import "):
        return "" if hasattr(module, key[len("import ") :]) else "not importable from the package"
    head, _, member = key.partition(" :: ")
    kind, name = head.split(" ", 1)
    obj = getattr(module, name, None)
    if obj is None:
        return "missing"
    if kind == "enum":
        expected = line.split(": ", 1)[1].split(", ")
        if not (inspect.isclass(obj) and issubclass(obj, enum.Enum)):
            return "not an enum"
        absent = [m for m in expected if m not in obj.__members__]
        return f"members missing: {absent}" if absent else ""
    if kind == "dataclass":
        if not dataclasses.is_dataclass(obj):
            return "not a dataclass"
        if not member:
            return ""
        fields = {f.name: f for f in dataclasses.fields(obj)}
        expected_name, expected_default = line.split(" = ", 1)
        if expected_name not in fields:
            return "field missing"
        ours = _field_default(fields[expected_name])
        return "" if ours == expected_default else f"default {ours}, Megatron's {expected_default}"
    if member:
        member_kind, member_name = member.split(" ", 1)
        attr = inspect.getattr_static(obj, member_name, None)
        if attr is None:
            return "missing"
        if member_kind == "property":
            return "" if isinstance(attr, property) else "not a property"
        obj = getattr(attr, "__func__", attr)
    elif kind == "class":
        obj = obj.__init__
    try:
        ours = parameters_of(obj)
    except (TypeError, ValueError):
        return ""  # a builtin without a signature: nothing to compare
    expected = parameters_of_line(line)
    return "" if ours == expected else f"parameters {ours}, Megatron's {expected}"


def check_public_home(module, key: str) -> str:
    """'' when a name Megatron defines in ``module`` names ``module`` as its home here too, else what is wrong.

    Ours may live with the code that owns it (``megatron.core.public_api`` says why); it then carries ``module`` as
    its ``__module__``, which help(), pickles and API listings read. A class Megatron defines in two modules (and
    we define once) may name either of them."""
    kind, _, rest = key.partition(" ")
    if kind == "import" or " :: " in rest:
        return ""
    home = getattr(getattr(module, rest, None), "__module__", module.__name__)
    if home == module.__name__ or key in REFERENCE.get(home, {}):
        return ""
    return f"its __module__ is {home}; mark it @public_api({module.__name__!r}) where it is defined"


def documented_exclusions() -> List[Tuple[str, str, str]]:
    """(module, entry pattern, reason) rows of docs/compatibility.md's "API entries left out" table."""
    text = COMPATIBILITY_DOC.read_text()
    section = text.split("## API entries left out", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("megatron."):
            rows.append((cells[0], cells[1], cells[2]))
    return rows


def _is_excluded(module_name: str, key: str, exclusions) -> bool:
    return any(
        fnmatch.fnmatchcase(module_name, module_pattern) and fnmatch.fnmatchcase(key, entry_pattern)
        for module_pattern, entry_pattern, _ in exclusions
    )


REFERENCE = parse_manifest(MANIFEST.read_text())
MODULES = sorted(m for m in REFERENCE if not any(m == p or m.startswith(p + ".") for p in LATER))


@pytest.mark.parametrize("module_name", MODULES)
def test_module_matches_megatron_core(module_name):
    module = importlib.import_module(module_name)
    exclusions = documented_exclusions()
    problems = []
    for key, line in REFERENCE[module_name].items():
        if _is_excluded(module_name, key, exclusions):
            continue
        problem = check_entry(module, key, line) or check_public_home(module, key)
        if problem:
            problems.append(f"  {key}: {problem}\n      Megatron: {line.strip()[:200]}")
    assert not problems, f"{module_name}: {len(problems)} entries differ from Megatron-Core 0.19\n" + "\n".join(
        problems
    )


def test_a_name_kept_elsewhere_must_name_its_public_home():
    module = importlib.import_module("megatron.core.utils")
    assert check_public_home(module, "def divide") == ""
    assert "mark it @public_api('megatron.core.utils')" in check_public_home(module, "def Optional")


def test_every_exclusion_has_a_reason_and_is_still_needed():
    """A documented exclusion says why and covers at least one entry that really differs; stale rows fail here."""
    for module_pattern, entry_pattern, reason in documented_exclusions():
        assert len(reason) > 20, f"{module_pattern} | {entry_pattern}: say why it is left out"
        differing = [
            (module_name, key)
            for module_name in MODULES
            if fnmatch.fnmatchcase(module_name, module_pattern)
            for key, line in REFERENCE[module_name].items()
            if fnmatch.fnmatchcase(key, entry_pattern) and check_entry(importlib.import_module(module_name), key, line)
        ]
        assert differing, f"{module_pattern} | {entry_pattern} excuses nothing that differs: remove the row"


def test_the_checker_notices_a_difference():
    """The comparison itself: a renamed parameter, a missing default and a missing name are all reported."""
    import types

    module = types.ModuleType("fake")
    module.f = lambda a, b=1: None
    assert check_entry(module, "def f", "def f(a, b=1)") == ""
    assert check_entry(module, "def f", "def f(a, c=1)") != ""
    assert check_entry(module, "def f", "def f(a=0, b=1)") != ""
    assert check_entry(module, "def g", "def g()") == "missing"
