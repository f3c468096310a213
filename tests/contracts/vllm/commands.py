"""Every command `serve.py --backend vllm` builds, written to JSON for the vLLM contract check.

Runs in our environment (`.venv`): serve.py reads the checkpoint's tokenizer and sidecar, which the vLLM
side never does. The checkpoint is the tests' tiny dense Qwen3 (a diffusion/self-spec checkpoint the
plugin serves), also as a self-spec checkpoint trained within-block causal, and with a draft-only adapter
(its LoRA is checked through vLLM's loader by `lora.py`).
"""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import sys
from pathlib import Path

from benchmark.tiny import draft_checkpoint, tiny_checkpoint
from inference import serve

VLLM_PYTHON = "/opt/vllm/bin/python"  # never run: only the argv after `-m MODULE` is parsed
PASS_THROUGH = ["--", "--tensor-parallel-size", "1", "--gpu-memory-utilization", "0.8", "--max-num-seqs", "4"]
MODE_FLAGS = {"causal": [], "diffusion": ["--threshold", "0.7", "--steps", "2"], "self-spec": ["--draft-len", "3"]}


def dry_run(argv: list[str], tail: list[str]) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert serve.main([*argv, "--backend", "vllm", "--dry-run", "--vllm-python", VLLM_PYTHON, *tail]) == 0
    return shlex.split(out.getvalue())


def checkpoints(root: Path) -> dict[str, Path]:
    dense = tiny_checkpoint(root / "dense", arch="qwen3", bd_size=4)
    causal_canvas = tiny_checkpoint(root / "within-block-causal", arch="qwen3", bd_size=4, within_block_causal=True)
    drafted = draft_checkpoint(root / "draft-adapter")
    return {"dense": dense, "within-block-causal": causal_canvas, "draft-adapter": drafted}


def cases(root: Path) -> list[dict]:
    found = []
    common = ["--port", "31000", "--api-key", "sk-test", "--served-model-name", "my-model", "--max-batch", "3"]
    for kind, model in checkpoints(root).items():
        for mode, flags in MODE_FLAGS.items():
            for tail in ([], PASS_THROUGH):
                argv = dry_run([str(model), "--mode", mode, *flags, *common], tail)
                found.append({"name": f"{kind} {mode}{' +flags' if tail else ''}", "mode": mode, "argv": argv})
    return found


if __name__ == "__main__":
    root = Path(sys.argv[1])
    built = cases(root)
    (root / "commands.json").write_text(json.dumps(built, indent=1))
    print(f"{root / 'commands.json'}: {len(built)} commands")
