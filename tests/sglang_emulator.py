"""A CPU stand-in for the part of SGLang that drives a dLLM algorithm with separate context encoding.

It follows SGLang 0.5.23 where `inference/sglang_backend/algorithms.py` depends on it (checked against the
wheel's source: `srt/dllm/mixin/scheduler.py`, `srt/dllm/mixin/req.py`, `srt/dllm/config.py`,
`srt/managers/schedule_batch.py`, `srt/layers/attention/triton_backend.py`):

- scheduling: at most `max_running_requests` requests are in the dLLM queue (SGLang's default for
  dLLM algorithms is 1: one request at a time); each step is either an EXTEND batch of every queued
  request that has tokens to encode (prompts and committed tokens: context passes), or, when none
  has, a DLLM_EXTEND batch of all the others (canvases). A context pass can be cut short by the KV
  budget (`extend_budget`), and is then continued by the next EXTEND batch;
- attention, as the Triton backend computes it under the plugin's settings (CUDA graphs off,
  chunked_prefill_size -1): an attention layer's `attn_type` decides, in EXTEND and DLLM_EXTEND
  forwards alike; DECODER_BIDIRECTIONAL makes the forward's new tokens see each other both ways. The
  type is whatever the last `set_attention` left (RadixAttention starts causal);
- stops: `Req._check_token_based_finish` with SGLang's stop set as the launcher reads it
  (`engine_stop_ids`: config.json and generation config `eos_token_id`, the tokenizer's eos), then
  `max_new_tokens`;
- hybrid models behave like SGLang's gated-delta layers: a (causal) canvas forward absorbs the
  canvas into the request's recurrent state and leaves it there, unless the state guard restores it;
- a draft adapter runs where the LoRA manager's token segments say, as SGLang's LoRA layers read their backend's
  batch info: the plugin's own `DraftLoRA` (`draft_router`) hands its segments to `EmulatedLoRAManager`, which
  checks them as `LoRAManager.prepare_lora_token_segments` and the Triton backend would (known ids, one length
  per id, as many rows as the forward has) and gates the model's LoRA by them; after `reset_lora_batch`, and in
  every forward before the first routing, no row takes it. peft's gated LoRA stands in for SGLang's kernels
  (`make sglang-contract` runs SGLang's loader and token-segment code on the same routing).

Forwards run on the native decode runner (`bdcore.decode.runner`), one cache per request. Canvas KV is dropped.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from bdcore.decode.rows import Forward, Rows
from bdcore.decode.runner import ModelRunner
from bdcore.decode.sampling import SamplingParams
from bdcore.decode.sequence import SequenceCache
from bdcore.draft_adapter import draft_gate
from bdcore.gated_delta import is_hybrid
from inference.backend_command import engine_stop_ids
from inference.sglang_backend.algorithms import ShiftedCanvasAlgorithm
from inference.sglang_backend.draft_lora import DraftLoRA

_REQUEST_IDS = itertools.count()
EMULATED_LORA_ID = "bdstack-draft-emulated"


class Mode:
    def __init__(self, dllm: bool):
        self.dllm = dllm

    def is_dllm_extend(self) -> bool:
        return self.dllm


@dataclass
class Batch:
    forward_mode: Mode
    input_ids: torch.Tensor
    rids: list[str]
    seq_lens: torch.Tensor
    sampling_info: SimpleNamespace
    new_tokens: list[list[int]] = field(default_factory=list)  # context pass: each request's slice

    @property
    def batch_size(self) -> int:
        return len(self.rids)


class EmulatedModelRunner:
    """`model_runner.forward` over a batch, one native KV cache per request."""

    def __init__(self, loaded):
        self.loaded = loaded
        self.hybrid = is_hybrid(loaded.model.config)
        # Dense: the canvas mask comes from `bidirectional` alone, as in SGLang, never from the sidecar.
        wbc = loaded.sidecar.within_block_causal if self.hybrid else False
        self.runner = ModelRunner(loaded.model, banned=None, within_block_causal=wbc)
        self.caches: dict[str, SequenceCache] = {}
        self.bidirectional = False  # every layer's attn_type: RadixAttention is built DECODER
        self.forwards = 0
        self.modes: list[tuple[str, bool]] = []  # (EXTEND | DLLM_EXTEND, bidirectional) per forward
        self.routing: list[bool] | None = None  # the LoRA manager's rows of the next forward (None: no batch info)
        self.routed: list[tuple[str, list[bool] | None]] = []  # (EXTEND | DLLM_EXTEND, its routing) per forward

    def cache(self, rid: str) -> SequenceCache:
        return self.caches.setdefault(rid, SequenceCache())

    def _forward(self, cache: SequenceCache, tokens: list[int], keep: int, drafting: list[bool]) -> torch.Tensor:
        if not self.bidirectional:
            rows = Rows().clean(tokens, cache.length)
        else:
            assert not self.hybrid, "SGLang's gated-delta kernels have no bidirectional mode"
            rows = Rows().canvas(tokens, cache.length)  # new tokens see the prefix and each other
        with self._lora_at(drafting):
            return self.runner.forward([(cache, Forward(rows, keep))])[0]

    @contextlib.contextmanager
    def _lora_at(self, drafting: list[bool]):
        """The model's draft adapter gated by SGLang's routing, not by the rows' streams (as the native runner
        gates it): a pre-hook on the model, inside the runner's own `draft_rows`, for one forward."""
        gate = draft_gate(self.loaded.model)
        if gate is None:
            yield
            return

        def route(module, args, kwargs):
            gate.rows = torch.tensor([drafting])

        handle = self.loaded.model.register_forward_pre_hook(route, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()

    def _rows_routed(self, lengths: list[int]) -> list[list[bool]]:
        """Each request's slice of the forward's routing; no batch info: no row takes the adapter."""
        routing = self.routing if self.routing is not None else [False] * sum(lengths)
        assert len(routing) == sum(lengths), "token segments must cover the forward's rows exactly"
        starts = list(itertools.accumulate([0, *lengths]))
        return [routing[a:b] for a, b in zip(starts, starts[1:])]

    def forward(self, batch: Batch, pp_proxy_tensors=None):
        self.forwards += 1
        dllm = batch.forward_mode.is_dllm_extend()
        self.modes.append(("DLLM_EXTEND" if dllm else "EXTEND", self.bidirectional))
        self.routed.append((self.modes[-1][0], None if self.routing is None else list(self.routing)))
        if not dllm:
            last = []
            routed = self._rows_routed([len(t) for t in batch.new_tokens])
            for rid, tokens, drafting in zip(batch.rids, batch.new_tokens, routed):
                last.append(self._forward(self.cache(rid), tokens, len(tokens), drafting)[-1])
            out = SimpleNamespace(next_token_logits=torch.stack(last), full_logits=None)
        else:
            B = batch.input_ids.numel() // batch.batch_size
            canvases = batch.input_ids.view(batch.batch_size, B).tolist()
            rows = []
            for rid, canvas, drafting in zip(batch.rids, canvases, self._rows_routed([B] * batch.batch_size)):
                cache = self.cache(rid)
                if self.hybrid:  # SGLang: token-causal canvas whose state is written to the request's slot
                    rows.append(self._forward(cache, canvas, len(canvas), drafting))
                    # the canvas KV is discarded, its recurrent state is not
                    cache.keys = [k[:, : -len(canvas)] for k in cache.keys]
                    cache.values = [v[:, : -len(canvas)] for v in cache.values]
                    continue
                rows.append(self._forward(cache, canvas, 0, drafting))
            out = SimpleNamespace(next_token_logits=None, full_logits=torch.cat(rows))
        return SimpleNamespace(logits_output=out, can_run_graph=False)


class EmulatedLoRAManager:
    """SGLang's `LoRAManager` as the plugin's `DraftLoRA` uses it: two slots (the base model, the adapter); its
    token segments become the next forwards' routing until `reset_lora_batch`."""

    def __init__(self, runner: EmulatedModelRunner):
        self.runner = runner

    def prepare_lora_token_segments(self, *, lora_ids, segment_lens) -> None:
        assert len(lora_ids) == len(segment_lens) and all(n > 0 for n in segment_lens)
        assert set(lora_ids) <= {None, EMULATED_LORA_ID}, "a LoRA id the pool does not hold"
        self.runner.routing = [i is not None for i, n in zip(lora_ids, segment_lens) for _ in range(n)]

    def reset_lora_batch(self) -> None:
        self.runner.routing = None


class EmulatedAttention:
    """The backend hooks: `set_attention` sets the layers' attention type the runner reads; the state
    guard snapshots and restores each request's gated-delta states; `draft_router` is the plugin's `DraftLoRA`
    over the emulated LoRA manager (the model passed in is already the served view, its mask row attached)."""

    @staticmethod
    def draft_router(self, model_runner: EmulatedModelRunner) -> DraftLoRA:
        return DraftLoRA(EmulatedLoRAManager(model_runner), EMULATED_LORA_ID)

    @staticmethod
    def set_attention(self, model_runner: EmulatedModelRunner, *, bidirectional: bool) -> None:
        model_runner.bidirectional = bidirectional

    @staticmethod
    @contextlib.contextmanager
    def recurrent_state_guard(self, model_runner: EmulatedModelRunner, forward_batch):
        saved = {rid: dict(model_runner.cache(rid).states) for rid in forward_batch.rids}
        try:
            yield
        finally:
            for rid, states in saved.items():
                model_runner.cache(rid).states = states


def emulated(cls: type[ShiftedCanvasAlgorithm], *, state_guard: bool = True) -> type[ShiftedCanvasAlgorithm]:
    hooks = {"set_attention": EmulatedAttention.set_attention, "draft_router": EmulatedAttention.draft_router}
    if state_guard:
        hooks["recurrent_state_guard"] = EmulatedAttention.recurrent_state_guard
    return type(f"Emulated{cls.__name__}", (cls,), hooks)


def _sampling_info(params: list[SamplingParams], vocab: int) -> SimpleNamespace:
    """SGLang's encoding: greedy is top_k 1; 'no top-k' is 1 << 30."""
    return SimpleNamespace(
        temperatures=torch.tensor([[p.temperature if not p.greedy else 1.0] for p in params]),
        top_ps=torch.tensor([p.top_p for p in params]),
        top_ks=torch.tensor([1 if p.greedy else (p.top_k or 1 << 30) for p in params]),
    )


@dataclass
class _Request:
    rid: str
    committed: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    done: bool = False


def serve(
    loaded,
    algorithm: ShiftedCanvasAlgorithm,
    prompts: list[list[int]],
    params: list[SamplingParams],
    *,
    max_running_requests: int = 1,
    extend_budget: int | None = None,
    runner: EmulatedModelRunner | None = None,
    rids: list[str] | None = None,
):
    """Decode the prompts (queued in order), SGLang style. Returns (outputs without the stop token, forwards).
    Request ids are unique across calls, as SGLang's are, unless `rids` names them."""
    runner = runner or EmulatedModelRunner(loaded)
    if algorithm.router is not None and algorithm.router.manager.runner is not runner:
        algorithm.router = None  # another model runner is another served model: the adapter is loaded into it
    B, vocab, stops = algorithm.block_size, len(loaded.tokenizer), engine_stop_ids(loaded.path, loaded.tokenizer)
    rids = rids or [f"req-{next(_REQUEST_IDS)}" for _ in prompts]
    waiting = [_Request(rid, list(p), q) for rid, p, q in zip(rids, prompts, params)]
    requests, running = list(waiting), []
    while waiting or running:
        while waiting and len(running) < max_running_requests:
            running.append(waiting.pop(0))
        prefill = [r for r in running if runner.cache(r.rid).length < len(r.committed)]
        if prefill:
            _context_batch(runner, algorithm, prefill, vocab, extend_budget)
            continue
        info = _sampling_info([r.params for r in running], vocab)
        lens = torch.tensor([len(r.committed) + B for r in running])
        ids = torch.zeros(len(running) * B, dtype=torch.long)  # SGLang fills the canvas with 0; the algorithm writes it
        canvas = Batch(Mode(True), ids, [r.rid for r in running], lens, info)
        _, tokens, *_ = algorithm.run(runner, canvas)
        for r, toks in zip(running, tokens):
            toks = toks.tolist()
            assert 1 <= len(toks) <= B, "a round commits between 1 and block_size tokens"
            room = r.params.max_tokens - len(r.output)
            stop = next((j for j, t in enumerate(toks) if t in stops), None)
            if stop is not None and stop < room:
                r.output += toks[:stop]
                r.done = True
            else:
                r.output += toks[:room]
                r.done = len(toks) >= room
            r.committed += toks
        running = [r for r in running if not r.done]
    return [r.output for r in requests], runner.forwards


def _context_batch(runner, algorithm, prefill, vocab: int, budget: int | None) -> None:
    """One EXTEND batch; the KV budget may leave a request's context, or the request, for the next one."""
    picked, slices, left = [], [], budget
    for r in prefill:
        start = runner.cache(r.rid).length
        take = len(r.committed) - start if left is None else min(len(r.committed) - start, left)
        if take <= 0:
            break
        picked.append(r)
        slices.append(r.committed[start : start + take])
        left = None if left is None else left - take
    lens = torch.tensor([runner.cache(r.rid).length + len(s) for r, s in zip(picked, slices)])
    info = _sampling_info([r.params for r in picked], vocab)
    ids = torch.tensor([t for s in slices for t in s])
    algorithm.run(runner, Batch(Mode(False), ids, [r.rid for r in picked], lens, info, slices))
