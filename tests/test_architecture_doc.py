"""docs/architecture.md stays true: every name in its tree exists, and every module of the program is in it.

The tree (the doc's first code block) nests by indentation: a name sits two columns deeper than its
folder, and a line that starts at or past the column of the description above it continues that
description. Any other indentation is an error rather than a guess, so a mis-indented name cannot hide
as a description. Names repeat across folders (`config.py`, `commands.py`, `run.sh`), so each entry is
resolved to its full path before any check.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
# tests/ is left out: tests/README.md maps the test files.
MAPPED = ("bdcore", "bdstack", "train", "inference", "data", "benchmark")
FIX = "Fix: edit docs/architecture.md (one line a file, indented under its folder) so it names exactly what exists."


def tree_lines(text: str) -> list[str]:
    """The lines of the doc's first fenced code block."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("```"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
    return lines[start + 1 : end]


def tree_paths(lines: list[str]) -> list[str]:
    """The full path of every entry, in order; folders end with '/'. Raises ValueError on a broken tree."""
    paths: list[str] = []
    folders: list[str] = []  # the open folders, one per depth
    last_indent, last_was_folder, description_col = -2, True, float("inf")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        name = line.split()[0]
        if indent > last_indent + 2:
            if indent >= description_col:
                continue  # a description running on
            raise ValueError(f"tree line {number}: {name!r} is indented neither as a name nor as a description")
        if indent % 2:
            raise ValueError(f"tree line {number}: {name!r} is indented by an odd number of columns")
        if indent == last_indent + 2 and not last_was_folder:
            raise ValueError(f"tree line {number}: {name!r} is indented under {paths[-1]!r}, which is not a folder")
        del folders[indent // 2 :]
        path = "/".join([*folders, name])
        paths.append(path)
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
        last_indent, last_was_folder = indent, name.endswith("/")
        rest = line[indent + len(name) :]
        # where a running-on description must start; an entry without a description takes none
        description_col = len(line) - len(rest.lstrip()) if rest.strip() else float("inf")
    return paths


def documented() -> list[str]:
    try:
        return tree_paths(tree_lines(DOC.read_text(encoding="utf-8")))
    except ValueError as e:
        broken = str(e)
    pytest.fail(f"docs/architecture.md: {broken}\n{FIX}")


def modules() -> set[str]:
    """Every module the map must name: the top-level scripts and the program folders' modules."""
    found = {p.name for p in ROOT.glob("*.py")}
    for folder in MAPPED:
        found |= {p.relative_to(ROOT).as_posix() for p in (ROOT / folder).rglob("*.py") if p.name != "__init__.py"}
    return found


def test_the_parser_resolves_each_name_to_its_folder():
    lines = [
        "a/      one",
        "  config.py   the first",
        "  b/          a folder whose description",
        "              runs on",
        "    config.py   the second",
        "  c.py        back up one level",
        "config.py   at the top",
    ]
    assert tree_paths(lines) == ["a/", "a/config.py", "a/b/", "a/b/config.py", "a/c.py", "config.py"]
    with pytest.raises(ValueError, match="not a folder"):
        tree_paths(["a.py   a file", "  b.py   under a file"])
    with pytest.raises(ValueError, match="neither"):
        tree_paths(["a/     a folder", "  b.py   in it", "      c.py   too deep"])


def test_every_name_in_the_map_exists():
    paths = documented()
    gone = [p for p in paths if not ((ROOT / p).is_dir() if p.endswith("/") else (ROOT / p).is_file())]
    twice = sorted({p for p in paths if paths.count(p) > 1})
    assert not gone, f"docs/architecture.md names what does not exist: {gone}\n{FIX}"
    assert not twice, f"docs/architecture.md names these twice: {twice}\n{FIX}"


def test_every_module_is_in_the_map():
    missing = sorted(modules() - set(documented()))
    assert not missing, f"modules missing from docs/architecture.md: {missing}\n{FIX}"
