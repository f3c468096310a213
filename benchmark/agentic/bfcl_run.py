"""BFCL v4 (`bfcl-eval`) against a bdstack server: registers bdstack model entries, then runs BFCL's CLI.

    # in BFCL's own venv (pip install bfcl-eval), from the bdstack repo root
    python -m benchmark.agentic.bfcl_run --base-url http://127.0.0.1:8000/v1 --served-model NAME \\
        generate --model bdstack-FC --test-category simple_python,multiple,parallel
    python -m benchmark.agentic.bfcl_run --served-model NAME evaluate --model bdstack-FC --test-category ...

BFCL only runs models listed in its MODEL_CONFIG_MAPPING (keyed by the `--model` name of `bfcl generate`
and `bfcl evaluate`). This wrapper adds two entries to that table in its own process, sets the
environment BFCL's handlers read, and hands the remaining arguments to BFCL's CLI:

- `bdstack-FC`: BFCL's OpenAI chat-completions handler in function-calling mode (OPENAI_BASE_URL,
  OPENAI_API_KEY): `tools` in the request, the server's tool-call parser, `tool` messages in multi-turn
  categories. Function names with dots are sent with underscores (as for every OpenAI-style entry).
- `bdstack-qwen-FC` (with --checkpoint): BFCL's Qwen FC handler, which renders its own Qwen prompt,
  sends it to /v1/completions (REMOTE_OPENAI_BASE_URL) and parses the `<tool_call>` blocks itself. BFCL
  loads the tokenizer from the checkpoint and sends the checkpoint path as the model name, so serve it
  with `--served-model-name CKPT` (the same path).

`--print-config` prints the entries as JSON without importing BFCL.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

FC_HANDLER = "bfcl_eval.model_handler.api_inference.openai_completion.OpenAICompletionsHandler"
QWEN_HANDLER = "bfcl_eval.model_handler.local_inference.qwen_fc.QwenFCHandler"


def model_configs(model: str, checkpoint: str | None = None) -> dict[str, dict]:
    """BFCL ModelConfig fields of the bdstack entries (the handler as a dotted path)."""
    common = dict(url="https://github.com/", org="bdstack", license="apache-2.0", input_price=None, output_price=None)
    configs = {
        "bdstack-FC": dict(
            model_name=model,
            display_name=f"{model} (bdstack, FC)",
            model_handler=FC_HANDLER,
            is_fc_model=True,
            underscore_to_dot=True,
            **common,
        )
    }
    if checkpoint:
        configs["bdstack-qwen-FC"] = dict(
            model_name=checkpoint,
            display_name=f"{Path(checkpoint).name} (bdstack, Qwen prompt)",
            model_handler=QWEN_HANDLER,
            is_fc_model=True,
            underscore_to_dot=False,
            **common,
        )
    return configs


def client_env(base_url: str, api_key: str) -> dict[str, str]:
    """What BFCL's handlers read: OPENAI_* (FC handler) and REMOTE_OPENAI_* (local-model handlers)."""
    return {
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": api_key,
        "REMOTE_OPENAI_BASE_URL": base_url,
        "REMOTE_OPENAI_API_KEY": api_key,
    }


def register(configs: dict[str, dict]) -> None:
    import importlib

    from bfcl_eval.constants.model_config import MODEL_CONFIG_MAPPING, ModelConfig

    for name, fields in configs.items():
        module, cls = fields["model_handler"].rsplit(".", 1)
        handler = getattr(importlib.import_module(module), cls)
        MODEL_CONFIG_MAPPING[name] = ModelConfig(**{**fields, "model_handler": handler})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmark.agentic.bfcl_run",
        description="Register bdstack models in BFCL v4 and run its CLI (generate / evaluate / scores ...).",
        epilog="Everything after the options goes to BFCL's CLI, e.g. 'generate --model bdstack-FC ...'.",
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI base URL (with /v1)")
    p.add_argument("--served-model", required=True, help="the server's model name (the FC route sends it)")
    p.add_argument("--api-key", default="EMPTY", help="the server's --api-key, if any")
    p.add_argument("--checkpoint", default=None, help="checkpoint directory: adds the bdstack-qwen-FC prompt route")
    p.add_argument("--print-config", action="store_true", help="print the BFCL entries as JSON and exit")
    p.add_argument("bfcl_args", nargs=argparse.REMAINDER, help="BFCL's command and its options")
    args = p.parse_args(argv)
    rest = args.bfcl_args
    checkpoint = str(Path(args.checkpoint).resolve()) if args.checkpoint else None
    configs = model_configs(args.served_model, checkpoint)
    if args.print_config:
        print(json.dumps({"env": client_env(args.base_url, args.api_key), "models": configs}, indent=2))
        return 0
    if not rest:
        p.error("give BFCL's command, e.g. 'generate --model bdstack-FC --test-category simple_python'")
    os.environ.update(client_env(args.base_url, args.api_key))
    try:
        register(configs)
        from bfcl_eval.__main__ import cli
    except ImportError as e:
        p.error(f"bfcl-eval is not importable here ({e}); use BFCL's venv (pip install bfcl-eval soundfile)")
    cli(args=rest, prog_name="bfcl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
