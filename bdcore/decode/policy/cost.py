"""What a decode forward costs: seconds by its shape, measured on the loaded model and device.

A forward pads every sequence's rows to the longest, so its shape is (sequences in it, longest row list).
The two are not interchangeable: on SmolLM2-135M (bf16, 2 CPU threads, 200 cached tokens each) 8 sequences
of 8 rows cost 144 ms where one sequence of 64 rows costs ~100 ms, and a second row costs each sequence
~4 ms in a batch of 8 against ~10 ms alone. A policy that prices a batch by its total rows drafts at 8
requests in flight where causal steps are faster (and runs at about two thirds of causal's speed).

So `ForwardCost` keeps one curve per batch size (`RowCost`: seconds by longest row list) and reads another
batch size between its neighbours' curves (beyond the largest: along the last two). `calibrate` times
forwards of 1, 2, 4, ... rows for 1, 2, 4 and 8 sequences over a cached context at start-up; a `RowCost`
interpolates its isotonic fit of the measured points (linearly; beyond the last, along the last segment)
and follows live timings (`observe`: a moving average per row count seen, which starts from the curve's
value there, so one noisy timing at a new row count moves the curve by `LIVE_WEIGHT` of its error, not all
of it; a live timing at a batch size no curve has starts that size's curve from the one read there).
`load_or_calibrate` keeps the measurement in a JSON file per checkpoint, device, dtype and thread count, so
a restart does not measure again.
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

from bdcore.decode.packed_linear import is_packed
from bdcore.decode.policy.tuning import LIVE_WEIGHT
from bdcore.decode.rows import Forward, Rows
from bdcore.decode.sequence import SequenceCache

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # rows per sequence; a batch of b times those up to b * r = 256
BATCHES = (1, 2, 4, 8)  # sequences per calibration forward (the scheduler's default batch is 8)
CONTEXT = 128  # cached tokens the calibration forwards attend to
# What a calibration forward holds (in the cache key: older curves timed clean rows, or one sequence only)
SHAPE = "verify+canvas by batch"


class RowCost:
    """Seconds of one decode forward of a given batch size by its rows (the longest row list).

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


class ForwardCost:
    """Seconds of one decode forward by its rows (the longest row list) and sequences (`batch`): one
    `RowCost` per batch size it has curves for. A batch size between two of them reads their curves
    interpolated at each row count; one beyond the largest extrapolates along the last two (rows cost each
    sequence about the same: never less than at the largest); with a single curve, a batch of b prices its
    rows as one sequence of b times as many (what the policy assumed before batches were measured). Those
    read curves are `RowCost`s too, so they never fall with rows. `observe` updates the curve of the batch
    size it timed, making one from the read curve when there is none."""

    def __init__(self, curves: dict[int, RowCost | dict[int, float]]):
        if not curves or any(int(b) < 1 for b in curves):
            raise ValueError(f"a forward cost needs curves at batch sizes >= 1, got {sorted(curves)}")
        self.curves = {int(b): c if isinstance(c, RowCost) else RowCost(c) for b, c in curves.items()}
        self._read: dict[int, RowCost] = {}  # curves read at batch sizes without one (dropped on any observe)

    @classmethod
    def from_dict(cls, data: dict) -> ForwardCost:
        return cls({int(b): {int(r): float(s) for r, s in points.items()} for b, points in data.items()})

    def to_dict(self) -> dict[str, dict[str, float]]:
        return {str(b): curve.to_dict() for b, curve in sorted(self.curves.items())}

    @property
    def points(self) -> dict[int, dict[int, float]]:
        """The measured (and live-averaged) timings: batch -> rows -> seconds."""
        return {b: dict(sorted(c.points.items())) for b, c in sorted(self.curves.items())}

    def __call__(self, rows: int, batch: int = 1) -> float:
        return self.curve(batch)(rows)

    def curve(self, batch: int) -> RowCost:
        batch = max(int(batch), 1)
        got = self.curves.get(batch) or self._read.get(batch)
        if got is None:
            got = self._read[batch] = RowCost(self._read_points(batch))
        return got

    def _read_points(self, batch: int) -> dict[int, float]:
        sizes = sorted(self.curves)
        below = [b for b in sizes if b < batch]
        above = [b for b in sizes if b > batch]
        if not below:  # fewer sequences than any curve: the fewest's (a forward never costs less than that)
            return dict(self.curves[above[0]].points)
        lo = self.curves[below[-1]]
        if above:
            hi, t = self.curves[above[0]], (batch - below[-1]) / (above[0] - below[-1])
            rows = sorted(set(lo.points) | set(hi.points))
            return {r: (1 - t) * lo(r) + t * hi(r) for r in rows}
        if len(below) == 1:  # rows at which the one curve's points fall, b/b0 times as many
            scale = batch / below[-1]
            rows = {1} | {max(-(-r * below[-1] // batch), 1) for r in lo.points}
            return {r: lo(r * scale) for r in rows}
        prev, b0, b1 = self.curves[below[-2]], below[-2], below[-1]
        return {r: lo(r) + (batch - b1) * max(lo(r) - prev(r), 0.0) / (b1 - b0) for r in lo.points}

    def observe(self, rows: int, seconds: float, batch: int = 1) -> None:
        """A live forward of `batch` sequences, the longest `rows` rows, took `seconds`."""
        if rows < 1 or batch < 1 or not seconds > 0:
            return
        if batch not in self.curves:
            self.curves[batch] = RowCost(dict(self.curve(batch).points))
        self.curves[batch].observe(rows, seconds)
        self._read.clear()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def calibrate(
    runner,
    *,
    sizes=SIZES,
    batches=BATCHES,
    context: int = CONTEXT,
    repeats: int = 3,
    min_seconds: float = 0.5,
    max_rounds: int = 25,
) -> ForwardCost:
    """Median seconds of each (batch, rows) forward, batch in `batches` and rows in `sizes` up to
    batch x rows = max(sizes) (none kept), every sequence over a cache of `context` tokens, on `runner`'s
    model and device (each batch's `RowCost` fits a non-decreasing curve through them). The shapes are timed
    in rounds, one forward of each per round after an untimed warm-up round, so a burst of load hits every
    shape alike; rounds go on until each shape has `repeats` timings and the timed forwards add up to
    `min_seconds` (at most `max_rounds`): three timings of a 2 ms forward once made 64 rows look cheaper
    than one. A sequence's r rows are shaped as the self-spec step the policy prices: one clean (verify) row
    and r - 1 canvas rows. A draft adapter runs its LoRA at canvas rows only, so a curve timed on
    clean rows alone would price every drafting forward at the causal step's cost and draft too much."""
    vocab = runner.model.config.vocab_size
    caches = [SequenceCache() for _ in range(max(batches))]
    tokens = [(7 * i + 3) % vocab for i in range(context + max(sizes))]
    runner.forward([(cache, Forward(Rows().clean(tokens[:context], 0), context)) for cache in caches])
    shapes = [(b, r) for b in batches for r in sizes if b * r <= max(sizes) or r == min(sizes)]
    times: dict[tuple[int, int], list[float]] = {shape: [] for shape in shapes}
    total, rounds = 0.0, 0

    def step(r: int) -> Forward:
        return Forward(
            Rows().clean(tokens[context : context + 1], context).canvas(tokens[context + 1 : context + r], context + 1),
            0,
        )

    while rounds <= repeats or (total < min_seconds and rounds <= max_rounds):
        seated = 0
        for b, r in shapes:
            op = step(r)
            if b > 1 and b != seated:  # untimed: the caches move into a slab of their own (`kv_slab`), as a
                runner.forward([(cache, op) for cache in caches[:b]])  # served batch's do once when it changes
                seated = b
            _sync(runner.device)
            t = time.perf_counter()
            runner.forward([(cache, op) for cache in caches[:b]])
            _sync(runner.device)
            if rounds:  # the first round is a warm-up
                times[b, r].append(time.perf_counter() - t)
                total += times[b, r][-1]
        rounds += 1
    curves: dict[int, dict[int, float]] = {}
    for (b, r), ts in times.items():
        curves.setdefault(b, {})[r] = sorted(ts)[len(ts) // 2]
    return ForwardCost(curves)


@functools.lru_cache(maxsize=1)
def code_stamp() -> str:
    """A hash of the code a decode forward runs through (bdcore's decode package, the draft adapter's gated
    projections): a measurement made before a change to them (one such change cut a drafting forward's cost by a
    fifth) would mislead the policy until the cache was cleared by hand."""
    decode = Path(__file__).resolve().parents[1]  # bdcore/decode, this policy package included
    files = sorted(decode.rglob("*.py")) + [decode.parent / f for f in ("draft_adapter.py", "draft_adapter_serving.py")]
    return hashlib.sha1(b"".join(f.read_bytes() for f in files)).hexdigest()[:12]


def cache_key(
    checkpoint: str | os.PathLike,
    device: torch.device,
    dtype: torch.dtype,
    packed: bool = False,
    compiled: bool = False,
) -> str:
    """One measurement per checkpoint (its path and config time), device, dtype, packed weights or not
    (`bdcore.decode.packed_linear`), decode step compiled or not (`compiled_step`), torch, thread count and
    decode code (`code_stamp`)."""
    path = Path(checkpoint).resolve()
    config = path / "config.json"
    stamp = config.stat().st_mtime_ns if config.is_file() else 0
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu{os.cpu_count()}"
    threads = torch.get_num_threads()
    shapes = f"{SIZES}|{BATCHES}|{CONTEXT}|{SHAPE}"
    weights = ("packed|" if packed else "") + ("compiled|" if compiled else "")
    text = f"{path}|{stamp}|{name}|{dtype}|{weights}{torch.__version__}|{threads}|{shapes}|{code_stamp()}"
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("BDSTACK_CACHE_DIR", Path.home() / ".cache" / "bdstack")) / "row_cost"


def load_or_calibrate(runner, checkpoint, *, progress=None) -> ForwardCost:
    """The cached measurement for this checkpoint and device, or a new one (written to the cache)."""
    dtype = next(runner.model.parameters()).dtype
    key = cache_key(checkpoint, runner.device, dtype, is_packed(runner.model), runner.compiled is not None)
    path = cache_dir() / f"{key}.json"
    if path.is_file():
        try:
            return ForwardCost.from_dict(json.loads(path.read_text())["seconds"])
        except (ValueError, KeyError, TypeError, AttributeError):
            pass  # a damaged cache file is measured again
    if progress is not None:
        progress(
            f"measuring decode forward cost by rows ({', '.join(map(str, SIZES))}) and sequences "
            f"({', '.join(map(str, BATCHES))}) on {runner.device}"
        )
    cost = calibrate(runner)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"checkpoint": str(Path(checkpoint).resolve()), "device": str(runner.device), "dtype": str(dtype)}
        path.write_text(json.dumps({**record, "seconds": cost.to_dict()}, indent=1) + "\n")
    except OSError:
        pass  # a read-only home: measure again next time
    return cost
