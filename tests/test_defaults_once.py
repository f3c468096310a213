"""Every serving and decode default is written once in production code (issue 58, "one home per default").

The decode settings' defaults live in `bdcore.decode.config` (`DecodeConfig`, `SELF_SPEC_CANVASES`); where a
server listens and its limits in `inference.server_defaults.ServerDefaults`. Everything else (serve.py's flags
and their help, both GPU backends' settings and commands, the app, the scheduler, the trainer's rollout
thresholds, the clients, the benchmarks that state a serving default) reads them from there.

The check reads every production module's syntax tree (no imports run) and reports the default's literal where
it is given to something that means that setting outside its home: a field or variable (`threshold: float =
0.9`), a parameter default (`def f(*, max_batch=8)`), a keyword (`Scheduler(engine, max_batch=8)`, `{"threshold":
0.9}`), an argparse `default=` of a flag of that name, and "default 0.9" written in a message or help text
about that setting. A name means a setting when it is the setting's name or ends with `_<name>`
(`opd_threshold`, `--rl-threshold`), so AdamW's `betas=(0.9, 0.95)` or a sweep's `THRESHOLDS` are not copies.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCTION = ("bdcore", "bdstack", "inference", "train", "data", "benchmark")
DECODE = "bdcore/decode/config.py::DecodeConfig"
SERVER = "inference/server_defaults.py::ServerDefaults"
ANY = None  # a default whose value alone is distinctive: every literal of it counts, whatever it is given to


@dataclass(frozen=True)
class Default:
    value: object
    names: tuple[str, ...] | None  # what the setting is called (fields, parameters, keywords, flags); ANY
    home: str  # "path::Class" (or "path::" for a module-level constant): the one place its literal may stand
    # whether a call passing the literal (`f(threshold=0.9)`, `{"threshold": 0.9}`) copies it: not where the value
    # is one choice among few that a caller names on purpose (a benchmark's "self-spec last" variant)
    keywords: bool = True


DEFAULTS = (
    Default(0.9, ("threshold",), DECODE),
    Default("last", ("self_spec_canvases", "canvases"), DECODE, keywords=False),
    Default(("last", "all", "auto"), ANY, "bdcore/decode/config.py::"),  # SELF_SPEC_CANVASES
    Default("127.0.0.1", ("host",), SERVER),
    Default(30000, ("port",), SERVER),
    Default(8, ("max_batch",), SERVER),
    Default(512, ("max_tokens", "default_max_tokens"), SERVER),
    Default(4 * 2**20, ("max_request_bytes",), SERVER),
    Default(2.0, ("chat_template_timeout", "chat_template_timeout_s", "default_timeout_s", "seconds"), SERVER),
    Default(20.0, ("header_timeout", "header_timeout_s"), SERVER),
)


def production_files() -> list[Path]:
    files = [ROOT / "train.py", ROOT / "setup.py"]
    for package in PRODUCTION:
        files += sorted((ROOT / package).rglob("*.py"))
    return [f for f in files if f.is_file()]


_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Pow: lambda a, b: a**b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: a // b,
}
UNKNOWN = object()


def literal(node: ast.AST | None) -> object:
    """The value of a literal expression (constants, +-*/ ** of them, tuples and lists); UNKNOWN otherwise."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = literal(node.operand)
        return -v if isinstance(v, (int, float)) and not isinstance(v, bool) else UNKNOWN
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        a, b = literal(node.left), literal(node.right)
        numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))
        return _OPS[type(node.op)](a, b) if numbers else UNKNOWN
    if isinstance(node, (ast.Tuple, ast.List)):
        items = tuple(literal(e) for e in node.elts)
        return UNKNOWN if any(i is UNKNOWN for i in items) else items
    return UNKNOWN


def same(value: object, default: object) -> bool:
    if isinstance(default, (int, float)) and not isinstance(default, bool):  # 2 and 2.0 are one timeout
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == default
    return type(value) is type(default) and value == default


def norm(name: str) -> str:
    return name.lstrip("-").replace("-", "_").lower()


def means(name: str | None, d: Default) -> bool:
    """Whether `name` (a field, parameter, keyword or flag) names `d`'s setting."""
    if d.names is ANY:
        return True
    if name is None:
        return False
    n = norm(name)
    return any(n == s or n.endswith("_" + s) for s in d.names)


def texts(value: object) -> set[str]:
    """How the value is written in prose: 0.9, 2.0 and 2, 4194304."""
    if isinstance(value, float):
        return {repr(value), f"{value:g}"}
    return {str(value)} if isinstance(value, (int, str)) else set()


def mentions(text: str, d: Default) -> bool:
    """Whether a message or help text speaks of `d`'s setting (`threshold`, `--max-batch`, `rl_threshold`)."""
    if d.names is ANY:
        return False
    low = text.lower().replace("-", "_")
    return any(re.search(rf"(?<![a-z0-9]){re.escape(s)}(?![a-z0-9])", low) for s in d.names)


def states_default(text: str, d: Default) -> bool:
    """`text` writes the default out: "default 0.9", "(default: 8", "default 2;" (not "default 20", "0.95")."""
    return any(re.search(rf"default:?\s+{re.escape(t)}(?![\w.])", text) for t in texts(d.value))


@dataclass(frozen=True)
class Site:
    path: str
    line: int
    scope: str  # the enclosing class ("" at module level and in functions outside classes)
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def _string_parts(node: ast.AST) -> str | None:
    """A string literal's text, or an f-string's literal parts (its fields left out)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
    return None


def _flag_name(call: ast.Call) -> str | None:
    """The setting an argparse `add_argument` call defines: its `dest=`, else its long flag, else its name."""
    for k in call.keywords:
        if k.arg == "dest" and isinstance(k.value, ast.Constant):
            return k.value.value
    names = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return next((n for n in names if n.startswith("--")), names[0] if names else None)


@cache
def parsed(source: str) -> tuple[ast.Module, frozenset[int]]:
    """A module's tree (read, never changed) and the ids of its bare string statements (docstrings)."""
    tree = ast.parse(source)
    docs = frozenset(
        id(n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
    )
    return tree, docs


def copies(path: str, source: str, d: Default) -> list[Site]:
    """Every place in `source` that gives `d`'s literal to its setting (the home included)."""
    found: list[Site] = []
    tree, docstrings = parsed(source)

    def given(name: str | None, value: ast.AST | None, node: ast.AST, scope: str, how: str) -> None:
        if value is not None and means(name, d) and same(literal(value), d.value):
            found.append(Site(path, node.lineno, scope, f"{how} {name or ''} = {d.value!r}".replace("  ", " ")))

    def prose(node: ast.AST, scope: str, about: str | None) -> None:
        text = _string_parts(node)
        if text is None or id(node) in docstrings or not states_default(text, d):
            return
        if (about is not None and means(about, d)) or mentions(text, d):
            found.append(Site(path, node.lineno, scope, f"{text!r} writes the default {d.value!r} out"))

    def visit(node: ast.AST, scope: str) -> None:
        flag = None  # the setting an argparse add_argument call defines
        if isinstance(node, ast.ClassDef):
            scope = node.name
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                pairs = [(target, node.value)]
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs = list(zip(target.elts, node.value.elts, strict=False))
                for t, v in pairs:
                    name = t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else None
                    if d.names is not ANY:
                        given(name, v, node, scope, "assigns")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            positional = a.posonlyargs + a.args
            for arg, default in zip(positional[len(positional) - len(a.defaults) :], a.defaults, strict=True):
                given(arg.arg, default, node, scope, "parameter")
            for arg, default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
                given(arg.arg, default, node, scope, "parameter")
        elif isinstance(node, ast.Call):
            if isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
                flag = _flag_name(node)
            for k in node.keywords:
                if flag is not None and k.arg == "default":
                    given(flag, k.value, node, scope, "argparse default of")
                elif flag is not None and k.arg == "help":
                    prose(k.value, scope, flag)
                elif k.arg is not None and d.names is not ANY and d.keywords:
                    given(k.arg, k.value, node, scope, "keyword")
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and isinstance(key.value, str) and d.names is not ANY and d.keywords:
                    given(key.value, value, node, scope, "dict key")
        elif isinstance(node, (ast.Constant, ast.JoinedStr)):
            prose(node, scope, None)
            return  # an f-string's parts are read as one text
        if d.names is ANY and isinstance(node, (ast.Tuple, ast.List)) and same(literal(node), d.value):
            found.append(Site(path, node.lineno, scope, f"the literal {d.value!r}"))
        for child in ast.iter_child_nodes(node):
            if not (flag is not None and isinstance(child, ast.keyword) and child.arg == "help"):  # read above
                visit(child, scope)

    visit(tree, "")
    return found


def at_home(site: Site, d: Default) -> bool:
    path, cls = d.home.split("::")
    return site.path == path and site.scope == cls


def scan(d: Default) -> list[Site]:
    sites = []
    for f in production_files():
        sites += copies(str(f.relative_to(ROOT)), f.read_text(encoding="utf-8"), d)
    return sites


@pytest.mark.parametrize("d", DEFAULTS, ids=lambda d: f"{d.value!r}")
def test_each_default_is_written_once_in_its_home(d):
    sites = scan(d)
    strays = [s for s in sites if not at_home(s, d)]
    assert not strays, (
        f"the default {d.value!r} is written outside its home {d.home}; read it from there "
        "(DecodeConfig.threshold, SERVER.max_batch, ... ; f-strings for help and messages):\n"
        + "\n".join(map(str, strays))
    )
    home = [s for s in sites if at_home(s, d)]
    assert len(home) == 1, f"{d.home} should hold the literal {d.value!r} once, found: {[str(s) for s in home]}"


def addresses(source: str, address: str) -> list[int]:
    """Lines of `source` whose string literals (docstrings aside) hold `address`, e.g. a client's base URL."""
    tree, docstrings = parsed(source)
    return [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and address in n.value and id(n) not in docstrings
    ]


def test_no_client_writes_the_server_address_out():
    """The clients' default base URL is `SERVER.base_url`, made from the host and port defaults."""
    address = "127.0.0.1:30000"
    found = [f"{f.relative_to(ROOT)}:{line}" for f in production_files() for line in addresses(f.read_text(), address)]
    assert not found, f"{address} written out (use inference.server_defaults.SERVER.base_url): {found}"
    assert addresses(
        'p.add_argument("--base-url", default=os.environ.get("URL", "http://127.0.0.1:30000/v1"))', address
    )
    assert not addresses('"""python chat.py --base-url http://127.0.0.1:30000/v1"""', address)


def test_the_homes_hold_the_values_the_check_names():
    from bdcore.decode.config import SELF_SPEC_CANVASES, DecodeConfig
    from inference.server_defaults import SERVER as defaults

    assert (DecodeConfig.threshold, DecodeConfig.self_spec_canvases) == (0.9, "last")
    assert SELF_SPEC_CANVASES == ("last", "all", "auto")
    assert (defaults.host, defaults.port, defaults.base_url) == ("127.0.0.1", 30000, "http://127.0.0.1:30000/v1")
    assert (defaults.max_batch, defaults.max_tokens, defaults.max_request_bytes) == (8, 512, 4 * 2**20)
    assert (defaults.chat_template_timeout_s, defaults.header_timeout_s) == (2.0, 20.0)


def _by_value(value) -> Default:
    return next(d for d in DEFAULTS if d.value == value and type(d.value) is type(value))


@pytest.mark.parametrize(
    "value, source",
    [
        (0.9, 'p.add_argument("--threshold", type=float, default=0.9)'),
        (0.9, "class OPDSection:\n    opd_threshold: float = 0.9\n"),
        (0.9, "def bdstack_settings(model, mode, *, threshold: float = 0.9):\n    pass\n"),
        (0.9, "DecodeConfig(mode, threshold=0.9)"),
        (0.9, 'settings = {"threshold": 0.9}'),
        (0.9, 'raise CannotServe(f"threshold must be >= 0, got {t}; give one in [0, 1] (default 0.9)")'),
        (0.9, 'p.add_argument("--threshold", type=float, help="commit threshold of the rollouts (default 0.9)")'),
        ("last", 'def f(*, self_spec_canvases: str = "last"):\n    pass\n'),
        (("last", "all", "auto"), 'CANVAS_CHOICES = ("last", "all", "auto")'),
        (("last", "all", "auto"), 'n.add_argument("--self-spec-canvases", choices=["last", "all", "auto"])'),
        (8, "class Scheduler:\n    def __init__(self, engine, max_batch: int = 8):\n        pass\n"),
        (8, 'n.add_argument("--max-batch", type=int, default=SERVER.max_batch, help="together (default 8; 1: one)")'),
        (512, "def create_app(loaded, *, default_max_tokens: int = 512):\n    pass\n"),
        (512, 'p.add_argument("--max-tokens", type=int, default=512)'),
        (30000, 'p.add_argument("--port", type=int, default=30000)'),
        ("127.0.0.1", 'def build(model, *, host: str = "127.0.0.1"):\n    pass\n'),
        (4 * 2**20, "DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20\ndef f(max_request_bytes=DEFAULT_MAX_REQUEST_BYTES): ..."),
        (4 * 2**20, 'n.add_argument("--max-request-bytes", type=int, default=4 * 2**20)'),
        (2.0, "class TemplateLimits:\n    seconds: float = 2.0\n"),
        (2.0, "DEFAULT_TIMEOUT_S = 2.0  # client templates render in milliseconds"),
        (2.0, 'n.add_argument("--chat-template-timeout", type=float, default=2)'),
        (20.0, 'n.add_argument("--header-timeout", type=float, default=20.0)'),
    ],
)
def test_a_copy_is_found(value, source):
    assert copies("x.py", source, _by_value(value)), source


@pytest.mark.parametrize(
    "value, source",
    [
        (0.9, "torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)"),
        (0.9, "THRESHOLDS = (0.5, 0.7, 0.9, 0.95)"),
        (0.9, "MASK, V, B, THR = 99, 100, 8, 0.9"),
        (0.9, 'def f():\n    """Passing `--opd_threshold 0.9` (the default) changes nothing; default 0.9."""\n'),
        (0.9, "DecodeConfig(mode, threshold=DecodeConfig.threshold)"),
        (0.9, 'help=f"diffusion commit confidence (default {DecodeConfig.threshold})"'),
        (8, 'p.add_argument("--concurrency", type=int, default=8, help="engine requests in flight (default 8)")'),
        (8, "rl_group_size: int = 8"),
        (512, "MAX_PROBE_EVERY = 512"),
        (512, 'p.add_argument("--max-new-tokens", type=int, default=512)'),
        (2.0, 'n.add_argument("--header-timeout", type=float, default=20.0, help="(default 20; bodies)")'),
        (20.0, "probe = torch.linspace(0.5, 20.0, 4)"),
        (30000, 'p.add_argument("--port", type=int, default=SERVER.port)'),
    ],
)
def test_an_unrelated_literal_is_not_a_copy(value, source):
    assert not copies("x.py", source, _by_value(value)), source


def test_a_benchmark_naming_a_layout_on_purpose_is_not_a_copy():
    """'last' is one of three layouts: a variant that names it chooses it; a parameter defaulting to it copies."""
    d = _by_value("last")
    assert not copies("x.py", 'VARIANTS = {"self-spec last": dict(mode="self-spec", self_spec_canvases="last")}', d)
    assert copies("x.py", 'def settings(*, self_spec_canvases: str = "last"): ...', d)
