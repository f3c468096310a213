"""Build the `python -m sglang.launch_server` command for upstream SGLang's own dLLM families.

SDAR, LLaDA2.0 and LLaDA2.1 are served by SGLang with its built-in diffusion algorithms, not by our engine.
Each family's algorithm and settings live in `configs/<family>.yaml` beside this module (one schema for
all) so that retuning a preset is a data change, and this module only validates that data and turns it
into argv.

SGLang (checked against 0.5.23) takes `--dllm-algorithm NAME` (the algorithm class name) and
`--dllm-algorithm-config PATH`, a YAML file it reads with `yaml.safe_load` and queries with `.get(key, default)`.
Because of that `.get`, a misspelt key is silently ignored upstream, so we check keys against what each
algorithm actually reads (`ALGORITHM_KEYS`) before SGLang ever starts.

Stdlib, PyYAML and the defaults' homes (`bdcore.decode.config`, `inference.server_defaults`, both stdlib only at
import): this runs in the launcher, which need not have torch or sglang installed.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from bdcore.decode.config import DecodeConfig
from inference.server_defaults import SERVER

FAMILIES: tuple[str, ...] = ("sdar", "llada2-0", "llada2-1-speed", "llada2-1-quality")
CONFIG_DIR: Path = Path(__file__).resolve().parent / "configs"
SGLANG_PYTHON_ENV = "BDSTACK_SGLANG_PYTHON"

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
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model, "--host", host, "--port", str(port)]
    cmd += ["--dllm-algorithm", cfg.algorithm]
    if cfg.algorithm_config:
        if algo_config_path is None:
            algo_config_path = write_algorithm_config(cfg, Path(tempfile.mkdtemp(prefix="bdstack-sglang-")))
        cmd += ["--dllm-algorithm-config", str(algo_config_path)]
    cmd += list(cfg.server_args)
    cmd += _common_flags(api_key, max_running_requests, served_model_name)
    cmd += list(extra_args)
    return cmd


def _common_flags(api_key: str | None, max_running_requests: int | None, served_model_name: str | None) -> list[str]:
    flags = ["--api-key", api_key] if api_key else []
    if max_running_requests is not None:
        flags += ["--max-running-requests", str(max_running_requests)]
    if served_model_name:
        flags += ["--served-model-name", served_model_name]
    return flags


def resolve_sglang_python(cli_value: str | None) -> str:
    """Interpreter that has sglang installed: --sglang-python, else $BDSTACK_SGLANG_PYTHON, else `python`.

    SGLang usually lives in its own environment (it pins torch), so it is rarely our own interpreter.
    """
    if cli_value:
        return cli_value
    return os.environ.get(SGLANG_PYTHON_ENV) or "python"


# -- bdstack checkpoints in SGLang (our own algorithms, registered by inference/sglang_backend/launch.py) --------
BDSTACK_LAUNCHER = "inference.sglang_backend.launch"
REPO_ROOT = Path(__file__).resolve().parents[2]


def bdstack_settings(
    model_dir: str | os.PathLike,
    mode: str,
    *,
    block_size: int | None = None,
    threshold: float = DecodeConfig.threshold,
    steps: int | None = None,
    draft_len: int | str | None = None,
    self_spec_canvases: str = DecodeConfig.self_spec_canvases,
):
    """The `--dllm-algorithm-config` of our algorithm for `mode`, read off the checkpoint (its sidecar and
    tokenizer, loaded in our environment so the SGLang side needs neither transformers pins nor our code).
    The serving gate decides first, from the sidecar and config.json alone: a refused decode loads nothing."""
    from bdcore.capabilities import Capabilities, read_capabilities
    from bdcore.loading import check_checkpoint
    from bdcore.serving_gate import resolve
    from bdcore.tokens import end_of_turn_id, filler_id, stop_ids
    from inference.sglang_backend.settings import ALGORITHMS, DecodeSettings

    model_dir = Path(model_dir)
    if mode not in ALGORITHMS:
        raise ValueError(f"mode {mode!r} has no bdstack SGLang algorithm; choose one of {sorted(ALGORITHMS)}")
    decode = DecodeConfig(mode, block_size, threshold, steps, draft_len, self_spec_canvases=self_spec_canvases)
    resolved = resolve(read_capabilities(model_dir) or Capabilities.from_sidecar(None), decode, "sglang")
    _, tok, sidecar = check_checkpoint(model_dir)
    eot = end_of_turn_id(tok)
    filler = filler_id(tok, eot)
    others = sorted(stop_ids(tok) - {eot, filler})  # e.g. eos, when it is not end-of-turn
    if eot not in sglang_stop_ids(model_dir, tok):
        # The algorithms report a filler as end-of-turn; SGLang must know it as a stop token.
        raise ValueError(
            f"SGLang would not stop at end-of-turn (token {eot}): it stops at config.json / generation_config.json "
            "eos_token_id and the tokenizer's eos; add the end-of-turn id to generation_config.json's eos_token_id"
        )
    if sidecar.draft_adapter is not None:  # what SGLang's LoRA loader would not load as trained, refused now
        from inference.sglang_backend.draft_adapter import check_adapter

        check_adapter(model_dir / sidecar.draft_adapter)
    return DecodeSettings(
        algorithm=ALGORITHMS[mode],
        block_size=resolved.draft_len if mode == "self-spec" else resolved.block,
        mask_id=sidecar.mask_id,
        end_of_turn_id=eot,
        filler_id=filler,
        other_stop_ids=others,
        within_block_causal=sidecar.within_block_causal,
        threshold=threshold,
        steps=steps,
        draft_adapter=sidecar.draft_adapter,
    )


def sglang_stop_ids(model_dir: str | os.PathLike, tokenizer) -> frozenset[int]:
    """The token ids SGLang (0.5.23) ends a request at without request-level stops: config.json and
    generation_config.json `eos_token_id` (ModelConfig._get_hf_eos_token_id) and the tokenizer's eos."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        value = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
        ids |= {value} if isinstance(value, int) else set(value or ())
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


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
) -> list[str]:
    """argv that runs SGLang with our algorithms registered; writes `settings` to `settings_path`.

    The Triton attention backend is the one that honours per-layer bidirectional attention (the
    algorithms' attention switch). SGLang 0.5.23 turns first-done-first-out rounds on by default; our
    algorithms commit every round, so the command turns them off. `extra_args` come last so a caller
    can override anything before them.
    """
    settings_path = Path(settings_path)
    settings_path.parent.mkdir(parents=True, exist_ok=True)
    settings_path.write_text(yaml.safe_dump(settings.to_dict(), sort_keys=True))
    cmd = [python, "-m", BDSTACK_LAUNCHER, "--model-path", model, "--host", host, "--port", str(port)]
    cmd += ["--dllm-algorithm", settings.algorithm, "--dllm-algorithm-config", str(settings_path)]
    cmd += ["--attention-backend", "triton", "--no-dllm-fdfo"]
    return cmd + _common_flags(api_key, max_running_requests, served_model_name) + list(extra_args)


def child_environment(base: dict | None = None) -> dict:
    """The launcher's environment: our repository importable (the launcher lives in it)."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env
