"""Write the shipped code prompt set for conversion runs (data/prompts/stdlib_*.jsonl) from the Python
standard library's own source.

    python -m data.make_stdlib_prompts [--out data/prompts] [--train 2000] [--heldout 100]

A block-diffusion conversion learns to draft the base model's own answers, so it needs many prompts of
the kind it will serve, and the only code prompts the project had (HumanEval's 124 train tasks) are too
few: a 10-minute run saw each answer six times. The standard library is thousands of short, documented,
pure-Python functions under the PSF license (permissive; `data/prompts/LICENSE-Python`), and it is on
every machine with Python, so the set needs no download. Each top-level public function with a docstring
becomes a HumanEval-style stub (its signature and docstring, body removed) in a one-turn chat asking for the
completed function; the answers come from `python -m data.self_distill`. Nothing is imported: the source is
parsed with `ast`. The split does not depend on Python's `random`: functions are ordered by the SHA-256 of
`module.name`, one function per name is kept (the first in that order), the first `--heldout` are held out
(for the drafting metric, `--eval_data`) and the next `--train` are the train set. Only the generated files
are committed, with the Python version that wrote them; HumanEval (pass@1) shares no prompt with them.
"""

from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

INSTRUCTION = "Complete this Python function. Reply with the full function in a ```python block."
DEFAULT_OUT = Path(__file__).resolve().parent / "prompts"
# Packages that are tests, demos, tooling or platform shims: their functions are not self-contained tasks.
SKIP_DIRS = {
    "test", "tests", "idlelib", "lib2to3", "ensurepip", "site-packages", "dist-packages", "turtledemo",
    "tkinter", "pydoc_data", "__pycache__", "venv", "distutils", "msilib", "config-3", "unittest",
}  # fmt: skip
DOC_CHARS = (40, 700)  # docstrings shorter say too little to implement from; longer are manuals
BODY_LINES = (1, 40)  # answers a small model finishes within a few hundred tokens


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _skipped(path: Path, root: Path) -> bool:
    parts = path.relative_to(root).parts
    return any(p in SKIP_DIRS or p.startswith(("config-", "test_")) for p in parts) or parts[-1] == "__main__.py"


def _stub(fn: ast.FunctionDef, indent: str = "") -> str | None:
    """`def name(args) -> ret:` and the docstring, as the source would show it, or None if it is not a task."""
    doc = ast.get_docstring(fn, clean=True)
    if doc is None or not DOC_CHARS[0] <= len(doc) <= DOC_CHARS[1] or '"""' in doc or "\\" in doc:
        return None
    body_lines = fn.end_lineno - fn.body[0].end_lineno if len(fn.body) > 1 else 0
    if not BODY_LINES[0] <= body_lines <= BODY_LINES[1] or fn.decorator_list:
        return None
    bare = copy.copy(fn)  # the same signature (and, on Python >= 3.12, type parameters), no body
    bare.body, bare.decorator_list = [ast.Pass()], []
    signature = ast.unparse(bare).splitlines()[0]  # "def name(args) -> ret:"
    inner = indent + "    "
    text = "\n".join(inner + line.rstrip() if line.strip() else "" for line in doc.strip().splitlines())
    return f'{indent}{signature}\n{inner}"""{text.lstrip()}\n{inner}"""'


def _tasks(tree: ast.Module):
    """(name, stub) for each top-level function and each method of a top-level class (with its `class` line:
    a method is a task in its class's context). Dunder methods are skipped: their job is the protocol's."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("__"):
            stub = _stub(node)
            if stub is not None:
                yield node.name, stub
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and not item.name.startswith("__"):
                    stub = _stub(item, indent="    ")
                    if stub is not None:
                        yield f"{node.name}.{item.name}", f"class {node.name}:\n{stub}"


def functions(root: Path) -> list[dict]:
    """Every function and method of the library under `root` that makes a stub, one per (qualified) name."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if _skipped(path, root):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        for name, stub in _tasks(tree):
            found.append({"source": f"{module}.{name}", "name": name, "stub": stub})
    found.sort(key=lambda f: hashlib.sha256(f["source"].encode()).hexdigest())
    seen, unique = set(), []
    for f in found:
        if f["name"] not in seen:
            seen.add(f["name"])
            unique.append(f)
    return unique


def to_prompt(fn: dict) -> dict:
    content = f"{INSTRUCTION}\n\n```python\n{fn['stub']}\n```"
    return {"messages": [{"role": "user", "content": content}], "source": fn["source"]}


def write(fns: list[dict], out: Path, *, train: int, heldout: int) -> dict[str, int]:
    if len(fns) < train + heldout:
        raise SystemExit(
            f"make_stdlib_prompts: error: this Python's standard library gives {len(fns)} functions, fewer than "
            f"--train {train} + --heldout {heldout}; ask for fewer"
        )
    out.mkdir(parents=True, exist_ok=True)
    splits = {"stdlib_heldout.jsonl": fns[:heldout], "stdlib_train.jsonl": fns[heldout : heldout + train]}
    for name, rows in splits.items():
        with open(out / name, "w", encoding="utf-8") as f:
            for fn in rows:
                f.write(json.dumps(to_prompt(fn), ensure_ascii=False) + "\n")
    return {name: len(rows) for name, rows in splits.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m data.make_stdlib_prompts", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: data/prompts)")
    p.add_argument("--train", type=int, default=2000, help="train prompts (default 2000)")
    p.add_argument("--heldout", type=int, default=100, help="held-out prompts, written first (default 100)")
    p.add_argument("--stdlib", type=Path, default=None, help="library source to read (default: this Python's)")
    args = p.parse_args(argv)
    if args.train < 1 or args.heldout < 0:
        p.error("--train must be >= 1 and --heldout >= 0")
    root = args.stdlib or stdlib_root()
    if not root.is_dir():
        p.error(f"--stdlib {root}: no such folder")
    fns = functions(root)
    counts = write(fns, args.out, train=args.train, heldout=args.heldout)
    version = ".".join(map(str, sys.version_info[:3]))
    print(f"{len(fns)} functions in the Python {version} standard library at {root}; wrote {counts} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
