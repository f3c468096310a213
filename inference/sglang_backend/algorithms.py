"""Shifted block diffusion and self-spec (docs/design.md section 6) on SGLang's dLLM driver: adapters that drive
the shared decoders of `bdcore.decode.modes`, one per request (`requests.py`).

SGLang (0.5.23, `sglang/srt/dllm/`) drives a dLLM algorithm through `run(model_runner, forward_batch,
algo_states)`. With `requires_separate_context_encoding` it alternates two kinds of batches per request:

- a context pass (an ordinary causal EXTEND forward) over the tokens committed since the last one, whose KV
  stays; of its logits it gives the algorithm each request's last row (`next_token_logits`);
- a canvas pass (DLLM_EXTEND) of `block_size` slots per request after the committed tokens, attending to their
  KV; the canvas KV is discarded afterwards. `run` may spend several model forwards on it and returns, per
  request, the tokens to commit; SGLang writes them over the canvas's slots of the request's fill ids
  (`process_batch_result_dllm`), so at most `block_size` of them, appends them to the output, applies its
  stop tokens and max_new_tokens, and encodes them in the next context pass.

The decoders plan every forward and take its logits; the adapters only place those forwards in the passes.
A forward of committed rows (the prompt, a diffusion block's commit, a self-spec causal step) is a context
pass, and the decoders read its last row only: SGLang's last row stands for every row. Denoise steps and
self-spec's drafting and verify forwards run in the canvas pass. What SGLang forces stays here:

- **One attention kind per forward** (`set_attention`: causal or bidirectional, no per-row mask), so no
  forward mixes committed or verify rows with a canvas. Diffusion runs unfused: the native engine's
  `--no-fuse-commit`, token for token. A self-spec round is three forwards instead of the native one: the
  context pass (a causal step: the AR token after the committed tokens), a seeded drafting forward
  ([AR token, MASK x (N-1)]: `Layout.seeded`, bidirectional unless the checkpoint's canvas is causal) and a
  causal verify of N - 2 of those drafts, so that a round (the AR token, the accepted drafts, then the
  correction or bonus) stays within the N = `block_size` tokens SGLang takes. The verify is one row short of
  the canvas pass; a pad row after it, which no row sees under causal attention, fills it.
- **The context pass owns the commit**: SGLang encodes the tokens a round returned, so the accepted drafts
  the native engine keeps from its verify forward are encoded again there, and a round's tokens reach SGLang
  when its canvas pass returns.
- **Every forward sets its attention first**: under the plugin's settings (no CUDA graphs, no chunked
  prefill) SGLang's Triton backend makes ordinary EXTEND forwards bidirectional too for layers left
  bidirectional, so an attention type inherited from the last canvas would corrupt committed tokens' KV.
- **Hybrids**: `recurrent_state_guard` (plugin.py: the mamba pool's slots) puts each request's gated-delta
  state back after every canvas forward, which SGLang's kernels would otherwise have advanced.
- **`<|mask|>`**: SGLang's model does not ban it; the adapters do (`bdcore.decode.sampling.ban`) as the
  native runner does, so greedy commit confidences are the native engine's.
- **Draft adapters**: a checkpoint's draft-only adapter acts at canvas rows only. Before each canvas-pass forward
  the adapters name the rows that draft (`Rows.drafting` of each planned forward, the native runner's gate: every
  row of a denoise canvas or of a seeded drafting canvas, none of a verify forward, of its pad rows or of the
  requests riding along) to the backend's router (`draft_router`: SGLang's LoRA manager, `draft_lora.py`), and
  clear it after; context passes run the base weights.

This module never imports SGLang: it touches `forward_batch.{forward_mode, input_ids, batch_size, rids,
seq_lens, sampling_info}` and `model_runner.forward(...)` only, so CPU tests drive it with the native
engine's forwards (tests/sglang_emulator.py).
"""

from __future__ import annotations

import contextlib

import torch

from bdcore.capabilities import Capabilities
from bdcore.decode.layout import Layout
from bdcore.decode.sampling import ban
from bdcore.serving_gate import resolve
from inference.sglang_backend.requests import Request, RequestTable, request_params
from inference.sglang_backend.settings import DecodeSettings


class ShiftedCanvasAlgorithm:
    """What both modes share: the requests' decoders, the context pass, the hooks a backend implements."""

    def __init__(self, settings: DecodeSettings):
        self.settings = settings
        self.block_size = settings.block_size
        self.mask_id = settings.mask_id
        self.draft_bidirectional = not settings.within_block_causal
        # The gate held these settings to the checkpoint when serve.py wrote them and when the plugin loaded them;
        # asked again with what they carry of the sidecar, it fills the decoders' defaults the same way.
        decode = resolve(Capabilities.from_sidecar(settings.sidecar()), settings.decode_config(), "sglang")
        self.requests = RequestTable(decode, settings, self._start)
        self.router = None  # the draft adapter's router, built at the first forward (it needs the model runner)

    # -- the hooks a backend implements ---------------------------------------------------------
    def set_attention(self, model_runner, *, bidirectional: bool) -> None:
        """Make the next forward bidirectional within its new tokens, or causal."""
        raise NotImplementedError

    def draft_router(self, model_runner):
        """The checkpoint's draft adapter on `model_runner`'s model, loaded (its `<|mask|>` row attached): a
        `backend_settings.DraftRouter`, whose `route(drafting)` makes the next forward run the adapter at the
        `drafting` rows, and `reset()` none."""
        raise NotImplementedError

    def recurrent_state_guard(self, model_runner, forward_batch):
        """Context manager around a canvas forward that leaves every request's recurrent (gated-delta)
        state as it was: the canvas starts from the block-entry state and commits nothing."""
        return contextlib.nullcontext()

    # -- what each mode says --------------------------------------------------------------------
    def _start(self, req: Request) -> None:
        """Plan a new request's first forward: its prompt, which the context pass that made it encoded."""
        req.plan(for_context=True)

    def _after_context(self, req: Request) -> None:
        """The request's context forward was taken: plan what the next canvas pass runs, if the mode does."""

    def _canvas_pass(self, model_runner, forward_batch) -> tuple[list[torch.Tensor], object]:
        """Tokens to commit per request, and the last forward's output (None if none ran)."""
        raise NotImplementedError

    # -- SGLang's entry point -------------------------------------------------------------------
    @torch.no_grad()
    def run(self, model_runner, forward_batch, algo_states=None):
        if self.settings.draft_adapter is not None and self.router is None:
            self.router = self.draft_router(model_runner)  # before any forward: the mask row is the trained one
        if not forward_batch.forward_mode.is_dllm_extend():
            return self._context_pass(model_runner, forward_batch)
        tokens, last = self._canvas_pass(model_runner, forward_batch)
        return (last.logits_output if last else None), tokens, None, None, bool(last and last.can_run_graph)

    def _forward(self, model_runner, forward_batch, *, bidirectional: bool):
        self.set_attention(model_runner, bidirectional=bidirectional)
        return model_runner.forward(forward_batch, pp_proxy_tensors=None)

    def _canvas_forward(self, model_runner, forward_batch, drafting: list[bool], *, bidirectional: bool):
        with self.recurrent_state_guard(model_runner, forward_batch):
            if self.router is None or not any(drafting):  # no batch info at all: no LoRA kernel runs (verify forwards)
                return self._forward(model_runner, forward_batch, bidirectional=bidirectional)
            self.router.route(drafting)
            try:
                return self._forward(model_runner, forward_batch, bidirectional=bidirectional)
            finally:
                self.router.reset()

    def _context_pass(self, model_runner, forward_batch):
        if forward_batch.input_ids.numel() == 0:
            return None, [], None, None, False
        out = self._forward(model_runner, forward_batch, bidirectional=False)  # the clean stream is causal
        logits = out.logits_output.next_token_logits  # [bs, V]: each request's last row
        info = getattr(forward_batch, "sampling_info", None)
        for i, (rid, end) in enumerate(zip(forward_batch.rids, _as_list(forward_batch.seq_lens))):
            req = self._context_request(rid, int(end), lambda i=i: request_params(info, i, logits.shape[-1]))
            if req is not None:
                rows = len(req.planned.rows.tokens)  # the decoders read the last of them only
                req.take(ban(logits[i : i + 1], self.mask_id).expand(rows, -1))
                self._after_context(req)
        return out.logits_output, [], None, None, out.can_run_graph

    def _context_request(self, rid: str, end: int, params) -> Request | None:
        """The request whose planned context forward SGLang's context pass, ending at `end`, completes; None
        where the pass holds only a part of it, or encodes again what the decoder has taken."""
        req = self.requests.get(rid)
        if req is None or (req.rounds == 0 and not req.for_context and end > req.cached):
            # A new request; or SGLang cut its prompt at the KV budget and the rest came in this batch, before
            # any canvas pass: the decoder starts again on the whole prompt.
            return self.requests.new(rid, end, params())
        if not req.for_context:
            if end <= req.cached:  # SGLang retracted the request and encodes its committed tokens again
                return None
            raise RuntimeError(f"request {rid}: a context pass up to {end}, but the decoder awaits a canvas pass")
        want = req.context_end()
        if end > want:
            raise RuntimeError(f"request {rid}: the context pass ends at {end}, the decoder's forward at {want}")
        return req if end == want else None  # short of it: SGLang cut the context at its KV budget

    def _canvas_requests(self, forward_batch) -> list[Request]:
        B, out = self.block_size, []
        for rid, length in zip(forward_batch.rids, _as_list(forward_batch.seq_lens)):
            req = self.requests.get(rid)
            if req is None or req.for_context:
                raise RuntimeError(f"request {rid}: canvas pass without a preceding context pass (no seed)")
            if int(length) - B != req.cached:
                raise RuntimeError(
                    f"request {rid}: the canvas starts at {int(length) - B} but the decoder's committed tokens end "
                    f"at {req.cached}; the context pass must end where the canvas starts"
                )
            req.rounds += 1
            out.append(req)
        return out

    def _run_planned(self, model_runner, forward_batch, batch: list[tuple[int, Request]], *, bidirectional: bool):
        """One canvas-pass forward of the planned forwards of `batch` ((index in the batch, request)); the
        other requests' slots ride along unread. Returns the forward's output."""
        B, device = self.block_size, forward_batch.input_ids.device
        rows, drafting = [], [[False] * B for _ in range(forward_batch.batch_size)]  # riding along: base weights
        for i, req in batch:
            tokens = req.planned.rows.tokens
            if len(tokens) < B and bidirectional:
                raise RuntimeError(f"internal: a bidirectional forward of {len(tokens)} rows in a canvas of {B}")
            rows.append(tokens + [self.mask_id] * (B - len(tokens)))  # pad rows last: causal, so nobody sees them
            drafting[i][: len(tokens)] = req.planned.rows.drafting()
        slots = forward_batch.input_ids.view(forward_batch.batch_size, B)
        slots[torch.tensor([i for i, _ in batch], device=device)] = torch.tensor(rows, device=device).to(slots)
        flat = [d for request in drafting for d in request]
        out = self._canvas_forward(model_runner, forward_batch, flat, bidirectional=bidirectional)
        logits = out.logits_output.full_logits.view(forward_batch.batch_size, B, -1)
        for i, req in batch:
            req.take(ban(logits[i, : len(req.planned.rows.tokens)], self.mask_id))
        return out

    def _round_tokens(self, forward_batch, reqs: list[Request]) -> list[torch.Tensor]:
        """Each request's tokens of this round; a finished request is forgotten."""
        out = []
        for rid, req in zip(forward_batch.rids, reqs):
            out.append(torch.tensor(req.sink.take(), dtype=torch.long, device=forward_batch.input_ids.device))
            if req.decoder.finished:
                self.requests.forget(rid)
        return out


class ShiftedDiffusion(ShiftedCanvasAlgorithm):
    """`DiffusionDecoder` with unfused commits: a context pass commits a block and seeds the next from its last
    row; the canvas pass denoises that block until it is decided (or the answer ended)."""

    def _after_context(self, req: Request) -> None:
        self._plan_next(req)

    def _plan_next(self, req: Request) -> None:
        if not req.decoder.finished:  # a decided block is committed by the next context pass
            req.plan(for_context=req.decoder.phase != "denoise")

    def _canvas_pass(self, model_runner, forward_batch):
        reqs, out = self._canvas_requests(forward_batch), None
        while denoising := [(i, r) for i, r in enumerate(reqs) if r.planned is not None and not r.for_context]:
            out = self._run_planned(model_runner, forward_batch, denoising, bidirectional=self.draft_bidirectional)
            for _, req in denoising:
                self._plan_next(req)
        return self._round_tokens(forward_batch, reqs), out


class SelfSpec(ShiftedCanvasAlgorithm):
    """`SelfSpecDecoder` in rounds of three forwards (module docstring): the context pass's causal step emits
    the AR token, a seeded canvas drafts after it, a causal forward verifies N - 2 drafts. Lossless: greedy
    output equals greedy causal output token for token, sampled output follows the AR law."""

    def __init__(self, settings: DecodeSettings):
        super().__init__(settings)
        N = self.block_size
        self.causal_step = Layout(0, 0, 0)  # the prompt's prefill too: no canvas rides along a context pass
        self.drafting = Layout(0, N - 1, 0, seeded=True)  # N rows: the canvas pass's width
        self.verifying = Layout(N - 2, 0, N - 2)  # N - 1 rows; at N = 2 a causal step

    def _start(self, req: Request) -> None:
        req.decoder.layout = self.causal_step
        req.plan(for_context=True)

    def _canvas_pass(self, model_runner, forward_batch):
        reqs, out = self._canvas_requests(forward_batch), None
        live = [(i, r) for i, r in enumerate(reqs) if not r.decoder.finished]  # else the AR token was a stop
        steps = [(self.drafting, self.draft_bidirectional)] if self.verifying.drafts else []
        for layout, bidirectional in [*steps, (self.verifying, False)] if live else []:
            for _, req in live:
                req.decoder.layout = layout
                req.plan(for_context=False)
            out = self._run_planned(model_runner, forward_batch, live, bidirectional=bidirectional)
        for _, req in live:
            if not req.decoder.finished:
                req.decoder.layout = self.causal_step
                req.plan(for_context=True)
        return self._round_tokens(forward_batch, reqs), out


def _as_list(values) -> list[int]:
    return values.tolist() if hasattr(values, "tolist") else list(values)
