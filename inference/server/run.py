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


def serve_app(app, *, host: str, port: int) -> bool:
    """Serve `app` (from `create_app`) until a signal stops it; False if it could not start listening."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
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
