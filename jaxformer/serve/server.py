"""Run the HTTP app with uvicorn: bind, serve, and on SIGTERM or Ctrl-C drain and exit.

    run(app, host="127.0.0.1", port=8000, drain_timeout=30.0)

On SIGTERM (or SIGINT) uvicorn stops accepting connections at once, lets the
requests in flight finish for up to `drain_timeout` seconds (streams included),
cancels what is left, then the app's lifespan stops the engine; `run` returns
normally, so the process exits 0.
"""

from __future__ import annotations

import signal
import threading
from typing import Optional


def run(app, *, host: str, port: int, drain_timeout: float = 30.0,
        log_level: str = "warning", ready_line: Optional[str] = None) -> None:
    """Serve `app` until a signal stops it (see the module docstring); `ready_line` is
    printed to stdout once the socket listens (a script can wait for it)."""
    import uvicorn  # noqa: PLC0415 - the `serve` extra

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if ready_line is not None and self.started:
                print(ready_line, flush=True)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=drain_timeout, access_log=False,
                            lifespan="on")
    server = Server(config)
    # uvicorn re-raises the signal that stopped it once it has shut down; SIGTERM's
    # default action would then kill the process (status -15) after a clean drain.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: None) if main_thread else None
    try:
        server.run()
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    if not server.started:  # the port was taken, or the lifespan failed: uvicorn said why
        raise OSError(f"could not serve on {host}:{port} (see uvicorn's message above)")
