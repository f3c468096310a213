"""The package layering README and docs/design.md promise, checked over the import graph (ast, no imports run).

bdcore is the base: it imports no other bdstack package. data sits on it alone (self-distillation loads
checkpoints through bdcore, not the server). train and inference never import each other. Nothing but
tests imports tests. No module imports another top-level package's private (leading underscore) name.
bdcore's modules import one another without a circle, function-level imports included (a lazy import
that closes a circle still ties the two modules into one).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bdcore", "data", "train", "inference", "benchmark", "tests")
# package -> the bdstack packages it may import (besides itself)
ALLOWED = {
    "bdcore": set(),
    "data": {"bdcore"},
    "train": {"bdcore", "data"},
    "inference": {"bdcore", "data"},
    "benchmark": {"bdcore", "data", "train", "inference"},
    "tests": {"bdcore", "data", "train", "inference", "benchmark"},
}


def imports(source: str) -> list[tuple[str, list[str]]]:
    """(module, imported names) for every absolute import in `source`, function-level ones included."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
    return found


def violations(package: str, path: str, source: str) -> list[str]:
    """What `source` (a module of `package`) imports against the layering."""
    bad = []
    for module, names in imports(source):
        top = module.split(".")[0]
        if top not in PACKAGES or top == package:
            continue
        if top not in ALLOWED[package]:
            bad.append(f"{path}: {package}/ imports {module}")
        private = [n for n in names if n.startswith("_")]
        private += [p for p in module.split(".") if p.startswith("_") and not p.startswith("__")]
        if private:
            bad.append(f"{path}: imports the private name(s) {private} of {module} across packages")
    return bad


def test_layering_holds_over_the_tree():
    bad = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            bad += violations(package, str(path.relative_to(ROOT)), path.read_text(encoding="utf-8"))
    assert not bad, "layering broken (see tests/test_layering.py for the rules):\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "package, source",
    [
        ("bdcore", "from train.rows import Sample"),
        ("bdcore", "def f():\n    import inference.serve\n"),
        ("train", "from inference.native.engine import Engine"),
        ("inference", "import train.checkpoint"),
        ("data", "from inference.server import app"),
        ("benchmark", "from tests.tiny import tiny_checkpoint"),
        ("train", "from bdcore.scoring import _private"),
        ("benchmark", "from train._impl import thing"),
    ],
)
def test_a_forbidden_import_is_reported(package, source):
    assert violations(package, "x.py", source)


@pytest.mark.parametrize(
    "package, source",
    [
        ("train", "from bdcore.decode.driver import DecodeDriver"),
        ("benchmark", "from inference.native.engine import Engine\nfrom train.rows import Sample"),
        ("inference", "from __future__ import annotations\nimport torch"),
        ("tests", "from benchmark.tiny import tiny_checkpoint"),
        ("bdcore", "from bdcore.decode._x import _y"),  # private within a package is its own business
    ],
)
def test_an_allowed_import_passes(package, source):
    assert not violations(package, "x.py", source)


def module_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """module -> the modules among `sources` it imports (`from a import b` names a.b when b is a module)."""
    graph = {}
    for name, source in sources.items():
        found = set()
        for module, names in imports(source):
            found |= {m for m in (module, *(f"{module}.{n}" for n in names)) if m in sources and m != name}
        graph[name] = found
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import circle once, as the path from its smallest module back to itself."""
    found = set()

    def walk(path: list[str]) -> None:
        for nxt in sorted(graph[path[-1]]):
            if nxt in path:
                circle = path[path.index(nxt) :]
                i = circle.index(min(circle))
                found.add(tuple(circle[i:] + circle[:i]))
            else:
                walk([*path, nxt])

    for module in graph:
        walk([module])
    return [[*c, c[0]] for c in sorted(found)]


def package_sources(package: str) -> dict[str, str]:
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path.read_text(encoding="utf-8")
    return out


def test_bdcore_imports_without_circles():
    found = cycles(module_graph(package_sources("bdcore")))
    assert not found, "import circles in bdcore:\n" + "\n".join(" -> ".join(c) for c in found)


def test_a_circle_is_reported_lazy_imports_included():
    sources = {
        "p.caps": "def runner():\n    from p.decode import runner\n",
        "p.decode": "",
        "p.decode.runner": "from p.decode.modes import Forward\n",
        "p.decode.modes": "from p.caps import MODES\n",
        "p.sidecar": "import p.caps\n",
    }
    assert cycles(module_graph(sources)) == [["p.caps", "p.decode.runner", "p.decode.modes", "p.caps"]]
    sources["p.caps"] = ""
    assert cycles(module_graph(sources)) == []
