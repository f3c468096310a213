"""A decode forward writes its new keys/values in place (bdcore/decode/sequence.py `SequenceCache.reserve`,
bdcore/decode/runner.py `written_in_place`): a cache lives in buffers with room past its tokens, a step
appends into them without copying the cache, a batch reads the caches right-padded with the padding zeroed,
and what every sequence gets equals what it gets alone."""

import pytest
import torch

from bdcore.decode.rows import Forward, Rows
from bdcore.decode.runner import ModelRunner
from bdcore.decode.sequence import SequenceCache
from bdcore.loading import load_checkpoint
from tests.tiny import tiny_checkpoint


def _cache(length, layers=3):
    return SequenceCache(
        keys=[torch.randn(2, length, 4) for _ in range(layers)],
        values=[torch.randn(2, length, 4) for _ in range(layers)],
    )


def test_reserve_keeps_the_cache_and_grows_by_a_quarter():
    cache = _cache(5)
    want = [t.clone() for t in (*cache.keys, *cache.values)]
    keys, values = cache.reserve(7)
    assert len(keys) == len(values) == 3 and keys[0].shape == (2, 7 + 64, 4)  # at least 64 tokens of room
    assert all(torch.equal(a, b) for a, b in zip((*cache.keys, *cache.values), want))
    assert cache.keys[0].data_ptr() == keys[0].data_ptr() and cache.values[2].data_ptr() == values[2].data_ptr()
    keys[1][:, 5:7] = 1.0  # a forward's two new rows, written in place
    cache.keep(7)
    assert cache.length == 7 and torch.equal(cache.keys[1][:, 5:], torch.ones(2, 2, 4))
    assert cache.reserve(60)[0][0] is keys[0]  # room enough: the same buffers
    cache.crop(3)  # a rollback keeps views of the buffers
    assert cache.reserve(71)[0][0] is keys[0]
    grown, _ = cache.reserve(400)  # no room: a quarter more than asked, the cache copied once
    assert grown[0].shape[1] == 500 and grown[0] is not keys[0]
    assert all(torch.equal(a, b[:, :3]) for a, b in zip((*cache.keys, *cache.values), want))
    cache.keys = [k.clone() for k in cache.keys]  # tensors of a runner's own: not the buffers any more
    moved, _ = cache.reserve(4)
    assert moved[0] is not grown[0] and torch.equal(cache.keys[0], want[0][:, :3])


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def runner(request, tmp_path_factory):
    path = tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch=request.param, bd_size=4)
    return ModelRunner(load_checkpoint(path).model, banned=None)


def test_batched_steps_write_in_place_and_never_read_the_padding(runner, monkeypatch):
    """Three sequences of different lengths step together for a few tokens and equal each one stepping
    alone. Every new buffer starts as NaN: padding that were not zeroed (or a row not written) would turn a
    batched sequence's logits to NaN. Between steps each cache stays in the same buffers (no copy)."""
    real_new_empty = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda t, *a, **k: real_new_empty(t, *a, **k).fill_(float("nan")))
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]
    batched, alone = [SequenceCache() for _ in prompts], [SequenceCache() for _ in prompts]
    with torch.no_grad():
        for caches in (batched, alone):
            for cache, p in zip(caches, prompts):
                runner.forward([(cache, Forward(Rows().clean(p, 0), len(p)))])
        for step in range(4):
            token = 20 + step
            ops = [Forward(Rows().clean([token, token + 1], len(p) + 2 * step), 2) for p in prompts]
            before = [c.keys[0].data_ptr() for c in batched]
            got = runner.forward(list(zip(batched, ops)))
            want = [runner.forward([(c, op)])[0] for c, op in zip(alone, ops)]
            for g, w in zip(got, want):
                assert not g.isnan().any()
                torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)  # as test_scheduler.py
            if step:  # the first step moved each prompt's cache into buffers with room
                assert [c.keys[0].data_ptr() for c in batched] == before
    for b, a in zip(batched, alone):
        assert b.length == a.length
        for x, y in zip((*b.keys, *b.values), (*a.keys, *a.values)):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


def _prompted(runner, prompts):
    caches = [SequenceCache() for _ in prompts]
    for cache, p in zip(caches, prompts):
        runner.forward([(cache, Forward(Rows().clean(p, 0), len(p)))])
    return caches


def test_a_batch_keeps_its_caches_in_one_slab_and_moves_only_what_changed(runner):
    """Sequences decoding together are rows of one buffer per layer (bdcore/decode/kv_slab.py): a step with
    the same sequences copies no cache; a join copies the newcomer into a free row, a leave moves a sequence
    from past the batch's rows into the free one, a forward of other caches in between takes rows whose
    sequences first get copies of their own. Every step equals each sequence stepping alone."""
    prompts = [[3, 4, 5, 6, 7, 8, 9], [12, 13], [14, 15, 16, 17, 18], [19, 20, 21]]
    batched, alone = _prompted(runner, prompts), _prompted(runner, prompts)
    others = _prompted(runner, [[30, 31, 32], [33, 34, 35, 36]])
    token = iter(range(40, 400))
    base = runner.slab.copies  # the runner is the module's: earlier tests' copies counted

    def step(members, rows=1):
        ops = []
        for i in members:
            start = next(token)
            ops.append(Forward(Rows().clean(list(range(start, start + rows)), batched[i].length), rows))
            for _ in range(rows - 1):
                next(token)
        with torch.no_grad():
            got = runner.forward([(batched[i], op) for i, op in zip(members, ops)])
            want = [runner.forward([(alone[i], op)])[0] for i, op in zip(members, ops)]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)  # as test_scheduler.py
        return runner.slab.copies - base

    assert step([0, 1, 2]) == 3  # every cache copied in once
    rows = [batched[i].room[0] for i in range(3)]  # rows of one tensor: consecutive, a row's size apart
    assert rows[1].data_ptr() - rows[0].data_ptr() == rows[0].numel() * rows[0].element_size()
    assert step([0, 1, 2], rows=2) == step([0, 1, 2]) == 3  # the same batch: no copy
    with torch.no_grad():  # other caches in between (the cost model's calibration does this)
        runner.forward([(c, Forward(Rows().clean([50 + i], c.length), 1)) for i, c in enumerate(others)])
    assert runner.slab.copies - base == 5
    assert step([0, 1, 2]) == 7  # back in their rows, their caches intact
    assert step([0, 2]) == 8  # a request left: the one past the batch's rows moved into its row
    assert step([2, 0, 3]) == 9  # one joined (and any order is the rows' order)
    assert step([0, 2, 3], rows=3) == 9
    step([1])  # alone: decodes in the copy it got when it lost its row
    for b, a in zip(batched, alone):
        assert b.length == a.length
        for x, y in zip((*b.keys, *b.values), (*a.keys, *a.values)):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
