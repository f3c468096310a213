"""benchmark/interleave.py, the decode benchmarks' timing rule: each slice of the requests is run by every
variant in turn, the order rotating by slice, outputs landing back in request order, per-round tokens and
seconds kept for the spread."""

import pytest

from benchmark.interleave import run_interleaved, slices


def test_slices_cover_the_requests_and_fill_the_concurrency():
    assert slices(10, 3) == [range(0, 3), range(3, 6), range(6, 10)]
    assert slices(10, 5, concurrency=4) == [range(0, 5), range(5, 10)]  # 5 rounds of 2 would not fill 4 in flight
    assert slices(3, 5, concurrency=8) == [range(0, 3)]


def test_every_variant_runs_each_slice_in_a_rotating_order():
    calls = []
    clock = {"a": 1.0, "b": 2.0, "c": 4.0}  # seconds a request takes per variant

    def runner(name):
        def run(batch):
            calls.append((name, list(batch)))
            return [f"{name}:{x}" for x in batch], clock[name] * len(batch)

        return run

    got = run_interleaved({n: runner(n) for n in "abc"}, list(range(7)), rounds=3, concurrency=1, tokens=lambda out: 10)
    assert [name for name, _ in calls] == list("abc" + "bca" + "cab")
    assert [batch for name, batch in calls if name == "b"] == [[0, 1], [2, 3], [4, 5, 6]]
    assert got.outputs["c"] == [f"c:{i}" for i in range(7)]
    assert got.per_round["a"] == [[20, 2.0], [20, 2.0], [30, 3.0]] and got.seconds["a"] == 7.0
    assert got.tok_s("c") == pytest.approx(70 / 28)
    assert got.round_ratios("a", "b") == pytest.approx([2.0, 2.0, 2.0])
