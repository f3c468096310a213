"""Conversion efficiency: what the same base model, prompts and wall-clock budget buy with each recipe.

    python -m benchmark.conversion --base runs/demo/ar/final --sft-data runs/demo/kit/train.jsonl \\
        --heldout runs/demo/kit/eval.jsonl --budget-min 3 --bd-size 8 --out runs/conversion-demo

Arms (each one `train.py` run on the same base, sized to the budget by a 3-step calibration run):
- `sft`: two-stream SFT on the given data;
- `sft_self`: two-stream SFT on self-distilled data (`data.self_distill`: the base model's own greedy
  answers to the same prompts, answers cut at the limit dropped);
- `opd`: on-policy distillation alone (`--recipe opd`), prompts from the given data;
- `sft_opd`: 30% of the budget of `sft_self` as a warm start, then OPD for the rest;
- `sft_draft`: `sft` with a draft-only LoRA adapter (`--lora-flags`): the base weights stay as they are.
Every checkpoint (and the base, causal only) is then evaluated on the held-out prompts side by side
(`benchmark/conversion_eval.py`), and one table is printed with the command that produced it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from bdcore.decode.config import DecodeConfig

ARMS = ("sft", "sft_self", "opd", "sft_opd", "sft_draft")
REPO = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], log: Path) -> float:
    start = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"conversion: {' '.join(cmd[:4])} ... failed; see {log}")
    return time.perf_counter() - start


def _train(args, out: Path, name: str, model: str, data: Path, steps: int, extra: list[str]) -> float:
    cmd = [sys.executable, "train.py", "--model_id", model, "--dataset", str(data), "--max_steps", str(steps)]
    cmd += ["--warmup", str(max(1, steps // 20)), "--log_every", "1", "--save_dir", str(out / name)]
    flags = shlex.split(args.train_flags)
    if "--draft_adapter" in extra:  # the draft adapter's clean stream is the base: no AR term to weigh
        flags = _without(flags, "--ar_loss_weight")
    return _run(cmd + flags + extra, out / f"{name}.log")


def _without(flags: list[str], name: str) -> list[str]:
    """`flags` without `name` and its value."""
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
        elif f == name:
            skip = True
        elif not f.startswith(f"{name}="):
            out.append(f)
    return out


def _steps_for(args, out: Path, name: str, model: str, data: Path, extra: list[str], seconds: float) -> int:
    """Steps that fit `seconds`, from the step time of a short calibration run (its first step excluded)."""
    _train(args, out, f"calibrate-{name}", model, data, 3, extra)
    records = (out / f"calibrate-{name}" / "metrics.jsonl").read_text().splitlines()
    times = [json.loads(x)["step_time_s"] for x in records]
    per_step = sum(times[1:]) / max(1, len(times) - 1)
    return max(2, int(seconds / per_step))


def _cost(run: Path) -> dict:
    """What the arm's last training run cost: trainable parameters, peak memory, median step time, and the
    size of its checkpoint (weights, tokenizer, sidecar and adapter; not the resume state)."""
    info_file = run / "model_info.json"  # absent in runs of a trainer older than it
    info = json.loads(info_file.read_text()) if info_file.is_file() else {"trainable_params": None}
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    times = sorted(r["step_time_s"] for r in records[1:] or records)
    final = run / "final"
    size = sum(f.stat().st_size for f in final.rglob("*") if f.is_file() and "train_state" not in f.parts)
    return {
        "final": str(final),
        "trainable_params": info["trainable_params"],
        "peak_mem_mib": max(r["peak_mem_mib"] for r in records),
        "step_time_s": times[len(times) // 2],
        "checkpoint_mb": size / 2**20,
    }


def _prompts_file(sft_data: Path, out: Path) -> Path:
    """The given chats with their last assistant turn removed: the prompts every arm answers."""
    path = out / "prompts.jsonl"
    with open(path, "w") as f:
        for line in sft_data.read_text().splitlines():
            msgs = json.loads(line)["messages"]
            while msgs and msgs[-1]["role"] == "assistant":
                msgs = msgs[:-1]
            if msgs:
                f.write(json.dumps({"messages": msgs}) + "\n")
    return path


PARTS = {"sft_opd": ("warm", "sft_opd")}  # arms trained in several runs; the others in one of their name


def trained(args) -> list[dict]:
    """`--eval-only`: the arms an earlier run of the same command trained in `--out` (train seconds: the
    sum of their steps' times, without process start-up and saves)."""
    rows = []
    for arm in args.arms:
        steps, wall = [], 0.0
        for name in PARTS.get(arm, (arm,)):
            run_dir = Path(args.out) / name
            if not (run_dir / "final").is_dir():
                raise SystemExit(f"conversion: --eval-only, but {run_dir}/final does not exist; train the arm first")
            records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
            steps.append(records[-1]["step"])
            wall += sum(r["step_time_s"] for r in records)
        rows.append({"arm": arm, "steps": steps, "train_wall_s": wall, **_cost(Path(args.out) / arm)})
    return rows


def run(args) -> list[dict]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = args.budget_min * 60
    opd = ["--recipe", "opd", *shlex.split(args.opd_flags)]
    prompts = Path(args.prompts) if args.prompts else _prompts_file(Path(args.sft_data), out)
    self_data = Path(args.self_distilled) if args.self_distilled else out / "self_distilled.jsonl"
    rows = []
    if {"sft_self", "sft_opd"} & set(args.arms) and not args.self_distilled:
        cmd = [sys.executable, "-m", "data.self_distill", "--model", args.base, "--prompts", str(prompts)]
        cmd += ["--out", str(self_data), "--max-new-tokens", str(args.max_tokens), "--batch", "8", "--no-progress"]
        seconds = _run(cmd, out / "self_distill.log")
        stats = json.loads(Path(f"{self_data}.stats.json").read_text())
        kept, dropped = stats.get("kept"), stats.get("dropped")
        print(f"self-distilled data: {kept} answers kept, dropped {dropped} ({seconds:.0f} s)", flush=True)
        if not kept:
            raise SystemExit(
                f"conversion: the base kept no self-distilled answer ({dropped}); answers must end with "
                "end-of-turn within --max-tokens: raise it, or leave out the sft_self and sft_opd arms"
            )
    # OPD needs only prompts, but the trainer reads them from chats with an answer: the self-distilled
    # chats serve when they exist (prompt sets without answers, such as HumanEval's).
    opd_data = self_data if self_data.is_file() else Path(args.sft_data)
    plans = {
        "sft": [("sft", args.base, Path(args.sft_data), [], 1.0)],
        "sft_self": [("sft_self", args.base, self_data, [], 1.0)],
        "opd": [("opd", args.base, opd_data, opd, 1.0)],
        "sft_opd": [("warm", args.base, self_data, [], 0.3), ("sft_opd", None, opd_data, opd, 0.7)],
        "sft_draft": [("sft_draft", args.base, Path(args.sft_data), shlex.split(args.lora_flags), 1.0)],
    }
    for arm in args.arms:
        wall, steps = 0.0, []
        for name, model, data, extra, share in plans[arm]:
            model = model or str(out / "warm" / "final")
            n = _steps_for(args, out, name, model, data, extra, budget * share)
            wall += _train(args, out, name, model, data, n, extra)
            steps.append(n)
        rows.append({"arm": arm, "steps": steps, "train_wall_s": wall, **_cost(out / arm)})
        print(f"{arm}: {'+'.join(map(str, steps))} steps in {wall:.0f} s", flush=True)
    return rows


def _millions(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:.2f}M"


def table(base: dict, rows: list[dict]) -> str:
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    lines = [
        "| arm | steps | train s | AR held-out loss | causal quality | self-spec tok/fwd | self-spec tok/s vs causal "
        "| diffusion tok/fwd | diffusion tok/s vs causal | diffusion quality | diffusion same as causal "
        "| trainable params | peak mem MiB | step s | checkpoint MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        f"| base | - | - | {f(base['ar_loss'], '.3f')} | {f(base['causal']['quality'], '.1%')} |" + " - |" * 10,
    ]
    for r in rows:
        c, s, d = r["causal"], r["self-spec"], r["diffusion"]
        lines.append(
            f"| {r['arm']} | {'+'.join(map(str, r['steps']))} | {r['train_wall_s']:.0f} | {f(r['ar_loss'], '.3f')} "
            f"| {f(c['quality'], '.1%')} | {s['tokens_per_forward']:.2f} | {s['tok_s'] / c['tok_s']:.2f}x "
            f"| {d['tokens_per_forward']:.2f} | {d['tok_s'] / c['tok_s']:.2f}x | {f(d['quality'], '.1%')} "
            f"| {d['same_as_causal']:.0%} | {_millions(r['trainable_params'])} "
            f"| {r['peak_mem_mib']:.0f} "
            f"| {r['step_time_s']:.2f} | {r['checkpoint_mb']:.1f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the AR base checkpoint every arm converts")
    p.add_argument(
        "--sft-data", required=True, help="chat JSONL: SFT data, and the prompts of every arm (answers may be absent)"
    )
    p.add_argument("--prompts", default=None, help="prompts to self-distil (default: --sft-data without answers)")
    p.add_argument(
        "--self-distilled",
        default=None,
        help="reuse this self-distilled chat JSONL (from an earlier run's data.self_distill on the same base and "
        "prompts) instead of making it again",
    )
    p.add_argument("--heldout", required=True, help="held-out chats (reference answers) or HumanEval-style prompts")
    p.add_argument("--budget-min", type=float, default=5.0, help="training wall-clock per arm, minutes")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {ARMS}")
    p.add_argument("--train-flags", default="--bd_size 8 --ar_loss_weight 0.2 --pack --max_length 1024 --lr 2e-3")
    p.add_argument("--opd-flags", default="--opd_prompts_per_step 4 --opd_max_new_tokens 64 --lr 5e-4")
    p.add_argument(
        "--lora-flags",
        default="--lora_rank 32 --draft_adapter --lr 3e-3",
        help="train.py flags of the sft_draft arm, after --train-flags",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="answer cap in self-distillation and evaluation")
    p.add_argument(
        "--threshold",
        type=float,
        default=DecodeConfig.threshold,
        help=f"diffusion commit threshold at evaluation (default {DecodeConfig.threshold}, the server's)",
    )
    p.add_argument("--limit", type=int, default=100, help="held-out prompts evaluated")
    p.add_argument("--out", required=True)
    p.add_argument("--eval-only", action="store_true", help="evaluate the arms an earlier run trained in --out")
    args = p.parse_args(argv)
    args.arms = [a for a in args.arms.split(",") if a]
    if unknown := set(args.arms) - set(ARMS):
        p.error(f"unknown arm(s) {sorted(unknown)}; choose from {ARMS}")

    from transformers import AutoTokenizer

    from benchmark.conversion_eval import evaluate, load_heldout

    rows = trained(args) if args.eval_only else run(args)
    heldout = load_heldout(Path(args.heldout), AutoTokenizer.from_pretrained(args.base), args.limit)
    base = evaluate(Path(args.base), heldout, max_tokens=args.max_tokens, threshold=args.threshold)
    for r in rows:
        r.update(evaluate(Path(r["final"]), heldout, max_tokens=args.max_tokens, threshold=args.threshold))
    text = table(base, rows)
    command = "python -m benchmark.conversion " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    print(f"\n{command}\n\n{text}")
    record = {"command": command, "base": base, "arms": rows}
    Path(args.out, "conversion.json").write_text(json.dumps(record, indent=1))
    Path(args.out, "conversion.md").write_text(f"`{command}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
