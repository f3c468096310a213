"""Continuous batching for the native engine: concurrent requests share forwards.

`Scheduler.generate` is what the server calls from its worker threads; it blocks until that request
is done. Dense models: one scheduler thread keeps up to `max_batch` requests in flight, each a decode
generator from `decode_modes.py` (any mix of modes), and runs their next forwards as one batched
forward (`batch_runner.py`); a request joins at the next step and leaves when it finishes, fails or is
cancelled. Hybrid models batch the same way (their gated-delta layers run request by request inside
the shared forward). `max_batch` 1 decodes one request at a time on the engine's runner.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from dataclasses import dataclass, field

from inference.batch_runner import BatchRunner, RequestCache
from inference.decode_modes import Crop
from inference.engine import Engine, Generation


@dataclass
class _Job:
    mode: object  # the request's decode generator
    out: object  # engine._Output
    cache: RequestCache = field(default_factory=RequestCache)
    op: object = None  # the forward it waits for
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class Scheduler:
    def __init__(self, engine: Engine, max_batch: int = 8):
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.engine, self.max_batch = engine, max_batch
        loaded, sc = engine.loaded, engine.loaded.sidecar
        self.batch_runner = None
        if max_batch > 1:
            self.batch_runner = BatchRunner(
                loaded.model,
                banned=loaded.mask_id,
                clean_causal=sc.clean_causal if sc else True,
                within_block_causal=sc.within_block_causal if sc else False,
            )
        self._one_at_a_time = threading.Lock()
        self._jobs: queue.Queue[_Job] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.batch_sizes: Counter = Counter()  # batched forwards by number of requests in them

    def generate(self, prompt_ids, params, decode=None, *, on_text=None, cancel=None) -> Generation:
        if self.batch_runner is None:
            with self._one_at_a_time:  # held until the request has fully stopped
                return self.engine.generate(prompt_ids, params, decode, on_text=on_text, cancel=cancel)
        mode, out = self.engine.start(prompt_ids, params, decode, on_text=on_text, cancel=cancel)
        job = _Job(mode, out)
        self._ensure_thread()
        self._jobs.put(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        return out.generation()

    def _ensure_thread(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="bdstack-scheduler", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        active: list[_Job] = []
        while True:
            if not active:
                active.append(self._jobs.get())
            while len(active) < self.max_batch:
                try:
                    active.append(self._jobs.get_nowait())
                except queue.Empty:
                    break
            for job in active:
                if job.op is None:
                    self._advance(job, first=True)
            active = [j for j in active if not j.done.is_set()]
            if not active:
                continue
            try:
                logits = self.batch_runner.forward([(j.cache, j.op.rows, j.op.keep, j.op.rollback) for j in active])
            except Exception as e:  # the forward itself failed: every request in it fails
                for job in active:
                    job.error = e
                    job.done.set()
                active = []
                continue
            self.batch_sizes[len(active)] += 1
            for job, lg in zip(active, logits):
                self._advance(job, lg)
            active = [j for j in active if not j.done.is_set()]

    @staticmethod
    def _advance(job: _Job, logits=None, *, first: bool = False) -> None:
        """Send the logits in and run the request up to its next forward (crops are local)."""
        try:
            op = next(job.mode) if first else job.mode.send(logits)
            while isinstance(op, Crop):
                job.cache.crop(op.length)
                op = job.mode.send(None)
            job.op = op
        except StopIteration:
            job.done.set()
        except BaseException as e:  # Cancelled, or a bug: reported to the request's own caller
            job.error = e
            job.done.set()
