"""The engine's gated-delta decode forward: chunked absorption (prefill, commits, canvases) equals the
token-by-token recurrence exactly (float64), and only rollback forwards keep per-row snapshots."""

import random

import pytest
import torch

from bdcore.decode.gated_delta_layers import absorb, recurrent_step
from bdcore.decode.rows import Rows
from bdcore.gated_delta import l2norm
from tests.one_sequence import OneSequence
from tests.tiny import tiny_hybrid_model


def _inputs(T, H=3, dk=8, dv=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q = l2norm(rand(T, H, dk)) * dk**-0.5
    k = l2norm(rand(T, H, dk))
    g = -torch.rand(T, H, generator=gen, dtype=torch.float64)
    beta = torch.rand(T, H, generator=gen, dtype=torch.float64)
    return q, k, rand(T, H, dv), g, beta, rand(H, dk, dv)


def _recurrence(S, q, k, v, g, beta):
    outs = []
    for t in range(q.shape[0]):
        S, o = recurrent_step(S, q[t], k[t], v[t], g[t], beta[t])
        outs.append(o)
    return torch.stack(outs), S


@pytest.mark.parametrize("T,chunk", [(1, 64), (63, 64), (64, 64), (150, 64), (150, 7)])
def test_chunked_absorb_equals_recurrence(T, chunk):
    q, k, v, g, beta, S0 = _inputs(T)
    want, want_S = _recurrence(S0, q, k, v, g, beta)
    got, got_S = absorb(S0, q, k, v, g, beta, chunk=chunk)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(got_S, want_S, atol=1e-12, rtol=1e-12)


def test_block_end_readout_reads_the_canvas_end_state():
    q, k, v, g, beta, S0 = _inputs(9, seed=1)
    _, end = _recurrence(S0, q, k, v, g, beta)
    got, got_S = absorb(S0, q, k, v, g, beta, end_readout=True)
    torch.testing.assert_close(got, torch.einsum("hkv,thk->thv", end, q), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(got_S, end, atol=1e-12, rtol=1e-12)


def test_long_prefill_commits_the_state_at_keep_without_snapshots():
    model = tiny_hybrid_model()
    rng = random.Random(3)
    ids = [rng.randrange(5, 90) for _ in range(200)]
    assert len(set(ids)) > 20, "a varied prompt (one seeded generator, not one per token)"

    def run(rollback):
        r = OneSequence(model)
        a = r.forward(Rows().clean(ids[:170], 0), keep=130, rollback=rollback)
        b = r.forward(Rows().clean(ids[130:133], 130).canvas([7, 8, 9, 10], 133), keep=3)
        return r, a, b

    chunked, a, b = run(False)
    stepped, a2, b2 = run(True)
    torch.testing.assert_close(a, a2, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(b, b2, atol=1e-4, rtol=1e-4)
    assert not chunked.cache.plan.steps, "a forward that is not rolled back keeps no per-row states"
    with pytest.raises(ValueError, match="rollback=True"):
        chunked.crop_to(chunked.length - 1)


def test_each_forward_gets_a_cache_that_shares_nothing_with_the_runners_template():
    """The runner copies one blank cache per forward (building it from the config costs ~1 ms a forward);
    a hybrid model's linear-attention layers hold dicts of per-state flags, which a forward that wrote them
    through a shallow copy would leave set in every later forward's cache."""
    from bdcore.decode.runner import ModelRunner

    runner = ModelRunner(tiny_hybrid_model(), banned=None)
    template = runner._cache_template.layers
    before = [{k: (dict(v) if isinstance(v, dict) else v) for k, v in vars(layer).items()} for layer in template]
    assert any(isinstance(v, dict) for b in before for v in b.values()), "the hybrid cache has per-state dicts"
    kv = runner._blank_cache()
    for layer in kv.layers:
        for v in vars(layer).values():
            if isinstance(v, dict):
                v[0] = "written"
    assert [vars(layer) for layer in template] == before
