"""Shifted block diffusion and self-spec (docs/design.md section 6) against SGLang's dLLM driver contract.

SGLang (0.5.23, `sglang/srt/dllm/`) drives a dLLM algorithm through `run(model_runner, forward_batch,
algo_states)`. With `requires_separate_context_encoding` it alternates two kinds of batches per request:

- a context pass (an ordinary causal EXTEND forward) over the tokens committed since the last one:
  exactly our commit forward, and its last row is the AR head's prediction of the next token;
- a canvas pass (DLLM_EXTEND) over `block_size` slots placed after the committed tokens, attending to
  their KV; the canvas KV is discarded afterwards, so nothing a canvas forward writes persists.

`run` returns, per request, the tokens to commit; SGLang appends them to the output, applies stop
tokens and max_tokens, and encodes them in the next context pass. This module never imports SGLang:
it touches `forward_batch.{forward_mode, input_ids, batch_size, rids, seq_lens, sampling_info}` and
`model_runner.forward(...)` only, so CPU tests drive it with the native engine's forwards. The one
backend-specific hook, `set_attention`, makes the next forward causal or bidirectional; `plugin.py`
implements it for SGLang's Triton attention backend. Every forward sets it first (context passes and
verifies causal, drafts as the checkpoint's `within_block_causal` says): under the plugin's settings
(no CUDA graphs, no chunked prefill) that backend also makes ordinary EXTEND forwards bidirectional for
layers left bidirectional, so an attention type inherited from the last canvas would corrupt the
committed tokens' KV and the next request's prompt.

Semantics match the native engine with `fuse_commit=False`: the seed (slot 0) is the AR token from
the context pass, row j of a canvas predicts slot j + 1, commits follow `bdcore.decode.rules`. Self-spec
spends three forwards per round (context, drafts, causal verify) instead of the native engine's one,
because SGLang's canvas attention has no per-row mask to mix causal verify rows and MASK rows.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import OrderedDict

import torch

from bdcore.decode.rules import block_decided, denoise_step, first_stop, greedy_accept, speculative_accept
from bdcore.decode.sampling import SamplingParams, pick
from inference.sglang_backend.settings import DecodeSettings

# SGLang turns temperature 0 into top_k = 1; top_k = -1 or 1 << 30 means the whole vocabulary.
_GREEDY_TOP_K = 1
_MAX_TRACKED_REQUESTS = 16384


def request_params(sampling_info, index: int, vocab_size: int) -> SamplingParams:
    """One request's sampling parameters from SGLang's batched `SamplingBatchInfo` (greedy when absent)."""
    if sampling_info is None:
        return SamplingParams()
    top_k = int(sampling_info.top_ks[index])
    if top_k == _GREEDY_TOP_K:
        return SamplingParams()
    temperature = float(sampling_info.temperatures.reshape(-1)[index])
    top_p = float(sampling_info.top_ps[index])
    return SamplingParams(
        temperature=temperature,
        top_k=0 if top_k <= 0 or top_k >= vocab_size else top_k,
        top_p=min(max(top_p, 1e-6), 1.0),
    )


def request_generator(rid: str) -> torch.Generator:
    """A CPU generator seeded from the request id: every tensor-parallel rank draws the same tokens."""
    seed = int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), "little") & ((1 << 63) - 1)
    return torch.Generator().manual_seed(seed)


class ShiftedCanvasAlgorithm:
    """What both modes share: the seed from the context pass, per-request sampling, stop handling."""

    def __init__(self, settings: DecodeSettings):
        self.settings = settings
        self.block_size = settings.block_size
        self.mask_id = settings.mask_id
        self.stop_ids = settings.stop_ids
        self.draft_bidirectional = not settings.within_block_causal
        # rid -> (seed token, number of committed tokens it follows); rid -> generator
        self._seeds: dict[str, tuple[int, int]] = {}
        self._generators: OrderedDict[str, torch.Generator] = OrderedDict()

    # -- the hooks a backend implements ---------------------------------------------------------
    def set_attention(self, model_runner, *, bidirectional: bool) -> None:
        """Make the next forward bidirectional within its new tokens, or causal."""
        raise NotImplementedError

    def recurrent_state_guard(self, model_runner, forward_batch):
        """Context manager around a canvas forward that leaves every request's recurrent (gated-delta)
        state as it was: the canvas starts from the block-entry state and commits nothing."""
        return contextlib.nullcontext()

    # -- SGLang's entry point -------------------------------------------------------------------
    @torch.no_grad()
    def run(self, model_runner, forward_batch, algo_states=None):
        if not forward_batch.forward_mode.is_dllm_extend():
            return self._context_pass(model_runner, forward_batch)
        tokens, last = self._canvas_pass(model_runner, forward_batch)
        return (last.logits_output if last else None), tokens, None, None, bool(last and last.can_run_graph)

    def _forward(self, model_runner, forward_batch, *, bidirectional: bool):
        self.set_attention(model_runner, bidirectional=bidirectional)
        return model_runner.forward(forward_batch, pp_proxy_tensors=None)

    def _canvas_forward(self, model_runner, forward_batch, *, bidirectional: bool):
        with self.recurrent_state_guard(model_runner, forward_batch):
            return self._forward(model_runner, forward_batch, bidirectional=bidirectional)

    def _context_pass(self, model_runner, forward_batch):
        if forward_batch.input_ids.numel() == 0:
            return None, [], None, None, False
        out = self._forward(model_runner, forward_batch, bidirectional=False)  # the clean stream is causal
        logits = out.logits_output.next_token_logits  # [bs, V]: each request's last row
        lengths = _as_list(forward_batch.seq_lens)
        for i, rid in enumerate(forward_batch.rids):
            params = request_params(getattr(forward_batch, "sampling_info", None), i, logits.shape[-1])
            seed, _ = pick(logits[i : i + 1], params, self.mask_id, self._generator(rid))
            # A context split into chunks leaves the seed of its last chunk: the one the canvas follows.
            self._seeds[rid] = (int(seed[0]), int(lengths[i]))
        return out.logits_output, [], None, None, out.can_run_graph

    def _canvas_pass(self, model_runner, forward_batch) -> tuple[list[torch.Tensor], object]:
        """Tokens to commit per request, and the last forward's output (None if none ran)."""
        raise NotImplementedError

    # -- helpers --------------------------------------------------------------------------------
    def _generator(self, rid: str) -> torch.Generator:
        gen = self._generators.get(rid)
        if gen is None:
            gen = self._generators[rid] = request_generator(rid)
            while len(self._generators) > _MAX_TRACKED_REQUESTS:
                self._generators.popitem(last=False)
        else:
            self._generators.move_to_end(rid)
        return gen

    def _take_seeds(self, forward_batch) -> list[int]:
        B, seeds = self.block_size, []
        lengths = _as_list(forward_batch.seq_lens)
        for i, rid in enumerate(forward_batch.rids):
            if rid not in self._seeds:
                raise RuntimeError(f"request {rid}: canvas pass without a preceding context pass (no seed)")
            seed, committed = self._seeds.pop(rid)
            if committed != int(lengths[i]) - B:
                raise RuntimeError(
                    f"request {rid}: the canvas starts at {int(lengths[i]) - B} but the seed follows {committed} "
                    "committed tokens; the context pass must end where the canvas starts"
                )
            seeds.append(seed)
        return seeds

    def _params(self, forward_batch, vocab_size: int) -> list[SamplingParams]:
        info = getattr(forward_batch, "sampling_info", None)
        return [request_params(info, i, vocab_size) for i in range(forward_batch.batch_size)]

    def _emit(self, tokens: list[int], device) -> torch.Tensor:
        """Tokens up to and including the first stop; a filler ends the output like end-of-turn (and is
        reported as end-of-turn, the stop token SGLang knows from the generation config)."""
        stop = first_stop(tokens, self.stop_ids)
        if stop is not None:
            last = self.settings.end_of_turn_id if tokens[stop] == self.settings.filler_id else tokens[stop]
            tokens = [*tokens[:stop], last]
        return torch.tensor(tokens, dtype=torch.long, device=device)


class ShiftedDiffusion(ShiftedCanvasAlgorithm):
    """Canvas `[seed, MASK x (B-1)]`; denoise until every slot is decided (or the answer ended)."""

    def _canvas_pass(self, model_runner, forward_batch):
        bs, B, mask = forward_batch.batch_size, self.block_size, self.mask_id
        seeds = self._take_seeds(forward_batch)
        canvases = [[seed] + [mask] * (B - 1) for seed in seeds]
        masked = [[False] + [True] * (B - 1) for _ in seeds]
        params: list[SamplingParams] | None = None
        steps, out = 0, None
        while not all(block_decided(c, m, self.stop_ids) for c, m in zip(canvases, masked)):
            forward_batch.input_ids.copy_(torch.tensor(canvases, dtype=forward_batch.input_ids.dtype).view(-1))
            out = self._canvas_forward(model_runner, forward_batch, bidirectional=self.draft_bidirectional)
            logits = out.logits_output.full_logits.view(bs, B, -1)
            params = params or self._params(forward_batch, logits.shape[-1])
            steps += 1
            for i, rid in enumerate(forward_batch.rids):
                if block_decided(canvases[i], masked[i], self.stop_ids):
                    continue
                denoise_step(
                    logits[i, :-1],
                    canvases[i],
                    masked[i],
                    params[i],
                    self._generator(rid),
                    banned=mask,
                    threshold=self.settings.threshold,
                    last_step=steps >= self.settings.denoise_steps,
                )
        device = forward_batch.input_ids.device
        return [self._emit(c, device) for c in canvases], out


class SelfSpec(ShiftedCanvasAlgorithm):
    """Drafts from `[seed, MASK x (N-1)]`, verified by a causal forward over `[seed, drafts]`.

    Emits the seed, the accepted drafts and the AR correction (at most N tokens: the canvas length;
    when every draft is accepted the bonus token is left to the next context pass, which predicts the
    same distribution). Greedy output equals greedy causal output token for token.
    """

    def _canvas_pass(self, model_runner, forward_batch):
        bs, N, mask = forward_batch.batch_size, self.block_size, self.mask_id
        seeds = self._take_seeds(forward_batch)
        ids = forward_batch.input_ids
        if all(s in self.stop_ids for s in seeds):  # every answer ends at its seed: no drafts needed
            return [self._emit([s], ids.device) for s in seeds], None
        ids.copy_(torch.tensor([[s] + [mask] * (N - 1) for s in seeds], dtype=ids.dtype).view(-1))
        drafted = self._canvas_forward(model_runner, forward_batch, bidirectional=self.draft_bidirectional)
        logits = drafted.logits_output.full_logits.view(bs, N, -1)
        params = self._params(forward_batch, logits.shape[-1])
        drafts, q = [], []
        for i, rid in enumerate(forward_batch.rids):
            d, qi = pick(logits[i, :-1], params[i], mask, self._generator(rid))
            drafts.append(d.cpu())
            q.append(None if qi is None else qi.cpu())  # greedy: no distribution
        ids.copy_(torch.stack([torch.cat([torch.tensor([s]), d]) for s, d in zip(seeds, drafts)]).to(ids).view(-1))
        last = self._canvas_forward(model_runner, forward_batch, bidirectional=False)
        verify = last.logits_output.full_logits.view(bs, N, -1)
        out = []
        for i, rid in enumerate(forward_batch.rids):
            ar, p = pick(verify[i], params[i], mask, self._generator(rid))
            if params[i].greedy:
                k = greedy_accept(drafts[i], ar.cpu())
                correction = int(ar[k])
            else:
                k, correction = speculative_accept(drafts[i], q[i], p.cpu(), self._generator(rid))
            emitted = [seeds[i], *drafts[i][:k].tolist()]
            if k < N - 1:
                emitted.append(correction)
            out.append(self._emit(emitted, ids.device))
        return out, last


def _as_list(values) -> list[int]:
    return values.tolist() if hasattr(values, "tolist") else list(values)
