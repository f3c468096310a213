"""A running OpenAI-compatible server (SGLang or vLLM, started by serve.py) against the native engine on the same
checkpoint, greedy: `python -m benchmark.served_vs_native CKPT MODE PORT` prints each prompt's two texts and exits
1 if any differs. The GPU scripts (`benchmark/gpu_sglang_check.sh`, `benchmark/gpu_vllm_check.sh`) run it.

The native engine decodes diffusion unfused (`fuse_commit=False`), as both backends do; its self-spec and causal
outputs are the base model's causal output. A draft adapter is served uncut (`draft_energy=1.0`): the backends'
LoRA loaders read the peft weights as trained.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request

PROMPTS = ["Hello there", "Count: 1 2 3", "The answer is"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("mode", choices=["causal", "diffusion", "self-spec"])
    p.add_argument("port", type=int)
    p.add_argument("--greedy", default="temperature=0", help="KEY=NUMBER the request sets for greedy decoding")
    p.add_argument(
        "--greedy-modes",
        default="causal,diffusion,self-spec",
        help="modes whose requests set it (vLLM 0.33 rejects a temperature for a diffusion model: its plugin is greedy "
        "by default)",
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--device", default="cuda", help="the native engine's (cpu: a dry run against a local server)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="the native engine's weights")
    args = p.parse_args(argv)

    from bdcore.decode.sampling import SamplingParams
    from bdcore.loading import load_checkpoint
    from inference.native.engine import DecodeConfig, Engine

    key, _, value = args.greedy.partition("=")
    greedy = {key: float(value)} if args.mode in args.greedy_modes.split(",") else {}
    loaded = load_checkpoint(args.checkpoint, device=args.device, dtype=args.dtype, draft_energy=1.0)
    engine = Engine(loaded, DecodeConfig(mode=args.mode, fuse_commit=False))
    base = f"http://localhost:{args.port}/v1"
    served = json.loads(urllib.request.urlopen(f"{base}/models").read())["data"][0]["id"]  # its own name for it
    bad = 0
    for prompt in PROMPTS:
        ids = loaded.tokenizer(prompt)["input_ids"]
        body = json.dumps({"model": served, "prompt": ids, "max_tokens": args.max_tokens, **greedy}).encode()
        url = f"{base}/completions"
        t = time.time()
        reply = urllib.request.urlopen(urllib.request.Request(url, body, {"Content-Type": "application/json"}))
        got = json.loads(reply.read())["choices"][0]["text"]
        dt = time.time() - t
        want = engine.generate(ids, SamplingParams(max_tokens=args.max_tokens))
        tpf = want.stats.tokens_per_forward
        print(f"{args.mode} {prompt!r}: served {got!r} ({dt:.2f}s) native {want.text!r} tpf {tpf:.2f}")
        bad += got != want.text
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
