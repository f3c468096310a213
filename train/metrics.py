"""Rank-0 observability: a progress bar, metrics.jsonl, optional TensorBoard / Weights & Biases."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch

from train.config import FlagError


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak RSS, KiB -> MiB


def _drop_records_after(path: Path, step: int) -> None:
    """Keep metrics.jsonl to one record per step: a run resumed at `step` logs the later steps again
    (a killed run had logged them after its last checkpoint; a fresh run restarts at 0)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if _record_step(line) <= step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)


def _record_step(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")  # a line torn by a kill mid-write belongs to no finished step


class RunLogger:
    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool,
        max_steps: int,
        start_step: int,
        wandb_project: str | None = None,
        tensorboard: bool = False,
        config: dict | None = None,
    ):
        self.enabled = enabled
        self.bar = self.tb = self.wandb = None
        if not enabled:
            return
        from tqdm import tqdm

        self.path = run_dir / "metrics.jsonl"
        _drop_records_after(self.path, start_step)
        # In a terminal the bar redraws often; in a log file (CI, Slurm) it writes a line every 30 s.
        interactive = sys.stderr.isatty()
        self.bar = tqdm(
            total=max_steps,
            initial=start_step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            mininterval=0.2 if interactive else 30.0,
        )
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise FlagError("--tensorboard", "needs the tensorboard package (pip install tensorboard)") from e
            self.tb = SummaryWriter(str(run_dir / "tb"))
        if wandb_project:
            try:
                import wandb
            except ImportError as e:
                raise FlagError("--wandb", "needs the wandb package (pip install wandb)") from e
            self.wandb = wandb.init(project=wandb_project, config=config, dir=str(run_dir))

    def step(self, record: dict | None) -> None:
        """Advance one step; `record` (a log step's metrics) goes to every sink."""
        if not self.enabled:
            return
        self.bar.update(1)
        if record is None:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        shown = dict(
            loss=f"{record['loss']:.4f}",
            diff=f"{record['diff']:.4f}",
            ar=f"{record['ar']:.4f}",
            lr=f"{record['lr']:.2e}",
            tok_s=f"{record['tokens_per_s']:.0f}",
        )
        if "draft_tpf_all" in record:  # the held-out drafting metric (--eval_data)
            shown.update(accept=f"{record['draft_first_accept']:.2f}", tpf=f"{record['draft_tpf_all']:.2f}")
        if "router_aux" in record:  # mixture of experts: the router's load-balancing loss
            shown["aux"] = f"{record['router_aux']:.3f}"
        if "opd_kl" in record:  # on-policy distillation: what the rollouts look like
            shown.update(
                kl=f"{record['opd_kl']:.3f}",
                roll_len=f"{record['rollout_len']:.1f}",
                roll_tpf=f"{record['rollout_tokens_per_forward']:.2f}",
            )
        if "rl_reward" in record:  # RL: rewards and how far the update moved the policy
            shown.update(
                reward=f"{record['rl_reward']:.3f}",
                roll_len=f"{record['rollout_len']:.1f}",
                roll_tpf=f"{record['rollout_tokens_per_forward']:.2f}",
                clip=f"{record['rl_clip_fraction']:.2f}",
            )
            if record.get("rl_kl"):
                shown["kl"] = f"{record['rl_kl']:.4f}"
        self.bar.set_postfix(**shown, refresh=False)
        for key, value in record.items():
            if isinstance(value, (int, float)) and key != "step":
                if self.tb is not None:
                    self.tb.add_scalar(key, value, record["step"])
        if self.wandb is not None:
            self.wandb.log(record, step=record["step"])

    def write(self, msg: str) -> None:
        if self.enabled:
            self.bar.write(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
