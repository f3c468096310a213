"""The results page's plots (`python -m benchmark.report`), drawn with matplotlib's headless Agg backend.

Each PNG carries, in its `Description` metadata, a sha256 of exactly the numbers it plots: Agg's pixels can
differ between builds of matplotlib and FreeType, the digest does not, so tests/test_results_report.py holds a
committed plot to its data by the digest and the image size rather than by the bytes.
"""

from __future__ import annotations

import hashlib
import json
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: no display on CI machines and servers
import matplotlib.pyplot as plt  # noqa: E402

from benchmark.record import BASELINE, CAUSAL, speed_rows  # noqa: E402

SIZE = (11.0, 4.8)  # inches; at DPI 100 a plot is 1100 x 480 pixels (the concurrency panels: 384 per row)
DPI = 100
DIGEST_PREFIX = "bdstack plotted data sha256 "


def digest(data) -> str:
    """What `Description` holds for a plot of `data` (JSON-able, in a fixed order)."""
    blob = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return DIGEST_PREFIX + hashlib.sha256(blob).hexdigest()


def stamp(path: Path) -> tuple[tuple[int, int], str | None]:
    """What identifies a plot across matplotlib builds: its pixel size and the digest of the data it plots."""
    from PIL import Image

    with Image.open(path) as image:
        return image.size, image.info.get("Description")


def _save(fig, path: Path, data) -> Path:
    # "Software" names the matplotlib version; left out so that a version bump alone changes no committed file
    fig.savefig(path, dpi=DPI, metadata={"Software": None, "Description": digest(data)})
    plt.close(fig)
    return path


def _label(record: dict) -> str:
    return record.get("label", record["title"])


def scaling(records: list[dict], path: Path) -> Path | None:
    """Tokens per forward (implied: lines; served: squares) and `auto`'s speed against training minutes;
    speed ratios a record withdraws (`speed_withdrawn`) are left out, as they no longer hold."""
    runs = [r for r in records if r["kind"] == "scaling"]
    if not runs:
        return None
    fig, (tpf, speed) = plt.subplots(1, 2, figsize=SIZE, sharex=True)
    data = []
    for i, record in enumerate(runs):
        colour = f"C{i % 10}"
        rows = sorted(record["rows"], key=lambda r: r["minutes"])
        withdrawn = "speed_withdrawn" in record
        points = {}
        for field in ("implied_linear", "implied_all", "served_linear", "served_all", "auto_vs_causal", "auto_vs_base"):
            held = not (withdrawn and field.startswith("auto_"))
            points[field] = [(r["minutes"], r[field]) for r in rows if field in r and held]
        data.append({"label": _label(record), "withdrawn": withdrawn, **points})
        for field, style in (("implied_linear", "-"), ("implied_all", "--")):
            if points[field]:
                xs, ys = zip(*points[field])
                label = _label(record) if field == "implied_linear" else None
                tpf.plot(xs, ys, style, color=colour, marker="o", markersize=3, label=label)
        for field in ("served_linear", "served_all"):
            if points[field]:
                xs, ys = zip(*points[field])
                tpf.plot(xs, ys, "s", color=colour, markersize=6)
        for field, marker in (("auto_vs_causal", "o"), ("auto_vs_base", "D")):
            if points[field]:
                xs, ys = zip(*points[field])
                speed.plot(xs, ys, marker, color=colour, markersize=7)
    tpf.set(xlabel="training minutes (2-core CPU)", ylabel="tokens per forward")
    tpf.set_title("self-spec tokens per forward: implied (solid linear, dashed all), served (squares)", fontsize=9)
    tpf.legend(fontsize=7, loc="upper left")
    tpf.grid(alpha=0.3)
    speed.axhline(1.0, color="grey", linewidth=0.8)
    speed.set(xlabel="training minutes (2-core CPU)", ylabel="tok/s ratio")
    speed.set_title("self-spec auto tok/s over our causal mode and the base model's generate", fontsize=9)
    for marker, label in (("o", "vs our causal"), ("D", "vs base generate")):  # legend only: colours as at left
        speed.plot([], [], marker, color="black", label=label)
    speed.legend(fontsize=7, loc="best")
    speed.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, path, data)


def concurrency(records: list[dict], path: Path) -> Path | None:
    """tok/s against concurrency per variant, one panel per series that measured more than one concurrency."""
    series: dict[str, list[dict]] = {}
    for record in records:
        if record["kind"] == "speed" and "series" in record:
            series.setdefault(record["series"], []).append(record)
    wide = {name: rs for name, rs in series.items() if len({row["concurrency"] for r in rs for row in r["rows"]}) > 1}
    if not wide:
        return None
    # two panels a row at most, so that each series' title (checkpoint, dtype, prompts, machine) stays legible
    cols = min(2, len(wide))
    rows = -(-len(wide) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(SIZE[0], SIZE[1] * rows * 0.8), squeeze=False)
    data = []
    names = sorted({row["variant"] for rs in wide.values() for r in rs for row in r["rows"]})
    order_all = sorted(names, key=lambda v: (v not in (BASELINE, CAUSAL), v))
    palette = plt.get_cmap("tab20").colors  # 20 colours: a sweep of fixed settings has more variants than 10
    colour = {v: palette[(2 * i) % 20 + (2 * i) // 20 % 2] for i, v in enumerate(order_all)}  # one per variant
    for ax in axes.flat[len(wide) :]:
        ax.set_visible(False)
    for ax, (name, group) in zip(axes.flat, sorted(wide.items())):
        lines: dict[str, list[tuple[int, float]]] = {}
        for record in group:
            for row in speed_rows(record):
                if "tok_s" in row:
                    lines.setdefault(row["variant"], []).append((row["concurrency"], row["tok_s"]))
        withdrawn = any("speed_withdrawn" in r for r in group)
        order = sorted(lines, key=lambda v: (v not in (BASELINE, CAUSAL), v))
        data.append({"series": name, "withdrawn": withdrawn, "lines": {v: sorted(lines[v]) for v in order}})
        for variant in order:
            xs, ys = zip(*sorted(lines[variant]))
            bold = variant in (BASELINE, CAUSAL, "self-spec auto")
            ax.plot(xs, ys, "-o", color=colour[variant], linewidth=2.2 if bold else 1, markersize=4, label=variant)
        ticks = sorted({c for points in lines.values() for c, _ in points})
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set(xlabel="requests in flight", ylabel="tok/s (all requests)")
        title = textwrap.fill(name, 60) + ("\n(ratios to causal withdrawn: see the tables)" if withdrawn else "")
        ax.set_title(title, fontsize=8)
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, path, data)


def diffusion(records: list[dict], path: Path) -> Path | None:
    """Accuracy against tokens per forward, one point per setting, per record."""
    runs = [r for r in records if r["kind"] == "diffusion_quality"]
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=SIZE)
    data = []
    for i, record in enumerate(runs):
        rows = sorted(record["rows"], key=lambda r: r["tokens_per_forward"])
        points = [(r["tokens_per_forward"], r["accuracy"], r["setting"]) for r in rows]
        data.append({"label": _label(record), "points": points})
        xs, ys, names = zip(*points)
        ax.plot(xs, [100 * y for y in ys], "-o", color=f"C{i % 10}", label=_label(record))
        for x, y, name in points:
            ax.annotate(name, (x, 100 * y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set(xlabel="tokens per forward", ylabel="accuracy (%)", title="Diffusion: accuracy against parallelism")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, path, data)


def quality(records: list[dict], path: Path) -> Path | None:
    """pass@1 and agreement with the base against tokens per forward, per variant, from `mode_quality` records."""
    runs = [r for r in records if r["kind"] == "mode_quality"]
    if not runs:
        return None
    fig, axes = plt.subplots(1, 2, figsize=SIZE, squeeze=False)
    data = []
    panels = [("pass_at_1", "HumanEval pass@1 (%)", "humaneval"), ("agree_prefix", "agreement with base (%)", None)]
    for i, record in enumerate(runs):
        for ax, (field, ylabel, task) in zip(axes[0], panels):
            for temperature in sorted({r["temperature"] for r in record["rows"]}):
                rows = [
                    r
                    for r in record["rows"]
                    if r["temperature"] == temperature and field in r and (task is None or r["task"] == task)
                ]
                for each in sorted({r["task"] for r in rows}):
                    points = [(r["tokens_per_forward"], r[field], r["variant"]) for r in rows if r["task"] == each]
                    data.append(
                        {"label": _label(record), "field": field, "task": each, "t": temperature, "points": points}
                    )
                    face = f"C{i % 10}" if temperature == 0 else "none"
                    curve = sorted(p for p in points if p[2].startswith("diffusion"))
                    if curve:
                        ax.plot([x for x, _, _ in curve], [100 * y for _, y, _ in curve], "-", color=f"C{i % 10}", lw=1)
                    for x, y, name in points:
                        ax.plot(x, 100 * y, "o", color=f"C{i % 10}", markerfacecolor=face, markersize=5)
                        ax.annotate(name, (x, 100 * y), textcoords="offset points", xytext=(3, 3), fontsize=5)
            ax.set(xlabel="tokens per forward", ylabel=ylabel)
            ax.grid(alpha=0.3)
        axes[0][0].plot([], [], "o", color=f"C{i % 10}", label=_label(record))
    axes[0][0].legend(fontsize=6, loc="center right")
    fig.tight_layout()
    return _save(fig, path, data)


PLOTS = {
    "scaling.png": scaling,
    "concurrency.png": concurrency,
    "diffusion.png": diffusion,
    "quality.png": quality,
}


def draw_all(records: list[dict], folder: Path) -> dict[str, Path]:
    """Every plot the records have data for, written into `folder` (name -> path)."""
    folder.mkdir(parents=True, exist_ok=True)
    made = {}
    for name, draw in PLOTS.items():
        path = draw(records, folder / name)
        if path is not None:
            made[name] = path
    return made
