"""Run the HTTP app with uvicorn: bind, serve, and on SIGTERM or Ctrl-C drain and exit.

    run(app, host="127.0.0.1", port=8000, drain_timeout=30.0)

On SIGTERM (or SIGINT) uvicorn stops accepting connections at once, lets the
requests in flight finish for up to `drain_timeout` seconds (streams included),
then `on_drain_timeout` ends what is left (the HTTP app's `end_open_requests`: an
error event ends each stream, whole), uvicorn cancels what still has not finished
`END_GRACE_S` later, and the app's lifespan stops the engine; `run` returns
normally, so the process exits 0.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from typing import Callable, Optional

# Seconds the requests ended at the drain timeout have to send their last bytes before
# uvicorn cancels them (only a client that reads nothing holds the shutdown that long).
END_GRACE_S = 3.0


def run(app, *, host: str, port: int, drain_timeout: float = 30.0,
        log_level: str = "warning", ready_line: Optional[str] = None,
        on_drain_timeout: Optional[Callable[[], None]] = None) -> None:
    """Serve `app` until a signal stops it (see the module docstring); `ready_line` is
    printed to stdout once the socket listens (a script can wait for it);
    `on_drain_timeout` is called on the event loop once a shutdown's drain timeout
    has passed."""
    import uvicorn  # noqa: PLC0415 - the `serve` extra

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if ready_line is not None and self.started:
                print(ready_line, flush=True)

        async def shutdown(self, sockets=None):
            if on_drain_timeout is not None:
                asyncio.get_running_loop().call_later(drain_timeout, on_drain_timeout)
            await super().shutdown(sockets)

    grace = END_GRACE_S if on_drain_timeout is not None else 0.0
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=drain_timeout + grace,
                            access_log=False, lifespan="on")
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
