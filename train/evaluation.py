"""The held-out drafting metric inside the trainer (`--eval_data`, every `--eval_every` steps).

The same figures as `python -m benchmark.draft_quality` (`bdcore/decode/policy/draft_quality.py`), on the student
as the server would run it (`train.rollout.decoding`): a canvas at every position of each held-out answer,
greedy acceptance against the AR head, the self-spec walk it implies and the AR head's held-out loss.
Every rank scores every answer (the same forwards on every rank, as FSDP2's all-gathers need), so the
figures are the same on all of them.
"""

from __future__ import annotations

import time

from bdcore.decode.canvas_fill import CanvasFill
from bdcore.decode.policy.draft_quality import draft_quality
from bdcore.decode.runner import ModelRunner
from train.config import FlagError, JobConfig
from train.data import DataError, heldout_answers
from train.rollout import decoding, student_capabilities


class DraftEval:
    def __init__(self, config: JobConfig, tokens):
        """`tokens`: the run's `train.build.TokenizerParts` (the eval answers are rendered as the rows are)."""
        ev = config.evaluation
        self.every, self.bd_size, self.mask_id = ev.eval_every, config.diffusion.bd_size, tokens.special.mask_id
        noise = config.diffusion.canvas_fill == "noise"  # canvases as the run's rows fill them
        self.fill = CanvasFill(self.mask_id, noise_vocab=tokens.special.noise_vocab if noise else None)
        try:
            self.samples = heldout_answers(ev.eval_data, tokens.tokenizer, tokens.end_of_turn, limit=ev.eval_samples)
        except DataError as e:
            raise FlagError("--eval_data", str(e).split(": ", 1)[1]) from e

    def due(self, step: int, max_steps: int) -> bool:
        return step == max_steps or (self.every > 0 and step % self.every == 0)

    def __call__(self, lm) -> dict[str, float]:
        t0 = time.perf_counter()
        caps = student_capabilities(lm.cfg, mask_id=self.mask_id, stop_ids=frozenset())
        with decoding(lm) as model:
            runner = ModelRunner.for_checkpoint(model, caps)
            quality = draft_quality(runner, self.samples, mask_id=self.mask_id, draft_len=self.bd_size, fill=self.fill)
        return {**quality.summary(), "t_eval_s": time.perf_counter() - t0}
