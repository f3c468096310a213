"""vLLM's side of the plugin contract, emulated on CPU: the KV a request keeps, one forward a step with the
Triton backend's mask (`inference.vllm_backend.masks.triton_visible`), and a native-engine reference loop.

The emulator keeps no KV tensors: each step runs the model over the request's computed tokens plus the
scheduled ones (computed rows causal, as vLLM's cache holds them) and returns the scheduled rows' logits.
So a wrong position, a wrong mask range or a wrong rollback length in the plugin changes the logits.

A draft-adapter checkpoint runs as the plugin serves it (`vllm_view`): its LoRA switched on at the rows the
plugin's per-token mapping names (`Step.drafting`, what `StepGlue.adapter_rows` hands vLLM; the computed
rows are KV, never recomputed with the adapter) and the trained `<|mask|>` row the plugin attaches. peft's
gated LoRA stands in for vLLM's punica kernels (`make vllm-contract` runs those on the mapping).
"""

from __future__ import annotations

from pathlib import Path

import torch

from bdcore.capabilities import Capabilities
from bdcore.decode.config import DecodeConfig
from bdcore.decode.layout import Layout
from bdcore.decode.modes import SelfSpecDecoder, make_decoder
from bdcore.decode.runner import ModelRunner
from bdcore.decode.sequence import AnswerTokens, DecodeStats, Sequence
from bdcore.draft_adapter import MASK_ROW, attach_mask_row, draft_rows
from bdcore.loading import load_checkpoint
from bdcore.serving_gate import resolve
from inference.vllm_backend.draft_adapter import load_mask_row
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
        drafting = torch.tensor([[False] * c + step.drafting])
        with draft_rows(model, drafting):
            out = model(input_ids=torch.tensor([tokens]), position_ids=torch.arange(n)[None], attention_mask=mask)
        logits = out.logits[0, c:].float()
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


def vllm_view(checkpoint: Path, mask_id: int):
    """A draft-adapter checkpoint as the vLLM plugin serves it: the adapter's LoRA weights as trained (vLLM
    loads the peft file as it is; no energy cut), gated by whoever runs it, and the `<|mask|>` row the plugin
    reads and attaches (`load_mask_row`, `attach_mask_row`) in place of the trainer's. The native engine's
    model for comparison is `load_checkpoint(checkpoint, draft_energy=1.0)`."""
    model = load_checkpoint(checkpoint, draft_energy=1.0).model
    embed = model.get_input_embeddings()
    embed._forward_hooks.clear()  # the trainer's swap, and its parameter: the plugin brings its own
    del embed._parameters[MASK_ROW]
    row = load_mask_row(checkpoint / "draft_adapter", embed.embedding_dim)
    attach_mask_row(embed, row, mask_id)
    return model
