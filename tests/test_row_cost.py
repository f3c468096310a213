"""The decode forward's cost model (bdcore/decode/policy/cost.py), which the `auto` self-spec policy reads: a curve
interpolates, never falls with rows and follows live timings; a batch size without a curve reads its
neighbours'; calibration times every (batch, rows) shape in rounds until enough time is measured and keeps
each shape's median; a measurement is cached per checkpoint, dtype and thread count."""

import pytest

from bdcore.decode.policy.cost import ForwardCost, RowCost, calibrate, load_or_calibrate
from bdcore.loading import load_checkpoint
from inference.native.engine import Engine
from tests.tiny import tiny_checkpoint


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def checkpoint(request, tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch=request.param, bd_size=4)


def test_row_cost_interpolates_and_follows_live_timings():
    cost = RowCost({1: 1.0, 4: 2.5, 8: 3.0})
    assert cost(1) == 1.0 and cost(2) == pytest.approx(1.5) and cost(6) == pytest.approx(2.75)
    assert cost(16) == pytest.approx(4.0)  # beyond the last point: along the last segment
    assert cost(0) == 1.0
    cost.observe(4, 4.5)
    assert cost(4) == pytest.approx(0.8 * 2.5 + 0.2 * 4.5)
    cost.observe(12, 10.0)  # a new row count starts from the curve (3.1 there), not from one noisy timing
    assert cost(12) == pytest.approx(0.8 * 3.1 + 0.2 * 10.0)
    with pytest.raises(ValueError, match="positive"):
        RowCost({1: 0.0})


def test_row_cost_curve_never_falls_with_rows():
    """Timing noise (32 rows timed faster than 16) is pooled away: the curve is the isotonic fit."""
    cost = RowCost({1: 1.0, 16: 3.0, 32: 2.0, 64: 4.0})
    assert cost(16) == cost(24) == cost(32) == pytest.approx(2.5) and cost(64) == 4.0 and cost(1) == 1.0
    assert cost(8) == pytest.approx(1.0 + 1.5 * 7 / 15)
    assert cost.points[16] == 3.0  # the measurements themselves are kept
    cost.observe(32, 7.0)  # 0.8 * 2.0 + 0.2 * 7.0 = 3.0: no violation left
    assert cost(16) == 3.0 and cost(32) == pytest.approx(3.0)


def test_cost_measurement_is_cached_per_checkpoint(checkpoint, monkeypatch, tmp_path):
    monkeypatch.setenv("BDSTACK_CACHE_DIR", str(tmp_path))
    loaded = load_checkpoint(checkpoint)
    runner = Engine(loaded).runner
    first = load_or_calibrate(runner, checkpoint)
    assert sorted(first.points) == [1, 2, 4, 8]  # sequences in the forward
    assert sorted(first.points[1]) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert sorted(first.points[8]) == [1, 2, 4, 8, 16, 32]  # 8 x 32 = 256 rows in all
    for batch, points in first.points.items():
        assert all(first(a, batch) <= first(b, batch) for a, b in zip(sorted(points), sorted(points)[1:]))

    def no_measuring(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr("bdcore.decode.policy.cost.calibrate", no_measuring)
    assert load_or_calibrate(runner, checkpoint).points == first.points
    (path,) = tmp_path.glob("row_cost/*.json")
    path.write_text("{not json")
    monkeypatch.undo()
    monkeypatch.setenv("BDSTACK_CACHE_DIR", str(tmp_path))
    assert sorted(load_or_calibrate(runner, checkpoint).points) == sorted(first.points)  # a damaged file: again


def test_calibration_times_rounds_until_enough_time_is_measured():
    """Fast forwards are timed in more rounds (up to max_rounds), every size in every round."""
    import types

    calls = []
    runner = types.SimpleNamespace(
        model=types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=50)),
        device=types.SimpleNamespace(type="cpu"),
        forward=lambda batch: calls.append(len(batch[0][1].rows.tokens)),
    )
    calibrate(runner, sizes=(1, 4), batches=(1,), context=8, repeats=2, min_seconds=0.0)
    assert calls == [8] + [1, 4] * 3  # the cache's prefill, a warm-up round, `repeats` timed rounds
    calls.clear()
    calibrate(runner, sizes=(1, 4), batches=(1,), context=8, repeats=2, min_seconds=60.0, max_rounds=5)
    assert calls == [8] + [1, 4] * 6  # instant forwards never add up to a minute: max_rounds timed rounds


def test_calibration_keeps_each_size_s_median_timing(monkeypatch):
    """A size's cost is the median of its timed rounds (robust to one round hit by a burst of load), not
    the middle timing in the order taken. The clock is faked: each forward advances it by a set time."""
    import types

    clock = [0.0]
    # the cache's prefill, the warm-up round (sizes 1 and 4), then three timed rounds of (size 1, size 4)
    took = iter([0.0, 9.0, 9.0, 5.0, 8.0, 1.0, 2.0, 3.0, 9.0])
    runner = types.SimpleNamespace(
        model=types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=50)),
        device=types.SimpleNamespace(type="cpu"),
        forward=lambda batch: clock.__setitem__(0, clock[0] + next(took)),
    )
    monkeypatch.setattr("bdcore.decode.policy.cost.time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    cost = calibrate(runner, sizes=(1, 4), batches=(1,), context=8, repeats=3, min_seconds=0.0)
    assert cost.points == {1: {1: 3.0, 4: 8.0}}  # medians of [5, 1, 3] and [8, 2, 9]


def test_a_cost_measured_at_other_threads_is_measured_again(monkeypatch, tmp_path):
    """The cached curve is per intra-op thread count: a CPU forward at 1 thread costs about twice one at
    2, so a curve from a 2-thread run read at 1 would misprice every layout."""
    import types

    import torch

    monkeypatch.setenv("BDSTACK_CACHE_DIR", str(tmp_path / "cache"))
    measured = []

    def fake_calibrate(runner):  # "measures" the thread count, so the curve read back names its run
        measured.append(torch.get_num_threads())
        return ForwardCost({1: {1: float(measured[-1])}})

    monkeypatch.setattr("bdcore.decode.policy.cost.calibrate", fake_calibrate)
    runner = types.SimpleNamespace(model=torch.nn.Linear(1, 1), device=torch.device("cpu"), compiled=None)
    (tmp_path / "ckpt").mkdir()
    threads = torch.get_num_threads()
    try:
        got = []
        for n in (2, 1, 2, 1):
            torch.set_num_threads(n)
            got.append(load_or_calibrate(runner, tmp_path / "ckpt").points)
    finally:
        torch.set_num_threads(threads)
    assert measured == [2, 1] and got == [{1: {1: 2.0}}, {1: {1: 1.0}}, {1: {1: 2.0}}, {1: {1: 1.0}}]


def test_a_cost_measured_by_other_decode_code_is_measured_again(monkeypatch, tmp_path):
    """A change to the code a decode forward runs through (the runner, the draft adapter's projections)
    changes what a row costs: the cached curve of the old code must not price the new one's layouts."""
    import types

    import torch

    from bdcore.decode.policy import cost

    monkeypatch.setenv("BDSTACK_CACHE_DIR", str(tmp_path / "cache"))
    measured = []
    monkeypatch.setattr(
        cost, "calibrate", lambda runner: measured.append(1) or ForwardCost({1: {1: float(len(measured))}})
    )
    runner = types.SimpleNamespace(model=torch.nn.Linear(1, 1), device=torch.device("cpu"), compiled=None)
    (tmp_path / "ckpt").mkdir()
    first = load_or_calibrate(runner, tmp_path / "ckpt").points
    assert load_or_calibrate(runner, tmp_path / "ckpt").points == first and len(measured) == 1
    assert len(cost.code_stamp()) == 12
    monkeypatch.setattr(cost, "code_stamp", lambda: "other code")
    assert load_or_calibrate(runner, tmp_path / "ckpt").points == {1: {1: 2.0}}, "measured again for the new code"
    runner.compiled = object()  # the decode step compiled (bdcore/decode/compiled_step.py): another cost
    assert load_or_calibrate(runner, tmp_path / "ckpt").points == {1: {1: 3.0}}, "measured again, compiled"


def test_calibration_times_forwards_by_rows(checkpoint):
    runner = Engine(load_checkpoint(checkpoint)).runner
    cost = calibrate(runner, sizes=(1, 64), context=8, repeats=1)
    assert cost.points.keys() == {1, 2, 4, 8} and set(cost.points[1]) == {1, 64}
    assert all(set(cost.points[b]) == {1} for b in (2, 4, 8))  # 64 rows a sequence: more than 64 in all
    assert all(s > 0 for points in cost.points.values() for s in points.values())


def test_calibration_forwards_are_shaped_as_self_spec_steps():
    """r rows are one clean (verify) row then r - 1 canvas rows: a draft adapter pays its LoRA at canvas rows
    only, so a curve timed on clean rows would price drafting at the causal step's cost (issue 41)."""
    import types

    from bdcore.decode.rows import CANVAS_STREAM, CLEAN_STREAM

    seen = []

    class Recorder:
        model = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=50))
        device = types.SimpleNamespace(type="cpu")

        def forward(self, batch):
            caches = {id(cache) for cache, _ in batch}
            assert len(caches) == len(batch), "every sequence of a forward has a cache of its own"
            seen.append([tuple(op.rows.stream) for _, op in batch])

    calibrate(Recorder(), sizes=(1, 4, 8), batches=(1, 2), context=6, repeats=1, min_seconds=0.0)
    prefill, *steps = seen
    assert prefill == [(CLEAN_STREAM,) * 6] * 2  # both sequences' caches, in one forward
    step = {r: (CLEAN_STREAM,) + (CANVAS_STREAM,) * (r - 1) for r in (1, 4, 8)}
    # 2 sequences of 8 rows would be 16 rows in all, more than the largest size: not timed
    assert {(len(s), s[0]) for s in steps} == {(1, step[1]), (1, step[4]), (1, step[8]), (2, step[1]), (2, step[4])}
    assert all(len(set(s)) == 1 for s in steps)  # the sequences of one forward alike


def test_a_batch_size_without_a_curve_reads_its_neighbours():
    """Between two curves: interpolated at each row count; beyond the largest: along the last two, never
    below the largest; with one curve, a batch of b as one sequence of b times the rows (the rule before
    batches were measured); fewer sequences than any curve: the fewest's."""
    cost = ForwardCost({2: {1: 2.0, 8: 4.0}, 4: {1: 3.0, 8: 7.0}})
    assert cost(1, 2) == 2.0 and cost(8, 4) == 7.0 and cost(4, 2) == pytest.approx(2.0 + 2.0 * 3 / 7)
    assert cost(1, 3) == pytest.approx(2.5) and cost(8, 3) == pytest.approx(5.5)
    assert cost(1, 8) == pytest.approx(3.0 + 4 * 0.5) and cost(8, 8) == pytest.approx(7.0 + 4 * 1.5)
    assert cost(8, 1) == 4.0  # fewer sequences than any curve
    one = ForwardCost({1: {1: 1.0, 16: 2.0, 64: 5.0}})
    assert one(2, 8) == one(16) == 2.0 and one(8, 8) == one(64)
    # an extrapolation that would fall with rows (the larger batch's curve steeper early) is fitted away
    odd = ForwardCost({1: {1: 1.0, 4: 1.0, 8: 3.0}, 2: {1: 2.0, 4: 4.0, 8: 4.0}})
    assert all(odd(a, 6) <= odd(b, 6) for a, b in [(1, 4), (4, 8), (8, 16)])
    with pytest.raises(ValueError, match="batch sizes >= 1"):
        ForwardCost({})


def test_live_timings_move_their_own_batch_size_s_curve():
    cost = ForwardCost({1: {1: 1.0, 8: 2.0}, 8: {1: 3.0, 8: 9.0}})
    cost.observe(8, 14.0, 8)
    assert cost(8, 8) == pytest.approx(0.8 * 9.0 + 0.2 * 14.0) and cost(8, 1) == 2.0
    assert cost(8, 4) == pytest.approx((4 * 2.0 + 3 * 10.0) / 7)  # the read curve follows its neighbour's timing
    cost.observe(1, 10.0, 4)  # a batch size without a curve: it starts from the curve read there
    read_1 = (4 * 1.0 + 3 * 3.0) / 7
    assert cost.points[4] == {1: pytest.approx(0.8 * read_1 + 0.2 * 10.0), 8: pytest.approx(38 / 7)}
    cost.observe(1, 0.0, 2) or cost.observe(0, 1.0, 2)  # nonsense timings are ignored
    assert 2 not in cost.points
    assert ForwardCost.from_dict(cost.to_dict()).points == cost.points


def test_calibration_times_a_batch_after_its_caches_moved_into_their_slab(monkeypatch):
    """A batch's first forward after another batch moves its caches into a slab of their own (kv_slab.py), a
    copy a served batch makes only when it changes: calibration runs it untimed before the batch's timed
    shapes in every round, or the first shape of each batch would be priced with a copy of every cache."""
    import types

    clock, shapes = [0.0], []

    def forward(batch):
        rows = len(batch[0][1].rows.tokens)
        shapes.append((len(batch), rows))
        moved = len(batch) > 1 and len(shapes) > 1 and shapes[-2][0] != len(batch)  # another batch ran last
        clock[0] += 9.0 if moved else float(len(batch) * rows)

    runner = types.SimpleNamespace(
        model=types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=50)),
        device=types.SimpleNamespace(type="cpu"),
        forward=forward,
    )
    monkeypatch.setattr("bdcore.decode.policy.cost.time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    cost = calibrate(runner, sizes=(1, 2), batches=(1, 2), context=8, repeats=2, min_seconds=0.0)
    assert shapes == [(2, 8)] + [(1, 1), (1, 2), (2, 1), (2, 1)] * 3  # the prefill, then each round
    assert cost.points == {1: {1: 1.0, 2: 2.0}, 2: {1: 2.0}}
