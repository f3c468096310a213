"""What the SGLang and vLLM backends share in our environment, where `serve.py` builds their commands: serve.py's
flags as decode settings and as the server's flags, the serving gate asked before a command is built, the settings
read off a checkpoint, the tokens an engine stops at, and the engine's process.

Each backend's `command.py` holds what differs (`command_from_args`, its builders, its settings' keys); what both
read inside the engine's process is `backend_settings.py`. Stdlib and the defaults' homes (`bdcore.decode.config`,
`inference.server_defaults`, stdlib only) at import: serve.py imports this for `--backend auto` without either
engine installed; the checkpoint readers are imported where they are used.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bdcore.decode.config import TREE_OFF, DecodeConfig
from inference.server_defaults import SERVER

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Engine:
    """One engine as the code its backend shares with the other sees it: its names, its interpreter, the serving
    gate asked for it, and our settings read off a checkpoint for it."""

    name: str  # the serving gate's backend name
    label: str  # the engine's name in messages
    python_env: str  # the environment variable naming the interpreter that has the engine installed
    stops_at: str  # where the engine reads the tokens it ends a request at (for the refusal that names them)
    error: type[ValueError] = ValueError  # what its refusals raise

    def python(self, cli_value: str | None) -> str:
        """The engine's interpreter: the flag, else the environment variable, else `python`."""
        return cli_value or os.environ.get(self.python_env) or "python"

    def check_decode(self, args, **more) -> None:
        """The serving gate on the flags' decode settings (and `more` of them) here; a ValueError says why not."""
        from bdcore.serving_gate import resolve

        decode = DecodeConfig(args.mode, **decode_flags(args), **more)
        resolve(engine_capabilities(args.model, args.mode), decode, self.name)

    def check_tree(self, args) -> None:
        """A draft tree asked for: the gate says why the engine verifies none (it refuses every tree but `off`)."""
        if args.tree not in (None, TREE_OFF):
            self.check_decode(args, tree=args.tree)

    def checkpoint_settings(
        self,
        model_dir: str | os.PathLike,
        mode: str,
        *,
        block_size: int | None = None,
        threshold: float = DecodeConfig.threshold,
        steps: int | None = None,
        draft_len: int | str | None = None,
        self_spec_canvases: str = DecodeConfig.self_spec_canvases,
    ) -> tuple[int, dict]:
        """The canvas of `mode` and `BackendSettings`' fields, read off the checkpoint (its sidecar and tokenizer,
        loaded here so the engine's side needs neither transformers pins nor our loaders). The serving gate decides
        first, from the sidecar and config.json alone: a refused decode loads nothing."""
        from bdcore.capabilities import Capabilities, read_capabilities
        from bdcore.loading import check_checkpoint
        from bdcore.serving_gate import resolve
        from bdcore.tokens import end_of_turn_id, filler_id, stop_ids

        model_dir = Path(model_dir)
        decode = DecodeConfig(mode, block_size, threshold, steps, draft_len, self_spec_canvases=self_spec_canvases)
        resolved = resolve(read_capabilities(model_dir) or Capabilities.from_sidecar(None), decode, self.name)
        _, tok, sidecar = check_checkpoint(model_dir)
        eot = end_of_turn_id(tok)
        filler = filler_id(tok, eot)
        others = sorted(stop_ids(tok) - {eot, filler})  # e.g. eos, when it is not end-of-turn
        if eot not in engine_stop_ids(model_dir, tok):
            # The decoders report a filler as end-of-turn; the engine must know it as a stop token.
            raise self.error(
                f"{self.label} would not stop at end-of-turn (token {eot}): it stops at {self.stops_at} and the "
                "tokenizer's eos; add the end-of-turn id to generation_config.json's eos_token_id"
            )
        canvas = resolved.draft_len if mode == "self-spec" else resolved.block
        return canvas, dict(
            mask_id=sidecar.mask_id,
            end_of_turn_id=eot,
            filler_id=filler,
            other_stop_ids=others,
            within_block_causal=sidecar.within_block_causal,
            threshold=threshold,
            steps=steps,
            draft_adapter=sidecar.draft_adapter,
        )


@dataclass(frozen=True)
class Server:
    """Where an engine's OpenAI server runs and listens, who may call it and the model's name there."""

    python: str = "python"
    host: str = SERVER.host
    port: int = SERVER.port
    api_key: str | None = None
    served_model_name: str | None = None

    @classmethod
    def from_args(cls, args, python: str) -> Server:
        return cls(python, args.host, args.port, args.api_key, args.served_model_name)

    def head(self, module: str, *model: str) -> list[str]:
        """`python -m MODULE [MODEL...] --host H --port P`: how both engines' commands start."""
        return [self.python, "-m", module, *model, "--host", self.host, "--port", str(self.port)]

    def flags(self, batch_flag: str = "", batch: int | None = None) -> list[str]:
        """The API key, the engine's limit on requests batched together (`batch_flag` `batch`), the served model
        name: each if given."""
        flags = ["--api-key", self.api_key] if self.api_key else []
        flags += [batch_flag, str(batch)] if batch is not None else []
        return flags + (["--served-model-name", self.served_model_name] if self.served_model_name else [])


def decode_flags(args) -> dict:
    """The decode settings SGLang and vLLM are asked to run, but the mode (their self-spec layout is fixed:
    `last` unless the flag asks for another, which the serving gate refuses)."""
    return dict(
        block_size=args.block_size,
        threshold=args.threshold,
        steps=args.steps,
        draft_len=args.draft_len,
        self_spec_canvases=args.self_spec_canvases or DecodeConfig.self_spec_canvases,
    )


def engine_capabilities(model: str | None, mode: str):
    """The checkpoint's capabilities as SGLang's and vLLM's commands see it, for the serving gate. Their causal
    mode is their stock engine on the HF weights, which reads nothing of ours (the directory may even be a hub
    id), so it is asked about a plain checkpoint; a directory without config.json is a plain one too."""
    from bdcore.capabilities import Capabilities, read_capabilities

    caps = read_capabilities(model) if model and mode != "causal" else None
    return caps or Capabilities.from_sidecar(None)


def engine_stop_ids(model_dir: str | os.PathLike, tokenizer) -> frozenset[int]:
    """The token ids the engines end a request at without request-level stops: config.json and
    generation_config.json `eos_token_id` and the tokenizer's eos (SGLang 0.5.23's
    ModelConfig._get_hf_eos_token_id; vLLM 0.33 reads generation_config.json's even under --generation-config vllm:
    ModelConfig.try_get_generation_config)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        value = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
        ids |= {value} if isinstance(value, int) else set(value or ())
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def repo_environment(base: dict | None = None) -> dict:
    """`base` (default: this process's environment) with our repository first on PYTHONPATH: the engine's process
    imports our launcher or plugin from it."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def run_command(cmd: list[str], env: dict, log: str | None = None) -> int:
    """Run the engine's command until it exits, passing it SIGINT and SIGTERM; `log`: tee its output to this file."""
    out = open(log, "a") if log else None  # noqa: SIM115 (closed below)
    pipe = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT) if out else {}
    child = subprocess.Popen(cmd, env=env, text=True, **pipe)
    previous = {sig: signal.signal(sig, lambda s, _f: child.send_signal(s)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if out:
            for line in child.stdout:
                sys.stdout.write(line)
                out.write(line)
                out.flush()
            out.close()
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
