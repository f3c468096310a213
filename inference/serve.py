#!/usr/bin/env python
"""Serve a bdstack checkpoint over an OpenAI-compatible API.

    python inference/serve.py CKPT --mode {causal,diffusion,self-spec} [--port 30000]
    python inference/serve.py MODEL --mode llada2-0 --backend sglang --dry-run   # upstream SGLang dLLM families

The model comes from the argument, else $BDSTACK_MODEL. --backend auto picks SGLang when it is
installed and a GPU is present, else the native PyTorch engine (CPU or GPU). Our own modes run on the
native engine; the SGLang families (sdar, llada2-0, llada2-1-speed, llada2-1-quality) run upstream
SGLang's own dLLM algorithms. Unknown arguments pass through to SGLang.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

NATIVE_MODES = ("causal", "diffusion", "self-spec")
SGLANG_FAMILIES = ("sdar", "llada2-0", "llada2-1-speed", "llada2-1-quality")


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
    p.add_argument("--backend", default="auto", choices=["auto", "native", "sglang"])
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=os.environ.get("BDSTACK_API_KEY"), help="require 'Authorization: Bearer KEY'")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: checkpoint name)")
    n = p.add_argument_group("native engine")
    n.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    n.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    n.add_argument("--block-size", type=int, default=None, help="diffusion canvas size (default: trained bd_size)")
    n.add_argument("--threshold", type=float, default=0.9, help="diffusion commit confidence (default 0.9)")
    n.add_argument("--steps", type=int, default=None, help="diffusion denoise steps per block (default: block-1)")
    n.add_argument("--draft-len", type=int, default=None, help="self-spec N (default and max: trained bd_size)")
    n.add_argument("--no-fuse-commit", action="store_true", help="diffusion: separate commit and denoise forwards")
    n.add_argument("--max-tokens", type=int, default=512, help="default max_tokens when a request gives none")
    s = p.add_argument_group("SGLang backend")
    s.add_argument(
        "--sglang-python",
        default=None,
        help="interpreter of the SGLang environment (default: $BDSTACK_SGLANG_PYTHON, else python)",
    )
    s.add_argument("--dry-run", action="store_true", help="print the SGLang command and exit")
    s.add_argument("--log", default=None, help="tee SGLang's output to this file")
    return p


def pick_backend(backend: str, mode: str) -> str:
    if mode in SGLANG_FAMILIES:
        if backend == "native":
            raise SystemExit(f"serve.py: error: --mode {mode} is served by upstream SGLang; use --backend sglang")
        return "sglang"
    if backend != "auto":
        return backend
    import torch

    return "sglang" if importlib.util.find_spec("sglang") and torch.cuda.is_available() else "native"


def run_sglang(args, extra: list[str]) -> int:
    from inference.sglang_launch import (
        build_sglang_command,
        load_family_config,
        resolve_sglang_python,
        write_algorithm_config,
    )

    if args.mode not in SGLANG_FAMILIES:
        raise SystemExit(
            f"serve.py: error: --backend sglang serves the families {SGLANG_FAMILIES}; our own modes "
            f"({', '.join(NATIVE_MODES)}) run on the native engine for now (--backend native)"
        )
    cfg = load_family_config(args.mode)
    algo = (
        write_algorithm_config(cfg, Path(tempfile.mkdtemp(prefix="bdstack-sglang-"))) if cfg.algorithm_config else None
    )
    cmd = build_sglang_command(
        args.model,
        family=args.mode,
        python=resolve_sglang_python(args.sglang_python),
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        extra_args=extra,
        algo_config_path=algo,
    )
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    log = open(args.log, "a") if args.log else None  # noqa: SIM115 (closed below)
    child = subprocess.Popen(
        cmd, stdout=subprocess.PIPE if log else None, stderr=subprocess.STDOUT if log else None, text=True
    )
    previous = {sig: signal.signal(sig, lambda s, _f: child.send_signal(s)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if log:
            for line in child.stdout:
                sys.stdout.write(line)
                log.write(line)
                log.flush()
            log.close()
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_native(args, extra: list[str]) -> int:
    if extra:
        raise SystemExit(f"serve.py: error: unrecognized arguments for the native engine: {' '.join(extra)}")
    import torch
    import uvicorn

    from inference.checkpoint import CheckpointError, load_checkpoint
    from inference.engine import DecodeConfig
    from inference.server import create_app

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        loaded = load_checkpoint(args.model, device=device, dtype=args.dtype)
        decode = DecodeConfig(
            mode=args.mode,
            block_size=args.block_size,
            threshold=args.threshold,
            steps=args.steps,
            draft_len=args.draft_len,
            fuse_commit=not args.no_fuse_commit,
        )
        app = create_app(
            loaded,
            decode,
            model_name=args.served_model_name or loaded.name,
            api_key=args.api_key,
            default_max_tokens=args.max_tokens,
        )
    except (CheckpointError, ValueError, NotImplementedError) as e:
        raise SystemExit(f"serve.py: error: {e}") from e
    print(
        f"serving {args.model} ({args.mode}, native engine on {device}) at http://{args.host}:{args.port}/v1",
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def main(argv=None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if extra[:1] == ["--"]:  # `serve.py MODEL -- --tp 2`: everything after -- is for SGLang
        extra = extra[1:]
    if not args.model:
        raise SystemExit("serve.py: error: give a checkpoint directory (or set BDSTACK_MODEL)")
    backend = pick_backend(args.backend, args.mode)
    return run_sglang(args, extra) if backend == "sglang" else run_native(args, extra)


if __name__ == "__main__":
    sys.exit(main())
