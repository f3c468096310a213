"""A CPU stand-in for the part of SGLang that drives a dLLM algorithm with separate context encoding.

It reproduces what `inference/sglang/algorithms.py` relies on (sglang/srt/dllm and the scheduler's
separate-context phases, 0.5.23): per round, a causal context pass over the tokens committed since the
last one (EXTEND, last-row logits per request), then a canvas pass of `block_size` slots after them
(DLLM_EXTEND, full logits, KV discarded); the returned tokens are appended to the output, cut at the
first stop token or max_tokens, and become the next context pass's input. Forwards are the native
engine's (`inference.runner`), with the canvas bidirectional or causal as the algorithm asks.
Hybrid models behave like SGLang's gated-delta layers: a (causal) canvas forward absorbs the canvas
into the request's recurrent state and leaves it there, unless the algorithm's state guard restores it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from inference.runner import ModelRunner, Rows
from inference.sampling import SamplingParams
from inference.sglang.algorithms import ShiftedCanvasAlgorithm


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
        self.caches: dict[str, ModelRunner] = {}
        self.bidirectional = True
        self.forwards = 0

    def cache(self, rid: str) -> ModelRunner:
        if rid not in self.caches:
            sc = self.loaded.sidecar
            runner = ModelRunner(self.loaded.model, banned=None, within_block_causal=sc.within_block_causal)
            runner.reset()
            self.caches[rid] = runner
        return self.caches[rid]

    def forward(self, batch: Batch, pp_proxy_tensors=None):
        self.forwards += 1
        if not batch.forward_mode.is_dllm_extend():
            last = []
            for rid, tokens in zip(batch.rids, batch.new_tokens):
                cache = self.cache(rid)
                logits = cache.forward(Rows().clean(tokens, cache.length), keep=len(tokens))
                last.append(logits[-1])
            out = SimpleNamespace(next_token_logits=torch.stack(last), full_logits=None)
        else:
            B = batch.input_ids.numel() // batch.batch_size
            canvases = batch.input_ids.view(batch.batch_size, B).tolist()
            rows = []
            for rid, canvas in zip(batch.rids, canvases):
                cache = self.cache(rid)
                if cache.hybrid:  # SGLang: token-causal canvas whose state is written to the request's slot
                    assert not self.bidirectional, "SGLang's gated-delta kernels have no bidirectional canvas"
                    rows.append(cache.forward(Rows().clean(canvas, cache.length), keep=len(canvas)))
                    cache._crop_kv(len(canvas))  # the canvas KV is discarded, its recurrent state is not
                    cache.length -= len(canvas)
                    continue
                r = Rows().canvas(canvas, cache.length) if self.bidirectional else Rows().clean(canvas, cache.length)
                rows.append(cache.forward(r, keep=0))
            out = SimpleNamespace(next_token_logits=None, full_logits=torch.cat(rows))
        return SimpleNamespace(logits_output=out, can_run_graph=False)


class EmulatedAttention:
    """The backend hooks: the emulated runner reads the flag the algorithm sets; the state guard
    snapshots and restores each request's gated-delta states."""

    @staticmethod
    def canvas_attention(self, model_runner: EmulatedModelRunner, *, bidirectional: bool) -> None:
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
    hooks = {"canvas_attention": EmulatedAttention.canvas_attention}
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


def serve(loaded, algorithm: ShiftedCanvasAlgorithm, prompts: list[list[int]], params: list[SamplingParams]):
    """Decode every prompt in one batch, SGLang style. Returns (outputs without the stop token, forwards)."""
    runner = EmulatedModelRunner(loaded)
    B, vocab = algorithm.block_size, len(loaded.tokenizer)
    rids = [f"req-{i}" for i in range(len(prompts))]
    committed = [list(p) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    while not all(done):
        active = [i for i in range(len(prompts)) if not done[i]]
        act_rids = [rids[i] for i in active]
        info = _sampling_info([params[i] for i in active], vocab)
        new = [committed[i][runner.cache(rids[i]).length :] for i in active]
        context = Batch(
            Mode(False),
            torch.tensor([t for toks in new for t in toks]),
            act_rids,
            torch.tensor([len(committed[i]) for i in active]),
            info,
            new,
        )
        algorithm.run(runner, context)
        canvas = Batch(
            Mode(True),
            torch.zeros(len(active) * B, dtype=torch.long),
            act_rids,
            torch.tensor([len(committed[i]) + B for i in active]),
            info,
        )
        _, tokens, *_ = algorithm.run(runner, canvas)
        for i, toks in zip(active, tokens):
            toks = toks.tolist()
            assert 1 <= len(toks) <= B, "a round commits between 1 and block_size tokens"
            room = params[i].max_tokens - len(outputs[i])
            stop = next((j for j, t in enumerate(toks) if t in loaded.stop_ids), None)
            if stop is not None and stop < room:
                outputs[i] += toks[:stop]
                done[i] = True
            else:
                outputs[i] += toks[:room]
                done[i] = len(toks) >= room
            committed[i] += toks
    return outputs, runner.forwards
