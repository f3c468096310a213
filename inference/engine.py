"""The native decode engine: causal, diffusion and self-spec over one checkpoint (DESIGN section 6).

`Engine.generate` decodes one request on a one-request `ModelRunner`; the modes themselves live in
`decode_modes.py` as generators of forwards, which `scheduler.py` also runs batched across requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from inference import decode_modes
from inference.checkpoint import LoadedModel
from inference.decode_modes import Forward, Request
from inference.decode_rules import DecodeStats, first_stop
from inference.runner import ModelRunner
from inference.sampling import SamplingParams


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

    def generation(self) -> Generation:
        return Generation(self.tokens, self.text, self.finish or "length", self.stats)

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
        mode, out = self.start(prompt_ids, params, decode, on_text=on_text, cancel=cancel)
        self.runner.reset()
        try:
            drive(mode, self.runner)
        finally:
            self.runner.reset()
        return out.generation()

    def start(self, prompt_ids, params: SamplingParams, decode=None, *, on_text=None, cancel=None):
        """One request's decode generator and its output, for any runner (bad settings raise here)."""
        decode = decode or self.decode
        self.loaded.check_mode(decode.mode)
        gen = torch.Generator().manual_seed(params.seed if params.seed is not None else torch.seed())
        out = _Output(self.loaded.tokenizer, params, self.loaded.stop_ids, DecodeStats(), on_text, cancel)
        return self.mode(decode, self.request(prompt_ids, params, gen, out)), out

    def request(self, prompt_ids, params: SamplingParams, gen, out: _Output) -> Request:
        sc = self.loaded.sidecar
        block_causal = sc is not None and not sc.clean_causal
        return Request(prompt_ids, params, gen, out, self.loaded.mask_id, self.loaded.stop_ids, block_causal)

    def mode(self, decode: DecodeConfig, req: Request):
        """The decode generator of `decode.mode` for one request (see decode_modes.py)."""
        block, budget, draft = self._settings(decode)
        if decode.mode == "causal":
            return decode_modes.causal(req)
        if decode.mode == "diffusion":
            return decode_modes.diffusion(
                req, block=block, budget=budget, threshold=decode.threshold, fuse_commit=decode.fuse_commit
            )
        return decode_modes.self_spec(req, draft_len=draft)


def drive(mode, runner: ModelRunner) -> None:
    """Run one request's decode generator on a one-request runner."""
    try:
        op = next(mode)
        while True:
            if isinstance(op, Forward):
                op = mode.send(runner.forward(op.rows, op.keep, rollback=op.rollback))
            else:
                runner.crop_to(op.length)
                op = mode.send(None)
    except StopIteration:
        pass
