"""The plugin's sampler: one vLLM request decoded by the native engine's own decoders (`bdcore.decode.modes`).

vLLM schedules, per request and step, the tokens after its computed (KV-cached) ones; the sampler turns
the step's logits into output tokens and says how many of the scheduled tokens keep their KV (the
rest roll back). `RequestDecoder` is that contract around a `SelfSpecDecoder` or `DiffusionDecoder`:
`next_step()` is the decoder's next forward as vLLM inputs (tokens, first position, the attention spec of
`masks.py`), `take(logits)` hands the logits to the decoder's own `take` and returns what vLLM must apply.
Commits, acceptance, the step budget and the sampler are therefore `bdcore.decode.rules` and `.sampling`
themselves, never a copy. vLLM-free (torch + bdcore), so CPU tests and the contract check run it.

Two differences from the native engine, both forced by vLLM's scheduling (README.md):
- a vLLM prefill schedules the prompt only (no canvas rows ride along), so self-spec's prefill is a plain
  causal step and the first drafts come from the cold step after it; greedy output is unchanged;
- diffusion commits are unfused (the native engine's `--no-fuse-commit`): a prefill or commit forward of
  clean rows, then denoise forwards of the canvas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bdcore.capabilities import Capabilities
from bdcore.decode.layout import Layout
from bdcore.decode.modes import Decoder, SelfSpecDecoder, make_decoder
from bdcore.decode.sampling import SamplingParams
from bdcore.decode.sequence import AnswerTokens, DecodeStats, EngineOwnedCache, Sequence
from bdcore.serving_gate import resolve
from inference.vllm_backend.masks import AttentionSpec, ranges_for
from inference.vllm_backend.settings import VllmDecodeSettings

EXTRA_ARGS_KEY = "bdstack"  # SamplingParams.extra_args["bdstack"] = {"temperature", "top_k", "top_p"}


@dataclass(frozen=True)
class Step:
    """One request's part of a vLLM forward."""

    tokens: list[int]  # scheduled token ids, at positions start, start + 1, ...
    start: int  # = the request's computed tokens before the step
    attention: AttentionSpec
    drafting: list[bool]  # per row: a draft adapter acts there (`Rows.drafting`: canvas rows)


@dataclass(frozen=True)
class StepResult:
    emitted: list[int]  # output tokens this step (a filler is reported as end-of-turn)
    computed: int  # tokens whose KV stays after the step; the rest of the scheduled ones roll back
    finished: bool


def request_params(extra_args: dict | None, max_tokens: int) -> SamplingParams:
    """A request's sampling parameters. vLLM 0.33 rejects temperature != 1 and seeds for diffusion
    models, so ours travel in `extra_args["bdstack"]`; without them a request is greedy."""
    ours = (extra_args or {}).get(EXTRA_ARGS_KEY) or {}
    unknown = sorted(set(ours) - {"temperature", "top_k", "top_p"})
    if unknown:
        raise ValueError(f"extra_args['{EXTRA_ARGS_KEY}']: unknown key(s) {unknown}; known: temperature, top_k, top_p")
    return SamplingParams(
        temperature=float(ours.get("temperature", 0.0)),
        top_k=int(ours.get("top_k", 0)),
        top_p=float(ours.get("top_p", 1.0)),
        max_tokens=max_tokens,
    )


class RequestDecoder:
    """One vLLM request in diffusion or self-spec mode, decoded by `bdcore.decode.modes`."""

    def __init__(
        self,
        settings: VllmDecodeSettings,
        prompt_ids: list[int],
        params: SamplingParams,
        generator: torch.Generator,
    ):
        self.settings = settings
        self.out = AnswerTokens(settings.stop_ids, params.max_tokens, DecodeStats())
        self.seq = Sequence(
            list(prompt_ids), params, generator, self.out, settings.mask_id, settings.stop_ids, cache=EngineOwnedCache()
        )
        self.decoder: Decoder = make_decoder(self._resolved(), self.seq)
        if isinstance(self.decoder, SelfSpecDecoder):
            self._layout = self.decoder.layout
            self.decoder.layout = Layout(0, 0, 0)  # a vLLM prefill carries no canvas: a plain causal step
        self._forward = None
        self._emitted_before = 0

    def _resolved(self):
        # The gate held these settings to the checkpoint when the command was built and when vLLM loaded the
        # model; asked again with what the settings carry of the sidecar, it fills their defaults the same way.
        s = self.settings
        return resolve(Capabilities.from_sidecar(s.sidecar()), s.decode_config(), "vllm")

    @property
    def stats(self) -> DecodeStats:
        return self.out.stats

    @property
    def finished(self) -> bool:
        return self.decoder.finished

    def next_step(self) -> Step:
        self._forward = fwd = self.decoder.next_forward()
        start = self.seq.cache.length
        spec = ranges_for(fwd.rows, start, within_block_causal=self.settings.within_block_causal)
        return Step(list(fwd.rows.tokens), start, spec, fwd.rows.drafting())

    def take(self, logits: torch.Tensor) -> StepResult:
        """Logits [len(step.tokens), V] of the last `next_step` (the mask token already banned, as the
        native runner bans it); the decoder commits, accepts and crops as the native engine does."""
        fwd, cache = self._forward, self.seq.cache
        if fwd is None:
            raise RuntimeError("take() without next_step()")
        if logits.shape[0] != len(fwd.rows.tokens):
            raise ValueError(f"expected {len(fwd.rows.tokens)} rows of logits, got {logits.shape[0]}")
        cache.length += fwd.keep
        self._forward = None
        self.decoder.take(logits)
        if isinstance(self.decoder, SelfSpecDecoder) and self.decoder.layout.canvas == 0 and self._layout.canvas:
            self.decoder.layout = self._layout  # after the prefill: the fixed layout
        return StepResult(self._new_output(), cache.length, self.decoder.finished)

    def _new_output(self) -> list[int]:
        out = self.out
        new = out.tokens[self._emitted_before :]
        self._emitted_before = len(out.tokens)
        if out.stop_token is not None and self.decoder.finished:
            last = self.settings.end_of_turn_id if out.stop_token == self.settings.filler_id else out.stop_token
            new = [*new, last]
        return new
