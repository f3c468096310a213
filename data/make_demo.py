"""Make the offline demo kit: a synthetic chat dataset with checkable answers, a character-level
chat tokenizer and a tiny random Qwen3 model directory (loadable with from_pretrained).

    python -m data.make_demo OUT_DIR [--train 2000 --eval 200 --seed 0 --hidden 128 --layers 4]

Tasks (the answer is a pure function of the question, so accuracy can be checked exactly):
  add   "Add 482 and 93."              -> "575"
  sort  "Sort: 7 3 9 1"                -> "1 3 7 9"
  copy  "Copy: qzkfe"                  -> "qzkfe"
  rev   "Reverse: abcde"               -> "edcba"
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import string
from pathlib import Path

from data.toy_tokenizer import build_char_tokenizer


def make_example(rng: random.Random) -> dict:
    kind = rng.choice(["add", "sort", "copy", "rev"])
    if kind == "add":
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        q, ans = f"Add {a} and {b}.", str(a + b)
    elif kind == "sort":
        xs = [rng.randint(0, 9) for _ in range(rng.randint(3, 7))]
        q, ans = "Sort: " + " ".join(map(str, xs)), " ".join(map(str, sorted(xs)))
    else:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 12)))
        q, ans = (f"Copy: {word}", word) if kind == "copy" else (f"Reverse: {word}", word[::-1])
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": ans}], "task": kind}


def write_dataset(path: Path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps(make_example(rng)) + "\n")


def write_model(out: Path, *, hidden: int, layers: int, seed: int, arch: str = "qwen3") -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig, Qwen3Config

    tok = build_char_tokenizer()
    common = dict(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 32),
        num_key_value_heads=max(1, hidden // 64),
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    if arch == "qwen3":
        cfg = Qwen3Config(**common)
    elif arch == "qwen3_moe":  # every layer a mixture of 4 experts, 2 per token
        from transformers import Qwen3MoeConfig

        cfg = Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden)
    else:  # hybrid: gated-delta layers with full attention every 4th layer (the Qwen3.5 pattern)
        heads = max(1, hidden // 32)
        cfg = Qwen3_5TextConfig(
            **common,
            linear_num_value_heads=heads,
            linear_num_key_heads=max(1, heads // 2),
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_conv_kernel_dim=4,
        )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), dtype=torch.float32)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--train", type=int, default=2000, help="training conversations")
    p.add_argument("--eval", type=int, default=200, help="held-out conversations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument(
        "--arch",
        default="qwen3",
        choices=["qwen3", "qwen3_5", "qwen3_moe"],
        help="dense Qwen3, hybrid Qwen3.5 (gated-delta + full attention), or mixture-of-experts Qwen3-MoE",
    )
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    write_dataset(args.out / "train.jsonl", args.train, args.seed)
    write_dataset(args.out / "eval.jsonl", args.eval, args.seed + 1)
    write_model(args.out / "base_model", hidden=args.hidden, layers=args.layers, seed=args.seed, arch=args.arch)
    print(f"wrote {args.out}/train.jsonl ({args.train}), eval.jsonl ({args.eval}), base_model/")


if __name__ == "__main__":
    main()
