"""The native decode engine: causal, diffusion and self-spec over one checkpoint (docs/design.md section 6).

`Engine.start` turns a request into a decoder (`bdcore.decode.modes`) whose sequence writes text to a
`TextOutput`; `Engine.generate` drives one decoder alone through the engine's `DecodeDriver`, and
`scheduler.py` drives many in shared forwards through the same driver (`bdcore.decode.driver.DecodeLoop`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from bdcore.decode.compiled_step import warm_up
from bdcore.decode.config import AUTO, DecodeConfig, ResolvedDecode
from bdcore.decode.driver import DecodeDriver, DecodeLoop
from bdcore.decode.modes import Decoder, make_decoder
from bdcore.decode.policy.cost import ForwardCost, calibrate, load_or_calibrate
from bdcore.decode.policy.state import Speculation
from bdcore.decode.runner import ModelRunner
from bdcore.decode.sampling import SamplingParams
from bdcore.decode.sequence import AnswerTokens, DecodeStats, Sequence, TokenLogprob
from bdcore.loading import LoadedModel
from bdcore.serving_gate import resolve

__all__ = ["Cancelled", "DecodeConfig", "Engine", "Generation", "TextOutput"]


@dataclass
class Generation:
    tokens: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    stats: DecodeStats = field(default_factory=DecodeStats)
    logprobs: list[TokenLogprob] | None = None  # per answer token, when the request asked (params.logprobs)


class Cancelled(Exception):
    """The client went away; generation stops at the next emitted token."""


class TextOutput(AnswerTokens):
    """A sequence's answer as text: the answer's tokens (end-of-turn/filler and max_tokens), then stop
    strings, and the text streamed as it is committed."""

    def __init__(
        self,
        tokenizer,
        params: SamplingParams,
        stop_ids: frozenset[int],
        stats: DecodeStats,
        on_text=None,
        cancel=None,
        on_logprobs=None,
    ):
        super().__init__(stop_ids, params.max_tokens, stats)
        self.tok, self.params = tokenizer, params
        self.on_text, self.cancel, self.on_logprobs = on_text, cancel, on_logprobs
        self.text = ""
        self.sent = 0  # characters already streamed
        self.sent_logprobs = 0  # log-probability entries already handed to `on_logprobs`

    def push(self, new: list[int], logprobs: list[TokenLogprob] | None = None) -> bool:
        """Add tokens the model produced; True once the output is finished."""
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled
        super().push(new, logprobs)
        if self.on_logprobs is not None and len(self.logprobs) > self.sent_logprobs:
            self.on_logprobs(self.logprobs[self.sent_logprobs :])  # before the text they belong to
            self.sent_logprobs = len(self.logprobs)
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
        logprobs = self.logprobs if self.params.logprobs is not None else None
        return Generation(self.tokens, self.text, self.finish or "length", self.stats, logprobs)

    def _held_back(self) -> int:
        """Length of the text's tail that could still grow into a stop string, or into the character a
        trailing U+FFFD stands for while its UTF-8 bytes are incomplete (not streamed yet)."""
        hold = len(self.text) - len(self.text.rstrip("\ufffd"))
        for s in self.params.stop:
            for n in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:n]):
                    hold = n
                    break
        return hold


class Engine:
    def __init__(
        self,
        loaded: LoadedModel,
        decode: DecodeConfig | None = None,
        *,
        cost: ForwardCost | None = None,
        compiled: bool = False,
    ):
        """`cost`: the forward cost by rows and batch for `draft_len`/`self_spec_canvases` "auto" (default: measured on
        this model and device at the first such request, or now when `decode` is auto; cached on disk). `compiled`:
        decode steps run compiled (`bdcore.decode.compiled_step`), their graphs compiled now (`compile_seconds`)."""
        self.loaded = loaded
        self.decode = decode or DecodeConfig()
        # The default settings are every request's unless it picks a mode: resolve them now, so that a bad one
        # (a mode the checkpoint lacks, a block longer than the context) stops the server at start rather than
        # failing each request.
        self.default_resolved = self._resolve(self.decode)
        self.runner = ModelRunner.for_checkpoint(loaded.model, loaded.capabilities)
        self.runner.serving_only = True  # nothing trains the engine's model: its forwards run in inference mode
        self.compile_seconds = None
        if compiled:  # before the cost model is measured, so that it prices the compiled step
            self.runner.compile_decode()
            # a self-spec server's drafting graphs too (a draft adapter's are its drafting twin's)
            self.compile_seconds = warm_up(self.runner, drafting=self.default_resolved.mode == "self-spec")
        self.driver = DecodeDriver(self.runner, Speculation(cost, prior=loaded.draft_prior) if cost else None)
        self._calibrating = threading.Lock()
        d = self.decode
        if d.mode == "self-spec" and AUTO in (d.draft_len, d.self_spec_canvases):
            self.speculation()

    def speculation(self) -> Speculation:
        """The self-spec policy state, measuring the forward cost first if nobody gave one."""
        with self._calibrating:
            if self.driver.speculation is None:
                with self.driver.lock:  # no decode forward runs while the calibration times its own
                    cost = load_or_calibrate(self.runner, self.loaded.path) if self.loaded.path else None
                    cost = cost or calibrate(self.runner)
                self.driver.speculation = Speculation(cost, prior=self.loaded.draft_prior)
            return self.driver.speculation

    def _resolve(self, decode: DecodeConfig) -> ResolvedDecode:
        return resolve(self.loaded.capabilities, decode, "native")

    def start(
        self,
        prompt_ids,
        params: SamplingParams,
        decode: DecodeConfig | ResolvedDecode | None = None,
        *,
        on_text=None,
        cancel=None,
        on_logprobs=None,
    ) -> tuple[Decoder, TextOutput]:
        """One request's decoder and its text output (bad settings raise here, before any forward).
        `on_text(delta)` streams text as it is committed, `on_logprobs(entries)` the answer tokens'
        log-probabilities (with `params.logprobs`) just before; setting `cancel` (a threading.Event) stops
        the request with `Cancelled` at its next emitted tokens."""
        if isinstance(decode, ResolvedDecode):  # the server resolved it when it read the request: one check a request
            resolved = decode
        else:
            resolved = self.default_resolved if decode is None else self._resolve(decode)
        gen = torch.Generator().manual_seed(params.seed if params.seed is not None else torch.seed())
        out = TextOutput(
            self.loaded.tokenizer, params, self.loaded.stop_ids, DecodeStats(), on_text, cancel, on_logprobs
        )
        decoder = make_decoder(
            resolved, Sequence.for_checkpoint(self.loaded.capabilities, prompt_ids, params, gen, out)
        )
        if (auto := resolved.auto_draft()) is not None:
            self.speculation().attach(decoder, auto)
        return decoder, out

    def generate(
        self, prompt_ids, params: SamplingParams, decode: DecodeConfig | None = None, *, on_text=None, cancel=None
    ) -> Generation:
        """Decode one request on its own (a batch of one)."""
        decoder, out = self.start(prompt_ids, params, decode, on_text=on_text, cancel=cancel)
        loop = DecodeLoop(self.driver)
        loop.admit(out, decoder)
        loop.run()
        return out.generation()
