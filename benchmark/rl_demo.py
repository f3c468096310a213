"""RL on the demo kit: accuracy per decode mode before and after, side by side (`make demo-rl`).

    python -m benchmark.rl_demo --start runs/demo/bd/final --data runs/demo/kit/train.jsonl \\
        --heldout runs/demo/kit/eval.jsonl --minutes 10 --out runs/demo/rl

Trains the converted demo checkpoint with `train.py --rl_diffusion_rollout` (reward: the exact answer,
diffusion rollouts, GRPO with DAPO's clip-higher, token-level loss and dynamic sampling) for the number of
steps that fits `--minutes` (sized by a 2-step calibration run), then evaluates the start and the result
on the held-out problems in every decode mode, in process, greedy (`benchmark/conversion_eval.py`), and
prints one table with the command that produced it. The rollouts' cost against the serving engine's
diffusion decode of the same prompts is printed too (`rollout_vs_engine`).
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

REPO = Path(__file__).resolve().parents[1]
RL_FLAGS = (
    "--rl_diffusion_rollout --rl_reward exact --rl_group_size 8 --rl_prompts_per_step 4 --rl_max_new_tokens 32 "
    "--rl_clip_high 0.28 --rl_token_level --rl_dynamic_sampling --rl_temperature 1.0 --lr 1e-4 --warmup 2"
)


def _train(args, out: Path, steps: int) -> float:
    cmd = [sys.executable, "train.py", "--model_id", str(args.start), "--dataset", str(args.data)]
    cmd += ["--bd_size", str(args.bd_size), "--max_steps", str(steps), "--log_every", "1", "--save_dir", str(out)]
    cmd += shlex.split(args.rl_flags)
    start = time.perf_counter()
    with open(out.parent / f"{out.name}.log", "w") as log:
        if subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
            raise SystemExit(f"rl_demo: train.py failed; see {out.parent / (out.name + '.log')}")
    return time.perf_counter() - start


def rollout_vs_engine(checkpoint: Path, heldout_prompts: list[list[int]], max_tokens: int) -> float:
    """Seconds of `train.rollout.rollout` over the prompts (one batch, greedy, trace recorded) divided by
    the serving engine's diffusion decode of the same prompts (one batched scheduler run)."""
    from bdcore.decode.config import DecodeConfig
    from bdcore.decode.sampling import SamplingParams
    from inference.native.engine import Engine
    from inference.native.loading import load_checkpoint
    from inference.native.scheduler import Scheduler
    from train.rollout import rollout

    loaded = load_checkpoint(checkpoint)
    sc, decode, params = loaded.sidecar, DecodeConfig(mode="diffusion"), SamplingParams(max_tokens=max_tokens)
    scheduler = Scheduler(Engine(loaded, decode), max_batch=len(heldout_prompts))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(heldout_prompts)) as pool:
        list(pool.map(lambda p: scheduler.generate(p, params, decode), heldout_prompts))
    engine_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    rollout(
        loaded.model,
        heldout_prompts,
        mask_id=loaded.mask_id,
        stop_ids=loaded.stop_ids,
        bd_size=sc.bd_size,
        decode=decode,
        params=params,
        clean_causal=sc.clean_causal,
        within_block_causal=sc.within_block_causal,
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
    p.add_argument("--rl-flags", default=RL_FLAGS, help=f"train.py flags of the RL run (default: {RL_FLAGS})")
    p.add_argument("--limit", type=int, default=100, help="held-out problems evaluated")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from benchmark.conversion_eval import evaluate, load_heldout

    args.out.mkdir(parents=True, exist_ok=True)
    steps = args.steps
    if steps is None:
        _train(args, args.out / "calibrate", 2)
        records = (args.out / "calibrate" / "metrics.jsonl").read_text().splitlines()
        times = [json.loads(x)["step_time_s"] for x in records]
        steps = max(2, int(args.minutes * 60 / (sum(times) / len(times))))  # the warm-up step included: safer
    wall = _train(args, args.out / "rl", steps)
    heldout = load_heldout(args.heldout, AutoTokenizer.from_pretrained(args.start), args.limit)
    rows = {
        "before": evaluate(args.start, heldout, max_tokens=args.max_tokens, threshold=0.9),
        "after": evaluate(args.out / "rl" / "final", heldout, max_tokens=args.max_tokens, threshold=0.9),
    }
    ratio = rollout_vs_engine(args.out / "rl" / "final", heldout.prompt_ids[:16], args.max_tokens)
    command = "python -m benchmark.rl_demo " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    lines = [
        command,
        f"RL: {steps} steps in {wall:.0f} s; rollout / engine diffusion decode time: {ratio:.2f}x",
        "",
        "| checkpoint | causal accuracy | diffusion accuracy | diffusion tok/fwd | self-spec tok/fwd "
        "| self-spec same as causal |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        c, d, s = row["causal"], row["diffusion"], row["self-spec"]
        lines.append(
            f"| {name} | {c['quality']:.1%} | {d['quality']:.1%} | {d['tokens_per_forward']:.2f} "
            f"| {s['tokens_per_forward']:.2f} | {s['same_as_causal']:.0%} |"
        )
    print("\n".join(lines))
    (args.out / "rl_demo.json").write_text(json.dumps({"command": command, "steps": steps, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
