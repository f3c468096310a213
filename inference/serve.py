#!/usr/bin/env python
"""Serve a bdstack checkpoint over an OpenAI-compatible API.

    python inference/serve.py CKPT --mode {causal,diffusion,self-spec} [--port 30000]
    python inference/serve.py MODEL --mode llada2-0 --backend sglang --dry-run   # upstream SGLang dLLM families
    python inference/serve.py CKPT --mode self-spec --backend vllm --dry-run      # vLLM with the bdstack plugin

The model comes from the argument, else $BDSTACK_MODEL. --backend auto picks SGLang, else vLLM, when it is
installed and a GPU is present, else the native PyTorch engine (CPU or GPU). Our own modes run on the
native engine; the SGLang families (sdar, llada2-0, llada2-1-speed, llada2-1-quality) run upstream
SGLang's own dLLM algorithms. Unknown arguments (or all after --) pass through to SGLang / vLLM.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import shlex
import sys
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):  # `python inference/X.py` from a checkout: the packages live in its root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bdcore.decode.config import AUTO, SELF_SPEC_CANVASES, DecodeConfig  # noqa: E402
from bdcore.decode.config import MODES as NATIVE_MODES  # noqa: E402
from bdcore.serving_gate import resolve  # noqa: E402
from inference.backend_command import engine_capabilities, run_command  # noqa: E402
from inference.server_defaults import SERVER  # noqa: E402
from inference.sglang_backend.command import FAMILIES as SGLANG_FAMILIES  # noqa: E402


class ServeError(SystemExit):
    """A setting serve.py cannot start with. `main` prints it as one line, `serve.py: error: <problem>;
    <fix>`, and the process exits 2, argparse's status for bad arguments (its str() is that line)."""

    def __init__(self, problem: str):
        super().__init__(2)
        self.line = f"serve.py: error: {problem}"

    def __str__(self) -> str:
        return self.line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="serve.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "model",
        nargs="?",
        default=os.environ.get("BDSTACK_MODEL"),
        help="checkpoint directory or hub id (default: $BDSTACK_MODEL)",
    )
    p.add_argument(
        "--mode",
        default="self-spec",
        choices=NATIVE_MODES + SGLANG_FAMILIES,
        help="decode mode (ours) or an upstream SGLang dLLM family (default: self-spec)",
    )
    p.add_argument("--backend", default="auto", choices=["auto", "native", "sglang", "vllm"])
    p.add_argument("--host", default=SERVER.host, help=f"bind address (default {SERVER.host}: this machine only)")
    p.add_argument("--port", type=int, default=SERVER.port)
    p.add_argument(
        "--api-key",
        default=os.environ.get("BDSTACK_API_KEY"),
        help="require 'Authorization: Bearer KEY' (native server: on every path but /health, /metrics and /docs "
        "included; default: $BDSTACK_API_KEY)",
    )
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: checkpoint name)")
    n = p.add_argument_group("native server")
    n.add_argument(
        "--max-request-bytes",
        type=int,
        default=SERVER.max_request_bytes,
        help=f"refuse request bodies larger than this with 413 (default {SERVER.max_request_bytes}: "
        f"{SERVER.max_request_bytes / 2**20:g} MiB)",
    )
    n.add_argument(
        "--allow-client-chat-template",
        action="store_true",
        help="let requests send their own Jinja chat_template (off: a template is code the server runs)",
    )
    n.add_argument(
        "--chat-template-timeout",
        type=float,
        default=SERVER.chat_template_timeout_s,
        metavar="SECONDS",
        help="stop rendering a client's chat template after this long and refuse the request with 400 "
        f"(default {SERVER.chat_template_timeout_s:g}; its output is also stopped once longer than the context "
        "can hold)",
    )
    n.add_argument(
        "--header-timeout",
        type=float,
        default=SERVER.header_timeout_s,
        metavar="SECONDS",
        help="close a connection that has not sent a whole request head this long after it opened or after "
        f"its previous reply (default {SERVER.header_timeout_s:g}; request bodies and replies are not timed)",
    )
    n = p.add_argument_group("native engine")
    n.add_argument(
        "--device",
        default=None,
        help="cpu, cuda, cuda:1 ... (default: cuda if available). With --backend sglang, cpu runs SGLang's own CPU "
        "engine (`make sglang-cpu` builds it; torch_native attention with our canvas rule)",
    )
    n.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bf16", "fp16", "fp32"],
        help="auto: bf16 on CUDA and on CPUs with native bf16 (AVX512-BF16 / AMX), else fp32",
    )
    n.add_argument("--block-size", type=int, default=None, help="diffusion canvas size (default: trained bd_size)")
    n.add_argument(
        "--threshold",
        type=float,
        default=DecodeConfig.threshold,
        help=f"diffusion commit confidence (default {DecodeConfig.threshold})",
    )
    n.add_argument("--steps", type=int, default=None, help="diffusion denoise steps per block (default: block-1)")
    n.add_argument(
        "--draft-len",
        type=_draft_len,
        default=None,
        help="self-spec N: drafts N-1 tokens a step (max: trained bd_size); auto: the engine chooses 0 (a plain "
        "causal step) .. bd_size-1 drafts each step from the forward cost it measures by rows (cached per checkpoint "
        "and device) and the acceptance it observes. Default: auto on the native engine, bd_size on SGLang",
    )
    n.add_argument("--no-fuse-commit", action="store_true", help="diffusion: unfused commit and prefill forwards")
    n.add_argument(
        "--self-spec-canvases",
        default=None,
        choices=SELF_SPEC_CANVASES,
        help="self-spec verify forwards draft after the last clean row only (a rejection then costs a cold "
        "step), after every clean row (no cold steps, N*N rows a forward), or auto: after the rows the engine "
        "chooses each step, from measured cost and acceptance. Default: auto on the native engine, "
        f"{DecodeConfig.self_spec_canvases} on SGLang",
    )
    n.add_argument(
        "--tree",
        default=None,
        help="self-spec draft trees of each slot's top candidates, greedy requests only: off; auto (default: weighed "
        "against chains where the layout is auto, verified where rated faster); or a shape every step verifies, "
        "W1,W2,... (candidates per depth, 1-4; e.g. 2,2) or spine:W1,... (only the argmax chain branches). "
        "Native engine only: SGLang and vLLM refuse it",
    )
    n.add_argument(
        "--compile",
        action="store_true",
        help="run decode steps compiled (torch.compile, inductor: fused small ops, no per-op Python): SmolLM2-135M's "
        "causal step 57 -> 33 ms on a 2-core CPU. Compiles at start (minutes on a small CPU, less from inductor's "
        "disk cache on the next start); prompts, drafting forwards and hybrid models stay eager",
    )
    n.add_argument(
        "--max-tokens",
        type=int,
        default=SERVER.max_tokens,
        help=f"default max_tokens when a request gives none ({SERVER.max_tokens})",
    )
    n.add_argument(
        "--max-batch",
        type=int,
        default=SERVER.max_batch,
        help=f"requests decoded together (default {SERVER.max_batch}; 1: one at a time); with --backend sglang it "
        "becomes --max-running-requests for the dLLM modes and families, with --backend vllm --max-num-seqs",
    )
    s = p.add_argument_group("SGLang backend")
    s.add_argument(
        "--sglang-python",
        default=None,
        help="interpreter of the SGLang environment (default: $BDSTACK_SGLANG_PYTHON, else python)",
    )
    s.add_argument("--dry-run", action="store_true", help="print the SGLang (or vLLM) command and exit")
    s.add_argument("--log", default=None, help="tee SGLang's (or vLLM's) output to this file")
    v = p.add_argument_group("vLLM backend")
    v.add_argument(
        "--vllm-python",
        default=None,
        help="interpreter of the vLLM environment (default: $BDSTACK_VLLM_PYTHON, else python)",
    )
    return p


def _draft_len(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 2 or auto, got {text!r}") from None


def pick_backend(
    backend: str, mode: str, sglang_python: str | None = None, vllm_python: str | None = None, model=None
) -> str:
    """SGLang families always run in SGLang. Our modes: native unless asked, or unless `auto` finds a GPU
    and an SGLang environment (--sglang-python / $BDSTACK_SGLANG_PYTHON, or sglang importable here), else a
    vLLM one (--vllm-python / $BDSTACK_VLLM_PYTHON, or vllm importable here) that can serve `model` in `mode`."""
    if mode in SGLANG_FAMILIES:
        if backend not in ("auto", "sglang"):
            raise ServeError(f"--mode {mode} is served by upstream SGLang; use --backend sglang")
        return "sglang"
    if backend != "auto":
        return backend
    import torch

    from inference.sglang_backend.command import SGLANG_PYTHON_ENV
    from inference.vllm_backend.command import VLLM_PYTHON_ENV

    if not torch.cuda.is_available():
        return "native"
    if sglang_python or os.environ.get(SGLANG_PYTHON_ENV) or importlib.util.find_spec("sglang"):
        return "sglang"
    if vllm_python or os.environ.get(VLLM_PYTHON_ENV) or importlib.util.find_spec("vllm"):
        from bdcore.serving_gate import serves

        try:
            caps = engine_capabilities(model, mode)
        except ValueError:  # a malformed sidecar or config.json: the native engine's loader names it
            return "native"
        if serves(caps, DecodeConfig(mode=mode), "vllm"):
            return "vllm"
    return "native"


def run_child(args, extra: list[str], backend: str) -> int:
    """Build SGLang's or vLLM's command (its backend's `command_from_args`); print it (--dry-run) or run it in the
    engine's own interpreter."""
    if backend == "vllm":
        from inference.vllm_backend import command as commands
    else:
        from inference.sglang_backend import command as commands
    try:
        cmd = commands.command_from_args(args, extra)
    except ValueError as e:
        raise ServeError(str(e)) from e
    if args.dry_run:
        print(shlex.join(cmd))  # copy-pasteable: the vLLM flags carry JSON
        return 0
    return run_command(cmd, commands.child_environment(), args.log)


def server_settings_refusal(args) -> str | None:
    """What is wrong with a setting of the server itself (every backend's port; the native server's limits)."""
    if not 1 <= args.port <= 65535:
        return f"--port {args.port} is not a TCP port; give one in 1-65535"
    for flag, value in (("--max-tokens", args.max_tokens), ("--max-batch", args.max_batch)):
        if value < 1:
            return f"{flag} must be >= 1, got {value}; give a positive count"
    if args.max_request_bytes < 1:
        return f"--max-request-bytes must be >= 1, got {args.max_request_bytes}; give a size in bytes"
    timeouts = (("--chat-template-timeout", args.chat_template_timeout), ("--header-timeout", args.header_timeout))
    for flag, value in timeouts:
        if not 0 < value < math.inf:  # NaN too
            return f"{flag} must be a positive number of seconds, got {value}; give one like 2 or 0.5"
    for flag, value in (("--block-size", args.block_size), ("--draft-len", args.draft_len)):
        if isinstance(value, int) and value < 2:  # checked here: the decode settings read 0 as "the default"
            return f"{flag} must be >= 2, got {value}; give at least 2, or leave it out for the default"
    return None


def native_decode(args):
    """The native engine's decode settings from the flags (self-spec's layout chosen each step by default)."""
    return DecodeConfig(
        mode=args.mode,
        block_size=args.block_size,
        threshold=args.threshold,
        steps=args.steps,
        # The native engine's self-spec defaults to choosing its layout each step
        # (docs/history/results-notebook.md: auto never lost to causal or by more than 5% to the best fixed
        # setting where it was measured).
        draft_len=args.draft_len or AUTO,
        fuse_commit=not args.no_fuse_commit,
        self_spec_canvases=args.self_spec_canvases or AUTO,
        # Trees are weighed where the engine chooses layouts, and verified only where the policy rates them faster.
        tree=args.tree or AUTO,
    )


_SETTING = re.compile(r"\b(block_size|draft_len|steps|threshold|self_spec_canvases)\b")


def decode_refusal(model: str, decode) -> str | None:
    """What the serving gate says of the native engine's settings, read off the checkpoint's sidecar before its
    weights load. Every mode a request may pick is checked, not only --mode: each request resolves the
    settings anew, and a setting found bad there would be a 400 for every request."""
    from bdcore.capabilities import read_capabilities
    from bdcore.serving_gate import served_modes

    caps = read_capabilities(model)
    if caps is None:
        return None  # not a model directory: load_checkpoint says so
    for mode in dict.fromkeys((decode.mode, *served_modes(caps, "native"))):
        try:
            resolve(caps, replace(decode, mode=mode), "native")
        except ValueError as e:
            why = _SETTING.sub(lambda m: "--" + m[1].replace("_", "-"), str(e))  # the library's names as flags
            return why if mode == decode.mode else f"{why} (for {mode} mode, which a request may pick)"
    return None


def run_native(args, extra: list[str]) -> int:
    if extra:
        raise ServeError(f"unrecognized arguments for the native engine: {' '.join(extra)}")
    decode = native_decode(args)
    try:
        why = decode_refusal(args.model, decode)
    except ValueError as e:  # a malformed sidecar or config.json
        why = str(e)
    if why is not None:
        raise ServeError(why)
    import torch

    from bdcore.loading import CheckpointError, load_checkpoint, serving_dtype
    from inference.server import create_app, serve_app

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        loaded = load_checkpoint(args.model, device=device, dtype=serving_dtype(args.dtype, device))
        app = create_app(
            loaded,
            decode,
            model_name=args.served_model_name or loaded.name,
            api_key=args.api_key,
            default_max_tokens=args.max_tokens,
            max_batch=args.max_batch,
            max_request_bytes=args.max_request_bytes,
            allow_client_chat_template=args.allow_client_chat_template,
            chat_template_timeout=args.chat_template_timeout,
            compiled=args.compile,
        )
    except (CheckpointError, ValueError, NotImplementedError) as e:
        raise ServeError(str(e)) from e
    print(
        f"serving {args.model} ({args.mode}, native engine on {device}) at http://{args.host}:{args.port}/v1",
        flush=True,
    )
    if not serve_app(app, host=args.host, port=args.port, header_timeout=args.header_timeout):
        raise ServeError(f"could not listen on {args.host}:{args.port} (the reason is above); pick another --port")
    return 0


def main(argv=None) -> int:
    try:
        return _serve(argv)
    except ServeError as e:
        print(e, file=sys.stderr)
        raise


def _serve(argv) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if extra[:1] == ["--"]:  # `serve.py MODEL -- --tp 2`: everything after -- is for SGLang / vLLM
        extra = extra[1:]
    if not args.model:
        raise ServeError("give a checkpoint directory (or set BDSTACK_MODEL)")
    if (why := server_settings_refusal(args)) is not None:
        raise ServeError(why)
    backend = pick_backend(args.backend, args.mode, args.sglang_python, args.vllm_python, args.model)
    return run_native(args, extra) if backend == "native" else run_child(args, extra, backend)


if __name__ == "__main__":
    sys.exit(main())
