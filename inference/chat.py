#!/usr/bin/env python
"""Chat with any OpenAI-compatible server (bdstack, SGLang, vLLM), streaming.

python inference/chat.py "Why is the sky blue?"        # one shot
python inference/chat.py                               # interactive (empty line or Ctrl-D quits)
python inference/chat.py --base-url http://127.0.0.1:30000/v1 --mode diffusion "Add 2 and 3."
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python inference/X.py` from a checkout: the packages live in its root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.server_defaults import SERVER  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="chat.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("prompt", nargs="?", help="one-shot message (omit for an interactive session)")
    p.add_argument("--base-url", default=os.environ.get("BDSTACK_BASE_URL", SERVER.base_url))
    p.add_argument("--api-key", default=os.environ.get("BDSTACK_API_KEY", "none"))
    p.add_argument("--model", default=None, help="model id (default: the server's first model)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=SERVER.max_tokens)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--mode", default=None, help="bdstack servers: per-request decode mode")
    p.add_argument("--no-stream", action="store_true")
    return p


def reply(client, model, messages, args, out=sys.stdout) -> str:
    extra = {"mode": args.mode} if args.mode else None
    kw = dict(
        model=model, messages=messages, max_tokens=args.max_tokens, temperature=args.temperature, extra_body=extra
    )
    if args.no_stream:
        resp = client.chat.completions.create(**kw)
        text = resp.choices[0].message.content or ""
        out.write(text + "\n")
        usage = getattr(resp, "usage", None)
        tpf = getattr(usage, "tokens_per_forward", None) if usage else None
        if tpf is None and usage is not None:
            tpf = (usage.model_extra or {}).get("tokens_per_forward")
        if tpf is not None:
            out.write(f"[{usage.completion_tokens} tokens, {tpf:.2f} tokens/forward]\n")
        return text
    parts = []
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].delta.content:
            out.write(chunk.choices[0].delta.content)
            out.flush()
            parts.append(chunk.choices[0].delta.content)
    out.write("\n")
    return "".join(parts)


def main(argv=None) -> int:
    from openai import OpenAI

    args = build_parser().parse_args(argv)
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = args.model or client.models.list().data[0].id
    messages = [{"role": "system", "content": args.system}] if args.system else []
    if args.prompt:
        reply(client, model, [*messages, {"role": "user", "content": args.prompt}], args)
        return 0
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        messages.append({"role": "assistant", "content": reply(client, model, messages, args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
