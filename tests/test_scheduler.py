"""Continuous batching (inference/native/scheduler.py, bdcore/decode/runner.py): requests decoded together
give exactly what each gives alone, in every mode and any mix of modes, dense and hybrid; a cancelled
or failing request leaves the others untouched."""

import threading
import time

import pytest
import torch

from bdcore.decode.driver import DecodeLoop
from bdcore.decode.rows import Forward, Rows
from bdcore.decode.runner import ModelRunner
from bdcore.decode.sampling import SamplingParams
from bdcore.decode.sequence import SequenceCache
from bdcore.loading import load_checkpoint
from inference.native.engine import Cancelled, DecodeConfig, Engine
from inference.native.scheduler import Scheduler
from tests.test_invariant_4_self_spec import _prompts
from tests.tiny import tiny_checkpoint

pytestmark = pytest.mark.e2e  # a whole program, server or long sweep: `pytest -m 'not e2e'` skips it

MAX_TOKENS = (24, 7, 24, 13, 24, 3, 24, 24)


@pytest.fixture(
    scope="module",
    params=[
        ("qwen3", True),
        ("llama", True),
        ("qwen3", False),
        ("qwen3_5", True),
        ("qwen3_5", False),
        ("qwen3", "unshifted"),  # single-stream: unshifted canvases, causal mode block by block
        ("qwen3_moe", True),  # mixture of experts
    ],
    ids=str,
)
def loaded(request, tmp_path_factory):
    arch, clean_causal = request.param
    path = tmp_path_factory.mktemp(arch)
    shift = clean_causal != "unshifted"
    return load_checkpoint(tiny_checkpoint(path, arch=arch, bd_size=4, clean_causal=clean_causal is True, shift=shift))


def _concurrently(fn, n):
    results, errors = [None] * n, [None] * n

    def run(i):
        try:
            results[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 (recorded for the assertion)
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return results, errors


def _decodes(loaded):
    modes = [DecodeConfig(mode="causal"), DecodeConfig(mode="diffusion", threshold=0.5)]
    if loaded.sidecar.clean_causal:
        modes += [DecodeConfig(mode="self-spec"), DecodeConfig(mode="self-spec", self_spec_canvases="all")]
    return modes


@pytest.mark.parametrize("mix", [False, True], ids=["one-mode", "mixed-modes"])
def test_batched_equals_one_by_one(loaded, mix):
    engine = Engine(loaded)
    prompts = _prompts(loaded.tokenizer, len(MAX_TOKENS), seed=5)
    params = [SamplingParams(max_tokens=m) for m in MAX_TOKENS]
    decodes = _decodes(loaded)
    plans = [[decodes[i % len(decodes)] for i in range(len(prompts))]] if mix else [[d] * len(prompts) for d in decodes]
    for plan in plans:
        scheduler = Scheduler(engine, max_batch=8)
        want = [engine.generate(p, q, d) for p, q, d in zip(prompts, params, plan)]
        got, errors = _concurrently(
            lambda i, s=scheduler, d=plan: s.generate(prompts[i], params[i], d[i]), len(prompts)
        )
        assert errors == [None] * len(prompts)
        for a, b in zip(want, got):
            assert (b.tokens, b.finish_reason, b.stats.forwards) == (a.tokens, a.finish_reason, a.stats.forwards)
        assert max(scheduler.batch_sizes) > 1, "requests really shared forwards"


def test_batched_logits_match_one_sequence_forwards(loaded):
    """A forward over three sequences (padded caches and rows) == each sequence's forward alone (a batch of
    one, whose cache goes in unpadded), also after a rollback crop."""
    model, mask = loaded.model, loaded.mask_id
    prompts = _prompts(loaded.tokenizer, 3, seed=9)
    runner = ModelRunner.for_checkpoint(model, loaded.capabilities)
    batched = [SequenceCache() for _ in prompts]
    alone = [SequenceCache() for _ in prompts]
    steps = [
        [(Rows().clean(p, 0), len(p)) for p in prompts],
        [(Rows().clean([5, 6], len(p)).canvas([mask] * 3, len(p) + 2), 2) for p in prompts],
        [(Rows().canvas([7, mask, mask, mask], len(p) + 2), 0) for p in prompts],
    ]
    for step in steps:
        got = runner.forward([(c, Forward(rows, keep)) for c, (rows, keep) in zip(batched, step)])
        for g, cache, (rows, keep) in zip(got, alone, step):
            torch.testing.assert_close(g, runner.forward([(cache, Forward(rows, keep))])[0], atol=1e-4, rtol=1e-4)
        assert [c.length for c in batched] == [c.length for c in alone]
    # a rollback forward, cut back by one token in both
    for cache in (batched[0], alone[0]):
        runner.forward([(cache, Forward(Rows().clean([9, 10, 11], cache.length), 3, rollback=True))])
        cache.crop(cache.length - 1)
    rows = Rows().clean([9], batched[0].length)
    got = runner.forward(
        [(batched[0], Forward(rows, 1)), (batched[1], Forward(Rows().clean([4], batched[1].length), 1))]
    )
    torch.testing.assert_close(got[0], runner.forward([(alone[0], Forward(rows, 1))])[0], atol=1e-4, rtol=1e-4)


def test_cancelled_request_leaves_the_batch_intact(tmp_path):
    loaded = load_checkpoint(tiny_checkpoint(tmp_path, bd_size=4))
    engine = Engine(loaded, DecodeConfig(mode="self-spec"))
    scheduler = Scheduler(engine, max_batch=4)
    prompts = _prompts(loaded.tokenizer, 4, seed=11)
    params = SamplingParams(max_tokens=40)
    cancel = threading.Event()
    want = [engine.generate(p, params) for p in prompts]
    assert len(want[0].tokens) > 2, "the cancelled request would have gone on"

    def run(i):
        if i == 0:
            return scheduler.generate(prompts[0], params, on_text=lambda _d: cancel.set(), cancel=cancel)
        return scheduler.generate(prompts[i], params)

    got, errors = _concurrently(run, 4)
    assert isinstance(errors[0], Cancelled)
    assert [g.tokens for g in got[1:]] == [w.tokens for w in want[1:]]


def test_bad_settings_fail_in_the_caller(tmp_path):
    dense = load_checkpoint(tiny_checkpoint(tmp_path / "d", bd_size=4))
    with pytest.raises(ValueError, match="exceeds the trained block size"):
        Scheduler(Engine(dense), 4).generate([1, 2, 3], SamplingParams(), DecodeConfig(mode="self-spec", draft_len=9))
    with pytest.raises(ValueError, match="max_batch"):
        Scheduler(Engine(dense), 0)


def test_decode_loop_batches_admits_and_retires(loaded):
    """The one decode loop (bdcore/decode/driver.py) with room for 3 of 8 requests: each request decodes
    exactly what it decodes alone, a forward never carries more than 3, and a request whose decoder fails
    (cancelled here) is retired with its error while the others go on (`catch`)."""
    engine = Engine(loaded)
    prompts = _prompts(loaded.tokenizer, len(MAX_TOKENS), seed=6)
    params = [SamplingParams(max_tokens=m) for m in MAX_TOKENS]
    want = [engine.generate(p, q) for p, q in zip(prompts, params)]
    cancelled = threading.Event()
    cancelled.set()
    loop = DecodeLoop(engine.driver, 3, catch=True)
    pending, outs, errors, widest = list(range(len(prompts))), {}, {}, 0
    while pending or loop.active:
        while pending and loop.room:
            i = pending.pop(0)
            decoder, outs[i] = engine.start(prompts[i], params[i], cancel=cancelled if i == 2 else None)
            loop.admit(i, decoder)
        widest = max(widest, len(loop.active))
        errors.update(loop.step())
    assert widest == 3 and sorted(errors) == list(range(len(prompts)))
    assert isinstance(errors.pop(2), Cancelled) and set(errors.values()) == {None}
    for i in errors:
        got = outs[i].generation()
        assert (got.tokens, got.finish_reason, got.stats.forwards) == (
            want[i].tokens,
            want[i].finish_reason,
            want[i].stats.forwards,
        )


def test_the_scheduler_can_decode_on_the_thread_that_loaded_the_model(tmp_path):
    """`run_here` (what serve.py does: one thread runs every torch op, see inference/server/run.py): requests
    from other threads are decoded on the calling thread, equal to the engine alone, and it returns once its
    stop is set; a scheduler already decoding on some thread refuses a second."""
    loaded = load_checkpoint(tiny_checkpoint(tmp_path, bd_size=4))
    engine = Engine(loaded)
    sched = Scheduler(engine, max_batch=4)
    params = SamplingParams(max_tokens=6)
    prompts = _prompts(loaded.tokenizer, 3)
    alone = [engine.generate(p, params).tokens for p in prompts]
    seen, stop = set(), threading.Event()
    real_forward = engine.driver.forward

    def forward(decoders):
        seen.add(threading.get_ident())
        return real_forward(decoders)

    engine.driver.forward = forward

    def clients():
        try:
            results, errors = _concurrently(lambda i: sched.generate(prompts[i], params).tokens, len(prompts))
            clients.out = (results, errors)
        finally:
            stop.set()

    sched.claim_here()  # as serve.py does: requests may arrive before run_here starts, and wait for it
    threading.Thread(target=clients).start()
    time.sleep(0.05)  # let them queue first: they must not start a scheduler thread of their own
    sched.run_here(stop)
    results, errors = clients.out
    assert errors == [None] * len(prompts) and results == alone
    assert seen == {threading.get_ident()}, "every forward ran on the thread that called run_here"
    with pytest.raises(RuntimeError, match="already decodes"):
        sched.run_here(threading.Event())
