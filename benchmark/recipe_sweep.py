"""Which recipe drafts best for a fixed wall-clock budget: train.py arms scored by the one-forward drafting metric.

    python -m benchmark.recipe_sweep --base runs/smollm2/base --data runs/real/stdlib_train_sd.jsonl \\
        --eval-data runs/real/stdlib_heldout_sd.jsonl --budget-min 10 \\
        --arm "full_lr1e-4=--ar_loss_weight 0.2 --lr 1e-4" \\
        --arm "adapter_r32_lr1e-3=--draft_adapter --lora_rank 32 --lr 1e-3" --out runs/sweep-smollm2

Each `--arm NAME=FLAGS` is one `train.py` run on the same base and data, after `--common` flags, sized to
the budget by a 3-step calibration run (`benchmark/conversion.py`'s), with `--eval_data` so that the trainer
scores the final weights itself (`train/evaluation.py`: a canvas at every position of each held-out
answer, greedy acceptance against the AR head): the share of first drafts accepted, the mean accepted
prefix, the tokens per forward linear and all-canvases self-spec would take, and the AR head's held-out
loss. A `base` row (the converted checkpoint before training: one step at lr 1e-12) gives the floor and
the AR loss every arm must not exceed (a lossless mode verifies with the AR head: damaging it to draft
better is not a win). The gain column is the implied linear tokens per forward above the base's, per
training minute. Arms run one after another: run the sweep on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

from benchmark.conversion import _run, _steps_for, _train

METRICS = ("draft_first_accept", "draft_mean_accepted", "draft_tpf_linear", "draft_tpf_all", "eval_ar_loss")
BASE_FLAGS = ["--lr", "1e-12"]  # one step that moves nothing: the mask row's initial value, the base's AR head


def parse_arm(text: str) -> tuple[str, list[str]]:
    name, sep, flags = text.partition("=")
    if not sep or not name or not name.replace("_", "").replace("-", "").replace(".", "").isalnum():
        raise argparse.ArgumentTypeError(f"--arm {text!r}: expected NAME=FLAGS, NAME of letters, digits, _ - .")
    return name, shlex.split(flags)


def final_eval(run_dir: Path) -> dict:
    """The metrics of the run's last step, where the trainer evaluated the final weights."""
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    missing = [k for k in METRICS if k not in last]
    if missing:
        raise SystemExit(f"recipe_sweep: {run_dir}/metrics.jsonl's last step has no {missing}: was --eval_data set?")
    return {
        **{k: last[k] for k in METRICS},
        "steps": last["step"],
        "train_s": sum(r["step_time_s"] for r in records),
        "eval_s": last.get("t_eval_s"),
    }


def sweep(args) -> list[dict]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = shlex.split(args.common) + ["--eval_data", str(args.eval_data), "--eval_samples", str(args.eval_samples)]
    ctx = SimpleNamespace(train_flags=shlex.join(common))  # what conversion's _train reads
    rows = []
    if args.base_row:
        cmd = [sys.executable, "train.py", "--model_id", args.base, "--dataset", str(args.data), "--max_steps", "1"]
        cmd += ["--save_dir", str(out / "base"), *common, *BASE_FLAGS]
        _run(cmd, out / "base.log")
        rows.append({"arm": "base", "flags": "(before training)", **final_eval(out / "base")})
        rows[-1]["train_s"] = 0.0
        print(f"base: {rows[-1]['draft_tpf_linear']:.3f} linear tok/fwd", flush=True)
    for name, flags in args.arm:
        steps = _steps_for(ctx, out, name, args.base, Path(args.data), flags, args.budget_min * 60)
        _train(ctx, out, name, args.base, Path(args.data), steps, flags)
        rows.append({"arm": name, "flags": shlex.join(flags), **final_eval(out / name)})
        r = rows[-1]
        print(
            f"{name}: {r['steps']} steps, {r['train_s']:.0f} s, {r['draft_tpf_linear']:.3f} linear tok/fwd", flush=True
        )
    return rows


def table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["arm"] == "base"), None)
    lines = [
        "| arm | flags | steps | train s | first draft accepted | mean accepted | implied linear tok/fwd "
        "| implied all-canvases tok/fwd | AR held-out loss | AR loss <= base | linear gain per train min |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ok = gain = "-"
        if base is not None and r is not base:
            ok = "yes" if r["eval_ar_loss"] <= base["eval_ar_loss"] + 1e-4 else "**no**"
            gain = f"{(r['draft_tpf_linear'] - base['draft_tpf_linear']) / (r['train_s'] / 60):.4f}"
        lines.append(
            f"| {r['arm']} | `{r['flags']}` | {r['steps']} | {r['train_s']:.0f} | {r['draft_first_accept']:.1%} "
            f"| {r['draft_mean_accepted']:.3f} | {r['draft_tpf_linear']:.3f} | {r['draft_tpf_all']:.3f} "
            f"| {r['eval_ar_loss']:.4f} | {ok} | {gain} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmark.recipe_sweep",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--base", required=True, help="the AR base checkpoint every arm converts")
    p.add_argument("--data", type=Path, required=True, help="training chats (JSONL with answers)")
    p.add_argument("--eval-data", type=Path, required=True, help="held-out chats whose answers are scored")
    p.add_argument("--eval-samples", type=int, default=40, help="held-out answers scored per arm (default 40)")
    p.add_argument("--budget-min", type=float, default=10.0, help="training wall-clock per arm, minutes (default 10)")
    p.add_argument("--common", default="--bd_size 8 --pack --max_length 1024", help="train.py flags every arm shares")
    p.add_argument("--arm", type=parse_arm, action="append", default=[], help="NAME=FLAGS (repeat); train.py flags")
    p.add_argument("--no-base-row", dest="base_row", action="store_false", help="skip the untrained base row")
    p.add_argument("--out", required=True, help="folder for the runs, sweep.json and sweep.md")
    args = p.parse_args(argv)
    for path in (args.data, args.eval_data):
        if not path.is_file():
            p.error(f"{path}: no such file")
    if not args.arm and not args.base_row:
        p.error("nothing to run: give at least one --arm")
    if len({n for n, _ in args.arm}) != len(args.arm) or any(n == "base" for n, _ in args.arm):
        p.error("--arm names must be distinct and not 'base'")
    rows = sweep(args)
    text = table(rows)
    command = "python -m benchmark.recipe_sweep " + shlex.join(argv if argv is not None else sys.argv[1:])
    print(f"\n{command}\n\n{text}")
    Path(args.out, "sweep.json").write_text(json.dumps({"command": command, "arms": rows}, indent=1) + "\n")
    Path(args.out, "sweep.md").write_text(f"`{command}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
