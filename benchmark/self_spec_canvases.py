"""Linear self-spec vs self-spec with a canvas after every clean row vs causal, side by side in one run.

    python -m benchmark.self_spec_canvases runs/demo/bd/final --heldout runs/demo/kit/eval.jsonl --limit 100

The native engine in process, greedy, one request at a time after one untimed warm-up request, the same
prompts in every variant (chat JSONL with reference answers, or HumanEval-style prompts): tokens per
forward, tok/s and its ratio to causal, the share of outputs identical to causal decoding (lossless:
must be 100%; causal decoding is `benchmark.conversion_eval.stock_greedy`, the Hugging Face model's own
greedy loop, so the engine's causal variant is held to it as well), cold steps, and how many drafts
were accepted per verify.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

VARIANTS = {
    "causal": dict(mode="causal"),
    "self-spec last": dict(mode="self-spec", self_spec_canvases="last"),
    "self-spec all": dict(mode="self-spec", self_spec_canvases="all"),
}


def measure(checkpoint: Path, heldout_path: Path, *, limit: int, max_tokens: int, draft_len: int | None) -> list[dict]:
    from transformers import AutoTokenizer

    from bdcore.decode.config import DecodeConfig
    from bdcore.decode.sampling import SamplingParams
    from benchmark.conversion_eval import load_heldout, stock_greedy
    from inference.native.engine import Engine
    from inference.native.loading import load_checkpoint

    loaded = load_checkpoint(checkpoint)
    heldout = load_heldout(heldout_path, AutoTokenizer.from_pretrained(checkpoint), limit)
    causal = [  # before any Engine exists: an engine binds its decode forward to hybrid layers
        stock_greedy(loaded.model, ids, max_tokens=max_tokens, stop_ids=loaded.stop_ids, banned=loaded.mask_id)
        for ids in heldout.prompt_ids
    ]
    rows = []
    for name, settings in VARIANTS.items():
        engine = Engine(loaded, DecodeConfig(draft_len=draft_len, **settings))
        engine.generate(heldout.prompt_ids[0], SamplingParams(max_tokens=max_tokens))  # warm-up, not timed
        start = time.perf_counter()
        outs = [engine.generate(ids, SamplingParams(max_tokens=max_tokens)) for ids in heldout.prompt_ids]
        wall = time.perf_counter() - start
        generated, forwards = sum(g.stats.generated for g in outs), sum(g.stats.forwards for g in outs)
        accepted = {}
        for g in outs:
            for k, v in g.stats.accepted.items():
                accepted[k] = accepted.get(k, 0) + v
        rows.append(
            {
                "variant": name,
                "tokens_per_forward": generated / forwards,
                "tok_s": generated / wall,
                "same_as_causal": sum(g.tokens == c for g, c in zip(outs, causal)) / len(outs),
                "forwards": forwards,
                "accepted": dict(sorted(accepted.items())),
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    base = rows[0]["tok_s"]
    lines = [
        "| variant | tokens/forward | tok/s | tok/s vs causal | same as causal | forwards "
        "| drafts accepted per verify |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['tokens_per_forward']:.2f} | {r['tok_s']:.1f} | {r['tok_s'] / base:.2f}x "
            f"| {r['same_as_causal']:.0%} | {r['forwards']} | {r['accepted'] or '-'} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a block-diffusion checkpoint with a causal AR head (clean_causal: true)")
    p.add_argument("--heldout", required=True, help="chat JSONL or HumanEval-style prompts")
    p.add_argument("--limit", type=int, default=50, help="prompts (default 50)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--draft-len", type=int, default=None, help="self-spec N (default: the trained bd_size)")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    rows = measure(
        Path(args.checkpoint),
        Path(args.heldout),
        limit=args.limit,
        max_tokens=args.max_tokens,
        draft_len=args.draft_len,
    )
    command = "python -m benchmark.self_spec_canvases " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"{command}\n\n{table(rows)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
