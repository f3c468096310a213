"""One RL step inside the trainer (`train.py --recipe rl`, or `--rl_diffusion_rollout`): GRPO/DAPO on the
student's rollouts (diffusion by default; self-spec or causal with `--rl_rollout_mode`).

Every `--rl_updates_per_batch` optimizer steps each rank draws `--rl_prompts_per_step` prompts (a
generator seeded by seed, rank and step, so a resumed run draws what the uninterrupted run drew), the
student rolls each out `--rl_group_size` times with the serving engine's decoding (`--rl_rollout_mode`,
diffusion by default; sampled at `--rl_temperature`), the answers are scored against the dataset's
references (`train/rewards.py`), and
the group-normalised advantages and the old policy's log-probabilities are fixed for the batch. Each
optimizer step of the batch then backpropagates the clipped surrogate (`train/grpo.py`) through the
student's training forward. Old and new log-probabilities come from the same function
(`train.trajectory.trajectory_logprobs`), so the first update of a batch sees a ratio of exactly 1.

Ranks stay in lockstep: every rank runs the same forwards (rollouts are synchronised; a rank whose groups
dynamic sampling dropped entirely still scores its first group, with zero advantages).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from bdcore.decode.config import DecodeConfig
from bdcore.decode.sampling import SamplingParams
from bdcore.tokens import stop_ids
from train.config import FlagError, JobConfig
from train.grpo import global_norm, policy_loss, select_rollouts
from train.noise import noise_generator
from train.opd import prompt_of
from train.rewards import checked_reward, load_reward, unreadable_references
from train.rollout import Rollout, student_rollouts
from train.rows import Sample
from train.trajectory import trajectory_logprobs

RL_STREAM = 1 << 21  # micro-step slot of the RL draws in `noise_generator`, apart from SFT and OPD


@dataclass
class RolloutBatch:
    rollouts: list[Rollout]  # the scored ones (dynamic sampling may have dropped groups)
    advantages: torch.Tensor
    old_logp: list[torch.Tensor]
    ref_logp: list[torch.Tensor] | None
    metrics: dict[str, float]


def reference_text(sample: Sample, tokenizer) -> str:
    """The text of a sample's last supervised answer, without its end-of-turn token."""
    start, end = sample.spans[-1]
    return tokenizer.decode(list(sample.input_ids[start : end - 1]), skip_special_tokens=True)


def load_reference(config: JobConfig, mask_id: int, num_real: int | None, device: torch.device, dtype):
    """The frozen starting policy for the KL term: `--model_id` as the run loaded it (the `<|mask|>` row
    initialised the same way), unsharded on every rank, in the student's compute dtype."""
    from transformers import AutoModelForCausalLM

    from train.model import TwoStreamLM
    from train.special_tokens import init_mask_rows

    model = AutoModelForCausalLM.from_pretrained(
        config.model.model_id,
        dtype=torch.float32,
        attn_implementation="sdpa",
        trust_remote_code=config.model.trust_remote_code,
    )
    if num_real is not None:
        init_mask_rows(model, mask_id, num_real)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return TwoStreamLM(model, config.diffusion, cpu_block_sparse=False)


class DiffusionRL:
    """The step of `--recipe rl` (the trainer's recipe-step interface: `train.trainer.SupervisedOnly`). Its one
    piece of state, the current rollout batch, is not saved: a resume starts at a batch boundary."""

    loss_metric = "rl_loss"

    def __init__(self, config: JobConfig, tokenizer, mask_id: int, filler_id: int, samples: list[Sample], reference):
        """`reference`: the frozen starting policy as a `TwoStreamLM` for the KL term, or None."""
        self.config, self.rl = config, config.rl
        self.sft_weight = self.rl.rl_sft_weight
        self.tokenizer, self.mask_id, self.filler_id = tokenizer, mask_id, filler_id
        self.stop_ids = stop_ids(tokenizer)
        references = [reference_text(s, tokenizer) for s in samples]
        self.unreadable = unreadable_references(self.rl.rl_reward, references)
        if len(self.unreadable) == len(samples):
            i, why = next(iter(self.unreadable.items()))
            raise FlagError(
                "--rl_reward",
                f"{self.rl.rl_reward} can score none of the {len(samples)} references of --dataset (e.g. sample {i}: "
                f"{why}: {references[i][:60]!r}); use a reward that reads these answers, or data it can score",
            )
        usable = [i for i in range(len(samples)) if i not in self.unreadable]  # never paid for: never drawn
        self.prompts = [prompt_of(samples[i]) for i in usable]
        self.references = [references[i] for i in usable]
        self.reward = load_reward(self.rl.rl_reward)
        self.reference = reference
        self.decode = DecodeConfig(mode=self.rl.rl_rollout_mode, threshold=self.rl.rl_threshold)
        self.params = SamplingParams(temperature=self.rl.rl_temperature, max_tokens=self.rl.rl_max_new_tokens)
        self.batch: RolloutBatch | None = None

    def step(self, lm, step: int, rank: int) -> dict[str, float]:
        """One policy update (a new rollout batch first, every `rl_updates_per_batch` steps); this rank's
        metrics."""
        updates = self.rl.rl_updates_per_batch
        if step % updates == 0:
            self.batch = self._rollout_batch(lm, step, rank)
        elif self.batch is None:
            raise RuntimeError(
                f"step {step} lies inside a rollout batch of {updates} updates whose rollouts are gone (a resume "
                "from a checkpoint saved mid-batch); save and resume at multiples of --rl_updates_per_batch"
            )
        b = self.batch
        t0 = time.perf_counter()
        new_logp = trajectory_logprobs(lm, b.rollouts, mask_id=self.mask_id, filler_id=self.filler_id)
        token_level = self.rl.rl_token_level
        parts = policy_loss(
            new_logp,
            b.old_logp,
            b.advantages,
            clip_low=self.rl.rl_clip_low,
            clip_high=self.rl.rl_clip_high,
            token_level=token_level,
            ref_logp=b.ref_logp,
            kl_weight=self.rl.rl_kl_weight,
            norm=global_norm(new_logp, token_level=token_level),
        )
        parts.loss.backward()
        return {
            **b.metrics,
            "rl_loss": float(parts.loss.detach()),
            "rl_kl": float(parts.kl),
            "rl_clip_fraction": parts.clip_fraction,
            "rl_ratio": parts.ratio_mean,
            "t_update_s": time.perf_counter() - t0,
        }

    def _rollout_batch(self, lm, step: int, rank: int) -> RolloutBatch:
        rl, n = self.rl, self.rl.rl_group_size
        gen = noise_generator(self.config.training.seed, rank, step, RL_STREAM)
        picks = torch.randint(len(self.prompts), (rl.rl_prompts_per_step,), generator=gen).tolist()
        seed = int(torch.randint(1 << 30, (), generator=gen))
        t0 = time.perf_counter()
        prompts = [self.prompts[i] for i in picks for _ in range(n)]
        rollouts = student_rollouts(
            lm, prompts, mask_id=self.mask_id, stop_ids=self.stop_ids, decode=self.decode, params=self.params, seed=seed
        )
        t1 = time.perf_counter()
        refs = [self.references[i] for i in picks for _ in range(n)]
        texts = [self.tokenizer.decode(r.tokens, skip_special_tokens=True) for r in rollouts]
        name = self.rl.rl_reward
        rewards = torch.tensor([checked_reward(name, self.reward, t, ref) for t, ref in zip(texts, refs)])
        keep, advantages, groups_kept = select_rollouts(rewards, n, dynamic=rl.rl_dynamic_sampling)
        kept = [r for r, k in zip(rollouts, keep.tolist()) if k]
        with torch.no_grad():
            old = trajectory_logprobs(lm, kept, mask_id=self.mask_id, filler_id=self.filler_id)
            ref = None
            if self.reference is not None:
                ref = trajectory_logprobs(self.reference, kept, mask_id=self.mask_id, filler_id=self.filler_id)
        generated = sum(r.stats.generated for r in rollouts)
        metrics = {
            "rl_reward": float(rewards.mean()),
            "rl_solved": float((rewards >= 1.0).float().mean()),
            "rl_groups_kept": groups_kept,
            "rollout_len": generated / len(rollouts),
            "rollout_tokens_per_forward": generated / max(1, sum(r.stats.forwards for r in rollouts)),
            "t_rollout_s": t1 - t0,
        }
        return RolloutBatch(kept, advantages, [x.detach() for x in old], ref, metrics)
