"""RL on the demo kit: accuracy per decode mode before and after, side by side (`make demo-rl`).

    python -m benchmark.rl_demo --start runs/demo/bd-short/final --data runs/demo/kit/train.jsonl \\
        --heldout runs/demo/kit/eval.jsonl --threshold 0.5 --minutes 10 --sft-baseline --out runs/demo/rl

Trains a converted checkpoint with `train.py --recipe rl` (reward: the exact answer, diffusion
rollouts at the commit `--threshold` that will be served, GRPO with DAPO's clip-higher, token-level loss and
dynamic sampling) for the number of steps that fits `--minutes` (sized by a 2-step calibration run), then
evaluates the start and the result on the held-out problems in every decode mode, in process, greedy
(`benchmark/conversion_eval.py`, diffusion at the same threshold), and prints one table with the command
that produced it. `--sft-baseline` spends the RL run's measured wall time on more two-stream SFT of the
same start instead (`--sft-flags`), so the table says what the same minutes of plain SFT would have bought.
The rollouts' cost against the serving engine's diffusion decode of the same prompts is printed too
(`rollout_vs_engine`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bdcore.decode.config import DecodeConfig

REPO = Path(__file__).resolve().parents[1]
RL_FLAGS = (
    "--recipe rl --rl_reward exact --rl_group_size 8 --rl_prompts_per_step 4 --rl_max_new_tokens 32 "
    "--rl_clip_high 0.28 --rl_token_level --rl_dynamic_sampling --rl_temperature 1.0 --lr 1e-4 --warmup 2"
)
# the demo conversion's own recipe (Makefile `demo`), continued from the start checkpoint
SFT_FLAGS = "--ar_loss_weight 0.5 --pack --max_length 1024 --micro_batch_size 2 --lr 2e-3 --warmup 20"


def _train(args, out: Path, steps: int, flags: list[str]) -> float:
    cmd = [sys.executable, "train.py", "--model_id", str(args.start), "--dataset", str(args.data)]
    cmd += ["--bd_size", str(args.bd_size), "--max_steps", str(steps), "--log_every", "1", "--save_dir", str(out)]
    cmd += flags
    start = time.perf_counter()
    with open(out.parent / f"{out.name}.log", "w") as log:
        if subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
            raise SystemExit(f"rl_demo: train.py failed; see {out.parent / (out.name + '.log')}")
    return time.perf_counter() - start


def _steps_for(args, out: Path, seconds: float, flags: list[str]) -> int:
    """Steps of a run with `flags` that fit `seconds`, from the mean time of steps 2-3 of a 3-step
    calibration run (the first step pays one-off warm-up costs; no learning-rate warm-up, which could not
    fit 3 steps)."""
    _train(args, out, 3, flags + ["--warmup", "0"])
    times = [json.loads(x)["step_time_s"] for x in (out / "metrics.jsonl").read_text().splitlines()][1:]
    return max(2, int(seconds / (sum(times) / len(times))))


def rollout_vs_engine(checkpoint: Path, heldout_prompts: list[list[int]], max_tokens: int, threshold: float) -> float:
    """Seconds of `train.rollout.rollout` over the prompts (one batch, greedy, trace recorded) divided by
    the serving engine's diffusion decode of the same prompts (one batched scheduler run)."""
    from bdcore.decode.sampling import SamplingParams
    from bdcore.loading import load_checkpoint
    from inference.native.engine import Engine
    from inference.native.scheduler import Scheduler
    from train.rollout import rollout

    loaded = load_checkpoint(checkpoint)
    params = SamplingParams(max_tokens=max_tokens)
    decode = DecodeConfig(mode="diffusion", threshold=threshold)
    scheduler = Scheduler(Engine(loaded, decode), max_batch=len(heldout_prompts))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(heldout_prompts)) as pool:
        list(pool.map(lambda p: scheduler.generate(p, params, decode), heldout_prompts))
    engine_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    rollout(
        loaded.model,
        heldout_prompts,
        caps=loaded.capabilities,
        decode=decode,
        params=params,
    )
    return (time.perf_counter() - t0) / engine_s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--start", type=Path, required=True, help="the converted checkpoint RL starts from")
    p.add_argument("--data", type=Path, required=True, help="chat JSONL with reference answers (the prompts)")
    p.add_argument("--heldout", type=Path, required=True, help="held-out chats with reference answers")
    p.add_argument("--minutes", type=float, default=10.0, help="RL wall-clock budget (default 10)")
    p.add_argument("--steps", type=int, default=None, help="RL steps (default: what fits --minutes)")
    p.add_argument("--bd-size", type=int, default=8)
    p.add_argument(
        "--threshold",
        type=float,
        default=DecodeConfig.threshold,
        help="diffusion commit threshold of the rollouts (--rl_threshold) and of the evaluation "
        f"(default {DecodeConfig.threshold})",
    )
    p.add_argument("--rl-flags", default=RL_FLAGS, help=f"train.py flags of the RL run (default: {RL_FLAGS})")
    p.add_argument(
        "--sft-baseline",
        action="store_true",
        help="also spend the RL run's wall time on two-stream SFT of the same start and evaluate it",
    )
    p.add_argument("--sft-flags", default=SFT_FLAGS, help=f"train.py flags of the SFT baseline (default: {SFT_FLAGS})")
    p.add_argument("--limit", type=int, default=100, help="held-out problems evaluated")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from benchmark.conversion_eval import evaluate, load_heldout

    args.out.mkdir(parents=True, exist_ok=True)
    rl_flags = shlex.split(args.rl_flags) + ["--rl_threshold", str(args.threshold)]
    steps = args.steps or _steps_for(args, args.out / "calibrate", args.minutes * 60, rl_flags)
    wall = _train(args, args.out / "rl", steps, rl_flags)
    checkpoints = {"before": args.start, "after RL": args.out / "rl" / "final"}
    sft_steps = sft_wall = None
    if args.sft_baseline:
        sft_flags = shlex.split(args.sft_flags)
        sft_steps = _steps_for(args, args.out / "calibrate-sft", wall, sft_flags)
        sft_wall = _train(args, args.out / "sft", sft_steps, sft_flags)
        checkpoints["after SFT, same time"] = args.out / "sft" / "final"
    heldout = load_heldout(args.heldout, AutoTokenizer.from_pretrained(args.start), args.limit)
    rows = {
        name: evaluate(path, heldout, max_tokens=args.max_tokens, threshold=args.threshold)
        for name, path in checkpoints.items()
    }
    ratio = rollout_vs_engine(args.out / "rl" / "final", heldout.prompt_ids[:16], args.max_tokens, args.threshold)
    command = "python -m benchmark.rl_demo " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    lines = [
        command,
        f"RL: {steps} steps in {wall:.0f} s; rollout / engine diffusion decode time: {ratio:.2f}x",
        *([f"SFT baseline: {sft_steps} steps in {sft_wall:.0f} s"] if sft_steps else []),
        "",
        f"| checkpoint | causal accuracy | diffusion accuracy (threshold {args.threshold}) | diffusion tok/fwd "
        "| self-spec tok/fwd | self-spec same as causal |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        c, d, s = row["causal"], row["diffusion"], row["self-spec"]
        lines.append(
            f"| {name} | {c['quality']:.1%} | {d['quality']:.1%} | {d['tokens_per_forward']:.2f} "
            f"| {s['tokens_per_forward']:.2f} | {s['same_as_causal']:.0%} |"
        )
    print("\n".join(lines))
    record = {
        "command": command,
        "steps": steps,
        "wall_s": wall,
        "sft_steps": sft_steps,
        "sft_wall_s": sft_wall,
        "rows": rows,
    }
    (args.out / "rl_demo.json").write_text(json.dumps(record, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
