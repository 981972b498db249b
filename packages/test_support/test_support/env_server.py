"""A bundle served as an OpenEnv env by agent-env's real server, in a subprocess a test starts and stops.

``serve_bundle`` runs ``build_app`` under uvicorn on a free loopback port, with every bit of its state (home, XDG
folders, local sandboxes, the agent-env config that registers ``local_tools``) in a temporary folder, and hands back
a ``ServedBundle``. That can count what the server holds open: episodes (runs not yet torn down), WebSocket sessions,
and local sandbox folders. On a clean exit it waits for all three to reach zero and raises ``LeftOpen`` if one
doesn't; on any exit it stops the server and every process it started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from .scripts import SAMPLE_BUNDLE

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
OPEN_ROUTE = "/test-support/open"
_STOP_SECONDS = 15.0


class ServerFailed(RuntimeError):
    """The env server exited, or wasn't ready in time; the message ends with its log."""


class LeftOpen(AssertionError):
    """Episodes, sessions or sandboxes were still open when they should all have closed."""


@dataclass(frozen=True)
class HeldOpen:
    """What the server holds open: episodes whose run isn't torn down, WebSocket sessions, local sandbox folders."""

    episodes: int
    sessions: int
    sandboxes: int

    def __bool__(self) -> bool:
        return bool(self.episodes or self.sessions or self.sandboxes)


@dataclass(frozen=True)
class ServedBundle:
    """A running env server: its ``url`` (``http://127.0.0.1:<port>``), the OpenEnv ``env_name`` its Task API
    answers to, and the folder holding its state and its log."""

    url: str
    env_name: str
    state_dir: Path
    process: subprocess.Popen = field(repr=False, compare=False)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def kill(self) -> None:
        """Kill the server and every process it started at once, as a node's crash would: no episode is torn down
        and no session is closed. Returns once the server is gone; ``serve_bundle`` then checks nothing at exit."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    @property
    def ws_url(self) -> str:
        """Where an episode's WebSocket connects."""
        return "ws" + self.url.removeprefix("http") + "/ws"

    @property
    def sandbox_dir(self) -> Path:
        return self.state_dir / "sandboxes"

    def open_episodes(self) -> int:
        """How many episodes the server is running: reset and neither ended nor torn down yet."""
        return self.held_open().episodes

    def open_sessions(self) -> int:
        """How many WebSocket sessions the server holds, each taking one of its ``max_concurrent_envs`` places."""
        return self.held_open().sessions

    def live_sandboxes(self) -> list[Path]:
        """The local sandbox folders not yet removed: one per episode of a task with a ``local_tools`` env."""
        return sorted(self.sandbox_dir.glob("agent-env-*")) if self.sandbox_dir.is_dir() else []

    def held_open(self) -> HeldOpen:
        """Everything the server holds open, read at once. Raises httpx.HTTPError when the server doesn't answer."""
        counts = httpx.get(self.url + OPEN_ROUTE, timeout=10).raise_for_status().json()
        return HeldOpen(counts["episodes"], counts["sessions"], len(self.live_sandboxes()))

    def wait_until_closed(self, timeout: float = 10.0) -> None:
        """Return once nothing is held open. Raises LeftOpen, saying what is still open, after ``timeout`` seconds:
        an abandoned episode takes a moment to tear down, one a client forgot never closes."""
        deadline = time.monotonic() + timeout
        while held := self.held_open():
            if time.monotonic() > deadline:
                raise LeftOpen(
                    f"the env server at {self.url} still holds {held.episodes} episode(s), "
                    f"{held.sessions} WebSocket session(s) and {held.sandboxes} sandbox folder(s) open "
                    f"after {timeout:g}s; a client didn't end or close an episode"
                )
            time.sleep(0.05)

    def tasks(self, split: str = "all") -> list[dict[str, Any]]:
        """The split's tasks as the Task API lists them, each with its ``name`` and ``index``."""
        listed = httpx.post(f"{self.url}/{self.env_name}/tasks", json={"split": split}, timeout=10)
        return listed.raise_for_status().json()["tasks"]

    def index_of(self, task_name: str, split: str = "all") -> int:
        """The index of the task named ``task_name`` in ``split``. Raises KeyError naming the split's tasks when it
        has none of that name."""
        tasks = self.tasks(split)
        for task in tasks:
            if task["name"] == task_name:
                return task["index"]
        raise KeyError(f"split {split!r} has no task {task_name!r}; it has {[task['name'] for task in tasks]}")


@contextmanager
def serve_bundle(
    bundle_dir: str | Path = SAMPLE_BUNDLE,
    *,
    max_concurrent_envs: int = 8,
    port: int = 0,
    ws_ping_s: float = 20.0,
    python: str | Path | None = None,
    startup_timeout: float = 120.0,
    close_timeout: float = 10.0,
) -> Iterator[ServedBundle]:
    """Serve ``bundle_dir`` (the sample bundle by default) with ``build_app`` in a subprocess on loopback at
    ``port`` (0: a free one; a killed server's port can serve again), and yield it once its Task API answers. It
    pings each WebSocket session every ``ws_ping_s`` seconds and closes one whose pong is ``ws_ping_s`` late, as
    uvicorn does by default every 20 s. The
    server runs on ``python``, by default the interpreter ENV_SERVER_PYTHON names, else this one: it needs
    agentenv-framework[openenv] and uvicorn, which a trainer's environment may lack.

    When the ``with`` body ends without an error and the server wasn't killed, it waits up to ``close_timeout``
    seconds for nothing to be held open and raises LeftOpen if something still is. Whatever happens, the server is
    then stopped, gracefully and then by force, with every process it started. Raises ServerFailed, with the
    server's log, when it exits or isn't ready within ``startup_timeout`` seconds, and FileNotFoundError when
    ``bundle_dir`` isn't a folder."""
    bundle = Path(bundle_dir).resolve()
    if not bundle.is_dir():
        raise FileNotFoundError(f"there is no bundle folder at {bundle}")
    interpreter = str(python or os.environ.get("ENV_SERVER_PYTHON") or sys.executable)
    with tempfile.TemporaryDirectory(prefix="test-support-env-", ignore_cleanup_errors=True) as state:
        state_dir = Path(state)
        port_file = state_dir / "port"
        with (state_dir / "server.log").open("wb") as log:
            process = subprocess.Popen(
                [
                    interpreter,
                    "-m",
                    "test_support._env_server_main",
                    str(bundle),
                    str(port_file),
                    str(max_concurrent_envs),
                    str(os.getpid()),
                    str(port),
                    str(ws_ping_s),
                ],
                env=_server_environment(state_dir),
                cwd=state_dir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            served = _ready(process, state_dir, port_file, startup_timeout)
            yield served
            if process.poll() is None:
                served.wait_until_closed(close_timeout)
        finally:
            _stop(process)


def _server_environment(state_dir: Path) -> dict[str, str]:
    """The server's environment: this one, with its home, XDG folders, temp folder and local sandboxes under
    ``state_dir``, an agent-env config registering ``local_tools``, and this package importable."""
    config = state_dir / "agent-env.toml"
    config.write_text('[envs]\nimpls = ["test_support.local_tools_env:LocalToolsEnv"]\n')
    folders = {
        name: state_dir / name.lower()
        for name in ("HOME", "XDG_STATE_HOME", "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME", "TMPDIR")
    }
    folders["AGENT_ENV_LOCAL_SANDBOX_DIR"] = state_dir / "sandboxes"
    for folder in folders.values():
        folder.mkdir()
    python_path = [str(PACKAGE_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {
        **os.environ,
        **{name: str(folder) for name, folder in folders.items()},
        "AGENT_ENV_CONFIG": str(config),
        "PYTHONPATH": os.pathsep.join(python_path),
    }


def _ready(process: subprocess.Popen, state_dir: Path, port_file: Path, timeout: float) -> ServedBundle:
    """The served bundle once its Task API lists its env. Raises ServerFailed when the process exits first or
    ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise ServerFailed(
                f"the env server exited with code {process.returncode} before it was ready; its log "
                f"ends:\n{_log_tail(state_dir)}"
            )
        if time.monotonic() > deadline:
            raise ServerFailed(f"the env server wasn't ready in {timeout:g}s; its log ends:\n{_log_tail(state_dir)}")
        if port_file.exists():
            url = f"http://127.0.0.1:{port_file.read_text()}"
            try:
                envs = httpx.get(url + "/list_environments", timeout=5).raise_for_status().json()
            except httpx.HTTPError:
                envs = None
            if envs:
                return ServedBundle(url=url, env_name=envs[0], state_dir=state_dir, process=process)
        time.sleep(0.1)


def _stop(process: subprocess.Popen) -> None:
    """Stop the server as its shutdown expects, which tears down open episodes, then kill whatever of its process
    group is left: a tool server its teardown missed, or the server itself if it hung."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(_STOP_SECONDS)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _log_tail(state_dir: Path, chars: int = 4000) -> str:
    try:
        return (state_dir / "server.log").read_text(errors="replace")[-chars:]
    except FileNotFoundError:
        return ""
