"""vLLM's side of the plugin contract, emulated on CPU: the KV a request keeps, one forward a step with the
Triton backend's mask (`inference.vllm_backend.masks.triton_visible`), and a native-engine reference loop.

The emulator keeps no KV tensors: each step runs the model over the request's computed tokens plus the
scheduled ones (computed rows causal, as vLLM's cache holds them) and returns the scheduled rows' logits.
So a wrong position, a wrong mask range or a wrong rollback length in the plugin changes the logits.
"""

from __future__ import annotations

import torch

from bdcore.capabilities import Capabilities
from bdcore.decode.config import DecodeConfig
from bdcore.decode.modes import SelfSpecDecoder, make_decoder
from bdcore.decode.runner import ModelRunner
from bdcore.decode.sequence import AnswerTokens, DecodeStats, Sequence
from bdcore.decode.speculation import Layout
from bdcore.serving_gate import resolve
from inference.vllm_backend.masks import triton_visible
from inference.vllm_backend.sampler import RequestDecoder


@torch.no_grad()
def vllm_decode(model, settings, prompt, params, seed: int, *, trace: bool = False):
    """Decode one request as vLLM would drive the plugin; returns (RequestDecoder, emitted tokens)."""
    req = RequestDecoder(settings, prompt, params, torch.Generator().manual_seed(seed))
    if trace:
        req.decoder.trace = []
    computed, emitted = list(prompt[:0]), []
    while not req.finished:
        step = req.next_step()
        assert step.start == len(computed), "a step must start at the request's computed tokens"
        tokens = computed + step.tokens
        n, c = len(tokens), len(computed)
        mask = torch.zeros(1, 1, n, n, dtype=torch.bool)
        mask[0, 0, :c, :c] = torch.ones(c, c, dtype=torch.bool).tril()
        mask[0, 0, c:] = triton_visible(step.attention, c, len(step.tokens))
        logits = (
            model(input_ids=torch.tensor([tokens]), position_ids=torch.arange(n)[None], attention_mask=mask)
            .logits[0, c:]
            .float()
        )
        logits[:, settings.mask_id] = float("-inf")
        result = req.take(logits)
        computed = tokens[: result.computed]
        emitted += result.emitted
    return req, emitted


@torch.no_grad()
def native_decode(model, settings, prompt, params, seed: int, *, mode=None, causal_prefill=False, trace=False):
    """The native engine's decode of one request (its decoders and runner); `causal_prefill`: self-spec's
    prefill carries no canvas, as under vLLM."""
    mode = mode or settings.mode
    out = AnswerTokens(settings.stop_ids, params.max_tokens, DecodeStats())
    seq = Sequence(list(prompt), params, torch.Generator().manual_seed(seed), out, settings.mask_id, settings.stop_ids)
    size = settings.size
    config = DecodeConfig(
        mode=mode,
        block_size=size if mode == "diffusion" else None,
        threshold=settings.threshold,
        steps=settings.steps,
        draft_len=size if mode == "self-spec" else None,
        fuse_commit=False,
    )
    decoder = make_decoder(resolve(Capabilities.from_sidecar(settings.sidecar()), config, "vllm"), seq)
    if trace:
        decoder.trace = []
    fixed = getattr(decoder, "layout", None)
    if causal_prefill and isinstance(decoder, SelfSpecDecoder):
        decoder.layout = Layout(0, 0, 0)
    runner = ModelRunner(model, banned=settings.mask_id, within_block_causal=settings.within_block_causal)
    while not decoder.finished:
        fwd = decoder.next_forward()
        decoder.take(runner.forward([(seq.cache, fwd)])[0])
        if isinstance(decoder, SelfSpecDecoder):
            decoder.layout = fixed
    return decoder, out
