"""vLLM 0.33's diffusion step accounting around `sampler.RequestDecoder` (vLLM-free: torch + bdcore).

What vLLM 0.33 does with a diffusion model (`ModelConfig.is_diffusion`), read from its source
(README.md, "The step contract"):
- the prefill schedules the prompt and gives it no logit rows (`num_new_sampled_tokens_per_step = 0`);
- every later step schedules exactly `canvas_length` draft tokens, read from the worker's
  `req_states.draft_tokens` (which the sampler writes), at the positions after the computed tokens,
  and every one of them gets a row of logits;
- the sampler reports G tokens (`num_sampled`) and `num_rejected` = scheduled - G: both the scheduler
  (`num_rejected = drafts - len(generated)`) and the worker (`computed += query_len - num_rejected`)
  keep the KV of the first G scheduled rows, and take the G tokens to be what those rows held.

So a vLLM step can only keep the KV of rows it reports as output, in order. Our forwards fit that: a
self-spec step keeps [pending, accepted drafts], a diffusion commit keeps the decided block, a denoise
forward keeps nothing. What the decoder emits beyond the kept rows (self-spec's correction token; a
block decided by a denoise step) is owed to vLLM and reported with the forward that computes it (the next
step's first rows), or at once when the request finishes. The prompt's last row (the first AR token, the
diffusion seed) has no logits under vLLM: the model computes that row itself (`model.py`), and a prefill
reads only that row (bdcore's decoders read `logits[prompt_len - 1]` of a prefill; the tests pin it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bdcore.decode.sampling import SamplingParams, ban
from inference.vllm_backend.masks import AttentionSpec, NotExpressible
from inference.vllm_backend.sampler import RequestDecoder, Step
from inference.vllm_backend.settings import VllmDecodeSettings


@dataclass(frozen=True)
class Emission:
    """One request's sampler output in a vLLM step."""

    tokens: list[int]  # vLLM's sampled tokens (num_sampled = len(tokens))
    rejected: int  # scheduled rows whose KV vLLM drops (num_rejected)


class CanvasRequest:
    """One request under vLLM's diffusion accounting: `prefill`, then `step` once per vLLM step, whose
    drafts (`drafts()`) and attention (`attention`) were planned at the end of the step before."""

    def __init__(self, settings: VllmDecodeSettings, prompt_ids: list[int], params: SamplingParams, generator):
        self.settings = settings
        self.prompt_len = len(prompt_ids)
        self.req = RequestDecoder(settings, prompt_ids, params, generator)
        self.owed: list[int] = []  # output the decoder produced that vLLM has not been told
        self.planned: Step | None = None  # the next forward; vLLM schedules its rows as drafts
        self.ended = False  # the answer is complete: every later step reports an end-of-turn

    @property
    def finished(self) -> bool:
        return self.req.finished

    def prefill(self, last_row: torch.Tensor) -> Emission:
        """The prompt's forward, from its last row's logits [V] alone (vLLM gives a diffusion prefill none)."""
        if self.planned is not None:
            raise RuntimeError("vLLM prefilled a request twice (preempted?): the plugin cannot resume a decode")
        step = self.req.next_step()
        if step.start != 0 or len(step.tokens) != self.prompt_len or step.attention != AttentionSpec(True, ()):
            raise NotExpressible("the decoder's first forward is not a plain causal prefill of the prompt")
        # A prefill decodes from its last row only; the other rows are that row's view (no copy).
        logits = ban(last_row.reshape(1, -1), self.settings.mask_id).expand(self.prompt_len, -1)
        return self._after(self.req.take(logits), step, kept=0)

    def drafts(self) -> list[int]:
        """The planned forward's rows, padded with masks to vLLM's draft width. Padding rows come last,
        causal and outside every bidirectional range, so no real row sees them; their KV is rolled back."""
        tokens = self._planned().tokens
        width = self.settings.canvas_length
        if len(tokens) > width:
            raise NotExpressible(f"a forward of {len(tokens)} rows is wider than vLLM's canvas_length {width}")
        return tokens + [self.settings.mask_id] * (width - len(tokens))

    @property
    def attention(self) -> AttentionSpec:
        return self._planned().attention

    def step(self, logits: torch.Tensor, computed: int) -> Emission:
        """One vLLM step: `logits` [scheduled drafts, V], `computed` = vLLM's computed tokens before it."""
        if self.ended:  # vLLM did not stop where the decoder did: end-of-turn is a vLLM stop (command.py)
            return Emission([self.settings.end_of_turn_id], logits.shape[0])
        step = self._planned()
        if computed != step.start:
            raise RuntimeError(
                f"vLLM computed {computed} tokens of this request, the plugin planned its forward at {step.start}: "
                "the KV accounting is out of step (async scheduling, prefix caching or preemption?)"
            )
        if logits.shape[0] < len(step.tokens):  # max_model_len cut the drafts short: the answer ends here
            return self._end(list(self.owed) + [self.settings.end_of_turn_id], logits.shape[0])
        n = len(step.tokens)
        return self._after(self.req.take(ban(logits[:n], self.settings.mask_id)), step, kept=logits.shape[0])

    def _after(self, result, step: Step, *, kept: int) -> Emission:
        """Report what vLLM may keep. `kept`: the step's scheduled rows (0 for the prefill, whose KV vLLM
        keeps whatever the sampler says)."""
        self.owed += result.emitted
        self.planned = None
        if result.finished:  # all of it, now: vLLM ends the request at its stop token or max_tokens
            return self._end(self.owed, max(kept - len(self.owed), 0))
        keep = result.computed - step.start if kept else 0
        tokens, self.owed = self.owed[:keep], self.owed[keep:]
        if tokens != step.tokens[:keep]:
            raise RuntimeError(f"internal: vLLM would keep the KV of rows {step.tokens[:keep]} as the output {tokens}")
        self.planned = self.req.next_step()
        return Emission(tokens, kept - keep)

    def _end(self, tokens: list[int], rejected: int) -> Emission:
        self.owed, self.planned, self.ended = [], None, True
        return Emission(tokens, rejected)

    def _planned(self) -> Step:
        if self.planned is None:
            raise RuntimeError("vLLM scheduled a request the plugin never prefilled")
        return self.planned


@dataclass(frozen=True)
class BatchRow:
    """One request of a vLLM step (`InputBatch`, in batch order), as the glue needs it."""

    req_id: str
    num_logits: int  # its rows of logits (its scheduled drafts; 0 for a prefill)
    computed: int  # vLLM's computed tokens before the step
    prefill_done: bool  # its prompt completes in this step


class StepGlue:
    """All requests of one vLLM worker: `model.py`'s ModelState and sampler are a thin shell around it."""

    def __init__(self, settings: VllmDecodeSettings):
        self.settings = settings
        self.requests: dict[str, CanvasRequest] = {}

    def add(self, req_id: str, prompt_ids: list[int], params: SamplingParams, generator) -> None:
        self.requests[req_id] = CanvasRequest(self.settings, list(prompt_ids), params, generator)

    def remove(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def prefill_rows(self, rows: list[BatchRow], query_end: list[int]) -> list[int]:
        """Hidden-state rows whose logits the model must compute itself: each completing prompt's last."""
        return [query_end[i] - 1 for i, r in enumerate(rows) if self._prefills(r)]

    def _prefills(self, r: BatchRow) -> bool:
        return r.prefill_done and r.num_logits == 0 and r.req_id in self.requests

    def attention_ranges(self, rows: list[BatchRow]) -> dict[int, list[tuple[int, int]]]:
        """`build_attn_metadata(mm_req_doc_ranges=...)`: batch index -> bidirectional ranges (absolute
        positions, ends inclusive) of the requests running a planned forward; every request is causal."""
        ranges = {}
        for i, r in enumerate(rows):
            req = self.requests.get(r.req_id)
            if req is not None and r.num_logits and req.planned is not None and req.attention.ranges:
                ranges[i] = list(req.attention.ranges)
        return ranges

    def adapter_rows(self, rows: list[BatchRow], scheduled: list[int]) -> list[bool]:
        """Per scheduled token of the step (batch order; `scheduled[i]` tokens of request i): whether the draft
        adapter acts there (`draft_lora.py` maps it so). A request running its planned forward drafts at that
        forward's canvas rows; prefill rows, clean rows, padding and other requests' rows run the base weights."""
        out = []
        for r, n in zip(rows, scheduled):
            req = self.requests.get(r.req_id)
            planned = req.planned if req is not None and r.num_logits else None
            drafting = planned.drafting[:n] if planned is not None else []
            out += drafting + [False] * (n - len(drafting))
        return out

    def sample(self, rows: list[BatchRow], logits: torch.Tensor, prefill_logits: torch.Tensor | None) -> list:
        """Per request (batch order): its Emission, and its next drafts (None: keep vLLM's). `logits`
        [sum(num_logits), V] in batch order; `prefill_logits` [len(prefill_rows), V] in the same order."""
        out, at, p = [], 0, 0
        for r in rows:
            req = self.requests.get(r.req_id)
            rows_logits = logits[at : at + r.num_logits]
            at += r.num_logits
            if req is None:  # vLLM's warmup and dummy requests: keep nothing, draft nothing
                out.append((Emission([], r.num_logits), None))
                continue
            if r.num_logits == 0:
                if not self._prefills(r):
                    out.append((Emission([], 0), None))  # a prompt chunk that does not complete the prompt
                    continue
                emission = req.prefill(prefill_logits[p])
                p += 1
            else:
                emission = req.step(rows_logits, r.computed)
            out.append((emission, None if req.planned is None else req.drafts()))
        return out
