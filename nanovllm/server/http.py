"""uvicorn, run so that stopping it never loses a request: the stop request comes from a ``threading.Event``
(``STOP.event`` of ``nanovllm.harness.interrupt`` for the command line, so SIGINT / SIGTERM are handled once,
by the same handlers as ``python -m nanovllm.run``), and on shutdown the engine's requests are ended (aborted,
reason ``interrupted``, their streams closed with that finish reason) before uvicorn waits for the connections
to close. ``start_in_thread`` runs a server beside the caller (tests, benchmarks)."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import uvicorn

from nanovllm.server.app import ServerState, create_app

# Seconds uvicorn waits for open connections once the engine has ended every request (their last chunks are
# on their way by then; a client that reads nothing more must not hold the process).
GRACEFUL_CLOSE_S = 5


class HTTPServer(uvicorn.Server):
    """A ``uvicorn.Server`` for one ``ServerState``; it stops when ``stop`` is set or ``should_exit`` is, and with
    ``stop_on_fault`` when the engine loop has failed (it would refuse everything from then on: the command line
    exits with an error; a server in a thread stays up, answering 503, until its owner stops it)."""

    def __init__(self, config: uvicorn.Config, state: ServerState, stop: threading.Event | None = None,
                 announce: bool = False, stop_on_fault: bool = True) -> None:
        super().__init__(config)
        self.state = state
        self.stop_event = stop or threading.Event()
        self.stop_on_fault = stop_on_fault
        self.announce = announce  # print the URL once listening (the command line; port 0 shows the real one)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The process's own handlers (STOP) stay in charge: they set stop_event, which on_tick watches.
        yield

    async def startup(self, sockets=None) -> None:  # type: ignore[no-untyped-def]
        await super().startup(sockets)
        if self.started and self.announce:
            print(f"nano-vllm: serving {self.state.model_name!r} at http://{self.config.host}:{self.port}/v1 "
                  "(Ctrl-C or SIGTERM to stop)", flush=True)

    async def on_tick(self, counter: int) -> bool:
        loop = self.state.engine_loop
        if self.stop_event.is_set() or (self.stop_on_fault and loop is not None and loop.fault is not None):
            self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets=None) -> None:  # type: ignore[no-untyped-def]
        for server in self.servers:  # no new connection while the requests in flight are ended
            server.close()
        await self.state.stop()
        await super().shutdown(sockets)

    @property
    def port(self) -> int | None:
        """The port it listens on (useful with ``port=0``), once started."""
        for server in self.servers:
            for sock in server.sockets:
                return sock.getsockname()[1]
        return None


def uvicorn_config(state: ServerState, host: str, port: int, log_level: str = "info") -> uvicorn.Config:
    """uvicorn's settings for our app: one process, HTTP/1.1 (h11), the asyncio loop, no access log per request
    (at hundreds of requests a second it would cost the engine CPU time)."""
    return uvicorn.Config(create_app(state), host=host, port=port, log_level=log_level, access_log=False,
                          timeout_graceful_shutdown=GRACEFUL_CLOSE_S, loop="asyncio", http="h11", lifespan="on")


@dataclass
class RunningServer:
    """A server started by ``start_in_thread``: its URL, and ``stop()`` (ends its requests, joins the thread)."""

    server: HTTPServer
    thread: threading.Thread

    @property
    def url(self) -> str:
        return f"http://{self.server.config.host}:{self.server.port}"

    def stop(self, timeout: float = 60.0) -> None:
        self.server.stop_event.set()
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise RuntimeError(f"the server at {self.url} did not stop within {timeout} s")


def start_in_thread(state: ServerState, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                    timeout: float = 60.0) -> RunningServer:
    """Serve ``state`` from a thread of this process (port 0: a free one); returns once it accepts connections."""
    server = HTTPServer(uvicorn_config(state, host, port, log_level), state, stop_on_fault=False)
    thread = threading.Thread(target=server.run, name="nanovllm-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the server on {host}:{port} did not start within {timeout} s"
                               f"{'' if thread.is_alive() else ' (it exited; see its log)'}")
        time.sleep(0.01)
    return RunningServer(server, thread)
