"""data/make_stdlib_prompts.py: stubs from a library's source (functions and methods, signature and
docstring, body removed), what is left out, the deterministic split; and the shipped prompt files."""

import ast
import json
from pathlib import Path

import pytest

from data.make_stdlib_prompts import INSTRUCTION, functions, main

REPO = Path(__file__).resolve().parent.parent

LIB = {
    "shapes.py": '''
import math


def area(r: float, *, pi=math.pi) -> float:
    """Return the area of a circle of radius r, in the square units of r."""
    return pi * r * r


def _private_helper(x):
    """A private helper is a task too: it has a body and says what it does."""
    y = x + 1
    return y


def undocumented(x):
    return x


def terse(x):
    """Too short."""
    return x


@staticmethod
def decorated(x):
    """Decorated functions are skipped: the decorator changes what the body must do."""
    return x


class Box:
    """A box."""

    def __init__(self, w):
        """Dunder methods are left out: their job is the protocol's, not their docstring's."""
        self.w = w

    def grow(self, by=1):
        """Make the box wider by `by` units and return its new width.

        Negative values shrink it.
        """
        self.w += by
        return self.w
''',
    "pkg/__init__.py": '''
def area(r):
    """Another function of the same name: only one function per name is kept."""
    return r
''',
    "test/test_shapes.py": '''
def check_area():
    """Test folders are not a source of tasks, whatever their docstrings say."""
    assert True
''',
}


@pytest.fixture
def lib(tmp_path):
    root = tmp_path / "lib"
    for name, text in LIB.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_stubs_are_signature_and_docstring_of_functions_and_methods(lib):
    listed = functions(lib)
    found = {f["name"]: f for f in listed}
    assert set(found) == {"area", "_private_helper", "Box.grow"} and len(listed) == 3
    assert found["area"]["stub"] == (
        "def area(r: float, *, pi=math.pi) -> float:\n"
        '    """Return the area of a circle of radius r, in the square units of r.\n    """'
    )
    assert found["Box.grow"]["stub"] == (
        "class Box:\n    def grow(self, by=1):\n"
        '        """Make the box wider by `by` units and return its new width.\n\n'
        '        Negative values shrink it.\n        """'
    )
    for f in found.values():  # every stub is Python whose function has no body beyond its docstring
        tree = ast.parse(f["stub"] + "\n" + ("        " if "class" in f["stub"] else "    ") + "pass\n")
        assert tree.body


def test_the_split_is_deterministic_and_disjoint(lib, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["--stdlib", str(lib), "--out", str(out), "--train", "2", "--heldout", "1"]) == 0
    held = [json.loads(x) for x in (out / "stdlib_heldout.jsonl").read_text().splitlines()]
    train = [json.loads(x) for x in (out / "stdlib_train.jsonl").read_text().splitlines()]
    assert len(held) == 1 and len(train) == 2
    assert not {r["source"] for r in held} & {r["source"] for r in train}
    assert [r["source"] for r in held + train] == [f["source"] for f in functions(lib)]
    for r in held + train:
        (msg,) = r["messages"]
        assert msg["role"] == "user" and msg["content"].startswith(INSTRUCTION + "\n\n```python\n")
    with pytest.raises(SystemExit, match="fewer than --train 5"):
        main(["--stdlib", str(lib), "--out", str(out), "--train", "5", "--heldout", "1"])


def test_the_shipped_stdlib_prompt_files():
    held = [json.loads(x) for x in (REPO / "data/prompts/stdlib_heldout.jsonl").read_text().splitlines()]
    train = [json.loads(x) for x in (REPO / "data/prompts/stdlib_train.jsonl").read_text().splitlines()]
    assert len(train) >= 1500 and len(held) >= 50
    sources = [r["source"] for r in held + train]
    assert len(set(sources)) == len(sources)
    for r in held + train:
        stub = r["messages"][0]["content"].split("```python\n", 1)[1].removesuffix("\n```")
        indent = "        " if stub.startswith("class ") else "    "
        ast.parse(stub + "\n" + indent + "pass\n")
        assert stub.splitlines()[-1].strip() == '"""'
