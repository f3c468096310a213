"""The canvas rule on SGLang's CPU engine: a bidirectional extend for the `torch_native` attention backend.

Our algorithms mark a canvas forward by setting every attention layer's `attn_type` to DECODER_BIDIRECTIONAL
(`plugin.attention_switch`). SGLang's Triton backend honours that; its `torch_native` backend (0.5.23,
`srt/layers/attention/torch_native_backend.py`, `forward_extend`) is non-causal only for ENCODER_ONLY and cross
attention, so it would attend a canvas **causally, without an error** (diffusion then drifts from the native
engine; the trial in docs/history/results-notebook.md, Session 54, matched 5 prompts of 10).

`canvas_backend_class` derives from SGLang's `TorchNativeAttnBackend` a backend whose extend over a
DECODER_BIDIRECTIONAL layer is the canvas rule: every new row sees the request's whole prefix (its committed
tokens' KV) and every new row of its canvas, both ways. That is SGLang's own SDPA extend with `is_causal` off,
which over "prefix + new rows" is exactly that mask, so only when every new row of the forward is a canvas row:
SGLang's DLLM_EXTEND forward of one `block_size` canvas per request (our split self-spec steps and unfused
diffusion run nothing else bidirectionally). Whatever else asks for a bidirectional layer (an ordinary EXTEND or
DECODE forward, whose rows are committed tokens; a request with other than one canvas of new rows; sliding-window
or cross attention, whose masks this cannot add) raises `CanvasAttentionError` instead of attending causally.

SGLang-free: the plugin passes SGLang's classes in (`plugin.register`), CPU tests pass stand-ins.
"""

from __future__ import annotations


class CanvasAttentionError(RuntimeError):
    """A forward asked for a bidirectional canvas the torch_native extend cannot express: refused, never causal."""


def check_canvas_forward(forward_batch, layer, canvas_size: int | None) -> None:
    """Raise unless every new row of `forward_batch` belongs to one `canvas_size` canvas per request, the one
    shape over which SDPA without `is_causal` (prefix + new rows) is the canvas rule."""
    mode = forward_batch.forward_mode
    if not mode.is_dllm_extend():
        raise CanvasAttentionError(
            f"bidirectional attention asked for in a {getattr(mode, 'name', mode)} forward: its rows are committed "
            "tokens, not a canvas, and torch_native cannot mix causal and canvas rows in one forward"
        )
    if getattr(layer, "is_cross_attention", False) or getattr(forward_batch, "encoder_lens", None) is not None:
        raise CanvasAttentionError("bidirectional canvas attention with cross attention or encoder tokens")
    window = getattr(layer, "sliding_window_size", None)
    if window is not None and window > -1:  # torch_native drops the window when not causal: a wrong mask
        raise CanvasAttentionError(f"layer {layer.layer_id}: a sliding-window layer cannot attend a canvas here")
    if canvas_size is None:
        raise CanvasAttentionError("bidirectional attention on a server without a dLLM block size (no canvas)")
    lengths = getattr(forward_batch, "extend_seq_lens_cpu", None)
    lengths = list(lengths) if lengths is not None else forward_batch.extend_seq_lens.tolist()
    if any(int(n) != canvas_size for n in lengths):
        raise CanvasAttentionError(
            f"a canvas forward whose requests extend by {lengths} rows, not one canvas of {canvas_size} each: "
            "it would mix committed and canvas rows under one mask"
        )


def canvas_backend_class(base_cls, attention_type):
    """SGLang's `TorchNativeAttnBackend` (`base_cls`) with the canvas rule for DECODER_BIDIRECTIONAL layers; every
    other layer takes the base's path unchanged (stock causal serving through it is SGLang's own)."""
    bidirectional = attention_type.DECODER_BIDIRECTIONAL

    class BdstackTorchNativeAttnBackend(base_cls):
        def __init__(self, model_runner, canvas_size: int | None = None):
            super().__init__(model_runner)
            self.canvas_size = canvas_size

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            if layer.attn_type is not bidirectional:
                return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
            check_canvas_forward(forward_batch, layer, self.canvas_size)
            # The base is non-causal for ENCODER_ONLY only: borrow that type for this call. It changes nothing
            # else in 0.5.23's extend (the KV of the canvas is written as for any layer, and dropped by SGLang).
            layer.attn_type = attention_type.ENCODER_ONLY
            try:
                return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
            finally:
                layer.attn_type = bidirectional

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            if layer.attn_type is bidirectional:  # a type left over from a canvas: the rows are committed ones
                check_canvas_forward(forward_batch, layer, self.canvas_size)
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)

    BdstackTorchNativeAttnBackend.__qualname__ = BdstackTorchNativeAttnBackend.__name__
    return BdstackTorchNativeAttnBackend


def canvas_backend_factory(base_cls, attention_type, canvas_size_of):
    """SGLang's attention-registry entry (`ATTENTION_BACKENDS["torch_native"]`): our backend over a model runner,
    its canvas size read by `canvas_size_of(model_runner)` (None on a server without a dLLM algorithm)."""
    cls = canvas_backend_class(base_cls, attention_type)

    def create(model_runner):
        return cls(model_runner, canvas_size_of(model_runner))

    create.bdstack = True
    return create
