"""Greedy accuracy of a checkpoint on the demo tasks, decoded autoregressively with HF `generate`.

    python -m data.demo_check CHECKPOINT EVAL_JSONL [--limit 100]

A block-diffusion checkpoint trained with ar_loss_weight > 0 keeps a causal clean stream, so plain
AR decoding with stock transformers measures how much of the AR model's quality it kept.
"""

from __future__ import annotations

import argparse
import json

import torch

from bdcore.chat import chat_ids
from bdcore.scoring import exact_match


def accuracy(checkpoint: str, eval_path: str, limit: int) -> tuple[float, int, dict[str, float]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    bad_words = [[tok.convert_tokens_to_ids("<|mask|>")]] if "<|mask|>" in tok.get_vocab() else None
    rows = [json.loads(x) for x in open(eval_path)][:limit]
    right = 0
    by_task: dict[str, list[int]] = {}
    for row in rows:
        ids = torch.tensor([chat_ids(tok, row["messages"][:-1])])
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=40,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id,
                bad_words_ids=bad_words,
            )
        answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
        ok = exact_match(answer, row["messages"][-1]["content"])
        right += ok
        by_task.setdefault(row.get("task", "all"), []).append(ok)
    return right / len(rows), len(rows), {k: sum(v) / len(v) for k, v in sorted(by_task.items())}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("eval_jsonl")
    p.add_argument("--limit", type=int, default=100)
    args = p.parse_args(argv)
    acc, n, per_task = accuracy(args.checkpoint, args.eval_jsonl, args.limit)
    tasks = ", ".join(f"{k} {v:.0%}" for k, v in per_task.items())
    print(f"{args.checkpoint}: greedy AR accuracy {acc:.1%} on {n} problems ({tasks})")


if __name__ == "__main__":
    main()
