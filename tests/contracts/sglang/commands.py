"""Every command `serve.py --backend sglang` builds, written to JSON for the SGLang contract check.

Runs in our environment (`.venv`): serve.py reads the checkpoint's tokenizer and sidecar, which the
SGLang side never does. The checkpoints are the tests' tiny ones (a dense Qwen3, a Qwen3.5 hybrid trained
within-block causal, and the dense Qwen3 with a draft-only adapter: the kinds the diffusion/self-spec modes
serve); `lora.py` loads the draft one's adapter from WORK/draft.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

from benchmark.tiny import draft_checkpoint, tiny_checkpoint
from inference import serve
from inference.sglang_backend.command import FAMILIES, bdstack_settings, build_bdstack_command, build_sglang_command

SGLANG_PYTHON = "/opt/sglang/bin/python"  # never run: only the argv after `-m MODULE` is parsed
PASS_THROUGH = ["--", "--tp", "2", "--mem-fraction-static", "0.8", "--max-running-requests", "4"]
MODE_FLAGS = {"causal": [], "diffusion": ["--threshold", "0.7", "--steps", "2"], "self-spec": ["--draft-len", "3"]}


def dry_run(argv: list[str], tail: list[str]) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert serve.main([*argv, "--backend", "sglang", "--dry-run", "--sglang-python", SGLANG_PYTHON, *tail]) == 0
    return out.getvalue().split()


def checkpoints(root: Path) -> dict[str, Path]:
    dense = tiny_checkpoint(root / "dense", arch="qwen3", bd_size=4)
    hybrid = tiny_checkpoint(root / "hybrid", arch="qwen3_5", bd_size=4)
    sidecar = hybrid / "block_diffusion.json"
    sidecar.write_text(json.dumps(json.loads(sidecar.read_text()) | {"within_block_causal": True}))
    return {"dense": dense, "hybrid": hybrid, "draft": draft_checkpoint(root / "draft")}


def cases(root: Path) -> list[dict]:
    found = []
    common = ["--port", "31000", "--api-key", "sk-test", "--served-model-name", "my-model", "--max-batch", "4"]
    for kind, model in checkpoints(root).items():
        for mode, flags in MODE_FLAGS.items():
            for tail in ([], PASS_THROUGH):
                argv = dry_run([str(model), "--mode", mode, *flags, *common], tail)
                found.append({"name": f"{kind} {mode}{' +flags' if tail else ''}", "mode": mode, "argv": argv})
    for family in FAMILIES:
        for tail in ([], PASS_THROUGH):
            argv = dry_run(["org/model", "--mode", family, *common], tail)
            found.append({"name": f"{family}{' +flags' if tail else ''}", "mode": family, "argv": argv})
    # The builders' own defaults, and the FDFO default of stock `sglang serve`.
    dense = root / "dense"
    settings = bdstack_settings(dense, "diffusion")
    argv = build_bdstack_command(
        str(dense), settings, root / "batched" / "settings.yaml", python=SGLANG_PYTHON, max_running_requests=8
    )
    found.append({"name": "dense diffusion, max_running_requests=8", "mode": "diffusion", "argv": argv})
    stock = [a for a in argv if a != "--no-dllm-fdfo"]  # SGLang's FDFO default, as under stock `sglang serve`
    found.append({"name": "dense diffusion, SGLang's FDFO default", "mode": "diffusion", "argv": stock})
    argv = build_sglang_command("org/model", family="sdar", python=SGLANG_PYTHON, max_running_requests=8)
    found.append({"name": "sdar, max_running_requests=8", "mode": "sdar", "argv": argv})
    return found


if __name__ == "__main__":
    root = Path(sys.argv[1])
    built = cases(root)
    (root / "commands.json").write_text(json.dumps(built, indent=1))
    print(f"{root / 'commands.json'}: {len(built)} commands")
