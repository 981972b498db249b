"""The process ``serve_bundle`` starts: agent-env's ``build_app`` over a bundle, served by uvicorn on a free loopback
port, plus one route, ``GET /test-support/open``, saying how many episodes and WebSocket sessions it holds open.

Run as ``python -m test_support._env_server_main BUNDLE PORT_FILE MAX_CONCURRENT_ENVS PARENT_PID PORT PING_S``
(PORT 0: a free one). The port is written to PORT_FILE once the socket listens; the Task API answers once the app
has started. PING_S is uvicorn's WebSocket keepalive: a ping to each session every PING_S seconds, the session
closed when its pong is PING_S seconds late. The server shuts down by itself once PARENT_PID is no longer its parent.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import uvicorn
from agent_env.openenv import build_app
from agent_env.task.episode import run as episodes
from fastapi import FastAPI
from openenv.core.env_server.http_server import HTTPEnvServer

from .env_server import OPEN_ROUTE


def main(bundle: str, port_file: str, max_concurrent_envs: str, parent_pid: str, port: str, ping_s: str) -> None:
    _stop_when_orphaned(int(parent_pid))
    app = build_app(Path(bundle), max_concurrent_envs=int(max_concurrent_envs))
    sessions = _env_server(app)

    def held_open() -> dict[str, int]:
        # An episode stays in agent-env's table of live runs until its teardown is over, tool servers and all.
        return {"episodes": len(episodes._live), "sessions": sessions.active_sessions}

    app.add_api_route(OPEN_ROUTE, held_open, methods=["GET"])
    listening = socket.create_server(("127.0.0.1", int(port)))
    partial = f"{port_file}.partial"
    Path(partial).write_text(str(listening.getsockname()[1]))
    os.replace(partial, port_file)
    config = uvicorn.Config(app, log_level="warning", ws_ping_interval=float(ping_s), ws_ping_timeout=float(ping_s))
    uvicorn.Server(config).run(sockets=[listening])


def _stop_when_orphaned(parent_pid: int) -> None:
    """Shut down, as SIGTERM has uvicorn do, once the process that started this one is gone. It started it in a
    session of its own, which no signal to its own process group reaches, so a caller killed outright would
    otherwise leave this server running."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


def _env_server(app: FastAPI) -> HTTPEnvServer:
    """The OpenEnv server behind ``app``'s ``/ws`` route, which holds its sessions: ``create_app`` keeps it only
    there, in the route's closure."""
    for route in app.router.routes:
        if getattr(route, "path", None) == "/ws":
            for cell in route.endpoint.__closure__ or ():
                if isinstance(cell.cell_contents, HTTPEnvServer):
                    return cell.cell_contents
    raise RuntimeError("build_app's /ws route no longer holds OpenEnv's HTTPEnvServer; count sessions another way")


if __name__ == "__main__":
    main(*sys.argv[1:])
