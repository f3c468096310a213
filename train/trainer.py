"""The training loop: data -> rows -> FSDP2 block-diffusion SFT -> checkpoints, resumable exactly.

`Trainer(config)` builds everything a run needs (torchtitan style), `train_step()` is one optimizer
step over its micro-batches, `save(name)` one checkpoint, and `train()` the loop around them.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from bdcore.decode.policy.acceptance import DRAFT_QUALITY_NAME
from train.build import build_model, build_rows, build_tokenizer, check_runtime, write_json
from train.checkpoint import check_resume, load_train_state, save_checkpoint, sidecar_for, start_run
from train.config import FlagError, JobConfig
from train.loss import diffusion_weights
from train.metrics import RunLogger, peak_memory_mib
from train.noise import noise_generator
from train.optim import build_optimizer, build_scheduler, fast_forward
from train.packing import RowStream, bucket_length
from train.parallel import all_reduce_sum, init_distributed
from train.recipes import RECIPE_TABLE
from train.single_stream import batch_builder


@dataclass(frozen=True)
class StepResult:
    """One optimizer step; losses are means over ranks, token counts sums over ranks."""

    loss: float
    diff: float
    ar: float
    lr: float  # the lr this step used
    grad_norm: torch.Tensor  # before clipping; a tensor so that steps that log nothing never sync on it
    tokens: float
    diff_tokens: float
    ar_tokens: float
    seconds: float
    extra: dict = field(default_factory=dict)  # on-policy distillation metrics (means over ranks)
    skipped: bool = False  # the loss or gradient norm was not finite: no update was applied


class SupervisedOnly:
    """The step of --recipe sft and --recipe ar_sft: the SFT loss alone (what the rows hold tells them apart).

    A recipe's step object has `sft_weight` (the SFT loss's weight in each step), `loss_metric` (the metric
    its own loss is reported as; None: it has no loss of its own) and `step(lm, step, rank) -> metrics`,
    which backpropagates that loss. None keeps state for a resume: their draws are seeded by (seed, rank,
    step); what a resume must share is their config section's RESUME_MUST_MATCH."""

    sft_weight = 1.0
    loss_metric = None

    def step(self, lm, step: int, rank: int) -> dict[str, float]:
        return {}


class Trainer:
    """One run of block-diffusion SFT on every rank (each rank constructs it and calls `train()`)."""

    def __init__(self, config: JobConfig):
        self.started = time.time()
        self.config = config
        self.info = info = init_distributed()
        check_runtime(config, info)
        self.run_dir = Path(config.checkpoint.save_dir)
        self.resume = check_resume(config)
        schedule_changes = self.resume.schedule_changes if self.resume else {}
        self.run_id = None  # only rank 0 writes the trainer state that records it
        if info.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.run_id = start_run(self.run_dir, self.resume)
            write_json(self.run_dir / "run_config.json", {**config.flags(), "schedule_changes": schedule_changes})

        self.tokens = build_tokenizer(config)
        self.data = build_rows(config, info, self.tokens, self.run_dir)
        self.model, self.save_dtype = build_model(config, info, self.tokens)
        if info.is_main:  # what the benchmarks compare across recipes (full fine-tuning vs adapters)
            params = list(self.model.parameters())
            trainable = sum(p.numel() for p in params if p.requires_grad)
            write_json(
                self.run_dir / "model_info.json",
                {"trainable_params": trainable, "total_params": sum(p.numel() for p in params)},
            )
        optim, training = config.optim, config.training
        self.optimizer = build_optimizer(self.model, lr=optim.lr, weight_decay=optim.weight_decay)
        self.scheduler = build_scheduler(
            self.optimizer, warmup=optim.warmup, max_steps=training.max_steps, min_ratio=optim.lr_min_ratio
        )
        self.stream = RowStream(
            len(self.data.rows),
            seed=training.seed,
            world_size=info.world_size,
            rank=info.rank,
            micro_batch_size=training.micro_batch_size,
        )
        self.step = 0  # optimizer steps done
        self.skipped_steps = 0  # steps whose non-finite loss or gradient norm was never applied
        self.nonfinite_in_a_row = 0
        if self.resume is not None:
            load_train_state(self.resume.checkpoint, self.model, self.optimizer, info)
            self.step, self.stream.position = self.resume.step, self.resume.data_position
            self.skipped_steps = self.resume.skipped_steps
            fast_forward(self.scheduler, self.step)

        self.logger = RunLogger(
            self.run_dir,
            enabled=info.is_main,
            max_steps=training.max_steps,
            start_step=self.step,
            wandb_project=config.logging.wandb,
            tensorboard=config.logging.tensorboard,
            config=config.flags(),
        )
        stats = self.data.stats
        self.logger.write(
            f"{len(self.data.rows)} rows from {stats.kept}/{stats.records} records "
            f"(skipped: {dict(stats.skipped) or 'none'}); world size {info.world_size}, device {info.device}"
        )
        for warning in self.resume.warnings if self.resume else ():
            self.logger.write(f"warning: {warning}")
        if schedule_changes:
            self.logger.write(
                f"warning: --resume {self.resume.checkpoint}: the lr schedule changes from step {self.step}: "
                f"{schedule_changes}"
            )
        self._router_aux: float | None = None  # the last SFT step's mean router load-balancing loss (MoE)
        try:
            self.recipe = self._build_recipe(config, info)
            self.eval = None
            self.last_eval: dict | None = None  # the latest drafting figures, written into each checkpoint
            if config.evaluation.eval_data:
                from train.evaluation import DraftEval

                self.eval = DraftEval(config, self.tokens)
        except BaseException:  # a refusal is then the last line the user sees, after the progress bar
            self.logger.close()
            raise
        self.offload = (
            torch.autograd.graph.save_on_cpu(pin_memory=True)
            if config.efficiency.activation_offload
            else contextlib.nullcontext()
        )

    def _build_recipe(self, config: JobConfig, info):
        """The step of the run's --recipe: the one place a recipe's name becomes the object the loop runs."""
        recipe = config.training.recipe
        if recipe in ("sft", "ar_sft"):  # the rows tell the two apart (config.diffusion.views)
            return SupervisedOnly()
        samples = [s for row in self.data.rows for s in row]  # the prompts and references of the rollouts
        if recipe == "opd":
            from train.opd_trainer import OnPolicyDistiller

            rows = self.model.model.get_output_embeddings().weight.shape[0]
            return OnPolicyDistiller(config, self.tokens, samples, info, rows)
        if recipe != "rl":
            raise ValueError(f"recipe {recipe!r}: no step for it (train/recipes.py lists {list(RECIPE_TABLE)})")
        from train.build import compute_dtype
        from train.rl_trainer import DiffusionRL, load_reference

        special, reference = self.tokens.special, None
        if config.rl.rl_kl_weight > 0:
            dtype = compute_dtype(config, info) or torch.float32
            reference = load_reference(config, special.mask_id, self.tokens.num_real, info.device, dtype)
        rl = DiffusionRL(config, self.tokens.tokenizer, special.mask_id, special.filler_id, samples, reference)
        if rl.unreadable:
            why = next(iter(rl.unreadable.values()))
            self.logger.write(
                f"warning: --rl_reward {config.rl.rl_reward} cannot score {len(rl.unreadable)} of "
                f"{len(samples)} references ({why}); RL never draws those samples"
            )
        return rl

    def train_step(self) -> StepResult:
        """Optimizer step `self.step`: the SFT loss over `grad_accum` micro-batches (at the recipe's SFT weight),
        then the recipe's own step (OPD, RL); advances `self.step`."""
        t0 = time.perf_counter()
        recipe = self.recipe
        sums = torch.zeros(3, dtype=torch.float64, device=self.info.device)
        counts = (0.0, 0.0, 0.0)
        if recipe.sft_weight > 0:
            counts = self._sft_backward(sums, recipe.sft_weight, sync_last=recipe.loss_metric is None)
        extra = {"router_aux": self._router_aux} if recipe.sft_weight > 0 and self._router_aux is not None else {}
        if recipe.loss_metric is not None:  # its own forwards and backward, after the SFT micro-batches
            self.model.set_requires_gradient_sync(True)
            extra.update(recipe.step(self.model, self.step, self.info.rank))
            sums[0] += extra[recipe.loss_metric]
        if extra:
            extra = self._mean_over_ranks(extra)
        clip = self.config.optim.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf"))
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        lr = self.optimizer.param_groups[0]["lr"]
        dist.all_reduce(sums)
        loss, diff, ar = (sums / self.info.world_size).tolist()
        # Every rank sees the same global loss and norm, so all skip together. A non-finite step never
        # reaches the optimizer: one NaN in Adam's moments would make every later weight NaN.
        finite = math.isfinite(loss) and bool(torch.isfinite(norm))
        if finite:
            self.optimizer.step()
            self.nonfinite_in_a_row = 0
        else:
            self.skipped_steps += 1
            self.nonfinite_in_a_row += 1
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        n_tokens, n_diff, a_norm = counts
        return StepResult(
            loss, diff, ar, lr, norm, n_tokens, n_diff, a_norm, time.perf_counter() - t0, extra, skipped=not finite
        )

    def _on_nonfinite(self, result: StepResult) -> None:
        """A skipped step is a warning line; --max_nonfinite_steps of them in a row stop the run."""
        patience = self.config.optim.max_nonfinite_steps
        what = f"step {self.step}: loss {result.loss}, grad_norm {float(result.grad_norm)}"
        if self.nonfinite_in_a_row >= patience:
            raise FlagError(
                f"step {self.step}",
                f"{self.nonfinite_in_a_row} steps in a row had a non-finite loss or gradient norm "
                f"(--max_nonfinite_steps {patience}; last: {what}); no update was applied and nothing was saved "
                "after them; lower --lr or --grad_clip, check the data and --rl_reward, then --resume from the last "
                "checkpoint",
            )
        self.logger.write(f"warning: {what}: non-finite, the update was skipped ({self.skipped_steps} so far)")

    def _mean_over_ranks(self, metrics: dict[str, float]) -> dict[str, float]:
        keys = sorted(metrics)
        values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=self.info.device)
        dist.all_reduce(values)
        return dict(zip(keys, (values / self.info.world_size).tolist()))

    def _sft_backward(self, sums: torch.Tensor, weight: float, *, sync_last: bool) -> tuple[float, float, float]:
        """The two-stream SFT loss of this step's micro-batches, scaled by `weight`, backpropagated; adds
        (loss, diff, ar) to `sums`; returns the global (tokens, diffusion targets, AR targets)."""
        info, diffusion = self.info, self.config.diffusion
        rows, row_lengths = self.data.rows, self.data.lengths
        batches, build = [], batch_builder(diffusion)
        for micro in range(self.config.training.grad_accum):
            ids_now = self.stream.next_micro_batch()
            length = bucket_length(max(row_lengths[i] for i in ids_now), self.config.data.length_buckets)
            gen = noise_generator(self.config.training.seed, info.rank, self.step, micro)
            batches.append(build([rows[i] for i in ids_now], diffusion, self.tokens.special, gen, row_length=length))
        # The loss is normalised by the supervised tokens of the whole global batch, so every rank needs the totals.
        local = [
            sum(float(diffusion_weights(b.diff_rate, diffusion, b.diff_offset).sum()) for b in batches),
            sum(b.ar_index.numel() for b in batches),
            sum(b.diff_index.numel() for b in batches),
            sum(b.num_real_tokens for b in batches),
        ]
        d_norm, a_norm, n_diff, n_tokens = all_reduce_sum(local, info.device)
        world = info.world_size
        aux = []
        for micro, batch in enumerate(batches):
            self.model.set_requires_gradient_sync(sync_last and micro == len(batches) - 1)
            with self.offload:
                parts = self.model(
                    batch.to(info.device), diff_norm=d_norm / world, ar_norm=a_norm / world, aux_weight=1 / len(batches)
                )
                (parts.loss * weight if weight != 1.0 else parts.loss).backward()
            sums += torch.stack([parts.loss.detach() * weight, parts.diff, parts.ar]).double()
            if parts.aux is not None:
                aux.append(float(parts.aux))
        self._router_aux = sum(aux) / len(aux) if aux else None  # mixture of experts: mean over micro-batches
        return n_tokens, n_diff, a_norm

    def metrics_record(self, result: StepResult) -> dict:
        """The metrics.jsonl record of the step just taken."""
        dt = result.seconds
        return {
            "step": self.step,
            "loss": result.loss,
            "diff": result.diff,
            "ar": result.ar,
            "lr": result.lr,
            "grad_norm": float(result.grad_norm),
            "tokens_per_s": result.tokens / dt,
            "supervised_tokens_per_s": (result.diff_tokens + result.ar_tokens) / dt,
            "diff_tokens": int(result.diff_tokens),
            "ar_tokens": int(result.ar_tokens),
            "epoch": self.stream.epoch,
            "peak_mem_mib": peak_memory_mib(self.info.device),
            "step_time_s": dt,
            "skipped_steps": self.skipped_steps,
            **result.extra,
        }

    def save(self, name: str) -> Path:
        """Checkpoint `save_dir/name` at `self.step` (collective: every rank calls it)."""
        state = {
            "step": self.step,
            "data_position": self.stream.position,
            "skipped_steps": self.skipped_steps,
            "config": self.config.resume_flags(),
            "run_id": self.run_id,
        }
        path = save_checkpoint(
            self.run_dir,
            name,
            model=self.model,
            optimizer=self.optimizer,
            tokenizer=self.tokens.tokenizer,
            info=self.info,
            sidecar=sidecar_for(self.config, self.tokens.special.mask_id, self.step),
            trainer_state=state,
            save_dtype=self.save_dtype,
        )
        if self.last_eval is not None and self.info.is_main:  # the serving engine's acceptance prior
            write_json(path / DRAFT_QUALITY_NAME, self.last_eval)
        self.logger.write(f"saved {path}")
        return path

    def train(self) -> dict:
        """Steps to --max_steps, logging every --log_every and saving every --save_every; then final/.
        Returns the summary also written to summary.json (final losses, steps, wall time since construction)."""
        max_steps, save_every = self.config.training.max_steps, self.config.checkpoint.save_every
        losses = []
        try:
            while self.step < max_steps:
                result = self.train_step()
                losses.append(result.loss)
                done = self.step
                evaluate = self.eval is not None and self.eval.due(done, max_steps)
                log = done % self.config.logging.log_every == 0 or done == max_steps or result.skipped or evaluate
                record = self.metrics_record(result) if log else None
                if evaluate:
                    record.update(self.eval(self.model))
                    keys = ("draft_first_accept", "draft_mean_accepted", "draft_tpf_linear", "draft_tpf_all")
                    self.last_eval = {k: record[k] for k in keys} | {"draft_len": self.eval.bd_size, "step": done}
                self.logger.step(record)
                if result.skipped:
                    self._on_nonfinite(result)
                if save_every and done % save_every == 0 and done != max_steps:
                    self.save(f"step_{done}")
            self.save("final")
        finally:  # an error is then the last line the user sees, after the progress bar
            self.logger.close()
        summary = {
            "steps": max_steps,
            "final_loss": losses[-1] if losses else None,
            "losses": losses,
            "wall_s": time.time() - self.started,
            "checkpoint": str(self.run_dir / "final"),
        }
        if self.info.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary


def run(config: JobConfig) -> dict:
    """Build and train; returns the summary. Every rank calls it."""
    return Trainer(config).train()
