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

Stdlib only at import (and the defaults' homes, `bdcore.decode.config` and `inference.server_defaults`, stdlib
only too): serve.py imports this for `--backend auto` without vLLM installed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from bdcore.decode.config import DecodeConfig
from inference.server_defaults import SERVER

VLLM_PYTHON_ENV = "BDSTACK_VLLM_PYTHON"
VLLM_CLI = "vllm.entrypoints.cli.main"  # what the `vllm` console script runs
# The architecture plugin.register() adds for each stock vLLM class it extends (causal mode needs neither); the
# serving gate refuses the others (its VLLM_ARCHITECTURES are these keys: tests/test_serving_gate.py).
ARCHITECTURES = {"Qwen3ForCausalLM": "BdstackQwen3ForBlockDiffusion"}
ARCHITECTURE = ARCHITECTURES["Qwen3ForCausalLM"]
PLUGIN_NAME = "bdstack"  # the entry point's name in pyproject.toml (what VLLM_PLUGINS lists)
REPO_ROOT = Path(__file__).resolve().parents[2]


class VllmCommandError(ValueError):
    """A checkpoint or option `serve.py --backend vllm` cannot serve; the message says why and what to use."""


def resolve_vllm_python(cli_value: str | None) -> str:
    """Interpreter that has vllm installed: --vllm-python, else $BDSTACK_VLLM_PYTHON, else `python`."""
    return cli_value or os.environ.get(VLLM_PYTHON_ENV) or "python"


def _common(model: str, python: str, host: str, port: int, api_key, max_num_seqs, served_model_name) -> list[str]:
    cmd = [python, "-m", VLLM_CLI, "serve", model, "--host", host, "--port", str(port)]
    cmd += ["--api-key", api_key] if api_key else []
    cmd += ["--max-num-seqs", str(max_num_seqs)] if max_num_seqs is not None else []
    return cmd + (["--served-model-name", served_model_name] if served_model_name else [])


def build_causal_command(
    model: str,
    *,
    python: str = "python",
    host: str = SERVER.host,
    port: int = SERVER.port,
    api_key: str | None = None,
    max_num_seqs: int | None = None,
    served_model_name: str | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """Stock vLLM: a bdstack checkpoint is a plain HF causal LM, and causal mode needs no plugin code."""
    return _common(model, python, host, port, api_key, max_num_seqs, served_model_name) + list(extra_args)


def build_bdstack_command(
    model: str,
    settings,
    *,
    python: str = "python",
    host: str = SERVER.host,
    port: int = SERVER.port,
    api_key: str | None = None,
    max_num_seqs: int | None = None,
    served_model_name: str | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """vLLM with our architecture for diffusion / self-spec; `settings` is a `VllmDecodeSettings`.
    `extra_args` come last, so a caller can override anything before them."""
    width = settings.canvas_length
    overrides = {"architectures": [architecture_for(model)], "canvas_length": width}
    diffusion = {"canvas_length": width, "max_denoising_steps": settings.denoise_steps}
    cmd = _common(model, python, host, port, api_key, max_num_seqs, served_model_name)
    cmd += ["--hf-overrides", _json(overrides)]
    cmd += ["--diffusion-config", _json(diffusion)]
    cmd += ["--additional-config", _json({"bdstack": settings.to_dict()})]
    cmd += ["--generation-config", "vllm", "--attention-backend", "TRITON_ATTN", "--enforce-eager"]
    cmd += ["--no-enable-prefix-caching", "--no-enable-chunked-prefill", "--no-async-scheduling"]
    if settings.draft_adapter is not None:
        from inference.vllm_backend.draft_adapter import lora_flags

        cmd += lora_flags(Path(model) / settings.draft_adapter)
    return cmd + list(extra_args)


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
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    allowed = [p for p in env.get("VLLM_PLUGINS", "").split(",") if p]
    if "VLLM_PLUGINS" in env and PLUGIN_NAME not in allowed:  # a user allow-list: keep it, add ours
        env["VLLM_PLUGINS"] = ",".join([*allowed, PLUGIN_NAME])
    return env


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
    """The plugin's settings for `mode`, read off the checkpoint (sidecar and tokenizer, in our environment).
    The serving gate decides first, from the sidecar and config.json alone: a refused decode loads nothing."""
    from bdcore.capabilities import Capabilities, read_capabilities
    from bdcore.loading import check_checkpoint
    from bdcore.serving_gate import resolve
    from bdcore.tokens import end_of_turn_id, filler_id
    from inference.sglang_backend.command import sglang_stop_ids
    from inference.vllm_backend.settings import MODES, VllmDecodeSettings

    if mode not in MODES:
        raise VllmCommandError(f"mode {mode!r} has no bdstack vLLM algorithm; choose one of {MODES} (or causal)")
    decode = DecodeConfig(mode, block_size, threshold, steps, draft_len, self_spec_canvases=self_spec_canvases)
    resolved = resolve(read_capabilities(model_dir) or Capabilities.from_sidecar(None), decode, "vllm")
    _, tok, sidecar = check_checkpoint(model_dir)
    eot = end_of_turn_id(tok)
    filler = filler_id(tok, eot)
    others = [int(tok.eos_token_id)] if tok.eos_token_id is not None and tok.eos_token_id not in (eot, filler) else []
    # vLLM 0.33 stops where SGLang does: generation_config.json's eos_token_id (read even under
    # --generation-config vllm: ModelConfig.try_get_generation_config) and the tokenizer's eos.
    if eot not in sglang_stop_ids(model_dir, tok):
        raise VllmCommandError(
            f"vLLM would not stop at end-of-turn (token {eot}): it stops at generation_config.json's eos_token_id "
            "and the tokenizer's eos; add the end-of-turn id to generation_config.json's eos_token_id"
        )
    return VllmDecodeSettings(
        mode=mode,
        size=resolved.draft_len if mode == "self-spec" else resolved.block,
        mask_id=sidecar.mask_id,
        end_of_turn_id=eot,
        filler_id=filler,
        other_stop_ids=others,
        within_block_causal=sidecar.within_block_causal,
        threshold=threshold,
        steps=steps,
        draft_adapter=sidecar.draft_adapter,
    )
