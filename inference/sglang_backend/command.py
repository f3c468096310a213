"""Build SGLang's commands: `python -m sglang.launch_server` for causal mode (stock SGLang on the HF weights) and
for upstream SGLang's own dLLM families, our launcher for diffusion and self-spec (`command_from_args` picks one
from serve.py's flags). What they share with the vLLM backend's commands is `inference/backend_command.py`'s.

SDAR, LLaDA2.0 and LLaDA2.1 are served by SGLang with its built-in diffusion algorithms, not by our engine.
Each family's algorithm and settings live in `configs/<family>.yaml` beside this module (one schema for
all) so that retuning a preset is a data change, and this module only validates that data and turns it
into argv.

SGLang (checked against 0.5.23) takes `--dllm-algorithm NAME` (the algorithm class name) and
`--dllm-algorithm-config PATH`, a YAML file it reads with `yaml.safe_load` and queries with `.get(key, default)`.
Because of that `.get`, a misspelt key is silently ignored upstream, so we check keys against what each
algorithm actually reads (`ALGORITHM_KEYS`) before SGLang ever starts.

Stdlib, PyYAML and modules that import only the stdlib (`inference.backend_command` and the defaults' homes,
`bdcore.decode.config` and `inference.server_defaults`): this runs in serve.py's process, which need not have
torch or sglang installed.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from inference.backend_command import Engine, Server, decode_flags, repo_environment
from inference.server_defaults import SERVER

FAMILIES: tuple[str, ...] = ("sdar", "llada2-0", "llada2-1-speed", "llada2-1-quality")
CONFIG_DIR: Path = Path(__file__).resolve().parent / "configs"
SGLANG_PYTHON_ENV = "BDSTACK_SGLANG_PYTHON"
SGLANG = Engine("sglang", "SGLang", SGLANG_PYTHON_ENV, stops_at="config.json / generation_config.json eos_token_id")
LAUNCH_SERVER = "sglang.launch_server"
BATCH_FLAG = "--max-running-requests"  # serve.py's --max-batch, for the dLLM modes and families
# serve.py --device cpu: SGLang's own CPU engine (0.5.23: the environment variable turns it on; torch_native is its
# attention, which our plugin gives the canvas rule, canvas_attention.py; no CUDA graphs). `make sglang-cpu` builds
# the environment it runs in.
CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE=1"
CPU_ENGINE_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph")

_NUMBER = (int, float)
# Keys each SGLang algorithm reads from its config (sglang/srt/dllm/algorithm/*.py, 0.5.23), with accepted
# types. `block_size` is read for every algorithm by sglang/srt/dllm/config.py and overrides the model default.
ALGORITHM_KEYS: dict[str, dict[str, tuple[type, ...]]] = {
    "LowConfidence": {"threshold": _NUMBER, "block_size": (int,)},
    "JointThreshold": {
        "threshold": _NUMBER,
        "edit_threshold": _NUMBER,
        "max_post_edit_steps": (int,),
        "penalty_lambda": _NUMBER,
        "vectorized_decoding": (bool,),
        "block_size": (int,),
    },
}
_SCHEMA: dict[str, type] = {
    "family": str,
    "description": str,
    "algorithm": str,
    "algorithm_config": dict,
    "server_args": list,
}


@dataclass(frozen=True)
class FamilyConfig:
    """One validated `configs/<family>.yaml`."""

    family: str
    description: str
    algorithm: str  # value for --dllm-algorithm
    algorithm_config: dict  # contents of the --dllm-algorithm-config YAML (may be empty)
    server_args: tuple[str, ...]  # extra launch_server flags the family always needs


def _type_ok(value: object, types: tuple[type, ...]) -> bool:
    # bool is an int subclass; `threshold: true` is a typo, not a number.
    if isinstance(value, bool):
        return bool in types
    return isinstance(value, types)


def load_family_config(family: str, config_dir: Path = CONFIG_DIR) -> FamilyConfig:
    """Read and validate `config_dir/<family>.yaml`; every problem is a ValueError naming the file and key."""
    if family not in FAMILIES:
        raise ValueError(f"unknown SGLang dLLM family {family!r}; choose one of: {', '.join(FAMILIES)}")
    path = Path(config_dir) / f"{family}.yaml"
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ValueError(f"{path}: cannot read family config ({e})") from e
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: invalid YAML ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping with keys {sorted(_SCHEMA)}, got {type(data).__name__}")

    missing = sorted(set(_SCHEMA) - set(data))
    if missing:
        raise ValueError(f"{path}: missing key(s) {missing}")
    extra = sorted(set(data) - set(_SCHEMA))
    if extra:
        raise ValueError(f"{path}: unknown key(s) {extra}; allowed: {sorted(_SCHEMA)}")
    for key, typ in _SCHEMA.items():
        if not isinstance(data[key], typ):
            raise ValueError(f"{path}: key {key!r} must be a {typ.__name__}, got {type(data[key]).__name__}")
    if data["family"] != family:
        raise ValueError(f"{path}: key 'family' is {data['family']!r}, expected {family!r} (the file name)")

    algorithm = data["algorithm"]
    if algorithm not in ALGORITHM_KEYS:
        raise ValueError(f"{path}: key 'algorithm' is {algorithm!r}; known SGLang algorithms: {sorted(ALGORITHM_KEYS)}")
    allowed = ALGORITHM_KEYS[algorithm]
    for key, value in data["algorithm_config"].items():
        if key not in allowed:
            raise ValueError(
                f"{path}: key 'algorithm_config.{key}' is not read by SGLang's {algorithm}; allowed: {sorted(allowed)}"
            )
        if not _type_ok(value, allowed[key]):
            names = "/".join(t.__name__ for t in allowed[key])
            raise ValueError(f"{path}: key 'algorithm_config.{key}' must be {names}, got {type(value).__name__}")

    for i, arg in enumerate(data["server_args"]):
        if not isinstance(arg, str):
            raise ValueError(f"{path}: key 'server_args[{i}]' must be a str, got {type(arg).__name__}")

    return FamilyConfig(
        family=family,
        description=data["description"],
        algorithm=algorithm,
        algorithm_config=dict(data["algorithm_config"]),
        server_args=tuple(data["server_args"]),
    )


def write_algorithm_config(cfg: FamilyConfig, directory: Path) -> Path:
    """Write `cfg.algorithm_config` as the YAML file SGLang's --dllm-algorithm-config expects; return its path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{cfg.family}-{cfg.algorithm}.yaml"
    path.write_text(yaml.safe_dump(cfg.algorithm_config, sort_keys=True))
    return path


def build_sglang_command(
    model: str,
    *,
    family: str,
    python: str = "python",
    host: str = SERVER.host,
    port: int = SERVER.port,
    api_key: str | None = None,
    extra_args: Sequence[str] = (),
    config_dir: Path = CONFIG_DIR,
    algo_config_path: Path | None = None,
    max_running_requests: int | None = None,
    served_model_name: str | None = None,
) -> list[str]:
    """Return the launch_server argv for `model` served as `family`.

    Order: interpreter and module, model/host/port, the dLLM algorithm (+ its config file), the family's fixed
    server args, the API key, then `extra_args` last so a caller can override anything before it.
    `max_running_requests` (serve.py's --max-batch) becomes --max-running-requests: SGLang runs dLLM
    requests one at a time without it.

    An empty `algorithm_config` omits --dllm-algorithm-config entirely: SGLang would read an empty file as
    None and crash on `.get`. If the config is non-empty and no `algo_config_path` is given, it is written to
    a fresh temporary directory (left in place: the server reads it after this returns).
    """
    cfg = load_family_config(family, config_dir)
    server = Server(python, host, port, api_key, served_model_name)
    cmd = server.head(LAUNCH_SERVER, "--model-path", model) + ["--dllm-algorithm", cfg.algorithm]
    if cfg.algorithm_config:
        if algo_config_path is None:
            algo_config_path = write_algorithm_config(cfg, Path(tempfile.mkdtemp(prefix="bdstack-sglang-")))
        cmd += ["--dllm-algorithm-config", str(algo_config_path)]
    cmd += list(cfg.server_args)
    return cmd + server.flags(BATCH_FLAG, max_running_requests) + list(extra_args)


def build_causal_command(model: str, server: Server, *, extra_args: Sequence[str] = ()) -> list[str]:
    """Stock SGLang: a bdstack checkpoint is a plain HF causal LM, and causal mode needs none of our code. No
    --max-running-requests: SGLang batches causal requests without being told."""
    return server.head(LAUNCH_SERVER, "--model-path", model) + server.flags() + list(extra_args)


def resolve_sglang_python(cli_value: str | None) -> str:
    """Interpreter that has sglang installed: --sglang-python, else $BDSTACK_SGLANG_PYTHON, else `python`.

    SGLang usually lives in its own environment (it pins torch), so it is rarely our own interpreter.
    """
    return SGLANG.python(cli_value)


# -- bdstack checkpoints in SGLang (our own algorithms, registered by inference/sglang_backend/launch.py) --------
BDSTACK_LAUNCHER = "inference.sglang_backend.launch"


def bdstack_settings(model_dir: str | os.PathLike, mode: str, **decode):
    """The `--dllm-algorithm-config` of our algorithm for `mode`, read off the checkpoint through the serving gate
    (`Engine.checkpoint_settings`, which takes the `decode` flags); a draft adapter SGLang's LoRA loader
    would not load as trained is refused now."""
    from inference.sglang_backend.settings import ALGORITHMS, DecodeSettings

    if mode not in ALGORITHMS:
        raise ValueError(f"mode {mode!r} has no bdstack SGLang algorithm; choose one of {sorted(ALGORITHMS)}")
    canvas, fields = SGLANG.checkpoint_settings(model_dir, mode, **decode)
    if fields["draft_adapter"] is not None:
        from inference.sglang_backend.draft_adapter import check_adapter

        check_adapter(Path(model_dir) / fields["draft_adapter"])
    return DecodeSettings(algorithm=ALGORITHMS[mode], block_size=canvas, **fields)


def build_bdstack_command(
    model: str,
    settings,
    settings_path: Path,
    *,
    python: str = "python",
    host: str = SERVER.host,
    port: int = SERVER.port,
    api_key: str | None = None,
    extra_args: Sequence[str] = (),
    max_running_requests: int | None = None,
    served_model_name: str | None = None,
    device: str | None = None,
) -> list[str]:
    """argv that runs SGLang with our algorithms registered; writes `settings` to `settings_path`.

    On a GPU the Triton attention backend is the one that honours per-layer bidirectional attention (the
    algorithms' attention switch); on `device` cpu, SGLang's CPU engine with its torch_native backend, which our
    plugin replaces with one that does (`cpu_engine`). SGLang 0.5.23 turns first-done-first-out rounds on by
    default; our algorithms commit every round, so the command turns them off. `extra_args` come last so a
    caller can override anything before them.
    """
    settings_path = Path(settings_path)
    settings_path.parent.mkdir(parents=True, exist_ok=True)
    settings_path.write_text(yaml.safe_dump(settings.to_dict(), sort_keys=True))
    server = Server(python, host, port, api_key, served_model_name)
    cmd = server.head(BDSTACK_LAUNCHER, "--model-path", model)
    cmd += ["--dllm-algorithm", settings.algorithm, "--dllm-algorithm-config", str(settings_path)]
    cmd += ["--no-dllm-fdfo"] + (["--attention-backend", "triton"] if device != "cpu" else [])
    cmd += server.flags(BATCH_FLAG, max_running_requests) + list(extra_args)
    return cpu_engine(cmd) if device == "cpu" else cmd


def cpu_engine(cmd: list[str]) -> list[str]:
    """`cmd` on SGLang's CPU engine: its environment variable set through `env` (so that --dry-run prints a
    command that runs as printed) and its flags before the caller's, which may override them."""
    at = cmd.index("--host")
    return ["env", CPU_ENGINE_ENV, *cmd[:at], *CPU_ENGINE_FLAGS, *cmd[at:]]


def command_from_args(args, extra: list[str]) -> list[str]:
    """serve.py's flags (`args`, and `extra` for SGLang itself) as the command: an upstream family, stock SGLang for
    causal, else our launcher with the settings file in a fresh temporary directory (left in place: SGLang reads it
    after this returns). A setting the serving gate refuses is a ValueError saying why."""
    SGLANG.check_tree(args)
    server = Server.from_args(args, resolve_sglang_python(args.sglang_python))
    device = getattr(args, "device", None)
    if device not in (None, "cpu") and not device.startswith("cuda"):
        raise ValueError(f"--device {device}: SGLang serves on cuda or, with its CPU engine, on cpu")
    if args.mode == "causal":  # a bdstack checkpoint is a stock HF model: plain SGLang serves it causally
        SGLANG.check_decode(args)
        cmd = build_causal_command(args.model, server, extra_args=extra)
        return cpu_engine(cmd) if device == "cpu" else cmd
    # SGLang runs dLLM requests one at a time unless told how many may share a batch.
    where = asdict(server) | dict(max_running_requests=args.max_batch, extra_args=extra)
    if args.mode in FAMILIES:
        if device == "cpu":
            raise ValueError(f"--mode {args.mode} on --device cpu: SGLang's own dLLM families run on a GPU only")
        return build_sglang_command(args.model, family=args.mode, **where)
    settings = bdstack_settings(args.model, args.mode, **decode_flags(args))  # through the serving gate
    path = Path(tempfile.mkdtemp(prefix="bdstack-sglang-")) / f"{settings.algorithm}.yaml"
    return build_bdstack_command(args.model, settings, path, device=device, **where)


def child_environment(base: dict | None = None) -> dict:
    """The launcher's environment: our repository importable (the launcher lives in it)."""
    return repo_environment(base)
