"""benchmark/draft_curve.py: the evaluated steps of a run with the tokens and minutes read up to them, and the
log fit, on a metrics file written here whose figures follow a known law."""

import json
import math

import pytest

from benchmark.draft_curve import log_fit, main, read_curve


def _run(tmp_path, steps=40, every=8, a=1.1, b=0.05):
    lines, tokens = [], 0.0
    for step in range(1, steps + 1):
        dt, rate = 2.0 + step % 3, 500.0  # tokens per step vary with the step time
        tokens += rate * dt
        r = {"step": step, "tokens_per_s": rate, "step_time_s": dt}
        if step % every == 0:
            r |= {
                "draft_tpf_linear": a + b * math.log(tokens),
                "draft_tpf_all": a + 2 * b * math.log(tokens),
                "draft_first_accept": 0.5,
            }
        lines.append(json.dumps(r))
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path


def test_points_carry_the_tokens_and_minutes_read_so_far(tmp_path):
    points = read_curve(_run(tmp_path))
    assert [p.step for p in points] == [8, 16, 24, 32, 40]
    dts = [2.0 + s % 3 for s in range(1, 9)]
    assert points[0].tokens == round(500 * sum(dts)) and points[0].minutes == pytest.approx(sum(dts) / 60)


def test_the_fit_recovers_the_law_and_extrapolates(tmp_path):
    points = read_curve(_run(tmp_path, a=1.1, b=0.05))
    fit = log_fit([p.tokens for p in points], [p.implied_linear for p in points])
    assert (fit.a, fit.b, fit.r2) == pytest.approx((1.1, 0.05, 1.0), abs=1e-9)
    assert fit.at(10 * points[-1].tokens) == pytest.approx(points[-1].implied_linear + 0.05 * math.log(10))
    noisy = log_fit([1e3, 1e4, 1e5], [1.0, 1.5, 1.2])
    assert noisy.r2 < 0.5


def test_a_run_without_evaluations_is_refused(tmp_path, capsys):
    _run(tmp_path, every=1000)
    with pytest.raises(SystemExit, match="needs --eval_every"):
        main([str(tmp_path)])


def test_the_record_carries_the_tokens(tmp_path):
    out = tmp_path / "rec.json"
    assert main([str(_run(tmp_path)), "--record", str(out), "--title", "t"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["step"] for r in rows] == [8, 16, 24, 32, 40] and all("tokens" in r for r in rows)


def test_median_rate_minutes_ignore_a_slowed_step(tmp_path):
    run = _run(tmp_path)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    slowed = json.loads(lines[3]) | {"step_time_s": 60.0}  # another job took the machine for one step
    slowed["tokens_per_s"] = 500.0 * (2.0 + 4 % 3) / 60.0  # the same tokens, read slowly
    lines[3] = json.dumps(slowed)
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    measured, idle = read_curve(run)[0], read_curve(run, median_rate=True)[0]
    dts = [2.0 + s % 3 for s in range(1, 9)]
    assert measured.minutes == pytest.approx((sum(dts) - dts[3] + 60.0) / 60)
    assert idle.minutes == pytest.approx(sum(dts) / 60) and idle.tokens == measured.tokens
