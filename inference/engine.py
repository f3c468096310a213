"""The native decode engine: causal, diffusion and self-spec over one checkpoint (DESIGN section 6).

One request at a time per engine (the server queues requests); batch size 1 keeps every mode
exact. Each mode is a loop of `ModelRunner.forward` calls whose rows follow the training layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from inference.checkpoint import LoadedModel
from inference.decode_rules import (
    DecodeStats,
    block_decided,
    denoise_step,
    first_stop,
    greedy_accept,
    speculative_accept,
)
from inference.runner import ModelRunner, Rows
from inference.sampling import SamplingParams, pick


@dataclass(frozen=True)
class DecodeConfig:
    mode: str = "causal"
    block_size: int | None = None  # diffusion canvas (default: the checkpoint's bd_size)
    threshold: float = 0.9  # diffusion: commit masked slots whose confidence exceeds this
    steps: int | None = None  # diffusion: denoise steps per block (default: block_size - 1)
    draft_len: int | None = None  # self-spec N (default and maximum: bd_size)
    fuse_commit: bool = True  # diffusion: fuse each commit (the prefill too) with the next block's first denoise


@dataclass
class Generation:
    tokens: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    stats: DecodeStats = field(default_factory=DecodeStats)


class Cancelled(Exception):
    """The client went away; generation stops at the next emitted token."""


class _Output:
    """Collects emitted tokens; applies end-of-turn/filler, max_tokens and stop strings; streams text."""

    def __init__(
        self, tokenizer, params: SamplingParams, stop_ids: frozenset[int], stats: DecodeStats, on_text=None, cancel=None
    ):
        self.tok, self.params, self.stop_ids, self.stats = tokenizer, params, stop_ids, stats
        self.on_text, self.cancel = on_text, cancel
        self.tokens: list[int] = []
        self.finish: str | None = None
        self.text = ""
        self.sent = 0  # characters already streamed

    def push(self, new: list[int]) -> bool:
        """Add tokens the model produced; True once the output is finished."""
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled
        stop = first_stop(new, self.stop_ids)
        room = self.params.max_tokens - len(self.tokens)
        if stop is not None and stop < room:
            self.stats.generated += stop + 1
            self.tokens += new[:stop]
            self.finish = "stop"
        elif len(new) >= room:
            self.stats.generated += room
            self.tokens += new[:room]
            self.finish = "length"
        else:
            self.stats.generated += len(new)
            self.tokens += new
        self.text = self.tok.decode(self.tokens, skip_special_tokens=True)
        cut = min((i for i in (self.text.find(s) for s in self.params.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.finish = self.text[:cut], "stop"
        if self.on_text is not None:
            safe = len(self.text) if self.finish else len(self.text) - self._held_back()
            if safe > self.sent:
                self.on_text(self.text[self.sent : safe])
                self.sent = safe
        return self.finish is not None

    def _held_back(self) -> int:
        """Length of the text's tail that could still grow into a stop string (not streamed yet)."""
        hold = 0
        for s in self.params.stop:
            for n in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:n]):
                    hold = n
                    break
        return hold


class Engine:
    def __init__(self, loaded: LoadedModel, decode: DecodeConfig | None = None):
        self.loaded = loaded
        self.decode = decode or DecodeConfig()
        loaded.check_mode(self.decode.mode)
        sc = loaded.sidecar
        self.runner = ModelRunner(
            loaded.model,
            banned=loaded.mask_id,
            clean_causal=sc.clean_causal if sc else True,
            within_block_causal=sc.within_block_causal if sc else False,
        )

    def _settings(self, decode: DecodeConfig) -> tuple[int, int, int]:
        bd = self.loaded.sidecar.bd_size if self.loaded.sidecar else 1
        block = decode.block_size or bd
        steps = decode.steps or max(1, block - 1)
        draft = decode.draft_len or bd
        if draft > bd:
            raise ValueError(f"draft_len {draft} exceeds the trained block size {bd}")
        if block < 2 or draft < 2:
            raise ValueError("block_size and draft_len must be >= 2")
        return block, steps, draft

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        decode: DecodeConfig | None = None,
        *,
        on_text=None,
        cancel=None,
    ) -> Generation:
        """Decode one request. `on_text(delta)` streams text as it is committed; setting the
        `cancel` event (threading.Event) stops the request with `Cancelled`."""
        decode = decode or self.decode
        self.loaded.check_mode(decode.mode)
        gen = torch.Generator().manual_seed(params.seed if params.seed is not None else torch.seed())
        stats = DecodeStats()
        out = _Output(self.loaded.tokenizer, params, self.loaded.stop_ids, stats, on_text, cancel)
        self.runner.reset()
        try:
            if decode.mode == "causal":
                self._causal(prompt_ids, params, gen, out)
            elif decode.mode == "diffusion":
                self._diffusion(prompt_ids, params, gen, out, decode)
            else:
                self._self_spec(prompt_ids, params, gen, out, decode)
        finally:
            self.runner.reset()
        return Generation(out.tokens, out.text, out.finish or "length", stats)

    # -- helpers --------------------------------------------------------------------------------
    def _pick(self, logits: torch.Tensor, params: SamplingParams, gen) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and their distributions for rows of logits."""
        return pick(logits, params, self.loaded.mask_id, gen)

    def _prefill(self, prompt_ids, params, gen, out) -> int:
        logits = self.runner.forward(Rows().clean(prompt_ids, 0), keep=len(prompt_ids))
        out.stats.forwards += 1
        tok, _ = self._pick(logits[-1:], params, gen)
        return int(tok[0])

    # -- modes ----------------------------------------------------------------------------------
    def _causal(self, prompt_ids, params, gen, out: _Output) -> None:
        tok = self._prefill(prompt_ids, params, gen, out)
        pos = len(prompt_ids)
        while not out.push([tok]):
            logits = self.runner.forward(Rows().clean([tok], pos), keep=1)
            out.stats.forwards += 1
            tok = int(self._pick(logits, params, gen)[0][0])
            pos += 1

    def _denoise_commit(self, logits_rows, canvas, masked, params, gen, decode, last_step) -> None:
        denoise_step(
            logits_rows,
            canvas,
            masked,
            params,
            gen,
            banned=self.loaded.mask_id,
            threshold=decode.threshold,
            last_step=last_step,
        )

    def _diffusion(self, prompt_ids, params, gen, out: _Output, decode: DecodeConfig) -> None:
        B, budget, _ = self._settings(decode)
        mask = self.loaded.mask_id
        block_causal = not self.runner.clean_causal
        # The prefill is the prompt's commit forward: fused with block 1's first denoise step, unless
        # commits are unfused (then every block, the first included, starts from a visible seed).
        p = len(prompt_ids)
        if decode.fuse_commit:
            logits = self.runner.forward(Rows().clean(prompt_ids, 0).canvas([mask] * B, p), keep=p)
        else:
            logits = self.runner.forward(Rows().clean(prompt_ids, 0), keep=p)
        out.stats.forwards += 1
        seed = int(self._pick(logits[p - 1 : p], params, gen)[0][0])
        canvas, masked = [seed] + [mask] * (B - 1), [False] + [True] * (B - 1)
        steps = 0
        if decode.fuse_commit:
            self._denoise_commit(logits[p : p + B - 1], canvas, masked, params, gen, decode, budget <= 1)
            steps = 1
        while True:
            while not block_decided(canvas, masked, self.loaded.stop_ids):
                logits = self.runner.forward(Rows().canvas(canvas, p), keep=0)
                out.stats.forwards += 1
                steps += 1
                self._denoise_commit(logits[:-1], canvas, masked, params, gen, decode, steps >= budget)
            stop = first_stop(canvas, self.loaded.stop_ids)
            if out.push(canvas[: stop + 1] if stop is not None else canvas):
                return
            if decode.fuse_commit:
                rows = Rows().commit(canvas, p, block_causal=block_causal).canvas([mask] * B, p + B)
                logits = self.runner.forward(rows, keep=B)
                out.stats.forwards += 1
                seed = int(self._pick(logits[B - 1 : B], params, gen)[0][0])
                canvas, masked = [seed] + [mask] * (B - 1), [False] + [True] * (B - 1)
                self._denoise_commit(logits[B:-1], canvas, masked, params, gen, decode, budget <= 1)
                steps = 1
            else:
                logits = self.runner.forward(Rows().commit(canvas, p, block_causal=block_causal), keep=B)
                out.stats.forwards += 1
                seed = int(self._pick(logits[-1:], params, gen)[0][0])
                canvas, masked, steps = [seed] + [mask] * (B - 1), [False] + [True] * (B - 1), 0
            p += B

    def _self_spec(self, prompt_ids, params, gen, out: _Output, decode: DecodeConfig) -> None:
        _, _, N = self._settings(decode)
        mask = self.loaded.mask_id
        # The prefill doubles as a cold step: its last row gives the first token (position c); a canvas whose
        # seed slot is that still-unknown token proposes the drafts after it (rows c..c+N-2 -> c+1..c+N-1).
        c = len(prompt_ids)  # cache length; `pending` sits at position c
        logits = self.runner.forward(Rows().clean(prompt_ids, 0).canvas([mask] * N, c), keep=c)
        out.stats.forwards += 1
        pending = int(self._pick(logits[c - 1 : c], params, gen)[0][0])
        drafts_t, q = self._pick(logits[c : c + N - 1], params, gen)
        drafts = drafts_t.tolist()
        if out.push([pending]):
            return
        while True:
            if drafts is None:  # cold step: one AR token, drafts for the positions after it
                logits = self.runner.forward(Rows().clean([pending], c).canvas([mask] * (N - 1), c + 1), keep=1)
                out.stats.forwards += 1
                tok = int(self._pick(logits[:1], params, gen)[0][0])
                drafts_t, q = self._pick(logits[1:], params, gen)
                drafts = drafts_t.tolist()
                out.stats.accepted[0] += 1
                emitted = [tok]
                c += 1
            else:  # warm step: verify N - 1 drafts, propose the next N - 1
                rows = Rows().clean([pending, *drafts], c).canvas([mask] * (N - 1), c + N)
                logits = self.runner.forward(rows, keep=N, rollback=True)
                out.stats.forwards += 1
                ar_tokens, p_dist = self._pick(logits[:N], params, gen)
                d = torch.tensor(drafts)
                if params.greedy:
                    k = greedy_accept(d, ar_tokens.cpu())
                    last = int(ar_tokens[k])
                else:
                    k, last = speculative_accept(d, q.cpu(), p_dist.cpu(), gen)
                out.stats.accepted[k] += 1
                emitted = drafts[:k] + [last]
                self.runner.crop_to(c + 1 + k)  # pending + accepted drafts stay cached
                c += 1 + k
                if k == N - 1:
                    drafts_t, q = self._pick(logits[N:], params, gen)
                    drafts = drafts_t.tolist()
                else:
                    drafts = None
            if out.push(emitted):
                return
            pending = emitted[-1]
