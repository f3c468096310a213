"""Running the server: HTTP (uvicorn) on a thread of its own, decoding on the thread that loaded the model.

Every torch op of a process should run on one thread: a second thread gets an OpenMP team of its own, and
with more team threads than cores the workers sleep between parallel regions instead of spinning (served
requests decoded at 0.78x the engine's in-process speed on a 2-core CPU while the scheduler had a thread of
its own). So the main thread, which loaded the model and measured its row cost, runs the scheduler's loop
(`Scheduler.run_here`), and uvicorn serves from another thread. SIGINT and SIGTERM ask uvicorn to stop; it
finishes the requests in flight (the scheduler decodes them meanwhile), and a second signal stops at once.
"""

from __future__ import annotations

import signal
import threading

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from inference.server_defaults import SERVER


class _HeadTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head has not arrived `header_timeout`
    seconds after the connection opened or the previous reply ended.

    uvicorn 0.54 arms no timer before a connection's first request, and its keep-alive timer stops at the
    first byte of the next: a client that connects and sends nothing, or half a request line, held its
    connection (and a file descriptor) for as long as it liked. The timer runs while h11 waits for a request
    head (`their_state` IDLE) and stops once one is whole, so a slow body, a long decode and a long stream are
    not touched; bytes that do not complete a head do not restart it."""

    header_timeout = SERVER.header_timeout_s
    _head_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_overdue)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # a whole head arrived (or a bad one was refused)
            self._stop_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start the next cycle and handle a pipelined head already here
        self._stop_head_timer()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_overdue)

    def connection_lost(self, exc) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_overdue(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()  # no reply: there is no request to answer (nginx and Apache do the same)


def http_protocol(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's `http` setting: h11 (whose connection states the timer reads) with this header timeout."""
    return type("HeadTimeoutH11", (_HeadTimeoutH11,), {"header_timeout": header_timeout})


def uvicorn_config(app, *, host: str, port: int, header_timeout: float, log_level: str = "warning"):
    """The uvicorn settings `serve_app` runs with (tests serve with them in a thread)."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=http_protocol(header_timeout))


def serve_app(app, *, host: str, port: int, header_timeout: float = SERVER.header_timeout_s) -> bool:
    """Serve `app` (from `create_app`) until a signal stops it; False if it could not start listening.
    `header_timeout`: seconds a connection may take to send a request head (see `_HeadTimeoutH11`)."""
    import uvicorn

    server = uvicorn.Server(uvicorn_config(app, host=host, port=port, header_timeout=header_timeout))
    stop = threading.Event()

    def run_http() -> None:
        try:
            server.run()
        except SystemExit:  # uvicorn's way out of a failed start (it logged why): `server.started` says so
            pass
        finally:
            stop.set()

    def on_signal(signum, frame) -> None:
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    app.state.scheduler.claim_here()  # before the first request can arrive
    http = threading.Thread(target=run_http, name="bdstack-http", daemon=True)
    http.start()
    try:
        app.state.scheduler.run_here(stop)
    finally:
        server.should_exit = True
        http.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return server.started
