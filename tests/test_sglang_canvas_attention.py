"""The canvas rule on SGLang's CPU engine without SGLang: `inference/sglang_backend/canvas_attention.py` over a
stand-in of SGLang 0.5.23's `TorchNativeAttnBackend` (its extend as the wheel computes it: SDPA over each
request's prefix + new rows, causal unless ENCODER_ONLY or cross attention), and the plugin's start-up rule that
holds each device to the attention backend that gives a canvas its mask. `tests/test_sglang_live.py` runs the
real backend inside a live SGLang."""

import enum
from types import SimpleNamespace

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from inference.sglang_backend import plugin
from inference.sglang_backend.canvas_attention import (
    CanvasAttentionError,
    canvas_backend_class,
    canvas_backend_factory,
)

HEADS, DIM, CANVAS = 2, 8, 4


class AttentionType(enum.Enum):  # sglang.srt.layers.radix_attention.AttentionType's members we touch
    DECODER = "decoder"
    DECODER_BIDIRECTIONAL = "decoder_bidirectional"
    ENCODER_ONLY = "encoder_only"


class StandInTorchNative:
    """TorchNativeAttnBackend.forward_extend/forward_decode (0.5.23) over one flat KV buffer: the new rows' KV is
    written at `out_cache_loc`, then each request attends its whole KV (prefix + new rows)."""

    def __init__(self, model_runner):
        self.k, self.v = model_runner.k, model_runner.v

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        self.k[forward_batch.out_cache_loc], self.v[forward_batch.out_cache_loc] = k, v
        causal = not (layer.is_cross_attention or layer.attn_type == AttentionType.ENCODER_ONLY)
        out, start = torch.empty_like(q), 0
        for prefix, new, slots in zip(
            forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens, forward_batch.kv
        ):
            query = torch.zeros(HEADS, prefix + new, DIM)  # SGLang's "redundant" query: prefix rows discarded
            query[:, prefix:] = q[start : start + new].transpose(0, 1)
            o = scaled_dot_product_attention(
                query, self.k[slots].transpose(0, 1), self.v[slots].transpose(0, 1), is_causal=causal
            )
            out[start : start + new] = o[:, prefix:].transpose(0, 1)
            start += new
        return out

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return q


class Mode(enum.Enum):
    EXTEND = 1
    DECODE = 2
    DLLM_EXTEND = 3

    def is_dllm_extend(self):
        return self is Mode.DLLM_EXTEND


def _layer(kind=AttentionType.DECODER_BIDIRECTIONAL, window=None):
    return SimpleNamespace(attn_type=kind, is_cross_attention=False, sliding_window_size=window, layer_id=0)


def _batch(prefixes, news, mode=Mode.DLLM_EXTEND):
    """Requests with `prefixes[i]` cached tokens and `news[i]` new rows, laid out one after another in the pool."""
    kv, loc, at = [], [], 0
    for p, n in zip(prefixes, news):
        kv.append(torch.arange(at, at + p + n))
        loc.append(torch.arange(at + p, at + p + n))
        at += p + n
    return SimpleNamespace(
        forward_mode=mode,
        extend_prefix_lens=list(prefixes),
        extend_seq_lens=torch.tensor(news),
        extend_seq_lens_cpu=list(news),
        out_cache_loc=torch.cat(loc),
        kv=kv,
        encoder_lens=None,
    )


def _backend(canvas=CANVAS):
    torch.manual_seed(0)
    runner = SimpleNamespace(k=torch.randn(64, HEADS, DIM), v=torch.randn(64, HEADS, DIM))
    return canvas_backend_class(StandInTorchNative, AttentionType)(runner, canvas)


def _qkv(rows):
    return (torch.randn(rows, HEADS, DIM) for _ in range(3))


def test_a_canvas_sees_its_prefix_and_itself_both_ways():
    backend, batch = _backend(), _batch([5, 3], [CANVAS, CANVAS])
    q, k, v = _qkv(2 * CANVAS)
    layer = _layer()
    got = backend.forward_extend(q, k, v, layer, batch)
    assert layer.attn_type is AttentionType.DECODER_BIDIRECTIONAL  # the borrowed type is put back
    for i, slots in enumerate(batch.kv):  # the canvas rule: every canvas row sees every key of its request
        rows = slice(i * CANVAS, (i + 1) * CANVAS)
        keys, values = backend.k[slots].transpose(0, 1), backend.v[slots].transpose(0, 1)
        want = scaled_dot_product_attention(q[rows].transpose(0, 1), keys, values).transpose(0, 1)
        torch.testing.assert_close(got[rows], want)
    causal = backend.forward_extend(q, k, v, _layer(AttentionType.DECODER), batch)
    assert not torch.allclose(causal, got), "a causal canvas would pass unnoticed"


def test_causal_layers_take_sglangs_own_path():
    backend, batch = _backend(), _batch([2], [7], Mode.EXTEND)  # a context pass: any length, causal
    q, k, v = _qkv(7)
    got = backend.forward_extend(q, k, v, _layer(AttentionType.DECODER), batch)
    torch.testing.assert_close(
        got, StandInTorchNative.forward_extend(backend, q, k, v, _layer(AttentionType.DECODER), batch)
    )


@pytest.mark.parametrize(
    ("batch", "layer", "error"),
    [
        (_batch([5], [CANVAS], Mode.EXTEND), _layer(), "EXTEND forward: its rows are committed tokens"),
        (_batch([5, 2], [CANVAS, CANVAS + 2], Mode.DLLM_EXTEND), _layer(), r"extend by \[4, 6\] rows"),
        (_batch([5], [CANVAS - 1], Mode.DLLM_EXTEND), _layer(), "would mix committed and canvas rows"),
        (_batch([5], [CANVAS]), _layer(window=16), "sliding-window layer"),
    ],
    ids=["context pass", "clean rows beside a canvas", "part of a canvas", "sliding window"],
)
def test_what_the_extend_cannot_express_is_refused_never_causal(batch, layer, error):
    backend = _backend()
    q, k, v = _qkv(int(batch.extend_seq_lens.sum()))
    with pytest.raises(CanvasAttentionError, match=error):
        backend.forward_extend(q, k, v, layer, batch)
    assert layer.attn_type is AttentionType.DECODER_BIDIRECTIONAL


def test_a_bidirectional_decode_or_a_server_without_canvas_is_refused():
    q, k, v = _qkv(1)
    with pytest.raises(CanvasAttentionError, match="DECODE forward"):
        _backend().forward_decode(q, k, v, _layer(), _batch([5], [1], Mode.DECODE))
    assert _backend().forward_decode(q, k, v, _layer(AttentionType.DECODER), _batch([5], [1], Mode.DECODE)) is q
    q, k, v = _qkv(CANVAS)
    with pytest.raises(CanvasAttentionError, match="without a dLLM block size"):
        _backend(canvas=None).forward_extend(q, k, v, _layer(), _batch([5], [CANVAS]))


def test_the_registry_factory_reads_the_canvas_size_off_the_runner():
    runner = SimpleNamespace(k=torch.zeros(1), v=torch.zeros(1), block=8)
    factory = canvas_backend_factory(StandInTorchNative, AttentionType, lambda r: r.block)
    backend = factory(runner)
    assert factory.bdstack and isinstance(backend, StandInTorchNative) and backend.canvas_size == 8


def _view(device, attention, prefill=None, decode=None):
    return SimpleNamespace(
        device=device, attention_backend=attention, prefill_attention_backend=prefill, decode_attention_backend=decode
    )


@pytest.mark.parametrize(("device", "attention"), [("cpu", "torch_native"), ("cuda", "triton"), (None, "triton")])
def test_each_device_runs_with_the_attention_that_masks_a_canvas(device, attention):
    assert plugin.server_arg_decisions(_view(device, attention)) == {
        "disable_radix_cache": True,
        "chunked_prefill_size": -1,
    }


@pytest.mark.parametrize(
    ("view", "error"),
    [
        (
            _view("cpu", "triton"),
            "on --device cpu .* need --attention-backend torch_native.* got --attention-backend triton",
        ),
        (_view("cpu", "intel_amx"), "need --attention-backend torch_native"),
        (_view("cpu", "torch_native", decode="intel_amx"), "got --decode-attention-backend intel_amx"),
        (_view("cuda", "torch_native"), "on --device cuda .* need --attention-backend triton"),
        (_view("xpu", "triton"), "not on --device xpu; use the native engine there"),
    ],
    ids=["cpu triton", "cpu amx", "cpu decode backend", "cuda torch_native", "xpu"],
)
def test_other_pairs_are_refused_in_one_line(view, error):
    with pytest.raises(plugin.PluginError, match=error):
        plugin.server_arg_decisions(view)


def test_a_draft_adapter_on_the_cpu_engine_is_refused_at_start(tmp_path):
    """SGLang 0.5.23's LoRA layers pin memory (lora/layers.py, ColumnParallelLinearWithLoRA): tried live, the
    first request crashed the scheduler. The plugin says so at start instead."""
    settings = tmp_path / "s.yaml"
    settings.write_text("draft_adapter: draft_adapter\n")
    view = _view("cpu", "torch_native")
    view.dllm_algorithm_config = str(settings)
    with pytest.raises(plugin.PluginError, match="draft adapters do not run on SGLang's CPU engine"):
        plugin.server_arg_decisions(view)
    settings.write_text("draft_adapter: null\n")
    assert plugin.server_arg_decisions(view)["chunked_prefill_size"] == -1


def test_sglangs_own_torch_native_backend_is_refused_at_the_first_canvas():
    """Were the registry entry missing in the scheduler (a process started another way), SGLang's own backend
    would attend canvases causally without an error: the attention switch refuses to run over it."""

    class RadixAttention(torch.nn.Module):
        attn_type = AttentionType.DECODER

    class LogitsProcessor(torch.nn.Module):
        return_full_logits = False

    TorchNativeAttnBackend = type("TorchNativeAttnBackend", (), {})  # SGLang's class, by its name
    model = torch.nn.Sequential(RadixAttention(), LogitsProcessor())
    switch = plugin.attention_switch(RadixAttention, AttentionType)
    with pytest.raises(plugin.PluginError, match="would attend canvases causally"):
        switch(
            SimpleNamespace(), SimpleNamespace(model=model, attn_backend=TorchNativeAttnBackend()), bidirectional=True
        )
    hybrid = SimpleNamespace(full_attn_backend=TorchNativeAttnBackend())
    with pytest.raises(plugin.PluginError, match="would attend canvases causally"):
        switch(SimpleNamespace(), SimpleNamespace(model=model, attn_backend=hybrid), bidirectional=True)
    ours = canvas_backend_class(StandInTorchNative, AttentionType)
    runner = SimpleNamespace(model=model, attn_backend=ours(SimpleNamespace(k=None, v=None), CANVAS))
    switch(SimpleNamespace(), runner, bidirectional=True)
    assert model[0].attn_type is AttentionType.DECODER_BIDIRECTIONAL
