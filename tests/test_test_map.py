"""tests/MAP.md, the map from production modules to their tests, stays true: every module under bdcore/,
train/, inference/ and data/ has one row, every module and test file it names exists, a plain entry imports
the module or runs it by name and an "(indirect: ...)" one does not, and a module some test imports is never
"none". Pure file parsing: imports are read with `ast`, nothing is imported."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAP = ROOT / "tests" / "MAP.md"
PACKAGES = ("bdcore", "train", "inference", "data")
ROW = re.compile(r"^\| `([\w/]+\.py)` \| (.+) \|$")
ENTRY = re.compile(r"`(test_\w+\.py)`(\s*\(indirect\b)?")
PATH = re.compile(r"`(\w[\w.-]*/[\w./-]*)`")  # a repository path, not a route such as `/metrics`


def production_modules() -> set[str]:
    return {
        p.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for p in (ROOT / package).rglob("*.py")
        if p.name != "__init__.py"
    }


def dotted(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def referenced(test: Path, modules: set[str]) -> set[str]:
    """The dotted production modules `test` imports (`import X`, `from X import`, `from package import X`) or
    names as a whole string (`python -m X`, `importlib.import_module("X")`)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(test.read_text(encoding="utf-8"), filename=str(test))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
    return names & modules


def read_map() -> dict[str, str]:
    rows: dict[str, str] = {}
    for number, line in enumerate(MAP.read_text(encoding="utf-8").splitlines(), 1):
        match = ROW.match(line)
        if match is None:
            continue
        module, cell = match.groups()
        assert module not in rows, f"tests/MAP.md line {number}: {module} has a second row"
        rows[module] = cell
    return rows


def test_every_production_module_has_one_row_and_every_row_a_module():
    rows = read_map()
    modules = production_modules()
    missing = sorted(modules - rows.keys())
    assert not missing, f"tests/MAP.md lacks a row for {missing}: add one naming the tests that exercise each"
    stale = sorted(rows.keys() - modules)
    assert not stale, f"tests/MAP.md has rows for modules that do not exist: {stale}"


def test_every_entry_exists_and_says_truly_how_it_reaches_its_module():
    modules = {dotted(m) for m in production_modules()}
    imports = {t.name: referenced(t, modules) for t in (ROOT / "tests").glob("test_*.py")}
    problems = []
    for module, cell in read_map().items():
        name = dotted(module)
        entries = ENTRY.findall(cell)
        for path in PATH.findall(cell):
            if not (ROOT / path).exists():
                problems.append(f"{module}: `{path}` does not exist")
        if not entries:
            if not cell.startswith("none"):
                problems.append(f"{module}: name a test file, or say 'none' and what runs it")
            importers = sorted(t for t, found in imports.items() if name in found)
            if importers:
                problems.append(f"{module}: 'none', but {importers} import it")
            continue
        for test, indirect in entries:
            if test not in imports:
                problems.append(f"{module}: {test} does not exist")
            elif indirect and name in imports[test]:
                problems.append(f"{module}: {test} imports it, so it is not indirect")
            elif not indirect and name not in imports[test]:
                problems.append(f"{module}: {test} does not import it; mark it '(indirect: through ...)'")
    assert not problems, "tests/MAP.md:\n" + "\n".join(problems)


def test_the_checks_find_a_planted_error(tmp_path, monkeypatch):
    """A row naming a test that does not import its module, unmarked, is caught (the check is not vacuous)."""
    text = MAP.read_text(encoding="utf-8")
    planted = text.replace(
        "| `bdcore/decode/kv_slab.py` | `test_cache_room.py` (indirect: the runner's batched steps, through "
        "`bdcore/decode/runner.py`) |",
        "| `bdcore/decode/kv_slab.py` | `test_cache_room.py` |",
    )
    assert planted != text
    (tmp_path / "MAP.md").write_text(planted, encoding="utf-8")
    monkeypatch.setattr(sys.modules[__name__], "MAP", tmp_path / "MAP.md")
    try:
        test_every_entry_exists_and_says_truly_how_it_reaches_its_module()
    except AssertionError as e:
        assert "test_cache_room.py does not import it" in str(e)
    else:
        raise AssertionError("a plain entry for a test that does not import its module passed")
