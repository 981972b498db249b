"""A warehouse's tools as an MCP server, on the standard library alone, so an episode's tool server is up in a
blink rather than after the seconds the ``mcp`` package takes to import.

It speaks MCP's streamable-HTTP transport in its plain-JSON form: every JSON-RPC request POSTed to it is answered
with one JSON reply, a notification with 202, and it keeps no session. ``local_tools_env`` starts one per episode
as ``python tool_server.py PORT_FILE STOCK_JSON [ships]``: it binds a free loopback port, writes the port to
PORT_FILE once it listens, and serves until it is stopped. The warehouse starts with the crates STOCK_JSON maps to
their shelves; with ``ships``, once a crate was added its tools also list ``ship_crate``, so an episode's tools
change between its turns.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

NEW_CRATE_SHELF = "dock"

TOOLS = [
    {
        "name": "list_crates",
        "description": "The names of the crates in the warehouse, as a JSON list.",
        "inputSchema": {"type": "object", "properties": {}},
    },
    {
        "name": "find_crate",
        "description": "The shelf a crate is on.",
        "inputSchema": {
            "type": "object",
            "properties": {"name": {"type": "string", "description": "The crate's name."}},
            "required": ["name"],
        },
    },
    {
        "name": "add_crate",
        "description": "Add a crate to the warehouse. It is put on the loading dock.",
        "inputSchema": {
            "type": "object",
            "properties": {"name": {"type": "string", "description": "The new crate's name."}},
            "required": ["name"],
        },
    },
    {
        "name": "wait_for_truck",
        "description": "Wait at the loading dock until the delivery truck arrives, which takes the seconds given.",
        "inputSchema": {
            "type": "object",
            "properties": {"seconds": {"type": "number", "description": "How long the truck takes."}},
            "required": ["seconds"],
        },
    },
]


SHIP_CRATE = {
    "name": "ship_crate",
    "description": "Ship a crate out of the warehouse.",
    "inputSchema": {
        "type": "object",
        "properties": {"name": {"type": "string", "description": "The crate's name."}},
        "required": ["name"],
    },
}


class Warehouse:
    """The crates and their shelves; with ``ships``, ``ship_crate`` is among its tools once a crate was added. Tool
    calls arrive on the server's threads, so each holds the lock."""

    def __init__(self, stock: dict[str, str], *, ships: bool = False):
        self._shelves = dict(stock)
        self._lock = threading.Lock()
        self._ships = ships
        self._added = False

    def tools(self) -> list[dict[str, Any]]:
        """The tools the warehouse lists now."""
        with self._lock:
            return [*TOOLS, SHIP_CRATE] if self._ships and self._added else list(TOOLS)

    def call(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        """The text a tool call answers with, and whether it is an error: an unknown tool, or arguments it can't
        take. ``wait_for_truck`` sleeps outside the lock, so it stands for a tool that waits on I/O."""
        if name == "wait_for_truck":
            seconds = arguments.get("seconds")
            if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0:
                return f"wait_for_truck needs the seconds as a number of at least 0, not {seconds!r}", True
            time.sleep(seconds)
            return f"The truck arrived after {seconds:g} s.", False
        with self._lock:
            if name == "list_crates":
                return json.dumps(sorted(self._shelves)), False
            crate = arguments.get("name")
            if name not in ("find_crate", "add_crate", *(("ship_crate",) if self._ships and self._added else ())):
                return f"there is no tool {name!r}", True
            if not isinstance(crate, str) or not crate.strip():
                return f"{name} needs the crate's name as a non-empty string, not {crate!r}", True
            crate = crate.strip()
            if name == "find_crate":
                if crate not in self._shelves:
                    return f"there is no crate {crate!r}; the crates are {', '.join(sorted(self._shelves))}", True
                return f"The crate {crate!r} is on shelf {self._shelves[crate]}.", False
            if name == "ship_crate":
                if self._shelves.pop(crate, None) is None:
                    return f"there is no crate {crate!r} to ship", True
                return f"Shipped the crate {crate!r}.", False
            if crate in self._shelves:
                return f"there is already a crate {crate!r}", True
            self._shelves[crate] = NEW_CRATE_SHELF
            self._added = True
            return f"Added the crate {crate!r}; the warehouse holds {len(self._shelves)} crates.", False


def answer(warehouse: Warehouse, message: Any) -> dict[str, Any] | None:
    """The JSON-RPC reply to ``message``, or None for a notification, which gets none."""
    if not isinstance(message, dict) or message.get("jsonrpc") != "2.0" or "method" not in message:
        return _error(None, -32600, "not a JSON-RPC 2.0 request")
    if "id" not in message:
        return None
    method, params = message["method"], message.get("params") or {}
    if method == "initialize":
        return _result(
            message,
            {
                "protocolVersion": params.get("protocolVersion", "2025-06-18"),
                "capabilities": {"tools": {"listChanged": False}},
                "serverInfo": {"name": "warehouse", "version": "1"},
            },
        )
    if method == "ping":
        return _result(message, {})
    if method == "tools/list":
        return _result(message, {"tools": warehouse.tools()})
    if method == "tools/call":
        arguments = params.get("arguments") or {}
        if not isinstance(arguments, dict):
            return _error(message["id"], -32602, "arguments must be an object")
        text, is_error = warehouse.call(str(params.get("name")), arguments)
        return _result(message, {"content": [{"type": "text", "text": text}], "isError": is_error})
    return _error(message["id"], -32601, f"there is no method {method!r}")


def _result(message: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": message["id"], "result": result}


def _error(request_id: Any, code: int, text: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": text}}


def _handler(warehouse: Warehouse) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                message = json.loads(body)
            except ValueError:
                self._send(HTTPStatus.BAD_REQUEST, _error(None, -32700, "the body is not JSON"))
                return
            reply = answer(warehouse, message)
            if reply is None:
                self._send(HTTPStatus.ACCEPTED, None)
            else:
                self._send(HTTPStatus.OK, reply)

        def do_GET(self) -> None:
            self._send(HTTPStatus.METHOD_NOT_ALLOWED, None, allow="POST")

        def do_DELETE(self) -> None:
            self._send(HTTPStatus.METHOD_NOT_ALLOWED, None, allow="POST")

        def _send(self, status: HTTPStatus, reply: dict[str, Any] | None, *, allow: str | None = None) -> None:
            data = b"" if reply is None else json.dumps(reply).encode()
            self.send_response(status)
            if allow:
                self.send_header("Allow", allow)
            if reply is not None:
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


def main(port_file: str, stock: str, ships: str = "") -> None:
    """Serve the warehouse stocked with ``stock`` (JSON) until stopped, once the port is in ``port_file``; it lists
    ``ship_crate`` once a crate was added when ``ships`` is ``ships``."""
    warehouse = Warehouse(json.loads(stock), ships=ships == "ships")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(warehouse))
    server.daemon_threads = True
    written = f"{port_file}.partial"
    with open(written, "w") as out:
        out.write(str(server.server_address[1]))
    os.replace(written, port_file)
    server.serve_forever()


if __name__ == "__main__":
    main(*sys.argv[1:])
