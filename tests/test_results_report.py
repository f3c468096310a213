"""`python -m benchmark.report` (benchmark/report.py, report_plots.py) over the schema of benchmark/record.py:
tables and plots from a small hand-made record set, superseded records moved to the history page, malformed
records refused by file and field, and the committed docs/results.md, its PNGs and the history page held to
the committed data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmark import record, report
from benchmark.report_plots import DIGEST_PREFIX, stamp

ROOT = Path(__file__).resolve().parents[1]


def _record(kind: str, rows: list[dict], **fields) -> dict:
    base = {
        "schema": record.SCHEMA,
        "kind": kind,
        "title": f"a {kind} run",
        "command": f"python -m benchmark.{kind} --flag",
        "machine": "2-core test CPU",
        "date": "2026-12-01",
        "source": "tests",
    }
    return base | fields | {"rows": rows}


SPEED_1 = [
    {"variant": "base generate", "concurrency": 1, "tok_s": 20.0, "tokens_per_forward": 1.0},
    {"variant": "causal", "concurrency": 1, "tok_s": 25.0, "tokens_per_forward": 1.0},
    {"variant": "self-spec auto", "concurrency": 1, "tok_s": 30.0, "tokens_per_forward": 1.5, "same_as_causal": 1.0},
]
SPEED_8 = [
    {"variant": "causal", "concurrency": 8, "tok_s": 40.0},
    {"variant": "self-spec auto", "concurrency": 8, "vs_causal": 1.25},  # only the ratio was recorded
]
SCALING = [
    {"minutes": 5, "tokens": 400_000, "implied_linear": 1.3, "implied_all": 1.5},
    {"minutes": 30, "implied_linear": 1.6, "implied_all": 1.9, "served_linear": 1.62, "auto_vs_causal": 1.4},
]
DIFFUSION = [
    {"setting": "causal", "accuracy": 0.8, "tokens_per_forward": 1.0},
    {"setting": "threshold 0.9", "threshold": 0.9, "accuracy": 0.7, "tokens_per_forward": 3.1},
]


@pytest.fixture
def site(tmp_path) -> dict[str, Path]:
    """A data folder of four records, the hand-written parts, and where the page and plots go."""
    data, prose = tmp_path / "data", tmp_path / "prose"
    data.mkdir()
    prose.mkdir()
    series = {"series": "tiny, fp32"}
    files = {
        "speed-c1.json": _record("speed", SPEED_1, date="2026-12-02", **series),
        "speed-c8.json": _record("speed", SPEED_8, date="2026-12-03", title="at eight", **series),
        "scaling.json": _record("scaling", SCALING, speed_withdrawn="the causal mode was slowed"),
        "diffusion.json": _record("diffusion_quality", DIFFUSION, machine="another machine"),
    }
    for name, rec in files.items():
        (data / name).write_text(json.dumps(rec))
    (prose / "intro.md").write_text("# Results\n\nHand-written intro.\n")
    (prose / "sweeps.md").write_text("## Sweeps\n\nHand-written history.\n")
    return {"data": data, "prose": prose, "out": tmp_path / "docs" / "results.md", "plots": tmp_path / "docs" / "res"}


def _argv(site: dict[str, Path], *extra: str) -> list[str]:
    args = [f"--{k}={v}" for k, v in site.items()]
    return [*args, *extra]


def _history(site: dict[str, Path]) -> Path:
    """Where the history page goes by default: history/results-older.md beside the page."""
    return site["out"].parent / "history" / "results-older.md"


def test_tables_and_plots_from_a_small_record_set(site):
    site["out"].parent.mkdir()
    assert report.main(_argv(site)) == 0
    page = site["out"].read_text()
    assert page.startswith(report.HEADER + "\n\n# Results\n\nHand-written intro.")
    # the sweep history closes the history page, which the page links relative to itself
    assert "Hand-written history." not in page and "](history/results-older.md)" in page
    assert _history(site).read_text().rstrip().endswith("Hand-written history.")
    # ratios against the base model's generate and our causal mode, computed from tok/s of the same run
    assert "| self-spec auto | 1 | 1.50 | 30.0 | 1.50x | 1.20x | 100% |" in page
    assert "| causal | 1 | 1.00 | 25.0 | 1.25x | 1.00x | - |" in page
    # a record holding only a ratio gets its tok/s from the causal row (1.25 x 40); a column no row fills
    # (here tokens/forward and vs base generate) is left out
    assert "| variant | concurrency | tok/s | vs causal |\n|---|---|---|---|\n| causal | 8 | 40.0 | 1.00x |" in page
    assert "| self-spec auto | 8 | 50.0 | 1.25x |" in page
    # withdrawn speed is struck through; tokens per forward stand; training tokens where a row has them
    assert "| training minutes | training tokens | implied linear tok/fwd |" in page
    assert "| 5.0 | 400,000 | 1.300 | 1.500 | - | - |" in page
    assert "| 30.0 | - | 1.600 | 1.900 | 1.62 | ~~1.40x~~ |" in page
    assert "| threshold 0.9 | 70.0% | 3.10 |" in page
    # every table names its command, machine and date
    for kind, machine, date in [
        ("speed", "2-core test CPU", "2026-12-02"),
        ("diffusion_quality", "another machine", ""),
    ]:
        assert f"python -m benchmark.{kind} --flag" in page
        assert f"Machine: {machine}. Date: {date or '2026-12-01'}." in page
    # the speed record with a base row is in the base section, the other in the concurrency section
    base_at, conc_at = page.index("## Speed against the base"), page.index("## Speed against concurrency")
    assert base_at < page.index("### a speed run") < conc_at < page.index("### at eight")
    for name in ("scaling.png", "concurrency.png", "diffusion.png"):
        png = site["plots"] / name
        assert f"](res/{name})" in page  # relative to the page
        assert png.stat().st_size > 5000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert stamp(png)[1].startswith(DIGEST_PREFIX)


ARMS = [
    {"arm": "sft kl", "minutes": 30.1, "steps": 560, "tokens": 540_000, "first_accepted": 0.512, "implied_linear": 1.5},
    {"arm": "draft-opd", "minutes": 29.8, "steps": 476, "first_accepted": 0.5, "implied_linear": 1.45, "ar_loss": 0.43},
]


def test_recipe_arms_have_their_own_section_and_table(site):
    (site["data"] / "arms.json").write_text(json.dumps(_record("arms", ARMS, title="arms at 30 minutes")))
    site["out"].parent.mkdir()
    assert report.main(_argv(site)) == 0
    page = site["out"].read_text()
    section = page.index("## Drafting recipes side by side")
    assert section < page.index("### arms at 30 minutes") < page.index("## Speed against the base")
    # shares as percentages, an unfilled column dropped, a cell one row lacks shown as -
    header = "| arm | training minutes | steps | training tokens | first draft accepted | implied linear tok/fwd |"
    assert header + " AR held-out loss |" in page
    assert "| sft kl | 30.1 | 560 | 540,000 | 51.2% | 1.500 | - |" in page
    assert "| draft-opd | 29.8 | 476 | - | 50.0% | 1.450 | 0.4300 |" in page
    # a share outside [0, 1] is refused by the schema, naming the field
    bad = _record("arms", [dict(ARMS[0], first_accepted=51.2)])
    with pytest.raises(record.RecordError, match=r"rows\[0\]\.first_accepted"):
        record.validate(bad, "arms.json")


def test_speed_against_stock_vllm_is_taken_within_a_run_and_concurrency():
    rows = [
        {"variant": "stock vLLM", "concurrency": 1, "tok_s": 40.0},
        {"variant": "causal", "concurrency": 1, "tok_s": 28.0},
        {"variant": "self-spec auto", "concurrency": 1, "vs_causal": 1.1},  # tok/s from causal's: 30.8
        {"variant": "stock vLLM", "concurrency": 8, "tok_s": 240.0},
        {"variant": "causal", "concurrency": 8, "tok_s": 96.0},
        {"variant": "causal", "concurrency": 4, "tok_s": 70.0},  # no vLLM row at 4: no ratio
    ]
    got = {(r["variant"], r["concurrency"]): r.get("vs_vllm") for r in record.speed_rows(_record("speed", rows))}
    assert got[("causal", 1)] == pytest.approx(0.7) and got[("causal", 8)] == pytest.approx(0.4)
    assert got[("self-spec auto", 1)] == pytest.approx(0.77) and got[("stock vLLM", 1)] == 1.0
    assert got[("causal", 4)] is None
    table = "\n".join(report.speed_table(_record("speed", rows)))
    assert "| causal | 1 | 28.0 | 1.00x | 0.70x |" in table and "| causal | 4 | 70.0 | 1.00x | - |" in table


def test_rendering_is_deterministic_and_check_catches_drift(site):
    site["out"].parent.mkdir()
    assert report.main(_argv(site)) == 0
    made = lambda: {p.name: p.read_bytes() for p in [site["out"], _history(site), *site["plots"].glob("*.png")]}  # noqa: E731
    first = made()
    assert report.main(_argv(site, "--check")) == 0
    assert report.main(_argv(site)) == 0
    assert first == made()
    # a number changed in the data: the page and the scaling plot are stale
    path = site["data"] / "scaling.json"
    rec = json.loads(path.read_text())
    rec["rows"][0]["implied_linear"] = 1.31
    path.write_text(json.dumps(rec))
    assert report.main(_argv(site, "--check")) == 1
    assert report.main(_argv(site)) == 0 and report.main(_argv(site, "--check")) == 0
    # a plot that does not show its data (here: another plot under its name) is stale too
    shutil.copy(site["plots"] / "diffusion.png", site["plots"] / "scaling.png")
    assert report.main(_argv(site, "--check")) == 1
    assert report.main(_argv(site)) == 0 and report.main(_argv(site, "--check")) == 0
    # so is a history page that differs from its data
    _history(site).write_text(_history(site).read_text() + "edited by hand\n")
    assert report.main(_argv(site, "--check")) == 1


def test_a_superseded_record_leaves_the_page_and_plots_for_the_history_page(site):
    site["out"].parent.mkdir()
    assert report.main(_argv(site)) == 0
    before = {name: stamp(site["plots"] / name) for name in ("concurrency.png", "scaling.png")}
    # an older run of the same series, superseded by the run at concurrency 1: a third concurrency, 4
    older = [
        {"variant": "causal", "concurrency": 4, "tok_s": 31.0},
        {"variant": "self-spec auto", "concurrency": 4, "tok_s": 33.0},
    ]
    rec = _record("speed", older, title="an older run", date="2026-11-20", series="tiny, fp32")
    (site["data"] / "speed-old.json").write_text(json.dumps(rec | {"superseded_by": "speed-c1.json"}))
    assert report.main(_argv(site, "--check")) == 1  # the history page gains it
    assert report.main(_argv(site)) == 0 and report.main(_argv(site, "--check")) == 0
    page, history = site["out"].read_text(), _history(site).read_text()
    assert "an older run" not in page and "| self-spec auto | 4 |" not in page
    assert history.startswith(report.HISTORY_HEADER) and "](../results.md)" in history
    at = history.index("### an older run")
    assert history.index("## Speed against concurrency") < at < history.index("| self-spec auto | 4 | 33.0 | 1.06x |")
    assert "Superseded by `speed-c1.json`: a speed run." in history
    assert "### a speed run" not in history and "### at eight" not in history  # current records stay off it
    # the plots show the current records only: the concurrency plot is the one drawn without the old record
    assert before == {name: stamp(site["plots"] / name) for name in before}
    # the same record made current again is back on the page and in the plot
    (site["data"] / "speed-old.json").write_text(json.dumps(rec))
    assert report.main(_argv(site)) == 0
    assert (
        "### an older run" in site["out"].read_text() and "No record is superseded yet." in _history(site).read_text()
    )
    assert stamp(site["plots"] / "concurrency.png") != before["concurrency.png"]


@pytest.mark.parametrize(
    "change, field, words",
    [
        (lambda r: r.pop("machine"), "'machine'", "missing"),
        (lambda r: r.update(date="Dec 5"), "'date'", "YYYY-MM-DD"),
        (lambda r: r.update(kind="latency"), "'kind'", "expected one of"),
        (lambda r: r["rows"][1].update(tok_s="fast"), "'rows[1].tok_s'", "expected a number"),
        (lambda r: r["rows"][0].update(tok_per_s=3.0), "'rows[0].tok_per_s'", "unknown"),
        (lambda r: r["rows"][2].update(same_as_causal=100), "'rows[2].same_as_causal'", "[0, 1]"),
        (lambda r: r["rows"][0].pop("tok_s"), "'rows[0]'", "needs one of"),
        (lambda r: r["rows"][0].update(concurrency=True), "'rows[0].concurrency'", "integer"),
        (lambda r: r.update(rows=[]), "'rows'", "non-empty"),
        (lambda r: r.update(superseded_by=True), "'superseded_by'", "expected a non-empty string"),
        (lambda r: r.update(superseded_by="session 49"), "'superseded_by'", "file name (NAME.json"),
        (lambda r: r.update(superseded_by="../data/speed-c8.json"), "'superseded_by'", "in the same folder"),
        (lambda r: r.update(superseded_by="speed-c9.json"), "'superseded_by'", "names no record"),
        (lambda r: r.update(superseded_by="speed-c1.json"), "'superseded_by'", "names the record itself"),
    ],
)
def test_a_malformed_record_is_refused_naming_the_file_and_field(site, capsys, change, field, words):
    path = site["data"] / "speed-c1.json"
    rec = json.loads(path.read_text())
    change(rec)
    path.write_text(json.dumps(rec))
    with pytest.raises(record.RecordError) as err:
        record.load_all(site["data"])
    assert str(path) in str(err.value) and f"field {field}" in str(err.value) and words in str(err.value)
    site["out"].parent.mkdir()
    assert report.main(_argv(site)) == 2  # the command says it in one line and writes nothing
    assert f"{path}: field {field}" in capsys.readouterr().err and not site["out"].exists()


def test_a_file_that_is_not_json_is_named(site):
    (site["data"] / "broken.json").write_text("{not json")
    with pytest.raises(record.RecordError, match=r"broken\.json: not JSON"):
        record.load_all(site["data"])


def test_a_benchmark_record_drops_what_the_schema_does_not_hold():
    rows = [{"variant": "causal", "concurrency": 1, "tok_s": 9.0, "accuracy": float("nan"), "per_round": [[1, 2]]}]
    made = record.make("speed", rows, title="t", command="c", source="s", dtype=None)
    assert made["rows"] == [{"variant": "causal", "concurrency": 1, "tok_s": 9.0}] and "dtype" not in made
    assert made["machine"] and record.validate(made, "made") is made


def test_the_committed_page_and_plots_are_what_the_committed_data_makes():
    """docs/results.md cannot drift from docs/results/data: `python -m benchmark.report --check`."""
    assert report.main(["--check"]) == 0, "run `python -m benchmark.report` and commit docs/results*"
    page = (ROOT / "docs" / "results.md").read_text()
    for name in ("scaling.png", "concurrency.png", "diffusion.png", "quality.png"):
        assert f"](results/{name})" in page
    # today's figures only (the bound); the older records live on the history page it links
    assert len(page.splitlines()) <= 400 and "](history/results-older.md)" in page
    assert (ROOT / "docs" / "history" / "results-older.md").read_text().startswith(report.HISTORY_HEADER)
