"""Invariant 2: noised block b of the two-stream forward equals a single-stream forward of
[prompt, clean blocks < b, noised block b] with a bidirectional (or causal) last block, on a separate
stock instance of the model. For hybrids, the reference's gated-delta layers are the stock conv and
token-by-token recurrence run piece by piece: the noised block starts from the clean state before it
and reads its block-end state (token-causal with `within_block_causal`)."""

import random
import types

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn, l2norm, torch_recurrent_gated_delta_rule

from tests.tiny import FILLER_ID, MASK_ID, random_sample, tiny_hybrid_model, tiny_model
from train.config import BlockDiffusionConfig
from train.model import TwoStreamLM
from train.noise import noise_generator
from train.rows import SpecialIds, build_batch

IDS = SpecialIds(mask_id=MASK_ID, filler_id=FILLER_ID)


def piecewise_forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """Stock gated-delta layer, run piece by piece; pieces flagged True read their end state."""
    pieces = attention_mask
    B, T, _ = hidden_states.shape
    mixed = self.in_proj_qkv(hidden_states).transpose(1, 2)
    mixed = causal_conv1d_fn(mixed, self.conv1d.weight.squeeze(1), self.conv1d.bias, activation=self.activation)
    q, k, v = torch.split(mixed.transpose(1, 2), [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    q, k = q.reshape(B, T, -1, self.head_k_dim), k.reshape(B, T, -1, self.head_k_dim)
    v = v.reshape(B, T, -1, self.head_v_dim)
    beta = self.in_proj_b(hidden_states).sigmoid()
    g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(hidden_states).float() + self.dt_bias)
    outs, state = [], None
    for s, e, end_readout in pieces:
        o, state = torch_recurrent_gated_delta_rule(
            q[:, s:e],
            k[:, s:e],
            v[:, s:e],
            g=g[:, s:e],
            beta=beta[:, s:e],
            initial_state=state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        if end_readout:
            qn = l2norm(q[:, s:e].repeat_interleave(self.num_v_heads // q.shape[2], dim=2).float())
            o = torch.einsum("bthk,bhkv->bthv", qn * self.head_k_dim**-0.5, state).to(o.dtype)
        outs.append(o)
    core = torch.cat(outs, 1)
    z = self.in_proj_z(hidden_states).reshape(-1, self.head_v_dim)
    core = self.norm(core.reshape(-1, self.head_v_dim), z).reshape(B, T, -1)
    return self.out_proj(core)


def reference_model(arch: str):
    """A stock SDPA instance with the test weights (hybrids: gated-delta layers run piece by piece)."""
    if arch != "qwen3_5":
        return tiny_model(arch)
    model = tiny_hybrid_model()
    for layer in model.get_decoder().layers:
        if hasattr(layer, "linear_attn"):
            layer.linear_attn.forward = types.MethodType(piecewise_forward, layer.linear_attn)
    return model


def single_stream_reference(model, sample, start, block_ids, bd_size, clean_causal, within_block_causal):
    """Logits of the block rows of one plain forward over [clean prefix, noised block]."""
    prefix = list(sample.input_ids[:start])
    P, B = len(prefix), len(block_ids)
    limit = list(range(P))  # last key position each prefix row may see
    pieces, t = [], 0  # gated-delta pieces: (start, end, reads its end state)
    for s, e in [] if clean_causal else [(s, min(e, P)) for s, e in sample.spans if s < P]:
        pieces += [(t, s, False)] if t < s else []
        for b0 in range(s, e, bd_size):
            b1 = min(e, b0 + bd_size)
            pieces.append((b0, b1, True))
            for i in range(b0, b1):
                limit[i] = b1 - 1
        t = e
    pieces += [(t, P, False)] if t < P else []
    pieces.append((P, P + B, not within_block_causal))
    mask = torch.zeros(P + B, P + B, dtype=torch.bool)
    for i in range(P):
        mask[i, : limit[i] + 1] = True
    mask[P:, :P] = True
    mask[P:, P:] = torch.tril(torch.ones(B, B, dtype=torch.bool)) if within_block_causal else True
    dev = next(model.parameters()).device
    mask = mask[None, None].to(dev)
    if hasattr(model.config, "layer_types") and "linear_attention" in model.config.layer_types:
        mask = {"full_attention": mask, "linear_attention": pieces}
    ids = torch.tensor([prefix + block_ids], device=dev)
    out = model(input_ids=ids, attention_mask=mask, position_ids=torch.arange(P + B, device=dev)[None])
    return out.logits[0, P:]


@pytest.mark.parametrize(
    "arch,clean_causal,wbc,turns,pack",
    [
        ("qwen3", True, False, 1, 1),
        ("qwen3", True, True, 1, 1),
        ("qwen3", False, False, 1, 1),
        ("qwen3", True, False, 1, 3),  # packing: documents never see each other
        ("qwen3", True, False, 3, 1),  # multi-turn: blocks restart at each assistant turn
        ("llama", False, True, 2, 2),
        ("qwen3_moe", True, False, 2, 2),
        ("qwen3_moe", False, False, 1, 2),
        ("qwen3_5", True, False, 1, 1),
        ("qwen3_5", True, True, 2, 2),
        ("qwen3_5", False, False, 2, 1),
        ("qwen3_5", True, False, 3, 2),
    ],
)
def test_noised_block_equals_single_stream(arch, clean_causal, wbc, turns, pack):
    model = tiny_hybrid_model() if arch == "qwen3_5" else tiny_model(arch)
    reference = reference_model(arch)  # TwoStreamLM switches `model` to the tiled SDPA; this stays stock
    rng = random.Random(turns * 10 + pack)
    bd = 4
    rows = [[random_sample(rng, turns=turns, max_prompt=8, max_resp=11) for _ in range(pack)] for _ in range(2)]
    cfg = BlockDiffusionConfig(
        bd_size=bd, ar_loss_weight=0.3 if clean_causal else 0.0, clean_causal=clean_causal, within_block_causal=wbc
    )
    batch = build_batch(rows, cfg, IDS, noise_generator(1, 0, 0))
    m = batch.meta
    checked = 0
    with torch.no_grad():
        logits = TwoStreamLM(model, cfg).logits(batch)
        assert reference.config._attn_implementation == "sdpa" != model.config._attn_implementation
        for r, samples in enumerate(rows):
            for d, sample in enumerate(samples):
                for view in range(1, cfg.views + 1):
                    sel = (m.doc[r] == d) & (m.stream[r] == view)
                    for blk in m.blk[r, sel].unique().tolist():
                        rows_b = (sel & (m.blk[r] == blk)).nonzero().flatten()
                        start = int(m.bstart[r, rows_b[0]])
                        block_ids = batch.input_ids[r, rows_b].tolist()
                        want = single_stream_reference(reference, sample, start, block_ids, bd, clean_causal, wbc)
                        tol = 5e-5 if arch == "qwen3_5" else 2e-5
                        torch.testing.assert_close(logits[r, rows_b], want, atol=tol, rtol=1e-5)
                        checked += 1
    assert checked >= 2 * pack * turns * 2
