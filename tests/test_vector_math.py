"""MKL's vector math is settled (one serial call) before the first forward of every process that runs models:
the loaders, the trainer's model build and this suite (bdcore/vector_math.py says which race it avoids;
the race itself shows in about one fresh Intel process in ten, so `benchmark/vector_math_race.py`, not a
test, reproduces it)."""

import pytest

import bdcore.vector_math as vector_math
from benchmark.tiny import tiny_model


class Settled(Exception):
    pass


def _raise_settled():
    raise Settled


def test_the_suite_settles_before_any_test_runs():
    assert vector_math._settled


def test_loading_weights_settles_first(monkeypatch, tmp_path):
    import bdcore.loading as loading

    tiny_model().save_pretrained(tmp_path)
    monkeypatch.setattr(loading, "settle_vector_math", _raise_settled)
    with pytest.raises(Settled):
        loading.load_weights(tmp_path)


def test_the_trainers_model_build_settles_first(monkeypatch):
    """Also a model built from a config, which never goes through `load_weights`."""
    import train.build as build

    monkeypatch.setattr(build, "settle_vector_math", _raise_settled)
    with pytest.raises(Settled):
        build.build_model(None, None, None)  # settled before the config is read


def test_the_race_script_runs_both_arms(capsys):
    from benchmark.vector_math_race import main

    assert main(["--processes", "1"]) == 0
    out = capsys.readouterr().out
    assert "cold:" in out and "settled: 0 of 1 processes wrong" in out


def test_a_reference_path_far_from_the_truth_fails_the_comparison():
    """What the race did to the frozen-clean test: the joint (reference) forward 1.6e-3 off the fp64 truth, the
    cached (tested) one 1.2e-5; a bound scaled by the reference's own error alone let that pass."""
    import torch

    from tests.numerics import assert_as_close_to_truth

    truth = torch.linspace(-1, 1, 64, dtype=torch.float64)
    tested = (truth + 1.2e-5).float()
    wrong_reference = (truth + 1.6e-3).float()
    assert_as_close_to_truth(tested, (truth + 1.0e-5).float(), truth, "rounding")
    with pytest.raises(AssertionError, match="the reference path's bound"):
        assert_as_close_to_truth(tested, wrong_reference, truth, "a wrong reference")
    with pytest.raises(AssertionError, match="the tested path's bound"):
        assert_as_close_to_truth(wrong_reference, tested, truth, "a wrong tested path")


def test_settling_makes_each_vector_math_call_once_on_a_few_elements(monkeypatch):
    """The settling call itself, not only its flag: each op torch sends to MKL VML (contiguous fp32) is called
    once, on fewer elements than one parallel grain (at::internal::GRAIN_SIZE, 32768), so in one thread, and
    a second settle calls nothing."""
    import torch

    ops = ("cos", "sin", "exp", "log", "tanh")
    calls = []
    for name in ops:
        op = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda t, _op=op, _name=name: calls.append((_name, t)) or _op(t))
    monkeypatch.setattr(vector_math, "_settled", False)
    vector_math.settle_vector_math()
    assert [name for name, _ in calls] == list(ops)
    for name, t in calls:
        assert t.dtype == torch.float32 and t.is_contiguous() and 0 < t.numel() < 32768, name
        assert t.device.type == "cpu", name
    assert vector_math._settled
    vector_math.settle_vector_math()
    assert len(calls) == len(ops), "settled once per process"
