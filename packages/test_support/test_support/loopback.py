"""An HTTP server on a free loopback port, run in a daemon thread, that answers each request with JSON.

The stand-in models (the scripted OpenAI model here, and the tiers' stand-ins for SGLang) are each one of these: a
subclass says how it answers a ``Request``, the one record of a request every stand-in keeps, and gets the server,
its address and its shutdown. It is the standard library's threaded server, so it runs in the dev environment and in
every trainer environment alike.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

HOST = "127.0.0.1"


@dataclass(frozen=True)
class Request:
    """One request: its method, its path (query included), its headers (names lower-cased), its body parsed as JSON
    (None when it isn't JSON), and the session it belongs to, which a stand-in names from what its wire format
    carries (``""`` as the server receives it)."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any
    session: str = ""

    @property
    def route(self) -> str:
        """The path without its query."""
        return self.path.split("?")[0]

    @property
    def messages(self) -> list[dict[str, Any]]:
        """A chat request's messages."""
        return self.body.get("messages", []) if isinstance(self.body, dict) else []

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        """A chat request's tools."""
        return self.body.get("tools") if isinstance(self.body, dict) else None

    @property
    def extra(self) -> dict[str, Any]:
        """A chat request's keys other than ``model``, ``messages`` and ``tools``: sampling settings and the like."""
        if not isinstance(self.body, dict):
            return {}
        return {key: value for key, value in self.body.items() if key not in ("model", "messages", "tools")}


class LoopbackServer:
    """Listens from construction until ``close()``; use it as a context manager. A subclass sets up its own state
    before calling ``__init__``, since requests may arrive as soon as it returns, and answers each request in
    ``respond``. A delay it waits through with ``sleep`` ends early once the server is closing."""

    def __init__(self, *, name: str):
        self._closing = threading.Event()
        self._server = _Server((HOST, 0), _Handler)
        self._server.owner = self
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name=name, daemon=True
        )
        self._thread.start()

    def respond(self, request: Request) -> tuple[int, Any] | tuple[int, Any, Mapping[str, str]]:
        """The status and payload answering ``request``: a string is sent as it is, anything else as JSON; and, as
        a third item when there are any, headers to send with them (e.g. ``Retry-After``)."""
        raise NotImplementedError

    def sleep(self, seconds: float) -> None:
        self._closing.wait(seconds)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    @property
    def host(self) -> str:
        return HOST

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


class _Server(ThreadingHTTPServer):
    """A thread per request, and a listen queue long enough for a benchmark's episodes all asking at once."""

    daemon_threads = True
    request_queue_size = 128
    owner: LoopbackServer


class _Handler(BaseHTTPRequestHandler):
    """Sends the headers and the body as they are written, Nagle's algorithm off: with it on, every answer on a
    kept-alive connection held its body until the client's delayed ACK of the headers, 40 ms later."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server: _Server

    def do_GET(self) -> None:
        self._respond()

    def do_POST(self) -> None:
        self._respond()

    def _respond(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        headers = {name.lower(): value for name, value in self.headers.items()}
        status, payload, *extra = self.server.owner.respond(Request(self.command, self.path, headers, body))
        data = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
        try:
            self.send_response(status)
            for name, value in (extra[0] if extra else {}).items():
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except ConnectionError:
            self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        pass
