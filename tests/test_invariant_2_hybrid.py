"""Invariant 2 (hybrid): each noised block of the two-stream forward equals a single-stream forward
of [clean prefix, noised block] whose gated-delta layers start the block from the clean state before
it and read the block-end state (stock conv and stock token-by-token recurrence underneath)."""

import random
import types

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn, l2norm, torch_recurrent_gated_delta_rule

from tests.test_invariant_2_noised_blocks import IDS
from tests.tiny import random_sample, tiny_hybrid_model
from train.config import BlockDiffusionConfig
from train.model import TwoStreamLM
from train.noise import noise_generator
from train.rows import build_batch


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


def reference_block_logits(model, sample, start, block_ids, bd, clean_causal, wbc):
    prefix = list(sample.input_ids[:start])
    P, Bn = len(prefix), len(block_ids)
    pieces, limit = [], list(range(P))
    if clean_causal:
        pieces.append((0, P, False))
    else:
        t = 0
        spans = [(s, min(e, P)) for s, e in sample.spans if s < P]
        for s, e in spans:
            if t < s:
                pieces.append((t, s, False))
            for b0 in range(s, e, bd):
                b1 = min(e, b0 + bd)
                pieces.append((b0, b1, True))
                for i in range(b0, b1):
                    limit[i] = b1 - 1
            t = e
        if t < P:
            pieces.append((t, P, False))
    pieces.append((P, P + Bn, not wbc))
    mask = torch.zeros(P + Bn, P + Bn, dtype=torch.bool)
    for i in range(P):
        mask[i, : limit[i] + 1] = True
    mask[P:, :P] = True
    mask[P:, P:] = torch.tril(torch.ones(Bn, Bn, dtype=torch.bool)) if wbc else True
    out = model(
        input_ids=torch.tensor([prefix + block_ids]),
        position_ids=torch.arange(P + Bn)[None],
        attention_mask={"full_attention": mask[None, None], "linear_attention": pieces},
    )
    return out.logits[0, P:]


@pytest.mark.parametrize(
    "clean_causal,wbc,turns,pack", [(True, False, 1, 1), (True, True, 2, 2), (False, False, 2, 1), (True, False, 3, 2)]
)
def test_noised_block_equals_single_stream_from_clean_state(clean_causal, wbc, turns, pack):
    ref = tiny_hybrid_model()
    for layer in ref.get_decoder().layers:
        if hasattr(layer, "linear_attn"):
            layer.linear_attn.forward = types.MethodType(piecewise_forward, layer.linear_attn)
    model = tiny_hybrid_model()
    bd = 4
    rng = random.Random(turns * 10 + pack)
    rows = [[random_sample(rng, turns=turns, max_prompt=9, max_resp=11) for _ in range(pack)] for _ in range(2)]
    cfg = BlockDiffusionConfig(
        bd_size=bd, ar_loss_weight=0.3 if clean_causal else 0.0, clean_causal=clean_causal, within_block_causal=wbc
    )
    batch = build_batch(rows, cfg, IDS, noise_generator(2, 0, 0))
    m = batch.meta
    checked = 0
    with torch.no_grad():
        logits = TwoStreamLM(model, cfg).logits(batch)
        for r, samples in enumerate(rows):
            for d, sample in enumerate(samples):
                for view in (1, 2):
                    sel = (m.doc[r] == d) & (m.stream[r] == view)
                    for blk in m.blk[r, sel].unique().tolist():
                        idx = (sel & (m.blk[r] == blk)).nonzero().flatten()
                        want = reference_block_logits(
                            ref,
                            sample,
                            int(m.bstart[r, idx[0]]),
                            batch.input_ids[r, idx].tolist(),
                            bd,
                            clean_causal,
                            wbc,
                        )
                        torch.testing.assert_close(logits[r, idx], want, atol=5e-5, rtol=1e-5)
                        checked += 1
    assert checked >= 8
