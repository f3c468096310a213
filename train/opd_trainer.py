"""One on-policy distillation step inside the trainer (`train.py --recipe opd`, or `--opd_on_policy`).

With `--opd_rollout self-spec` the step is Draft-OPD instead (`train/draft_opd.py`): the rollouts are the
served self-spec decoder's, the targets the verifier's rows of the same forward.

Per optimizer step each rank draws `--opd_prompts_per_step` prompts (a generator seeded by seed, rank
and step, so a resumed run draws what the uninterrupted run drew), the student rolls them out with
the serving engine's diffusion decoding, the frozen teacher scores the answers, and the OPD loss
(`train/opd.py`) is backpropagated through the student's training forward. The teacher is a plain
frozen copy on every rank (not sharded); with a draft-only adapter (`--draft_adapter`) and no
`--opd_teacher`, it is the student's own clean stream, which is the frozen base model bit for bit.
"""

from __future__ import annotations

import time

import torch

from bdcore.decode.config import DecodeConfig
from bdcore.decode.runner import ModelRunner
from bdcore.decode.sampling import SamplingParams
from bdcore.loading import CheckpointError, load_weights
from bdcore.tokens import MASK_TOKEN, stop_ids
from train.build import compute_dtype
from train.config import FlagError, JobConfig
from train.draft_opd import draft_opd_loss, walked_rollouts
from train.noise import noise_generator
from train.opd import choose_states, opd_loss, prompt_of, teacher_logprobs
from train.rollout import decoding, student_capabilities, student_rollouts
from train.rows import Sample

OPD_STREAM = 1 << 20  # micro-step slot of the OPD draws in `noise_generator`, apart from the SFT micro-steps


def load_teacher(path: str, device: torch.device, dtype: torch.dtype):
    try:
        teacher = load_weights(path, dtype=dtype, attn_implementation="sdpa")
    except CheckpointError as e:
        raise FlagError("--opd_teacher", str(e)) from e
    return teacher.to(device).eval().requires_grad_(False)


def check_teacher_vocab(teacher, path: str, tokenizer, student_rows: int) -> None:
    """The teacher must score the student's tokens by the same ids: its output rows cover every real id of
    the student's tokenizer and are no more than the student's `student_rows`, and its own tokenizer (when
    the directory has one) maps every token to the same id (`<|mask|>` aside). Else the KL compares
    unrelated tokens, or fails at the first step on a tensor size."""
    from transformers import AutoTokenizer

    fix = "distil from a teacher of the student's tokenizer, e.g. the model --model_id was trained from"
    student = {t: i for t, i in tokenizer.get_vocab().items() if t != MASK_TOKEN}
    real = max(student.values()) + 1
    width = teacher.get_output_embeddings().weight.shape[0]
    if width < real:
        raise FlagError("--opd_teacher", f"{path} scores {width} token ids, the student's tokenizer has {real}; {fix}")
    if width > student_rows:
        raise FlagError(
            "--opd_teacher", f"{path} scores {width} token ids, more than the student's {student_rows}; {fix}"
        )
    try:
        theirs = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):  # a weights-only directory: the width check is all there is to go on
        return
    theirs = {t: i for t, i in theirs.get_vocab().items() if t != MASK_TOKEN}
    odd = sorted(t for t in set(student) | set(theirs) if student.get(t) != theirs.get(t))
    if odd:
        example = odd[0]
        raise FlagError(
            "--opd_teacher",
            f"{path}'s tokenizer differs from the student's in {len(odd)} tokens (e.g. {example!r}: id "
            f"{theirs.get(example)} in the teacher, {student.get(example)} in the student); {fix}",
        )


class OnPolicyDistiller:
    """The step of `--recipe opd` (the trainer's recipe-step interface: `train.trainer.SupervisedOnly`)."""

    loss_metric = "opd_loss"

    def __init__(self, config: JobConfig, tokens, samples: list[Sample], info, student_rows: int):
        """`tokens`: the run's `train.build.TokenizerParts`; `student_rows`: the student's output rows."""
        self.config, self.opd = config, config.opd
        self.sft_weight = self.opd.opd_sft_weight
        self.mask_id, self.filler_id = tokens.special.mask_id, tokens.special.filler_id
        self.stop_ids = stop_ids(tokens.tokenizer)
        self.samples = samples
        self.prompts = [prompt_of(s) for s in samples]
        dtype = compute_dtype(config, info) or torch.float32  # the student's compute dtype
        self.teacher = None  # a draft adapter's clean stream is the base model: the teacher comes free
        if self.opd.opd_teacher or not config.lora.draft_adapter:
            path = self.opd.opd_teacher or config.model.model_id
            self.teacher = load_teacher(path, info.device, dtype)
            check_teacher_vocab(self.teacher, path, tokens.tokenizer, student_rows)
        self.draft_opd = self.opd.opd_rollout == "self-spec"
        if self.draft_opd:  # the drafts are judged by the AR head: the verifier is the clean stream itself
            self.decode = DecodeConfig(mode="self-spec")
        else:
            self.decode = DecodeConfig(mode="diffusion", threshold=self.opd.opd_threshold)
        self.params = SamplingParams(temperature=self.opd.opd_temperature, max_tokens=self.opd.opd_max_new_tokens)

    def step(self, lm, step: int, rank: int) -> dict[str, float]:
        """Rollouts, teacher, loss and backward for one optimizer step; returns this rank's metrics."""
        gen = noise_generator(self.config.training.seed, rank, step, OPD_STREAM)
        picks = torch.randint(len(self.prompts), (self.opd.opd_prompts_per_step,), generator=gen).tolist()
        t0 = time.perf_counter()
        seed = int(torch.randint(1 << 30, (), generator=gen))
        if self.draft_opd and self.opd.opd_draft_states == "walk":
            rollouts = self._walk(lm, [self.samples[i] for i in picks])
        else:
            rollouts = self._rollouts(lm, [self.prompts[i] for i in picks], seed)
        t1 = time.perf_counter()
        teacher_logp = None
        if self.teacher is not None:
            teacher_logp = teacher_logprobs(self.teacher, rollouts, mask_id=self.mask_id)
        t2 = time.perf_counter()
        timing = {"t_rollout_s": t1 - t0, "t_teacher_s": t2 - t1}
        if self.draft_opd:
            return {**self._draft_step(lm, rollouts, teacher_logp), **timing, "t_student_s": time.perf_counter() - t2}
        chosen = [choose_states(r, self.opd.opd_states_per_block, gen) for r in rollouts]
        parts = opd_loss(
            lm,
            chosen,
            teacher_logp,
            mask_id=self.mask_id,
            filler_id=self.filler_id,
            ar_weight=self.opd.opd_ar_weight,
            slots=self.opd.opd_slots,
        )
        parts.loss.backward()
        t3 = time.perf_counter()
        generated = sum(r.stats.generated for r in rollouts)
        agree = sum(
            int((lp.argmax(-1).cpu() == torch.tensor(r.response)).sum()) for r, lp in zip(rollouts, parts.teacher_logp)
        )
        return {
            "opd_loss": float(parts.loss.detach()),
            "opd_kl": float(parts.kl),
            "opd_ar_kl": float(parts.ar_kl),
            "opd_kl_tokens": parts.kl_tokens,
            "rollout_len": generated / len(rollouts),
            "rollout_tokens_per_forward": generated / max(1, sum(r.stats.forwards for r in rollouts)),
            # answer tokens the teacher would have picked: a proxy for self-spec acceptance
            "teacher_agreement": agree / max(1, sum(len(r.response) for r in rollouts)),
            **timing,
            "t_student_s": t3 - t2,
        }

    def _rollouts(self, lm, prompts: list[list[int]], seed: int):
        return student_rollouts(
            lm,
            prompts,
            mask_id=self.mask_id,
            stop_ids=self.stop_ids,
            decode=self.decode,
            params=self.params,
            seed=seed,
        )

    def _walk(self, lm, samples: list[Sample]):
        """Draft-OPD's verifies walked along the samples' answers (`train.draft_opd.walked_rollouts`)."""
        caps = student_capabilities(lm.cfg, mask_id=self.mask_id, stop_ids=self.stop_ids)
        with decoding(lm) as model:
            runner = ModelRunner.for_checkpoint(model, caps)
            return walked_rollouts(runner, samples, mask_id=self.mask_id, draft_len=lm.cfg.bd_size)

    def _draft_step(self, lm, rollouts, teacher_logp) -> dict[str, float]:
        """Draft-OPD (`train/draft_opd.py`) on self-spec rollouts: loss, backward and its metrics."""
        parts = draft_opd_loss(
            lm,
            rollouts,
            mask_id=self.mask_id,
            filler_id=self.filler_id,
            reject_weight=self.opd.opd_reject_weight,
            teacher_logp=teacher_logp,
            ar_weight=self.opd.opd_ar_weight,
        )
        parts.loss.backward()
        verdicts = [v for r in rollouts for v in r.verdicts]
        generated = sum(len(r.response) for r in rollouts)
        # forwards: decoded, as counted; walked, the prefill, each verify and the cold step after a rejection
        forwards = sum(r.stats.forwards for r in rollouts) or sum(
            1 + len(r.verdicts) + sum(v.accepted < v.verified for v in r.verdicts[:-1]) for r in rollouts
        )
        return {
            "opd_loss": float(parts.loss.detach()),
            "opd_kl": float(parts.kl),
            "opd_reverse_kl": float(parts.reverse_kl),
            "opd_ar_kl": float(parts.ar_kl),
            "opd_kl_tokens": parts.accepted_slots + parts.rejected_slots,
            "rollout_len": generated / len(rollouts),
            "rollout_tokens_per_forward": generated / max(1, forwards),
            # what the served decoder got from these drafts: accepted drafts per verify, plus the AR token
            "acceptance_length": 1 + sum(v.accepted for v in verdicts) / max(1, len(verdicts)),
        }
