"""What a decode forward costs: seconds by rows in the forward, measured on the loaded model and device.

A forward pads every sequence's rows to the longest, so its cost is a function of batch x longest row list
(`rows` below). `calibrate` times forwards of 1, 2, 4, ... rows over a cached context at start-up;
`RowCost` interpolates its isotonic fit of the measured points (linearly; beyond the last, along the
last segment) and follows live timings (`observe`: a moving average per row count seen, which starts from
the curve's value there, so one noisy timing at a new row count moves the curve by `LIVE_WEIGHT` of its
error, not all of it). `load_or_calibrate` keeps the measurement in a JSON file per checkpoint, device,
dtype and thread count, so a restart does not measure again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from bisect import bisect_left
from pathlib import Path

import torch

from bdcore.decode.rows import Forward, Rows
from bdcore.decode.sequence import SequenceCache

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONTEXT = 128  # cached tokens the calibration forwards attend to
SHAPE = "verify+canvas"  # what a calibration forward holds (in the cache key: older curves timed clean rows)
LIVE_WEIGHT = 0.2  # weight of a new live timing in its row count's moving average


class RowCost:
    """Seconds of one decode forward by its rows (batch x longest row list).

    `points` are the measured (and live-averaged) timings; the curve read by `__call__` is their
    isotonic fit (pool-adjacent-violators): a forward of more rows never costs less. Without it, timing
    noise on a small model (a 2 ms forward jitters by 50%) can make 32 rows look cheaper than 16, and the
    policy then drafts with every canvas on noise."""

    def __init__(self, points: dict[int, float]):
        if not points or any(r < 1 or s <= 0 for r, s in points.items()):
            raise ValueError(f"a row cost needs positive timings at row counts >= 1, got {points}")
        self.points = dict(points)
        self._fit()

    def _fit(self) -> None:
        xs = sorted(self.points)
        blocks: list[list[float]] = []  # [sum, count] of pooled neighbours, non-decreasing means
        for x in xs:
            blocks.append([self.points[x], 1])
            while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
                total, count = blocks.pop()
                blocks[-1][0] += total
                blocks[-1][1] += count
        ys = [total / count for total, count in blocks for _ in range(int(count))]
        self._xs, self._ys = xs, ys

    def __call__(self, rows: int) -> float:
        xs, ys = self._xs, self._ys
        if len(xs) == 1:
            return ys[0] * max(rows, 1) / xs[0] if rows > xs[0] else ys[0]
        if rows <= xs[0]:
            return ys[0]
        i = min(max(bisect_left(xs, rows), 1), len(xs) - 1)
        x0, x1 = xs[i - 1], xs[i]
        y0, y1 = ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (rows - x0) / (x1 - x0), 1e-9)

    def observe(self, rows: int, seconds: float) -> None:
        """A live forward of `rows` took `seconds`."""
        if rows < 1 or not seconds > 0:
            return
        old = self.points.get(rows)
        old = self(rows) if old is None else old
        self.points[rows] = (1 - LIVE_WEIGHT) * old + LIVE_WEIGHT * seconds
        self._fit()

    def to_dict(self) -> dict[str, float]:
        return {str(r): s for r, s in sorted(self.points.items())}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def calibrate(
    runner, *, sizes=SIZES, context: int = CONTEXT, repeats: int = 3, min_seconds: float = 0.5, max_rounds: int = 25
) -> RowCost:
    """Median seconds of each row count in `sizes` (none kept) over a cache of `context` tokens,
    on `runner`'s model and device (`RowCost` fits a non-decreasing curve through them). The sizes are
    timed in rounds, one forward of each per round after an untimed warm-up round, so a burst of load hits
    every size alike; rounds go on until each size has `repeats` timings and the timed forwards add up to
    `min_seconds` (at most `max_rounds`): three timings of a 2 ms forward once made 64 rows look cheaper
    than one. A forward of r rows is shaped as the self-spec step the policy prices: one clean (verify) row
    and r - 1 canvas rows. A draft adapter runs its LoRA at canvas rows only (issue 41), so a curve timed on
    clean rows alone would price every drafting forward at the causal step's cost and draft too much."""
    vocab = runner.model.config.vocab_size
    cache = SequenceCache()
    tokens = [(7 * i + 3) % vocab for i in range(context + max(sizes))]
    runner.forward([(cache, Forward(Rows().clean(tokens[:context], 0), context))])
    times: dict[int, list[float]] = {r: [] for r in sizes}
    total, rounds = 0.0, 0
    while rounds <= repeats or (total < min_seconds and rounds <= max_rounds):
        for r in sizes:
            op = Forward(
                Rows()
                .clean(tokens[context : context + 1], context)
                .canvas(tokens[context + 1 : context + r], context + 1),
                0,
            )
            _sync(runner.device)
            t = time.perf_counter()
            runner.forward([(cache, op)])
            _sync(runner.device)
            if rounds:  # the first round is a warm-up
                times[r].append(time.perf_counter() - t)
                total += times[r][-1]
        rounds += 1
    return RowCost({r: sorted(ts)[len(ts) // 2] for r, ts in times.items()})


@functools.lru_cache(maxsize=1)
def code_stamp() -> str:
    """A hash of the code a decode forward runs through (bdcore's decode package, the draft adapter's gated
    projections): a measurement made before a change to them (session 43 cut a drafting forward's cost by a
    fifth) would mislead the policy until the cache was cleared by hand."""
    root = Path(__file__).resolve().parent
    files = sorted(root.glob("*.py")) + [root.parent / f for f in ("draft_adapter.py", "draft_adapter_serving.py")]
    return hashlib.sha1(b"".join(f.read_bytes() for f in files)).hexdigest()[:12]


def cache_key(checkpoint: str | os.PathLike, device: torch.device, dtype: torch.dtype) -> str:
    """One measurement per checkpoint (its path and config time), device, dtype, torch, thread count and
    decode code (`code_stamp`)."""
    path = Path(checkpoint).resolve()
    config = path / "config.json"
    stamp = config.stat().st_mtime_ns if config.is_file() else 0
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu{os.cpu_count()}"
    threads = torch.get_num_threads()
    text = f"{path}|{stamp}|{name}|{dtype}|{torch.__version__}|{threads}|{SIZES}|{CONTEXT}|{SHAPE}|{code_stamp()}"
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("BDSTACK_CACHE_DIR", Path.home() / ".cache" / "bdstack")) / "row_cost"


def load_or_calibrate(runner, checkpoint, *, progress=None) -> RowCost:
    """The cached measurement for this checkpoint and device, or a new one (written to the cache)."""
    dtype = next(runner.model.parameters()).dtype
    path = cache_dir() / f"{cache_key(checkpoint, runner.device, dtype)}.json"
    if path.is_file():
        try:
            return RowCost({int(r): float(s) for r, s in json.loads(path.read_text())["seconds"].items()})
        except (ValueError, KeyError, TypeError):
            pass  # a damaged cache file is measured again
    if progress is not None:
        progress(f"measuring decode forward cost by rows ({', '.join(map(str, SIZES))}) on {runner.device}")
    cost = calibrate(runner)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"checkpoint": str(Path(checkpoint).resolve()), "device": str(runner.device), "dtype": str(dtype)}
        path.write_text(json.dumps({**record, "seconds": cost.to_dict()}, indent=1) + "\n")
    except OSError:
        pass  # a read-only home: measure again next time
    return cost
