"""Continuous batching for the native engine: concurrent requests share forwards.

`Scheduler.generate` is what the server calls from its worker threads; it blocks until that request
is done. One scheduler thread keeps up to `max_batch` requests in flight, each a decoder from
`bdcore.decode.modes` (any mix of modes), in a `DecodeLoop` on the engine's decode driver: their next
forwards run as one forward; a request joins at the next step and leaves when it finishes, fails or is
cancelled. With
`max_batch` 1 requests run one at a time, each until it has fully stopped.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from dataclasses import dataclass, field

from bdcore.decode.driver import DecodeLoop
from bdcore.decode.modes import Decoder
from inference.native.engine import Engine, Generation, TextOutput
from inference.server_defaults import SERVER

STOP_POLL_S = 0.2  # how soon an idle `run_here` notices its stop


@dataclass
class _Job:
    decoder: Decoder
    out: TextOutput
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class Scheduler:
    def __init__(self, engine: Engine, max_batch: int = SERVER.max_batch):
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.engine, self.max_batch = engine, max_batch
        self.driver = engine.driver
        self._jobs: queue.Queue[_Job] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._ran_here = False
        self.batch_sizes: Counter = Counter()  # forwards by number of requests in them

    def generate(self, prompt_ids, params, decode=None, *, on_text=None, cancel=None, on_logprobs=None) -> Generation:
        decoder, out = self.engine.start(
            prompt_ids, params, decode, on_text=on_text, cancel=cancel, on_logprobs=on_logprobs
        )
        job = _Job(decoder, out)
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

    def claim_here(self) -> None:
        """Reserve the calling thread for `run_here` before any request can arrive (serve.py calls it before
        its HTTP thread starts): a request that came first would otherwise start a thread of the scheduler's
        own, and `run_here` would then refuse to start."""
        with self._start_lock:
            if self._thread is not None:
                raise RuntimeError("the scheduler already decodes on another thread")
            self._thread = threading.current_thread()

    def run_here(self, stop: threading.Event) -> None:
        """Decode on the calling thread until `stop` is set, instead of a thread of the scheduler's own: the
        server's main thread, which loaded the model. Torch ops on a second thread get a second OpenMP team,
        and with more team threads than cores the workers stop spinning between parallel regions: a served
        request decoded at 0.78x the engine's in-process tok/s (2-core CPU, SmolLM2-135M). Requests queued
        before it starts (after `claim_here`) are decoded when it does."""
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.current_thread()
            elif self._thread is not threading.current_thread() or self._ran_here:
                raise RuntimeError("the scheduler already decodes on another thread")
            self._ran_here = True
        self._loop(stop)

    def _loop(self, stop: threading.Event | None = None) -> None:
        # catch: a decoder's failure (Cancelled, or a bug) is reported to its request's own caller
        loop: DecodeLoop[_Job] = DecodeLoop(self.driver, self.max_batch, catch=True)
        while stop is None or not stop.is_set():
            if not loop.active:
                try:
                    job = self._jobs.get(timeout=None if stop is None else STOP_POLL_S)
                except queue.Empty:
                    continue
                loop.admit(job, job.decoder)
            while loop.room:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                loop.admit(job, job.decoder)
            size = len(loop.active)
            try:
                retired = loop.step()
            except Exception as e:  # the forward itself failed: every request in it fails
                retired = [(job, e) for job in loop.drop_all()]
            else:
                self.batch_sizes[size] += 1
            for job, error in retired:
                job.error = error
                job.done.set()
